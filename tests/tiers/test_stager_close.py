"""Stager.close while the stager is planning returns when the plan does, not after its rest.

The Loader closes the stager at every `for` (no thread may run across the workers' fork), so a
close that waits out the planner's 0.5 s rest costs every epoch half a second (found by the
fault-injection tests, whose loader epochs took 0.6 s instead of 0.1 s).
"""

from __future__ import annotations

import threading
import time

from tierflow.loader import TieredDataset, BatchSpec
from tierflow.tiers import TierConfig, build_stack
from tierflow.tiers.stager import Stager

from corpora import pack_lorem


def test_close_during_a_plan_returns_when_the_plan_ends(tmp_path):
    pack_lorem(tmp_path, 2000)
    stack = build_stack(str(tmp_path / "ds"), [TierConfig("L2", str(tmp_path / "l2"), 1 << 30)])
    stager = Stager(TieredDataset(stack.dataset(), BatchSpec(batch_size=8, seq_len=64)), stack, min_batches=4)
    planning, release = threading.Event(), threading.Event()
    plan = stager._plan_and_fetch

    def held_plan() -> None:
        planning.set()
        release.wait(10)
        plan()

    stager._plan_and_fetch = held_plan  # type: ignore[method-assign]
    stager.start()
    assert planning.wait(10)
    closer = threading.Thread(target=stager.close)
    closer.start()
    time.sleep(0.05)  # close has asked the planner to stop and woken it: it is still planning
    started = time.monotonic()
    release.set()
    closer.join(10)
    assert not closer.is_alive() and time.monotonic() - started < 0.3
