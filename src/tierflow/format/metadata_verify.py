"""The whole-dataset check of version-3 metadata (`tierflow verify`): every column of the tables
against its hash, every shard's block rows, the stored layout recomputed, the dataset id against the shards; streamed, so memory
stays a chunk's whatever the dataset's size (opening checks only what a process uses)."""

from __future__ import annotations

import json
from typing import Any
from collections.abc import Iterator
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import xxhash
from numpy.lib.stride_tricks import sliding_window_view

from tierflow.errors import ManifestError
from tierflow.format.manifest import schema_fields
from tierflow.format.metadata_layout import verify_layout
from tierflow.format.metadata_windows import verify_windows
from tierflow.format.metadata_summary import verify_summary
from tierflow.format.metadata import (
    BLOCK_SCHEMA,
    METADATA_NAME,
    SHARD_SCHEMA,
    MappedManifest,
    MetadataTables,
    column_dtype,
)


def verify_metadata(manifest: MappedManifest) -> list[str]:
    """Every problem with a version-3 dataset's tables, read whole, streaming: each column of both
    tables against its hash, every shard's checks and block rows, the dataset id against the shards.
    Bounded memory: the shard table's columns (~100 bytes a shard) and a window of block rows at a time.
    The block table's pass runs beside the shard table's checks (numpy and xxhash release the GIL), so
    the time is the longer of the two, not their sum."""
    problems: list[str] = []
    tables = manifest.tables
    try:
        tables.check_chunk_tables()
    except ManifestError as e:
        return [str(e)]
    for name in SHARD_SCHEMA.names:
        try:
            tables.column(name)
        except ManifestError as e:
            problems.append(str(e))
    with ThreadPoolExecutor(1) as pool:
        blocks = None if problems else pool.submit(_block_problems, tables)
        if not problems:
            try:
                tables.checksums()  # no shard listed twice: the whole checksum_order
            except ManifestError as e:
                problems.append(str(e))
        problems += verify_layout(tables)
        problems += verify_windows(tables)
        if not problems:
            problems += verify_summary(tables)
        if problems:
            return problems
        checksums = tables.column("checksum")
        recomputed = streamed_dataset_id({"fields": schema_fields(manifest.schema)}, manifest.tokenizer, checksums)
        assert blocks is not None
        problems, suspects = blocks.result()
    if problems:
        return problems
    for i in suspects:  # each one's own check names what is wrong
        try:
            tables.block_list(i, keep=False)
        except ManifestError as e:
            problems.append(str(e))
    if recomputed != manifest.dataset_id:
        problems.append(
            f"{manifest.where}/{METADATA_NAME}: dataset_id {manifest.dataset_id} does not match its "
            f"schema, tokenizer and shards ({recomputed})"
        )
    return problems


def _block_problems(tables: MetadataTables) -> tuple[list[str], list[int]]:
    """The block table read once: each column against its chunks' hashes (or, with no block chunk
    table, its whole hash), and the shards whose block rows are suspect (`_suspect_shards`). The
    chunks cover every row and the chunk table is checked against the header, so hashing the whole
    column as well would hash the table twice (~0.1 s of CPU a GB)."""
    chunked = tables.block_chunks is not None
    hashes = {} if chunked else {name: xxhash.xxh3_128() for name in BLOCK_SCHEMA.names}
    mismatched: dict[str, str] = {}
    suspects = list(_suspect_shards(tables, hashes, mismatched))
    problems = []
    for name in BLOCK_SCHEMA.names:
        if name in mismatched:
            problems.append(mismatched[name])
        elif name in hashes and hashes[name].hexdigest() != tables.blocks.hashes[name]:
            problems.append(f"{tables.blocks.where}: column {name} does not match its hash in the header")
    return problems, suspects


def streamed_dataset_id(schema_json: dict, tokenizer: dict | None, checksums: np.ndarray, chunk: int = 1 << 16) -> str:
    """`compute_dataset_id` of a checksum column, its canonical JSON hashed as it is made, a chunk of
    names at a time (the same bytes: sorted keys, no spaces; hex names need no escaping), written by
    numpy, so a million shards cost milliseconds and a chunk's memory, not the whole document at once."""
    h = xxhash.xxh3_128()
    h.update(
        b'{"schema":'
        + json.dumps(schema_json["fields"], sort_keys=True, separators=(",", ":")).encode()
        + b',"shards":['
    )
    for start in range(0, len(checksums), chunk):
        raw = np.ascontiguousarray(checksums[start : start + chunk]).view(np.uint8).reshape(-1, 16)
        names = np.empty((raw.shape[0], 35), dtype=np.uint8)  # "<32 hex digits>", a row a shard
        names[:, 0] = names[:, 33] = ord('"')
        names[:, 34] = ord(",")
        names[:, 1:33:2], names[:, 2:33:2] = _HEX[raw >> 4], _HEX[raw & 15]
        h.update((b"," if start else b"") + names.tobytes()[:-1])
    h.update(b'],"tokenizer":' + json.dumps(tokenizer, sort_keys=True, separators=(",", ":")).encode() + b"}")
    return h.hexdigest()


