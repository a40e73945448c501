"""The stager's plan, without threads or tiers: lookahead sizing, the budget, holds, epoch edges."""

from __future__ import annotations

import math
import time

import numpy as np
from hypothesis import given, settings, strategies as st

from tierflow.loader import TieredDataset, BatchSpec, OrderSpec
from tierflow.order import RankStream, SampleOrder, ShardUse, future_shard_uses
from tierflow.tiers import TierConfig, build_stack
from tierflow.tiers.plan import ORACLE_SHARDS, FutureView, NodeShape, merged_spans, passed, plan_staging, size_lookahead
from tierflow.tiers.stager import Stager

from corpora import pack_lorem

SHARD = 100  # bytes of every shard
STEP = 10  # node samples per step


def shape(**changes) -> NodeShape:
    base = dict(
        shard_bytes=SHARD,
        bytes_per_step=50.0,
        samples_per_step=STEP,
        min_batches=4,
        max_bytes=10_000,
        next_windows_bytes=2 * SHARD,
        capacity=20_000,
        dataset_bytes=50_000,
        staging_slots=2,
    )
    return NodeShape(**{**base, **changes})


def windows(count: int, per_window: int = 2, steps: int = 3, start: int = 0, epoch: int = 0) -> list[ShardUse]:
    """Consecutive windows of `per_window` shards, each read for `steps` steps, shards numbered in order."""
    uses = []
    for w in range(count):
        first = start + w * steps * STEP
        for k in range(per_window):
            uses.append(ShardUse(w * per_window + k, first, first + steps * STEP - 1, epoch, 0))
    return uses


# ---------------------------------------------------------------- lookahead


def test_without_measurements_the_lookahead_is_the_larger_of_min_batches_and_the_next_windows():
    assert size_lookahead(shape(), 0.0, 1.0, 1.0).bytes == 4 * 50.0
    assert size_lookahead(shape(next_windows_bytes=700), 0.0, 1.0, 1.0).bytes == 700


def test_the_lookahead_follows_littles_law_with_a_2x_margin_and_stops_at_max_bytes():
    node = shape()
    ahead = size_lookahead(node, consumption_bytes_s=1000.0, fetch_p99_s=0.5, fetch_mean_s=0.25)
    assert ahead.bytes == 2 * 1000.0 * (0.5 + 0.25)
    assert ahead.horizon_steps == math.ceil(1500 / 50)
    assert size_lookahead(node, 1e9, 1.0, 1.0).bytes == node.max_bytes
    assert size_lookahead(shape(max_bytes=60), 1e9, 1.0, 1.0).horizon_steps == node.min_batches


def test_a_burst_stretches_the_lookahead_to_cover_it_within_max_bytes_and_it_returns_after():
    """During a checkpoint upload expected to last `cover_s`, the lookahead is at least what the
    loop consumes meanwhile (rate x seconds), never past max_bytes, and the plan fetches that far."""
    node = shape(staging_slots=100)
    before = size_lookahead(node, 100.0, 0.1, 0.1)
    during = size_lookahead(node, 100.0, 0.1, 0.1, cover_s=30.0)
    assert before.bytes == 4 * 50.0 and during.bytes == 100.0 * 30.0
    assert during.horizon_steps == math.ceil(3000 / 50) > before.horizon_steps
    assert size_lookahead(node, 100.0, 0.1, 0.1, cover_s=1e6).bytes == node.max_bytes
    assert size_lookahead(node, 100.0, 0.1, 0.1, cover_s=0.0) == before
    uses = windows(40)
    calm = plan_staging(uses, node, consumption_bytes_s=100.0, fetch_p99_s=0.1, fetch_mean_s=0.1, resident=set())
    riding = plan_staging(
        uses, node, consumption_bytes_s=100.0, fetch_p99_s=0.1, fetch_mean_s=0.1, resident=set(), cover_s=30.0
    )
    assert len(riding.fetch) >= 3000 // SHARD > len(calm.fetch)
    assert riding.fetch[: len(calm.fetch)] == calm.fetch  # the same order of first use, only further


def test_the_view_covers_twice_what_the_tier_holds_or_the_dataset_without_a_tier():
    assert size_lookahead(shape(), 0.0, 1.0, 1.0).view_steps == math.ceil(2 * 20_000 / 50)
    assert size_lookahead(shape(capacity=0), 0.0, 1.0, 1.0).view_steps == math.ceil(2 * 50_000 / 50)
    assert size_lookahead(shape(capacity=10), 1e9, 1.0, 1.0).view_steps == 200  # never short of the horizon


