"""The batches one rank of one node consumes, each with the cursor to resume after it.

World arrangement: node n of N owns partitions p = n (mod N); the node's stream is the
interleave of those partitions (interleave.py), numbered j = 0, 1, 2, ... from the cursor.
Local rank r of R takes node batches j = b * R + r as its batches b = 0, 1, 2, ...; a loader
worker w of W builds the rank's batches b = w (mod W). Training is synchronous: the cursor
attached to batch b is the state after every rank of every node has consumed its batches
0..b, so it is the same dict on all ranks and any of them can be saved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from tierflow.order.cursor import OrderCursor
from tierflow.order.interleave import pick_partition
from tierflow.order.order import SampleOrder
from tierflow.order.remainder import Remainder


class _NodeCounts:
    """`delivered_after(base, picks)` for one node's fixed starting counts, in O(log P + P) numpy
    per query instead of a binary search over levels: the counts are sorted once, so the number
    of picks below level L is piecewise linear in L and its level is found with one searchsorted."""

    def __init__(self, base: np.ndarray) -> None:
        self.base = np.asarray(base, dtype=np.int64)
        self.sorted = np.sort(self.base)
        self.prefix = np.concatenate([[0], np.cumsum(self.sorted)])
        ranks = np.arange(self.sorted.size, dtype=np.int64)
        self.picks_at = ranks * self.sorted - self.prefix[:-1]  # picks below level sorted[m]

    def after(self, picks: int) -> np.ndarray:
        if picks <= 0:
            return self.base.copy()
        below = int(np.searchsorted(self.picks_at, picks, side="right"))
        level = (picks + int(self.prefix[below])) // below
        after = np.maximum(self.base, level)
        eligible = np.flatnonzero(self.base <= level)
        left = picks - (below * level - int(self.prefix[below]))
        after[eligible[:left]] += 1
        return after


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
    """Seekable batch sequence of one rank: batch(b) is O(P log b) and touches O(B) samples."""

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
        self.order = order
        self.base = cursor
        self.batch_size = batch_size
        self.node = node
        self.num_nodes = num_nodes
        self.rank = rank
        self.ranks_per_node = ranks_per_node
        self.partitions = order.layout.node_partitions(node, num_nodes)
        self._delivered = np.array([cursor.batches[p] for p in self.partitions], dtype=np.int64)
        self._geometries = {
            p: order.geometry(p, batch_size) for p in range(order.partitions)
        }
        self._base_epochs = np.array(cursor.epochs, dtype=np.int64)
        self._base_offsets = np.array(cursor.offsets, dtype=np.int64)
        self._base_batches = np.array(cursor.batches, dtype=np.int64)
        self._sizes = np.asarray(order.layout.partition_sizes, dtype=np.int64)
        self._node_counts = []
        for n in range(num_nodes):
            owned = np.array(order.layout.node_partitions(n, num_nodes), dtype=np.int64)
            self._node_counts.append((owned, _NodeCounts(self._base_batches[owned])))

    def node_batch(self, pick: int) -> tuple[int, int, int]:
        """(partition, epoch, offset) of node batch `pick` counted from the cursor."""
        index, nth = pick_partition(self._delivered, pick)
        partition = self.partitions[index]
        epoch, offset = self._geometries[partition].advance(
            self.base.epochs[partition], self.base.offsets[partition], nth
        )
        return partition, epoch, offset

    def batch(self, index: int) -> Batch:
        partition, epoch, offset = self.node_batch(index * self.ranks_per_node + self.rank)
        micro = self.order.read(partition, epoch, offset, self.batch_size)
        return Batch(
            index, partition, micro.sample_ids, micro.epochs, micro.mask, self.cursor_after(index).to_dict()
        )

    def batches(self, worker: int = 0, num_workers: int = 1, start: int = 0) -> Iterator[Batch]:
        """Endless: the rank's batches b >= start with b = worker (mod num_workers)."""
        if not 0 <= worker < num_workers:
            raise ValueError(f"worker {worker} outside range({num_workers})")
        index = start + (worker - start) % num_workers
        while True:
            yield self.batch(index)
            index += num_workers

    def cursor_after(self, index: int) -> OrderCursor:
        """State once every rank of every node has consumed its batches 0..index; vectorised
        over partitions (it is computed for every batch)."""
        picks = (index + 1) * self.ranks_per_node
        batches = self._base_batches.copy()
        for owned, counts in self._node_counts:
            batches[owned] = counts.after(picks)
        moved = batches - self._base_batches
        epochs = self._base_epochs.copy()
        offsets = self._base_offsets.copy()
        if self.order.remainder is Remainder.CARRY:
            changed = moved > 0
            position = epochs * self._sizes + offsets + moved * self.batch_size
            epochs[changed], offsets[changed] = np.divmod(position[changed], self._sizes[changed])
        else:
            for p in np.flatnonzero(moved).tolist():
                epochs[p], offsets[p] = self._geometries[p].advance(int(epochs[p]), int(offsets[p]), int(moved[p]))
        return self.order.cursor(epochs.tolist(), offsets.tolist(), batches.tolist())
