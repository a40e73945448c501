"""Cost of the telemetry primitives on the per-batch hot path.

Measures ns per counter increment, gauge set, histogram observe and boundary
record (with its two perf_counter reads), counts how many of those the device
feed makes per batch, and prints the share of a batch's time they take
against the target (<= 2%); then the loader's cost per batch with its telemetry on vs off (wait,
step, production, depth, stall attribution, per-open tier attribution), on warm decoded local shards,
against issue 17's target (<= 3% per batch with no step), two ways, each row on and off side by side:
- fresh loaders: each round times a new Loader with telemetry on and one with it off (the order
  swapped every other round), with no step and a 2 ms step; medians of the rounds with the spread
  (min-max) and of the per-round on/off ratio;
- steady state: one Loader with telemetry on and one with it off, alive side by side in this
  process, read in alternating chunks of batches; CPU us per batch (process_time) of each chunk and
  the on/off ratio of each adjacent pair of chunks, which cancels the drift a shared machine's load
  puts between rounds. This is the figure the target is judged on; 300 pairs, so that one run's median
  moves little with the machine's load (runs of 100 disagreed by a point or more). Beside it, the ratio
  of the two loaders' total CPU, which counts each flush of the records (one per 512 batches) in full.
`--opcodes` instead counts the Python opcodes per batch each function runs (sys.settrace), telemetry on
vs off: exact on a noisy machine, and it names where the per-batch work is.
Run: .venv/bin/python benchmarks/telemetry.py [--opcodes]
"""

from __future__ import annotations

import collections
import json
import statistics
import sys
import tempfile
import time
import timeit
from pathlib import Path
from typing import Any
from collections.abc import Callable

import numpy as np
import torch

import tierflow
from tierflow.loader import Loader
from tierflow.tiers import TierConfig
from tierflow.loader.device_feed import DeviceFeed
from tierflow.commands.bench import steps_per_second
from tierflow.telemetry.metrics import MetricsRegistry
from _harness import round_order, spread
from warm import remove_l1, warm_dataset, warm_l1

REPEATS = 5
NUMBER = 200_000
LOADER_BATCH = 8
LOADER_SEQ_LEN = 1024