def test_the_view_of_a_huge_tier_stops_at_oracle_shards_and_never_short_of_the_horizon():
    huge = shape(capacity=SHARD * 300_000, dataset_bytes=SHARD * 1_000_000, max_bytes=SHARD * 300_000)
    assert size_lookahead(huge, 0.0, 1.0, 1.0).view_steps == math.ceil(ORACLE_SHARDS * SHARD / 50)
    assert size_lookahead(huge, 1e9, 1.0, 1.0).view_steps == math.ceil(SHARD * 300_000 / 50)  # the horizon


def test_a_faster_loop_plans_further_ahead():
    uses = windows(40)
    slow = plan_staging(uses, shape(), consumption_bytes_s=10.0, resident=None)
    fast = plan_staging(uses, shape(), consumption_bytes_s=2000.0, resident=None)
    assert set(slow.fetch) < set(fast.fetch)
    limit = fast.lookahead.horizon_steps * STEP
    assert set(fast.fetch) == {u.shard for u in uses if u.first_use < limit}


# ---------------------------------------------------------------- the budget


def test_shards_are_fetched_in_order_of_first_use():
    uses = sorted(windows(10), key=lambda u: (u.first_use, -u.shard))
    plan = plan_staging(uses, shape(), consumption_bytes_s=1e6, resident=None)
    firsts = {}
    for use in uses:
        firsts.setdefault(use.shard, use.first_use)
    assert list(plan.fetch) == sorted(plan.fetch, key=lambda s: firsts[s])
    assert len(set(plan.fetch)) == len(plan.fetch)


def test_the_windows_being_read_now_are_fetched_whatever_the_budget():
    uses = windows(5)
    plan = plan_staging(uses, shape(max_bytes=0, next_windows_bytes=0, min_batches=1), resident=None)
    assert plan.fetch == (0, 1)  # read from position 0: needed now, not "ahead"


def test_every_lanes_window_being_read_is_taken_and_the_budget_buys_the_next_windows():
    # two lanes, windows of 2 shards read for 6 steps, interleaved: lane b's next batch is a step
    # after lane a's, so its window's first use from the cursor is 10, not 0
    lane_a = [ShardUse(s, f, f + 59, 0, 0) for f, pair in ((0, (0, 1)), (60, (4, 5))) for s in pair]
    lane_b = [ShardUse(s, f, f + 59, 0, 1) for f, pair in ((10, (2, 3)), (70, (6, 7))) for s in pair]
    uses = sorted(lane_a + lane_b, key=lambda u: (u.first_use, u.shard))
    node = shape(next_windows_bytes=4 * SHARD, min_batches=1, reading_shards=4)
    plan = plan_staging(uses, node, consumption_bytes_s=0.0, resident=None)
    assert plan.fetch == (0, 1, 2, 3, 4, 5, 6, 7)  # both windows being read, then both next ones
    held = plan_staging(uses, node, consumption_bytes_s=0.0, resident=None, held={0, 1, 2, 3})
    assert held.fetch == (4, 5, 6, 7)  # the windows being read cost none of the budget


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 40), st.integers(0, 400), st.integers(1, 60)), max_size=80),
    st.integers(0, 3000),
    st.floats(0, 5000),
    st.integers(0, 4),
    st.sets(st.integers(0, 40)),
    st.sets(st.integers(0, 40)),
    st.booleans(),
)
def test_a_plan_never_aims_beyond_its_budget_or_the_staging_slots(raw, max_bytes, rate, slots, resident, held, tiered):
    uses = sorted((ShardUse(s, f, f + n, 0, 0) for s, f, n in raw), key=lambda u: (u.first_use, u.shard))
    node = shape(max_bytes=max_bytes, staging_slots=slots)
    plan = plan_staging(uses, node, consumption_bytes_s=rate, resident=resident if tiered else None, held=held)
    assert plan.lookahead.bytes <= max_bytes
    now = {u.shard for u in uses if u.first_use <= 0}
    ahead = [s for s in plan.fetch if s not in now]
    assert len(ahead) * SHARD <= plan.lookahead.bytes
    if tiered:
        assert len([s for s in ahead if s not in resident]) <= slots
    assert not set(plan.fetch) & held
    limit = plan.lookahead.horizon_steps * STEP
    assert all(any(u.shard == s and u.first_use < limit for u in uses) for s in plan.fetch)


