"""Issue 39 item 1, its remaining part: one `for` is one epoch for positional batchers. A batch that
holds samples of two epochs is the rare exception: at most one per rank at each epoch edge, and
only under remainder="carry" (none under drop or pad).

Under cursor version 2 each lane's carry batches were consecutive slices of its own walk, so with
`a` lanes up to `a` node batches straddled an edge (benchmarks/epoch_edges.py: up to 16 batches and
129 samples per rank and edge); version 3 reads a node's epoch before the next (order/edges.py).
A version-2 cursor keeps resuming its own order."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from tierflow.errors import CursorFormatError
from tierflow.loader import Loader, OrderSpec, Samples, TieredDataset, WorldPosition, BatchSpec
from tierflow.order import RankStream, SampleOrder

DATASETS = {
    "images-6x50": [50] * 6,
    "images-20x15": [15] * 20,
    "uneven-64": [int(c) for c in np.random.default_rng(5).integers(5, 41, size=64)],
}
BATCH = 16
EPOCHS = 2


def mixed_batches_per_edge(stream: RankStream) -> list[int]:
    """Per epoch edge e (e -> e + 1): the rank's batches whose real samples span two epochs."""
    mixed = [0] * EPOCHS
    index = 0
    while True:
        batch = stream.batch(index)
        real = batch.epochs[batch.mask]
        low = int(real.min())
        if low >= EPOCHS:
            return mixed
        mixed[low] += int(real.max()) != low
        index += 1


def cases() -> list:
    out = []
    for name, counts in DATASETS.items():
        for lanes in (1, 2, 4, 16):
            for remainder in ("carry", "drop", "pad"):
                if remainder == "drop" and min(counts) < BATCH and len(counts) >= 16:
                    continue  # 16 partitions of one shard smaller than a batch: drop refuses them
                for ranks in (1, 2):
                    out.append(
                        pytest.param(name, lanes, remainder, ranks, id=f"{name}-{lanes}lanes-{remainder}-{ranks}ranks")
                    )
    return out


@pytest.mark.parametrize("name,lanes,remainder,ranks", cases())
def test_at_most_one_batch_per_rank_mixes_epochs_at_an_edge_and_only_under_carry(name, lanes, remainder, ranks):
    counts = DATASETS[name]
    order = SampleOrder(
        counts,
        dataset_id=name,
        seed=3,
        partitions=min(16, len(counts)),
        window_shards=2,
        lanes=lanes,
        remainder=remainder,
    )
    allowed = 1 if remainder == "carry" else 0
    for rank in range(ranks):
        stream = RankStream(order, order.start(), batch_size=BATCH, rank=rank, ranks_per_node=ranks)
        assert max(mixed_batches_per_edge(stream)) <= allowed, (rank, mixed_batches_per_edge(stream))


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_loader_for_over_lanes_mixes_epochs_in_at_most_one_batch(long_tailed_docs, ranks):
    """The same bar through TieredDataset's world layout and a Samples batcher (its `for`s)."""
    for rank in range(ranks):
        dataset = TieredDataset(
            long_tailed_docs,
            BatchSpec(batch_size=BATCH, batcher=Samples(select=["tokens"])),
            OrderSpec(partitions=4, lanes=4),
            world=WorldPosition(0, 1, rank, ranks),
        )
        loader = Loader(dataset, return_meta=True)
        for epoch in range(EPOCHS):
            mixed = sum(int(meta.epochs.min()) != int(meta.epochs.max()) for _, meta in loader)
            assert mixed <= 1, (rank, epoch, mixed)


SAVED_V2 = {
    "version": 2,
    "seed": 3,
    "epoch": 0,
    "partitions": 6,
    "epochs": [0, 1, 0, 0, 1, 0],
    "offsets": [30, 0, 48, 48, 0, 30],
    "config_hash": "1bfb80e7bdb73285c888bec3c99e7040",
    "config": {
        "dataset_id": "images-6x50",
        "seed": 3,
        "partitions": 6,
        "window_shards": 2,
        "lanes": 4,
        "remainder": "carry",
        "num_shards": 6,
        "num_samples": 300,
        "layout": "193150b31b3312f5",
    },
}
"""A version-2 cursor saved after batch 15 of 4 lanes over 300 images, just before the epoch edge."""
SAVED_V2_NEXT = "ec0a254986ffe246ae8a46cd9e0c643f5196c563c4c7c780314b6b7f78d2fd90"
"""sha256 of the 8 batches (ids, epochs) it resumes into under version 2's interleave."""


