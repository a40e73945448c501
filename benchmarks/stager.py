"""Micro-benchmark of the stager's plan: microseconds per `plan_staging` call, no threads, no I/O.

The stager plans at most every 10 plans' time (so it takes at most ~10% of the training loop's
GIL); this is what one plan costs at 64, 1k and 10k future shard uses (a view two tier
capacities long is 1k-10k uses on a large node). The uses are synthetic: windows of 4 shards
of a 2k-shard dataset, read 3 steps each, the top tier holding a quarter of them, the stager
holding 16 and fetching 4. Rows: the plan alone, and the plan with the next-use oracle built
from its intervals (what one stager plan does besides reading the order's future view).

Run: .venv/bin/python benchmarks/stager.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import random
import time

from _harness import spread
from tierflow.order import ShardUse
from tierflow.policies.oracle import IntervalOracle
from tierflow.tiers.plan import NodeShape, plan_staging

SHARDS = 2048
WINDOW = 4
STEP = 64
NODE = NodeShape(
    shard_bytes=256 << 20,
    bytes_per_step=64 << 20,
    samples_per_step=STEP,
    min_batches=5,
    max_bytes=64 << 30,
    next_windows_bytes=4 * (256 << 20),
    capacity=128 << 30,
    dataset_bytes=SHARDS * (256 << 20),
    staging_slots=4,
)


def future(count: int, seed: int = 0) -> list[ShardUse]:
    """`count` uses: consecutive windows of WINDOW shards drawn from the dataset, each read 3 steps."""
    rng = random.Random(seed)
    uses = []
    for w in range(-(-count // WINDOW)):
        first = w * 3 * STEP
        for shard in rng.sample(range(SHARDS), WINDOW):
            uses.append(ShardUse(shard, first, first + 3 * STEP - 1, w * WINDOW // SHARDS, 0))
    return sorted(uses[:count], key=lambda u: (u.first_use, u.shard))


def us_per_plan(uses: list[ShardUse], oracle: bool, repeat: int) -> float:
    resident = set(range(0, SHARDS, 4))
    held, in_flight = {u.shard for u in uses[:16]}, {u.shard for u in uses[16:20]}
    started = time.perf_counter()
    for _ in range(repeat):
        plan = plan_staging(
            uses,
            NODE,
            consumption_bytes_s=2e9,
            fetch_p99_s=0.2,
            fetch_mean_s=0.1,
            position=3,
            resident=resident,
            held=held,
            in_flight=in_flight,
        )
        if oracle:
            IntervalOracle((str(shard), first, last) for shard, first, last in plan.intervals)
    return (time.perf_counter() - started) / repeat * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="3 rounds")
    args = parser.parse_args()
    rounds = 3 if args.quick else args.rounds
    sizes = [64, 1000, 10_000]
    print(f"plan_staging, us per plan, median (min-max) of {rounds} rounds")
    print(f"{'future uses':>11} {'plan':>24} {'plan + oracle':>24}")
    for size in sizes:
        uses = future(size)
        repeat = max(3, 20_000 // size)
        cells = []
        for oracle in (False, True):
            cells.append(spread([us_per_plan(uses, oracle, repeat) for _ in range(rounds)]))
        print(f"{size:>11} {cells[0]:>24} {cells[1]:>24}")


if __name__ == "__main__":
    main()
