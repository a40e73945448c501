"""Least-recently-used eviction: what every peer loader does, and our baseline."""

from __future__ import annotations

from collections import OrderedDict

from tierflow.policies.base import CachePolicy, EntryStats


class LRUPolicy(CachePolicy):
    """Evicts the entry read longest ago. O(1) per event.

    After `restore` the recency order is rebuilt once, lazily, at the next `victim()`.
    """

    name = "lru"

    def __init__(self) -> None:
        super().__init__()
        self._last_access: dict[str, float] = {}
        self._order: OrderedDict[str, None] = OrderedDict()
        self._order_stale = False

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
        return next(iter(self._recency()), None)

    def _recency(self) -> OrderedDict[str, None]:
        """Unpinned entries, least recently used first."""
        if self._order_stale:
            ranked = sorted(self._order, key=self._last_access.__getitem__)
            self._order = OrderedDict.fromkeys(ranked)
            self._order_stale = False
        return self._order

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
