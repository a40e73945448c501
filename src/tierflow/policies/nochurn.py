"""No-churn caching: once full, what is cached stays (CoorDL's MinIO cache).

Under a fresh uniform shuffle every epoch, every entry is equally likely to be read
next, so swapping one cached entry for another can only lose: the optimum is to fill
the cache once and keep it. Entries not read during a whole epoch have left the
working set (a dataset was dropped, the order changed) and become evictable.
"""

from __future__ import annotations

from collections import OrderedDict

from tierflow.policies.base import CachePolicy, EntryStats


class NoChurnPolicy(CachePolicy):
    """Admits only while there is room or a stale entry to replace; O(1) per event.

    An entry is stale when it was not read in the current or the previous epoch (the
    caller reports epoch ends through `on_epoch_end`). When the caller must cache an
    entry anyway (it is being read from the tier) and nothing is stale, the victim is
    the most recently used unpinned entry, so churn stays confined to one slot and the
    long-standing entries keep paying off.
    """

    name = "nochurn"

    def __init__(self, epoch: int = 0) -> None:
        super().__init__()
        self.epoch = int(epoch)
        self._last_access: dict[str, float] = {}
        self._stamp: dict[str, int] = {}
        self._order: OrderedDict[str, None] = OrderedDict()
        self._order_stale = False

    def on_epoch_end(self, now: float) -> None:
        self._observe(now)
        self.epoch += 1

    def is_stale(self, key: str) -> bool:
        """Whether `key` went unread for a whole epoch and may be replaced."""
        return self._stamp[key] < self.epoch - 1

    def _oldest(self) -> str | None:
        if self._order_stale:
            ranked = sorted(self._order, key=self._last_access.__getitem__)
            self._order = OrderedDict.fromkeys(ranked)
            self._order_stale = False
        return next(iter(self._order), None)

    def admit(self, key: str, size: int, now: float, free_bytes: int) -> bool:
        self._observe(now)
        if size <= free_bytes:
            return True
        oldest = self._oldest()
        return oldest is not None and self.is_stale(oldest)

    def on_insert(self, key: str, size: int, now: float) -> None:
        self._observe(now)
        self._last_access[key] = now
        self._stamp[key] = self.epoch
        self._order[key] = None

    def on_access(self, key: str, now: float) -> None:
        self._observe(now)
        self._last_access[key] = now
        self._stamp[key] = self.epoch
        if key not in self._pins:
            self._order.move_to_end(key)

    def on_remove(self, key: str) -> None:
        self._forget_pins(key)
        del self._last_access[key]
        del self._stamp[key]
        self._order.pop(key, None)

    def victim(self, now: float) -> str | None:
        oldest = self._oldest()
        if oldest is None or self.is_stale(oldest):
            return oldest
        return next(reversed(self._order))

    def stats(self, key: str) -> EntryStats:
        return {"last_access": self._last_access[key], "epoch": self._stamp[key]}

    def restore(self, key: str, size: int, stats: EntryStats) -> None:
        self._last_access[key] = float(stats.get("last_access", 0.0))
        self._stamp[key] = min(int(stats.get("epoch", self.epoch)), self.epoch)
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
        self._stamp[key] = self.epoch
        self._order[key] = None
