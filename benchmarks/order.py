"""Benchmark of the sample order: start-up, seek and hot-path cost against dataset size.

Construct + seek (load a mid-epoch cursor) + first 1,000 sample ids, at 1M, 10M, 100M and 1B
samples over a fixed 4,000 shards: wall time and peak traced memory, and their growth against
1M (target: <= 10%). Then microseconds per sample id on the hot path (batches of 1,000). Then
shuffle quality against the working set (lanes x windows of k shards): |Spearman rho| between a
sample's position in the epoch and its stored index (target <= 0.01), and the distinct shards in
a global batch of 8 ranks x 32 samples. Then the hot path's microseconds per sample id under the
window shuffle against block groups (8 B samples), medians of alternating rounds.
Run: .venv/bin/python benchmarks/order.py
"""

from __future__ import annotations

import time
import tracemalloc

import numpy as np
from _harness import spread

from tierflow.order import RankStream, SampleOrder, future_shard_uses

SHARDS = 4000
SIZES = [1_000_000, 10_000_000, 100_000_000, 1_000_000_000]
BATCH = 1000
REPEATS = 5


def start_and_first_batch(total: int) -> np.ndarray:
    order = SampleOrder([total // SHARDS] * SHARDS, dataset_id=f"bench-{total}", seed=1, partitions=64)
    half = [int(n) // 2 for n in order.layout.partition_sizes]
    saved = order.cursor([3] * 64, half).to_dict()
    cursor = order.load(saved)
    stream = RankStream(order, cursor, batch_size=BATCH, node=3, num_nodes=8, rank=5, ranks_per_node=8)
    return stream.batch(0).sample_ids


def measure_start(total: int) -> tuple[float, int]:
    best = float("inf")
    for _ in range(REPEATS):
        began = time.perf_counter()
        ids = start_and_first_batch(total)
        best = min(best, time.perf_counter() - began)
        assert ids.size == BATCH
    tracemalloc.start()
    start_and_first_batch(total)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return best, peak


def measure_hot_path(total: int, batches: int = 300) -> tuple[float, float, float]:
    order = SampleOrder([total // SHARDS] * SHARDS, dataset_id=f"bench-{total}", seed=1, partitions=64)
    stream = RankStream(order, order.start(), batch_size=BATCH, node=0, num_nodes=8, ranks_per_node=8)
    stream.batch(0)
    began = time.perf_counter()
    for j in range(batches):
        stream.node_batch(j)
    ids_only = (time.perf_counter() - began) / (batches * BATCH) * 1e6
    began = time.perf_counter()
    for b in range(batches):
        stream.batch(b)
    with_cursor = (time.perf_counter() - began) / (batches * BATCH) * 1e6
    began = time.perf_counter()
    future_shard_uses(order, order.start(), node=0, num_nodes=8, batch_size=BATCH, horizon=1_000_000)
    future_ms = (time.perf_counter() - began) * 1e3
    return ids_only, with_cursor, future_ms


def ids_cost(group_bytes: int, total: int = 100_000_000, batches: int = 3000, batch: int = 256) -> float:
    """Microseconds per sample id of node batches (ids only) of an order with 8-byte samples."""
    order = SampleOrder(
        [total // SHARDS] * SHARDS,
        dataset_id=f"bench-{total}",
        seed=1,
        partitions=64,
        lanes=16,
        group_bytes=group_bytes,
        decoded_bytes=[8 * (total // SHARDS)] * SHARDS,
    )
    stream = RankStream(order, order.start(), batch_size=batch, node=0, num_nodes=8, ranks_per_node=8)
    stream.node_batch(0)
    began = time.perf_counter()
    for j in range(batches):
        stream.node_batch(j)
    return (time.perf_counter() - began) / (batches * batch) * 1e6


def shuffle_quality(
    lanes: int,
    window_shards: int,
    shards: int = 2000,
    per_shard: int = 50,
    ranks: int = 8,
    batch: int = 32,
    first_epoch: tuple[int, int] | None = None,
) -> tuple[float, float, int]:
    """(|Spearman rho| of position vs stored index over the first epoch, mean and min distinct shards
    per global batch) for one node's order read through `lanes` lanes (epoch 0 as `first_epoch`)."""
    order = SampleOrder(
        [per_shard] * shards,
        dataset_id="quality",
        seed=3,
        partitions=64,
        window_shards=window_shards,
        lanes=lanes,
        first_epoch=first_epoch,
    )
    streams = [RankStream(order, order.start(), batch_size=batch, rank=r, ranks_per_node=ranks) for r in range(ranks)]
    ids, distinct = [], []
    for step in range(shards * per_shard // (ranks * batch)):
        global_batch = np.concatenate([s.batch(step).sample_ids for s in streams])
        ids.append(global_batch)
        distinct.append(np.unique(order.layout.shard_of(global_batch)).size)
    ids = np.concatenate(ids)
    rho = np.corrcoef(np.arange(ids.size), ids)[0, 1]  # both are ranks: Pearson on them is Spearman
    return abs(float(rho)), float(np.mean(distinct)), int(np.min(distinct))


def main() -> None:
    print(f"start-up: construct + seek + first {BATCH} ids, {SHARDS} shards, 64 partitions, best of {REPEATS}")
    print(f"{'samples':>14} {'time ms':>9} {'x vs 1M':>8} {'peak KiB':>9} {'x vs 1M':>8}")
    base = None
    for total in SIZES:
        seconds, peak = measure_start(total)
        base = base or (seconds, peak)
        print(
            f"{total:>14,} {seconds * 1e3:>9.2f} {seconds / base[0]:>8.2f} {peak / 1024:>9.0f} {peak / base[1]:>8.2f}"
        )
    print()
    print(f"hot path, batches of {BATCH} (node 0 of 8, 8 ranks):")
    print(f"{'samples':>14} {'us/id ids':>10} {'us/id +cursor':>14} {'future 1M ms':>13}")
    for total in (SIZES[0], SIZES[-1]):
        ids_only, with_cursor, future_ms = measure_hot_path(total)
        print(f"{total:>14,} {ids_only:>10.3f} {with_cursor:>14.3f} {future_ms:>13.1f}")
    print()
    print(
        "hot path by shuffle, 100M samples of 8 B, node batches of 256 (node 0 of 8, 16 lanes), us per id, "
        "median (min-max) of 5 alternating rounds:"
    )
    shuffles = {"window": 0, "groups 4 MiB": 4 << 20, "groups 1 MiB": 1 << 20}
    costs: dict[str, list[float]] = {name: [] for name in shuffles}
    for round_ in range(5):
        for name in list(shuffles) if round_ % 2 == 0 else list(shuffles)[::-1]:
            costs[name].append(ids_cost(shuffles[name]))
    for name, values in costs.items():
        print(f"{name:>14} {spread(values, '.3f')}")
    print()
    print(
        "shuffle quality against the working set (2,000 shards x 50 samples, 64 partitions, one node, "
        "global batch 8 x 32):"
    )
    print(
        f"{'lanes x k':>10} {'shards at once':>15} {'|rho| epoch':>12} {'<= 0.01':>8} {'shards/batch mean':>18} {'min':>5}"
    )

    def quality_row(lanes: int, k: int, first_epoch: tuple[int, int] | None = None) -> None:
        shown = first_epoch or (lanes, k)
        rho, mean, least = shuffle_quality(lanes, k, first_epoch=first_epoch)
        print(
            f"{shown[0]:>5} x {shown[1]:<2} {shown[0] * 2 * shown[1]:>15} {rho:>12.4f} "
            f"{'met' if rho <= 0.01 else 'MISS':>8} {mean:>18.1f} {least:>5}"
        )

    for lanes, k in ((64, 4), (16, 4), (8, 4), (4, 4), (1, 4), (1, 2), (1, 1)):
        quality_row(lanes, k)
    print(
        "a narrowed first epoch (SampleOrder(first_epoch=(m, k0)): 16 x 4 later, m lanes x k0 at once in "
        "epoch 0; the loader's rule at 400 and at 25 shards a node):"
    )
    for m, k0 in ((16, 1), (4, 1)):
        quality_row(16, 4, (m, k0))


if __name__ == "__main__":
    main()
