"""A shard opened as a table: its blocks decoded on first use, rows read through per-column getters.

`ShardTable` holds decoded blocks; `LazyShardTable` (what the sources give) reads, verifies and
decodes each block when a row first needs it, and a `BlockCache` bounds the decoded bytes of
compressed blocks across tables.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence as SequenceABC
from typing import Any, overload
from collections.abc import Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.types as pat

from tierflow.format._heap import TRIM_EVERY, release_free_heap
from tierflow.format.blocks import BlockBytes
from tierflow.format.index import cumulative
from tierflow.errors import ManifestError, ShardCorruptError
from tierflow.format.block_decoder import block_schema, decode_block
from tierflow.format.shard import block_rows
from tierflow.format.verify import block_error


class _Views:
    """What is read off one decoded block, kept with it (and dropped with it): per-column row
    getters and list columns' (offsets, values) numpy views."""

    __slots__ = ("getters", "parts")

    def __init__(self) -> None:
        self.getters: dict[str | tuple[str, bool], Callable[[int], Any]] = {}
        self.parts: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}  # offsets, values, values[offsets[0]:]


class ShardTable:
    """One shard's blocks (decoded record batches) with per-column numpy views cached on first use.

    This base holds every block already; `LazyShardTable` (what the sources give) loads and
    verifies each block on first use.
    """

    def __init__(self, blocks: Sequence[pa.RecordBatch]) -> None:
        self.blocks = list(blocks)
        self.row_starts = cumulative([b.num_rows for b in self.blocks])
        self._views = [_Views() for _ in self.blocks]

    @property
    def num_rows(self) -> int:
        return int(self.row_starts[-1])

    @property
    def num_blocks(self) -> int:
        return len(self.row_starts) - 1

    def _slot(self, block: int) -> tuple[pa.RecordBatch, _Views]:
        """(decoded block, the views read off it) of one block."""
        return self.blocks[block], self._views[block]

    def block(self, block: int) -> pa.RecordBatch:
        return self._slot(block)[0]

    def block_rows(self, block: int) -> int:
        return int(self.row_starts[block + 1] - self.row_starts[block])

    def getter(self, block: int, name: str, text_views: bool = False) -> Callable[[int], Any]:
        """Row -> value of column `name` in one block (None for a column the shard lacks). With
        `text_views`, a string column without nulls gives each value as a memoryview of its UTF-8
        bytes in the block, not decoded: what a worker writes into its ring as it is."""
        decoded, views = self._slot(block)
        key = (name, True) if text_views else name
        g = views.getters.get(key)
        if g is None:
            idx = decoded.schema.get_field_index(name)
            column = decoded.column(idx) if idx >= 0 else None
            if column is None:
                g = _null_getter
            elif (
                text_views
                and (pat.is_string(column.type) or pat.is_large_string(column.type))
                and not column.null_count
            ):
                g = _utf8_getter(column)
            else:
                g = self.getter(block, name) if text_views else _column_getter(column)
            views.getters[key] = g
        return g

    def _parts(self, block: int, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(offsets, values, values from the first row's on) of a list column of one block, made
        once per loaded block."""
        decoded, views = self._slot(block)
        parts = views.parts.get(name)
        if parts is None:
            arr = decoded.column(name)
            offsets, values = _list_offsets(arr), numpy_view(arr.values)
            parts = views.parts[name] = (offsets, values, values[int(offsets[0]) :])
        return parts

    def list_parts(self, block: int, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(offsets, values) numpy views of a list column of one block."""
        return self._parts(block, name)[:2]

    def list_values(self, block: int, name: str) -> np.ndarray:
        """The values of a list column of one block from its first row's on, so value k of the block
        (for the token column: the token at offset k of the block) is element k. The hot path of
        token reads: one slot and one dict lookup once the block is loaded."""
        parts = self._slot(block)[1].parts.get(name)
        return (parts if parts is not None else self._parts(block, name))[2]


class BlockCache:
    """A bound on the decoded bytes of blocks held across tables (compressed shards decode into
    memory). Least recently loaded first out, with a second chance for blocks read since; a block
    that goes is loaded (read, verified, decoded) again on its next use."""

    def __init__(self, max_bytes: int) -> None:
        self.cap = max_bytes
        """The source's budget; a reader may bound `max_bytes` below it (TieredDataset.decoded_bound)."""
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[tuple[int, int], int] = OrderedDict()
        self._tables: dict[int, weakref.ref] = {}
        self._dead: list[int] = []  # tables gone since the last add (appended by their finalizers)
        self._lock = threading.Lock()
        self.evictions = 0
        self.trims = 0
        """Times the freed blocks' heap pages were handed back (_heap.release_free_heap)."""
        self._untrimmed = 0  # bytes evicted since the last trim

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, table: LazyShardTable, block: int, size: int) -> None:
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
                self._untrimmed += nbytes
                if owner is not None:
                    victims.append((owner, b))
            trim = self._untrimmed >= TRIM_EVERY
            if trim:
                self._untrimmed = 0
        for owner, b in victims:
            owner._evict(b)
        if trim and release_free_heap():  # after the slots let go of the evicted blocks
            self.trims += 1

    def _drop_table(self, token: int) -> None:
        """Forget a table that is gone (its blocks went with it); called under the lock."""
        self._tables.pop(token, None)
        for key in [k for k in self._entries if k[0] == token]:
            self.bytes -= self._entries.pop(key)


_tokens = itertools.count()


class LazyShardTable(ShardTable):
    """A shard whose blocks are loaded on first use: opening costs O(blocks) of metadata, reading a
    row costs O(its block). A block's bytes are verified (xxh3-64 from the manifest or the tier's
    block list) before any of them is served; a block that fails (or cannot be read) raises
    ShardCorruptError naming the shard and the block, after `recover(block, error, source)` (the
    tier stack: quarantine, fetch again) had one try at giving a sound copy. Thread-safe: a block is loaded once, under
    the table's lock; the getters of loaded blocks are read without it.
    """

    def __init__(
        self,
        name: str,
        source: BlockBytes,
        schema: pa.Schema | None = None,
        cache: BlockCache | None = None,
        recover: Callable[[int, ShardCorruptError, BlockBytes], BlockBytes] | None = None,
    ) -> None:
        self.name = name
        self._source = source
        self._schema_hint = schema
        self._schema: pa.Schema | None = None
        self._cache = cache
        self._recover = recover
        self.row_starts = cumulative(block_rows(source.blocks))
        n = len(source.blocks)
        self._slots: list[tuple[pa.RecordBatch, _Views] | None] = [None] * n
        source.loaded = self._slots  # what a source reading ahead need not fetch (no reference back)
        self._referenced = bytearray(n)
        self._lock = threading.RLock()
        self.token = next(_tokens)
        self.blocks_loaded = 0
        """Blocks read, verified and decoded so far (a block the cache dropped counts again)."""
        self.blocks_verified = 0
        self._tokens: tuple[str, str | None, list[int | None], int | None] | None = None

    def expect_tokens(
        self, column: str, dtype: str | None, counts: Sequence[int | None], eos: int | None = None
    ) -> None:
        """Check each block's token count (`counts`, the manifest's; None: not recorded) and token
        dtype against its list offsets when it is decoded, before any view of it is handed out:
        a manifest whose counts were moved between blocks would otherwise serve wrong windows.
        `eos`: the manifest's eos_id, which ends every document pack writes: a block whose
        documents end with another token is ManifestError (windows would cut documents wrongly)."""
        with self._lock:
            if self._tokens is not None:
                return
            if len(counts) != len(self._slots):
                raise ShardCorruptError(
                    f"shard {self.name}: {len(counts)} block token counts for {len(self._slots)} blocks"
                )
            self._tokens = (column, dtype, list(counts), eos)
            for b, slot in enumerate(self._slots):
                if slot is not None:
                    self._check_tokens(b, slot[0])

    def _check_tokens(self, b: int, decoded: pa.RecordBatch, views: _Views | None = None) -> None:
        """`expect_tokens`' checks of block b; `views` (the block's, still empty) is given the token
        column's (offsets, values) views the checks read, which `list_values` would make again."""
        column, dtype, counts, eos = self._tokens  # type: ignore[misc]
        idx = decoded.schema.get_field_index(column)
        block = self._source.blocks[b]
        if idx < 0:
            if counts[b]:
                raise block_error(
                    self.name, b, block, f"has no {column} column, the manifest says it holds {counts[b]} tokens"
                )
            return
        arr = decoded.column(idx)
        if dtype is not None and str(getattr(arr.type, "value_type", arr.type)) != dtype:
            raise block_error(self.name, b, block, f"holds {arr.type} tokens, the manifest's token_dtype is {dtype}")
        if counts[b] is None and (eos is None or not len(arr)):
            return
        offsets = _list_offsets(arr)
        if counts[b] is not None:
            got = int(offsets[-1]) - int(offsets[0]) if len(offsets) else 0
            if got != counts[b]:
                raise block_error(self.name, b, block, f"holds {got} tokens, the manifest says {counts[b]}")
        if eos is None or not len(arr):
            return
        if arr.values.null_count:
            raise block_error(self.name, b, block, "holds null tokens")
        values = numpy_view(arr.values)
        ends = offsets[1:][offsets[1:] > offsets[:-1]]  # of the documents with tokens
        last = values[ends - 1] if len(ends) else ends
        wrong = np.flatnonzero(last != eos)
        if len(wrong):
            raise ManifestError(
                f"shard {self.name}: block {b}: its documents end with token "
                f"{int(last[wrong[0]])}, not the manifest's eos_id {eos} ({len(wrong)} of "
                f"{len(ends)}): the manifest's eos_id is wrong (edited, or resealed); re-pack, "
                f"or restore the manifest"
            )
        if views is not None:
            views.parts[column] = (offsets, values, values[int(offsets[0]) :])

    @property
    def blocks(self) -> _LazyBlocks:  # type: ignore[override]
        return _LazyBlocks(self)

    def _slot(self, block: int) -> tuple[pa.RecordBatch, _Views]:
        slot = self._slots[block]
        if slot is None:
            return self._load(block)
        self._referenced[block] = 1
        return slot

    def list_values(self, block: int, name: str) -> np.ndarray:
        """`ShardTable.list_values`, marking the block read for the cache's second chance also when this
        read loaded it (its token views made with the block's checks)."""
        slot = self._slots[block]
        if slot is None:
            slot = self._load(block)
        self._referenced[block] = 1
        parts = slot[1].parts.get(name)
        return (parts if parts is not None else self._parts(block, name))[2]

    def _evict(self, block: int) -> None:
        self._slots[block] = None  # views handed out keep their buffers alive

    def _load(self, b: int) -> tuple[pa.RecordBatch, _Views]:
        with self._lock:
            slot = self._slots[b]
            if slot is not None:
                return slot
            schema = self._shard_schema()
            source, data = self._verified(b)
            # decode_block refuses a batch of other than the block's rows (its claims are checked first)
            decoded = decode_block(data, schema, self.name, b, source.blocks[b], source.max_decoded)
            slot = (decoded, _Views())
            if self._tokens is not None:
                self._check_tokens(b, decoded, slot[1])
            self._slots[b] = slot
            self.blocks_loaded += 1
        if self._cache is not None and source.compressed:
            self._cache.add(self, b, decoded.get_total_buffer_size())
        return slot

    def _verified(self, b: int) -> tuple[BlockBytes, pa.Buffer]:
        """(source, bytes) of block b, checked against its xxh3-64; one recovery on a mismatch."""
        source = self._source
        try:
            data = source.checked(b, self.name)
        except OSError as e:  # ShardCorruptError, or a copy whose bytes cannot be read (EIO)
            if self._recover is None:
                raise
            if not isinstance(e, ShardCorruptError):
                unreadable = ShardCorruptError(f"shard {self.name}: block {b} cannot be read ({e})")
                unreadable.__cause__ = e  # the recovery reads the next copy from below the failing tier
                e = unreadable
            source = self._replace_source(self._recover(b, e, source))
            try:
                data = source.checked(b, self.name)
            except ShardCorruptError:
                raise
            except OSError as again:
                raise ShardCorruptError(
                    f"shard {self.name}: block {b} cannot be read from the copy fetched again either ({again})"
                ) from again
        if not source.verified:
            self.blocks_verified += 1
        return source, data

    def _replace_source(self, source: BlockBytes) -> BlockBytes:
        """Another copy of the same shard (maybe another form: same blocks, other byte ranges)."""
        if not np.array_equal(block_rows(source.blocks), block_rows(self._source.blocks)):
            raise ShardCorruptError(f"shard {self.name}: the copy fetched again has other blocks")
        self._source = source
        source.loaded = self._slots
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
            except OSError:  # ShardCorruptError, or unreadable: the verified read below decides (and recovers)
                found = None
            if found is not None and found.equals(self._schema_hint):
                self._schema = self._schema_hint
                return self._schema
        source, data = self._verified(0)
        self._schema = block_schema(data, self.name, source.blocks[0])
        return self._schema


class _LazyBlocks(SequenceABC[pa.RecordBatch]):
    """`table.blocks` of a lazy table: indexing loads (and verifies) that block."""

    def __init__(self, table: LazyShardTable) -> None:
        self._table = table

    def __len__(self) -> int:
        return self._table.num_blocks

    @overload
    def __getitem__(self, index: int) -> pa.RecordBatch: ...

    @overload
    def __getitem__(self, index: slice) -> list[pa.RecordBatch]: ...

    def __getitem__(self, index: int | slice) -> pa.RecordBatch | list[pa.RecordBatch]:
        if isinstance(index, slice):
            return [self._table.block(i) for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"shard {self._table.name}: block {index} out of range")
        return self._table.block(index)


def _null_getter(_: int) -> None:
    return None


def numpy_view(arr: pa.Array) -> np.ndarray:
    """A fixed-width numeric array without nulls as a read-only numpy view of its buffer. Not
    `Array.to_numpy`: pyarrow imports pandas for it, ~0.2 s and ~57 MB in every process that reads."""
    if arr.null_count or not (pat.is_integer(arr.type) or pat.is_floating(arr.type)):
        raise TypeError(f"{arr.type} with {arr.null_count} nulls has no plain numpy view")
    kind = np.dtype(arr.type.to_pandas_dtype())
    buf = arr.buffers()[1]
    if buf is None:
        return np.zeros(0, dtype=kind)
    return np.frombuffer(buf, dtype=kind, count=len(arr) + arr.offset)[arr.offset :]


def _list_offsets(arr: pa.Array) -> np.ndarray:
    return numpy_view(arr.offsets)


def _validity(arr: pa.Array) -> np.ndarray:
    """Row -> valid, as numpy bools, from the array's bitmap (`arr.is_valid()` is a compute call:
    ~60 us a block, paid by every column with nulls of every block loaded)."""
    bitmap = arr.buffers()[0]
    bits = np.unpackbits(np.frombuffer(bitmap, dtype=np.uint8), bitorder="little")
    return bits[arr.offset : arr.offset + len(arr)].view(np.bool_)


def _binary_parts(arr: pa.Array) -> tuple[np.ndarray, memoryview]:
    """(offsets of its rows, its bytes) of a string or binary array, as views of its buffers."""
    large = pat.is_large_string(arr.type) or pat.is_large_binary(arr.type)
    bufs = arr.buffers()
    offsets = np.frombuffer(bufs[1], dtype=np.int64 if large else np.int32)[arr.offset : arr.offset + len(arr) + 1]
    return offsets, memoryview(bufs[2]) if bufs[2] is not None else memoryview(b"")


def _utf8_getter(arr: pa.Array) -> Callable[[int], memoryview]:
    """Row -> its value's UTF-8 bytes in the block (a string array without nulls), not decoded."""
    offsets, data = _binary_parts(arr)
    return lambda r: data[offsets[r] : offsets[r + 1]]


def _column_getter(arr: pa.Array) -> Callable[[int], Any]:
    """A fast per-row accessor for one column of one decoded block."""
    t = arr.type
    valid = None
    if arr.null_count:
        if arr.null_count == len(arr):
            return _null_getter
        valid = _validity(arr)

    def guarded(f: Callable[[int], Any]) -> Callable[[int], Any]:
        if valid is None:
            return f
        return lambda r: f(r) if valid[r] else None

    if (
        (pat.is_list(t) or pat.is_large_list(t))
        and (pat.is_integer(t.value_type) or pat.is_floating(t.value_type))
        and arr.values.null_count == 0
    ):
        offsets = _list_offsets(arr)
        values = numpy_view(arr.values)
        return guarded(lambda r: values[offsets[r] : offsets[r + 1]])
    if pat.is_string(t) or pat.is_binary(t) or pat.is_large_string(t) or pat.is_large_binary(t):
        offsets, data = _binary_parts(arr)
        if pat.is_string(t) or pat.is_large_string(t):
            return guarded(lambda r: str(data[offsets[r] : offsets[r + 1]], "utf-8"))  # one pass, no bytes copy
        return guarded(lambda r: bytes(data[offsets[r] : offsets[r + 1]]))
    if (pat.is_integer(t) or pat.is_floating(t) or pat.is_boolean(t)) and valid is None and not pat.is_boolean(t):
        values = numpy_view(arr)
        return lambda r: values[r].item()
    return lambda r: arr[r].as_py()
