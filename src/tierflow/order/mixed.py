"""One rank stream over several datasets mixed by weight, resumable from a small JSON cursor.

Each node walks its own mixture draws g = 0, 1, 2, ... (MixtureSchedule, mixing.py): node
batch g comes from dataset d = schedule.dataset_of(g) and is that dataset's own next node
batch (its RankStream lanes), so a small dataset is up-sampled by repetition and its epochs
advance with fresh shuffles. Ranks and workers split a node's mixed stream as RankStream does:
rank r of R takes node batches j = b * R + r, worker w of W builds b = w (mod W). Steps are
synchronous, so after batch b every node has consumed the same number of draws; the cursor
records that count and each dataset's own order cursor, and seeking to it is O(D * P).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any
from collections.abc import Iterator, Sequence

import numpy as np

from tierflow.errors import CursorFormatError, CursorMismatchError
from tierflow.order.cursor import OrderCursor
from tierflow.order.mixing import MixtureSchedule
from tierflow.order.order import MicroBatch, SampleOrder
from tierflow.order.stream import RankStream

MIXED_CURSOR_VERSION = 1


@dataclass(frozen=True)
class MixedCursor:
    """Mixture draws each node has consumed, and every dataset's order cursor at that point."""

    draws: int
    cursors: tuple[OrderCursor, ...]
    weights: tuple[float, ...]
    seed: int
    config_hash: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": MIXED_CURSOR_VERSION,
            "weights": list(self.weights),
            "seed": self.seed,
            "draws": self.draws,
            "datasets": [c.to_dict() for c in self.cursors],
            "config_hash": self.config_hash,
        }

    @classmethod
    def from_dict(cls, state: Any) -> MixedCursor:
        """Parse what `to_dict` wrote (its shape only; `MixedOrder.load` checks it against a mixture)."""
        if not isinstance(state, dict) or any(
            k not in state for k in ("version", "weights", "seed", "draws", "datasets", "config_hash")
        ):
            raise CursorFormatError(
                "a mixed cursor is a dict with version, weights, seed, draws, datasets and config_hash"
            )
        if state["version"] != MIXED_CURSOR_VERSION:
            raise CursorFormatError(
                f"mixed cursor version {state['version']!r}; this tierflow reads version {MIXED_CURSOR_VERSION}"
            )
        if not isinstance(state["draws"], int) or state["draws"] < 0 or not isinstance(state["datasets"], list):
            raise CursorFormatError("mixed cursor draws must be a non-negative integer and datasets a list")
        return cls(
            state["draws"],
            tuple(OrderCursor.from_dict(c) for c in state["datasets"]),
            tuple(float(w) for w in state["weights"]),
            int(state["seed"]),
            str(state["config_hash"]),
        )


class MixedOrder:
    """Several dataset orders and their weights: the mixture's configuration and cursor checks."""

    def __init__(self, orders: Sequence[SampleOrder], weights: Sequence[float], seed: int = 0) -> None:
        if len(orders) != len(weights):
            raise ValueError(f"mixture of {len(orders)} datasets got {len(weights)} weights")
        self.orders = list(orders)
        self.weights = tuple(float(w) for w in weights)
        self.seed = int(seed)
        self.schedule = MixtureSchedule(self.weights, self.seed)
        config = {"weights": self.weights, "seed": self.seed, "datasets": [o.config_hash for o in self.orders]}
        canonical = json.dumps(config, sort_keys=True, separators=(",", ":"))
        self.config_hash = hashlib.sha256(canonical.encode()).hexdigest()[:32]

    @property
    def num_datasets(self) -> int:
        return len(self.orders)

    def cursor(self, draws: int, cursors: Sequence[OrderCursor]) -> MixedCursor:
        return MixedCursor(int(draws), tuple(cursors), self.weights, self.seed, self.config_hash)

    def start(self) -> MixedCursor:
        return self.cursor(0, [o.start() for o in self.orders])

    def load(self, state: dict[str, Any], allow_mismatch: bool = False) -> MixedCursor:
        """Validate a saved mixed cursor; O(D * P). Different weights or seed are refused unless
        allowed (then the draw count is kept and this mixture's schedule continues from it); a
        different number of datasets is always refused."""
        if not isinstance(state, dict) or any(
            k not in state for k in ("version", "weights", "seed", "draws", "datasets")
        ):
            raise CursorFormatError("a mixed cursor is a dict with version, weights, seed, draws and datasets")
        if state["version"] != MIXED_CURSOR_VERSION:
            raise CursorFormatError(
                f"mixed cursor version {state['version']!r}; this tierflow reads version {MIXED_CURSOR_VERSION}"
            )
        if not isinstance(state["draws"], int) or state["draws"] < 0:
            raise CursorFormatError(f"mixed cursor draws must be a non-negative integer, got {state['draws']!r}")
        saved = state["datasets"]
        if not isinstance(saved, list) or len(saved) != self.num_datasets:
            count = len(saved) if isinstance(saved, list) else saved
            raise CursorMismatchError(
                f"mixed cursor holds {count} datasets, this mixture has {self.num_datasets} "
                "(not resumable, not even with allow_mismatch)"
            )
        differing = [
            f"{name}: cursor {state[name]!r} vs mixture {value!r}"
            for name, value in (("weights", list(self.weights)), ("seed", self.seed))
            if state[name] != value
        ]
        if differing and not allow_mismatch:
            raise CursorMismatchError(
                "mixed cursor does not match this mixture: "
                + "; ".join(differing)
                + " (pass allow_mismatch=True to resume anyway)"
            )
        cursors = []
        for d, (order, dataset_state) in enumerate(zip(self.orders, saved)):
            try:
                cursors.append(order.load(dataset_state, allow_mismatch))
            except CursorMismatchError as error:
                raise CursorMismatchError(f"mixture dataset {d}: {error}") from error
        return self.cursor(state["draws"], cursors)


