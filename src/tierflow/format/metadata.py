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
- above CHUNK_ROWS shards, the chunk table (`metadata-chunks-<xxh3-128>.arrow`, the header's
  `chunks`) holds, a row per chunk of CHUNK_ROWS shards, the xxh3-128 of that chunk of each column
  of the shard and layout tables and the running sums at its first row: the header stays a few KB
  at any shard count, and each of its columns (4 KB at a million shards) is hashed whole when first
  read. A header written before it held the same in its table entries (`chunks`, 65,536 rows a
  chunk), or nothing (one chunk of every row); both read, and `tierflow upgrade` writes the table;
- a chunk of a shard-table column is hashed and checked (ranges; its counts adding up to the step
  between two running sums of the chunk table, its running sums rising by its counts from the chunk
  table's) the first time a row of it is used, once (metadata_table.py): a process pays for the
  chunks of the shards it reads, and every chunk checked is the whole column checked;
- a shard's name is checked to be no other shard's by a binary search along `checksum_order` (the
  checksum must sort where the order lists that shard, and the next one differ: of two shards that
  share a checksum at most one passes); the whole order is checked by `verify` and by what reads
  every name (gc, the entry keys);
- a shard's block rows are checked the first time that shard is used: the chunks of BLOCK_CHUNK_ROWS
  rows of the block table they lie in against the block chunk table (`metadata-block_chunks-<xxh3-128>.arrow`,
  the header's `block_chunks`, a row a chunk, the xxh3-128 of each column's chunk), and bounds-checked
  as a manifest's are; so a rank touches only the block chunks of the shards it reads (the block
  table, ~1.3 GB at a million shards of 64 blocks, is never read whole at open), and `verify` hashes
  the table as it reads it, with no hash a shard. A header written before the block chunk table (or
  whose table an older tierflow's gc removed) has each shard's rows checked against its
  `block_digest`, as before; the writer still writes the digest, for readers older than the table;
- the header's `summary` (metadata_summary.py: the largest shards, the largest blocks' sum) sizes
  the working set and the decoded bound without a whole column;
- `verify_metadata` (`tierflow verify`) hashes every column of both tables, streaming, and checks
  the summary, the layout and the dataset id against the shards, in bounded memory.
A damaged row in a shard-table column is refused when its chunk is first used, a damaged block row
when its shard is first used, never served; a process pays for the rows it uses, not for the
dataset (~1.4 GB at a million shards). The dataset id against the checksums is `verify`'s (the
header's checksum covers the recorded id). Anything wrong is a ManifestError naming the dataset,
the file and what is wrong.

This module is the reading side; the header, its schemas and checks are `metadata_header`, a mapped
table checked by chunk `metadata_table`, writing and publishing `metadata_writer`, the whole-dataset
check `metadata_verify`, the lookups over the mapped tables `metadata_index`.
"""

from __future__ import annotations

import logging
import threading
import weakref
from functools import partial
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from tierflow.errors import ManifestError
from tierflow.format._regular import read_regular
from tierflow.format.metadata_layout import (
    layout_schema,
    TABLE_PREFIX as TABLE_PREFIX,
    TABLE_SUFFIX as TABLE_SUFFIX,
    StoredLayout,
)
from tierflow.format.manifest import Manifest, schema_from_json
from tierflow.format.metadata_shards import MappedShards
from tierflow.format.metadata_windows import window_layout
from tierflow.format.metadata_table import (
    ChunkCheck,
    ChunkPlan,
    MappedTable,
    ShardRows,
    column_digest as column_digest,
    column_dtype as column_dtype,
)
from tierflow.format.metadata_header import (
    BLOCK_CHUNK_SCHEMA as BLOCK_CHUNK_SCHEMA,
    BLOCK_SCHEMA as BLOCK_SCHEMA,
    HEADER_CHECKSUM_KEY as HEADER_CHECKSUM_KEY,
    LEGACY_MANIFEST_SHARDS as LEGACY_MANIFEST_SHARDS,
    MAX_HEADER_BYTES,
    METADATA_NAME,
    METADATA_VERSION,
    RUNNING,
    RUNNING_COLUMNS,
    SHARD_SCHEMA,
    chunk_schema,
    header_checksum as header_checksum,
    header_layout_schema,
    parse_header,
    table_entries as table_entries,
    table_keys as table_keys,
)
from tierflow.format.table_locks import HeldTable, TableGone
from tierflow.format.shard import COMPRESSIONS, MAX_COUNT, BlockList, ShardInfo, block_rows, shard_name

log = logging.getLogger("tierflow.format")
_COUNT_COLUMNS = ("samples", "bytes", "decoded_bytes", "tokens", "blocks", "largest_rows")
_COUNTED = {running: count for count, running in RUNNING.items()}
CHUNK_ROWS = 1 << 12
"""Rows a table's chunk holds: the unit a reader hashes and checks (32 KB of an int64 column). At
65,536 a rank's first batch at a million shards hashed ~11 MB of chunks it mostly did not use."""
BLOCK_CHUNK_ROWS = 1 << 16
"""Block rows a chunk of the block table holds (1.3 MB of its four columns): what a shard's first use
hashes, the same at a thousand shards as at a million."""


