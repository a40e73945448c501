"""Random access to a packed dataset: a sample is an index lookup and a slice of a mapped buffer.

`open_dataset(path)` gives `len()`, `ds[i]` (a dict of columns; token and other primitive
list columns as numpy views, no copy), iteration, and `ds.tokens(start, stop)` over the
concatenated token stream. Where shards come from is a `ShardSource`: by default the dataset
directory itself; the tier stack supplies decoded, memory-mapped files instead. Either way a
shard opens in O(its block list) and a row costs its block: read, verified (xxh3-64), decoded
on first use (docs/format.md, "Reading and verification").
"""

from __future__ import annotations

import itertools
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence as SequenceABC
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.types as pat

from tierflow.format.manifest import Manifest
from tierflow.format.regular import fd_path, open_shard_file
from tierflow.format.shard import (
    Block, ShardCorruptError, ShardInfo, block_error, block_schema, check_block, decode_block,
)


class ShardSource(Protocol):
    """Supplies the record batches of a shard; the tier stack is one, a plain directory another."""

    def open_shard(self, index: int, info: ShardInfo) -> "ShardTable": ...


def _starts(counts: Sequence[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(np.asarray(counts, dtype=np.int64), dtype=np.int64)])


class ShardTable:
    """One shard's record batches with per-column numpy views cached on first use.

    This base holds every batch already; `LazyShardTable` (what the sources give) loads and
    verifies each batch (block) on first use.
    """

    def __init__(self, batches: Sequence[pa.RecordBatch], keepalive: Any = None) -> None:
        self.batches = list(batches)
        self._keepalive = keepalive  # the memory map the batches point into
        self.row_starts = _starts([b.num_rows for b in self.batches])
        self._getters: list[dict[str, Callable[[int], Any]]] = [{} for _ in self.batches]

    @classmethod
    def from_ipc_file(cls, path: str | Path, memory_map: bool = True) -> "ShardTable":
        """Every batch of an IPC file, unverified: decoded files are memory-mapped (zero copy),
        compressed ones decode into memory."""
        source = pa.memory_map(str(path)) if memory_map else pa.OSFile(str(path))
        reader = pa.ipc.open_file(source)
        batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
        return cls(batches, keepalive=source)

    @property
    def num_rows(self) -> int:
        return int(self.row_starts[-1])

    @property
    def num_batches(self) -> int:
        return len(self.row_starts) - 1

    def _slot(self, batch: int) -> tuple[pa.RecordBatch, dict[str, Callable[[int], Any]]]:
        """(record batch, its column getters) of one block."""
        return self.batches[batch], self._getters[batch]

    def batch(self, batch: int) -> pa.RecordBatch:
        return self._slot(batch)[0]

    def locate(self, row: int) -> tuple[int, int]:
        b = int(np.searchsorted(self.row_starts, row, side="right")) - 1
        return b, row - int(self.row_starts[b])

    def getter(self, batch: int, name: str) -> Callable[[int], Any]:
        rb, getters = self._slot(batch)
        g = getters.get(name)
        if g is None:
            idx = rb.schema.get_field_index(name)
            g = _null_getter if idx < 0 else _column_getter(rb.column(idx))
            getters[name] = g
        return g

    def row(self, row: int, names: Sequence[str]) -> dict[str, Any]:
        b, r = self.locate(row)
        return {name: self.getter(b, name)(r) for name in names}

    def list_parts(self, batch: int, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(offsets, values) numpy views of a list column of one batch."""
        arr = self.batch(batch).column(name)
        return _list_offsets(arr), arr.values.to_numpy(zero_copy_only=True)


# -- block-granular reading ---------------------------------------------------------------------
class BlockBytes:
    """Where the bytes of one shard file's blocks come from (a mapped file, a file, a buffer).

    `blocks` are the file's blocks (the manifest's for the at-rest form, the tier's block list
    for the decoded form); `verified` means every byte was checked already (a whole buffer
    verified on download), so blocks need no second check; `compressed` bytes decode into memory.
    """

    def __init__(self, blocks: Sequence[Block], compressed: bool, verified: bool = False,
                 keepalive: Any = None) -> None:
        self.blocks = list(blocks)
        self.compressed = compressed
        self.verified = verified
        self.keepalive = keepalive  # a tier pin: alive as long as batches may point into the file

    def read(self, index: int, length: int | None = None) -> pa.Buffer:
        raise NotImplementedError

    def checked(self, index: int, name: str) -> pa.Buffer:
        """Block `index`'s bytes, after checking them against its xxh3-64 (ShardCorruptError if not)."""
        data = self.read(index)
        if not self.verified:
            check_block(data, name, index, self.blocks[index])
        return data


