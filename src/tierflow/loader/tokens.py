"""Token windows over the concatenated token stream, and document boundaries inside them.

A window is L + 1 consecutive tokens of one shard: L inputs plus the next-token label of the
last one; shard s holds floor((n_s - 1) / L) of them, from its first token on, and consecutive
windows share one token. Windows never cross a shard boundary, so reading one needs exactly one
shard and the order's windows of k shards are all a node has to hold (a window running into the
next shard would pull in a shard the order does not otherwise need then). The price is each
shard's tail of fewer than L + 1 tokens, counted by `tokens_outside_windows` (with 256 MB
shards of uint16 tokens and L = 8192: 0.006%). The window is the order's sample; global window
i lives in the shard where the cumulative counts put it.
"""

from __future__ import annotations

import bisect
import weakref

import numpy as np

from tierflow.format.dataset import Dataset


def num_windows(num_tokens: int, seq_len: int) -> int:
    """Windows that fit in one shard: each needs L + 1 tokens, consecutive ones share one."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    return max(0, (num_tokens - 1) // seq_len)


def window_counts(token_starts: np.ndarray, seq_len: int) -> np.ndarray:
    """Per shard, how many windows it holds (token_starts: cumulative, length shards + 1)."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    return np.maximum(0, (np.diff(np.asarray(token_starts, dtype=np.int64)) - 1) // seq_len)


def tokens_outside_windows(token_starts: np.ndarray, seq_len: int) -> int:
    """Tokens no window reads: each shard's tail (the last token of a window is read twice)."""
    tokens = np.diff(np.asarray(token_starts, dtype=np.int64))
    covered = window_counts(token_starts, seq_len) * seq_len + (tokens > seq_len)
    return int((tokens - covered).sum())


def window_token_starts(token_starts: np.ndarray, seq_len: int, ids: np.ndarray) -> np.ndarray:
    """Where in the concatenated token stream each global window id starts."""
    token_starts = np.asarray(token_starts, dtype=np.int64)
    firsts = np.concatenate([[0], np.cumsum(window_counts(token_starts, seq_len))])
    shards = np.searchsorted(firsts, ids, side="right") - 1
    return token_starts[shards] + (ids - firsts[shards]) * seq_len


def document_segments(inputs: np.ndarray, eos_id: int) -> tuple[np.ndarray, int, np.ndarray]:
    """(cu_seqlens int32, max_seqlen, position_ids int32 like inputs) of a (B, L) window batch.

    A document ends with its EOS; each row also starts a segment, so no segment crosses rows.
    cu_seqlens indexes the flattened batch (row-major), as variable-length attention expects.
    """
    rows, length = inputs.shape
    total = rows * length
    starts_here = np.zeros(total, dtype=bool)
    starts_here[1:] = inputs.reshape(-1)[:-1] == eos_id
    starts_here[::length] = True
    starts = np.flatnonzero(starts_here)
    cu_seqlens = np.append(starts, total).astype(np.int32)
    position_ids = np.arange(total, dtype=np.int32)
    position_ids -= np.repeat(starts.astype(np.int32), np.diff(cu_seqlens))
    position_ids = position_ids.reshape(rows, length)
    max_seqlen = int(np.diff(cu_seqlens).max()) if cu_seqlens.size > 1 else 0
    return cu_seqlens, max_seqlen, position_ids


class TokenReader:
    """Copies token ranges of a dataset straight from its mapped blocks into a caller's buffer.

    One copy per window, also when it spans blocks or shards (Dataset.tokens would concatenate).
    """

    def __init__(self, dataset: Dataset) -> None:
        column = dataset.manifest.token_column
        if column is None:
            raise TypeError(f"{dataset.location}: not a token dataset (packed without a tokenizer)")
        self.dataset = dataset
        self.column = column
        self._block_starts: dict[int, list[int]] = {}
        self._parts: dict[tuple[int, int], tuple[int, np.ndarray, weakref.ref]] = {}
        self._prune_at = 1024
        self.pieces = 0

    def _blocks(self, shard: int) -> list[int]:
        starts = self._block_starts.get(shard)
        if starts is None:  # from the manifest's per-block token counts when the pack recorded them
            starts = self.dataset.block_token_starts(shard).tolist()
            self._block_starts[shard] = starts
        return starts

    def _values(self, shard: int, block: int) -> tuple[int, np.ndarray]:
        """(first offset, values view) of one block, kept while the shard stays open."""
        table = self.dataset.shard(shard)
        key = (shard, block)
        found = self._parts.get(key)
        if found is None or found[2]() is not table:
            offsets, values = table.list_parts(block, self.column)
            # weak: holding the table would hold its tier pin, and the tier could never evict it
            found = (int(offsets[0]), values, weakref.ref(table))
            self._parts[key] = found
            if len(self._parts) > self._prune_at:
                self._parts = {k: v for k, v in self._parts.items() if v[2]() is not None}
                self._prune_at = 2 * len(self._parts) + 1024
        return found[0], found[1]

    def copy_into(self, out: np.ndarray, start: int) -> None:
        """out[:] = tokens[start : start + len(out)]."""
        stop = start + out.shape[0]
        token_starts = self.dataset.token_starts
        if stop > int(token_starts[-1]):
            raise IndexError(f"{self.dataset.location}: tokens [{start}, {stop}) past the stream end {int(token_starts[-1])}")
        pos = start
        while pos < stop:
            shard = int(np.searchsorted(token_starts, pos, side="right")) - 1
            local = pos - int(token_starts[shard])
            blocks = self._blocks(shard)
            b = bisect.bisect_right(blocks, local) - 1
            first, values = self._values(shard, b)
            begin = first + local - blocks[b]
            take = min(stop - pos, blocks[b + 1] - local)
            out[pos - start:pos - start + take] = values[begin:begin + take]
            self.pieces += 1
            pos += take

    def copy_windows(self, out: np.ndarray, starts: np.ndarray) -> None:
        """out[r] = tokens[starts[r] : starts[r] + out.shape[1]] for every row; a row inside one
        block (almost all of them) is one slice copy, the rest go piece by piece."""
        width = out.shape[1]
        token_starts = self.dataset.token_starts
        if starts.size and int(starts.max()) + width > int(token_starts[-1]):
            raise IndexError(f"{self.dataset.location}: a window of {width} tokens from {int(starts.max())} "
                             f"runs past the stream end {int(token_starts[-1])}")
        shards = np.searchsorted(token_starts, starts, side="right") - 1
        locals_ = starts - token_starts[shards]
        for row, (shard, local) in enumerate(zip(shards.tolist(), locals_.tolist())):
            blocks = self._blocks(shard)
            b = bisect.bisect_right(blocks, local) - 1
            if local + width <= blocks[b + 1]:
                first, values = self._values(shard, b)
                begin = first + local - blocks[b]
                out[row] = values[begin:begin + width]
                self.pieces += 1
            else:
                self.copy_into(out[row], int(starts[row]))