_CHUNK_TABLES = {
    "chunks": ("chunk table", "every column is checked whole"),
    "block_chunks": ("block chunk table", "each shard's block rows are checked by its block_digest"),
}
"""Each chunk table's header key: what it is called, and what checks in its place while it is missing."""


def has_metadata(directory: str | Path) -> bool:
    """Whether a directory holds a version-3 header (the reader prefers it to manifest.json)."""
    return (Path(directory) / METADATA_NAME).is_file()


def block_digest(length: np.ndarray, rows: np.ndarray, checksum: np.ndarray, tokens: np.ndarray) -> int:
    """xxh3-64 of one shard's block rows, column after column (little-endian)."""
    h = xxhash.xxh3_64()
    for column, kind in ((length, "<u4"), (rows, "<u4"), (checksum, "<u8"), (tokens, "<u4")):
        h.update(np.ascontiguousarray(column, dtype=kind).tobytes())
    return h.intdigest()


CHECKSUM_HALVES = np.dtype([("hi", ">u8"), ("lo", ">u8")])
"""A 16-byte checksum as two big-endian halves: numpy orders these as the bytes (the hex) order."""


def inline_starts(entry: dict) -> dict[str, list[int]]:
    """The shard table's running sums at each chunk's first row as a header written before the chunk
    table holds them, per running column."""
    chunks = entry.get("chunks")
    if chunks is None:
        return {name: [0] if entry["rows"] else [] for name in RUNNING_COLUMNS}
    return chunks["starts"]


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