_scratch = threading.local()


def _scratch_buffer(size: int) -> memoryview:
    """This thread's reusable read buffer, at least `size` bytes (a fresh one per read would fault in
    new pages every time)."""
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or len(buffer) < size:
        buffer = _scratch.buffer = bytearray(max(size, 1 << 20))
    return memoryview(buffer)[:size]


class MappedBlocks(BlockBytes):
    """Blocks sliced out of a memory map: zero copy; a block's pages are read when it is verified."""

    def __init__(self, path: str | Path, blocks: Sequence[Block], name: str, expected_size: int,
                 compressed: bool = False, keepalive: Any = None) -> None:
        super().__init__(blocks, compressed, keepalive=keepalive)
        self.path = Path(path)
        fd = open_shard_file(self.path)
        try:
            size = os.fstat(fd).st_size
            if size != expected_size:  # also keeps every slice inside the mapping (no SIGBUS)
                raise ShardCorruptError(f"shard {name}: size {size} != {expected_size} expected ({self.path})")
            self._map = pa.memory_map(fd_path(fd, self.path))  # the file checked is the file mapped
        finally:
            os.close(fd)
        self._buffer = self._map.read_buffer(size)

    def read(self, index: int, length: int | None = None) -> pa.Buffer:
        block = self.blocks[index]
        return self._buffer.slice(block.offset, block.length if length is None else min(length, block.length))

    def checked(self, index: int, name: str) -> pa.Buffer:
        """Verified through a positioned read into a scratch buffer, served from the map: hashing the
        mapping itself would make every page of the block resident in this process, while a read
        row needs only its own pages."""
        block = self.blocks[index]
        scratch = _scratch_buffer(block.length)
        fd = open_shard_file(self.path)
        try:
            got = os.preadv(fd, [scratch], block.offset)
        finally:
            os.close(fd)
        check_block(scratch[:got], name, index, block)
        return self.read(index)


class FileBlocks(BlockBytes):
    """Blocks read with one positioned read each (compressed shards: they decode into memory)."""

    def __init__(self, path: str | Path, blocks: Sequence[Block], compressed: bool = True,
                 keepalive: Any = None) -> None:
        super().__init__(blocks, compressed, keepalive=keepalive)
        self.path = Path(path)

    def read(self, index: int, length: int | None = None) -> pa.Buffer:
        block = self.blocks[index]
        fd = open_shard_file(self.path)
        try:
            return pa.py_buffer(os.pread(fd, block.length if length is None else min(length, block.length),
                                         block.offset))
        finally:
            os.close(fd)


class BufferBlocks(BlockBytes):
    """Blocks sliced out of a shard file held in memory (verified whole when it was downloaded)."""

    def __init__(self, data: bytes, blocks: Sequence[Block], compressed: bool, verified: bool) -> None:
        super().__init__(blocks, compressed, verified=verified)
        self._buffer = pa.py_buffer(data)

    def read(self, index: int, length: int | None = None) -> pa.Buffer:
        block = self.blocks[index]
        return self._buffer.slice(block.offset, block.length if length is None else min(length, block.length))


