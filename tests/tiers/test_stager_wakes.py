"""The stager's thread wakes when a plan is due or a pin can go, not once per consumed batch.

Woken per batch, the thread took the GIL from the loop for every batch to find it had nothing to do:
a warm epoch behind a full L2 ran at half the steps/s of the same loop without a stager. Counted
here in the thread's own rounds, not timed."""

from __future__ import annotations

from pathlib import Path

import pytest

from tierflow.loader import Loader, TieredDataset, BatchSpec, OrderSpec
from tierflow.tiers import TierConfig, build_stack
from tierflow.tiers.stager import Stager

from corpora import pack_lorem

BATCHES = 400


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pack_lorem(tmp_path_factory.mktemp("stager-wakes"), 12000)


class CountedStager(Stager):
    """A Stager that counts its thread's rounds that did not plan."""

    idle_rounds = 0

    def _release_passed(self) -> None:
        self.idle_rounds += 1
        super()._release_passed()


def test_a_warm_loop_does_not_wake_the_stager_per_batch(dataset: Path, tmp_path: Path) -> None:
    stack = build_stack(str(dataset), [TierConfig("L2", str(tmp_path / "l2"), 1.0)])
    try:
        ds = TieredDataset(stack.dataset(), BatchSpec(batch_size=8, seq_len=64), OrderSpec(seed=3))
        for info in stack.manifest().shards:
            stack.ensure(info).release()
        stager = CountedStager(ds, stack)
        loader = Loader(ds, stager=stager, endless=True)
        loader.start_prefetch()
        batches = iter(loader)
        for _ in range(BATCHES):
            next(batches)
        idle = stager.idle_rounds
        loader.close()
    finally:
        stack.close()
    # woken per batch it went round 72 times in 400 batches to do nothing; now at its idle look (every
    # 0.5 s) and where a pin can go (plans, paced by their own cost, are not counted)
    assert idle < BATCHES / 20, idle
