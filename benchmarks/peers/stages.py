"""Where a raw batch's CPU time goes, stage by stage, in the main process (issue 17's "How").

One epoch of the peers' packed tokens and documents through `tierflow.open_loader` at its
defaults (no workers, no step), each stage's calls wrapped with this thread's CPU clock
(`time.thread_time`, so other processes on a busy machine do not count): the order's plan, block
decode (read, verify, decompress, validate), the copy of token windows, the document segments,
the rows of a text batch (the columns of a run of them, on the main process's path: str made from
the blocks' UTF-8), the device feed's host conversion; "the rest" is the loop's CPU time
less the stages (Loader, TimedBatches, telemetry, carrying the meta). A fresh loader per round,
rounds alternating tokens and text; medians (min-max) of the rounds in us a batch. The wrappers
cost ~1 us a wrapped call, counted in the stage they wrap. Reads run.py's packed datasets
(make bench-peers ARGS="--only raw" builds them).

    .venv/bin/python benchmarks/peers/stages.py [--work /tmp/tierflow-peers/full] [--rounds 5]
"""

from __future__ import annotations

import argparse
import collections
import functools
import sys
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable

import tierflow
from tierflow.format import table
from tierflow.format.reads import TokenReader
from tierflow.loader import batching, device_feed, plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _harness import spread

SPENT: collections.Counter[str] = collections.Counter()
_ACTIVE: list[str] = []
STAGES: list[str] = []
"""The stages `timed` wraps, in the order they were named (the table's rows)."""


def timed(owner: Any, name: str, stage: str) -> None:
    """Wrap `owner.name` so its CPU time counts to `stage`, less what nested stages took."""
    inner: Callable[..., Any] = getattr(owner, name)
    if stage not in STAGES:
        STAGES.append(stage)

    @functools.wraps(inner)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.thread_time()
        _ACTIVE.append(stage)
        try:
            return inner(*args, **kwargs)
        finally:
            _ACTIVE.pop()
            spent = time.thread_time() - started
            SPENT[stage] += spent
            if _ACTIVE:
                SPENT[_ACTIVE[-1]] -= spent

    setattr(owner, name, wrapper)


def instrument() -> list[str]:
    timed(plan.TrainStream, "batch", "plan (order ids of the batch)")
    timed(table.LazyShardTable, "_load", "decode blocks (read, xxh3, zstd, validate)")
    timed(TokenReader, "copy_windows", "copy token windows")
    timed(batching, "window_segments", "segments (cu_seqlens, position_ids)")
    timed(batching, "_rows", "rows of a text batch (str, dicts)")
    timed(batching, "_run_columns", "columns of a text run (str, lists)")
    timed(batching, "collate_samples", "collate")
    timed(device_feed.DeviceFeed, "_convert", "device feed host conversion")
    return STAGES


def epoch(data: Path, kind: str) -> tuple[dict[str, float], float, int]:
    SPENT.clear()
    shape = {"seq_len": 2048} if kind == "tokens" else {}
    loader = tierflow.open_loader(data, batch_size=8, num_workers=0, seed=17, **shape)
    started, batches = time.thread_time(), 0
    for _ in loader:
        batches += 1
    total = time.thread_time() - started
    loader.close()
    return {k: v / batches for k, v in SPENT.items()}, total / batches, batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="/tmp/tierflow-peers/full")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    stages = instrument()
    datasets = {
        "tokens": Path(args.work) / "data" / "tierflow-tokens",
        "text": Path(args.work) / "data" / "tierflow-docs",
    }
    runs: dict[str, list[tuple[dict[str, float], float, int]]] = {kind: [] for kind in datasets}
    for number in range(args.rounds):
        for kind in list(datasets) if number % 2 == 0 else list(datasets)[::-1]:
            runs[kind].append(epoch(datasets[kind], kind))
    print(f"CPU us a batch (batch 8, main process, defaults), medians of {args.rounds} rounds (min-max)\n")
    print("| stage | " + " | ".join(datasets) + " |")
    print("|---|" + "---|" * len(datasets))
    for stage in stages + ["the rest (Loader, TimedBatches, telemetry, meta)", "whole batch"]:
        cells = []
        for kind in datasets:
            per_round = []
            for spent, total, _ in runs[kind]:
                if stage == "whole batch":
                    per_round.append(total)
                elif stage.startswith("the rest"):
                    per_round.append(total - sum(spent.values()))
                else:
                    per_round.append(spent.get(stage, 0.0))
            cells.append(spread([v * 1e6 for v in per_round], ".0f") if any(per_round) else "-")
        print(f"| {stage} | " + " | ".join(cells) + " |")
    print("\nbatches an epoch: " + ", ".join(f"{kind} {runs[kind][0][2]}" for kind in datasets))


if __name__ == "__main__":
    main()