class BlockCache:
    """A bound on the decoded bytes of blocks held across tables (compressed shards decode into
    memory). Least recently loaded first out, with a second chance for blocks read since; a block
    that goes is loaded (read, verified, decoded) again on its next use."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[tuple[int, int], int] = OrderedDict()
        self._tables: dict[int, weakref.ref] = {}
        self._dead: list[int] = []  # tables gone since the last add (appended by their finalizers)
        self._lock = threading.Lock()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, table: "LazyShardTable", block: int, size: int) -> None:
        victims = []
        with self._lock:
            while self._dead:
                self._drop_table(self._dead.pop())
            key = (table.token, block)
            if key in self._entries:
                return
            if table.token not in self._tables:
                self._tables[table.token] = weakref.ref(table)
                weakref.finalize(table, self._dead.append, table.token)  # no lock: it may run anywhere
            self._entries[key] = size
            self.bytes += size
            budget = len(self._entries) * 2  # every entry gets at most one second chance per call
            while self.bytes > self.max_bytes and len(self._entries) > 1 and budget > 0:
                budget -= 1
                (token, b), nbytes = next(iter(self._entries.items()))
                if (token, b) == key:
                    self._entries.move_to_end(key)
                    continue
                owner = self._tables.get(token)
                owner = owner() if owner is not None else None
                if owner is not None and owner._referenced[b]:
                    owner._referenced[b] = 0
                    self._entries.move_to_end((token, b))
                    continue
                del self._entries[(token, b)]
                self.bytes -= nbytes
                self.evictions += 1
                if owner is not None:
                    victims.append((owner, b))
        for owner, b in victims:
            owner._evict(b)

    def _drop_table(self, token: int) -> None:
        """Forget a table that is gone (its blocks went with it); called under the lock."""
        self._tables.pop(token, None)
        for key in [k for k in self._entries if k[0] == token]:
            self.bytes -= self._entries.pop(key)


_tokens = itertools.count()


class LazyShardTable(ShardTable):
    """A shard whose blocks are loaded on first use: opening costs O(blocks) of metadata, reading a
    row costs O(its block). A block's bytes are verified (xxh3-64 from the manifest or the tier's
    block list) before any of them is served; a block that fails raises ShardCorruptError naming
    the shard and the block, after `recover(block, error, source)` (the tier stack: quarantine,
    fetch again) had one try at giving a sound copy. Thread-safe: a block is loaded once, under
    the table's lock; the getters of loaded blocks are read without it.
    """

    def __init__(self, name: str, source: BlockBytes, schema: pa.Schema | None = None,
                 cache: BlockCache | None = None,
                 recover: Callable[[int, ShardCorruptError, BlockBytes], BlockBytes] | None = None) -> None:
        self.name = name
        self._source = source
        self._schema_hint = schema
        self._schema: pa.Schema | None = None
        self._cache = cache
        self._recover = recover
        self.row_starts = _starts([b.rows for b in source.blocks])
        n = len(source.blocks)
        self._slots: list[tuple[pa.RecordBatch, dict] | None] = [None] * n
        self._referenced = bytearray(n)
        self._lock = threading.RLock()
        self.token = next(_tokens)
        self.blocks_loaded = 0
        """Blocks read, verified and decoded so far (a block the cache dropped counts again)."""
        self.blocks_verified = 0

    @property
    def batches(self) -> "_LazyBatches":  # type: ignore[override]
        return _LazyBatches(self)

    @property
    def _keepalive(self) -> Any:  # type: ignore[override]
        return self._source.keepalive

    def _slot(self, batch: int) -> tuple[pa.RecordBatch, dict[str, Callable[[int], Any]]]:
        slot = self._slots[batch]
        if slot is None:
            return self._load(batch)
        self._referenced[batch] = 1
        return slot

    def _evict(self, batch: int) -> None:
        self._slots[batch] = None  # views handed out keep their buffers alive

    def _load(self, b: int) -> tuple[pa.RecordBatch, dict[str, Callable[[int], Any]]]:
        with self._lock:
            slot = self._slots[b]
            if slot is not None:
                return slot
            schema = self._shard_schema()
            source, data = self._verified(b)
            batch = decode_block(data, schema, self.name, b, source.blocks[b])
            if batch.num_rows != source.blocks[b].rows:
                raise block_error(self.name, b, source.blocks[b],
                                  f"holds {batch.num_rows} rows, not {source.blocks[b].rows}")
            slot = (batch, {})
            self._slots[b] = slot
            self.blocks_loaded += 1
        if self._cache is not None and source.compressed:
            self._cache.add(self, b, batch.get_total_buffer_size())
        return slot

    def _verified(self, b: int) -> tuple[BlockBytes, pa.Buffer]:
        """(source, bytes) of block b, checked against its xxh3-64; one recovery on a mismatch."""
        source = self._source
        try:
            data = source.checked(b, self.name)
        except ShardCorruptError as e:
            if self._recover is None:
                raise
            source = self._replace_source(self._recover(b, e, source))
            data = source.checked(b, self.name)
        if not source.verified:
            self.blocks_verified += 1
        return source, data

    def _replace_source(self, source: BlockBytes) -> BlockBytes:
        """Another copy of the same shard (maybe another form: same batches, other byte ranges)."""
        if [b.rows for b in source.blocks] != [b.rows for b in self._source.blocks]:
            raise ShardCorruptError(f"shard {self.name}: the copy fetched again has other blocks")
        self._source = source
        return source

    def _shard_schema(self) -> pa.Schema:
        """The shard's own schema (from block 0). The first bytes of block 0 are enough when they
        decode to the manifest's schema (nothing unverified is used); otherwise block 0 is verified."""
        if self._schema is not None:
            return self._schema
        block = self._source.blocks[0]
        if self._schema_hint is not None:
            try:
                found = block_schema(self._source.read(0, 1 << 16), self.name, block)
            except ShardCorruptError:
                found = None
            if found is not None and found.equals(self._schema_hint):
                self._schema = self._schema_hint
                return self._schema
        source, data = self._verified(0)
        self._schema = block_schema(data, self.name, source.blocks[0])
        return self._schema


