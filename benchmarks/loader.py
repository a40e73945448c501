"""Loader benchmark: a training loop fed by tierflow against the same batches preloaded in RAM.

The dry run (DESIGN.md) is the bound: the same step driven by the same batches already in memory.
Rounds alternate tierflow / dry run; each figure is the median of the rounds with its spread
(min-max). Timing starts when the first batch has arrived (start-up is reported on its own).
Also the raw loader speed with no step: samples/s, wall us and CPU us per batch (main process
plus DataLoader workers, from getrusage after the workers have exited).

    .venv/bin/python benchmarks/loader.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

import tierflow
from tierflow.format.dataset import ShardTable
from tierflow.format.shard import ShardInfo, decode_shard
from tierflow.loader import Loader, TieredDataset

SEQ_LEN = 2048
BATCH = 8


def make_dataset(root: Path, tokens: int) -> str:
    rng = np.random.default_rng(0)
    source = root / "docs.jsonl"
    written = 0
    with open(source, "w") as f:
        while written < tokens:
            n = int(rng.integers(200, 4000))
            f.write(json.dumps({"text": "".join(chr(97 + c) for c in rng.integers(0, 26, n))}) + "\n")
            written += n + 1
    tierflow.pack([source], root / "ds", tokenizer="bytes", workers=1, target_shard_bytes=4 << 20)
    return str(root / "ds")


class WarmL1Source:
    """Stand-in for a warm L1 until the tier stack lands: decoded shards, memory-mapped, opened once."""

    def __init__(self, decoded: Path) -> None:
        self.decoded = decoded
        self._open: dict[int, ShardTable] = {}

    def open_shard(self, index: int, info: ShardInfo) -> ShardTable:
        table = self._open.get(index)
        if table is None:
            table = self._open[index] = ShardTable.from_ipc_file(self.decoded / info.name, memory_map=True)
        return table


def warm_l1(path: str) -> Path:
    decoded = Path(path).parent / "l1"
    decoded.mkdir(exist_ok=True)
    for info in tierflow.Manifest.load(path).shards:
        decode_shard(Path(path) / info.name, decoded / info.name)
    return decoded


def dataset(path: str) -> TieredDataset:
    decoded = Path(path).parent / "l1"
    return TieredDataset(path, batch_size=BATCH, seq_len=SEQ_LEN, partitions=8,
                         shard_source_factory=lambda: WarmL1Source(decoded))


def run_loop(batches, steps: int, step_s: float) -> tuple[float, float]:
    """(steps/s after the first batch, seconds to the first batch)."""
    started = time.perf_counter()
    iterator = iter(batches)
    next(iterator)
    first = time.perf_counter() - started
    begin = time.perf_counter()
    done = 0
    for _ in iterator:
        if step_s:
            time.sleep(step_s)
        done += 1
        if done == steps:
            break
    return done / (time.perf_counter() - begin), first


def tierflow_round(path: str, workers: int, steps: int, step_s: float,
                   background: bool | None = None) -> tuple[float, float]:
    loader = Loader(dataset(path), device="cpu", num_workers=workers, background=background)
    try:
        return run_loop(loader, steps, step_s)
    finally:
        loader.close()


def preload(path: str, count: int) -> list:
    loader = Loader(dataset(path), device="cpu")
    batches = []
    for batch in loader:
        batches.append({k: (v.clone() if hasattr(v, "clone") else v) for k, v in batch.items()})
        if len(batches) == count:
            break
    loader.close()
    return batches


def raw_speed(path: str, workers: int, batches: int, background: bool | None = None) -> dict[str, float]:
    self_before = resource.getrusage(resource.RUSAGE_SELF)
    kids_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    loader = Loader(dataset(path), device="cpu", num_workers=workers, background=background)
    iterator = iter(loader)
    next(iterator)
    begin = time.perf_counter()
    for n, _ in enumerate(iterator, 1):
        if n == batches:
            break
    wall = time.perf_counter() - begin
    loader.close()
    self_after = resource.getrusage(resource.RUSAGE_SELF)
    kids_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = sum(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
              for before, after in ((self_before, self_after), (kids_before, kids_after)))
    return {"samples_per_s": batches * BATCH / wall, "us_per_batch": wall / batches * 1e6,
            "cpu_us_per_batch": cpu / (batches + 1) * 1e6}


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):8.1f} ({min(values):.1f}-{max(values):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and steps")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--feed-thread", action="store_true",
                        help="with workers, receive batches on the device feed's thread (Loader(background=True))")
    args = parser.parse_args()
    background = True if args.feed_thread else None
    rounds = 1 if args.quick else args.rounds
    plan = {0.002: 150, 0.010: 60, 0.050: 16}
    if args.quick:
        plan = {k: max(8, v // 3) for k, v in plan.items()}
    with tempfile.TemporaryDirectory() as tmp:
        path = make_dataset(Path(tmp), 24 << 20)
        warm_l1(path)
        preloaded = preload(path, max(plan.values()) + 2)
        print(f"dataset: {tierflow.open_dataset(path)!r}; batch {BATCH} x {SEQ_LEN + 1} tokens (uint16)")
        print(f"{'workers':>7} {'step ms':>7} {'tierflow steps/s':>24} {'dry run steps/s':>24} {'ratio':>6} "
              f"{'target':>6} {'first batch ms':>14}")
        for workers in (0, 2):
            for step_s, steps in plan.items():
                ours, dry, firsts = [], [], []
                for _ in range(rounds):
                    rate, first = tierflow_round(path, workers, steps, step_s, background)
                    ours.append(rate)
                    firsts.append(first * 1e3)
                    dry.append(run_loop(preloaded, steps, step_s)[0])
                ratio = statistics.median(ours) / statistics.median(dry)
                target = 0.9 if step_s < 0.005 else 0.95
                print(f"{workers:>7} {step_s * 1e3:>7.0f} {spread(ours):>24} {spread(dry):>24} {ratio:>6.3f} "
                      f"{'met' if ratio >= target else 'MISSED':>6} {statistics.median(firsts):>14.0f}")
        print()
        print(f"{'workers':>7} {'samples/s':>12} {'us/batch':>10} {'CPU us/batch':>13}  (raw, no step; median of {rounds})")
        for workers in (0, 2):
            runs = [raw_speed(path, workers, 400 if not args.quick else 100, background) for _ in range(rounds)]
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            print(f"{workers:>7} {med['samples_per_s']:>12.0f} {med['us_per_batch']:>10.0f} {med['cpu_us_per_batch']:>13.0f}")


if __name__ == "__main__":
    main()
