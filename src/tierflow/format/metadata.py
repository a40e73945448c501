"""Metadata that is opened, not parsed (format version 3): a small JSON header and Arrow IPC files.

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
  tokens (uint32; the blocks are contiguous from offset 0, so offsets are the lengths' running sum);
- optionally the default order's partition layout (metadata_layout.py).

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
A damaged row in a shard-table column is refused when the column is first used, a damaged block row
when its shard is first used, never served; a process pays for the columns and shards it uses, not
for the dataset (~1.4 GB at a million shards). The dataset id against the checksums is `verify`'s
(the header's checksum covers the recorded id). Anything wrong is a ManifestError naming the
dataset, the file and what is wrong.

This module is the layout and the reading side; writing and publishing is `metadata_writer`, the
whole-dataset check `metadata_verify`, the lookups over the mapped tables `metadata_index`.
"""

from __future__ import annotations

import json
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, overload

import numpy as np
import pyarrow as pa
import xxhash

from tierflow.errors import ManifestError
from tierflow.format._regular import fd_path, read_regular
from tierflow.format.metadata_layout import (
    LAYOUT_SCHEMA,
    TABLE_PREFIX as TABLE_PREFIX,
    TABLE_SUFFIX as TABLE_SUFFIX,
    StoredLayout,
    check_layout_entry,
    check_table_entry as _check_table_entry,
    is_count as _is_count,
)
from tierflow.format.manifest import Manifest, _check_fields, schema_from_json
from tierflow.format.table_locks import TableGone, open_table
from tierflow.format.shard import COMPRESSIONS, MAX_COUNT, BlockList, ShardInfo, block_rows, shard_name

METADATA_NAME = "metadata.json"
METADATA_VERSION = 3
HEADER_CHECKSUM_KEY = "header_checksum"
MAX_HEADER_BYTES = 16 << 20
"""A header is a few KB (schema, tokenizer, stats); larger is refused unread."""
LEGACY_MANIFEST_SHARDS = 10_000
"""Up to this many shards pack writes manifest.json beside the version-3 metadata."""

SHARD_SCHEMA = pa.schema(
    [
        ("checksum", pa.binary(16)),
        ("decoded_checksum", pa.binary(16)),
        ("compression", pa.uint8()),
        ("samples", pa.int64()),
        ("bytes", pa.int64()),
        ("decoded_bytes", pa.int64()),
        ("tokens", pa.int64()),
        ("sample_start", pa.int64()),
        ("token_start", pa.int64()),
        ("first_block", pa.int64()),
        ("blocks", pa.int64()),
        ("largest_rows", pa.int64()),
        ("tokens_known", pa.uint8()),
        ("block_digest", pa.uint64()),
        ("checksum_order", pa.int64()),
    ]
)
BLOCK_SCHEMA = pa.schema(
    [("length", pa.uint32()), ("rows", pa.uint32()), ("checksum", pa.uint64()), ("tokens", pa.uint32())]
)
_COUNT_COLUMNS = ("samples", "bytes", "decoded_bytes", "tokens", "blocks", "largest_rows")


def column_dtype(kind: pa.DataType) -> Any:
    return np.dtype("V16") if pa.types.is_fixed_size_binary(kind) else np.dtype(kind.to_pandas_dtype())


def has_metadata(directory: str | Path) -> bool:
    """Whether a directory holds a version-3 header (the reader prefers it to manifest.json)."""
    return (Path(directory) / METADATA_NAME).is_file()


