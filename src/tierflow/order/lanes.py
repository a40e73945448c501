"""Lanes: a node reads its partitions a few at a time, so the shards it needs at once stay few.

Node n's partitions (p = n mod N, ascending) are dealt to a = min(lanes, count) lanes, the i-th
to lane i mod a. A lane reads its partitions one after another within each epoch: first those it
has started (one in a fresh run; after an elastic resume there may be several, by partition
index), then the unstarted ones in a per-epoch shuffle. Only a partitions, each one window of k
shards, are being read at once, whatever P is, while P stays the unit of elastic resume.

Everything is derived from the per-partition positions (epoch, offset) the cursor records, so the
rule continues exactly after any resume. A lane's position T = sum(epoch * size + offset) over its
partitions grows by one per sample read; `take` walks it forward.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from collections.abc import Iterator

import numpy as np

from tierflow.order._keys import derive_key
from tierflow.order.layout import PartitionLayout
from tierflow.order.permutation import FeistelPermutation
from tierflow.order.remainder import Remainder, StreamGeometry

Positions = dict[int, tuple[int, int]]
"""partition -> (epoch, offset) of its next sample; offset < the partition's size."""


@dataclass(frozen=True)
class Span:
    """Consecutive offsets [start, stop) of one partition's epoch, in a lane's reading order."""

    partition: int
    epoch: int
    start: int
    stop: int


def node_lanes(layout: PartitionLayout, node: int, num_nodes: int, lanes: int) -> list[tuple[int, ...]]:
    """The member partitions of each of the node's lanes."""
    owned = layout.node_partitions(node, num_nodes)
    count = max(1, min(lanes, len(owned)))
    return [tuple(owned[i::count]) for i in range(count)]


class Lane:
    """Partitions read one after another within each epoch (see the module docstring)."""

    def __init__(self, layout: PartitionLayout, members: tuple[int, ...], seed: int, shuffle: bool = True) -> None:
        self.members = members
        self.shuffle = shuffle
        self.sizes = {p: int(layout.partition_sizes[p]) for p in members}
        self.size = sum(self.sizes.values())
        self.seed = seed
        self._orders: OrderedDict[int, tuple[int, ...]] = OrderedDict()

    def epoch_order(self, epoch: int) -> tuple[int, ...]:
        """The lane's partitions in the order a fresh epoch reads them."""
        if not self.shuffle:
            return self.members  # ascending: with a contiguous layout, the stored order
        found = self._orders.get(epoch)
        if found is None:
            members = self.members
            shuffle = FeistelPermutation(len(members), derive_key("lane", self.seed, epoch, members[0], len(members)))
            found = self._orders[epoch] = tuple(members[i] for i in shuffle(np.arange(len(members))).tolist())
            if len(self._orders) > 4:
                self._orders.popitem(last=False)
        return found

    def position(self, state: Positions) -> int:
        return sum(e * self.sizes[p] + o for p, (e, o) in state.items())

    def epoch_position(self, state: Positions) -> tuple[int, int]:
        """(the lane's epoch, samples of it already read) - the drop/pad remainders' clock."""
        epoch = min(e for e, _ in state.values())
        done = sum(self.sizes[p] if e > epoch else o for p, (e, o) in state.items())
        return epoch, done

    @staticmethod
    def _clean(state: Positions) -> bool:
        """At an epoch boundary: every partition at the start of the same epoch."""
        first = next(iter(state.values()))[0]
        return all(o == 0 and e == first for e, o in state.values())

    def spans(self, state: Positions) -> Iterator[Span]:
        """The runs still to read from `state`, in order; endless."""
        epochs = {p: e for p, (e, _) in state.items()}
        offsets = {p: o for p, (_, o) in state.items()}
        epoch = min(epochs.values())
        while True:
            pending = [p for p in self.members if epochs[p] == epoch]
            started = [p for p in pending if offsets[p] > 0]
            fresh = [p for p in self.epoch_order(epoch) if epochs[p] == epoch and offsets[p] == 0]
            for p in started + fresh:
                yield Span(p, epoch, offsets[p], self.sizes[p])
            for p in pending:
                epochs[p], offsets[p] = epoch + 1, 0
            epoch += 1

    def take(self, state: Positions, count: int) -> tuple[list[Span], Positions]:
        """The next `count` samples from `state` as spans, and the positions after them: every
        sample, also of a count spanning several of the lane's epochs (a batch larger than the lane)."""
        return self._walk(state, count, True)

    def advance(self, state: Positions, count: int) -> Positions:
        """The positions `count` samples after `state`, jumping over whole epochs (no spans: a seek
        far ahead costs the epochs' count, not their samples)."""
        return self._walk(state, count, False)[1]

    def _walk(self, state: Positions, count: int, with_spans: bool) -> tuple[list[Span], Positions]:
        after = dict(state)
        spans: list[Span] = []
        left = count
        while left:
            if not with_spans and left >= 2 * self.size and self._clean(after):  # each partition moves by one
                skip = left // self.size - 1
                after = {p: (e + skip, 0) for p, (e, _) in after.items()}
                left -= skip * self.size
            for span in self.spans(after):
                n = min(left, span.stop - span.start)
                if with_spans:
                    spans.append(Span(span.partition, span.epoch, span.start, span.start + n))
                end = span.start + n
                after[span.partition] = (span.epoch, end) if end < span.stop else (span.epoch + 1, 0)
                left -= n
                if left == 0 or (not with_spans and left >= 2 * self.size and self._clean(after)):
                    break
        return spans, after