class _LazyBatches(SequenceABC):
    """`table.batches` of a lazy table: indexing loads (and verifies) that block."""

    def __init__(self, table: LazyShardTable) -> None:
        self._table = table

    def __len__(self) -> int:
        return self._table.num_batches

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self._table.batch(i) for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"shard {self._table.name}: block {index} out of range")
        return self._table.batch(index)


def open_blocks(path: str | Path, info: ShardInfo, form: str = "at_rest", blocks: Sequence[Block] | None = None,
                keepalive: Any = None) -> BlockBytes:
    """The block source of a local shard file: at rest (the manifest's blocks) or decoded (`blocks`,
    the tier's list). Uncompressed files are memory-mapped; compressed ones read block by block."""
    if form == "at_rest":
        if info.compression == "none":
            return MappedBlocks(path, info.blocks, info.name, info.bytes, keepalive=keepalive)
        return FileBlocks(path, info.blocks, keepalive=keepalive)
    if blocks is None:
        raise ValueError(f"shard {info.name}: a decoded file needs its block list")
    return MappedBlocks(path, blocks, info.name, info.decoded_bytes, keepalive=keepalive)


def _null_getter(_: int) -> None:
    return None


def _list_offsets(arr: pa.Array) -> np.ndarray:
    return arr.offsets.to_numpy(zero_copy_only=True)


def _column_getter(arr: pa.Array) -> Callable[[int], Any]:
    """A fast per-row accessor for one column of one record batch."""
    t = arr.type
    valid = None
    if arr.null_count:
        valid = arr.is_valid().to_numpy(zero_copy_only=False)

    def guarded(f: Callable[[int], Any]) -> Callable[[int], Any]:
        if valid is None:
            return f
        return lambda r: f(r) if valid[r] else None

    if (pat.is_list(t) or pat.is_large_list(t)) and (
            pat.is_integer(t.value_type) or pat.is_floating(t.value_type)) and arr.values.null_count == 0:
        offsets = _list_offsets(arr)
        values = arr.values.to_numpy(zero_copy_only=True)
        return guarded(lambda r: values[offsets[r]:offsets[r + 1]])
    if pat.is_string(t) or pat.is_binary(t) or pat.is_large_string(t) or pat.is_large_binary(t):
        off_type = np.int64 if (pat.is_large_string(t) or pat.is_large_binary(t)) else np.int32
        bufs = arr.buffers()
        offsets = np.frombuffer(bufs[1], dtype=off_type)[arr.offset:arr.offset + len(arr) + 1]
        data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
        if pat.is_string(t) or pat.is_large_string(t):
            return guarded(lambda r: data[offsets[r]:offsets[r + 1]].tobytes().decode("utf-8"))
        return guarded(lambda r: data[offsets[r]:offsets[r + 1]].tobytes())
    if (pat.is_integer(t) or pat.is_floating(t) or pat.is_boolean(t)) and valid is None and not pat.is_boolean(t):
        values = arr.to_numpy(zero_copy_only=True)
        return lambda r: values[r].item()
    return lambda r: arr[r].as_py()


class DirectorySource:
    """Shards read straight from the dataset directory, block by block, each block verified on use.

    Opening a shard costs its block list (from the manifest); reading a row costs its block:
    read, checked against the block's xxh3-64, decoded. Uncompressed shards are memory-mapped
    and their verified blocks stay (a mapping costs address space, not memory: the page cache
    holds the bytes). Compressed blocks decode into memory, bounded by `max_decoded_bytes`
    across shards; a block that falls out is read, verified and decoded again when next used.
    Wrong bytes are never served, and no whole file is read to serve one sample.
    """

    def __init__(self, root: str | Path, max_decoded_bytes: int = 1 << 30, schema: pa.Schema | None = None) -> None:
        self.root = Path(root)
        self.max_decoded_bytes = max_decoded_bytes
        self.schema = schema
        self.cache = BlockCache(max_decoded_bytes)
        self._tables: dict[int, LazyShardTable] = {}
        self._lock = threading.Lock()
        self.opens = 0
        """Shard files opened so far (a count that stays at the shard count means no thrash)."""

    @property
    def blocks_read(self) -> int:
        """Blocks read, verified and decoded so far, over every shard."""
        with self._lock:
            tables = list(self._tables.values())
        return sum(t.blocks_loaded for t in tables)

    def open_shard(self, index: int, info: ShardInfo) -> ShardTable:
        table = self._tables.get(index)
        if table is not None:
            return table
        table = LazyShardTable(info.name, open_blocks(self.root / info.name, info), self.schema, self.cache)
        with self._lock:
            found = self._tables.get(index)
            if found is not None:
                return found
            self.opens += 1
            self._tables[index] = table
        return table


