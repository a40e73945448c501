"""No-churn caching: once full, what is cached stays (CoorDL's MinIO cache).

Under a fresh uniform shuffle every epoch, every entry is equally likely to be read
next, so swapping one cached entry for another can only lose: the optimum is to fill
the cache once and keep it. Entries not read during a whole epoch have left the
working set (a dataset was dropped, the order changed) and become evictable.
"""

from __future__ import annotations

from tierflow.policies.base import EntryStats
from tierflow.policies.lru import LRUPolicy


class NoChurnPolicy(LRUPolicy):
    """Admits only while there is room or a stale entry to replace; O(1) per event.

    An entry is stale when it was not read in the current or the previous epoch (the
    caller reports epoch ends through `on_epoch_end`). When the caller must cache an
    entry anyway (it is being read from the tier) and nothing is stale, the victim is
    the most recently used unpinned entry, so churn stays confined to one slot and the
    long-standing entries keep paying off. Recency bookkeeping is LRU's; this adds the
    epoch stamp of each entry's last read.
    """

    name = "nochurn"

    def __init__(self, epoch: int = 0) -> None:
        super().__init__()
        self.epoch = int(epoch)
        self._stamp: dict[str, int] = {}

    def on_epoch_end(self, now: float) -> None:
        self._observe(now)
        self.epoch += 1

    def is_stale(self, key: str) -> bool:
        """Whether `key` went unread for a whole epoch and may be replaced."""
        return self._stamp[key] < self.epoch - 1

    def _oldest(self) -> str | None:
        return next(iter(self._recency()), None)

    def admit(self, key: str, size: int, now: float, free_bytes: int) -> bool:
        self._observe(now)
        if size <= free_bytes:
            return True
        oldest = self._oldest()
        return oldest is not None and self.is_stale(oldest)

    def admit_read(self, key: str, size: int, now: float, free_bytes: int) -> bool:
        """Full of fresh entries, a reader's entry is read from below rather than churned in."""
        return self.admit(key, size, now, free_bytes)

    def on_insert(self, key: str, size: int, now: float) -> None:
        super().on_insert(key, size, now)
        self._stamp[key] = self.epoch

    def on_access(self, key: str, now: float) -> None:
        super().on_access(key, now)
        self._stamp[key] = self.epoch

    def on_remove(self, key: str) -> None:
        super().on_remove(key)
        del self._stamp[key]

    def victim(self, now: float) -> str | None:
        oldest = self._oldest()
        if oldest is None or self.is_stale(oldest):
            return oldest
        return next(reversed(self._order))

    def stats(self, key: str) -> EntryStats:
        return {**super().stats(key), "epoch": self._stamp[key]}

    def restore(self, key: str, size: int, stats: EntryStats) -> None:
        super().restore(key, size, stats)
        self._stamp[key] = min(int(stats.get("epoch", self.epoch)), self.epoch)

    def _reinstate(self, key: str, now: float) -> None:
        super()._reinstate(key, now)
        self._stamp[key] = self.epoch
