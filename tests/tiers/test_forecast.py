"""`tiers.forecast`: the bytes an epoch fetches, replayed against a tier, and Belady's MIN with
bypass as the floor no live figure can beat. Checked exhaustively on small traces: for equal
sizes `optimum` is exact, and every policy's replay fetches at least as much."""

from __future__ import annotations

import random

import pytest

from tierflow.order.future import ShardUse
from tierflow.tiers.forecast import optimum, replay


def uses_of(trace: list[int], per_epoch: int) -> list[ShardUse]:
    return [ShardUse(shard, t, t, t // per_epoch, 0) for t, shard in enumerate(trace)]


def fewest_fetches(trace: list[int], slots: int) -> int:
    """Every schedule of admissions and evictions (bypass allowed), by dynamic programming over
    the resident sets: the true minimum number of fetches."""
    best = {frozenset(): 0}
    for shard in trace:
        nxt: dict[frozenset, int] = {}
        for state, cost in best.items():
            if shard in state:
                keep_cheapest(nxt, state, cost)
                continue
            keep_cheapest(nxt, state, cost + 1)  # bypass: read once, not kept
            if len(state) < slots:
                keep_cheapest(nxt, state | {shard}, cost + 1)
            for victim in state:
                keep_cheapest(nxt, (state - {victim}) | {shard}, cost + 1)
        best = nxt
    return min(best.values())


def keep_cheapest(costs: dict[frozenset, int], state: frozenset, cost: int) -> None:
    if cost < costs.get(state, 1 << 30):
        costs[state] = cost


@pytest.mark.parametrize("seed", range(3))
def test_optimum_is_the_true_minimum_for_equal_sizes_and_no_policy_beats_it(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(60):
        shards, slots = rng.randint(2, 5), rng.randint(1, 3)
        trace = [rng.randrange(shards) for _ in range(rng.randint(1, 12))]
        sizes = [100] * shards
        epochs = 2
        per_epoch = max(1, len(trace) // epochs)
        uses = uses_of(trace, per_epoch)
        epochs_seen = max(u.epoch for u in uses) + 1
        best = optimum(uses, sizes, sizes, capacity=slots * 100, epochs=epochs_seen)
        assert sum(e.fetched for e in best) == 100 * fewest_fetches(trace, slots), (trace, slots)
        assert all(e.dataset == 100 * shards for e in best)
        for policy in ("lru", "nochurn", "auto"):
            live = replay(uses, sizes, sizes, capacity=slots * 100, staging=0, epochs=epochs_seen, policy=policy)
            assert sum(e.fetched for e in live) >= sum(e.fetched for e in best), (policy, trace, slots)


def test_a_shard_larger_than_the_room_is_read_every_time_and_uses_past_the_epochs_are_not_counted() -> None:
    uses = uses_of([0, 1, 0, 1, 0, 1], per_epoch=2)  # three epochs
    sizes, rest = [500, 50], [250, 25]
    best = optimum(uses, sizes, rest, capacity=100, epochs=2)
    assert [(e.epoch, e.fetched) for e in best] == [(0, 275), (1, 250)]  # shard 1 stays; shard 0 never fits
    assert best[0].ratio == pytest.approx(275 / 275)
    live = replay(uses, sizes, rest, capacity=100, staging=0, epochs=2, policy="lru")
    assert [e.fetched for e in live] == [275, 250]
    staged = replay(uses, sizes, rest, capacity=100, staging=1000, epochs=2, policy="lru")
    assert [e.fetched for e in staged] == [275, 0]  # the staging area keeps what the tier cannot
