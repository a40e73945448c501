"""Which batches each DataLoader worker should build: blocks decoded against batches waiting out of order.

Dealt in turn (DataLoader's rule: worker w of W builds the batches n with n mod W = w) batches
leave the workers in order, but the batches of one lane's block group go to every worker and each
decodes its blocks (decodes.py counted ~1.8 x the blocks with 2 workers). The Loader's pool deals by
lane (`loader/ownership.py`, the row "pool: by lane, lag 8"). This plans one raw epoch (no data read:
the order's batches and the index's block of each sample) and computes, for other rules of who
builds which batch:

- decodes: blocks each worker touches, summed (each worker decodes what it touches at least once);
- balance: the busiest worker's batches against an even share (the epoch's length in builds);
- buffer: the most batches built but not yet taken, when every worker builds its own batches in
  order, one per tick, and the loop takes batch n as soon as batches 0..n exist (what a Loader that
  restores the order would hold).

Rules: "n mod W" (DataLoader's); "pool: by lane, lag 8" (the pool's `LaneSticky`, asked of the
dataset); "lane": a batch goes to the worker of its lane (lane mod W); "sticky, lag L":
a lane stays on its worker while its batches share a block with its previous one, and otherwise, or
once that worker has L more batches than the least loaded one, moves to the least loaded worker.
Reads run.py's packed datasets (make bench-peers ARGS="--only raw" builds them).

    .venv/bin/python benchmarks/peers/ownership.py [--work /tmp/tierflow-peers/full] [--workers 2 4]
"""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path
from collections.abc import Callable

import numpy as np

from tierflow.loader import BatchSpec, OrderSpec, TieredDataset
from tierflow.loader.tokens import WindowStarts
from tierflow.loader.workers import LAG
from tierflow.order.lanes import node_lanes

SEQ_LEN = 2048
Batches = list[tuple[int, frozenset[int]]]
"""Per batch of the epoch: its lane, and the blocks (global block numbers) its samples read."""


def epoch_batches(data: Path, kind: str) -> tuple[TieredDataset, Batches]:
    """Epoch 0's batches of the rank's order at the peers' defaults (batch 8; tokens: windows of SEQ_LEN)."""
    shape = {"seq_len": SEQ_LEN} if kind == "tokens" else {}
    ds = TieredDataset(str(data), BatchSpec(batch_size=8, **shape), OrderSpec(seed=17))
    index = ds._open().dataset.index
    order = ds.stream(0, 1)._stream  # the rank's stream: every batch, not one worker's
    starts = WindowStarts(index.token_starts, SEQ_LEN) if kind == "tokens" else None
    lane_of = {
        p: lane for lane, members in enumerate(node_lanes(ds.order.layout, 0, 1, ds.order.lanes)) for p in members
    }
    batches: Batches = []
    while True:
        partition, ids, _, _, epoch = order.node_parts(len(batches))
        if epoch > 0:
            return ds, batches
        ids = np.asarray(ids, dtype=np.int64)
        if starts is not None:  # a window reads every block from its first token's to its last's
            first = starts(ids)
            low, high = (
                index.first_block[rows[:, 0]] + rows[:, 1]
                for rows in (index.token_blocks(first), index.token_blocks(first + SEQ_LEN))
            )
            read = frozenset(b for a, z in zip(low.tolist(), high.tolist()) for b in range(a, z + 1))
        else:
            shards, blocks, _ = index.locate_samples(ids)
            read = frozenset((index.first_block[shards] + blocks).tolist())
        batches.append((lane_of[partition], read))


def by_streams(ds: TieredDataset, batches: Batches, workers: int) -> list[int]:
    """DataLoader's rule, asked of the workers' own streams (`OrderStream.owns`)."""
    streams = [ds.stream(w, workers) for w in range(workers)]
    return [next(w for w, stream in enumerate(streams) if stream.owns(n)) for n in range(len(batches))]


def by_pool(ds: TieredDataset, batches: Batches, workers: int) -> list[int]:
    """The Loader's pool's rule (`TieredDataset.ownership` with the pool's greatest lag)."""
    dealt = ds.ownership(workers, LAG)
    return [dealt.owner(n) for n in range(len(batches))]


def by_lane(batches: Batches, workers: int) -> list[int]:
    return [lane % workers for lane, _ in batches]


def sticky(batches: Batches, workers: int, lag: int | None) -> list[int]:
    owner: list[int] = []
    held: dict[int, int] = {}
    last: dict[int, frozenset[int]] = {}
    load = [0] * workers
    for lane, blocks in batches:
        w = held.get(lane)
        if w is None or not blocks & last[lane] or (lag is not None and load[w] > min(load) + lag):
            w = min(range(workers), key=lambda v: (load[v], v != held.get(lane)))
        held[lane], last[lane] = w, blocks
        load[w] += 1
        owner.append(w)
    return owner


def measure(batches: Batches, owner: list[int], workers: int) -> tuple[int, float, int]:
    """(decodes, busiest worker ÷ an even share, most batches waiting out of order)."""
    touched: list[set[int]] = [set() for _ in range(workers)]
    built = np.zeros(len(batches), dtype=np.int64)  # the tick at which each batch is built
    count = [0] * workers
    for n, ((_, blocks), w) in enumerate(zip(batches, owner)):
        touched[w] |= blocks
        built[n] = count[w]
        count[w] += 1
    taken = np.maximum.accumulate(built)  # batch n is taken once 0..n are built
    ticks = np.arange(int(built.max()) + 1)
    waiting = np.sort(built).searchsorted(ticks, side="right") - taken.searchsorted(ticks, side="right")
    return sum(len(t) for t in touched), max(count) / (len(batches) / workers), int(waiting.max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="/tmp/tierflow-peers/full")
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    for kind, name in (("tokens", "tierflow-tokens"), ("text", "tierflow-docs")):
        ds, batches = epoch_batches(Path(args.work) / "data" / name, kind)
        blocks = len(frozenset().union(*(b for _, b in batches)))
        print(
            f"\n{kind}: epoch 0, {len(batches)} batches of 8, {blocks} blocks, {ds.order.lanes} lanes "
            f"(epoch 0 reads {ds.order.first_epoch[0] if ds.order.first_epoch else ds.order.lanes} at a time)\n"
        )
        print("| workers | rule | decodes ÷ blocks | busiest ÷ even share | batches waiting, at most |")
        print("|---|---|---|---|---|")
        for workers in args.workers:
            rules: dict[str, Callable[[], list[int]]] = {
                "n mod W (DataLoader's)": partial(by_streams, ds, batches, workers),
                f"pool: by lane, lag {LAG}": partial(by_pool, ds, batches, workers),
                "lane": partial(by_lane, batches, workers),
                "sticky": partial(sticky, batches, workers, None),
                "sticky, lag 8": partial(sticky, batches, workers, 8),
                "sticky, lag 32": partial(sticky, batches, workers, 32),
            }
            for rule, assign in rules.items():
                decodes, busiest, waiting = measure(batches, assign(), workers)
                print(f"| {workers} | {rule} | {decodes / blocks:.2f} | {busiest:.2f} | {waiting} |")


if __name__ == "__main__":
    main()
