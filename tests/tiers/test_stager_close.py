"""Stager.close while the stager is planning returns when the plan does, not after its rest.

The Loader closes the stager at every `for` (no thread may run across the workers' fork), so a
close that waits out the planner's 0.5 s rest costs every epoch half a second (found by the
fault-injection tests, whose loader epochs took 0.6 s instead of 0.1 s).
"""

from __future__ import annotations

import json
import threading
import time

import tierflow
from tierflow.loader import TieredDataset
from tierflow.tiers import TierConfig, build_stack
from tierflow.tiers.stager import Stager


def test_close_during_a_plan_returns_when_the_plan_ends(tmp_path):
    with open(tmp_path / "docs.jsonl", "w") as f:
        for i in range(2000):
            f.write(json.dumps({"text": f"{i:05d} " + "lorem ipsum " * (i % 23)}) + "\n")
    tierflow.pack([tmp_path / "docs.jsonl"], tmp_path / "ds", tokenizer="bytes", workers=1,
                  target_shard_bytes=256 << 10)
    stack = build_stack(str(tmp_path / "ds"), [TierConfig("L2", str(tmp_path / "l2"), 1 << 30)])
    stager = Stager(TieredDataset(stack.dataset(), batch_size=8, seq_len=64), stack, min_batches=4)
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