def ns_per_op(statement: str, namespace: dict) -> tuple[float, float]:
    """Best and median of REPEATS runs, in ns per operation."""
    runs = timeit.repeat(statement, globals=namespace, number=NUMBER, repeat=REPEATS)
    empty = min(timeit.repeat("pass", number=NUMBER, repeat=REPEATS))
    per_op = sorted((run - empty) / NUMBER * 1e9 for run in runs)
    return per_op[0], per_op[len(per_op) // 2]


def feed_ops_per_batch() -> dict[str, float]:
    """Metric updates the device feed makes per batch of 5 arrays, staged as on a GPU."""
    rng = np.random.default_rng(0)
    batches = [
        {
            "input_ids": rng.integers(0, 2**16, (8, 2048), dtype=np.uint16),
            "labels": rng.integers(0, 2**16, (8, 2048), dtype=np.uint16),
            "position_ids": np.zeros((8, 2048), dtype=np.int32),
            "cu_seqlens": np.zeros(17, dtype=np.int32),
            "loss_mask": np.ones((8, 2048), dtype=bool),
            "step": i,
        }
        for i in range(50)
    ]
    widen = {"input_ids": torch.int64, "labels": torch.int64, "position_ids": torch.int64}
    feed = DeviceFeed(batches, "cpu", staged=True, widen=widen)
    started = time.perf_counter()
    for _ in feed:
        pass
    per_batch_s = (time.perf_counter() - started) / len(batches)
    stats = feed.stats()
    # each copy counter touched this run is updated once per batch (the feed tallies a batch first)
    touched = sum(
        1
        for m in feed.registry.metrics()
        if m.kind == "counter" and m.value and m.name != "tierflow_feed_batches_total"
    )
    counter_ops = (touched + 1) * stats.batches
    histogram_ops = sum(h.count for h in feed.registry.metrics() if h.kind == "histogram")
    return {
        "counter": counter_ops / stats.batches,
        "boundary": histogram_ops / stats.batches,
        "feed_batch_s": per_batch_s,
    }


def main() -> None:
    registry = MetricsRegistry({"job": "bench", "node": "n0", "rank": 0})
    namespace = {
        "counter": registry.counter("tierflow_bench_total", {"tier": "L1"}),
        "gauge": registry.gauge("tierflow_bench_bytes", {"tier": "L1"}),
        "histogram": registry.histogram("tierflow_bench_seconds", {"tier": "L1"}),
        "boundary": registry.boundary("bench"),
        "perf_counter": time.perf_counter,
    }
    costs = {
        "counter.inc()": ns_per_op("counter.inc()", namespace),
        "counter.inc(4096)": ns_per_op("counter.inc(4096)", namespace),
        "gauge.set(v)": ns_per_op("gauge.set(12345)", namespace),
        "histogram.observe(v)": ns_per_op("histogram.observe(0.00123)", namespace),
        "boundary: 2 clock reads + observe": ns_per_op(
            "t = perf_counter(); boundary.blocked_get(perf_counter() - t)", namespace
        ),
    }
    print("telemetry primitive cost (ns per op, best / median of 5)")
    print(f"{'operation':<36}{'best':>8}{'median':>8}")
    for name, (best, median) in costs.items():
        print(f"{name:<36}{best:8.0f}{median:8.0f}")

    ops = feed_ops_per_batch()
    per_batch_ns = (
        ops["counter"] * costs["counter.inc(4096)"][1] + ops["boundary"] * costs["boundary: 2 clock reads + observe"][1]
    )
    print()
    print(
        f"device feed, staged, 5 arrays/batch: {ops['counter']:.0f} counter ops + {ops['boundary']:.0f} boundary records per batch"
    )
    print(f"telemetry cost per batch: {per_batch_ns / 1000:.1f} us (median costs)")
    print()
    print(f"{'batch time':<28}{'telemetry share':>16}{'target':>8}{'met':>6}")
    rows = [
        ("2 ms step", 2e-3),
        ("10 ms step", 10e-3),
        ("50 ms step", 50e-3),
        (f"feed alone on CPU ({ops['feed_batch_s'] * 1e6:.0f} us)", ops["feed_batch_s"]),
    ]
    for label, seconds in rows:
        share = per_batch_ns * 1e-9 / seconds
        print(f"{label:<28}{share:16.3%}{'2%':>8}{'yes' if share <= 0.02 else 'NO':>6}")


def warm_token_dataset(root: Path) -> tuple[Path, TierConfig]:
    """A packed token dataset and its shards decoded next to it (the warm cache)."""
    rng = np.random.default_rng(0)
    with open(root / "docs.jsonl", "w") as f:
        for _ in range(6000):
            n = int(rng.integers(100, 3000))
            f.write(json.dumps({"text": "".join(chr(97 + c) for c in rng.integers(0, 26, n))}) + "\n")
    tierflow.pack([root / "docs.jsonl"], root / "ds", tokenizer="bytes", workers=1, target_shard_bytes=4 << 20)
    return root / "ds", warm_l1(root / "ds")


def timed_round(path: Path, l1: TierConfig, telemetry: bool, batches: int, step_s: float) -> float:
    """Batches/s of a loop with a `step_s` sleep, timed from the first batch (start-up excluded)."""
    dataset = warm_dataset(path, l1, batch_size=LOADER_BATCH, seq_len=LOADER_SEQ_LEN, partitions=4)
    loader = Loader(dataset, "cpu", telemetry=telemetry, endless=True)
    try:
        return steps_per_second(loader, batches, step_s)[0]
    finally:
        loader.close()


def loader_on_vs_off(rounds: int = 9, chunks: int = 300, chunk_batches: int = 200) -> None:
    """The loader with telemetry on (the default) and off: fresh loaders per round, then the steady state."""
    plan = {0.0: 3000, 0.002: 400}
    with tempfile.TemporaryDirectory() as tmp:
        path, l1 = warm_token_dataset(Path(tmp))
        try:
            on_vs_off(path, l1, plan, rounds)
            steady_on_vs_off(path, l1, chunks, chunk_batches)
        finally:
            remove_l1(l1)


def on_vs_off(path: Path, l1: TierConfig, plan: dict[float, int], rounds: int) -> None:
    """Each round runs on then off (order swapped every other round, so a drift in machine load
    favours neither); the per-round on/off ratio cancels slow drifts that medians alone keep."""
    timed_round(path, l1, True, 50, 0.0)  # warm page cache and imports
    print()
    print(
        f"fresh loaders: telemetry on (default) vs Loader(telemetry=False); warm decoded local shards, "
        f"batch {LOADER_BATCH} x {LOADER_SEQ_LEN + 1} tokens, main process; {rounds} alternating rounds; "
        f"median (min-max)"
    )
    print(
        f"{'step ms':>7} {'batches':>7} {'on batches/s':>24} {'off batches/s':>24} {'on/off per round':>24} "
        f"{'cost':>6} {'on us/b':>8} {'off us/b':>9} {'<=3%':>5}"
    )
    for step_s, batches in plan.items():
        rates: dict[bool, list[float]] = {True: [], False: []}
        ratios = []
        for r in range(rounds):
            got = {on: timed_round(path, l1, on, batches, step_s) for on in round_order(r, (True, False))}
            for on, rate in got.items():
                rates[on].append(rate)
            ratios.append(got[True] / got[False])
        cost = 1 - statistics.median(ratios)
        print(
            f"{step_s * 1e3:>7.0f} {batches:>7} {spread(rates[True], '.0f'):>24} "
            f"{spread(rates[False], '.0f'):>24} {spread(ratios, '.3f'):>24} {cost:>6.1%} "
            f"{1e6 / statistics.median(rates[True]):>8.1f} {1e6 / statistics.median(rates[False]):>9.1f} "
            f"{'yes' if cost <= 0.03 else 'NO':>5}"
        )
    print("cost = 1 - median per-round on/off ratio; with no step it is the worst case (the loop is all loader)")


def steady_on_vs_off(path: Path, l1: TierConfig, chunks: int, chunk_batches: int) -> None:
    """CPU per batch of a Loader with telemetry on and one with it off, both alive, read in alternating
    chunks (the order swapped every other chunk); no step, so the loop is all loader."""
    loaders = {
        on: Loader(
            warm_dataset(path, l1, batch_size=LOADER_BATCH, seq_len=LOADER_SEQ_LEN, partitions=4),
            "cpu",
            telemetry=on,
            endless=True,
        )
        for on in (True, False)
    }
    try:
        batches = {on: iter(loader) for on, loader in loaders.items()}
        for it in batches.values():
            for _ in range(500):  # past start-up, the feed's inline/thread decision and a first flush
                next(it)
        per_batch: dict[bool, list[float]] = {True: [], False: []}
        ratios, extra = [], []
        for c in range(chunks):
            got = {}
            for on in round_order(c, (True, False)):
                it = batches[on]
                started = time.process_time()
                for _ in range(chunk_batches):
                    next(it)
                got[on] = (time.process_time() - started) / chunk_batches
                per_batch[on].append(got[on])
            ratios.append(got[True] / got[False])
            extra.append(got[True] - got[False])
    finally:
        for loader in loaders.values():
            loader.close()
    cost = statistics.median(ratios) - 1
    quartiles = statistics.quantiles(ratios, n=4)
    totals = sum(per_batch[True]) / sum(per_batch[False]) - 1
    print()
    print(
        f"steady state: a Loader with telemetry on and one with it off side by side, no step, {chunks} alternating "
        f"chunks of {chunk_batches} batches; CPU us per batch, median (min-max)"
    )
    print(
        f"{'on us/batch':>24} {'off us/batch':>24} {'on - off us':>22} {'on/off per chunk pair':>26} "
        f"{'(p25-p75)':>15} {'cost':>6} {'<=3%':>5} {'totals':>7}"
    )
    print(
        f"{spread(per_batch[True], '.1f', 1e6):>24} {spread(per_batch[False], '.1f', 1e6):>24} "
        f"{spread(extra, '.1f', 1e6):>22} {spread(ratios, '.3f'):>26} "
        f"{f'({quartiles[0]:.3f}-{quartiles[2]:.3f})':>15} {cost:>6.1%} {'yes' if cost <= 0.03 else 'NO':>5} "
        f"{totals:>7.1%}"
    )
    print(
        "cost = median per-chunk-pair on/off ratio - 1 (issue 17's target: <= 3%); totals = on CPU / off CPU - 1 "
        "over all chunks"
    )


def opcode_tracer(counted: collections.Counter[str]) -> Callable[[Any, str, Any], Any]:
    """A `sys.settrace` function that counts every Python opcode run into `counted`, by file:function."""

    def trace(frame: Any, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        where = f"{frame.f_code.co_filename.rsplit('/src/', 1)[-1]}:{frame.f_code.co_name}"

        def opcode(frame: Any, event: str, arg: Any) -> Any:
            if event == "opcode":
                counted[where] += 1
            return opcode

        return opcode

    return trace


def opcodes_on_vs_off(batches: int = 512, top: int = 8) -> None:
    """Python opcodes per batch, telemetry on minus off, over `batches` warm batches (no step, background
    thread off: the trace would slow the loop past the feed's automatic choice)."""
    counts: dict[bool, collections.Counter[str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path, l1 = warm_token_dataset(Path(tmp))
        try:
            for on in (True, False):
                dataset = warm_dataset(path, l1, batch_size=LOADER_BATCH, seq_len=LOADER_SEQ_LEN, partitions=4)
                with Loader(dataset, "cpu", telemetry=on, endless=True, background=False) as loader:
                    it = iter(loader)
                    for _ in range(300):
                        next(it)
                    counts[on] = collections.Counter()
                    sys.settrace(opcode_tracer(counts[on]))
                    try:
                        for _ in range(batches):
                            next(it)
                    finally:
                        sys.settrace(None)
        finally:
            remove_l1(l1)
    on, off = counts[True], counts[False]
    print(
        f"Python opcodes per batch, {batches} warm batches, no step: on {sum(on.values()) / batches:.0f}, "
        f"off {sum(off.values()) / batches:.0f}, on - off {(sum(on.values()) - sum(off.values())) / batches:.0f}"
    )
    for where in sorted(set(on) | set(off), key=lambda w: off[w] - on[w])[:top]:
        print(f"{(on[where] - off[where]) / batches:>8.1f}  {where}")


if __name__ == "__main__":
    if "--opcodes" in sys.argv[1:]:
        opcodes_on_vs_off()
    else:
        main()
        loader_on_vs_off()
