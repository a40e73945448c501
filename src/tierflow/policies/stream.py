"""Streaming: drop an entry as soon as its use ends (single-pass training).

In a single pass nothing is read twice, so the entry just finished is the one to
drop, and evicting older entries to cache a point read buys nothing.
"""

from __future__ import annotations

from collections import OrderedDict

from tierflow.policies.base import CachePolicy, EntryStats


class StreamPolicy(CachePolicy):
    """Evicts the most recently used unpinned entry; admits only into free room. O(1).

    Entries in use are pinned by the tier, so the victim is the one whose use ended
    last. Should the single-pass assumption be wrong (a loop), the older entries stay
    resident, which is also the right thing for cyclic access.
    """

    name = "stream"

    def __init__(self) -> None:
        super().__init__()
        self._last_access: dict[str, float] = {}
        self._order: OrderedDict[str, None] = OrderedDict()
        self._order_stale = False

    def admit(self, key: str, size: int, now: float, free_bytes: int) -> bool:
        return size <= free_bytes

    def on_insert(self, key: str, size: int, now: float) -> None:
        self._observe(now)
        self._last_access[key] = now
        self._order[key] = None

    def on_access(self, key: str, now: float) -> None:
        self._observe(now)
        self._last_access[key] = now
        if key not in self._pins:
            self._order.move_to_end(key)

    def on_remove(self, key: str) -> None:
        self._forget_pins(key)
        del self._last_access[key]
        self._order.pop(key, None)

    def victim(self, now: float) -> str | None:
        if self._order_stale:
            ranked = sorted(self._order, key=self._last_access.__getitem__)
            self._order = OrderedDict.fromkeys(ranked)
            self._order_stale = False
        return next(reversed(self._order), None) if self._order else None

    def stats(self, key: str) -> EntryStats:
        return {"last_access": self._last_access[key]}

    def restore(self, key: str, size: int, stats: EntryStats) -> None:
        self._last_access[key] = float(stats.get("last_access", 0.0))
        self._order[key] = None
        self._order_stale = True

    def __contains__(self, key: object) -> bool:
        return key in self._last_access

    def __len__(self) -> int:
        return len(self._last_access)

    def _withdraw(self, key: str) -> None:
        del self._order[key]

    def _reinstate(self, key: str, now: float) -> None:
        self._last_access[key] = max(self._last_access[key], now)
        self._order[key] = None
