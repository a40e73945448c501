"""Metadata that is opened, not parsed (format version 3): a small JSON header and two Arrow IPC files.

A version-2 manifest is one JSON document holding every shard and every block; each process parses
all of it (1.7 MB and 0.09 s at 1,000 shards, 160 MB, 6 s and 1.3 GB at 100,000). Version 3 keeps
the dataset-wide fields in `metadata.json` (a few KB whatever the size) and puts the per-shard and
per-block rows in two uncompressed Arrow IPC files, memory-mapped read-only:

- the shard table, one row a shard: checksum and decoded_checksum (16 bytes each: the shard's name
  is `shard-<checksum hex>.arrow`, so no name in it can be a path), compression (an index into
  COMPRESSIONS), samples, bytes, decoded_bytes, tokens, sample_start, token_start (the running sums,
  so an index needs no pass over the shards), first_block, blocks (its rows of the block table),
  largest_rows (rows of its largest block), tokens_known (1 when every block's token count was
  recorded), block_digest (xxh3-64 of its rows of the block table) and checksum_order (the shards
  sorted by checksum: no shard twice is O(shards) compares, and a key finds its shards without a sort);
- the block table, one row a block, shard after shard: length, rows, checksum (the xxh3-64 value),
  tokens (uint32; the blocks are contiguous from offset 0, so offsets are the lengths' running sum).

Both file names carry their content hash (`metadata-shards-<xxh3-128>.arrow`), so writing new tables
never touches the ones a published header names; the header is written last, atomically (temp file,
fsync, rename), and is the commit point: a crash leaves the previous header (or manifest) valid.
Opening reads the header and the IPC footers: O(1) in the number of shards. A node's processes map
the same files, so they share the pages through the page cache.

Integrity, as strong as the manifest's checksum, paid as it is used:
- the header is checksummed (xxh3-128 of its canonical JSON) and names each table file's size, row
  count and, per column, the xxh3-128 of the column's bytes;
- a shard-table column is hashed whole and checked (ranges, running sums, totals against the header)
  the first time a process uses it, once: ~8 MB at a million shards, a few ms at memory speed, and
  only for the columns that process reads (a rank's order needs `samples`; names need `checksum`);
- a shard's block rows are checked against its `block_digest` (and bounds-checked as a manifest's
  are) the first time that shard is used, so a rank touches only the block rows of the shards it
  reads: the block table (~1.3 GB at a million shards of 64 blocks) is never read whole at open;
- `verify_metadata` (`tierflow verify`) hashes every column of both tables, streaming, and checks
  the dataset id against the shards, in bounded memory.
The trade-off: a damaged row in a shard-table column is refused when the column is first used (the
whole column), a damaged block row when its shard is first used, never later than that and never
served; a process pays for the columns and shards it uses, not for the dataset (hashing every column
and every block row at open would be ~1.4 GB read at a million shards, by every process). What is
not checked at open is the dataset id against the checksums (a JSON of every name): the header's
checksum covers the recorded id, and `verify` recomputes it. Anything wrong is a ManifestError
naming the dataset, the file and what is wrong.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence as SequenceABC
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import xxhash

from tierflow.errors import ManifestError, ShardCorruptError
from tierflow.format._atomic import write_atomically
from tierflow.format.manifest import (MANIFEST_NAME, Manifest, _check_fields, schema_fields, schema_from_json,
                                      schema_to_json)
from tierflow.format.shard import COMPRESSIONS, MAX_COUNT, BlockList, ShardInfo, block_rows, shard_name

METADATA_NAME = "metadata.json"
METADATA_VERSION = 3
HEADER_CHECKSUM_KEY = "header_checksum"
MAX_HEADER_BYTES = 16 << 20
"""A header is a few KB (schema, tokenizer, stats); larger is refused unread."""
LEGACY_MANIFEST_SHARDS = 10_000
"""Up to this many shards pack writes manifest.json beside the version-3 metadata."""
TABLE_PREFIX = "metadata-"
TABLE_SUFFIX = ".arrow"

SHARD_SCHEMA = pa.schema([
    ("checksum", pa.binary(16)), ("decoded_checksum", pa.binary(16)), ("compression", pa.uint8()),
    ("samples", pa.int64()), ("bytes", pa.int64()), ("decoded_bytes", pa.int64()), ("tokens", pa.int64()),
    ("sample_start", pa.int64()), ("token_start", pa.int64()), ("first_block", pa.int64()), ("blocks", pa.int64()),
    ("largest_rows", pa.int64()), ("tokens_known", pa.uint8()), ("block_digest", pa.uint64()),
    ("checksum_order", pa.int64()),
])
BLOCK_SCHEMA = pa.schema([("length", pa.uint32()), ("rows", pa.uint32()), ("checksum", pa.uint64()),
                          ("tokens", pa.uint32())])
_COUNT_COLUMNS = ("samples", "bytes", "decoded_bytes", "tokens", "blocks", "largest_rows")


def _numpy_dtype(kind: pa.DataType) -> Any:
    return np.dtype("V16") if pa.types.is_fixed_size_binary(kind) else np.dtype(kind.to_pandas_dtype())


def has_metadata(directory: str | Path) -> bool:
    """Whether a directory holds a version-3 header (the reader prefers it to manifest.json)."""
    return (Path(directory) / METADATA_NAME).is_file()


def header_checksum(d: dict) -> str:
    body = {k: v for k, v in d.items() if k != HEADER_CHECKSUM_KEY}
    return xxhash.xxh3_128_hexdigest(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


# ------------------------------------------------------------------------------------------ writing
def block_digest(length: np.ndarray, rows: np.ndarray, checksum: np.ndarray, tokens: np.ndarray) -> int:
    """xxh3-64 of one shard's block rows, column after column (little-endian)."""
    h = xxhash.xxh3_64()
    for column, kind in ((length, "<u4"), (rows, "<u4"), (checksum, "<u8"), (tokens, "<u4")):
        h.update(np.ascontiguousarray(column, dtype=kind).tobytes())
    return h.intdigest()