class Dataset:
    """A packed dataset opened for reading; thread-safe for concurrent readers."""

    def __init__(self, manifest: Manifest, source: ShardSource, columns: Sequence[str] | None = None,
                 location: str = "") -> None:
        self.manifest = manifest
        self.source = source
        self.location = location
        names = manifest.schema.names
        if columns is not None:
            unknown = [c for c in columns if c not in names]
            if unknown:
                raise KeyError(f"{location}: no column(s) {unknown}; the dataset has {names}")
        self.columns = list(columns) if columns is not None else list(names)
        self.sample_starts = np.concatenate(
            [[0], np.cumsum([s.samples for s in manifest.shards], dtype=np.int64)])
        self.token_starts = np.concatenate(
            [[0], np.cumsum([s.tokens for s in manifest.shards], dtype=np.int64)])
        self._token_batch_starts: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return int(self.sample_starts[-1])

    def __repr__(self) -> str:
        return (f"Dataset({self.location!r}, samples={len(self)}, shards={len(self.manifest.shards)}, "
                f"columns={self.columns})")

    def locate(self, index: int) -> tuple[int, int]:
        """Global sample index -> (shard index, row in shard)."""
        if not 0 <= index < len(self):
            raise IndexError(f"{self.location}: sample {index} out of range [0, {len(self)})")
        s = int(np.searchsorted(self.sample_starts, index, side="right")) - 1
        return s, index - int(self.sample_starts[s])

    def shard(self, s: int) -> ShardTable:
        return self.source.open_shard(s, self.manifest.shards[s])

    def __getitem__(self, index: int) -> dict[str, Any]:
        if index < 0:
            index += len(self)
        s, row = self.locate(index)
        return self.shard(s).row(row, self.columns)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for s in range(len(self.manifest.shards)):
            table = self.shard(s)
            for row in range(table.num_rows):
                yield table.row(row, self.columns)

    @property
    def num_tokens(self) -> int:
        return int(self.token_starts[-1])

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the concatenated stream; a view when inside one block."""
        column = self.manifest.token_column
        if column is None:
            raise TypeError(f"{self.location}: not a token dataset (packed without --tokenizer)")
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"{self.location}: tokens [{start}, {stop}) outside [0, {self.num_tokens})")
        pieces = []
        pos = start
        while pos < stop:
            s = int(np.searchsorted(self.token_starts, pos, side="right")) - 1
            table = self.shard(s)
            batch_starts = self.block_token_starts(s, table)
            local = pos - int(self.token_starts[s])
            b = int(np.searchsorted(batch_starts, local, side="right")) - 1
            offsets, values = table.list_parts(b, column)
            begin = int(offsets[0]) + local - int(batch_starts[b])
            take = min(stop - pos, int(batch_starts[b + 1]) - local)
            pieces.append(values[begin:begin + take])
            pos += take
        if len(pieces) == 1:
            return pieces[0]
        if not pieces:
            return np.zeros(0, dtype=self.manifest.token_dtype or np.uint16)
        return np.concatenate(pieces)

    def block_token_starts(self, s: int, table: ShardTable | None = None) -> np.ndarray:
        """Token offsets of shard s's blocks within the shard (length blocks + 1).

        From the manifest when the pack recorded per-block token counts (nothing is read);
        otherwise every block's offsets are read once (older packs)."""
        starts = self._token_batch_starts.get(s)
        if starts is None:
            info = self.manifest.shards[s]
            counts = [b.tokens for b in info.blocks]
            if not counts or None in counts or sum(counts) != info.tokens or min(counts) < 0:
                column = self.manifest.token_column
                table = table if table is not None else self.shard(s)
                counts = []
                for b in range(table.num_batches):
                    offsets, _ = table.list_parts(b, column)
                    counts.append(int(offsets[-1] - offsets[0]))
            starts = _starts(counts)
            self._token_batch_starts[s] = starts
        return starts


def open_dataset(path: str | Path, columns: Sequence[str] | None = None, manifest: Manifest | None = None) -> Dataset:
    """Open a packed dataset directory for random access by global sample index (`manifest`: the
    directory's manifest, already loaded)."""
    manifest = manifest if manifest is not None else Manifest.load(path)
    return Dataset(manifest, DirectorySource(path, schema=manifest.schema), columns=columns, location=str(path))
