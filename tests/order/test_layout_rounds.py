"""The longest-first layout dealt a round at a time gives the heap's assignment, shard for shard."""

from __future__ import annotations

import numpy as np
import pytest

from tierflow.order.layout import _assign_longest_first, _assign_longest_first_heap
from tierflow.order.working_set import (
    ShardSizes,
    choose_working_set,
    largest_bytes,
    total_bytes,
    working_set_bytes,
)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("shards, partitions", [(1, 1), (5, 4), (64, 64), (100, 64), (1000, 7), (3000, 64), (2000, 16)])
def test_rounds_deal_as_the_heap_does(seed: int, shards: int, partitions: int) -> None:
    rng = np.random.default_rng(seed)
    cases = [
        (rng.integers(1, 1000, shards), None),
        (rng.integers(1, 1000, shards), rng.integers(0, 10**6, shards)),
        (np.full(shards, 500), np.full(shards, 7)),
        (rng.integers(90, 110, shards), None),
    ]
    empty = np.full(shards, 500)
    empty[1::3] = 0  # empty shards weigh nothing: ties the heap breaks by partition index
    cases.append((empty, None))
    for counts, sizes in cases:
        assert np.array_equal(
            _assign_longest_first(counts, sizes, partitions), _assign_longest_first_heap(counts, sizes, partitions)
        )


def test_working_set_bytes_of_a_column_is_the_sum_of_the_largest() -> None:
    sizes = np.random.default_rng(0).integers(0, 1000, 300)
    for shards in (0, 1, 5, 299, 400):
        assert working_set_bytes(shards, sizes) == working_set_bytes(shards, sizes.tolist())


@pytest.mark.parametrize("seed", range(4))
def test_working_set_bytes_of_a_large_column_with_ties_is_the_sum_of_the_largest(seed: int) -> None:
    """Above a chunk's worth of shards the largest are found among the values at least the chunks'
    maxima's count-th largest (no copy of the column): ties, sorted and spread columns alike."""
    rng = np.random.default_rng(seed)
    for sizes in (
        rng.integers(0, 4, 50_000),
        rng.integers(0, 10**9, 50_000),
        np.sort(rng.integers(0, 10**6, 30_001)),
        np.full(20_000, 7),
        np.where(rng.random(40_000) < 0.001, 9, 3),  # a few above a sea of ties
    ):
        for shards in (0, 1, 16, 128, 1000):
            assert working_set_bytes(shards, sizes) == working_set_bytes(shards, sizes.tolist())


def test_working_set_bytes_of_a_read_only_column_asked_again_is_the_same() -> None:
    """A read-only column over a read-only buffer (a mapped one) keeps its largest sorted after the
    first ask: fewer and more shards asked next, and a writeable copy, give the sums of the largest."""
    rng = np.random.default_rng(5)
    values = rng.integers(0, 10**9, 70_001)
    mapped = np.frombuffer(values.tobytes(), dtype=values.dtype)[1:]
    assert not mapped.flags.writeable
    for shards in (127, 15, 0, 1000, 3, 70_000, 80_000):
        assert working_set_bytes(shards, mapped) == working_set_bytes(shards, mapped.tolist())
        assert working_set_bytes(shards, mapped.copy()) == working_set_bytes(shards, mapped.tolist())


def test_sizes_summarised_by_their_largest_answer_as_the_column() -> None:
    """ShardSizes (a header's summary) answers from its largest values, and past them from the column,
    asked for only then: the same bytes, totals and largest as the column itself."""
    rng = np.random.default_rng(5)
    sizes = rng.integers(1, 10**9, size=5000).astype(np.int64)
    asked: list[int] = []

    def column() -> np.ndarray:
        asked.append(1)
        return sizes

    summary = ShardSizes(sizes.size, int(sizes.sum()), np.sort(sizes)[::-1][:256].tolist(), column)
    for shards in (0, 1, 128, 255):
        assert working_set_bytes(shards, summary) == working_set_bytes(shards, sizes)
    assert not asked
    assert working_set_bytes(1000, summary) == working_set_bytes(1000, sizes) and asked
    assert total_bytes(summary) == total_bytes(sizes) and largest_bytes(summary) == largest_bytes(sizes)
    assert choose_working_set(summary, 64) == choose_working_set(sizes, 64)
