"""Clairvoyant eviction (Belady's MIN with bypass): the optimum when the order is known.

The loader knows its future order, so it can evict the entry needed furthest in the
future and refuse to cache one needed later than everything already cached. An entry
inside one of its use intervals is in use (its next use is now) and is kept first.
"""

from __future__ import annotations

import heapq
import math

from tierflow.policies.base import CachePolicy, EntryStats, NextUseOracle


class ClairvoyantPolicy(CachePolicy):
    """Evicts the entry whose next use is furthest away; O(log n) per event.

    Each entry's next use is asked of the oracle when it is inserted, read or unpinned,
    and again for every entry when the oracle is replaced or an epoch ends (so a
    prediction that passed without the read it promised cannot keep an entry forever).
    Without an oracle it falls back to LRU. Sizes are not weighed: with several victims
    needed, admission is decided against the furthest one (exact for equal-sized shards).
    """

    name = "clairvoyant"

    def __init__(self, oracle: NextUseOracle | None = None) -> None:
        super().__init__()
        self._last_access: dict[str, float] = {}
        self._ranked: dict[str, tuple[float, str]] = {}
        self._heap: list[tuple[float, str]] = []
        self._oracle = oracle

    def _distance(self, key: str, now: float) -> float:
        """Bigger is evicted first: the next use, or the idle time's negation without an oracle."""
        if self._oracle is None:
            return -self._last_access[key]
        return self._oracle.next_use(key, now)

    def _rank(self, key: str, now: float) -> None:
        item = (-self._distance(key, now), key)
        self._ranked[key] = item
        heapq.heappush(self._heap, item)
        if len(self._heap) > 2 * len(self._ranked) + 64:
            self._rerank_all(now)

    def _rerank_all(self, now: float) -> None:
        self._ranked = {key: (-self._distance(key, now), key) for key in self._last_access if key not in self._pins}
        self._heap = list(self._ranked.values())
        heapq.heapify(self._heap)

    def next_use(self, key: str, now: float) -> float:
        """When the oracle says `key` is needed next (math.inf without an oracle)."""
        return math.inf if self._oracle is None else self._oracle.next_use(key, now)

    def set_oracle(self, oracle: NextUseOracle | None) -> None:
        self._oracle = oracle
        self._rerank_all(self._latest)

    def on_epoch_end(self, now: float) -> None:
        self._observe(now)
        self._rerank_all(now)

    def admit(self, key: str, size: int, now: float, free_bytes: int) -> bool:
        self._observe(now)
        if self._oracle is None:
            return True
        wanted = self._oracle.next_use(key, now)
        if wanted == math.inf:
            return False
        if size <= free_bytes:
            return True
        rival = self.victim(now)
        return rival is not None and wanted < -self._ranked[rival][0]

    def admit_read(self, key: str, size: int, now: float, free_bytes: int) -> bool:
        """A reader's entry is read from below this once unless its next use after this one is
        sooner than the furthest resident's (Belady with bypass: caching it would cost a hit)."""
        self._observe(now)
        if self._oracle is None or size <= free_bytes:
            return True
        wanted = self._oracle.use_after_current(key, now)
        rival = self.victim(now)
        return rival is not None and wanted < -self._ranked[rival][0]

    def on_insert(self, key: str, size: int, now: float) -> None:
        self._observe(now)
        self._last_access[key] = now
        self._rank(key, now)

    def on_access(self, key: str, now: float) -> None:
        self._observe(now)
        self._last_access[key] = now
        if key not in self._pins:
            self._rank(key, now)

    def on_remove(self, key: str) -> None:
        self._forget_pins(key)
        del self._last_access[key]
        self._ranked.pop(key, None)

    def victim(self, now: float) -> str | None:
        heap, ranked = self._heap, self._ranked
        while heap:
            top = heap[0]
            if ranked.get(top[1]) is top:
                return top[1]
            heapq.heappop(heap)
        return None

    def stats(self, key: str) -> EntryStats:
        return {"last_access": self._last_access[key]}

    def restore(self, key: str, size: int, stats: EntryStats) -> None:
        last_access = float(stats.get("last_access", 0.0))
        self._observe(last_access)
        self._last_access[key] = last_access
        self._rank(key, self._latest)

    def __contains__(self, key: object) -> bool:
        return key in self._last_access

    def __len__(self) -> int:
        return len(self._last_access)

    def _withdraw(self, key: str) -> None:
        del self._ranked[key]

    def _reinstate(self, key: str, now: float) -> None:
        self._observe(now)
        self._last_access[key] = max(self._last_access[key], now)
        self._rank(key, now)
