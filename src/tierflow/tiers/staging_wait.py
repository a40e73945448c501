"""Waiting for room in the node's shared staging area, apart from the stack that mixes it in."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from tierflow.format.shard import ShardInfo
from tierflow.telemetry import Counter
from tierflow.tiers._lock import Pin
from tierflow.tiers._staging import NodeProgress

log = logging.getLogger("tierflow.tiers")


class StagingWait:
    """`TierStack`'s wait for room in the node's staging area (a rank of the node behind this one)."""

    progress: NodeProgress | None
    staging_wait_s: float
    m_staging_waits: Counter
    m_staging_wait_s: Counter

    def _wait_for_room(self, info: ShardInfo, attempt: Callable[[], Pin | None]) -> Pin | None:
        """Every entry of the node's staging area is in use, read by the node's readers or held
        for a slower rank of the node: while a rank of the node is behind this one and moving, wait
        (it frees what it holds as it passes it, or brings this very shard in meanwhile) rather than
        read the shard into this process's memory, which fetches it once more. That keeps a rank
        within the staging area of the slowest. None when no rank is behind, or after
        `staging_wait_s` without the slowest moving. `attempt` tries the staging area again."""
        assert self.progress is not None
        started = last = time.monotonic()
        mine, slowest = self.progress.lag()
        if mine is None or slowest is None or slowest >= mine:
            return None
        self.m_staging_waits.inc()
        delay = 0.002
        try:
            while True:
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
                pin = attempt()  # the staging area's `ensure`, as the stack first tried it
                if pin is not None:
                    return pin
                now_mine, now_slowest = self.progress.lag()
                if now_mine is None or now_slowest is None or now_slowest >= now_mine:
                    return None  # none behind now: what holds the room is this rank's own
                if now_slowest != slowest:
                    slowest, last = now_slowest, time.monotonic()
                elif time.monotonic() - last > self.staging_wait_s:
                    log.warning(
                        "shard %s: the node's staging area stayed full and its slowest rank did not "
                        "move for %.0f s; reading the shard into memory",
                        info.name,
                        self.staging_wait_s,
                    )
                    return None
        finally:
            self.m_staging_wait_s.inc(time.monotonic() - started)
