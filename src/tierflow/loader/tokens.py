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

from tierflow.format.metadata_windows import windows_of


def num_windows(num_tokens: int, seq_len: int) -> int:
    """Windows that fit in one shard: each needs L + 1 tokens, consecutive ones share one."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    return int(windows_of(num_tokens, seq_len))


def window_counts(token_starts: np.ndarray, seq_len: int) -> np.ndarray:
    """Per shard, how many windows it holds (token_starts: cumulative, length shards + 1)."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    return windows_of(np.diff(np.asarray(token_starts, dtype=np.int64)), seq_len)


def tokens_outside_windows(token_starts: np.ndarray, seq_len: int) -> int:
    """Tokens no window reads: each shard's tail (the last token of a window is read twice)."""
    tokens = np.diff(np.asarray(token_starts, dtype=np.int64))
    covered = window_counts(token_starts, seq_len) * seq_len + (tokens > seq_len)
    return int((tokens - covered).sum())


def window_token_starts(token_starts: np.ndarray, seq_len: int, ids: np.ndarray) -> np.ndarray:
    """Where in the concatenated token stream each global window id starts."""
    return WindowStarts(token_starts, seq_len)(np.asarray(ids, dtype=np.int64))


class WindowStarts:
    """`window_token_starts` for one dataset and window length, its per-shard tables made once: global
    window i of shard s (the shard whose first window id `firsts[s]` is the last one <= i) starts at
    token_starts[s] + (i - firsts[s]) * L, i.e. at base[s] + i * L."""

    def __init__(self, token_starts: np.ndarray, seq_len: int) -> None:
        token_starts = np.asarray(token_starts, dtype=np.int64)
        self.seq_len = seq_len
        self.firsts = np.concatenate([[0], np.cumsum(window_counts(token_starts, seq_len))]).astype(np.int64)
        self._base = token_starts[:-1] - self.firsts[:-1] * seq_len
        self._ends = self.firsts[1:]  # the first shard whose windows end past i holds window i

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        """Token starts of int64 window ids (each inside [0, windows))."""
        starts = self._base.take(self._ends.searchsorted(ids, side="right"), mode="clip")
        starts += ids * self.seq_len
        return starts


_SHAPES: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}


def _row_tables(rows: int, length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(cu_seqlens of one segment per row, position ids of one segment per row, arange(rows * L)) as
    int32, read-only, made once per batch shape (callers copy them)."""
    found = _SHAPES.get((rows, length))
    if found is None:
        total = rows * length
        cu = np.arange(0, total + 1, length, dtype=np.int32) if length else np.zeros(rows + 1, dtype=np.int32)
        positions = np.tile(np.arange(length, dtype=np.int32), rows).reshape(rows, length)
        flat = np.arange(total, dtype=np.int32)
        for a in (cu, positions, flat):
            a.setflags(write=False)
        if len(_SHAPES) > 16:
            _SHAPES.clear()
        found = _SHAPES[(rows, length)] = (cu, positions, flat)
    return found


def row_segments(rows: int, length: int) -> tuple[np.ndarray, int, np.ndarray]:
    """`document_segments` of a batch without document ends: one segment per row."""
    cu, positions, _ = _row_tables(rows, length)
    return cu.copy(), length if rows else 0, positions.copy()


_LOOP_STARTS = 32
"""Up to this many segment starts inside rows, position ids are patched a slice per start."""


def document_segments(inputs: np.ndarray, eos_id: int) -> tuple[np.ndarray, int, np.ndarray]:
    """(cu_seqlens int32, max_seqlen, position_ids int32 like inputs) of a (B, L) window batch.

    A document ends with its EOS; each row also starts a segment, so no segment crosses rows.
    cu_seqlens indexes the flattened batch (row-major), as variable-length attention expects.
    """
    rows, length = inputs.shape
    if rows * length == 0:
        return row_segments(rows, length)
    ends = inputs == eos_id
    if not ends.any():  # most windows of long documents hold no EOS
        return row_segments(rows, length)
    # a segment starts after every EOS but the one ending a row (the next row starts one anyway)
    inner = np.flatnonzero(ends)
    inner += 1
    return _segments(rows, length, inner[inner % length != 0])


def window_segments(windows: np.ndarray, eos_id: int) -> tuple[np.ndarray, int, np.ndarray]:
    """`document_segments(windows[:, :-1], eos_id)` of a (B, L + 1) window buffer, its EOS found in
    the contiguous buffer (3x faster to compare than the inputs' strided view)."""
    rows, width = windows.shape
    length = width - 1
    if rows * length == 0:
        return row_segments(rows, length)
    hits = np.flatnonzero(windows == eos_id)
    if not hits.size:
        return row_segments(rows, length)
    row, column = np.divmod(hits, width)
    inside = column < length - 1  # the labels' last token, and an EOS ending a row, start nothing
    return _segments(rows, length, row[inside] * length + column[inside] + 1)


def _segments(rows: int, length: int, inner: np.ndarray) -> tuple[np.ndarray, int, np.ndarray]:
    """The segments of a (rows, length) batch whose documents also start at flat positions `inner`
    (ascending, none at a row's start)."""
    if not inner.size:
        return row_segments(rows, length)
    row_cu, row_positions, flat = _row_tables(rows, length)
    if inner.size <= _LOOP_STARTS:  # a few starts: Python lists cost less than numpy calls on tiny arrays
        starts = inner.tolist()
        cuts = sorted([*range(0, rows * length + 1, length), *starts])
        position_ids = row_positions.copy()
        out = position_ids.reshape(-1)
        for start in starts:  # ascending: a later start in the row overwrites the rest
            end = start - start % length + length
            out[start:end] = flat[: end - start]
        return np.array(cuts, dtype=np.int32), max(b - a for a, b in zip(cuts, cuts[1:])), position_ids
    cu_seqlens = np.concatenate((row_cu, inner.astype(np.int32)))
    cu_seqlens.sort()
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    position_ids = (flat - np.repeat(cu_seqlens[:-1], lengths)).reshape(rows, length)
    return cu_seqlens, int(lengths.max()), position_ids


def run_document_starts(windows: np.ndarray, eos_id: int) -> np.ndarray:
    """The segment starts inside rows of a run of batches' (N, L + 1) window buffer, as flat
    positions of its (N, L) inputs, ascending: `window_segments`' starts for every batch of the
    run from one scan (a segment never crosses a row, so each batch's are its rows' own)."""
    rows, width = windows.shape
    length = width - 1
    hits = np.flatnonzero(windows == eos_id)
    row, column = np.divmod(hits, width)
    inside = column < length - 1
    return row[inside] * length + column[inside] + 1


def run_segments(inner: np.ndarray, batches: int, rows: int, length: int) -> list[tuple[np.ndarray, int, np.ndarray]]:
    """`window_segments` of each of a run's `batches` batches of `rows` rows, from the run's segment
    starts inside rows (`run_document_starts`), split between the batches by one search."""
    if rows * length == 0:
        return [row_segments(rows, length) for _ in range(batches)]
    size = rows * length
    bounds = inner.searchsorted(np.arange(batches + 1, dtype=np.int64) * size).tolist()
    return [
        _segments(rows, length, inner[low:high] - k * size) if high > low else row_segments(rows, length)
        for k, (low, high) in enumerate(zip(bounds, bounds[1:]))
    ]
