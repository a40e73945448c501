"""The whole-dataset check of version-3 metadata (`tierflow verify`): every column of the tables
against its hash, every shard's block rows, the stored layout recomputed, the dataset id against the shards; streamed, so memory
stays a chunk's whatever the dataset's size (opening checks only what a process uses)."""

from __future__ import annotations

import json
from typing import Any
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import xxhash
from numpy.lib.stride_tricks import sliding_window_view

from tierflow.errors import ManifestError
from tierflow.format.manifest import schema_fields
from tierflow.format.metadata_layout import verify_layout
from tierflow.format.metadata_summary import verify_summary
from tierflow.format.metadata import BLOCK_SCHEMA, METADATA_NAME, SHARD_SCHEMA, MappedManifest, MetadataTables


def verify_metadata(manifest: MappedManifest) -> list[str]:
    """Every problem with a version-3 dataset's tables, read whole, streaming: each column of both
    tables against its hash, every shard's checks and block rows, the dataset id against the shards.
    Bounded memory: the shard table's columns (~100 bytes a shard) and one shard's blocks at a time."""
    problems: list[str] = []
    tables = manifest.tables
    try:
        tables.check_chunk_table()
    except ManifestError as e:
        return [str(e)]
    for name in SHARD_SCHEMA.names:
        try:
            tables.column(name)
        except ManifestError as e:
            problems.append(str(e))
    if not problems:
        try:
            tables.checksums()  # no shard listed twice: the whole checksum_order
        except ManifestError as e:
            problems.append(str(e))
    problems += verify_layout(tables)
    if not problems:
        problems += verify_summary(tables)
    if problems:
        return problems
    hashes = {name: xxhash.xxh3_128() for name in BLOCK_SCHEMA.names}
    suspects = list(_suspect_shards(tables, hashes))  # the block table read once, hashed as it goes
    for name, h in hashes.items():
        if h.hexdigest() != tables.blocks.hashes[name]:
            problems.append(f"{tables.blocks.where}: column {name} does not match its hash in the header")
    if problems:
        return problems
    checksums = tables.column("checksum")
    for i in suspects:  # each one's own check names what is wrong
        try:
            tables.block_list(i, keep=False)
        except ManifestError as e:
            problems.append(str(e))
    recomputed = streamed_dataset_id({"fields": schema_fields(manifest.schema)}, manifest.tokenizer, checksums)
    if recomputed != manifest.dataset_id:
        problems.append(
            f"{manifest.where}/{METADATA_NAME}: dataset_id {manifest.dataset_id} does not match its "
            f"schema, tokenizer and shards ({recomputed})"
        )
    return problems


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


def _suspect_shards(tables: MetadataTables, hashes: dict[str, Any], chunk: int = 8192) -> Iterator[int]:
    """The shards whose block rows fail what `block_list` checks (their digest, rows and tokens adding
    up, every block inside the file, largest_rows), found a chunk of shards at a time: the checks
    vectorised over the chunk's blocks, the digests one hash a shard (`_shard_digests`), so memory stays a
    chunk's and a million shards take seconds, not the ~100 us a shard of building each list."""
    col = tables.column
    first, count, digest = col("first_block"), col("blocks"), col("block_digest")
    samples, tokens, size, largest, known = (
        col("samples"),
        col("tokens"),
        col("bytes"),
        col("largest_rows"),
        col("tokens_known"),
    )

    def rows_of(lo: int) -> tuple[int, int, int, dict[str, np.ndarray]]:
        hi = min(lo + chunk, tables.num_shards)
        b0, b1 = int(first[lo]), int(first[hi - 1] + count[hi - 1])
        return hi, b0, b1, {name: tables.blocks.read(name, b0, b1) for name in BLOCK_SCHEMA.names}

    with ThreadPoolExecutor(1) as reader:  # the next chunk's rows read (pread, no GIL) while this one is checked
        ahead = reader.submit(rows_of, 0) if tables.num_shards else None
        for lo in range(0, tables.num_shards, chunk):
            assert ahead is not None
            hi, b0, b1, blocks = ahead.result()
            for name, h in hashes.items():  # the chunks follow each other: together, the whole table
                h.update(blocks[name].data.cast("B"))
            ahead = reader.submit(rows_of, hi) if hi < tables.num_shards else None
            n = count[lo:hi]
            full = n > 0
            starts = (first[lo:hi] - b0)[full]
            length, rows = blocks["length"], blocks["rows"]
            bad = _per_shard(rows, np.add, starts, full) != samples[lo:hi]
            bad |= (known[lo:hi] == 1) & (_per_shard(blocks["tokens"], np.add, starts, full) != tokens[lo:hi])
            bad |= _per_shard(length, np.add, starts, full) > size[lo:hi]
            bad |= _per_shard(rows, np.maximum, starts, full) != largest[lo:hi]
            bad |= full & (_per_shard(length, np.minimum, starts, full) == 0)
            bad |= _shard_digests(blocks, first[lo:hi] - b0, n) != digest[lo:hi].astype(np.uint64)
            yield from (lo + np.flatnonzero(bad)).tolist()


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