_HEX = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)


def _suspect_shards(tables: MetadataTables, hashes: dict[str, Any], mismatched: dict[str, str]) -> Iterator[int]:
    """The shards whose block rows fail what `block_list` checks (their rows and tokens adding up,
    every block inside the file, largest_rows; the digest, for a dataset written before the block
    chunk table), found a window of block rows at a time, the checks vectorised over the shards whose
    rows the window ends, so memory stays a window's and a million shards take one pass over the
    table, not the ~100 us a shard of building each list. Each window's rows are hashed by chunk against
    the block chunk table (the first chunk of a column that does not match goes into `mismatched`) or,
    with none, into `hashes` (together, the whole table)."""
    col = tables.column
    first, count, digest = col("first_block"), col("blocks"), col("block_digest")
    samples, tokens, size, largest, known = (
        col("samples"),
        col("tokens"),
        col("bytes"),
        col("largest_rows"),
        col("tokens_known"),
    )
    ends = first + count  # contiguous from 0 (each chunk of first_block is checked to be their running sum)
    blocks, chunked = tables.blocks, tables.block_chunks is not None
    step = blocks.chunk_rows if chunked else WINDOW_ROWS
    window = max(WINDOW_ROWS // step, 1) * step  # whole chunks
    n = tables.num_shards
    starts = range(0, max(blocks.rows, 1), window)
    kinds = {name: column_dtype(blocks.schema.field(name).type) for name in BLOCK_SCHEMA.names}

    # each window is read into one of a ring of buffers (fresh ones would fault in their pages every
    # window): _READ_AHEAD in flight, the one checked, and the one before it, whose rows it may carry
    buffers = [
        {name: np.empty(window, dtype=kind) for name, kind in kinds.items()}
        for _ in range(min(_READ_AHEAD + 2, len(starts)))
    ]

    def rows_of(w: int) -> dict[str, Future[np.ndarray]]:
        b0, into = starts[w], buffers[w % len(buffers)]
        stop = min(b0 + window, blocks.rows)
        return {name: reader.submit(blocks.read, name, b0, stop, into[name]) for name in BLOCK_SCHEMA.names}

    def check(a: int, b: int, rows: dict[str, np.ndarray]) -> list[int]:
        """Shards a...b-1, whose block rows are `rows` (from the first one's)."""
        return _check_shards(
            rows,
            first[a:b] - first[a],
            count[a:b],
            samples[a:b],
            tokens[a:b],
            size[a:b],
            largest[a:b],
            known[a:b],
            None if chunked else digest[a:b],
            a,
        )

    lo = 0
    carry = {name: np.zeros(0, dtype=kind) for name, kind in kinds.items()}
    # each column's next windows read (pread, no GIL) while this one is checked: a read in flight a
    # column, as a disk's queue wants, not one after another
    with ThreadPoolExecutor(len(BLOCK_SCHEMA)) as reader:
        ahead = deque(rows_of(w) for w in range(min(_READ_AHEAD, len(starts))))
        for w, b0 in enumerate(starts):
            read = {name: f.result() for name, f in ahead.popleft().items()}
            b1 = b0 + len(read["length"])
            if w + _READ_AHEAD < len(starts):
                ahead.append(rows_of(w + _READ_AHEAD))
            for name in BLOCK_SCHEMA.names:
                if not chunked:
                    hashes[name].update(read[name].data.cast("B"))
                elif name not in mismatched:
                    mismatched.update(_chunk_mismatch(tables, name, read[name], b0))
            hi = n if b1 >= blocks.rows else int(np.searchsorted(ends, b1, side="right"))  # end in this window
            # those begun in an earlier window (one, but for empty shards) are checked on the rows carried
            # over and this window's first; the rest on the window's own rows, not copied
            mid = lo + int(np.searchsorted(first[lo:hi], b0, side="left"))
            if mid > lo:
                upto = int(ends[mid - 1]) - b0
                yield from check(lo, mid, {k: np.concatenate([carry[k], v[:upto]]) for k, v in read.items()})
            if hi > mid:
                at, upto = int(first[mid]) - b0, int(ends[hi - 1]) - b0
                yield from check(mid, hi, {k: v[at:upto] for k, v in read.items()})
            if hi < n:  # the rows of the shard not yet ended
                at = int(first[hi]) - b0
                carry = {k: v[at:] if at >= 0 else np.concatenate([carry[k], v]) for k, v in read.items()}
            lo = hi


WINDOW_ROWS = 1 << 19
"""Block rows verify reads and checks at a time (~10 MB of the four columns), whole chunks of them."""
_READ_AHEAD = 2
"""Windows of the block table read ahead of the one verify checks."""


def _chunk_mismatch(tables: MetadataTables, name: str, values: np.ndarray, b0: int) -> dict[str, str]:
    """The first chunk of a window of a block column (from row b0, whole chunks) whose hash is not the
    block chunk table's, as the problem verify reports; empty if all match."""
    step = tables.blocks.chunk_rows
    data = values.data.cast("B")
    width = values.itemsize * step
    for c, at in enumerate(range(0, data.nbytes, width), start=b0 // step):
        mismatch = tables.blocks.hash_mismatch(name, c, data[at : at + width])
        if mismatch is not None:
            return {name: mismatch}
    return {}


def _check_shards(
    blocks: dict[str, np.ndarray],
    first: np.ndarray,
    count: np.ndarray,
    samples: np.ndarray,
    tokens: np.ndarray,
    size: np.ndarray,
    largest: np.ndarray,
    known: np.ndarray,
    digest: np.ndarray | None,
    lo: int,
) -> list[int]:
    """The shards (numbered from `lo`) of a run whose block rows are `blocks` (each one's from `first`)
    that fail block_list's checks, vectorised over the run."""
    full = count > 0
    starts = first[full]
    length, rows = blocks["length"], blocks["rows"]
    bad = _per_shard(rows, np.add, starts, full) != samples
    bad |= (known == 1) & (_per_shard(blocks["tokens"], np.add, starts, full) != tokens)
    bad |= _per_shard(length, np.add, starts, full) > size
    bad |= _per_shard(rows, np.maximum, starts, full) != largest
    bad |= full & (_per_shard(length, np.minimum, starts, full) == 0)
    if digest is not None:
        bad |= _shard_digests(blocks, first, count) != digest.astype(np.uint64)
    return (lo + np.flatnonzero(bad)).tolist()


def _shard_digests(blocks: dict[str, np.ndarray], starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Each shard's `block_digest` of a chunk's block rows. The shards of one block count are copied
    together into a matrix, a row a shard laid out as the digest hashes it (lengths, rows, checksums,
    tokens, little-endian): each column's run of a shard is a row of a sliding window over it, so the
    copy moves runs, not single values, and the loop over shards only hashes a row."""
    columns = [np.ascontiguousarray(blocks[name], dtype=kind).view("<u4") for name, kind in _DIGESTED]
    widths = [np.dtype(kind).itemsize // 4 for _, kind in _DIGESTED]  # 4-byte words a block
    digests = np.empty(counts.size, dtype=np.uint64)
    for n in np.unique(counts).tolist():
        which = np.flatnonzero(counts == n)
        if n == 0:  # shards of no blocks: the digest of nothing
            digests[which] = xxhash.xxh3_64_intdigest(b"")
            continue
        record = np.empty((which.size, n * sum(widths)), dtype="<u4")
        at = 0
        for column, width in zip(columns, widths):
            record[:, at : at + n * width] = sliding_window_view(column, n * width)[::width][starts[which]]
            at += n * width
        flat, step = record.data.cast("B"), record.shape[1] * 4
        digests[which] = [xxhash.xxh3_64_intdigest(flat[i : i + step]) for i in range(0, flat.nbytes, step)]
    return digests


_DIGESTED = (("length", "<u4"), ("rows", "<u4"), ("checksum", "<u8"), ("tokens", "<u4"))
"""The block columns a shard's block_digest covers, in its order, as it hashes them."""


def _per_shard(values: np.ndarray, reduce: np.ufunc, starts: np.ndarray, full: np.ndarray) -> np.ndarray:
    """`reduce` over each shard's block rows of a chunk: `full` marks the shards with blocks, `starts`
    where theirs begin in `values`; 0 for a shard of none."""
    out = np.zeros(full.size, dtype=np.int64)
    if starts.size:  # summed as int64: a shard's uint32 rows could wrap
        out[full] = reduce.reduceat(values, starts, dtype=np.int64 if reduce is np.add else None)
    return out
