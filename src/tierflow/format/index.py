"""Where things live in a packed dataset: sample i -> (shard, block, row), token t -> (shard, block, offset).

One answer for every reader, from the manifest's counts alone (rows and tokens per block), so
nothing is read to find a sample or a token: the cumulative counts of every block of every shard
in one array, and a lookup is one `searchsorted` over it (vectorised for a whole batch). Built
once per `Dataset`. Packs made before blocks recorded their token counts have a shard's counts
read from its blocks' list offsets the first time a token of that shard is looked up.
"""

from __future__ import annotations

import threading
from typing import NamedTuple
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from tierflow.errors import ShardCorruptError
from tierflow.format.shard import BlockList, ShardInfo, block_rows, block_tokens

BlockTokenCounts = Callable[[int], Sequence[int]]
"""shard -> its blocks' token counts, read from the blocks (for packs that did not record them)."""


def cumulative(counts: Iterable[int]) -> np.ndarray:
    """[0, c0, c0 + c1, ...] as int64: where each of a run of counted things starts."""
    counts = np.fromiter(counts, dtype=np.int64) if not isinstance(counts, np.ndarray) else counts
    out = np.zeros(counts.size + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out


class SamplePlaces(NamedTuple):
    """Where samples live: shard, block within the shard, row within the block (int64 arrays)."""

    shard: np.ndarray
    block: np.ndarray
    row: np.ndarray


class TokenPlaces(NamedTuple):
    """Where tokens live: shard, block within the shard, offset within the block's tokens, and how
    many tokens of the block are left from there (int64 arrays)."""

    shard: np.ndarray
    block: np.ndarray
    offset: np.ndarray
    left: np.ndarray


def _known_token_counts(info: ShardInfo) -> np.ndarray | None:
    """The shard's per-block token counts from its manifest entry, None when absent or inconsistent
    (a manifest's columns as they are: no list per block, at every start)."""
    blocks = info.blocks
    if isinstance(blocks, BlockList):
        counts = blocks.tokens
    else:
        listed = block_tokens(blocks)
        counts = None if None in listed else np.array(listed, dtype=np.int64)
    if counts is None or not counts.size or int(counts.min()) < 0 or sum(counts.tolist()) != info.tokens:
        return None
    return counts


def _unknown_token_counts(info: ShardInfo) -> np.ndarray:
    """Counts that start every block of the shard at its first token (until they are read)."""
    counts = np.zeros(len(info.blocks), dtype=np.int64)
    counts[-1:] = info.tokens
    return counts


class DatasetIndex:
    """Cumulative sample and token counts per shard and per block (blocks numbered across shards).

    `sample_starts`/`token_starts`: per shard, length shards + 1. `block_samples`/`block_tokens`:
    per block of the whole dataset, length blocks + 1; shard s's blocks are numbers
    `first_block[s]` to `first_block[s + 1]`. A lookup is one searchsorted and one row take of a
    per-block table (shard, block in shard, first token, end token, first sample), so a batch of
    positions costs a handful of numpy calls, whatever its size. Thread-safe.
    """

    def __init__(self, shards: Sequence[ShardInfo], read_block_tokens: BlockTokenCounts | None = None) -> None:
        per_shard = [len(s.blocks) for s in shards]
        self.first_block = cumulative(per_shard)
        rows = [block_rows(s.blocks) for s in shards]  # columns, not records (a manifest lists thousands)
        self.block_samples = cumulative(np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64))
        self.sample_starts = self.block_samples[self.first_block]
        self.token_starts = cumulative(s.tokens for s in shards)
        known = [_known_token_counts(s) for s in shards]
        # a shard whose counts are unknown yet has all its blocks start at its first token, so a
        # lookup still finds its shard; the counts are read then (`_learn`)
        counts = [c if c is not None else _unknown_token_counts(s) for s, c in zip(shards, known)]
        self.block_tokens = cumulative(np.concatenate(counts) if counts else np.zeros(0, dtype=np.int64))
        shard_of = np.repeat(np.arange(len(shards), dtype=np.int64), per_shard)
        self._blocks = np.stack(
            [
                shard_of,
                np.arange(shard_of.size, dtype=np.int64) - self.first_block[shard_of],
                self.block_tokens[:-1],
                self.block_tokens[1:],
                self.block_samples[:-1],
            ],
            axis=1,
        )
        # token lookups: the first block whose end is past a position holds it (empty blocks end
        # where they start); its (shard, block, first token, end token), contiguous for `take`
        self._block_ends = self.block_tokens[1:]
        self._token_rows = np.ascontiguousarray(self._blocks[:, :4])
        self._unknown = {i for i, (s, c) in enumerate(zip(shards, known)) if c is None and s.blocks}
        self._read_block_tokens = read_block_tokens
        self._names = [s.name for s in shards]  # errors name the shard's file
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        del state["_lock"]  # a Dataset pickles for spawn/forkserver workers
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def num_samples(self) -> int:
        return int(self.block_samples[-1])

    @property
    def num_tokens(self) -> int:
        return int(self.token_starts[-1])

    def locate_samples(self, ids: np.ndarray) -> SamplePlaces:
        """(shard, block, row) of each global sample id (ids inside [0, num_samples))."""
        ids = np.asarray(ids, dtype=np.int64)
        rows = self._blocks[self.block_samples.searchsorted(ids, side="right") - 1]
        return SamplePlaces(rows[:, 0], rows[:, 1], ids - rows[:, 4])

    def locate_sample(self, i: int) -> tuple[int, int, int]:
        """(shard, block, row) of one sample id; the scalar form of `locate_samples`."""
        shard, block, _, _, first = self._blocks[int(self.block_samples.searchsorted(i, side="right")) - 1].tolist()
        return shard, block, i - first

    def token_blocks(self, positions: np.ndarray) -> np.ndarray:
        """Per position in the concatenated token stream (inside [0, num_tokens)), the row of its
        block: (shard, block in shard, the block's first token, its end token), int64 (n, 4)."""
        positions = np.asarray(positions, dtype=np.int64)
        if self._unknown:
            with self._lock:
                self._learn(self.token_starts.searchsorted(positions, side="right") - 1)
        return self._token_rows.take(self._block_ends.searchsorted(positions, side="right"), axis=0, mode="clip")

    def locate_tokens(self, positions: np.ndarray) -> TokenPlaces:
        """(shard, block, offset, left) of each position in the concatenated token stream."""
        positions = np.asarray(positions, dtype=np.int64)
        rows = self.token_blocks(positions)
        return TokenPlaces(rows[:, 0], rows[:, 1], positions - rows[:, 2], rows[:, 3] - positions)

    def locate_token(self, t: int) -> tuple[int, int, int, int]:
        """(shard, block, offset, left) of one token position; the scalar form of `locate_tokens`."""
        if self._unknown:
            shard, block, first, end = self.token_blocks(np.array([t]))[0].tolist()
        else:
            shard, block, first, end, _ = self._blocks[
                int(self.block_tokens.searchsorted(t, side="right")) - 1
            ].tolist()
        return shard, block, t - first, end - t

    def _learn(self, shards: np.ndarray) -> None:
        """Read the block token counts of the shards among `shards` whose counts are unknown
        (under the lock; a lock-free lookup runs only once every count is known)."""
        for s in set(np.unique(shards).tolist()) & self._unknown:
            if self._read_block_tokens is None:
                raise ValueError(
                    f"shard {self._names[s]}: its blocks' token counts are not in the manifest and "
                    f"this index has no way to read them"
                )
            counts = np.asarray(self._read_block_tokens(s), dtype=np.int64)
            first, stop = int(self.first_block[s]), int(self.first_block[s + 1])
            expected = int(self.token_starts[s + 1] - self.token_starts[s])
            if counts.size != stop - first or int(counts.sum()) != expected:
                raise ShardCorruptError(
                    f"shard {self._names[s]}: its blocks hold {int(counts.sum())} tokens in "
                    f"{counts.size} blocks, the manifest says {expected} in {stop - first}"
                )
            self.block_tokens[first + 1 : stop] = self.token_starts[s] + np.cumsum(counts[:-1])
            self._blocks[first:stop, 2] = self.block_tokens[first:stop]
            self._blocks[first:stop, 3] = self.block_tokens[first + 1 : stop + 1]
            self._token_rows[first:stop, 2:] = self._blocks[first:stop, 2:4]
            self._unknown.discard(s)
