"""Next-use oracles built from the loader's view of the future: (key, first_use, last_use) intervals.

The loader knows its order (seed + epoch), so it can say, for every shard, the
intervals of global sample positions during which the shard is read. A point access
is an interval whose first and last use coincide.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Iterable


class IntervalOracle:
    """Answers `next_use(key, now)` from each key's sorted, non-overlapping use intervals.

    Inside an interval (first_use <= now < last_use) the entry is in use and its next
    use is `now`; otherwise it is the first_use of the next interval after `now`.
    """

    def __init__(self, intervals: Iterable[tuple[str, float, float]]) -> None:
        grouped: dict[str, list[tuple[float, float]]] = {}
        for key, first, last in intervals:
            if last < first:
                raise ValueError(f"interval of {key!r} ends before it starts: [{first}, {last}]")
            grouped.setdefault(key, []).append((float(first), float(last)))
        self._firsts: dict[str, list[float]] = {}
        self._lasts: dict[str, list[float]] = {}
        for key, spans in grouped.items():
            spans.sort()
            for (_, last), (first, _) in zip(spans, spans[1:]):
                if first < last:
                    raise ValueError(f"intervals of {key!r} overlap at position {first}")
            self._firsts[key] = [first for first, _ in spans]
            self._lasts[key] = [last for _, last in spans]

    def next_use(self, key: str, now: float) -> float:
        firsts = self._firsts.get(key)
        if firsts is None:
            return math.inf
        index = bisect_right(firsts, now)
        if index > 0 and self._lasts[key][index - 1] > now:
            return now
        return firsts[index] if index < len(firsts) else math.inf

    def use_after_current(self, key: str, now: float) -> float:
        firsts = self._firsts.get(key)
        if firsts is None:
            return math.inf
        index = bisect_right(firsts, now)
        return firsts[index] if index < len(firsts) else math.inf

    def __len__(self) -> int:
        return len(self._firsts)


def oracle_from_intervals(intervals: Iterable[tuple[str, float, float]]) -> IntervalOracle:
    """The oracle the loader builds from its order's future view."""
    return IntervalOracle(intervals)


def oracle_from_accesses(accesses: Iterable[tuple[str, float]]) -> IntervalOracle:
    """The oracle for a plain access sequence of (key, position)."""
    return IntervalOracle((key, position, position) for key, position in accesses)
