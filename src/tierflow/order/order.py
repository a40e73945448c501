"""The world-independent sample order of one dataset: layout, per-epoch windows, cursor checks.

`SampleOrder` knows the canonical partitions, how each partition's stream maps positions to
global sample ids, and how many lanes a node reads them through; `RankStream` (stream.py) turns
it into the batches one rank consumes.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any
from collections.abc import Sequence

import numpy as np

from tierflow.order._keys import derive_key
from tierflow.errors import CursorFormatError, CursorMismatchError
from tierflow.order.cursor import CURSOR_VERSION, OrderCursor
from tierflow.order.layout import PartitionLayout
from tierflow.order.permutation import FeistelPermutation
from tierflow.order.remainder import Remainder
from tierflow.order.windows import EpochWindows

WINDOWS_CACHED_SHARDS = 1 << 18
"""Shard entries the cache of built (partition, epoch) shuffles may hold (a few arrays of one int64
per shard each: ~10 MB at most). The stager walks its whole horizon every plan, and a horizon of
several epochs of every partition through a cache of two epochs' worth rebuilt every entry each
time: 426 shuffles, ~130 ms holding the GIL per plan, on the peers' tokens behind a full L2."""


@dataclass(frozen=True)
class MicroBatch:
    """B samples from one partition; mask is False on padding repeats."""

    partition: int
    sample_ids: np.ndarray
    epochs: np.ndarray
    mask: np.ndarray


