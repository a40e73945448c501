"""The stager's controls with a real dataset and tier: a stager another rank of the node runs for
(disabled) stages nothing, a stack without tiers gives it nothing to do, and a burst announced to
a stager that cannot cover it, or that closes, never leaves its owner waiting."""

from __future__ import annotations

import pytest

import tierflow
from tierflow.loader import TieredDataset, BatchSpec
from tierflow.tiers import TierConfig, build_stack
from tierflow.tiers.stager import Stager

from corpora import pack_lorem


@pytest.fixture(scope="module")
def lorem(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("stager-control")
    pack_lorem(root, 2000)
    return root / "ds"


def stager_for(lorem, tmp_path, tiers=True, **kw) -> Stager:
    configs = [TierConfig("L2", str(tmp_path / "l2"), 1 << 30)] if tiers else []
    stack = build_stack(str(lorem), configs)
    return Stager(TieredDataset(stack.dataset(), BatchSpec(batch_size=8, seq_len=64)), stack, min_batches=4, **kw)


def test_a_disabled_stager_stages_nothing_and_measures_nothing(lorem, tmp_path) -> None:
    """Another local rank's loader: the node's stager runs in local rank 0, this one only counts."""
    stager = stager_for(lorem, tmp_path, enabled=False)
    stager.start()
    for _ in range(5):
        stager.consumed(None)
    ride = stager.ride_through(60.0)
    assert ride.wait(timeout=0) and stager.burst_seconds() == 0.0  # covered as it is: nothing to wait for
    stager.close()
    assert stager.consumption_rate() == 0.0 and stager.snapshot()["fetches"] == 0
    assert not stager.stack.tiers[0].index.keys()


def test_a_stager_over_a_stack_without_tiers_plans_without_error_and_fetches_nothing(lorem, tmp_path) -> None:
    stager = stager_for(lorem, tmp_path, tiers=False)
    assert stager._resident() is None
    stager.start()
    stager.consumed(None)
    stager.close()
    assert stager.m_errors.value == 0 and stager.snapshot()["fetches"] == 0


def test_a_ride_before_any_consumption_is_measured_is_covered_at_once(lorem, tmp_path) -> None:
    stager = stager_for(lorem, tmp_path)
    stager.start()
    try:
        ride = stager.ride_through(60.0)  # 60 s of a rate not measured yet: nothing to stage for it
        assert ride.wait(timeout=0) and stager.burst_seconds() == 0.0
    finally:
        stager.close()


def test_closing_a_stager_releases_the_rides_waiting_on_it(lorem, tmp_path) -> None:
    """A checkpoint's `commit_async` waits on its ride for the pre-staging; a stager closing (the
    loader's `for` ending) will stage nothing more for it, so the wait ends instead of timing out."""
    dataset_bytes = sum(s.decoded_bytes for s in tierflow.open_dataset(lorem).manifest.shards)
    # it plans, and no fetch ever ends; a lookahead of a few epochs keeps each plan short
    stager = stager_for(lorem, tmp_path, max_bytes=3 * dataset_bytes, threads=0)
    stager.start()
    try:
        for _ in range(3):
            stager.consumed(None)
        ride = stager.ride_through(1e6)
        assert stager.burst_seconds() == 1e6 and ride.cover_bytes > 0
        assert not ride.wait(timeout=0.2)  # nothing it asked for is staged
    finally:
        stager.close()
    assert ride.wait(timeout=0)
    ride.end()
    assert stager.burst_seconds() == 0.0