class MetadataTables:
    """A dataset's mapped shard and block tables, each column verified once, on first use."""

    def __init__(self, directory: Path, header: dict, where: str) -> None:
        self.directory = directory
        self.where = where
        self.header = header
        self.totals = header["totals"]
        self.chunks = self._chunk_table(directory, header, where, "chunks")
        self.block_chunks = self._chunk_table(directory, header, where, "block_chunks")
        self.shards = MappedTable(directory, header["shards"], SHARD_SCHEMA, where, self._plan("shards"))
        self.blocks = MappedTable(directory, header["blocks"], BLOCK_SCHEMA, where, self._plan("blocks"))
        entry = header.get("layout")
        self.layout = (
            None if entry is None else MappedTable(directory, entry, layout_schema(entry), where, self._plan("layout"))
        )
        self._held = [
            HeldTable(directory / window["file"], f"{where}: {window['file']}")
            for window in (header.get("windows") or {}).values()
        ]
        """The stored window layouts' tables, locked now though mapped only when a loader of their
        length asks: this reader holds every table its header names against gc, as it holds the others."""
        self.manifest: Callable[[], Any] = lambda: None
        """The MappedManifest these tables belong to, weakly: a strong reference would make a cycle that
        keeps the tables mapped, and their shared locks held against gc, until Python's cycle collector
        runs (a process that dropped a dataset and packs over it found its old tables in use)."""
        self.num_shards = self.shards.rows
        self._starts = None if self.chunks is not None else inline_starts(header["shards"])
        self._sorted = False
        self._lock = threading.Lock()
        self._block_lists: dict[int, BlockList] = {}

    def column(self, name: str) -> np.ndarray:
        """A shard-table column (int64 counts, 16-byte checksums), every chunk hashed and checked once."""
        return self.shards.column(name, self._check_chunk(name))

    def value(self, name: str, shard: int) -> Any:
        """Shard `shard`'s value of a column, its chunk hashed and checked once."""
        return self.shards.value(name, shard, self._check_chunk(name))

    def at(self, name: str, shards: np.ndarray) -> np.ndarray:
        """The column's values at `shards`, their chunks hashed and checked once."""
        return self.shards.at(name, shards, self._check_chunk(name))

    def shards_at(self, running: str, positions: np.ndarray) -> np.ndarray:
        """The shard each of `positions` (sample ids or token numbers, in range) lies in, by the running
        sums `running`: a binary search over the mapped column, whose answer is decided by the row it
        lands on and the next; those are checked, so a lookup hashes the chunks it lands in, not the
        column, and a damaged row that decided a landing is refused (MappedTable.search)."""
        return self.shards.search(running, positions, self._check_chunk(running))

    def rows(self, name: str) -> ShardRows:
        """The column indexed by shard, each chunk checked when a shard of it is first read."""
        return ShardRows(self.shards, name, self._check_chunk(name), self.manifest())

    def _check_chunk(self, name: str) -> ChunkCheck:
        return partial(self._check, name)

    @staticmethod
    def _chunk_table(directory: Path, header: dict, where: str, key: str) -> MappedTable | None:
        """The chunk table the header names under `key`. One that is missing (a tierflow older than it
        does not know it and its gc removes it) leaves the checks it serves made as before it:
        the same integrity, a slower start or check, until `tierflow upgrade` writes it again."""
        entry = header.get(key)
        if entry is None:
            return None
        schema = BLOCK_CHUNK_SCHEMA if key == "block_chunks" else chunk_schema(header_layout_schema(header))
        try:
            return MappedTable(directory, entry, schema, where)
        except TableGone:
            if (directory / entry["file"]).exists() or not (directory / header["shards"]["file"]).exists():
                raise  # not missing alone: the header was superseded (read it again) or the dataset damaged
            what, instead = _CHUNK_TABLES[key]
            log.warning(
                "%s: its %s %s is missing (an older tierflow's gc removes it); %s; `tierflow upgrade` writes it again",
                where,
                what,
                entry["file"],
                instead,
            )
            return None

    def _plan(self, table: str) -> ChunkPlan | None:
        """Where `table`'s chunk hashes are: a chunk table's columns, each hashed whole when first read
        (a few KB a column at a million shards); None: in the table's header entry."""
        key = "block_chunks" if table == "blocks" else "chunks"
        chunks = self.block_chunks if table == "blocks" else self.chunks
        if chunks is None:
            return None
        return ChunkPlan(
            self.header[key]["rows_per_chunk"],
            lambda name: chunks.column(f"{table}.{name}"),
            f"the {_CHUNK_TABLES[key][0]}",
        )

    def starts(self, running: str) -> Sequence[int] | np.ndarray:
        """The shards' running sums `running` at each chunk's first row (the chunk table's, or the header's)."""
        if self._starts is not None:
            return self._starts[running]
        assert self.chunks is not None
        return self.chunks.column(running, partial(self._check_starts, running))

    def check_chunk_tables(self) -> None:
        """Every column of the chunk tables against its hash, the running sums checked (`verify`)."""
        for table in (t for t in (self.chunks, self.block_chunks) if t is not None):
            for name in table.schema.names:
                if name in RUNNING_COLUMNS:
                    self.starts(name)
                else:
                    table.column(name)

    @staticmethod
    def _check_starts(running: str, c: int, lo: int, v: np.ndarray) -> str | None:
        """A running-sum column of the chunk table: from 0, never falling, counts (what each chunk of
        the shard table is checked against)."""
        if v.size and (int(v[0]) != 0 or bool((np.diff(v) < 0).any()) or int(v.max()) >= MAX_COUNT):
            return f"{running} is not {v.size} running sums rising from 0"
        return None

    def _boundary(self, running: str, c: int) -> int:
        """The running sum `running` at chunk c's first row (the chunk table's), or its total past the last."""
        found = self.starts(running)
        if c < len(found):
            return int(found[c])
        return self.blocks.rows if running == "first_block" else int(self.totals[_COUNTED[running]])

    def _check(self, name: str, c: int, lo: int, v: np.ndarray) -> str | None:
        """Chunk c of a column (rows lo...) against its ranges and the running sums at the chunks' edges
        (`starts`): every chunk checked is the whole column checked (each chunk's sum is the step between
        two of them, the last edge the header's total, so the chunks' sums add up to the totals)."""
        # one pass: a negative int64 read as uint64 is at least 2**63, past MAX_COUNT
        largest = int(v.view(np.uint64).max()) if name in _COUNT_COLUMNS and v.size else 0
        if largest >= MAX_COUNT:
            i = int(np.flatnonzero((v < 0) | (v >= MAX_COUNT))[0])
            return f"shard #{lo + i}: {name} = {int(v[i])} is negative or absurd"
        if name == "compression" and v.size and int(v.max()) >= len(COMPRESSIONS):
            i = int(np.argmax(v >= len(COMPRESSIONS)))
            return f"shard #{lo + i}: unknown compression code {int(v[i])}"
        if name == "tokens_known" and v.size and int(v.max()) > 1:
            return "tokens_known is not 0 or 1"
        running = RUNNING.get(name)
        if running is not None:
            # an int64 sum would wrap round to anything: refused past 2**62 (summed as floats only when
            # the counts, each below MAX_COUNT, could reach 2**61)
            if largest * v.size >= 2**61 and float(v.sum(dtype=np.float64)) >= 2.0**62:
                return f"the shards' {name} sum past 2**62: absurd"
            total = int(v.sum(dtype=np.int64)) if v.size else 0
            step = self._boundary(running, c + 1) - self._boundary(running, c)
            if total != step:
                if self.shards.chunk_rows >= self.num_shards:
                    return f"the shards' {name} sum to {total}, the header says {step}"
                says = "the header" if self.chunks is None else "the chunk table"
                return f"shards #{lo}-#{lo + v.size - 1}: their {name} sum to {total}, {says} says {step}"
        if name in _COUNTED:
            counts = self.shards.span(_COUNTED[name], lo, lo + v.size, self._check_chunk(_COUNTED[name]))
            if not _running_sum(v - self._boundary(name, c), counts):  # from the header's value, rising by the counts
                return f"{name} is not the running sum of {_COUNTED[name]}"
        if name == "checksum_order" and v.size and (int(v.min()) < 0 or int(v.max()) >= self.num_shards):
            return "checksum_order is not a permutation of the shards"
        return None

    def _check_sorted(self) -> None:
        """checksum_order, whole: a permutation of the shards along which the checksums strictly
        increase, so no shard is listed twice (O(shards) compares, no sort). n indices in range along
        which the checksums strictly rise are n distinct shards, a permutation: it is checked apart
        only when they do not rise, so the error is the same as when it was checked first."""
        n = self.num_shards
        if not n or self._sorted:
            return
        v = self.column("checksum_order")
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
                raise ManifestError(f"{self.shards.where}: checksum_order is not a permutation of the shards")
            i = int(np.argmin(rising))
            if halves[v[i]] == halves[v[i + 1]]:
                raise ManifestError(
                    f"{self.shards.where}: a shard is listed twice (shards #{int(v[i])} and #{int(v[i + 1])})"
                )
            raise ManifestError(f"{self.shards.where}: checksum_order does not sort the checksums")
        self._sorted = True

    def stored_layout(self, seq_len: int | None = None) -> StoredLayout | None:
        """The order's layout stored with the metadata: the rows order's (metadata_layout.py), or that
        of windows of `seq_len` tokens (metadata_windows.py); None: compute it. Made once and kept by
        the manifest, not by these tables (a layout refers to them: a cycle would keep them mapped)."""
        manifest = self.manifest()
        made: dict[int | None, StoredLayout] = {} if manifest is None else manifest.layouts
        with self._lock:
            if seq_len not in made:
                if seq_len is not None:
                    stored = window_layout(self, seq_len)
                elif self.layout is not None:
                    entry, samples = self.header["layout"], self.rows("samples")
                    stored = StoredLayout(self.layout, entry, samples, self.where, self._sample_starts)
                else:
                    return None
                if stored is None:
                    return None
                stored.manifest = manifest
                made[seq_len] = stored
            return made[seq_len]

    def layout_of(self, counts: Any) -> StoredLayout | None:
        """The stored layout made for these very per-shard counts (the rows', or a window length's)."""
        manifest = self.manifest()
        made = {} if manifest is None else manifest.layouts
        return next((stored for stored in made.values() if stored.counts is counts), None)

    def _sample_starts(self, shards: np.ndarray) -> np.ndarray:
        return self.at("sample_start", shards)

    def checksums(self) -> np.ndarray:
        """The checksum column, whole, checked to hold no shard twice (with `checksum_order`)."""
        self._check_sorted()
        return self.column("checksum")

    def checksum(self, i: int) -> bytes:
        """Shard i's checksum, checked to be no other shard's: where it sorts among the checksums
        (a binary search along `checksum_order`, ~log2(shards) rows read), `checksum_order` must list
        shard i, and the next one another checksum. For a given checksum the search lands on one
        place, so of two shards that share it at most one passes, wherever the order lists them; the
        whole order is `verify`'s (and `checksums`')."""
        key = self.value("checksum", i).tobytes()
        if self._sorted:
            return key
        order, checksums, n = self.shards.raw("checksum_order"), self.shards.raw("checksum"), self.num_shards

        def along(p: int) -> tuple[int, bytes]:
            j = int(order[p])
            if not 0 <= j < n:
                raise ManifestError(f"{self.shards.where}: checksum_order is not a permutation of the shards")
            return j, checksums[j].tobytes()

        lo, hi = 0, n
        while lo < hi:
            mid = (lo + hi) // 2
            if along(mid)[1] < key:
                lo = mid + 1
            else:
                hi = mid
        found = along(lo) if lo < n else (-1, b"")
        after = along(lo + 1) if lo + 1 < n else (-1, b"")
        for other, value in (found, after):
            if other != i and value == key:
                raise ManifestError(f"{self.shards.where}: a shard is listed twice (shards #{i} and #{other})")
        if found[0] != i:
            raise ManifestError(
                f"{self.shards.where}: checksum_order does not list shard #{i} where its checksum sorts "
                f"(damaged; `tierflow verify` names what)"
            )
        return key

    def name(self, i: int) -> str:
        return shard_name(self.checksum(i).hex())

    def block_list(self, i: int, keep: bool = True) -> BlockList:
        """Shard i's blocks, their rows checked (the chunks of the block table they lie in against the
        block chunk table, or, a dataset written before it, against the shard's block_digest) and their
        bounds (once, when `keep`: a pass over every shard keeps none, so its memory stays one shard's)."""
        found = self._block_lists.get(i)
        if found is not None:
            return found
        value = self.value
        first, count = int(value("first_block", i)), int(value("blocks", i))
        stop = first + count
        name = self.name(i)
        if self.block_chunks is not None:
            cols = {column: self.blocks.span(column, first, stop) for column in BLOCK_SCHEMA.names}
        else:
            cols = {column: self.blocks.raw(column)[first:stop] for column in BLOCK_SCHEMA.names}
            if block_digest(cols["length"], cols["rows"], cols["checksum"], cols["tokens"]) != int(
                value("block_digest", i)
            ):
                raise ManifestError(
                    f"{self.where}: shard {name}: its rows of {self.blocks.path.name} do not match "
                    f"its block_digest (damaged or edited)"
                )
        lengths = cols["length"].astype(np.int64)
        offsets = np.zeros(count, dtype=np.int64)
        np.cumsum(lengths[:-1], out=offsets[1:])
        rows = cols["rows"].astype(np.int64)
        tokens = cols["tokens"].astype(np.int64) if int(value("tokens_known", i)) else None
        blocks = BlockList(offsets, lengths, rows, cols["checksum"], tokens)
        problem = blocks.check(name, int(value("bytes", i)), int(value("samples", i)), int(value("tokens", i)))
        if problem is None and count and int(rows.max()) != int(value("largest_rows", i)):
            problem = f"shard {name}: largest_rows is not its largest block's rows"
        if problem is not None:
            raise ManifestError(f"{self.where}: {problem}")
        if keep:
            with self._lock:
                self._block_lists[i] = blocks
        return blocks

    def shard(self, i: int, keep: bool = True) -> ShardInfo:
        value = self.value
        return ShardInfo(
            name=self.name(i),
            samples=int(value("samples", i)),
            bytes=int(value("bytes", i)),
            decoded_bytes=int(value("decoded_bytes", i)),
            checksum=self.checksum(i).hex(),
            decoded_checksum=value("decoded_checksum", i).tobytes().hex(),
            compression=COMPRESSIONS[int(value("compression", i))],
            tokens=int(value("tokens", i)),
            blocks=self.block_list(i, keep),
        )


class MappedManifest(Manifest):
    """A version-3 dataset's manifest: the header's fields, and `shards` mapped (MappedShards).
    It pickles as its directory (a worker maps the same files, sharing their pages)."""

    tables: MetadataTables
    directory: Path
    where: str
    layouts: dict[int | None, StoredLayout]
    """The stored layouts made so far (MetadataTables.stored_layout), by window length (None: rows)."""

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
    manifest.tables, manifest.directory, manifest.where, manifest.layouts = tables, directory, where, {}
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
