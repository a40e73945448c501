"""The rule that interleaves a node's lanes into one stream of micro-batches: proportional rates.

Each lane's batch i has a key: the lane position where it starts, in ticks of 1/2^24 of the
lane's epoch (floor(start * 2^24 / lane size)). The node's stream takes batches in key order,
ties to the lower lane, so every lane advances at a rate proportional to its size: every sample
is drawn at the same rate and all lanes end an epoch together (within a batch). Keys depend only
on positions, which the cursor records, so the rule continues exactly after any resume.

A first epoch read in G groups of lanes (SampleOrder.first_epoch) stretches every epoch to G
epochs' worth of ticks: a lane of group g keys its epoch-0 batches g * TICKS + floor(start *
TICKS / size), inside the group's own stretch, and every later batch floor(start * G * TICKS /
size); so the groups read their first epochs one after another and from epoch 1 on every lane
runs at its proportional rate again, the rule still a function of positions alone.

Pick j from the cursor: the smallest key K with more than j batches at keys <= K (a binary
search over K, O(lanes) per probe), then lanes in index order at K. Integers throughout.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from tierflow.order.lanes import LaneBatches

TICKS = 1 << 24


class LaneSchedule:
    """Seekable merge of the lanes' batches by key."""

    def __init__(self, lanes: Sequence[LaneBatches], groups: Sequence[int] | None = None) -> None:
        """`groups`: each lane's first-epoch group (None: one group)."""
        self.lanes = list(lanes)
        self.sizes = [lane.lane.size for lane in self.lanes]
        self.groups = list(groups) if groups is not None else [0] * len(self.lanes)
        self.stretch = max(self.groups, default=0) + 1
        self.epoch_ticks = TICKS * self.stretch

    def key(self, lane: int, i: int) -> int:
        return self.key_of(lane, self.lanes[lane].start(i))

    def key_of(self, lane: int, start: int) -> int:
        size = self.sizes[lane]
        if start < size and self.stretch > 1:
            return self.groups[lane] * TICKS + start * TICKS // size
        return start * self.epoch_ticks // size

    def keys_of(self, lane: int, starts: np.ndarray) -> np.ndarray:
        """`key_of` for int64 lane positions at once."""
        size = self.sizes[lane]
        later = starts * self.epoch_ticks // size
        if self.stretch == 1:
            return later
        return np.where(starts < size, self.groups[lane] * TICKS + starts * TICKS // size, later)

    def _below(self, key: int) -> list[int]:
        """Per lane: batches whose key is below `key`."""
        # start * E // size < key  <=>  start < ceil(key * size / E); a group's first epoch alike from g * TICKS
        out = []
        for lane, size, group in zip(self.lanes, self.sizes, self.groups):
            if self.stretch > 1 and key <= self.epoch_ticks:
                position = min(size, max(0, -(-(key - group * TICKS) * size // TICKS)))
            else:
                position = -(-key * size // self.epoch_ticks)
            out.append(lane.count_before(position))
        return out

    def _key_of_pick(self, j: int) -> int:
        low = min(self.key(lane, 0) for lane in range(len(self.lanes)))
        high = min(self.key(lane, j) for lane in range(len(self.lanes)))
        while low < high:  # smallest K with sum(below(K + 1)) > j
            mid = (low + high) // 2
            if sum(self._below(mid + 1)) > j:
                high = mid
            else:
                low = mid + 1
        return low

    def pick(self, j: int) -> tuple[int, int]:
        """(lane, its batch number) of the node's batch `j` counted from the cursor."""
        key = self._key_of_pick(j)
        before, through = self._below(key), self._below(key + 1)
        rest = j - sum(before)
        for lane, (b, t) in enumerate(zip(before, through)):
            if rest < t - b:
                return lane, b + rest
            rest -= t - b
        raise AssertionError("pick beyond its key")

    def counts_after(self, picks: int) -> list[int]:
        """Batches each lane has delivered after `picks` node batches."""
        if picks <= 0:
            return [0] * len(self.lanes)
        lane, i = self.pick(picks - 1)
        key = self.key(lane, i)
        before, through = self._below(key), self._below(key + 1)
        return [through[m] if m < lane else i + 1 if m == lane else before[m] for m in range(len(self.lanes))]

    def pick_of(self, lane: int, i: int) -> int:
        """The node batch at which `lane` delivers its batch i."""
        key = self.key(lane, i)
        before, through = self._below(key), self._below(key + 1)
        return sum(before) + sum(t - b for t, b in zip(through[:lane], before[:lane])) + i - before[lane]


class ScheduleWalker:
    """The same merge walked forward one pick at a time (a heap over lanes): what sequential
    iteration pays per batch instead of a seek."""

    def __init__(self, schedule: LaneSchedule) -> None:
        self.schedule = schedule
        self.picks = 0
        self.counts = [0] * len(schedule.lanes)
        self._heap = [(schedule.key(m, 0), m) for m in range(len(schedule.lanes))]
        heapq.heapify(self._heap)

    def seek(self, picks: int) -> None:
        schedule = self.schedule
        self.counts = schedule.counts_after(picks)
        self.picks = picks
        self._heap = [(schedule.key(m, c), m) for m, c in enumerate(self.counts)]
        heapq.heapify(self._heap)

    def advance(self, picks: int) -> tuple[int, int]:
        """Move to `picks` (forward cheaply, else seek); (lane, batch) of the last pick taken, or
        (-1, -1) when none was."""
        if picks < self.picks or picks - self.picks > 4096:
            self.seek(picks)
            return -1, -1
        last = (-1, -1)
        heap, counts, schedule = self._heap, self.counts, self.schedule
        while self.picks < picks:
            _, lane = heapq.heappop(heap)
            last = (lane, counts[lane])
            counts[lane] += 1
            heapq.heappush(heap, (schedule.key(lane, counts[lane]), lane))
            self.picks += 1
        return last

    def pick(self, j: int) -> tuple[int, int]:
        """(lane, batch) of pick j, leaving the walker just after it."""
        if j < self.picks or j - self.picks > 4096:
            self.seek(j)
        return self.advance(j + 1)
