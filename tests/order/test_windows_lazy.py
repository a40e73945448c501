"""An epoch's shuffled order is computed as far as it is read (order/windows.py).

A start reads its first windows, not its partition's every shard; whatever is asked, at whatever
offset and in whatever order, the answer is the one the whole order gives."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tierflow.order.layout import PartitionLayout
from tierflow.order.windows import STEP_SHARDS, EpochWindows

SHARDS = 6000


@pytest.fixture(scope="module")
def layout() -> PartitionLayout:
    rng = np.random.default_rng(11)
    counts = rng.integers(0, 40, size=SHARDS).astype(np.int64)  # zeros among them: empty shards
    return PartitionLayout(counts, partitions=2)


def windows(layout: PartitionLayout, width: int = 3, groups: bool = False) -> EpochWindows:
    if not groups:
        return EpochWindows(layout, 1, 2, seed=5, window_shards=width)
    decoded = layout.shard_sample_counts * 100
    return EpochWindows(layout, 1, 2, seed=5, window_shards=width, group_bytes=700, decoded_bytes=decoded)


@pytest.mark.parametrize("width, groups", [(3, False), (1, False), (7, True), (4096, False)])
def test_a_lazy_order_answers_as_the_whole_order(layout: PartitionLayout, width: int, groups: bool) -> None:
    whole = windows(layout, width, groups)
    order, starts = whole.shard_order, whole.shard_starts  # computes all of it
    assert order.size == layout.partition_shards[1].size and int(starts[-1]) == whole.size
    rng = np.random.default_rng(3)
    for offsets in (
        np.arange(0, 50),
        np.sort(rng.integers(0, whole.size, size=300)),
        rng.integers(0, whole.size, size=300),  # unsorted, windows far apart
        np.arange(whole.size - 40, whole.size),
    ):
        lazy = windows(layout, width, groups)
        assert lazy.sample_ids(offsets).tolist() == whole.sample_ids(offsets).tolist()
    deep = int(rng.integers(whole.size // 2, whole.size - 100))
    assert (
        windows(layout, width, groups).range_ids(deep, deep + 100).tolist()
        == whole.range_ids(deep, deep + 100).tolist()
    )
    edges = whole.window_shard_edges
    for w in rng.integers(0, whole.num_windows, size=20).tolist():
        lazy = windows(layout, width, groups)
        assert lazy.window_start(w) == int(starts[edges[w]])
        assert lazy.window_shards(w).tolist() == order[edges[w] : edges[w + 1]].tolist()
        assert lazy.window_counts(w).tolist() == layout.shard_sample_counts[lazy.window_shards(w)].tolist()
    for offset in rng.integers(0, whole.size, size=50).tolist():
        expected = int(np.searchsorted(whole.window_starts, offset, side="right") - 1)
        assert windows(layout, width, groups).window_of(offset) == expected
    assert windows(layout, width, groups).window_start(whole.num_windows) == whole.size


def test_a_start_computes_its_first_windows_not_the_partition(layout: PartitionLayout) -> None:
    lazy = windows(layout)
    lazy.range_ids(0, 16)
    assert 0 < lazy._order.size <= STEP_SHARDS + 3 < layout.partition_shards[1].size
    lazy.window_of(lazy.size - 1)  # the last offset: the whole order
    assert lazy._order.size == layout.partition_shards[1].size


def test_an_order_part_computed_pickles_and_goes_on_the_same(layout: PartitionLayout) -> None:
    """A spawn or forkserver worker gets the order pickled with the windows it has computed so far."""
    import pickle

    whole = windows(layout)
    part = windows(layout)
    part.range_ids(0, 16)
    again = pickle.loads(pickle.dumps(part))
    assert (
        again.range_ids(whole.size - 50, whole.size).tolist() == whole.range_ids(whole.size - 50, whole.size).tolist()
    )


def test_threads_extending_one_order_agree(layout: PartitionLayout) -> None:
    """The stager's forecast and the batches read one order from two threads: each extension is
    whole, so every reader sees a consistent prefix."""
    whole = windows(layout)
    expected = whole.sample_ids(np.arange(whole.size))
    shared = windows(layout)
    results: list[bool] = []

    def read(step: int) -> None:
        ok = True
        for lo in range(0, shared.size, step):
            hi = min(lo + step, shared.size)
            ok &= shared.sample_ids(np.arange(lo, hi)).tolist() == expected[lo:hi].tolist()
        results.append(ok)

    threads = [threading.Thread(target=read, args=(step,)) for step in (97, 1001, 33)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True, True, True]
