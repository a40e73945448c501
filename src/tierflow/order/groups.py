"""Block groups: a window's samples shuffled within runs of about `group_bytes` decoded bytes.

A compressed block is decoded whole, so a batch drawn from a whole window (k shards) decodes
nearly every block of them before it is complete, and the first batch's cost grows with the
shards' size. With groups, the window (in its shuffled shard order) is cut into groups of whole
shards (small ones, while they fit in `group_bytes` together) or equal runs of one shard's
samples (a large one, each run <= `group_bytes`, but never less than its largest block: a run
inside one block would decode as much and mix less); the groups are shuffled, then the samples
inside each group. A batch then reads a bounded run of storage - about group_bytes / block size
+ 2 blocks per group it touches - whatever the dataset's size, and consecutive batches move
between groups in a shuffled order. Both shuffles are our Feistel permutation, keyed by
(seed, epoch, partition, window) and, inside a group, that key folded with the group's index.
"""

from __future__ import annotations

import numpy as np

from tierflow.order._keys import derive_key, splitmix64_array
from tierflow.order.permutation import FeistelPermutation, permute_each

GROUP_BYTES = 256 << 10
"""The loader's default: the packer's smallest block (256 KB), so a group is a run of about the
shard's largest block (never less) in any pack, and a batch decodes two or three blocks however
many samples a shard holds. See docs/order.md ("Block groups") for the shuffle quality it keeps."""
GROUP_SAMPLES = 1024
"""The loader's default floor in samples: a group of small byte size but large samples (1 KB and
up) would hold only a batch or two, which is the stored order shuffled within the batch; 1,024
samples mix as 4 MiB groups did in benchmarks/groups.py's SGD loss (1 MiB at 1 KB a sample)."""
GROUP_FLOOR_CAP = 4 << 20
"""The sample floor asks for at most this many bytes (the default before the floor): 1,024 images of
~130 KB would otherwise make 130 MB groups, whole windows of small shards, which a cold first
epoch must fetch before its first batches."""


def floor_bytes(group_samples: int, size: int, count: int) -> int:
    """The bytes a group of a shard of `count` samples in `size` bytes holds at least for its floor of
    `group_samples` samples, up to GROUP_FLOOR_CAP."""
    return min(-(-group_samples * size // max(count, 1)), GROUP_FLOOR_CAP)


def group_edges(
    counts: np.ndarray,
    decoded_bytes: np.ndarray,
    group_bytes: int,
    block_bytes: np.ndarray | None = None,
    group_samples: int = 0,
) -> np.ndarray:
    """Slot edges (window-relative, from 0 to the window's size) of the groups of a window whose
    shards, in reading order, hold `counts` samples and `decoded_bytes` bytes (the largest block
    of each `block_bytes`); a group holds at least `group_samples` samples' worth of a shard's bytes,
    up to GROUP_FLOOR_CAP."""
    edges = [0]
    start = 0
    open_bytes = 0  # bytes of the small shards in the group still open
    blocks = block_bytes.tolist() if block_bytes is not None else [0] * len(counts)
    for count, size, block in zip(counts.tolist(), decoded_bytes.tolist(), blocks):
        if count == 0:
            continue
        limit = max(group_bytes, floor_bytes(group_samples, size, count))
        if size <= limit:
            if open_bytes and open_bytes + size > limit:
                edges.append(start)
                open_bytes = 0
            open_bytes += size
        else:
            if open_bytes:
                edges.append(start)
                open_bytes = 0
            runs = -(-size // max(limit, block))
            edges.extend((start + np.arange(1, runs) * count // runs).tolist())
            edges.append(start + count)
        start += count
    if edges[-1] != start:
        edges.append(start)
    found = np.array(edges, dtype=np.int64)  # ascending: keep each edge once (np.unique's first call
    return found[np.concatenate(([True], found[1:] != found[:-1]))]  # imports numpy.ma, ~15 ms of a start)


class WindowGroups:
    """The permutation of a window's offsets under the block-group shuffle (called like a
    FeistelPermutation: window offsets in, window slots out)."""

    def __init__(
        self,
        counts: np.ndarray,
        decoded_bytes: np.ndarray,
        block_bytes: np.ndarray | None,
        group_bytes: int,
        seed: int,
        epoch: int,
        partition: int,
        window: int,
        group_samples: int = 0,
    ) -> None:
        self.edges = group_edges(counts, decoded_bytes, group_bytes, block_bytes, group_samples)
        sizes = np.diff(self.edges)
        key = derive_key("groups", seed, epoch, partition, window)
        self.order = FeistelPermutation(sizes.size, key)(np.arange(sizes.size, dtype=np.int64))
        self.starts = np.concatenate(([0], np.cumsum(sizes[self.order]))).astype(np.int64)
        self._base = np.uint64(derive_key("group", seed, epoch, partition, window))
        self._last: tuple[int, FeistelPermutation] | None = None

    @property
    def count(self) -> int:
        return int(self.order.size)

    def __call__(self, offsets: np.ndarray) -> np.ndarray:
        offsets = np.asarray(offsets, dtype=np.int64)
        rank = np.searchsorted(self.starts, offsets, side="right") - 1
        if rank.size and rank.min() == rank.max():  # the common case: a run of offsets inside one group
            one = int(rank[0])
            return self.edges[self.order[one]] + self._group(one)(offsets - self.starts[one])
        group = self.order[rank]
        first = self.edges[group]
        keys = splitmix64_array(group.astype(np.uint64) ^ self._base)  # = derive_key(..., window, group)
        return first + permute_each(offsets - self.starts[rank], self.edges[group + 1] - first, keys)

    def _group(self, rank: int) -> FeistelPermutation:
        """The permutation inside the group read at `rank` (the last one asked for is kept)."""
        if self._last is None or self._last[0] != rank:
            group = int(self.order[rank])
            key = int(splitmix64_array(np.array([group], dtype=np.uint64) ^ self._base)[0])
            self._last = rank, FeistelPermutation(int(self.edges[group + 1] - self.edges[group]), key)
        return self._last[1]
