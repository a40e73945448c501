"""Streaming: drop an entry as soon as its use ends (single-pass training).

In a single pass nothing is read twice, so the entry just finished is the one to
drop, and evicting older entries to cache a point read buys nothing.
"""

from __future__ import annotations

from tierflow.policies.lru import LRUPolicy


class StreamPolicy(LRUPolicy):
    """Evicts the most recently used unpinned entry; admits only into free room. O(1).

    Entries in use are pinned by the tier, so the victim is the one whose use ended
    last. Should the single-pass assumption be wrong (a loop), the older entries stay
    resident, which is also the right thing for cyclic access. The bookkeeping is LRU's;
    only the end of the recency order it evicts from differs.
    """

    name = "stream"

    def admit(self, key: str, size: int, now: float, free_bytes: int) -> bool:
        return size <= free_bytes

    def victim(self, now: float) -> str | None:
        order = self._recency()
        return next(reversed(order), None) if order else None
