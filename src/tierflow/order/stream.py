"""The batches one rank of one node consumes, each with the cursor to resume after it.

World arrangement: node n of N owns partitions p = n (mod N), read through a few lanes
(lanes.py) whose batches interleave at proportional rates (interleave.py) into the node's
stream, numbered j = 0, 1, 2, ... from the cursor. Local rank r of R takes node batches
j = b * R + r as its batches b = 0, 1, 2, ...; a loader worker w of W builds the rank's
batches b = w (mod W). Training is synchronous: the cursor attached to batch b is the state
after every rank of every node has consumed its batches 0..b, so it is the same dict on all
ranks and any of them can be saved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from tierflow.order.cursor import OrderCursor
from tierflow.order.interleave import LaneSchedule, ScheduleWalker
from tierflow.order.lanes import Lane, LaneBatches, Positions, Span, node_lanes
from tierflow.order.order import MicroBatch, SampleOrder
from tierflow.order.remainder import Remainder


class _LanePositions:
    """A lane's positions before its batch i, moved forward from the last one asked for."""

    def __init__(self, batches: LaneBatches, base: Positions) -> None:
        self.batches = batches
        self.lane = batches.lane
        self.base = base
        self._state = base
        self._clock = self._base_clock = self._clock_of(base)

    def _clock_of(self, state: Positions) -> tuple[int, int]:
        if self.batches.remainder is Remainder.CARRY:
            return 0, self.lane.position(state)
        return self.lane.epoch_position(state)

    def _target(self, i: int) -> tuple[int, int]:
        if self.batches.remainder is Remainder.CARRY:
            return 0, self.batches.start(i)
        return self.batches.lane_epoch_of(i)

    def before(self, i: int) -> Positions:
        epoch, offset = self._target(i)
        for start, (have_epoch, have) in ((self._state, self._clock), (self.base, self._base_clock)):
            if epoch == have_epoch and offset >= have:
                state = self.lane.take(start, offset - have)[1]
                break
        else:  # drop/pad: a later lane epoch starts with every partition fresh
            state = self.lane.take({p: (epoch, 0) for p in self.lane.members}, offset)[1]
        self._state, self._clock = state, (epoch, offset)
        return state


class NodeStream:
    """One node's lanes from a cursor: its batches in order, and its positions after any number."""

    def __init__(self, order: SampleOrder, cursor: OrderCursor, *, node: int, num_nodes: int,
                 batch_size: int) -> None:
        self.order = order
        self.batch_size = batch_size
        self.lanes = [Lane(order.layout, members, order.seed, order.shuffle)
                      for members in node_lanes(order.layout, node, num_nodes, order.lanes)]
        bases = [{p: (cursor.epochs[p], cursor.offsets[p]) for p in lane.members} for lane in self.lanes]
        self.batches = [LaneBatches(lane, base, batch_size, order.remainder) for lane, base in zip(self.lanes, bases)]
        self.schedule = LaneSchedule(self.batches)
        self._reading = ScheduleWalker(self.schedule)
        self._counting = ScheduleWalker(self.schedule)
        self._read_at = [_LanePositions(b, base) for b, base in zip(self.batches, bases)]
        self._count_at = [_LanePositions(b, base) for b, base in zip(self.batches, bases)]

    def positions_before(self, lane: int, i: int) -> Positions:
        """The lane's positions where its batch i starts (drop: a dropped tail already skipped)."""
        return self._read_at[lane].before(i)

    def lane_batch(self, pick: int) -> tuple[int, int]:
        """(lane, the lane's batch number) of node batch `pick`, counted from the cursor."""
        return self._reading.pick(pick)

    def spans(self, lane: int, i: int) -> list[Span]:
        """The runs of samples lane batch i reads (fewer than B samples: pad's last batch)."""
        batches = self.batches[lane]
        count = self.batch_size
        if batches.remainder is Remainder.PAD:
            count = min(count, self.lanes[lane].size - batches.lane_epoch_of(i)[1])
        return self.lanes[lane].take(self.positions_before(lane, i), count)[0]

    def read(self, pick: int) -> MicroBatch:
        lane, i = self.lane_batch(pick)
        spans = self.spans(lane, i)
        ids = [self.order.windows(s.partition, s.epoch).range_ids(s.start, s.stop) for s in spans]
        epochs = [np.full(s.stop - s.start, s.epoch, dtype=np.int64) for s in spans]
        sample_ids = ids[0] if len(ids) == 1 else np.concatenate(ids)
        sample_epochs = epochs[0] if len(epochs) == 1 else np.concatenate(epochs)
        mask = np.ones(self.batch_size, dtype=bool)
        real = sample_ids.size
        if real < self.batch_size:
            sample_ids = np.resize(sample_ids, self.batch_size)
            sample_epochs = np.resize(sample_epochs, self.batch_size)
            mask[real:] = False
        return MicroBatch(spans[0].partition, sample_ids, sample_epochs, mask)

    def epoch_of_pick(self, pick: int) -> int:
        """The epoch of node batch `pick` (its oldest sample's: where its lane batch starts)."""
        lane, i = self.lane_batch(pick)
        return self.batches[lane].start(i) // self.lanes[lane].size

    def picks_through(self, epoch: int) -> int:
        """Node batches from the cursor whose epoch is <= `epoch`: a prefix of the stream, since
        the interleave puts every batch starting in epoch e before any starting in e + 1."""
        return sum(b.count_before((epoch + 1) * b.lane.size) for b in self.batches)

    def positions_after(self, picks: int) -> Positions:
        """Every partition's position once the node has consumed `picks` batches."""
        self._counting.advance(picks)
        out: Positions = {}
        for lane, count in enumerate(self._counting.counts):
            out.update(self._count_at[lane].before(count))
        return out


