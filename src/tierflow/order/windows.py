"""One partition's epoch: its shards shuffled, then samples shuffled inside windows of k shards.

Epoch offset o of partition p is computed, never stored: find the window holding o (binary
search over the running sample counts of the shuffled shards, computed as far as o), permute o
inside the window - with a Feistel permutation keyed by (seed, epoch, p, window) over the whole
window, or by block groups (groups.py) - and map the permuted slot back to (shard, row).
"""

from __future__ import annotations

import threading
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
STEP_SHARDS = 1024
"""Shuffled positions an epoch's order is first computed for (a start's windows), then doubling."""
WINDOWS_KEPT = 4
"""Windows whose permutation is kept built (a block-group one holds O(groups) arrays)."""


class EpochWindows:
    """The shuffled shard order and sample windows of (partition, epoch); with `group_bytes` (and
    the shards' `decoded_bytes`, and their largest blocks' `block_bytes` when known) samples are
    shuffled within block groups of each window.

    The shuffled order and its running sample counts are computed as far as they are read, in steps
    of at least STEP_SHARDS positions (whole windows), doubling: a start reads its first windows, not
    its partition's every shard, and a resume computes up to its offset."""

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
        self._owned = layout.partition_shards[partition]
        self._owned_counts = layout.partition_counts(partition)
        n = self._owned.size
        self._shuffled = FeistelPermutation(n, derive_key("shards", seed, epoch, partition)) if shuffle else None
        self._width = window_shards
        self._step = -(-STEP_SHARDS // window_shards) * window_shards
        self._order = np.zeros(0, dtype=np.int64)  # shard at each shuffled position computed so far
        self._counts = np.zeros(0, dtype=np.int64)  # its samples
        self._starts = np.zeros(1, dtype=np.int64)  # running sum of _counts, from 0
        self.size = int(self._owned_counts.sum())
        self.num_windows = -(-n // window_shards)
        if group_bytes and decoded_bytes is None:
            raise ValueError("block groups (group_bytes > 0) need the shards' decoded_bytes")
        self.group_bytes = group_bytes
        self.group_samples = group_samples
        self._decoded_bytes = decoded_bytes if group_bytes else None
        self._block_bytes = block_bytes
        self._window_permutations: OrderedDict[int, FeistelPermutation | WindowGroups] = OrderedDict()
        self._chunks: OrderedDict[int, np.ndarray] = OrderedDict()
        self._checked: set[int] = set()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        del state["_lock"]  # a worker gets the order pickled, its windows with it
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _extend(self, positions: int) -> None:
        """Computes the shuffled order up to at least `positions` (whole steps, doubling, at most all)."""
        if positions <= self._order.size:
            return
        with self._lock:  # the stager's forecast and the batches read one order from two threads
            order, known, n = self._order, self._order.size, self._owned.size
            if positions <= known or known == n:
                return
            upto = min(n, max(positions, 2 * known, known + self._step))
            upto = min(n, -(-upto // self._width) * self._width)
            taken = np.arange(known, upto, dtype=np.int64)
            if self._shuffled is not None:
                taken = self._shuffled(taken)
            counts = np.asarray(self._owned_counts[taken], dtype=np.int64)
            self._counts = np.concatenate((self._counts, counts))
            self._starts = np.concatenate((self._starts, self._starts[-1] + np.cumsum(counts)))
            self._order = np.concatenate((order, self._owned[taken]))  # last: its size says what is known

    def _cover(self, offset: int) -> None:
        """Computes the order until the shards holding epoch offset `offset` (< size) are known."""
        while int(self._starts[-1]) <= offset and self._order.size < self._owned.size:
            self._extend(self._order.size + 1)

    @property
    def shard_order(self) -> np.ndarray:
        """Every shard of the partition in this epoch's order (computes all of it)."""
        self._extend(self._owned.size)
        return self._order

    @property
    def shard_starts(self) -> np.ndarray:
        """[0, running sum of the samples of `shard_order`...] (computes all of it)."""
        self._extend(self._owned.size)
        return self._starts

    @property
    def window_starts(self) -> np.ndarray:
        """Each window's first epoch offset, and the size (computes all of it)."""
        return self.shard_starts[self.window_shard_edges]

    @property
    def window_shard_edges(self) -> np.ndarray:
        n = self._owned.size
        return np.append(np.arange(0, n, self._width), n)

    def window_start(self, window: int) -> int:
        """The first epoch offset of `window` (num_windows: the size)."""
        position = min(window * self._width, self._owned.size)
        self._extend(position)
        return int(self._starts[position])

    def window_shards(self, window: int) -> np.ndarray:
        """Global shard indices read by `window`."""
        positions = self._positions(window)  # first: it may replace the array
        return self._order[positions]

    def window_counts(self, window: int) -> np.ndarray:
        """The samples of each of `window_shards(window)`."""
        positions = self._positions(window)
        return self._counts[positions]

    def _positions(self, window: int) -> slice:
        """The shuffled positions of `window`'s shards, computed."""
        lo, hi = window * self._width, min((window + 1) * self._width, self._owned.size)
        self._extend(hi)
        return slice(lo, hi)

    def window_of(self, offset: int) -> int:
        self._cover(offset)
        return int(np.searchsorted(self._starts, offset, side="right") - 1) // self._width

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
            size = self.window_start(window + 1) - self.window_start(window)
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
        if offsets.size:
            self._cover(int(offsets.max()))
        windows = (np.searchsorted(self._starts, offsets, side="right") - 1) // self._width
        slots = np.empty_like(offsets)
        first, last = (int(windows[0]), int(windows[-1])) if offsets.size else (0, -1)
        if first == last:
            start = self.window_start(first)
            slots[:] = start + self._permutation(first)(offsets - start)
        else:
            for window in set(windows.tolist()):  # not np.unique: its first call imports numpy.ma (~15 ms)
                chosen = windows == window
                start = self.window_start(window)
                slots[chosen] = start + self._permutation(window)(offsets[chosen] - start)
        rank = np.searchsorted(self._starts, slots, side="right") - 1
        shards = self._order[rank]
        return self._layout.shard_starts(shards) + (slots - self._starts[rank])
