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

import heapq
from bisect import bisect_right
from dataclasses import dataclass
from typing import Any
from collections.abc import Iterator

import numpy as np

from tierflow.order.cursor import OrderCursor
from tierflow.order.edges import EpochEdges, Piece
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
                state = self.lane.advance(start, offset - have)
                break
        else:  # drop/pad: a later lane epoch starts with every partition fresh
            state = self.lane.advance({p: (epoch, 0) for p in self.lane.members}, offset)
        self._state, self._clock = state, (epoch, offset)
        return state


WALK_SAMPLES = 4096
"""Samples of a lane's walk evaluated at once (ids and epochs), sliced per batch; at most half a
lane epoch, so a small lane is not evaluated many epochs ahead."""
PICKS = 256
"""Node batches whose (lane, lane batch) the interleave is evaluated for at once, at the least."""
_KEY_LIMIT = 1 << 62


class _LaneWalk:
    """The samples a lane reads from one state on, in order (its walk): walk position k is the
    k-th sample `Lane.take` reads from `origin`. Every batch of a lane reads a run of one walk (carry:
    the walk from the cursor; drop/pad: that walk in the cursor's lane epoch, each later lane epoch
    the walk from its fresh start), so a batch is a slice of ids and epochs evaluated a chunk at a
    time (whole spans, vectorised) instead of spans, positions and ids per batch. Epochs never
    decrease along a walk."""

    def __init__(self, order: SampleOrder, lane: Lane, origin: Positions) -> None:
        self.order = order
        self.lane = lane
        self.origin = origin
        self._begin = 0
        self._end = 0  # walk positions [begin, end) are evaluated
        self._state = origin  # the lane's positions at walk position `end`
        self._ids = np.zeros(0, dtype=np.int64)
        self._epochs = np.zeros(0, dtype=np.int64)
        self._span_starts: list[int] = [0]  # where each span evaluated starts, from `begin`
        self._partitions: list[int] = [-1]

    def read(self, position: int, count: int) -> tuple[np.ndarray, np.ndarray, int]:
        """(sample ids, epochs, the first one's partition) of walk positions [position, position +
        count); the arrays are read-only views."""
        if position < self._begin or position + count > self._end:
            self._evaluate(position, max(count, min(WALK_SAMPLES, self.lane.size // 2)))
        at = position - self._begin
        spans = self._span_starts
        k = 0 if len(spans) == 1 else bisect_right(spans, at) - 1
        return self._ids[at : at + count], self._epochs[at : at + count], self._partitions[k]

    def _evaluate(self, position: int, count: int) -> None:
        take = self.lane.take
        if position >= self._end:
            state = take(self._state, position - self._end)[1] if position > self._end else self._state
        else:
            state = take(self.origin, position)[1]
        spans: list[Span] = []
        after, left, most = state, count, 2 * self.lane.size - 1  # a take of more skips whole epochs' spans
        while left:
            run, after = take(after, min(left, most))
            spans += run
            left -= min(left, most)
        windows = self.order.windows
        ids = [windows(s.partition, s.epoch).range_ids(s.start, s.stop) for s in spans]
        epochs = [np.full(s.stop - s.start, s.epoch, dtype=np.int64) for s in spans]
        self._ids = ids[0] if len(ids) == 1 else np.concatenate(ids)
        self._epochs = epochs[0] if len(epochs) == 1 else np.concatenate(epochs)
        self._ids.setflags(write=False)
        self._epochs.setflags(write=False)
        self._span_starts = np.cumsum([0] + [s.stop - s.start for s in spans[:-1]]).tolist()
        self._partitions = [s.partition for s in spans]
        self._begin, self._end, self._state = position, position + count, after


class _Picks:
    """The interleave's picks evaluated for a run of node batches at once: which lane and which of
    its batches each node batch is (the merge of the lanes' batch keys, vectorised), the same as
    `ScheduleWalker` walks one pick at a time; a jump back or far ahead seeks."""

    def __init__(self, schedule: LaneSchedule) -> None:
        self.schedule = schedule
        self.lanes = len(schedule.lanes)
        self.shares = np.array(schedule.sizes, dtype=np.float64) / sum(schedule.sizes)
        self._first = 0
        self._lane: list[int] = []
        self._batch: list[int] = []
        self._counts = [0] * self.lanes  # lane batches delivered before pick first + len(_lane)
        self._stride = 1
        self._last = -1

    def pick(self, j: int) -> tuple[int, int]:
        if j > self._last >= 0:
            self._stride = j - self._last
        self._last = j
        at = j - self._first
        if not 0 <= at < len(self._lane):
            self._evaluate(j)
            at = j - self._first
        return self._lane[at], self._batch[at]

    def _evaluate(self, j: int) -> None:
        wanted = min(1 << 16, max(PICKS, 64 * self._stride))
        end = self._first + len(self._lane)
        if end <= j < end + wanted:
            first, counts = end, self._counts
        else:
            first, counts = j, self.schedule.counts_after(j)
        lanes, batches, counts = self._merge(counts, wanted + j - first)
        while first + len(lanes) <= j:  # a lane's candidates ran out early: merge on
            more_lanes, more_batches, counts = self._merge(counts, wanted)
            lanes, batches = lanes + more_lanes, batches + more_batches
        self._first, self._lane, self._batch, self._counts = first, lanes, batches, counts

    def _merge(self, counts: list[int], wanted: int) -> tuple[list[int], list[int], list[int]]:
        """The next picks after lane counts `counts` (at least one, about `wanted`): each lane's next
        batches by (key, lane), kept while no lane's next batch could come first."""
        schedule = self.schedule
        per_lane = [int(n) + 2 for n in np.ceil(self.shares * wanted)]
        numbers = [np.arange(c, c + n, dtype=np.int64) for c, n in zip(counts, per_lane)]
        starts = [lane.starts(i) for lane, i in zip(schedule.lanes, numbers)]
        if max(int(s[-1]) for s in starts) >= _KEY_LIMIT // schedule.epoch_ticks // max(self.lanes, 1):
            return self._walk(counts, wanted)  # keys past int64: the walker's Python integers
        keys = np.concatenate([schedule.keys_of(m, s) * self.lanes + m for m, s in enumerate(starts)])
        order = np.argsort(keys, kind="stable")  # a lane's batches stay in their order
        merged = keys[order]
        last = min(int(k[-1]) for k in np.split(keys, np.cumsum(per_lane)[:-1]))
        taken = order[: int(np.searchsorted(merged, last, side="right"))]
        lane_of = np.repeat(np.arange(self.lanes, dtype=np.int64), per_lane)
        lanes = lane_of[taken]
        batches = np.concatenate(numbers)[taken]
        after = [c + int(n) for c, n in zip(counts, np.bincount(lanes, minlength=self.lanes).tolist())]
        return lanes.tolist(), batches.tolist(), after

    def _walk(self, counts: list[int], wanted: int) -> tuple[list[int], list[int], list[int]]:
        """`_merge` by the walker's rule, one pick at a time, in Python integers."""
        schedule, counts = self.schedule, list(counts)
        heap = [(schedule.key(m, c), m) for m, c in enumerate(counts)]
        heapq.heapify(heap)
        lanes, batches = [], []
        for _ in range(wanted):
            _, lane = heapq.heappop(heap)
            lanes.append(lane)
            batches.append(counts[lane])
            counts[lane] += 1
            heapq.heappush(heap, (schedule.key(lane, counts[lane]), lane))
        return lanes, batches, counts


class NodeStream:
    """One node's lanes from a cursor: its batches in order, and its positions after any number."""

    def __init__(self, order: SampleOrder, cursor: OrderCursor, *, node: int, num_nodes: int, batch_size: int) -> None:
        self.order = order
        self.batch_size = batch_size
        self.lanes = [
            Lane(order.layout, members, order.seed, order.shuffle)
            for members in node_lanes(order.layout, node, num_nodes, order.lanes)
        ]
        bases = [{p: (cursor.epochs[p], cursor.offsets[p]) for p in lane.members} for lane in self.lanes]
        self.batches = [LaneBatches(lane, base, batch_size, order.remainder) for lane, base in zip(self.lanes, bases)]
        self.schedule = LaneSchedule(self.batches, order.first_epoch_groups(len(self.lanes), node))
        self._reading = ScheduleWalker(self.schedule)
        self._counting = ScheduleWalker(self.schedule)
        self._read_at = [_LanePositions(b, base) for b, base in zip(self.batches, bases)]
        self._count_at = [_LanePositions(b, base) for b, base in zip(self.batches, bases)]
        self._bases = bases
        self._picks = _Picks(self.schedule)
        self._walks: list[dict[int, _LaneWalk]] = [{} for _ in self.lanes]
        self._carry = order.remainder is Remainder.CARRY
        self._pad = order.remainder is Remainder.PAD
        # drop/pad: the lane epoch the cursor stands in (its walk is the cursor's), and how far into it
        self._clocks = [lane.epoch_position(base) for lane, base in zip(self.lanes, bases)]
        self._full = np.ones(batch_size, dtype=bool)
        self._full.setflags(write=False)
        # a batch of two lane epochs or more is read the long way: `Lane.take` of that many samples
        # gives the spans of its last epochs only, which is what such a batch has always read
        self._by_spans = any(batch_size >= 2 * lane.size for lane in self.lanes)
        # version 3 under carry: the epoch-major edge (edges.py); a version-2 cursor keeps its lanes' batches
        self.edges = (
            EpochEdges(self.lanes, bases, batch_size, order.first_epoch_groups(len(self.lanes), node))
            if self._carry and cursor.version >= 3
            else None
        )
        self._edge_states = [(0, base) for base in bases]  # (walk position, the lane's positions there)

    def _edge_parts(self, pick: int) -> tuple[int, np.ndarray, np.ndarray, np.ndarray, int]:
        """`read_parts` under the epoch-major edge: the batch's pieces read from the lanes' walks."""
        assert self.edges is not None
        epoch, pieces = self.edges.pieces(pick)
        ids, epochs, partition = [], [], -1
        for piece in pieces:
            at = self.edges.walk_index(piece.lane, piece.epoch, piece.start)
            some_ids, some_epochs, first = self._walk(piece.lane, -1).read(at, piece.stop - piece.start)
            partition = first if partition < 0 else partition
            ids.append(some_ids)
            epochs.append(some_epochs)
        if len(ids) == 1:
            return partition, ids[0], epochs[0], self._full, epoch
        return partition, np.concatenate(ids), np.concatenate(epochs), self._full, epoch

    def _edge_spans(self, piece: Piece) -> list[Span]:
        assert self.edges is not None
        walked = self.edges.walk_index(piece.lane, piece.epoch, piece.start)
        lane = self.lanes[piece.lane]
        return lane.take(lane.advance(self._bases[piece.lane], walked), piece.stop - piece.start)[0]

    def _edge_positions(self, lane: int, walked: int) -> Positions:
        """The lane's positions `walked` samples after the cursor, moved on from the last ones asked for."""
        have, state = self._edge_states[lane]
        if walked < have:
            have, state = 0, self._bases[lane]
        state = self.lanes[lane].advance(state, walked - have)
        self._edge_states[lane] = (walked, state)
        return state

    def positions_before(self, lane: int, i: int) -> Positions:
        """The lane's positions where its batch i starts (drop: a dropped tail already skipped)."""
        return self._read_at[lane].before(i)

    def lane_batch(self, pick: int) -> tuple[int, int]:
        """(lane, the lane's batch number) of node batch `pick`, counted from the cursor."""
        return self._picks.pick(pick)

    def lane_of(self, pick: int) -> int:
        """The lane node batch `pick` reads first (0 where batches span lane epochs), read from the
        schedule alone: no sample ids. Asked ahead of the reading, it moves this stream's walkers, so a
        stream that deals batches to workers is not the one that reads them."""
        if self.edges is not None:
            return self.edges.pieces(pick)[1][0].lane
        return 0 if self._by_spans else self._picks.pick(pick)[0]

    def _walk(self, lane: int, epoch: int) -> _LaneWalk:
        """The lane's walk from the cursor (epoch -1), or from the fresh start of lane epoch `epoch`."""
        walks = self._walks[lane]
        walk = walks.get(epoch)
        if walk is None:
            origin = self._bases[lane] if epoch < 0 else {p: (epoch, 0) for p in self.lanes[lane].members}
            walk = walks[epoch] = _LaneWalk(self.order, self.lanes[lane], origin)
            if len(walks) > 3:
                del walks[next(k for k in walks if k >= 0 and k != epoch)]
        return walk

    def read_parts(self, pick: int) -> tuple[int, np.ndarray, np.ndarray, np.ndarray, int]:
        """`read` as (partition, sample ids, epochs, mask, the batch's epoch: its oldest sample's),
        the arrays read-only and shared with the stream."""
        if self.edges is not None:
            return self._edge_parts(pick)
        if self._by_spans:
            micro = self.read_by_spans(pick)
            real = micro.epochs[micro.mask] if micro.mask.any() else micro.epochs
            return micro.partition, micro.sample_ids, micro.epochs, micro.mask, int(real.min())
        lane, i = self._picks.pick(pick)
        size = self.batch_size
        if self._carry:
            ids, epochs, partition = self._walk(lane, -1).read(i * size, size)
            return partition, ids, epochs, self._full, int(epochs[0])
        epoch, offset = self.batches[lane].lane_epoch_of(i)
        count = min(size, self.lanes[lane].size - offset) if self._pad else size
        clock_epoch, clock_done = self._clocks[lane]
        if epoch == clock_epoch:
            ids, epochs, partition = self._walk(lane, -1).read(offset - clock_done, count)
        else:
            ids, epochs, partition = self._walk(lane, epoch).read(offset, count)
        if count == size:
            return partition, ids, epochs, self._full, int(epochs[0])
        mask = np.ones(size, dtype=bool)
        mask[count:] = False
        return partition, np.resize(ids, size), np.resize(epochs, size), mask, int(epochs[0])

    def spans(self, lane: int, i: int) -> list[Span]:
        """The runs of samples lane batch i reads (fewer than B samples: pad's last batch)."""
        batches = self.batches[lane]
        count = self.batch_size
        if batches.remainder is Remainder.PAD:
            count = min(count, self.lanes[lane].size - batches.lane_epoch_of(i)[1])
        return self.lanes[lane].take(self.positions_before(lane, i), count)[0]

    def read(self, pick: int) -> MicroBatch:
        partition, ids, epochs, mask, _ = self.read_parts(pick)
        return MicroBatch(partition, ids, epochs, mask)

    def read_by_spans(self, pick: int) -> MicroBatch:
        """`read` the long way, batch by batch through the lanes' spans (the reference `read` is
        checked against)."""
        if self.edges is not None:
            spans = [span for piece in self.edges.pieces(pick)[1] for span in self._edge_spans(piece)]
        else:
            lane, i = self._reading.pick(pick)
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
        if self.edges is not None:
            return self.edges.locate(pick).epoch
        lane, i = self.lane_batch(pick)
        return self.batches[lane].start(i) // self.lanes[lane].size

    def picks_through(self, epoch: int) -> int:
        """Node batches from the cursor whose epoch is <= `epoch`: a prefix of the stream, since
        the interleave puts every batch starting in epoch e before any starting in e + 1."""
        if self.edges is not None:
            return self.edges.plan(epoch + 1).first_pick if epoch + 1 >= min(self.edges.first_epochs) else 0
        return sum(b.count_before((epoch + 1) * b.lane.size) for b in self.batches)

    def epoch_counts(self, pick: int) -> list[tuple[int, int]]:
        """(epoch, samples of it) in node batch `pick`, oldest first, as a sorted group splits it: the
        epoch-major edge's last batch of an epoch by its samples' epochs; any other batch (and every
        batch of a version-2 carry, whose lanes run across their edges) whole in its own epoch."""
        if self.edges is not None:
            return self.edges.epoch_counts(pick)
        return [(self.epoch_of_pick(pick), self.batch_size)]

    def positions_after(self, picks: int) -> Positions:
        """Every partition's position once the node has consumed `picks` batches."""
        out: Positions = {}
        if self.edges is not None:
            for lane, (epoch, offset) in enumerate(self.edges.clocks_after(picks)):
                out.update(self._edge_positions(lane, self.edges.walk_index(lane, epoch, offset)))
            return out
        self._counting.advance(picks)
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
        self.nodes = [
            NodeStream(order, cursor, node=n, num_nodes=num_nodes, batch_size=batch_size) for n in range(num_nodes)
        ]
        self.own = self.nodes[node]
        self.partitions = order.layout.node_partitions(node, num_nodes)

    def node_batch(self, pick: int) -> MicroBatch:
        """This node's batch `pick` counted from the cursor (all its ranks together)."""
        return self.own.read(pick)

    def node_parts(self, pick: int) -> tuple[int, np.ndarray, np.ndarray, np.ndarray, int]:
        """`node_batch` as (partition, sample ids, epochs, mask, epoch), arrays read-only
        (`NodeStream.read_parts`)."""
        return self.own.read_parts(pick)

    def lane_of(self, index: int) -> int:
        """The lane this rank's batch `index` reads first (`NodeStream.lane_of`)."""
        return self.own.lane_of(index * self.ranks_per_node + self.rank)

    def batch(self, index: int) -> Batch:
        micro = self.node_batch(index * self.ranks_per_node + self.rank)
        return Batch(
            index, micro.partition, micro.sample_ids, micro.epochs, micro.mask, self.cursor_after(index).to_dict()
        )

    def batches(self, worker: int = 0, num_workers: int = 1, start: int = 0) -> Iterator[Batch]:
        """Endless: the rank's batches b >= start with b = worker (mod num_workers)."""
        if not 0 <= worker < num_workers:
            raise ValueError(f"worker {worker} outside range({num_workers})")
        index = start + (worker - start) % num_workers
        while True:
            yield self.batch(index)
            index += num_workers

    def _counted_ranks(self, agree: bool) -> list[tuple[int, int]]:
        """(node, rank) of every rank of every node with `agree`, else this rank's alone."""
        if agree:
            return [(n, r) for n in range(self.num_nodes) for r in range(self.ranks_per_node)]
        return [(self.node, self.rank)]

    def epoch_batches(self, after: int | None = None, agree: bool = False) -> tuple[int, int]:
        """(epoch, batches): the epoch a run of this rank's batches from the cursor finishes (its
        first batch's, and past `after`, the last one finished) and how many of its batches belong
        to it or an older one. With `agree`, what every rank of every node stops at together: the
        smallest first epoch, and the fewest batches (what `Loader`'s epoch_end="agree" does)."""
        ranks = self._counted_ranks(agree)
        epoch = min(self.nodes[n].epoch_of_pick(r) for n, r in ranks)
        if after is not None:
            epoch = max(epoch, after + 1)
        R = self.ranks_per_node
        counts = [max(0, -(-(self.nodes[n].picks_through(epoch) - r) // R)) for n, r in ranks]
        return epoch, min(counts)

    def epoch_parts(
        self, after: int | None = None, agree: bool = False, parts: int = 1, skip: int = 0
    ) -> tuple[int, int]:
        """`epoch_batches` counted in parts: each batch is cut into `parts` equal parts of its
        samples sorted by epoch (a sorted group's batches), part k belonging to the epoch of its
        first sample, and the run starts at part `skip` of batch 0. The epoch-major edge's last
        batch of an epoch then gives its older parts to that epoch and the rest to the next
        (`NodeStream.epoch_counts`); with `parts` 1 this is `epoch_batches`, less `skip`."""
        ranks = self._counted_ranks(agree)
        size = self.batch_size // parts
        epoch = min(_part_epoch(self.nodes[n].epoch_counts(r), skip * size) for n, r in ranks)
        if after is not None:
            epoch = max(epoch, after + 1)
        R = self.ranks_per_node
        counts = []
        for n, r in ranks:
            node = self.nodes[n]
            picks = max(0, -(-(node.picks_through(epoch) - r) // R))
            if not picks:
                counts.append(0)
                continue
            newer = sum(c for e, c in node.epoch_counts((picks - 1) * R + r) if e > epoch)
            counts.append(max(0, picks * parts - newer // size - skip))
        return epoch, min(counts)

    def cursor_after(self, index: int) -> OrderCursor:
        """State once every rank of every node has consumed its batches 0..index."""
        picks = (index + 1) * self.ranks_per_node
        epochs, offsets = list(self.base.epochs), list(self.base.offsets)
        for node in self.nodes:
            for p, (e, o) in node.positions_after(picks).items():
                epochs[p], offsets[p] = e, o
        return self.order.cursor(epochs, offsets, self.base.version)


def _part_epoch(counts: list[tuple[int, int]], at: int) -> int:
    """The epoch of the sample at position `at` of a batch sorted by epoch ((epoch, count) pairs)."""
    for epoch, count in counts:
        if at < count:
            return epoch
        at -= count
    return counts[-1][0]