class SampleOrder:
    """Deterministic, seekable order of one dataset over P canonical partitions. `shuffle=False`:
    stored order (contiguous partitions, no shard, window or lane shuffle), every epoch the same.
    `group_bytes` > 0 (with every shard's `decoded_bytes`, and the decoded size of its largest
    block, `block_bytes`, when known): samples are shuffled within block groups of about that many
    decoded bytes (at least a block, and `group_samples` samples' worth) inside each window, the
    groups shuffled (groups.py), so a batch reads a bounded number of blocks; 0: each window's
    samples shuffled all together.
    `first_epoch` = (lanes at once, window_shards): epoch 0 reads a node's lanes a few at a time, in
    groups of that many (a seeded draw), each group's whole first epoch before the next group's,
    with windows of that many shards; later epochs read every lane at once (interleave.py).
    `stored_layout`: the layout stored with the metadata (order/layout.py uses it for the counts it
    was made for); `decoded_digest`: the config's digest of `decoded_bytes` and `block_bytes` when
    the caller knows it (stored with the metadata), instead of hashing them."""

    def __init__(
        self,
        shard_sample_counts: Sequence[int],
        *,
        dataset_id: str,
        seed: int = 0,
        partitions: int = 64,
        window_shards: int = 4,
        lanes: int | None = None,
        remainder: str | Remainder = Remainder.CARRY,
        shard_bytes: Sequence[int] | None = None,
        shuffle: bool = True,
        group_bytes: int = 0,
        decoded_bytes: Sequence[int] | None = None,
        block_bytes: Sequence[int] | None = None,
        group_samples: int = 0,
        first_epoch: tuple[int, int] | None = None,
        stored_layout: Any = None,
        decoded_digest: str | None = None,
    ) -> None:
        if window_shards < 1:
            raise ValueError(f"window_shards must be >= 1, got {window_shards}")
        if lanes is not None and lanes < 1:
            raise ValueError(f"lanes must be >= 1, got {lanes}")
        if group_bytes < 0 or group_samples < 0:
            raise ValueError(f"group_bytes and group_samples must be >= 0, got {group_bytes}, {group_samples}")
        if first_epoch is not None and (len(first_epoch) != 2 or min(first_epoch) < 1):
            raise ValueError(f"first_epoch must be (lanes >= 1, window_shards >= 1), got {first_epoch}")
        self.dataset_id = dataset_id
        self.seed = int(seed)
        self.window_shards = window_shards
        self.remainder = Remainder(remainder)
        self.shuffle = bool(shuffle)
        self.layout = PartitionLayout(
            shard_sample_counts, partitions, shard_bytes, contiguous=not self.shuffle, stored=stored_layout
        )
        self.lanes = self.layout.partitions if lanes is None else min(lanes, self.layout.partitions)
        self.group_bytes = int(group_bytes) if self.shuffle else 0
        self.group_samples = int(group_samples) if self.group_bytes else 0
        self.first_epoch = (
            None if first_epoch is None or not self.shuffle else (int(first_epoch[0]), int(first_epoch[1]))
        )
        self.decoded_bytes: Any = None  # int64 per shard, or values read for the shards asked for (per_shard)
        self.block_bytes: Any = None  # int64 per shard, or values made for the shards asked for (per_shard)
        if self.group_bytes:
            shards = self.layout.num_shards
            if decoded_bytes is None or len(decoded_bytes) != shards:
                raise ValueError(f"block groups need decoded_bytes for each of the {shards} shards")
            if block_bytes is not None and len(block_bytes) != shards:
                raise ValueError(f"block_bytes has {len(block_bytes)} entries for {shards} shards")
            self.decoded_bytes = (
                decoded_bytes
                if getattr(decoded_bytes, "per_shard", False)
                else np.asarray(decoded_bytes, dtype=np.int64)
            )
            self.block_bytes = (  # per_shard: values made for the shards asked for (a mapped dataset's)
                block_bytes
                if getattr(block_bytes, "per_shard", False) or block_bytes is None
                else np.asarray(block_bytes, dtype=np.int64)
            )
        self.config: dict[str, Any] = {
            "dataset_id": dataset_id,
            "seed": self.seed,
            "partitions": self.layout.partitions,
            "window_shards": window_shards,
            "lanes": self.lanes,
            "remainder": self.remainder.value,
            "num_shards": self.layout.num_shards,
            "num_samples": self.layout.num_samples,
            "layout": self.layout.digest()[:16],
        }
        if not self.shuffle:  # only then, so a shuffled order's cursors keep their hash
            self.config["shuffle"] = False
        if self.first_epoch is not None:  # only then, so an order as wide in every epoch keeps its hash
            self.config["first_epoch"] = list(self.first_epoch)
        if self.decoded_bytes is not None:  # only then, so a full-window order's cursors keep their hash
            self.config["group_bytes"] = self.group_bytes
            if self.group_samples:  # only then, so a cursor saved before the floor keeps its hash
                self.config["group_samples"] = self.group_samples
            if decoded_digest is None:
                decoded = np.asarray(self.decoded_bytes[:], dtype=np.int64)
                sizes = (
                    decoded
                    if self.block_bytes is None
                    else np.concatenate([decoded, np.asarray(self.block_bytes[:], dtype=np.int64)])
                )
                decoded_digest = hashlib.sha256(sizes.astype("<i8").tobytes()).hexdigest()[:16]
            self.config["decoded"] = decoded_digest
        canonical = json.dumps(self.config, sort_keys=True, separators=(",", ":"))
        self.config_hash = hashlib.sha256(canonical.encode()).hexdigest()[:32]
        self._windows: OrderedDict[tuple[int, int], EpochWindows] = OrderedDict()
        per_partition = -(-self.layout.num_shards // max(1, self.layout.partitions))
        self._windows_capacity = max(2 * self.layout.partitions + 8, WINDOWS_CACHED_SHARDS // max(1, per_partition))

    @property
    def partitions(self) -> int:
        return self.layout.partitions

    def first_epoch_groups(self, lanes: int, node: int) -> list[int] | None:
        """The first-epoch group of each of a node's `lanes` lanes (None: one group, all at once):
        lanes in a seeded order, dealt `first_epoch[0]` to a group."""
        if self.first_epoch is None or lanes <= self.first_epoch[0]:
            return None
        rank = FeistelPermutation(lanes, derive_key("first-epoch", self.seed, node, lanes))(np.arange(lanes))
        return (rank // self.first_epoch[0]).tolist()

    def start(self) -> OrderCursor:
        """The cursor before the first sample of epoch 0."""
        zeros = (0,) * self.partitions
        return OrderCursor(self.seed, zeros, zeros, self.config_hash, dict(self.config))

    def load(self, state: dict[str, Any], allow_mismatch: bool = False) -> OrderCursor:
        """Validate a saved cursor against this order; O(P)."""
        cursor = OrderCursor.from_dict(state)
        if cursor.partitions != self.partitions:
            raise CursorMismatchError(
                f"cursor has {cursor.partitions} partitions, order of dataset {self.dataset_id!r} "
                f"has {self.partitions}; partition positions cannot be mapped (not even with allow_mismatch)"
            )
        if cursor.config_hash != self.config_hash:
            names = list(self.config) + [name for name in cursor.config if name not in self.config]
            differing = [
                f"{name}: cursor {cursor.config.get(name)!r} vs order {self.config.get(name)!r}"
                for name in names
                if cursor.config.get(name) != self.config.get(name)
            ]
            if not allow_mismatch:
                raise CursorMismatchError(
                    f"cursor does not match the order of dataset {self.dataset_id!r}: "
                    + ("; ".join(differing) or "config hash differs")
                    + " (pass allow_mismatch=True to resume anyway)"
                )
            epochs, offsets = [], []
            for p in range(self.partitions):
                size = int(self.layout.partition_sizes[p])
                past_end = cursor.offsets[p] >= size
                epochs.append(cursor.epochs[p] + past_end)
                offsets.append(0 if past_end else cursor.offsets[p])
            return OrderCursor(
                self.seed, tuple(epochs), tuple(offsets), self.config_hash, dict(self.config), cursor.version
            )
        for p, offset in enumerate(cursor.offsets):
            if offset >= self.layout.partition_sizes[p]:
                raise CursorFormatError(
                    f"cursor offset {offset} is past the end of partition {p} "
                    f"({int(self.layout.partition_sizes[p])} samples) of dataset {self.dataset_id!r}"
                )
        return cursor

    def cursor(self, epochs: Sequence[int], offsets: Sequence[int], version: int = CURSOR_VERSION) -> OrderCursor:
        """`version`: the edge rule the positions continue under (a resumed cursor's own)."""
        return OrderCursor(
            self.seed,
            tuple(int(e) for e in epochs),
            tuple(int(o) for o in offsets),
            self.config_hash,
            self.config,
            version,
        )

    def windows(self, partition: int, epoch: int) -> EpochWindows:
        """The (cached) shuffle of one partition's epoch; O(1) to build, its order computed as read."""
        key = (partition, epoch)
        found = self._windows.get(key)
        if found is not None:
            self._windows.move_to_end(key)
            return found
        window_shards = self.first_epoch[1] if epoch == 0 and self.first_epoch is not None else self.window_shards
        built = EpochWindows(
            self.layout,
            partition,
            epoch,
            self.seed,
            window_shards,
            self.shuffle,
            self.group_bytes,
            self.decoded_bytes,
            self.block_bytes,
            self.group_samples,
        )
        self._windows[key] = built
        if len(self._windows) > self._windows_capacity:
            self._windows.popitem(last=False)
        return built
