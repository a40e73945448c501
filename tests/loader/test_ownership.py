"""How the batches are dealt to workers: in turn for DataLoader, by lane for the Loader's pool."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tierflow.loader.ownership import KEPT, LaneSticky, RoundRobin


def _lanes(count: int, lanes: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, lanes, count).tolist()


def test_round_robin_deals_in_turn():
    dealt = RoundRobin(3)
    assert [dealt.owner(n) for n in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert list(itertools.islice(dealt.owned(1), 3)) == [1, 4, 7]


@pytest.mark.parametrize("workers, lag", [(2, 1), (2, 6), (3, 8), (4, 2)])
def test_a_lane_stays_with_its_worker_while_no_worker_is_dealt_lag_more_than_another(workers, lag):
    lanes = _lanes(5000, 12)
    dealt = LaneSticky(lambda n: lanes[n % len(lanes)], workers, lag)  # endless, as a stream is
    owners = [dealt.owner(n) for n in range(len(lanes))]
    counts = [0] * workers
    held: dict[int, int] = {}
    for lane, owner in zip(lanes, owners):
        if lane in held and held[lane] != owner:  # a lane moves only to the least dealt worker, when it must
            assert counts[held[lane]] >= min(counts) + lag and counts[owner] == min(counts)
        held[lane] = owner
        counts[owner] += 1
        assert max(counts) - min(counts) <= lag
    moves = sum(1 for a, b in zip(owners, owners[1:]) if a != b)
    assert moves > 0 and len(set(owners)) == workers
    for worker in range(workers):  # each worker's own list agrees with the owners, in order
        mine = list(itertools.takewhile(lambda n: n < len(lanes), dealt.owned(worker)))
        assert mine == [n for n, owner in enumerate(owners) if owner == worker]


def test_every_process_deals_the_same_batches_alike_however_far_it_asks():
    """The training process asks batch by batch; a worker walks its own list; one asking behind
    what it keeps deals again from the start: all agree."""
    lanes = _lanes(3 * KEPT, 7, seed=1)
    one = LaneSticky(lanes.__getitem__, 2, 8)
    whole = [one.owner(n) for n in range(len(lanes))]
    other = LaneSticky(lanes.__getitem__, 2, 8)
    assert other.owner(len(lanes) - 1) == whole[-1]
    assert other.owner(5) == whole[5]  # behind what it keeps: dealt again
    assert [other.owner(n) for n in range(len(lanes))] == whole


def test_a_lane_sticky_deal_refuses_no_workers_or_no_lag():
    with pytest.raises(ValueError, match="lag >= 1"):
        LaneSticky(lambda n: 0, 2, 0)