@dataclass(frozen=True)
class Batch:
    """Batch number `index` of a rank: global sample ids, their epochs, the padding mask, and
    the cursor after it (resuming from it yields batch index + 1)."""

    index: int
    partition: int
    sample_ids: np.ndarray
    epochs: np.ndarray
    mask: np.ndarray
    cursor: dict[str, Any]


class RankStream:
    """Seekable batch sequence of one rank; walked forward, a batch costs O(lanes) heap steps and
    O(B) samples, and its cursor O(P)."""

    def __init__(
        self,
        order: SampleOrder,
        cursor: OrderCursor,
        *,
        batch_size: int,
        node: int = 0,
        num_nodes: int = 1,
        rank: int = 0,
        ranks_per_node: int = 1,
    ) -> None:
        if not 0 <= rank < ranks_per_node:
            raise ValueError(f"rank {rank} outside range({ranks_per_node}) of node {node}")
        order.layout.node_partitions(node, num_nodes)  # validates the arrangement
        self.order = order
        self.base = cursor
        self.batch_size = batch_size
        self.node = node
        self.num_nodes = num_nodes
        self.rank = rank
        self.ranks_per_node = ranks_per_node
        self.nodes = [NodeStream(order, cursor, node=n, num_nodes=num_nodes, batch_size=batch_size)
                      for n in range(num_nodes)]
        self.own = self.nodes[node]
        self.partitions = order.layout.node_partitions(node, num_nodes)

    def node_batch(self, pick: int) -> MicroBatch:
        """This node's batch `pick` counted from the cursor (all its ranks together)."""
        return self.own.read(pick)

    def batch(self, index: int) -> Batch:
        micro = self.node_batch(index * self.ranks_per_node + self.rank)
        return Batch(index, micro.partition, micro.sample_ids, micro.epochs, micro.mask,
                     self.cursor_after(index).to_dict())

    def batches(self, worker: int = 0, num_workers: int = 1, start: int = 0) -> Iterator[Batch]:
        """Endless: the rank's batches b >= start with b = worker (mod num_workers)."""
        if not 0 <= worker < num_workers:
            raise ValueError(f"worker {worker} outside range({num_workers})")
        index = start + (worker - start) % num_workers
        while True:
            yield self.batch(index)
            index += num_workers

    def epoch_batches(self, after: int | None = None, agree: bool = False) -> tuple[int, int]:
        """(epoch, batches): the epoch a run of this rank's batches from the cursor finishes (its
        first batch's, and past `after`, the last one finished) and how many of its batches belong
        to it or an older one. With `agree`, what every rank of every node stops at together: the
        smallest first epoch, and the fewest batches (what `Loader`'s epoch_end="agree" does)."""
        ranks = [(n, r) for n in range(self.num_nodes) for r in range(self.ranks_per_node)] if agree \
            else [(self.node, self.rank)]
        epoch = min(self.nodes[n].epoch_of_pick(r) for n, r in ranks)
        if after is not None:
            epoch = max(epoch, after + 1)
        R = self.ranks_per_node
        counts = [max(0, -(-(self.nodes[n].picks_through(epoch) - r) // R)) for n, r in ranks]
        return epoch, min(counts)

    def cursor_after(self, index: int) -> OrderCursor:
        """State once every rank of every node has consumed its batches 0..index."""
        picks = (index + 1) * self.ranks_per_node
        epochs, offsets = list(self.base.epochs), list(self.base.offsets)
        for node in self.nodes:
            for p, (e, o) in node.positions_after(picks).items():
                epochs[p], offsets[p] = e, o
        return self.order.cursor(epochs, offsets)