def test_a_saved_version_2_cursor_keeps_resuming_its_own_order():
    """Whatever the edge rule becomes, a cursor saved before it resumes the order it was saved in."""
    order = SampleOrder([50] * 6, dataset_id="images-6x50", seed=3, partitions=6, window_shards=2, lanes=4)
    stream = RankStream(order, order.load(SAVED_V2), batch_size=16)
    rows = [[stream.batch(i).sample_ids.tolist(), stream.batch(i).epochs.tolist()] for i in range(8)]
    assert hashlib.sha256(json.dumps(rows).encode()).hexdigest() == SAVED_V2_NEXT
    assert stream.batch(7).cursor["version"] == SAVED_V2["version"]


def test_a_fresh_cursor_is_version_3_and_other_versions_are_refused_by_name():
    order = SampleOrder([50] * 6, dataset_id="images-6x50", seed=3, partitions=6, window_shards=2, lanes=4)
    saved = RankStream(order, order.start(), batch_size=16).batch(3).cursor
    assert saved["version"] == 3 and order.load(saved).version == 3
    for version in (1, 4):
        with pytest.raises(CursorFormatError, match=f"order cursor version {version}; this tierflow reads versions"):
            order.load({**saved, "version": version})


@pytest.mark.parametrize("lanes", [2, 4, 16])
@pytest.mark.parametrize("ranks", [1, 2])
def test_a_version_3_cursor_saved_at_any_batch_resumes_exactly_across_the_edges(lanes, ranks):
    order = SampleOrder(DATASETS["uneven-64"], dataset_id="uneven", seed=3, partitions=16, lanes=lanes)
    whole = [RankStream(order, order.start(), batch_size=BATCH, rank=r, ranks_per_node=ranks) for r in range(ranks)]
    steps = -(-3 * sum(DATASETS["uneven-64"]) // (BATCH * ranks))
    for saved_at in range(0, steps, 3):
        cursor = order.load(whole[0].batch(saved_at).cursor)
        for rank, stream in enumerate(whole):
            resumed = RankStream(order, cursor, batch_size=BATCH, rank=rank, ranks_per_node=ranks)
            for b in range(min(8, steps - saved_at)):
                assert resumed.batch(b).sample_ids.tolist() == stream.batch(saved_at + 1 + b).sample_ids.tolist()


def part_epochs(stream: RankStream, parts: int, batches: int) -> list[int]:
    """Each part's epoch of the rank's first `batches` batches, a batch cut into `parts` slices of
    its samples sorted by epoch (what a sorted group's parts hold), read the long way."""
    out = []
    for index in range(batches):
        epochs = np.sort(stream.batch(index).epochs)
        out += [int(epochs[k * (epochs.size // parts)]) for k in range(parts)]
    return out


@pytest.mark.parametrize("name", sorted(DATASETS))
@pytest.mark.parametrize("lanes", [1, 4])
def test_a_sorted_groups_parts_count_in_their_own_epochs_from_any_cursor(name, lanes):
    """`epoch_parts` (what len() of a LengthBuckets/AspectBuckets loader counts) is, from any cursor
    and part of its group, the run of parts whose epoch is at most the one the run finishes; parts
    of a group that straddles the edge split between the two epochs' fors."""
    counts, parts, size = DATASETS[name], 4, 6
    order = SampleOrder(counts, dataset_id=name, seed=3, partitions=min(16, len(counts)), window_shards=2, lanes=lanes)
    ranks = 2
    straddling = 0
    for rank in range(ranks):
        start = RankStream(order, order.start(), batch_size=parts * size, rank=rank, ranks_per_node=ranks)
        per_epoch = sum(counts) // (parts * size * ranks) + 1
        every = part_epochs(start, parts, 5 * per_epoch)
        straddling += sum(every[k] != every[k + 1] for k in range(len(every) - 1) if (k + 1) % parts)
        for first in range(0, 2 * per_epoch):
            cursor = start.cursor_after(first - 1) if first else order.start()
            stream = RankStream(order, cursor, batch_size=parts * size, rank=rank, ranks_per_node=ranks)
            for skip in range(parts):
                rest = every[first * parts + skip :]
                for after in (None, rest[0] - 1, rest[0]):
                    epoch = rest[0] if after is None else max(rest[0], after + 1)
                    count = next((k for k, e in enumerate(rest) if e > epoch), len(rest))
                    assert stream.epoch_parts(after, False, parts, skip) == (epoch, count), (first, skip, after)
    assert straddling  # some group's parts lie in two epochs