def test_held_shards_count_against_the_budget_but_are_not_fetched_again():
    uses = windows(10)
    node = shape(max_bytes=4 * SHARD, next_windows_bytes=0, min_batches=1)
    free = plan_staging(uses, node, consumption_bytes_s=1e6, resident=None)
    assert free.fetch == (0, 1, 2, 3, 4, 5)  # the window being read, then 4 shards of budget
    held = plan_staging(uses, node, consumption_bytes_s=1e6, resident=None, held={2, 3}, in_flight={4})
    assert held.fetch == (0, 1, 5)


def test_only_the_staging_slots_pass_through_staging_when_the_top_tier_does_not_hold_a_shard():
    uses = windows(10)
    node = shape(staging_slots=2)
    plan = plan_staging(uses, node, consumption_bytes_s=1e6, resident=set())
    assert plan.fetch == (0, 1, 2, 3)  # the window being read, then two shards through staging
    resident = plan_staging(uses, node, consumption_bytes_s=1e6, resident={2, 3, 4, 5})
    assert resident.fetch == (0, 1, 2, 3, 4, 5, 6, 7)  # resident shards take no slot


def test_the_windows_a_faster_rank_reads_are_wanted_whatever_the_budget_and_held_for_the_slowest():
    uses = windows(10)  # windows of 2 shards, 3 steps (30 samples) each
    node = shape(max_bytes=0, next_windows_bytes=0, min_batches=1)
    alone = plan_staging(uses, node, resident=None)
    assert alone.fetch == (0, 1)
    ahead = plan_staging(uses, node, resident=None, lead=65)  # the fastest rank is in window 2
    assert ahead.fetch == (0, 1, 2, 3, 4, 5)
    assert all(ahead.hold_until[s] == uses[s].last_use for s in ahead.fetch)
    budgeted = plan_staging(
        uses,
        shape(max_bytes=2 * SHARD, next_windows_bytes=0, min_batches=1),
        consumption_bytes_s=1e6,
        resident=None,
        lead=65,
    )
    assert budgeted.fetch == (0, 1, 2, 3, 4, 5, 6, 7)  # then the budget ahead of the fastest


# ---------------------------------------------------------------- holds


def test_a_staged_shard_is_held_to_the_end_of_its_next_use_only():
    uses = sorted(windows(3) + [ShardUse(0, 500, 529, 1, 0)], key=lambda u: (u.first_use, u.shard))
    plan = plan_staging(uses, shape(), consumption_bytes_s=1e6, resident=None)
    assert plan.hold_until[0] == 29  # its next use ends at 29; the one at 500 is a later use
    assert plan.hold_until[4] == 89
    assert (0, 0, 29) in plan.intervals and (0, 500, 529) in plan.intervals


def test_held_and_in_flight_shards_are_held_to_their_use_even_past_the_horizon():
    uses = windows(60)
    plan = plan_staging(uses, shape(), resident=None, held={100}, in_flight={110})
    limit = plan.lookahead.horizon_steps * STEP
    far = [u for u in uses if u.shard in (100, 110)]
    assert all(u.first_use >= limit for u in far)
    assert plan.hold_until[100] == far[0].last_use and plan.hold_until[110] == far[1].last_use
    assert not {100, 110} & set(plan.fetch)
    assert not [s for s in plan.hold_until if s not in (100, 110) and uses[s].first_use >= limit]


def test_a_held_shard_whose_use_has_passed_is_released():
    uses = windows(10)
    plan = plan_staging(uses, shape(), resident=None, held={0, 1, 2, 99}, position=35)
    assert set(plan.release) == {0, 1, 99}  # window 0 ended at 29; shard 99 is not used again
    assert set(passed(plan.hold_until, {0, 2, 99}, 35)) == {0, 99}
    assert 0 in plan.fetch  # released and wanted again is fetched again (its use began before the cursor)


def test_spans_of_one_shard_merge_when_they_touch():
    assert merged_spans([(10, 20), (0, 5), (5, 8), (21, 30)]) == [(0, 8), (10, 20), (21, 30)]
    assert merged_spans([(0, 10), (3, 4)]) == [(0, 10)]


# ---------------------------------------------------------------- epoch edges, from a real order


