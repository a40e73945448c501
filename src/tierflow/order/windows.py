"""One partition's epoch: its shards shuffled, then samples shuffled inside windows of k shards.

Epoch offset o of partition p is computed, never stored: find the window holding o (binary
search over O(shards of p) window starts), permute o inside the window - with a Feistel
permutation keyed by (seed, epoch, p, window) over the whole window, or by block groups
(groups.py) - and map the permuted slot back to (shard, row).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from tierflow.order._keys import derive_key
from tierflow.order.groups import WindowGroups
from tierflow.order.layout import PartitionLayout
from tierflow.order.permutation import FeistelPermutation


class _Identity:
    """The permutation of an unshuffled order: stored order inside each window."""

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return x


_IDENTITY = _Identity()
CHUNK = 2048
CHUNKS_KEPT = 2
WINDOWS_KEPT = 4
"""Windows whose permutation is kept built (a block-group one holds O(groups) arrays)."""


class EpochWindows:
    """The shuffled shard order and sample windows of (partition, epoch); with `group_bytes` (and
    the shards' `decoded_bytes`, and their largest blocks' `block_bytes` when known) samples are
    shuffled within block groups of each window."""

    def __init__(
        self,
        layout: PartitionLayout,
        partition: int,
        epoch: int,
        seed: int,
        window_shards: int,
        shuffle: bool = True,
        group_bytes: int = 0,
        decoded_bytes: np.ndarray | None = None,
        block_bytes: np.ndarray | None = None,
        group_samples: int = 0,
    ) -> None:
        if window_shards < 1:
            raise ValueError(f"window_shards must be >= 1, got {window_shards}")
        self.partition = partition
        self.epoch = epoch
        self.seed = seed
        self._layout = layout
        self.shuffle = shuffle
        owned = layout.partition_shards[partition]
        counts = layout.partition_counts(partition)
        if shuffle:
            shuffled = FeistelPermutation(owned.size, derive_key("shards", seed, epoch, partition))(
                np.arange(owned.size)
            )
            owned, counts = owned[shuffled], counts[shuffled]
        self.shard_order = owned
        self._counts = counts
        self.shard_starts = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
        self.size = int(self.shard_starts[-1])
        window_edges = np.append(np.arange(0, owned.size, window_shards), owned.size)
        self.window_shard_edges = window_edges
        self.window_starts = self.shard_starts[window_edges]
        if group_bytes and decoded_bytes is None:
            raise ValueError("block groups (group_bytes > 0) need the shards' decoded_bytes")
        self.group_bytes = group_bytes
        self.group_samples = group_samples
        self._decoded_bytes = decoded_bytes if group_bytes else None
        self._block_bytes = block_bytes
        self._window_permutations: OrderedDict[int, FeistelPermutation | WindowGroups] = OrderedDict()
        self._chunks: OrderedDict[int, np.ndarray] = OrderedDict()
        self._checked: set[int] = set()

    @property
    def num_windows(self) -> int:
        return int(self.window_starts.size - 1)

    def window_shards(self, window: int) -> np.ndarray:
        """Global shard indices read by `window`."""
        edges = self.window_shard_edges
        return self.shard_order[edges[window] : edges[window + 1]]

    def window_counts(self, window: int) -> np.ndarray:
        """The samples of each of `window_shards(window)`."""
        edges = self.window_shard_edges
        return self._counts[edges[window] : edges[window + 1]]

    def window_of(self, offset: int) -> int:
        return int(np.searchsorted(self.window_starts, offset, side="right") - 1)

    def _permutation(self, window: int) -> FeistelPermutation | WindowGroups | _Identity:
        if window not in self._checked:  # before a sample of it is served
            self._layout.check_window(self.partition, self.window_shards(window), self.window_counts(window))
            self._checked.add(window)
        if not self.shuffle:
            return _IDENTITY
        permutation = self._window_permutations.get(window)
        if permutation is not None:
            self._window_permutations.move_to_end(window)
            return permutation
        if self._decoded_bytes is not None:
            shards = self.window_shards(window)
            blocks = self._block_bytes[shards] if self._block_bytes is not None else None
            permutation = WindowGroups(
                self.window_counts(window),
                self._decoded_bytes[shards],
                blocks,
                self.group_bytes,
                self.seed,
                self.epoch,
                self.partition,
                window,
                self.group_samples,
            )
        else:
            size = int(self.window_starts[window + 1] - self.window_starts[window])
            permutation = FeistelPermutation(size, derive_key("window", self.seed, self.epoch, self.partition, window))
        self._window_permutations[window] = permutation
        if len(self._window_permutations) > WINDOWS_KEPT:
            self._window_permutations.popitem(last=False)
        return permutation

    def range_ids(self, start: int, stop: int) -> np.ndarray:
        """sample_ids(arange(start, stop)), from aligned chunks of CHUNK offsets evaluated at once:
        a stream reads consecutive offsets a few at a time, and numpy's per-call overhead, not the
        arithmetic, is what a small batch pays for (~15x less per sample at batch size 8)."""
        if not 0 <= start <= stop <= self.size:
            raise IndexError(
                f"offsets [{start}, {stop}) outside partition {self.partition} epoch {self.epoch} (size {self.size})"
            )
        first, last = start // CHUNK, (stop - 1) // CHUNK
        if stop == start:
            return np.zeros(0, dtype=np.int64)
        if first == last:
            return self._chunk(first)[start - first * CHUNK : stop - first * CHUNK]
        return np.concatenate(
            [self._chunk(c)[max(start - c * CHUNK, 0) : stop - c * CHUNK] for c in range(first, last + 1)]
        )

    def _chunk(self, index: int) -> np.ndarray:
        found = self._chunks.get(index)
        if found is None:
            found = self._chunks[index] = self.sample_ids(
                np.arange(index * CHUNK, min((index + 1) * CHUNK, self.size), dtype=np.int64)
            )
            found.setflags(write=False)
            if len(self._chunks) > CHUNKS_KEPT:
                self._chunks.popitem(last=False)
        else:
            self._chunks.move_to_end(index)
        return found

    def sample_ids(self, offsets: np.ndarray) -> np.ndarray:
        """Global sample ids at epoch offsets (each in range(size)) of this partition."""
        offsets = np.asarray(offsets, dtype=np.int64)
        if offsets.size and (offsets.min() < 0 or offsets.max() >= self.size):
            raise IndexError(f"offsets outside partition {self.partition} epoch {self.epoch} (size {self.size})")
        windows = np.searchsorted(self.window_starts, offsets, side="right") - 1
        slots = np.empty_like(offsets)
        first, last = (int(windows[0]), int(windows[-1])) if offsets.size else (0, -1)
        if first == last:
            start = self.window_starts[first]
            slots[:] = start + self._permutation(first)(offsets - start)
        else:
            for window in set(windows.tolist()):  # not np.unique: its first call imports numpy.ma (~15 ms)
                chosen = windows == window
                start = self.window_starts[window]
                slots[chosen] = start + self._permutation(window)(offsets[chosen] - start)
        rank = np.searchsorted(self.shard_starts, slots, side="right") - 1
        shards = self.shard_order[rank]
        return self._layout.shard_starts(shards) + (slots - self.shard_starts[rank])
