"""Cost of the telemetry primitives on the per-batch hot path.

Measures ns per counter increment, gauge set, histogram observe and boundary
record (with its two perf_counter reads), counts how many of those the device
feed makes per batch, and prints the share of a batch's time they take
against the target (<= 2%); then the loader's throughput with its telemetry on vs off (wait,
step, production, depth, stall attribution, per-open tier attribution) over alternating rounds.
Run: .venv/bin/python benchmarks/telemetry.py
"""

from __future__ import annotations

import time
import timeit

import numpy as np
import torch

from tierflow.loader.device_feed import DeviceFeed
from tierflow.telemetry.metrics import MetricsRegistry

REPEATS = 5
NUMBER = 200_000


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
            "tf_cursor": {"step": i},
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
    touched = sum(1 for m in feed.registry.metrics() if m.kind == "counter" and m.value and m.name != "tierflow_feed_batches_total")
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
    per_batch_ns = ops["counter"] * costs["counter.inc(4096)"][1] + ops["boundary"] * costs["boundary: 2 clock reads + observe"][1]
    print()
    print(f"device feed, staged, 5 arrays/batch: {ops['counter']:.0f} counter ops + {ops['boundary']:.0f} boundary records per batch")
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


def loader_on_vs_off(rounds: int = 6, batches: int = 300) -> None:
    """Batches/s through Loader (no step) with telemetry on and off, alternating, on one packed dataset."""
    import json
    import statistics
    import tempfile
    from pathlib import Path

    import tierflow
    from tierflow.loader import Loader, TieredDataset

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        with open(root / "docs.jsonl", "w") as f:
            for i in range(20000):
                f.write(json.dumps({"text": f"{i:06d} " + "lorem ipsum " * (i % 40 + 4)}) + "\n")
        tierflow.pack([root / "docs.jsonl"], root / "ds", tokenizer="bytes", workers=1, target_shard_bytes=1 << 20)
        rates: dict[bool, list[float]] = {True: [], False: []}
        for r in range(rounds * 2):
            on = r % 2 == 0
            dataset = TieredDataset(root / "ds", batch_size=16, seq_len=256, seed=r // 2)
            loader = Loader(dataset, "cpu", telemetry=on)
            started = time.perf_counter()
            for n, _ in enumerate(loader, 1):
                if n == batches:
                    break
            rates[on].append(batches / (time.perf_counter() - started))
            loader.close()
    print()
    print(f"loader throughput, token windows 16x256, no step, {rounds} alternating rounds of {batches} batches")
    print(f"{'telemetry':<12}{'median b/s':>12}{'min':>10}{'max':>10}")
    for on in (False, True):
        values = rates[on]
        print(f"{'on' if on else 'off':<12}{statistics.median(values):12.0f}{min(values):10.0f}{max(values):10.0f}")
    ratio = statistics.median(rates[True]) / statistics.median(rates[False])
    print(f"on / off: {ratio:.3f} (cost {1 - ratio:.1%} of a loader with no step: the worst case)")


if __name__ == "__main__":
    main()
    loader_on_vs_off()