def columns_from_shards(shards: Sequence[ShardInfo]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The shard and block tables' columns for a list of shards (pack, upgrade). ValueError for a
    shard the tables cannot hold (blocks not contiguous from 0, a value beyond its column)."""
    n = len(shards)
    cols: dict[str, np.ndarray] = {name: np.zeros(n, dtype=_numpy_dtype(SHARD_SCHEMA.field(name).type))
                                   for name in SHARD_SCHEMA.names}
    lengths, rows, sums, tokens = [], [], [], []
    first = 0
    for i, s in enumerate(shards):
        blocks = s.blocks
        if isinstance(blocks, BlockList):
            b_len, b_rows, b_off = blocks.lengths, blocks.rows, blocks.offsets
            b_sum = (np.asarray(blocks.checksums, dtype=np.uint64) if not isinstance(blocks.checksums, list)
                     else np.array([int(c, 16) for c in blocks.checksums], dtype=np.uint64))
            b_tok = blocks.tokens
        else:
            b_len = np.array([b.length for b in blocks], dtype=np.int64)
            b_rows = np.array([b.rows for b in blocks], dtype=np.int64)
            b_off = np.array([b.offset for b in blocks], dtype=np.int64)
            b_sum = np.array([int(b.checksum, 16) for b in blocks], dtype=np.uint64)
            listed = [b.tokens for b in blocks]
            b_tok = None if (not listed or None in listed) else np.array(listed, dtype=np.int64)
        count = len(b_len)
        if count and (int(b_off[0]) != 0 or np.any(b_off[1:] != np.cumsum(b_len)[:-1])):
            raise ValueError(f"shard {s.name}: its blocks are not contiguous from offset 0")
        known = b_tok is not None and count > 0
        t = np.asarray(b_tok, dtype=np.int64) if known else np.zeros(count, dtype=np.int64)
        for name, values in (("length", b_len), ("rows", b_rows), ("tokens", t)):
            if count and (int(np.min(values)) < 0 or int(np.max(values)) >= 1 << 32):
                raise ValueError(f"shard {s.name}: a block's {name} does not fit 32 bits")
        lengths.append(np.asarray(b_len, dtype=np.uint32))
        rows.append(np.asarray(b_rows, dtype=np.uint32))
        sums.append(b_sum)
        tokens.append(t.astype(np.uint32))
        cols["checksum"][i] = np.frombuffer(bytes.fromhex(s.checksum), dtype="V16")[0]
        cols["decoded_checksum"][i] = np.frombuffer(bytes.fromhex(s.decoded_checksum), dtype="V16")[0]
        cols["compression"][i] = COMPRESSIONS.index(s.compression)
        for name in ("samples", "bytes", "decoded_bytes", "tokens"):
            cols[name][i] = getattr(s, name)
        cols["first_block"][i], cols["blocks"][i] = first, count
        cols["largest_rows"][i] = int(np.max(b_rows)) if count else 0
        cols["tokens_known"][i] = int(known)
        cols["block_digest"][i] = block_digest(lengths[-1], rows[-1], sums[-1], tokens[-1])
        first += count
    cols["sample_start"] = _starts(cols["samples"])
    cols["token_start"] = _starts(cols["tokens"])

    def cat(parts: list[np.ndarray], kind: str) -> np.ndarray:
        return np.concatenate(parts).astype(kind) if parts else np.zeros(0, dtype=kind)
    blocks = {"length": cat(lengths, "<u4"), "rows": cat(rows, "<u4"), "checksum": cat(sums, "<u8"),
              "tokens": cat(tokens, "<u4")}
    return cols, blocks


_KEY = np.dtype([("hi", ">u8"), ("lo", ">u8")])
"""A 16-byte checksum as two big-endian halves: numpy orders these as the bytes (the hex) order."""


def checksum_order(checksums: np.ndarray) -> np.ndarray:
    """The shards in the order of their checksums (the `checksum_order` column): with it a reader
    checks that no shard is listed twice, and finds a shard by its key, without sorting."""
    return np.argsort(np.ascontiguousarray(checksums).view(_KEY), kind="stable").astype(np.int64)


def _starts(counts: np.ndarray) -> np.ndarray:
    out = np.zeros(counts.size, dtype=np.int64)
    np.cumsum(counts[:-1], out=out[1:])
    return out


def _arrow_column(values: np.ndarray, kind: pa.DataType) -> pa.Array:
    if pa.types.is_fixed_size_binary(kind):
        data = np.ascontiguousarray(values).view(np.uint8)
        return pa.Array.from_buffers(kind, len(values), [None, pa.py_buffer(data)])
    return pa.array(np.ascontiguousarray(values, dtype=_numpy_dtype(kind)), type=kind)


def column_digest(values: np.ndarray | memoryview | pa.Buffer) -> str:
    return xxhash.xxh3_128_hexdigest(memoryview(values).cast("B") if not isinstance(values, pa.Buffer)
                                     else values)


def _write_table(directory: Path, kind: str, schema: pa.Schema, columns: dict[str, np.ndarray]) -> dict:
    """One table as an uncompressed Arrow IPC file named by its content hash (temp file, fsync,
    rename); its entry for the header."""
    rows = len(next(iter(columns.values()))) if columns else 0
    arrays = [_arrow_column(columns[name], schema.field(name).type) for name in schema.names]
    batch = pa.RecordBatch.from_arrays(arrays, schema=schema)
    tmp = directory / f".tmp-{os.getpid()}-{threading.get_ident()}-{kind}{TABLE_SUFFIX}"
    digest = xxhash.xxh3_128()
    try:
        with pa.OSFile(str(tmp), "wb") as sink:
            with pa.ipc.new_file(sink, schema) as writer:
                writer.write_batch(batch)
        with open(tmp, "rb") as f:
            while chunk := f.read(8 << 20):
                digest.update(chunk)
            os.fsync(f.fileno())
        name = f"{TABLE_PREFIX}{kind}-{digest.hexdigest()}{TABLE_SUFFIX}"
        os.replace(tmp, directory / name)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    hashes = {name: column_digest(_column_bytes(arr)) for name, arr in zip(schema.names, arrays)}
    return {"file": name, "rows": rows, "size": (directory / name).stat().st_size, "columns": hashes}


def _column_bytes(arr: pa.Array) -> memoryview:
    width = arr.type.byte_width
    buf = arr.buffers()[1]
    if buf is None:
        return memoryview(b"")
    return memoryview(buf).cast("B")[arr.offset * width:(arr.offset + len(arr)) * width]


def write_metadata(directory: str | Path, manifest: Manifest | None = None, *,
                   shard_columns: dict[str, np.ndarray] | None = None,
                   block_columns: dict[str, np.ndarray] | None = None, fields: dict | None = None,
                   manifest_bytes: bytes | None = None) -> Path:
    """Write the version-3 metadata of a dataset directory: both tables, then the header last
    (atomically), so a reader sees the old metadata or the new, whole. From a `manifest` (pack,
    upgrade) or from ready columns (`shard_columns`/`block_columns` as `columns_from_shards` gives
    them, `fields` the header's dataset-wide fields: what a synthetic or converted dataset writes).
    `manifest_bytes`: the manifest.json published beside it (pack, upgrade), recorded by size and
    hash: a reader takes the header only while the manifest beside it is that one, so an edited or
    replaced manifest.json is read (and judged) as itself, never shadowed by an older header."""
    directory = Path(directory)
    if manifest is not None:
        shard_columns, block_columns = columns_from_shards(manifest.shards)
        fields = {"dataset_id": manifest.dataset_id, "schema": schema_to_json(manifest.schema),
                  "tokenizer": manifest.tokenizer, "token_column": manifest.token_column,
                  "token_dtype": manifest.token_dtype, "eos_id": manifest.eos_id, "stats": manifest.stats}
    assert shard_columns is not None and block_columns is not None and fields is not None
    shard_columns = dict(shard_columns)
    shard_columns["checksum_order"] = checksum_order(np.asarray(shard_columns["checksum"]))
    for name in ("sample_start", "token_start"):
        if name not in shard_columns:
            shard_columns[name] = _starts(np.asarray(shard_columns[name.split("_")[0] + "s"], dtype=np.int64))
    shards = _write_table(directory, "shards", SHARD_SCHEMA, shard_columns)
    blocks = _write_table(directory, "blocks", BLOCK_SCHEMA, block_columns)
    totals = {key: int(np.asarray(shard_columns[key], dtype=np.int64).sum())
              for key in ("samples", "tokens", "bytes", "decoded_bytes", "blocks")}
    header = {"format": "tierflow", "format_version": METADATA_VERSION, **fields,
              "shards": shards, "blocks": blocks, "totals": totals,
              "manifest": None if manifest_bytes is None else
              {"size": len(manifest_bytes), "xxh3": xxhash.xxh3_128_hexdigest(manifest_bytes)}}
    header[HEADER_CHECKSUM_KEY] = header_checksum(header)
    return _publish(directory, METADATA_NAME, json.dumps(header, indent=1).encode())


def _publish(directory: Path, name: str, data: bytes) -> Path:
    return write_atomically(directory / name, data)


# ------------------------------------------------------------------------------------------ reading
def _is_count(v: Any) -> bool:
    return type(v) is int and 0 <= v < MAX_COUNT


def parse_header(raw: bytes, where: str) -> dict:
    """The header's fields, checked: JSON, format and version, its checksum, the types of every
    field a reader uses. ManifestError naming `where` otherwise."""
    def fail(msg: str) -> ManifestError:
        return ManifestError(f"{where}: {msg}")

    if len(raw) > MAX_HEADER_BYTES:
        raise fail(f"{len(raw)} bytes, more than the {MAX_HEADER_BYTES} a metadata header may have; refused")
    try:
        d = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise fail(f"not valid JSON ({e})") from None
    except RecursionError:
        raise fail("JSON nested too deeply to be a metadata header") from None
    if not isinstance(d, dict) or d.get("format") != "tierflow":
        raise fail("not a tierflow metadata header (missing \"format\": \"tierflow\")")
    if d.get("format_version") != METADATA_VERSION or type(d.get("format_version")) is not int:
        raise fail(f"unknown format_version {d.get('format_version')!r:.40}; this header reader reads "
                   f"version {METADATA_VERSION}")
    try:
        recorded = d.get(HEADER_CHECKSUM_KEY)
        if not isinstance(recorded, str) or recorded != header_checksum(d):
            raise fail(f"{HEADER_CHECKSUM_KEY} {recorded!r:.40} does not match the header's contents "
                       f"(damaged or edited; run `tierflow upgrade` again, or restore it)")
    except (ValueError, TypeError, OverflowError, RecursionError) as e:
        raise fail(f"the header does not serialise ({type(e).__name__}: {e})") from None
    _check_fields(d, fail)
    if not isinstance(d.get("dataset_id"), str):
        raise fail("dataset_id is missing")
    for table, schema in (("shards", SHARD_SCHEMA), ("blocks", BLOCK_SCHEMA)):
        entry = d.get(table)
        if not isinstance(entry, dict):
            raise fail(f"\"{table}\" is not an object")
        name = entry.get("file")
        if (not isinstance(name, str) or not name.startswith(f"{TABLE_PREFIX}{table}-")
                or not name.endswith(TABLE_SUFFIX) or "/" in name or "\\" in name or ".." in name):
            raise fail(f"{table}.file {name!r:.80} is not a metadata table inside the dataset "
                       f"(paths, '..' and URLs are refused)")
        if not _is_count(entry.get("rows")) or not _is_count(entry.get("size")):
            raise fail(f"{table}.rows or {table}.size is not a count")
        hashes = entry.get("columns")
        if not isinstance(hashes, dict) or set(hashes) != set(schema.names) or \
                not all(isinstance(v, str) for v in hashes.values()):
            raise fail(f"{table}.columns does not list a hash for each of {schema.names}")
    beside = d.get("manifest")
    if beside is not None and not (isinstance(beside, dict) and _is_count(beside.get("size"))
                                   and isinstance(beside.get("xxh3"), str)):
        raise fail("\"manifest\" is not null or the size and hash of the manifest.json beside it")
    totals = d.get("totals")
    if not isinstance(totals, dict) or not all(_is_count(totals.get(k)) for k in
                                               ("samples", "tokens", "bytes", "decoded_bytes", "blocks")):
        raise fail("totals are not counts of samples, tokens, bytes, decoded_bytes and blocks")
    if totals["blocks"] != d["blocks"]["rows"]:
        raise fail(f"totals.blocks = {totals['blocks']}, but the block table has {d['blocks']['rows']} rows")
    for key, total in (("samples", totals["samples"]), ("tokens", totals["tokens"])):
        stats = d.get("stats") or {}
        if type(stats.get(key)) is int and stats[key] != total:
            raise fail(f"stats.{key} = {stats[key]}, but the shards' {key} sum to {total}")
    return d


class _Table:
    """One mapped IPC table: columns as numpy views into the mapping, each hashed against the
    header the first time it is handed out (unless `verify` is False: a caller checking ranges)."""

    def __init__(self, directory: Path, entry: dict, schema: pa.Schema, where: str) -> None:
        self.path = directory / entry["file"]
        self.where = f"{where}: {entry['file']}"
        self.rows = entry["rows"]
        self.hashes = entry["columns"]
        self.schema = schema
        try:
            size = os.stat(self.path).st_size
        except FileNotFoundError:
            raise ManifestError(f"{self.where}: missing (the header names a table the dataset does not hold)") from None
        if size != entry["size"]:
            raise ManifestError(f"{self.where}: {size} bytes, the header says {entry['size']} (damaged or replaced)")
        try:
            self._map = pa.memory_map(str(self.path), "r")
            reader = pa.ipc.open_file(self._map)
            if reader.num_record_batches != 1:
                raise ValueError(f"{reader.num_record_batches} record batches, not 1")
            batch = reader.get_batch(0)
            if not batch.schema.equals(schema):
                raise ValueError(f"its schema is not the {len(schema)} columns of this format")
            if batch.num_rows != self.rows:
                raise ValueError(f"{batch.num_rows} rows, the header says {self.rows}")
            batch.validate()
        except ManifestError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever pyarrow says of a damaged file
            raise ManifestError(f"{self.where}: not a readable metadata table ({type(e).__name__}: {e})") from None
        self._batch = batch
        self._checked: dict[str, np.ndarray] = {}
        self._lock = threading.RLock()  # a column's check may use another column of the table

    def raw(self, name: str) -> np.ndarray:
        """The column as a read-only numpy view of the mapping, not yet hashed."""
        arr = self._batch.column(name)
        if arr.null_count:
            raise ManifestError(f"{self.where}: column {name} has nulls")
        kind = _numpy_dtype(arr.type)
        buf = arr.buffers()[1]
        if buf is None or not self.rows:
            return np.zeros(0, dtype=kind)
        view = np.frombuffer(buf, dtype=kind, count=len(arr) + arr.offset)[arr.offset:]
        return view

    def read(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of a column read from the file (pread), not through the mapping: a pass
        over a whole table (verify) keeps its memory to a chunk instead of mapping every page."""
        arr = self._batch.column(name)
        kind = _numpy_dtype(arr.type)
        buf = arr.buffers()[1]
        if buf is None or stop <= start:
            return np.zeros(0, dtype=kind)
        base = self._map_base()
        offset = buf.address - base + (arr.offset + start) * kind.itemsize
        size = (stop - start) * kind.itemsize
        if not 0 <= offset <= offset + size <= os.fstat(self._fd()).st_size:
            raise ManifestError(f"{self.where}: column {name} lies outside the file")
        data = os.pread(self._fd(), size, offset)
        if len(data) != size:
            raise ManifestError(f"{self.where}: column {name} is cut short")
        return np.frombuffer(data, dtype=kind)

    def _map_base(self) -> int:
        if not hasattr(self, "_base"):
            self._base = _mapping_address(self._map)
        return self._base

    def _fd(self) -> int:
        with self._lock:
            if not hasattr(self, "_file"):
                self._file = os.open(self.path, os.O_RDONLY)
        return self._file

    def __del__(self) -> None:
        fd = getattr(self, "_file", None)
        if fd is not None:
            os.close(fd)

    def column(self, name: str, check: Callable[[np.ndarray], str | None] | None = None) -> np.ndarray:
        found = self._checked.get(name)
        if found is not None:
            return found
        with self._lock:
            found = self._checked.get(name)
            if found is not None:
                return found
            values = self.raw(name)
            if column_digest(values) != self.hashes[name]:
                raise ManifestError(f"{self.where}: column {name} does not match its hash in the header "
                                    f"(damaged or edited; run `tierflow upgrade` again, or restore it)")
            problem = check(values) if check is not None else None
            if problem is not None:
                raise ManifestError(f"{self.where}: {problem}")
            self._checked[name] = values
            return values


def _mapping_address(mapped: pa.MemoryMappedFile) -> int:
    """The address where a memory-mapped file's byte 0 lies (its buffers' offsets in the file follow)."""
    mapped.seek(0)
    return mapped.read_buffer(1).address


class MetadataTables:
    """A dataset's mapped shard and block tables, each column verified once, on first use."""

    def __init__(self, directory: Path, header: dict, where: str) -> None:
        self.directory = directory
        self.where = where
        self.header = header
        self.totals = header["totals"]
        self.shards = _Table(directory, header["shards"], SHARD_SCHEMA, where)
        self.blocks = _Table(directory, header["blocks"], BLOCK_SCHEMA, where)
        self.num_shards = self.shards.rows
        self._lock = threading.Lock()
        self._block_lists: dict[int, BlockList] = {}

    def column(self, name: str) -> np.ndarray:
        """A shard-table column (int64 counts, 16-byte checksums), hashed and range-checked once."""
        return self.shards.column(name, lambda v: self._check(name, v))

    def _check(self, name: str, v: np.ndarray) -> str | None:
        n = self.num_shards
        if name in _COUNT_COLUMNS and v.size and (int(v.min()) < 0 or int(v.max()) >= MAX_COUNT):
            i = int(np.flatnonzero((v < 0) | (v >= MAX_COUNT))[0])
            return f"shard #{i}: {name} = {int(v[i])} is negative or absurd"
        if name == "compression" and v.size and int(v.max()) >= len(COMPRESSIONS):
            i = int(np.argmax(v >= len(COMPRESSIONS)))
            return f"shard #{i}: unknown compression code {int(v[i])}"
        if name == "tokens_known" and v.size and int(v.max()) > 1:
            return "tokens_known is not 0 or 1"
        if name in ("samples", "tokens"):
            total = int(v.sum(dtype=np.int64)) if v.size else 0  # each < 2**48: 10**6 of them cannot wrap
            if total != self.totals[name]:
                return f"the shards' {name} sum to {total}, the header says {self.totals[name]}"
        if name in ("sample_start", "token_start"):
            counts = self.column(name.split("_")[0] + "s")
            if v.size and (int(v[0]) != 0 or not np.array_equal(v[1:], np.cumsum(counts[:-1]))):
                return f"{name} is not the running sum of {name.split('_')[0]}s"
        if name == "first_block":
            counts = self.column("blocks")
            if v.size and (int(v[0]) != 0 or not np.array_equal(v[1:], np.cumsum(counts[:-1]))):
                return "first_block is not the running sum of blocks"
            if (int(v[-1] + counts[-1]) if v.size else 0) != self.blocks.rows:
                return f"the shards' blocks do not add up to the block table's {self.blocks.rows} rows"
        if name == "checksum_order" and n:
            # a permutation of the shards along which the checksums strictly increase: no shard is
            # listed twice (O(shards) compares, no sort)
            if int(v.min()) < 0 or int(v.max()) >= n:
                return "checksum_order is not a permutation of the shards"
            seen = np.zeros(n, dtype=bool)
            seen[v] = True
            if not seen.all():
                return "checksum_order is not a permutation of the shards"
            keys = self.column("checksum").view(_KEY)[v]
            hi, lo = keys["hi"], keys["lo"]
            rising = (hi[1:] > hi[:-1]) | ((hi[1:] == hi[:-1]) & (lo[1:] > lo[:-1]))
            if not rising.all():
                i = int(np.argmin(rising))
                if keys[i] == keys[i + 1]:
                    return f"a shard is listed twice (shards #{int(v[i])} and #{int(v[i + 1])})"
                return "checksum_order does not sort the checksums"
        return None

    def checksums(self) -> np.ndarray:
        """The checksum column, checked to hold no shard twice (with `checksum_order`)."""
        self.column("checksum_order")
        return self.column("checksum")

    def name(self, i: int) -> str:
        return shard_name(self.checksums()[i].tobytes().hex())

    def block_list(self, i: int, keep: bool = True) -> BlockList:
        """Shard i's blocks, their rows checked against its block_digest and bounds (once, when
        `keep`: a pass over every shard keeps none, so its memory stays one shard's)."""
        found = self._block_lists.get(i)
        if found is not None:
            return found
        first, count = int(self.column("first_block")[i]), int(self.column("blocks")[i])
        stop = first + count
        cols = {name: self.blocks.raw(name)[first:stop] for name in BLOCK_SCHEMA.names}
        name = self.name(i)
        if block_digest(cols["length"], cols["rows"], cols["checksum"], cols["tokens"]) != \
                int(self.column("block_digest")[i]):
            raise ManifestError(f"{self.where}: shard {name}: its rows of {self.blocks.path.name} do not match "
                                f"its block_digest (damaged or edited)")
        lengths = cols["length"].astype(np.int64)
        offsets = np.zeros(count, dtype=np.int64)
        np.cumsum(lengths[:-1], out=offsets[1:])
        rows = cols["rows"].astype(np.int64)
        tokens = cols["tokens"].astype(np.int64) if int(self.column("tokens_known")[i]) else None
        blocks = BlockList(offsets, lengths, rows, cols["checksum"], tokens)
        problem = blocks.check(name, int(self.column("bytes")[i]), int(self.column("samples")[i]),
                               int(self.column("tokens")[i]))
        if problem is None and count and int(rows.max()) != int(self.column("largest_rows")[i]):
            problem = f"shard {name}: largest_rows is not its largest block's rows"
        if problem is not None:
            raise ManifestError(f"{self.where}: {problem}")
        if keep:
            with self._lock:
                self._block_lists[i] = blocks
        return blocks

    def shard(self, i: int, keep: bool = True) -> ShardInfo:
        col = self.column
        return ShardInfo(name=self.name(i), samples=int(col("samples")[i]), bytes=int(col("bytes")[i]),
                         decoded_bytes=int(col("decoded_bytes")[i]), checksum=self.checksums()[i].tobytes().hex(),
                         decoded_checksum=col("decoded_checksum")[i].tobytes().hex(),
                         compression=COMPRESSIONS[int(col("compression")[i])], tokens=int(col("tokens")[i]),
                         blocks=self.block_list(i, keep))


class MappedShards(SequenceABC):
    """The shards of a mapped dataset as a sequence of ShardInfo, each made when asked for (and
    kept); len() is the header's. Iterating makes one per shard: O(shards), for tools, not starts."""

    def __init__(self, tables: MetadataTables) -> None:
        self.tables = tables
        self._made: dict[int, ShardInfo] = {}

    def __len__(self) -> int:
        return self.tables.num_shards

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        index = int(index)
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"shard {index} out of range [0, {len(self)})")
        found = self._made.get(index)
        if found is None:
            found = self._made[index] = self.tables.shard(index)
        return found

    def __iter__(self) -> Iterator[ShardInfo]:
        for i in range(len(self)):
            yield self._made.get(i) or self.tables.shard(i, keep=False)  # a pass over every shard stays bounded

    def __repr__(self) -> str:
        return f"MappedShards({len(self)} shards, {len(self._made)} made)"


class MappedManifest(Manifest):
    """A version-3 dataset's manifest: the header's fields, and `shards` mapped (MappedShards).
    It pickles as its directory (a worker maps the same files, sharing their pages)."""

    tables: MetadataTables
    directory: Path
    where: str

    @property
    def dataset_id(self) -> str:  # type: ignore[override]
        return self.header["dataset_id"]

    @property
    def num_samples(self) -> int:  # type: ignore[override]
        return self.tables.totals["samples"]

    @property
    def num_tokens(self) -> int:  # type: ignore[override]
        return self.tables.totals["tokens"]

    @property
    def header(self) -> dict:
        return self.tables.header

    def shard_column(self, name: str) -> np.ndarray:
        return self.tables.column(name)

    def save(self, directory: str | Path) -> Path:  # type: ignore[override]
        raise TypeError(f"{self.where}: a mapped manifest is written by write_metadata, not saved as JSON")

    def __reduce__(self) -> tuple[Any, ...]:
        return (load_metadata, (self.directory, self.where))


def current_metadata(directory: str | Path) -> MappedManifest | None:
    """The version-3 metadata of a directory when it describes the dataset there: a header, and
    beside it no manifest.json or the very one the header recorded (size and xxh3-128: the file is
    read, not parsed; pack writes one only while it is small). None: read manifest.json (a version-2
    dataset, an unfinished pack, or a manifest replaced or edited after the header was written)."""
    directory = Path(directory)
    if not has_metadata(directory):
        return None
    manifest = load_metadata(directory)
    beside = manifest.header.get("manifest")
    path = directory / MANIFEST_NAME
    if beside is None:
        return manifest if not path.exists() else None
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        return None
    if size != beside["size"]:
        return None
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return manifest if h.hexdigest() == beside["xxh3"] else None


def load_metadata(directory: str | Path, where: str | None = None) -> MappedManifest:
    """Open a version-3 dataset's metadata: the header read and checked, both tables mapped.
    O(1) in the number of shards; columns are verified as they are first used."""
    directory = Path(directory)
    path = directory / METADATA_NAME
    where = where or str(directory)
    from tierflow.format._regular import read_regular
    try:
        raw = read_regular(path, MAX_HEADER_BYTES, ManifestError)
    except FileNotFoundError:
        raise ManifestError(f"{path}: no metadata header; {directory} holds no version-3 dataset") from None
    header = parse_header(raw, f"{where}/{METADATA_NAME}" if where else str(path))
    tables = MetadataTables(directory, header, where)
    try:
        schema = schema_from_json(header["schema"])
    except Exception as e:  # noqa: BLE001
        raise ManifestError(f"{where}/{METADATA_NAME}: schema does not decode ({e})") from None
    if header.get("token_column") is not None and header["token_column"] not in schema.names:
        raise ManifestError(f"{where}/{METADATA_NAME}: token_column {header['token_column']!r} is not in the schema")
    manifest = MappedManifest(schema=schema, shards=MappedShards(tables), tokenizer=header.get("tokenizer"),  # type: ignore[arg-type]
                              token_column=header.get("token_column"), token_dtype=header.get("token_dtype"),
                              eos_id=header.get("eos_id"), stats=header.get("stats") or {},
                              format_version=METADATA_VERSION, checksummed=True)
    manifest.tables, manifest.directory, manifest.where = tables, directory, where
    return manifest


def shard_column(manifest: Manifest, name: str) -> np.ndarray:
    """A per-shard column (samples, bytes, decoded_bytes, tokens, largest_rows) as int64 numpy: the
    mapped column of a version-3 dataset (no per-shard objects), else one pass over the shards."""
    if isinstance(manifest, MappedManifest):
        return manifest.shard_column(name)
    if name == "largest_rows":
        return np.fromiter((int(block_rows(s.blocks).max()) if len(s.blocks) else 0 for s in manifest.shards),
                           dtype=np.int64, count=len(manifest.shards))
    return np.fromiter((getattr(s, name) for s in manifest.shards), dtype=np.int64, count=len(manifest.shards))


def verify_metadata(manifest: MappedManifest) -> list[str]:
    """Every problem with a version-3 dataset's tables, read whole, streaming: each column of both
    tables against its hash, every shard's checks and block rows, the dataset id against the shards.
    Bounded memory: the shard table's columns (~100 bytes a shard) and one shard's blocks at a time."""
    problems: list[str] = []
    tables = manifest.tables
    for name in SHARD_SCHEMA.names:
        try:
            tables.column(name)
        except ManifestError as e:
            problems.append(str(e))
    for name in BLOCK_SCHEMA.names:  # read, not mapped: memory stays a chunk's, whatever the table's size
        h = xxhash.xxh3_128()
        step = 1 << 20
        for start in range(0, tables.blocks.rows, step):
            h.update(memoryview(tables.blocks.read(name, start, min(start + step, tables.blocks.rows))).cast("B"))
        if h.hexdigest() != tables.blocks.hashes[name]:
            problems.append(f"{tables.blocks.where}: column {name} does not match its hash in the header")
    if problems:
        return problems
    checksums = tables.column("checksum")
    for i in _suspect_shards(tables):  # each one's own check names what is wrong
        try:
            tables.block_list(i, keep=False)
        except ManifestError as e:
            problems.append(str(e))
    recomputed = streamed_dataset_id({"fields": schema_fields(manifest.schema)}, manifest.tokenizer, checksums)
    if recomputed != manifest.dataset_id:
        problems.append(f"{manifest.where}/{METADATA_NAME}: dataset_id {manifest.dataset_id} does not match its "
                        f"schema, tokenizer and shards ({recomputed})")
    return problems


def streamed_dataset_id(schema_json: dict, tokenizer: dict | None, checksums: np.ndarray, chunk: int = 1 << 16) -> str:
    """`compute_dataset_id` of a checksum column, its canonical JSON hashed as it is made, a chunk of
    names at a time (the same bytes: sorted keys, no spaces; hex names need no escaping), so a million
    shards cost ~35 MB of strings a chunk at a time, not the whole document at once."""
    h = xxhash.xxh3_128()
    h.update(b'{"schema":' + json.dumps(schema_json["fields"], sort_keys=True, separators=(",", ":")).encode()
             + b',"shards":[')
    for start in range(0, len(checksums), chunk):
        hexed = np.ascontiguousarray(checksums[start:start + chunk]).tobytes().hex()
        names = ",".join(f'"{hexed[i:i + 32]}"' for i in range(0, len(hexed), 32))
        h.update((("," if start else "") + names).encode())
    h.update(b'],"tokenizer":' + json.dumps(tokenizer, sort_keys=True, separators=(",", ":")).encode() + b"}")
    return h.hexdigest()


def _suspect_shards(tables: MetadataTables, chunk: int = 8192) -> Iterator[int]:
    """The shards whose block rows fail what `block_list` checks (their digest, rows and tokens adding
    up, every block inside the file, largest_rows), found a chunk of shards at a time: the checks
    vectorised over the chunk's blocks, the digests hashed from views (no copy), so memory stays a
    chunk's and a million shards take seconds, not the ~100 us a shard of building each list."""
    col = tables.column
    first, count, digest = col("first_block"), col("blocks"), col("block_digest")
    samples, tokens, size, largest, known = (col("samples"), col("tokens"), col("bytes"), col("largest_rows"),
                                             col("tokens_known"))
    for lo in range(0, tables.num_shards, chunk):
        hi = min(lo + chunk, tables.num_shards)
        b0, b1 = int(first[lo]), int(first[hi - 1] + count[hi - 1])
        n = count[lo:hi]
        blocks = {name: tables.blocks.read(name, b0, b1) for name in BLOCK_SCHEMA.names}  # this chunk's rows
        length, rows, toks = (blocks[k].astype(np.int64) for k in ("length", "rows", "tokens"))
        starts = (first[lo:hi] - b0)[n > 0]
        bad = np.zeros(hi - lo, dtype=bool)
        full = n > 0

        def per_shard(values: np.ndarray, reduce: Any) -> np.ndarray:
            out = np.zeros(hi - lo, dtype=np.int64)
            if starts.size:
                out[full] = reduce.reduceat(values, starts)
            return out
        bad |= per_shard(rows, np.add) != samples[lo:hi]
        bad |= (known[lo:hi] == 1) & (per_shard(toks, np.add) != tokens[lo:hi])
        bad |= per_shard(length, np.add) > size[lo:hi]
        bad |= per_shard(rows, np.maximum) != largest[lo:hi]
        bad |= per_shard((length <= 0).astype(np.int64), np.add) > 0
        for i in range(lo, hi):
            if bad[i - lo]:
                continue
            a, z = int(first[i]) - b0, int(first[i] + count[i]) - b0
            h = xxhash.xxh3_64()
            for name in ("length", "rows", "checksum", "tokens"):
                h.update(memoryview(blocks[name][a:z]).cast("B"))
            bad[i - lo] = h.intdigest() != int(digest[i])
        yield from (lo + np.flatnonzero(bad)).tolist()


def upgrade(directory: str | Path) -> Path:
    """Write the version-3 metadata of the dataset in `directory` from its manifest.json, in place:
    tables under new names, the header last, atomically; manifest.json is kept (older readers). A crash
    leaves the old dataset as it was (at worst, unreferenced table files that gc removes)."""
    directory = Path(directory)
    from tierflow.format._regular import read_regular
    from tierflow.format.manifest import max_manifest_bytes
    path = directory / MANIFEST_NAME
    try:
        raw = read_regular(path, max_manifest_bytes(), ManifestError)
    except FileNotFoundError:
        raise ManifestError(f"{path}: no manifest; {directory} holds no finished tierflow dataset") from None
    manifest = Manifest.from_bytes(raw, str(path))  # checked as any reader checks it
    return write_metadata(directory, manifest, manifest_bytes=raw)


def write_with_manifest(directory: str | Path, manifest: Manifest, legacy_max_shards: int | None = None) -> Path:
    """What pack publishes: the version-3 tables and header, then manifest.json last (version-2
    readers and tools) while the dataset has at most `legacy_max_shards` shards
    (LEGACY_MANIFEST_SHARDS); above that the header alone (a manifest of 10,000 shards is ~30 MB that
    a version-2 reader parses in ~1 s per process)."""
    directory = Path(directory)
    limit = LEGACY_MANIFEST_SHARDS if legacy_max_shards is None else legacy_max_shards
    if len(manifest.shards) > limit:
        # the header first: while an older pack's manifest.json is beside it, readers read that one (a
        # header recording none is current only alone), so a crash before the unlink leaves the old dataset
        path = write_metadata(directory, manifest)
        (directory / MANIFEST_NAME).unlink(missing_ok=True)
        return path
    raw = json.dumps(manifest.to_json(), indent=1).encode()  # the bytes `save` writes
    write_metadata(directory, manifest, manifest_bytes=raw)
    return manifest.save(directory)


def is_published(directory: str | Path) -> bool:
    """Whether a directory holds a finished dataset: a manifest.json, or a header that publishes
    none beside it (pack writes the header before manifest.json: a header that records one whose
    manifest is missing is an unfinished pack)."""
    directory = Path(directory)
    if (directory / MANIFEST_NAME).exists():
        return True
    if not has_metadata(directory):
        return False
    try:
        return json.loads((directory / METADATA_NAME).read_bytes()).get("manifest") is None
    except (ValueError, AttributeError):
        return True  # a damaged header is not for pack to overwrite silently


def referenced_tables(directory: str | Path) -> set[str]:
    """The table files the directory's header names (gc keeps them, whether or not it is current)."""
    try:
        raw = (Path(directory) / METADATA_NAME).read_bytes()  # an I/O error propagates: never gc on a guess
    except FileNotFoundError:
        return set()
    try:
        d = json.loads(raw)
        return {d[t]["file"] for t in ("shards", "blocks") if isinstance(d[t]["file"], str)}
    except (ValueError, KeyError, TypeError, AttributeError):
        return set()


def table_files(directory: str | Path) -> Iterable[str]:
    """The metadata table files of the directory (for gc: those its header does not name may go)."""
    return (p.name for p in Path(directory).iterdir()
            if p.name.startswith(TABLE_PREFIX) and p.name.endswith(TABLE_SUFFIX))


class MappedIndex:
    """`DatasetIndex` over mapped metadata: where a sample or a token lives, from the shard table's
    running sums (sample_start, token_start) and, inside a shard, its own blocks' counts, made the
    first time that shard is looked up. Opening costs nothing per shard; a lookup costs one
    searchsorted over the shards and one over the blocks of each shard it lands in."""

    def __init__(self, manifest: MappedManifest, read_block_tokens: Callable[[int], Sequence[int]] | None = None) -> None:
        self.manifest = manifest
        self.tables = manifest.tables
        self._read_block_tokens = read_block_tokens
        self._rows: dict[int, np.ndarray] = {}
        self._tokens: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()
        self._sample_starts: np.ndarray | None = None
        self._token_starts: np.ndarray | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        return (MappedIndex, (self.manifest, self._read_block_tokens))

    @property
    def first_block(self) -> np.ndarray:
        """Shard s's first row of the block table (a global block number), length shards."""
        return self.tables.column("first_block")

    @property
    def sample_starts(self) -> np.ndarray:
        """[sample_start..., num_samples], length shards + 1 (made on first use: 8 bytes a shard)."""
        if self._sample_starts is None:
            self._sample_starts = np.append(self.tables.column("sample_start"), self.num_samples)
        return self._sample_starts

    @property
    def token_starts(self) -> np.ndarray:
        if self._token_starts is None:
            self._token_starts = np.append(self.tables.column("token_start"), self.num_tokens)
        return self._token_starts

    @property
    def num_samples(self) -> int:
        return int(self.tables.totals["samples"])

    @property
    def num_tokens(self) -> int:
        return int(self.tables.totals["tokens"])

    def _block_rows(self, s: int) -> np.ndarray:
        found = self._rows.get(s)
        if found is None:
            rows = self.tables.block_list(s).rows
            found = np.zeros(rows.size + 1, dtype=np.int64)
            np.cumsum(rows, out=found[1:])
            self._rows[s] = found
        return found

    def _block_tokens(self, s: int) -> np.ndarray:
        found = self._tokens.get(s)
        if found is not None:
            return found
        blocks = self.tables.block_list(s)
        expected = int(self.tables.column("tokens")[s])
        counts = blocks.tokens
        if counts is None:
            if self._read_block_tokens is None:
                raise ValueError(f"shard {self.tables.name(s)}: its blocks' token counts are not in the metadata "
                                 f"and this index has no way to read them")
            counts = np.asarray(self._read_block_tokens(s), dtype=np.int64)
            if counts.size != len(blocks) or int(counts.sum()) != expected:
                raise ShardCorruptError(f"shard {self.tables.name(s)}: its blocks hold {int(counts.sum())} tokens in "
                                        f"{counts.size} blocks, the metadata says {expected} in {len(blocks)}")
        found = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=found[1:])
        with self._lock:
            self._tokens[s] = found
        return found

    def locate_samples(self, ids: np.ndarray):
        from tierflow.format.index import SamplePlaces
        ids = np.asarray(ids, dtype=np.int64)
        starts = self.tables.column("sample_start")
        shard = starts.searchsorted(ids, side="right") - 1
        block = np.empty_like(ids)
        row = np.empty_like(ids)
        for s in np.unique(shard).tolist():
            here = shard == s
            local = ids[here] - int(starts[s])
            cum = self._block_rows(s)
            b = cum.searchsorted(local, side="right") - 1
            block[here], row[here] = b, local - cum[b]
        return SamplePlaces(shard, block, row)

    def locate_sample(self, i: int) -> tuple[int, int, int]:
        places = self.locate_samples(np.array([i]))
        return int(places.shard[0]), int(places.block[0]), int(places.row[0])

    def token_blocks(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        starts = self.tables.column("token_start")
        n = len(starts)
        shard = np.clip(starts.searchsorted(positions, side="right") - 1, 0, max(n - 1, 0))
        out = np.empty((positions.size, 4), dtype=np.int64)
        for s in np.unique(shard).tolist():
            here = shard == s
            first = int(starts[s])
            cum = self._block_tokens(s)
            b = np.minimum(cum[1:].searchsorted(positions[here] - first, side="right"), len(cum) - 2)
            out[here, 0], out[here, 1] = s, b
            out[here, 2], out[here, 3] = first + cum[b], first + cum[b + 1]
        return out

    def locate_tokens(self, positions: np.ndarray):
        from tierflow.format.index import TokenPlaces
        positions = np.asarray(positions, dtype=np.int64)
        rows = self.token_blocks(positions)
        return TokenPlaces(rows[:, 0], rows[:, 1], positions - rows[:, 2], rows[:, 3] - positions)

    def locate_token(self, t: int) -> tuple[int, int, int, int]:
        shard, block, first, end = self.token_blocks(np.array([t]))[0].tolist()
        return shard, block, t - first, end - t


class ShardNames:
    """The shard file names a manifest references, as a container (`name in names`): for a mapped
    manifest a sorted copy of the checksum column (16 bytes a shard, no string per shard: gc of a
    million shards in ~16 MB), else a set of the names."""

    _KEY = np.dtype([("hi", ">u8"), ("lo", ">u8")])

    def __init__(self, manifest: Manifest) -> None:
        if isinstance(manifest, MappedManifest):
            tables = manifest.tables
            self._sorted: np.ndarray | None = tables.checksums().view(self._KEY)[tables.column("checksum_order")]
            self._names: set[str] = set()
        else:
            self._sorted = None
            self._names = {s.name for s in manifest.shards}

    def __contains__(self, name: object) -> bool:
        if self._sorted is None:
            return name in self._names
        if not isinstance(name, str) or not (name.startswith("shard-") and name.endswith(TABLE_SUFFIX)):
            return False
        try:
            key = np.frombuffer(bytes.fromhex(name[len("shard-"):-len(TABLE_SUFFIX)]), dtype=self._KEY)
        except ValueError:
            return False
        if key.size != 1:
            return False
        i = int(self._sorted.searchsorted(key[0]))
        return i < len(self._sorted) and self._sorted[i] == key[0]


def upgrade_source(source: Any, workdir: str | Path) -> str:
    """`upgrade` for a dataset at a URL: its manifest.json read and checked, the tables and header
    written in `workdir`, uploaded tables first and the header last (the commit point); the manifest
    stays for version-2 readers. Returns the header's URL."""
    from tierflow.storage.datasets import read_manifest_json
    workdir = Path(workdir)
    raw, manifest = read_manifest_json(source)
    write_metadata(workdir, manifest, manifest_bytes=raw)
    for name in sorted(referenced_tables(workdir)):
        source.upload(workdir / name, name)
    source.upload(workdir / METADATA_NAME, METADATA_NAME)
    return f"{source.url}/{METADATA_NAME}"


class ShardKeys:
    """Entry key (a shard's at-rest checksum) -> the shards that have it, as `.get(key, default)`:
    for a mapped manifest a sorted view of the checksum column (24 bytes a shard, no string per
    shard), else a dict. Equal content may repeat under one key in a repacked dataset."""

    _KEY = np.dtype([("hi", ">u8"), ("lo", ">u8")])

    def __init__(self, manifest: Manifest) -> None:
        self._dict: dict[str, list[int]] | None = None
        if isinstance(manifest, MappedManifest):
            tables = manifest.tables
            self._order = tables.column("checksum_order")  # checked: a permutation sorting the keys
            self._sorted = tables.checksums().view(self._KEY)[self._order]
        else:
            self._dict = {}
            for shard, info in enumerate(manifest.shards):
                self._dict.setdefault(info.key, []).append(shard)

    def get(self, key: str, default: Any = ()) -> Any:
        if self._dict is not None:
            return self._dict.get(key, default)
        try:
            probe = np.frombuffer(bytes.fromhex(key), dtype=self._KEY)
        except ValueError:
            return default
        if probe.size != 1:
            return default
        lo = int(self._sorted.searchsorted(probe[0], side="left"))
        hi = int(self._sorted.searchsorted(probe[0], side="right"))
        return self._order[lo:hi].tolist() if hi > lo else default