class LaneBatches:
    """Where the lane's batches start, from its positions at a cursor: batch i starts at lane
    position `start(i)`; carry runs straight through epochs, drop and pad restart each lane epoch."""

    def __init__(self, lane: Lane, state: Positions, batch_size: int, remainder: Remainder) -> None:
        self.lane = lane
        self.batch_size = batch_size
        self.remainder = remainder
        self.geometry = StreamGeometry(lane.size, batch_size, remainder)
        if remainder is Remainder.CARRY:
            self.origin = lane.position(state)
        else:
            epoch, done = self.geometry.normalize(*lane.epoch_position(state))
            self.epoch, self.done = epoch, done
            self.first = self.geometry.batches_per_epoch_from(done)
            self.per_epoch = self.geometry.batches_per_epoch_from(0)

    def start(self, i: int) -> int:
        """Lane position where batch i (counted from the cursor) starts."""
        if self.remainder is Remainder.CARRY:
            return self.origin + i * self.batch_size
        epoch, offset = self.lane_epoch_of(i)
        return epoch * self.lane.size + offset

    def starts(self, i: np.ndarray) -> np.ndarray:
        """`start` of each of the int64 batch numbers `i` (>= 0) at once."""
        b = self.batch_size
        if self.remainder is Remainder.CARRY:
            return self.origin + i * b
        size = self.lane.size
        rest = i - self.first
        later = (self.epoch + 1 + rest // self.per_epoch) * size + (rest % self.per_epoch) * b
        return np.where(rest < 0, self.epoch * size + self.done + i * b, later)

    def lane_epoch_of(self, i: int) -> tuple[int, int]:
        """(lane epoch, offset in it) where batch i starts (drop/pad)."""
        return self.geometry.advance(self.epoch, self.done, i)

    def count_before(self, position: int) -> int:
        """How many batches start before lane position `position`."""
        b = self.batch_size
        if self.remainder is Remainder.CARRY:
            return max(0, -(-(position - self.origin) // b))
        size = self.lane.size
        base = self.epoch * size + self.done
        if position <= base:
            return 0
        if position <= (self.epoch + 1) * size:
            return min(self.first, -(-(position - base) // b))
        full, rest = divmod(position - (self.epoch + 1) * size, size)
        return self.first + full * self.per_epoch + min(self.per_epoch, -(-rest // b))
