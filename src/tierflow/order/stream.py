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
from tierflow.order.interleave import delivered_after, pick_partition
from tierflow.order.order import SampleOrder


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
        """State once every rank of every node has consumed its batches 0..index."""
        picks = (index + 1) * self.ranks_per_node
        epochs = list(self.base.epochs)
        offsets = list(self.base.offsets)
        batches = list(self.base.batches)
        layout = self.order.layout
        for node in range(self.num_nodes):
            owned = layout.node_partitions(node, self.num_nodes)
            before = np.array([self.base.batches[p] for p in owned], dtype=np.int64)
            after = delivered_after(before, picks)
            for p, old, new in zip(owned, before.tolist(), after.tolist()):
                epochs[p], offsets[p] = self._geometries[p].advance(epochs[p], offsets[p], new - old)
                batches[p] = new
        return self.order.cursor(epochs, offsets, batches)