def test_across_the_epoch_edge_the_next_epochs_first_windows_are_planned_and_each_use_is_held_apart():
    counts = [int(c) for c in np.random.default_rng(8).integers(3, 30, size=48)]
    order = SampleOrder(counts, dataset_id="plan", seed=4, partitions=4, window_shards=2)
    batch = 5
    per_node = int(sum(order.layout.partition_sizes))
    stream = RankStream(order, order.start(), batch_size=batch)
    cursor = stream.cursor_after(per_node // batch - 4)  # 4 steps before the end of epoch 0
    node = shape(
        shard_bytes=1,
        samples_per_step=batch,
        bytes_per_step=batch * 10.0,
        max_bytes=1e9,
        min_batches=12,
        staging_slots=100,
    )
    ahead = size_lookahead(node, 0.0, 1.0, 1.0)
    uses = future_shard_uses(order, cursor, node=0, num_nodes=1, batch_size=batch, horizon=ahead.view_steps * batch)
    plan = plan_staging(uses, node, resident=None)
    limit = ahead.horizon_steps * batch
    planned = {(u.shard, u.epoch) for u in uses if u.first_use < limit}
    assert {e for _, e in planned} == {0, 1}
    assert set(plan.fetch) == {s for s, _ in planned}
    for shard in plan.fetch:  # held to the end of its next use: the one in epoch 0 if it has one
        first = next(u for u in uses if u.shard == shard)
        assert plan.hold_until[shard] == first.last_use
    by_shard = {}
    for shard, first, last in plan.intervals:
        by_shard.setdefault(shard, []).append((first, last))
    for use in uses:  # the oracle knows every use, across the edge
        assert any(first <= use.first_use and use.last_use <= last for first, last in by_shard[use.shard])
    again = [s for s in plan.fetch if (s, 0) in planned and (s, 1) in planned]
    assert again, "some shard is read at the end of epoch 0 and again at the start of epoch 1"
    for shard in again:  # held through epoch 0's use (the next plan holds epoch 1's); the oracle joins them
        e0, e1 = (next(u for u in uses if u.shard == shard and u.epoch == e) for e in (0, 1))
        assert plan.hold_until[shard] == e0.last_use
        joined = e1.first_use <= e0.last_use
        assert any(first <= e0.first_use and e1.last_use <= last for first, last in by_shard[shard]) == joined


# ---------------------------------------------------------------- the view the stager reads


class OnlyTheView:
    """A dataset cut down to `FutureView`'s members: anything else the stager touched would fail."""

    def __init__(self, dataset: TieredDataset) -> None:
        self._dataset = dataset
        self.manifest, self.num_order_samples = dataset.manifest, dataset.num_order_samples
        self.working_set, self.world = dataset.working_set, dataset.world

    def node_step_samples(self) -> int:
        return self._dataset.node_step_samples()

    def future_shard_uses(self, cursor=None, horizon_batches: int = 64) -> list[ShardUse]:
        return self._dataset.future_shard_uses(cursor, horizon_batches)


def test_the_stager_reads_a_dataset_only_through_the_future_view(tmp_path):
    pack_lorem(tmp_path, 3000)
    stack = build_stack(str(tmp_path / "ds"), [TierConfig("L2", str(tmp_path / "l2"), 1 << 30, form="decoded")])
    dataset = TieredDataset(stack.dataset(), BatchSpec(batch_size=8, seq_len=64))
    assert isinstance(dataset, FutureView)
    stager = Stager(OnlyTheView(dataset), stack, min_batches=4)
    stager.start()
    deadline = time.monotonic() + 30
    while stager.snapshot()["fetches"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    stager.close()
    assert stager.snapshot()["fetches"] > 0 and stager.m_errors.value == 0


def test_the_windows_being_read_skip_the_budget_only_where_the_top_tier_holds_the_working_set(tmp_path):
    pack_lorem(tmp_path, 3000)
    for capacity, reading in ((1 << 30, True), (64 << 10, False)):
        stack = build_stack(
            str(tmp_path / "ds"), [TierConfig("L2", str(tmp_path / f"l2-{capacity}"), capacity, form="decoded")]
        )
        dataset = TieredDataset(
            stack.dataset(), BatchSpec(batch_size=8, seq_len=64), OrderSpec(window_shards=1, lanes=4)
        )
        node = Stager(dataset, stack, min_batches=4).node
        assert node.reading_shards == (dataset.working_set.reading if reading else 0), capacity
        stack.close()


def test_the_staging_area_has_room_for_any_working_set_and_the_window_just_left():
    """The staging area is the working set's size and holds one shard more than it at once (the window
    just left, pinned until the stager lets it go): sized by the mean, a small last shard left it short
    of three full ones, so a reader found it full of pins and its shard was fetched twice."""
    from tierflow.order.working_set import working_set_bytes

    full = 16_800_000
    assert working_set_bytes(2, [full] * 24 + [13_000_000]) >= 3 * full
    assert working_set_bytes(2, [10, 30, 20, 5]) == 60
    assert working_set_bytes(4, [10, 30]) == 40 and working_set_bytes(2, []) == 0
