"""Hot score: frequency decayed by idle time, boosted by co-access (the seed's improved LFU).

score = freq * 0.5 ** ((now - last_access) / half_life) * (1 + co_weight * co_access)

`now` multiplies every score by the same factor, so ranking by the log-domain key
ln freq + last_access * ln2 / half_life + ln(1 + co_weight * co_access) is the same at
every time: a heap keyed once per access never needs rescoring. The half-life is in
the caller's clock (seconds or epochs), never in global access counts, which would
make it degenerate to LRU.

Admission is frequency-gated (as in TinyLFU): once room must be made, a missed entry
is admitted only if its remembered key beats the victim's, so one-pass scans and
cyclic loops slightly larger than the cache do not flush the hot set.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict

from tierflow.policies.base import CachePolicy, EntryStats

_LN2 = math.log(2.0)


def hotscore_key(freq: float, last_access: float, co_access: float, half_life: float, co_weight: float = 0.3) -> float:
    """The time-invariant log-domain rank of an entry: higher stays, lowest is evicted."""
    return math.log(freq) + last_access * _LN2 / half_life + math.log1p(co_weight * co_access)


def hot_score(
    freq: float, last_access: float, co_access: float, half_life: float, now: float, co_weight: float = 0.3
) -> float:
    """The seed's score at time `now` (for reading and testing; ranking uses `hotscore_key`)."""
    return freq * 0.5 ** ((now - last_access) / half_life) * (1.0 + co_weight * co_access)


class HotScorePolicy(CachePolicy):
    """Evicts the entry with the lowest hot score; O(log n) per event.

    co_access is how many other entries were in use (pinned) when the entry was last
    read: shards read together in a shuffle window, or by several jobs at once. It is
    updated only on the entry's own access. Non-resident keys keep their statistics in a
    bounded history so a returning entry is ranked by its past.
    """

    name = "hotscore"

    def __init__(self, half_life: float = 1.0, co_weight: float = 0.3, history_limit: int = 1 << 20) -> None:
        super().__init__()
        if not half_life > 0:
            raise ValueError(f"hotscore: half_life must be positive, got {half_life}")
        self.half_life = float(half_life)
        self.co_weight = float(co_weight)
        self.history_limit = int(history_limit)
        self._entries: dict[str, list[float]] = {}  # key -> [freq, last_access, co_access]
        self._ranked: dict[str, tuple[float, float, str]] = {}
        self._heap: list[tuple[float, float, str]] = []
        self._history: OrderedDict[str, tuple[float, float, float]] = OrderedDict()

    def _key(self, freq: float, last_access: float, co_access: float) -> float:
        return hotscore_key(freq, last_access, co_access, self.half_life, self.co_weight)

    def _rank(self, key: str) -> None:
        freq, last_access, co_access = self._entries[key]
        item = (self._key(freq, last_access, co_access), last_access, key)
        self._ranked[key] = item
        heapq.heappush(self._heap, item)
        if len(self._heap) > 2 * len(self._ranked) + 64:
            self._heap = list(self._ranked.values())
            heapq.heapify(self._heap)

    def _co_access_now(self, key: str) -> int:
        return self.pinned_count - (1 if key in self._pins else 0)

    def _remember(self, key: str, freq: float, last_access: float, co_access: float) -> None:
        self._history[key] = (freq, last_access, co_access)
        self._history.move_to_end(key)
        while len(self._history) > self.history_limit:
            self._history.popitem(last=False)

    def admit(self, key: str, size: int, now: float, free_bytes: int) -> bool:
        self._observe(now)
        if size <= free_bytes:
            return True
        past = self._history.get(key)
        rival = self.victim(now)
        admitted = past is not None and rival is not None and (self._key(*past) > self._ranked[rival][0])
        if not admitted:
            freq = past[0] + 1.0 if past is not None else 1.0
            self._remember(key, freq, now, self._co_access_now(key))
        return admitted

    def on_insert(self, key: str, size: int, now: float) -> None:
        self._observe(now)
        past = self._history.pop(key, None)
        freq = past[0] + 1.0 if past is not None else 1.0
        self._entries[key] = [freq, now, float(self._co_access_now(key))]
        self._rank(key)

    def on_access(self, key: str, now: float) -> None:
        self._observe(now)
        entry = self._entries[key]
        entry[0] += 1.0
        entry[1] = now
        entry[2] = float(self._co_access_now(key))
        if key not in self._pins:
            self._rank(key)

    def on_remove(self, key: str) -> None:
        self._forget_pins(key)
        freq, last_access, co_access = self._entries.pop(key)
        self._ranked.pop(key, None)
        self._remember(key, freq, last_access, co_access)

    def victim(self, now: float) -> str | None:
        heap, ranked = self._heap, self._ranked
        while heap:
            top = heap[0]
            if ranked.get(top[2]) is top:
                return top[2]
            heapq.heappop(heap)
        return None

    def score(self, key: str, now: float) -> float:
        """The entry's hot score at `now` (telemetry)."""
        freq, last_access, co_access = self._entries[key]
        return hot_score(freq, last_access, co_access, self.half_life, now, self.co_weight)

    def stats(self, key: str) -> EntryStats:
        freq, last_access, co_access = self._entries[key]
        return {"freq": freq, "last_access": last_access, "co_access": co_access}

    def restore(self, key: str, size: int, stats: EntryStats) -> None:
        last_access = float(stats.get("last_access", 0.0))
        self._observe(last_access)
        self._entries[key] = [max(1.0, float(stats.get("freq", 1.0))), last_access, float(stats.get("co_access", 0.0))]
        self._rank(key)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def _withdraw(self, key: str) -> None:
        del self._ranked[key]

    def _reinstate(self, key: str, now: float) -> None:
        self._rank(key)