def header_checksum(d: dict) -> str:
    body = {k: v for k, v in d.items() if k != HEADER_CHECKSUM_KEY}
    return xxhash.xxh3_128_hexdigest(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def block_digest(length: np.ndarray, rows: np.ndarray, checksum: np.ndarray, tokens: np.ndarray) -> int:
    """xxh3-64 of one shard's block rows, column after column (little-endian)."""
    h = xxhash.xxh3_64()
    for column, kind in ((length, "<u4"), (rows, "<u4"), (checksum, "<u8"), (tokens, "<u4")):
        h.update(np.ascontiguousarray(column, dtype=kind).tobytes())
    return h.intdigest()


CHECKSUM_HALVES = np.dtype([("hi", ">u8"), ("lo", ">u8")])
"""A 16-byte checksum as two big-endian halves: numpy orders these as the bytes (the hex) order."""


def column_digest(values: np.ndarray | memoryview | pa.Buffer) -> str:
    if isinstance(values, pa.Buffer):
        return xxhash.xxh3_128_hexdigest(values)
    view = values.data if isinstance(values, np.ndarray) else values
    return xxhash.xxh3_128_hexdigest(view.cast("B"))


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
        raise fail('not a tierflow metadata header (missing "format": "tierflow")')
    if d.get("format_version") != METADATA_VERSION or type(d.get("format_version")) is not int:
        raise fail(
            f"unknown format_version {d.get('format_version')!r:.40}; this header reader reads "
            f"version {METADATA_VERSION}"
        )
    try:
        recorded = d.get(HEADER_CHECKSUM_KEY)
        if not isinstance(recorded, str) or recorded != header_checksum(d):
            raise fail(
                f"{HEADER_CHECKSUM_KEY} {recorded!r:.40} does not match the header's contents "
                f"(damaged or edited; run `tierflow upgrade` again, or restore it)"
            )
    except (ValueError, TypeError, OverflowError, RecursionError) as e:
        raise fail(f"the header does not serialise ({type(e).__name__}: {e})") from None
    _check_fields(d, fail)
    if not isinstance(d.get("dataset_id"), str):
        raise fail("dataset_id is missing")
    for table, schema in (("shards", SHARD_SCHEMA), ("blocks", BLOCK_SCHEMA)):
        _check_table_entry(d.get(table), table, schema, fail)
    beside = d.get("manifest")
    if beside is not None and not (
        isinstance(beside, dict) and _is_count(beside.get("size")) and isinstance(beside.get("xxh3"), str)
    ):
        raise fail('"manifest" is not null or the size and hash of the manifest.json beside it')
    totals = d.get("totals")
    if not isinstance(totals, dict) or not all(
        _is_count(totals.get(k)) for k in ("samples", "tokens", "bytes", "decoded_bytes", "blocks")
    ):
        raise fail("totals are not counts of samples, tokens, bytes, decoded_bytes and blocks")
    if totals["blocks"] != d["blocks"]["rows"]:
        raise fail(f"totals.blocks = {totals['blocks']}, but the block table has {d['blocks']['rows']} rows")
    for key, total in (("samples", totals["samples"]), ("tokens", totals["tokens"])):
        stats = d.get("stats") or {}
        if type(stats.get(key)) is int and stats[key] != total:
            raise fail(f"stats.{key} = {stats[key]}, but the shards' {key} sum to {total}")
    if d.get("layout") is not None:  # the order's stored layout (metadata_layout.py); absent before it
        _check_table_entry(d["layout"], "layout", LAYOUT_SCHEMA, fail)
        check_layout_entry(d["layout"], d["shards"]["rows"], totals["samples"], fail)
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
        fd = open_table(self.path, self.where)
        size = os.fstat(fd).st_size
        try:
            if size != entry["size"]:
                raise ManifestError(
                    f"{self.where}: {size} bytes, the header says {entry['size']} (damaged or replaced)"
                )
            self._map = pa.memory_map(fd_path(fd, self.path), "r")
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
            os.close(fd)
            raise
        except Exception as e:
            os.close(fd)
            raise ManifestError(f"{self.where}: not a readable metadata table ({type(e).__name__}: {e})") from None
        self._file = fd  # its shared lock keeps gc from removing the table while this process reads it
        self._batch = batch
        self._checked: dict[str, np.ndarray] = {}
        self._lock = threading.RLock()  # a column's check may use another column of the table

    def raw(self, name: str) -> np.ndarray:
        """The column as a read-only numpy view of the mapping, not yet hashed."""
        arr = self._batch.column(name)
        if arr.null_count:
            raise ManifestError(f"{self.where}: column {name} has nulls")
        kind = column_dtype(arr.type)
        buf = arr.buffers()[1]
        if buf is None or not self.rows:
            return np.zeros(0, dtype=kind)
        view = np.frombuffer(buf, dtype=kind, count=len(arr) + arr.offset)[arr.offset :]
        return view

    def read(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of a column read from the file (pread), not through the mapping: a pass
        over a whole table (verify) keeps its memory to a chunk instead of mapping every page."""
        arr = self._batch.column(name)
        kind = column_dtype(arr.type)
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
                raise ManifestError(
                    f"{self.where}: column {name} does not match its hash in the header "
                    f"(damaged or edited; run `tierflow upgrade` again, or restore it)"
                )
            problem = check(values) if check is not None else None
            if problem is not None:
                raise ManifestError(f"{self.where}: {problem}")
            self._checked[name] = values
            return values


def _running_sum(starts: np.ndarray, counts: np.ndarray, chunk: int = 1 << 16) -> bool:
    """starts == [0, cumsum(counts[:-1])...], as differences a chunk at a time (no column-sized
    array; int64 wraps alike both ways, so the same answer)."""
    if starts.size and int(starts[0]) != 0:
        return False
    for lo in range(0, starts.size - 1, chunk):
        hi = min(lo + chunk, starts.size - 1)
        if not np.array_equal(starts[lo + 1 : hi + 1] - starts[lo:hi], counts[lo:hi]):
            return False
    return True


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
        entry = header.get("layout")
        self.layout = None if entry is None else _Table(directory, entry, LAYOUT_SCHEMA, where)
        self._stored: StoredLayout | None = None
        self.manifest: Callable[[], Any] = lambda: None
        """The MappedManifest these tables belong to, weakly: a strong reference would make a cycle that
        keeps the tables mapped, and their shared locks held against gc, until Python's cycle collector
        runs (a process that dropped a dataset and packs over it found its old tables in use)."""
        self.num_shards = self.shards.rows
        self._lock = threading.Lock()
        self._block_lists: dict[int, BlockList] = {}

    def column(self, name: str) -> np.ndarray:
        """A shard-table column (int64 counts, 16-byte checksums), hashed and range-checked once."""
        return self.shards.column(name, lambda v: self._check(name, v))

    def _check(self, name: str, v: np.ndarray) -> str | None:
        n = self.num_shards
        # one pass: a negative int64 read as uint64 is at least 2**63, past MAX_COUNT
        largest = int(v.view(np.uint64).max()) if name in _COUNT_COLUMNS and v.size else 0
        if largest >= MAX_COUNT:
            i = int(np.flatnonzero((v < 0) | (v >= MAX_COUNT))[0])
            return f"shard #{i}: {name} = {int(v[i])} is negative or absurd"
        if name == "compression" and v.size and int(v.max()) >= len(COMPRESSIONS):
            i = int(np.argmax(v >= len(COMPRESSIONS)))
            return f"shard #{i}: unknown compression code {int(v[i])}"
        if name == "tokens_known" and v.size and int(v.max()) > 1:
            return "tokens_known is not 0 or 1"
        if name in ("samples", "tokens"):
            # an int64 sum would wrap round to anything: refused past 2**62 (summed as floats only when
            # the counts, each below MAX_COUNT, could reach 2**61)
            if largest * v.size >= 2**61 and float(v.sum(dtype=np.float64)) >= 2.0**62:
                return f"the shards' {name} sum past 2**62: absurd"
            total = int(v.sum(dtype=np.int64)) if v.size else 0
            if total != self.totals[name]:
                return f"the shards' {name} sum to {total}, the header says {self.totals[name]}"
        if name in ("sample_start", "token_start"):
            counts = self.column(name.split("_")[0] + "s")
            if not _running_sum(v, counts):
                return f"{name} is not the running sum of {name.split('_')[0]}s"
        if name == "first_block":
            counts = self.column("blocks")
            if not _running_sum(v, counts):
                return "first_block is not the running sum of blocks"
            if (int(v[-1] + counts[-1]) if v.size else 0) != self.blocks.rows:
                return f"the shards' blocks do not add up to the block table's {self.blocks.rows} rows"
        if name == "checksum_order" and n:
            # a permutation of the shards along which the checksums strictly increase: no shard is
            # listed twice (O(shards) compares, no sort). n indices in range along which the checksums
            # strictly rise are n distinct shards, a permutation: it is checked apart only when they
            # do not rise, so the error is the same as when it was checked first
            if int(v.min()) < 0 or int(v.max()) >= n:
                return "checksum_order is not a permutation of the shards"
            checksums = self.column("checksum")
            halves = checksums.view(CHECKSUM_HALVES)
            # the leading 4 bytes, native once, then gathered: a quarter of the bytes moved at random
            top = checksums.view(">u4")[::4].astype(np.uint32)[v]
            rising = top[1:] > top[:-1]
            tie = np.flatnonzero(top[1:] == top[:-1])  # equal leading bytes (~n²/2³² pairs): the halves decide
            if tie.size:
                a, b = halves[v[tie]], halves[v[tie + 1]]
                rising[tie] = (b["hi"] > a["hi"]) | ((b["hi"] == a["hi"]) & (b["lo"] > a["lo"]))
            if not rising.all():
                seen = np.zeros(n, dtype=bool)
                seen[v] = True
                if not seen.all():
                    return "checksum_order is not a permutation of the shards"
                i = int(np.argmin(rising))
                if halves[v[i]] == halves[v[i + 1]]:
                    return f"a shard is listed twice (shards #{int(v[i])} and #{int(v[i + 1])})"
                return "checksum_order does not sort the checksums"
        return None

    def stored_layout(self) -> StoredLayout | None:
        """The order's layout stored with the metadata (metadata_layout.py); None: compute it."""
        if self._stored is None and self.layout is not None:
            self._stored = StoredLayout(
                self.layout, self.header["layout"], self.column("samples"), self.where, self._sample_starts
            )
            self._stored.manifest = self.manifest()
        return self._stored

    def _sample_starts(self) -> np.ndarray:
        return self.column("sample_start")

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
        if block_digest(cols["length"], cols["rows"], cols["checksum"], cols["tokens"]) != int(
            self.column("block_digest")[i]
        ):
            raise ManifestError(
                f"{self.where}: shard {name}: its rows of {self.blocks.path.name} do not match "
                f"its block_digest (damaged or edited)"
            )
        lengths = cols["length"].astype(np.int64)
        offsets = np.zeros(count, dtype=np.int64)
        np.cumsum(lengths[:-1], out=offsets[1:])
        rows = cols["rows"].astype(np.int64)
        tokens = cols["tokens"].astype(np.int64) if int(self.column("tokens_known")[i]) else None
        blocks = BlockList(offsets, lengths, rows, cols["checksum"], tokens)
        problem = blocks.check(
            name, int(self.column("bytes")[i]), int(self.column("samples")[i]), int(self.column("tokens")[i])
        )
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
        return ShardInfo(
            name=self.name(i),
            samples=int(col("samples")[i]),
            bytes=int(col("bytes")[i]),
            decoded_bytes=int(col("decoded_bytes")[i]),
            checksum=self.checksums()[i].tobytes().hex(),
            decoded_checksum=col("decoded_checksum")[i].tobytes().hex(),
            compression=COMPRESSIONS[int(col("compression")[i])],
            tokens=int(col("tokens")[i]),
            blocks=self.block_list(i, keep),
        )


class MappedShards(Sequence[ShardInfo]):
    """The shards of a mapped dataset as a sequence of ShardInfo, each made when asked for (and
    kept); len() is the header's. Iterating makes one per shard: O(shards), for tools, not starts."""

    def __init__(self, tables: MetadataTables) -> None:
        self.tables = tables
        self._made: dict[int, ShardInfo] = {}

    def __len__(self) -> int:
        return self.tables.num_shards

    @overload
    def __getitem__(self, index: int) -> ShardInfo: ...

    @overload
    def __getitem__(self, index: slice) -> list[ShardInfo]: ...

    def __getitem__(self, index: int | slice) -> ShardInfo | list[ShardInfo]:
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
    def dataset_id(self) -> str:
        return self.header["dataset_id"]

    @property
    def num_samples(self) -> int:
        return self.tables.totals["samples"]

    @property
    def num_tokens(self) -> int:
        return self.tables.totals["tokens"]

    @property
    def header(self) -> dict:
        return self.tables.header

    def shard_column(self, name: str) -> np.ndarray:
        return self.tables.column(name)

    def save(self, directory: str | Path) -> Path:
        raise TypeError(f"{self.where}: a mapped manifest is written by write_metadata, not saved as JSON")

    def __reduce__(self) -> tuple[Any, ...]:
        return (load_metadata, (self.directory, self.where))


def load_metadata(directory: str | Path, where: str | None = None) -> MappedManifest:
    """Open a version-3 dataset's metadata: the header read and checked, both tables mapped.
    O(1) in the number of shards; columns are verified as they are first used."""
    directory = Path(directory)
    path = directory / METADATA_NAME
    where = where or str(directory)
    last = b""
    while True:
        try:
            raw = read_regular(path, MAX_HEADER_BYTES, ManifestError)
        except FileNotFoundError:
            raise ManifestError(f"{path}: no metadata header; {directory} holds no version-3 dataset") from None
        header = parse_header(raw, f"{where}/{METADATA_NAME}" if where else str(path))
        try:
            tables = MetadataTables(directory, header, where)
            break
        except TableGone:
            if raw == last:  # the same header names a missing table: the dataset lost it
                raise
            last = raw  # a newer header replaced this one and gc removed its tables: read that one
    try:
        schema = schema_from_json(header["schema"])
    except Exception as e:
        raise ManifestError(f"{where}/{METADATA_NAME}: schema does not decode ({e})") from None
    if header.get("token_column") is not None and header["token_column"] not in schema.names:
        raise ManifestError(f"{where}/{METADATA_NAME}: token_column {header['token_column']!r} is not in the schema")
    manifest = MappedManifest(
        schema=schema,
        shards=MappedShards(tables),
        tokenizer=header.get("tokenizer"),
        token_column=header.get("token_column"),
        token_dtype=header.get("token_dtype"),
        eos_id=header.get("eos_id"),
        stats=header.get("stats") or {},
        format_version=METADATA_VERSION,
        checksummed=True,
    )
    manifest.tables, manifest.directory, manifest.where = tables, directory, where
    tables.manifest = weakref.ref(manifest)  # a stored layout pickles as its manifest (its directory)
    return manifest


def shard_column(manifest: Manifest, name: str) -> np.ndarray:
    """A per-shard column (samples, bytes, decoded_bytes, tokens, largest_rows) as int64 numpy: the
    mapped column of a version-3 dataset (no per-shard objects), else one pass over the shards."""
    if isinstance(manifest, MappedManifest):
        return manifest.shard_column(name)
    if name == "largest_rows":
        return np.fromiter(
            (int(block_rows(s.blocks).max()) if len(s.blocks) else 0 for s in manifest.shards),
            dtype=np.int64,
            count=len(manifest.shards),
        )
    return np.fromiter((getattr(s, name) for s in manifest.shards), dtype=np.int64, count=len(manifest.shards))
