"""Token windows over the concatenated token stream, and document boundaries inside them.

A window is L + 1 consecutive tokens of one shard: L inputs plus the next-token label of the
last one; shard s holds floor((n_s - 1) / L) of them, from its first token on, and consecutive
windows share one token. Windows never cross a shard boundary, so reading one needs exactly one
shard and the order's windows of k shards are all a node has to hold (a window running into the
next shard would pull in a shard the order does not otherwise need then). The price is each
shard's tail of fewer than L + 1 tokens, counted by `tokens_outside_windows` (with 256 MB
shards of uint16 tokens and L = 8192: 0.006%). The window is the order's sample; global window
i lives in the shard where the cumulative counts put it (the index's per-shard `token_starts`),
and its tokens are copied by `tierflow.format.reads.TokenReader`.
"""

from __future__ import annotations

import numpy as np


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