@dataclass(frozen=True)
class MixedBatch:
    """Batch `index` of a rank: which dataset it came from, that dataset's global sample ids,
    their epochs (the dataset's own), the padding mask, and the mixed cursor after it."""

    index: int
    dataset: int
    partition: int
    sample_ids: np.ndarray
    epochs: np.ndarray
    mask: np.ndarray
    cursor: dict[str, Any]


class MixedRankStream:
    """Seekable mixed batch sequence of one rank: batch(b) costs O(log D + P log b + B), and its
    cursor O(D * P)."""

    def __init__(
        self,
        mixture: MixedOrder,
        cursor: MixedCursor,
        *,
        batch_size: int,
        node: int = 0,
        num_nodes: int = 1,
        rank: int = 0,
        ranks_per_node: int = 1,
    ) -> None:
        if not 0 <= rank < ranks_per_node:
            raise ValueError(f"rank {rank} outside range({ranks_per_node}) of node {node}")
        if len(cursor.cursors) != mixture.num_datasets:
            raise CursorMismatchError(
                f"mixed cursor holds {len(cursor.cursors)} datasets, mixture has {mixture.num_datasets}"
            )
        self.mixture = mixture
        self.base = cursor
        self.batch_size = batch_size
        self.rank = rank
        self.ranks_per_node = ranks_per_node
        # One node stream per dataset, counted from the cursor; RankStream with R = 1 makes its
        # node batch k equal to its batch k, and its cursor_after(k) the state after k + 1 picks.
        self.datasets = [
            RankStream(order, dataset_cursor, batch_size=batch_size, node=node, num_nodes=num_nodes)
            for order, dataset_cursor in zip(mixture.orders, cursor.cursors)
        ]
        self._base_counts = mixture.schedule.counts_after(cursor.draws)

    def node_batch(self, pick: int) -> tuple[int, MicroBatch]:
        """(dataset, its micro-batch) of the node's mixed batch `pick` from the cursor."""
        dataset, local = self.mixture.schedule.dataset_of(self.base.draws + pick)
        return dataset, self.datasets[dataset].node_batch(local - self._base_counts[dataset])

    def batch(self, index: int) -> MixedBatch:
        dataset, micro = self.node_batch(index * self.ranks_per_node + self.rank)
        cursor = self.cursor_after(index).to_dict()
        return MixedBatch(index, dataset, micro.partition, micro.sample_ids, micro.epochs, micro.mask, cursor)

    def batches(self, worker: int = 0, num_workers: int = 1, start: int = 0) -> Iterator[MixedBatch]:
        """Endless: the rank's batches b >= start with b = worker (mod num_workers)."""
        if not 0 <= worker < num_workers:
            raise ValueError(f"worker {worker} outside range({num_workers})")
        index = start + (worker - start) % num_workers
        while True:
            yield self.batch(index)
            index += num_workers

    def cursor_after(self, index: int) -> MixedCursor:
        """State once every rank of every node has consumed its batches 0..index."""
        draws = self.base.draws + (index + 1) * self.ranks_per_node
        counts = self.mixture.schedule.counts_after(draws)
        cursors = []
        for d, stream in enumerate(self.datasets):
            picks = counts[d] - self._base_counts[d]
            cursors.append(stream.cursor_after(picks - 1) if picks > 0 else stream.base)
        return self.mixture.cursor(draws, cursors)
