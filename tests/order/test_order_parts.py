"""Specification of the order's smaller parts: the lane interleave, remainder arithmetic, eval order,
mixing schedule, per-sample randomness."""

import numpy as np
import pytest

from tierflow.order import EvalOrder, MixtureSchedule, sample_rng, sample_seed, sample_seeds
from tierflow.order.interleave import LaneSchedule, ScheduleWalker
from tierflow.order.lanes import Lane, LaneBatches
from tierflow.order.layout import PartitionLayout
from tierflow.order.remainder import Remainder, StreamGeometry


def lane_batches(sizes, positions, batch=5, remainder=Remainder.CARRY):
    """One single-partition lane per size, at the given (epoch, offset) positions."""
    layout = PartitionLayout([int(n) for n in sizes], partitions=len(sizes))
    lanes = [Lane(layout, (p,), seed=0) for p in range(len(sizes))]
    return [LaneBatches(lane, {p: positions[p]}, batch, remainder) for p, lane in enumerate(lanes)]


def merged_by_key(schedule, picks):
    """Brute force: every lane's first `picks` batches sorted by (key, lane, number)."""
    keys = [(schedule.key(m, i), m, i) for m in range(len(schedule.lanes)) for i in range(picks)]
    return [(m, i) for _, m, i in sorted(keys)[:picks]]


@pytest.mark.parametrize("remainder", list(Remainder))
@pytest.mark.parametrize(
    "sizes,positions",
    [([40, 40, 40], [(0, 0)] * 3), ([13, 50, 27, 8], [(0, 5), (1, 20), (0, 0), (2, 3)]), ([7], [(0, 0)])],
)
def test_interleave_closed_form_equals_the_merge_by_key(remainder, sizes, positions):
    if remainder is Remainder.DROP:
        sizes = [max(n, 5) for n in sizes]
    schedule = LaneSchedule(lane_batches(sizes, positions, remainder=remainder))
    merged = merged_by_key(schedule, 60)
    walker = ScheduleWalker(schedule)
    for j, expected in enumerate(merged):
        assert schedule.pick(j) == expected
        assert schedule.pick_of(*expected) == j
        assert walker.pick(j) == expected
        counts = [sum(1 for m, _ in merged[: j + 1] if m == lane) for lane in range(len(sizes))]
        assert schedule.counts_after(j + 1) == counts


def test_lanes_advance_at_rates_proportional_to_their_sizes():
    schedule = LaneSchedule(lane_batches([100, 300, 37], [(0, 0)] * 3, batch=4))
    sizes = schedule.sizes
    for picks in (50, 109, 400):
        counts = schedule.counts_after(picks)
        epochs = [c * 4 / n for c, n in zip(counts, sizes)]
        assert max(epochs) - min(epochs) <= max(4 / n for n in sizes) + 1e-9


@pytest.mark.parametrize("remainder", list(Remainder))
@pytest.mark.parametrize("size,batch", [(10, 3), (9, 3), (4, 7), (1, 1)])
def test_advance_equals_stepping_batch_by_batch(remainder, size, batch):
    if remainder is Remainder.DROP and size < batch:
        with pytest.raises(ValueError, match="drop every sample"):
            StreamGeometry(size, batch, remainder)
        return
    geometry = StreamGeometry(size, batch, remainder)
    epoch, offset = 0, 0
    for k in range(1, 25):
        segments = geometry.segments(epoch, offset)
        last = segments[-1]
        epoch, offset = last.epoch, last.stop
        if remainder is Remainder.CARRY:
            epoch, offset = divmod(epoch * size + offset, size)
        assert geometry.normalize(*geometry.advance(0, 0, k)) == geometry.normalize(epoch, offset)
        assert geometry.batch_index(0, 0, segments[0].epoch, segments[0].start) == k - 1


def test_carry_batches_run_across_the_epoch_edge():
    geometry = StreamGeometry(10, 4, Remainder.CARRY)
    segments = geometry.segments(*geometry.advance(0, 0, 2))
    assert [(s.epoch, s.start, s.stop) for s in segments] == [(0, 8, 10), (1, 0, 2)]


@pytest.mark.parametrize("n,batch,world", [(103, 8, 4), (64, 8, 8), (5, 4, 3), (1, 1, 1)])
def test_eval_order_reads_every_sample_once_in_stored_order_with_a_mask(n, batch, world):
    order = EvalOrder(n, batch_size=batch, world_size=world)
    real = []
    for rank in range(world):
        steps = [b for w in range(2) for b in order.rank_batches(rank, w, 2)]
        assert len(steps) == order.steps
        for b in sorted(steps, key=lambda b: b.step):
            assert b.sample_ids.size == batch
            real.extend(b.sample_ids[b.mask].tolist())
    assert real == list(range(n))


def test_mixture_counts_stay_within_a_draw_or_two_of_the_weights():
    schedule = MixtureSchedule([0.5, 0.3, 0.15, 0.05], seed=7)
    weights = np.array([0.5, 0.3, 0.15, 0.05])
    for draws in [0, 1, 17, 1000, 123_457, 10**12 + 3]:
        counts = np.array(schedule.counts_after(draws))
        assert counts.sum() == draws
        assert np.abs(counts - weights * draws).max() <= 2


def test_mixture_schedule_seeks_to_what_iteration_produces():
    schedule = MixtureSchedule([3, 1, 1], seed=1)
    counts = [0, 0, 0]
    for draw in range(500):
        assert schedule.counts_after(draw) == counts
        dataset, local = schedule.dataset_of(draw)
        assert local == counts[dataset]
        counts[dataset] += 1


def test_mixture_schedule_is_pinned_by_seed():
    draws = [MixtureSchedule([0.5, 0.3, 0.2], seed=3).dataset_of(g)[0] for g in range(10)]
    assert draws == [2, 0, 1, 0, 1, 0, 2, 0, 1, 0]
    assert draws != [MixtureSchedule([0.5, 0.3, 0.2], seed=4).dataset_of(g)[0] for g in range(10)]


def test_mixture_refuses_non_positive_weights():
    with pytest.raises(ValueError, match="positive"):
        MixtureSchedule([1.0, 0.0])


def test_sample_seed_golden_values_never_change():
    assert [sample_seed(1, 0, i) for i in range(3)] == [9308711592695113472, 7230677352598981310, 5255115996746269511]


def test_vectorised_sample_seeds_equal_scalar():
    ids = np.array([0, 5, 2**40, 999])
    assert sample_seeds(3, 2, ids).tolist() == [sample_seed(3, 2, int(i)) for i in ids]


def test_sample_rng_is_the_same_everywhere_and_differs_by_epoch_and_id():
    assert sample_rng(1, 0, 5).random() == 0.09602827595925512
    assert sample_rng(1, 0, 5).random() == sample_rng(1, 0, 5).random()
    assert sample_rng(1, 1, 5).random() != sample_rng(1, 0, 5).random()
    assert sample_rng(1, 0, 6).random() != sample_rng(1, 0, 5).random()
