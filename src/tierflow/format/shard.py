"""The shard: one Arrow IPC file, compressed per buffer at rest, content-addressed.

A shard's rows are cut into *blocks*, one Arrow record batch each, and the shard exists in two
forms with the same blocks: *at rest* (zstd/lz4 buffer compression, what L4-L2 hold) and
*decoded* (uncompressed, what a tier memory-maps for zero-copy numpy views). Both forms' sizes
and xxh3-128 hashes are in the manifest, and every block of the at-rest file has its byte range
and xxh3-64, so a ranged read of one block verifies without reading the shard. See docs/format.md.
"""

from __future__ import annotations

import base64
import binascii
import os
import threading
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Callable, Iterator, NamedTuple, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.types as pat
import xxhash
import zstandard

from tierflow.format._checksum import CHUNK, HashingSink, xxh3_hex
from tierflow.format._ipcmeta import ZSTD, BatchClaims, MalformedMessage, batch_claims, decoded_size
from tierflow.format._regular import open_regular
from tierflow.errors import ShardCorruptError

SHARD_PREFIX = "shard-"
SHARD_SUFFIX = ".arrow"
COMPRESSIONS = ("zstd", "lz4", "none")
#: at-rest compression is kept only when it saves at least this fraction of the decoded size
MIN_SAVING = 0.15
MAX_COUNT = 1 << 48
"""A manifest's counts (samples, bytes, a block's rows) are below this; anything larger is absurd."""


class Form(StrEnum):
    """How a shard's bytes are held: as packed (`at_rest`, compressed per buffer) or `decoded`
    (uncompressed, memory-mapped for zero-copy views). String-valued, so tier configs, CLI
    arguments and tier index rows keep their spelling."""

    AT_REST = "at_rest"
    DECODED = "decoded"

    @classmethod
    def _missing_(cls, value: object) -> "Form":
        raise ValueError(f"form {value!r} is not one of {', '.join(f.value for f in cls)}")


class Block(NamedTuple):
    """One record batch of a shard file (a tuple: a manifest lists thousands, parsed at every start)."""

    offset: int
    length: int
    rows: int
    checksum: str  # xxh3-64 hex of bytes [offset, offset + length) of the file
    tokens: int | None = None  # values of the token column in this block, when the pack recorded them


@dataclass
class ShardInfo:
    """What the manifest records about one shard."""

    name: str
    samples: int
    bytes: int
    decoded_bytes: int
    checksum: str
    decoded_checksum: str
    compression: str
    tokens: int = 0
    blocks: Sequence[Block] = field(default_factory=list)
    """A list of records (pack, a tier's block list) or, loaded from a manifest, a `BlockList`."""

    @property
    def key(self) -> str:
        """The entry key every tier uses for this shard: its at-rest content hash."""
        return self.checksum

    def bytes_in(self, form: Form) -> int:
        """The size of the shard's file in `form`."""
        return self.decoded_bytes if form == Form.DECODED else self.bytes

    def checksum_in(self, form: Form) -> str:
        """The xxh3-128 of the shard's file in `form`."""
        return self.decoded_checksum if form == Form.DECODED else self.checksum

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "samples": self.samples,
            "bytes": self.bytes,
            "decoded_bytes": self.decoded_bytes,
            "checksum": self.checksum,
            "decoded_checksum": self.decoded_checksum,
            "compression": self.compression,
            "tokens": self.tokens,
            "blocks": block_table(self.blocks),
        }

    @classmethod
    def from_json(cls, d: dict) -> "ShardInfo":
        """The shard a manifest entry describes; its blocks stay columns (`BlockList`) until used."""
        return cls(
            name=str(d["name"]), samples=int(d["samples"]), bytes=int(d["bytes"]),
            decoded_bytes=int(d["decoded_bytes"]), checksum=str(d["checksum"]),
            decoded_checksum=str(d["decoded_checksum"]), compression=str(d["compression"]),
            tokens=int(d.get("tokens", 0)), blocks=BlockList.from_json(d["blocks"]),
        )


class BlockList(SequenceABC):
    """A shard's blocks as the manifest lists them: int64 columns (offset, length, rows, tokens) and
    the checksums, a `Block` record made only when one is asked for. A manifest lists every block of
    every shard (3,081 at 100M samples in 30 shards) and a start reads a few of one shard: making
    records for all of them was most of a manifest's parse. The columns are checked whole when the
    manifest loads (`check`), so a record handed out is a validated one."""

    __slots__ = ("offsets", "lengths", "rows", "tokens", "checksums", "_made")

    def __init__(self, offsets: np.ndarray, lengths: np.ndarray, rows: np.ndarray, checksums: list[str] | np.ndarray,
                 tokens: np.ndarray | None = None) -> None:
        self.offsets, self.lengths, self.rows, self.checksums, self.tokens = offsets, lengths, rows, checksums, tokens
        self._made: list[Block | None] = [None] * len(checksums)

    @classmethod
    def from_json(cls, b: dict) -> "BlockList":
        """The columns of a manifest's `blocks` object, a binary table (`block_table`) or, as format
        version 1 wrote them, JSON lists; TypeError/ValueError if one is not a list of its type or they
        differ in length (untrusted JSON: bool, float and huge ints are refused)."""
        if not isinstance(b, dict):
            raise TypeError("blocks is not an object")
        if "table" in b:
            return cls._from_table(b)
        tokens = b.get("tokens")
        columns = {"offset": b["offset"], "length": b["length"], "rows": b["rows"], "checksum": b["checksum"]}
        if tokens is not None:
            columns["tokens"] = tokens
        for name, column in columns.items():
            allowed = {str} if name == "checksum" else {int}
            if not isinstance(column, list) or not set(map(type, column)) <= allowed:
                raise TypeError(f"blocks.{name} is not a list of {'/'.join(t.__name__ for t in allowed)}")
        if len({len(c) for c in columns.values()}) > 1:
            lengths = ", ".join(f"{k} {len(v)}" for k, v in columns.items())
            raise ValueError(f"blocks' columns differ in length: {lengths}")
        try:
            ints = [np.array(columns[k], dtype=np.int64).reshape(-1) for k in ("offset", "length", "rows")]
            counts = np.array(tokens, dtype=np.int64).reshape(-1) if tokens is not None else None
        except OverflowError:
            raise ValueError("a block's offset, length, rows or tokens is beyond 64 bits") from None
        return cls(*ints, columns["checksum"], counts)

    @classmethod
    def _from_table(cls, b: dict) -> "BlockList":
        """The columns of a `block_table` object: one base64 decode and a view per column, so a
        manifest's parse and checksum cost C passes over ~27 characters a block, not a JSON value per
        block and column (lists of 3,081 blocks were ~60% of a 100M-sample manifest's load)."""
        names, count, table = b.get("columns"), b.get("count"), b.get("table")
        if names not in (list(TABLE_COLUMNS[:3]), list(TABLE_COLUMNS)):
            raise ValueError(f"blocks.columns = {names!r:.80} is not {list(TABLE_COLUMNS[:3])}, "
                             f"optionally + ['tokens']")
        if type(count) is not int or not 0 <= count < MAX_COUNT or not isinstance(table, str):
            raise TypeError("blocks.count is not a block count or blocks.table is not a string")
        try:
            raw = binascii.a2b_base64(table, strict_mode=True)
        except binascii.Error as e:
            raise ValueError(f"blocks.table is not base64 ({e})") from None
        size = (20 if len(names) == 4 else 16) * count
        if len(raw) != size:
            raise ValueError(f"blocks.table holds {len(raw)} bytes, not the {size} of {count} blocks")
        lengths_rows = np.frombuffer(raw, "<u4", 2 * count).astype(np.int64)
        lengths, rows = lengths_rows[:count], lengths_rows[count:]
        offsets = np.zeros(count, dtype=np.int64)
        np.cumsum(lengths[:-1], out=offsets[1:])
        checksums = np.frombuffer(raw, "<u8", count, 8 * count)
        tokens = np.frombuffer(raw, "<u4", count, 16 * count).astype(np.int64) if len(names) == 4 else None
        return cls(offsets, lengths, rows, checksums, tokens)

    def check(self, name: str, size: int, samples: int, tokens: int) -> str | None:
        """What is wrong with these blocks of shard `name` (`size` bytes at rest, `samples` rows,
        `tokens` tokens), None when nothing: rows summing to the samples, recorded tokens summing to
        the tokens, then block by block its rows in range, inside the file and after the block before
        it (pack writes them so; `verify` streams them so). Vectorised: O(blocks) in numpy, not Python."""
        rows, offsets, lengths = self.rows, self.offsets, self.lengths
        total = sum(rows.tolist())  # exact, whatever a hostile manifest's numbers add up to
        if total != samples:
            return f"shard {name}: block rows sum to {total}, not {samples} samples"
        if self.tokens is not None and self.tokens.size:
            counted = sum(self.tokens.tolist())
            if int(self.tokens.min()) < 0 or counted != tokens:
                return f"shard {name}: block tokens sum to {counted}, not its {tokens} tokens"
        before = np.concatenate(([0], (offsets + lengths)[:-1]))  # where the block before ends
        bad_rows = (rows < 0) | (rows >= MAX_COUNT)
        # each of offset and length within the size first, so their sum cannot wrap around
        outside = (offsets < 0) | (lengths <= 0) | (offsets > size) | (lengths > size) | (offsets + lengths > size)
        wrong = np.flatnonzero(bad_rows | outside | (offsets < before))
        if not wrong.size:
            return None
        i = int(wrong[0])
        offset, length = int(offsets[i]), int(lengths[i])
        if bad_rows[i]:
            return f"shard {name}: a block of {int(rows[i])} rows is negative or absurd"
        if outside[i]:
            return f"shard {name}: block at {offset}+{length} lies outside the file"
        return f"shard {name}: block at {offset}+{length} overlaps the block before it (ending at {int(before[i])})"

    @property
    def made(self) -> int:
        """Block records made so far (what a start paid for: the blocks it read, not the manifest's)."""
        return sum(b is not None for b in self._made)

    def token_counts(self) -> list[int | None]:
        return self.tokens.tolist() if self.tokens is not None else [None] * len(self)

    def __len__(self) -> int:
        return len(self._made)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        found = self._made[index]
        if found is None:
            tokens = int(self.tokens[index]) if self.tokens is not None else None
            checksum = self.checksums[index]
            hexed = checksum if isinstance(checksum, str) else f"{int(checksum):016x}"
            found = self._made[index] = Block(int(self.offsets[index]), int(self.lengths[index]), int(self.rows[index]),
                                              hexed, tokens)
        return found

    def __iter__(self) -> Iterator[Block]:
        return (self[i] for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SequenceABC) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"BlockList({len(self)} blocks, {self.made} made)"

    def __getstate__(self) -> tuple:
        return self.offsets, self.lengths, self.rows, self.checksums, self.tokens

    def __setstate__(self, state: tuple) -> None:
        self.offsets, self.lengths, self.rows, self.checksums, self.tokens = state
        self._made = [None] * len(self.checksums)


TABLE_COLUMNS = ("length", "rows", "checksum", "tokens")
"""The block table's columns, in order: little-endian uint32, uint32, uint64 (the xxh3-64's value)
and uint32; `tokens` only when every block has its count. The blocks are contiguous from offset 0
(pack writes them so), so their offsets are the lengths' running sum; a block decodes to at most
BLOCK_DECODED_LIMIT bytes, so 32 bits hold its length, rows and tokens."""
_TABLE_TYPES = ("<u4", "<u4", "<u8", "<u4")


def block_table(blocks: Sequence[Block]) -> dict:
    """A shard's blocks as the manifest stores them (format version 2): the columns one after another
    (`TABLE_COLUMNS`; the checksum is the xxh3-64's value), in one base64 string. JSON lists cost
    the manifest's parse and checksum a value per block and column; this costs C passes over ~27
    characters a block. ValueError for blocks a table cannot hold: not contiguous from 0, or a value
    that does not fit its column."""
    ends = np.cumsum([0] + [b.length for b in blocks]).tolist()
    if [b.offset for b in blocks] != ends[:-1]:
        raise ValueError("the blocks are not contiguous from offset 0; a block table cannot hold them")
    columns = [[b.length for b in blocks], [b.rows for b in blocks], [int(b.checksum, 16) for b in blocks],
               [b.tokens for b in blocks]]
    if not blocks or any(b.tokens is None for b in blocks):
        columns.pop()
    names = list(TABLE_COLUMNS[:len(columns)])
    try:
        table = b"".join(np.array(values, dtype=kind).tobytes() for values, kind in zip(columns, _TABLE_TYPES))
    except OverflowError:
        raise ValueError(f"a block's {', '.join(names)} does not fit the block table's columns") from None
    return {"columns": names, "count": len(blocks), "table": base64.b64encode(table).decode("ascii")}


def block_lists(blocks: dict) -> dict:
    """A manifest's `blocks` object as format version 1 wrote it (JSON lists), for tools and tests
    that read or edit the columns by hand; readers take either form."""
    if "table" not in blocks:
        return blocks
    listed = BlockList.from_json(blocks)
    lists = {"offset": listed.offsets.tolist(), "length": listed.lengths.tolist(), "rows": listed.rows.tolist(),
             "checksum": [b.checksum for b in listed]}
    if listed.tokens is not None:
        lists["tokens"] = listed.tokens.tolist()
    return lists


def block_rows(blocks: Sequence[Block]) -> np.ndarray:
    """Rows of each block (int64), without making a record of each."""
    if isinstance(blocks, BlockList):
        return blocks.rows
    return np.fromiter((b.rows for b in blocks), dtype=np.int64, count=len(blocks))


def block_tokens(blocks: Sequence[Block]) -> list[int | None]:
    """Token count of each block (None where the pack did not record it), without making records."""
    if isinstance(blocks, BlockList):
        return blocks.token_counts()
    return [b.tokens for b in blocks]


def shard_name(checksum: str) -> str:
    return f"{SHARD_PREFIX}{checksum}{SHARD_SUFFIX}"


DEFAULT_LEVELS = {"zstd": 6}
"""zstd 6 rather than Arrow's default 1: ~15% fewer bytes at rest for ~30% more pack CPU, and
decoding costs the same at any level (measured on benchmarks/peers' text corpus)."""


def _ipc_options(compression: str, level: int | None) -> pa.ipc.IpcWriteOptions:
    if compression == "none":
        return pa.ipc.IpcWriteOptions(compression=None)
    level = DEFAULT_LEVELS.get(compression) if level is None else level
    codec = pa.Codec(compression, compression_level=level) if level is not None else compression
    return pa.ipc.IpcWriteOptions(compression=codec, use_threads=True)


def _block_tokens(block: pa.RecordBatch, column: str | None) -> int | None:
    """Values of the list column `column` in one block (its token count), None without one."""
    if column is None:
        return None
    idx = block.schema.get_field_index(column)
    if idx < 0:
        return 0
    offsets = block.column(idx).offsets
    return int(offsets[-1].as_py() - offsets[0].as_py()) if len(offsets) else 0


def _write_ipc(blocks: Sequence[pa.RecordBatch], schema: pa.Schema, sink: HashingSink,
               options: pa.ipc.IpcWriteOptions, token_column: str | None = None) -> list[Block]:
    """Write an IPC file of `blocks` through `sink`; return where each landed."""
    written = []
    with pa.ipc.new_file(pa.PythonFile(sink, mode="w"), schema, options=options) as writer:
        for block in blocks:
            start = sink.position
            sink.take_block_digest()
            writer.write_batch(block)
            written.append(Block(start, sink.position - start, block.num_rows, sink.take_block_digest(),
                                 _block_tokens(block, token_column)))
    return written


class ShardWriter:
    """Writes one shard a block (record batch) at a time, under its content name once closed.

    Each block is compressed as it arrives, so the packer's parent compresses while its
    workers parse instead of in one burst per shard; the decoded form is serialised in the
    same pass, only to measure its size and xxh3-128. No block is kept once written (in the
    packer they pin its scratch files): a shard whose compression does not pay is rewritten
    uncompressed from its own compressed file.
    With `token_column`, each block also records its token count (readers then locate a token
    without decoding the blocks before it).
    """

    def __init__(self, directory: str | Path, schema: pa.Schema, compression: str = "zstd",
                 level: int | None = None, token_column: str | None = None) -> None:
        if compression not in COMPRESSIONS:
            raise ValueError(f"unknown compression {compression!r}; expected one of {COMPRESSIONS}")
        self.directory = Path(directory)
        self.schema = schema
        self.compression = compression
        self.level = level
        self.token_column = token_column
        self.tmp = self.directory / f".tmp-{os.getpid()}-{id(self):x}{SHARD_SUFFIX}"
        self._blocks: list[Block] = []
        self._decoded = HashingSink()
        self._decoded_writer = pa.ipc.new_file(pa.PythonFile(self._decoded, mode="w"), schema,
                                               options=_ipc_options("none", None))
        self._file = open(self.tmp, "wb", buffering=CHUNK)
        self._sink = HashingSink(self._file)
        self._writer = pa.ipc.new_file(pa.PythonFile(self._sink, mode="w"), schema,
                                       options=_ipc_options(compression, level))

    def write(self, block: pa.RecordBatch) -> None:
        """Append one record batch as the shard's next block."""
        start = self._sink.position
        self._sink.take_block_digest()
        self._writer.write_batch(block)
        self._blocks.append(Block(start, self._sink.position - start, block.num_rows,
                                  self._sink.take_block_digest(), _block_tokens(block, self.token_column)))
        self._decoded_writer.write_batch(block)

    def close(self, tokens: int = 0) -> ShardInfo:
        """Finish, fsync and rename to `shard-<checksum>.arrow`; atomic.

        Compression is dropped for this shard when it saves less than MIN_SAVING (images,
        already-compressed bytes): decoding costs CPU on every read for nothing.
        """
        try:
            self._writer.close()
            self._decoded_writer.close()
            chosen, sink, blocks = self.compression, self._sink, self._blocks
            if self.compression != "none" and sink.position > (1 - MIN_SAVING) * self._decoded.position:
                chosen = "none"
                sink, blocks = self._rewrite_uncompressed()
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            checksum = sink.hexdigest()
            name = shard_name(checksum)
            os.replace(self.tmp, self.directory / name)
        except BaseException:
            self.abort()
            raise
        return ShardInfo(
            name=name, samples=sum(b.rows for b in blocks), bytes=sink.position,
            decoded_bytes=self._decoded.position, checksum=checksum, decoded_checksum=self._decoded.hexdigest(),
            compression=chosen, tokens=tokens, blocks=blocks,
        )

    def _rewrite_uncompressed(self) -> tuple[HashingSink, list[Block]]:
        """The shard again, uncompressed, read back from its compressed file one batch at a time
        (byte-identical to writing the original batches: it is what `decode_shard` does)."""
        self._file.close()
        packed = self.tmp.with_name(self.tmp.name + ".z")
        os.replace(self.tmp, packed)
        try:
            self._file = open(self.tmp, "wb", buffering=CHUNK)
            sink = HashingSink(self._file)
            with pa.memory_map(str(packed)) as source:
                reader = pa.ipc.open_file(source)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
                blocks = _write_ipc(batches, self.schema, sink, _ipc_options("none", None), self.token_column)
        finally:
            packed.unlink(missing_ok=True)
        return sink, blocks

    def abort(self) -> None:
        """Drop the unfinished shard (its temporary file included)."""
        if not self._file.closed:
            self._file.close()
        self.tmp.unlink(missing_ok=True)


def decode_shard(src: str | Path, dst: str | Path, info: ShardInfo) -> tuple[int, str]:
    """Write the decoded (uncompressed) form of an at-rest shard to `dst`; return (size, xxh3-128).

    The result is byte-identical to the decoded form measured at pack time, so the manifest's
    `decoded_checksum` verifies it. The blocks are the manifest's byte ranges (`info`), not the
    file's footer, each bounded before it is decoded and the output by `info.decoded_bytes`: a
    hostile shard cannot make admission cost more memory than one block or more disk than the
    manifest declared. One block is held at a time.
    """
    with pa.memory_map(str(src)) as source:
        mapped = source.read_buffer()
        if mapped.size != info.bytes:
            raise ShardCorruptError(f"shard {info.name}: {mapped.size} bytes, not {info.bytes} ({src})")
        if not info.blocks:
            raise ShardCorruptError(f"shard {info.name}: no blocks")
        first = info.blocks[0]
        schema = block_schema(mapped.slice(first.offset, first.length), info.name, first)
        with open(dst, "wb", buffering=CHUNK) as f:
            sink = HashingSink(f)
            sink.limit = info.decoded_bytes
            sink.limit_error = ShardCorruptError(f"shard {info.name}: decodes to more than the "
                                                 f"{info.decoded_bytes} bytes the manifest declares")
            _write_ipc(_bounded_batches(mapped, schema, info), schema, sink, _ipc_options("none", None))
    return sink.position, sink.hexdigest()


def _bounded_batches(mapped: pa.Buffer, schema: pa.Schema, info: ShardInfo) -> Iterator[pa.RecordBatch]:
    for i, block in enumerate(info.blocks):
        yield decode_block(mapped.slice(block.offset, block.length), schema, info.name, i, block,
                           max_decoded=info.decoded_bytes)


def block_error(name: str, index: int, block: Block, why: str = "fails its checksum") -> ShardCorruptError:
    return ShardCorruptError(f"shard {name}: block {index} (bytes {block.offset}+{block.length}) {why}")


def check_block(data: bytes | memoryview | pa.Buffer, name: str, index: int, block: Block) -> None:
    """Raise ShardCorruptError (naming shard and block) unless `data` are the block's bytes."""
    if len(data) != block.length or xxh3_hex(data) != block.checksum:
        raise block_error(name, index, block)


def block_stream(data: pa.Buffer, index: int) -> pa.Buffer:
    """One block's bytes as an IPC message stream; block 0 also holds the file's magic (8 bytes, left
    out here) and the schema."""
    return data.slice(8) if index == 0 else data


def block_messages(data: pa.Buffer, index: int) -> pa.ipc.MessageReader:
    """The IPC messages of one block's bytes."""
    return pa.ipc.MessageReader.open_stream(block_stream(data, index))


BLOCK_DECODED_LIMIT = 1 << 30
"""Decoded bytes one block may take at most (pack cuts 1 MB blocks; a hostile manifest may declare
any decoded size, and Arrow allocates a compressed buffer's promised size before decompressing)."""


def decode_block(data: pa.Buffer, schema: pa.Schema, name: str, index: int, block: Block,
                 max_decoded: int | None = None) -> pa.RecordBatch:
    """One block decoded from its (already verified) bytes; zero-copy when uncompressed.

    Bytes that verify may still be hostile (a hostile manifest lists their checksum), so before
    Arrow allocates anything the message's claims are bounded (`_check_claims`: rows, buffer
    ranges, decompressed size within `max_decoded`), and after decoding the batch is validated
    in full (offsets, lengths, UTF-8: ~30 us a MB of text), so no view ever reads outside its
    buffers. Any failure is ShardCorruptError naming shard and block, not Arrow's bare error.
    """
    try:
        stream = block_stream(data, index)
        source = pa.BufferReader(stream)  # its position marks where each message's stored bytes begin
        messages = pa.ipc.MessageReader.open_stream(source)
        while True:
            start = source.tell()
            try:
                message = messages.read_next_message()
            except StopIteration:
                break
            if message.type == "record batch":
                limit = BLOCK_DECODED_LIMIT if max_decoded is None else min(max_decoded, BLOCK_DECODED_LIMIT)
                claims = _check_claims(message, name, index, block, limit)
                if claims.compressed:
                    batch = _zstd_batch(message, claims, schema) if claims.codec == ZSTD else None
                    if batch is None:
                        batch = _decompressed(stream.slice(start, source.tell() - start), schema)
                else:
                    batch = pa.ipc.read_record_batch(message, schema)
                batch.validate(full=True)
                return batch
    except (pa.ArrowException, OSError, ValueError, zstandard.ZstdError) as e:
        if isinstance(e, ShardCorruptError):
            raise
        raise block_error(name, index, block, f"does not decode ({e})") from None
    raise block_error(name, index, block, "holds no record batch")


DECODE_POOL: pa.MemoryPool = pa.system_memory_pool()
"""Where decompressed blocks live: the C allocator, not Arrow's default (mimalloc), which kept ~40 MB
more resident than the ~190 MB of blocks it held over an epoch, decoded on one thread or on Arrow's
pool (docs/memory.md). `DECODE_POOL.bytes_allocated()` is the decoded bytes alive."""

_SINGLE_THREADED = pa.ipc.IpcReadOptions(use_threads=False)


def _decompressed(message: pa.Buffer, schema: pa.Schema) -> pa.RecordBatch:
    """A compressed record batch (its message's bytes, as stored) decoded into DECODE_POOL on this
    thread (`read_record_batch` takes neither a pool nor options: a stream of the schema and this one
    message does; the schema's bytes are made once per schema)."""
    stream = pa.py_buffer(_schema_bytes(schema) + message.to_pybytes())
    return pa.ipc.open_stream(stream, options=_SINGLE_THREADED, memory_pool=DECODE_POOL).read_next_batch()


_ZSTD = threading.local()


def _zstd() -> zstandard.ZstdDecompressor:
    """This thread's zstd context, made once (a context may not be shared between threads)."""
    context = getattr(_ZSTD, "context", None)
    if context is None:
        context = _ZSTD.context = zstandard.ZstdDecompressor()
    return context


def _zstd_batch(message: pa.ipc.Message, claims: BatchClaims, schema: pa.Schema) -> pa.RecordBatch | None:
    """A zstd record batch decoded by python-zstandard into DECODE_POOL, its arrays built over the
    decoded buffers; None for a schema it does not lay out (`_layout`: Arrow decodes that one).

    Arrow's reader spends ~1.7x as long on the same frames (~1.0 against ~1.7 GB/s on the peers'
    token corpus): it makes a zstd context per buffer, this reuses one per thread. The frames
    must decode to exactly the sizes their prefixes promise (the claims bounded those already);
    the batch is validated in full by the caller, as Arrow's is."""
    layout = _layout(schema)
    if layout is None or len(layout) != len(claims.node_lengths) \
            or sum(n for _, n in layout) != len(claims.buffers):
        return None
    body = message.body
    view = memoryview(body)
    context = _zstd()
    buffers: list[pa.Buffer | None] = []
    for offset, length in claims.buffers:
        if length == 0:
            buffers.append(None)
            continue
        promised = int.from_bytes(view[offset:offset + 8], "little", signed=True)
        if promised == -1:  # stored as is
            buffers.append(body.slice(offset + 8, length - 8))
            continue
        out = pa.allocate_buffer(promised, memory_pool=DECODE_POOL)
        target, filled = memoryview(out), 0
        with context.stream_reader(view[offset + 8:offset + length]) as reader:
            while filled < promised:
                got = reader.readinto(target[filled:])
                if not got:
                    break
                filled += got
            if filled != promised or reader.read(1):
                raise ValueError(f"a zstd buffer decodes to other than the {promised} bytes its prefix promises")
        buffers.append(out)
    nodes = iter(zip(claims.node_lengths, claims.null_counts))
    taken = iter(buffers)
    columns = [_array(field.type, nodes, taken) for field in schema]
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def _array(kind: pa.DataType, nodes: Iterator[tuple[int, int]], buffers: Iterator[pa.Buffer | None]) -> pa.Array:
    """The next array of a batch's field nodes and buffers, depth first as IPC lays them out."""
    length, nulls = next(nodes)
    layout = _kind(kind)
    if layout == "null":  # no buffers in IPC
        return pa.nulls(length)
    own = [next(buffers) for _ in range(_BUFFERS[layout])]
    if own[0] is None and nulls:
        raise ValueError(f"a {kind} node of {nulls} nulls has no validity buffer")
    own[1:] = [b if b is not None else _EMPTY for b in own[1:]]
    children = [_array(child.type, nodes, buffers) for child in _children(kind)]
    return pa.Array.from_buffers(kind, length, own, nulls, children=children or None)


_EMPTY = pa.py_buffer(b"")
_BUFFERS = {"fixed": 2, "binary": 3, "list": 2, "struct": 1, "null": 0}
"""IPC buffers of each node by layout: validity first, then offsets and/or data."""


def _kind(kind: pa.DataType) -> str | None:
    if pat.is_null(kind):
        return "null"
    if pat.is_integer(kind) or pat.is_floating(kind) or pat.is_boolean(kind):
        return "fixed"
    if pat.is_string(kind) or pat.is_binary(kind) or pat.is_large_string(kind) or pat.is_large_binary(kind):
        return "binary"
    if pat.is_list(kind) or pat.is_large_list(kind):
        return "list"
    if pat.is_struct(kind):
        return "struct"
    return None


def _children(kind: pa.DataType) -> list[pa.Field]:
    if pat.is_list(kind) or pat.is_large_list(kind):
        return [kind.value_field]
    if pat.is_struct(kind):
        return [kind.field(i) for i in range(kind.num_fields)]
    return []


_LAYOUTS: dict[int, tuple[pa.Schema, list[tuple[str, int]] | None]] = {}


def _layout(schema: pa.Schema) -> list[tuple[str, int]] | None:
    """(layout, buffers) of each node of a schema, depth first; None when a type has no layout here
    (dictionaries, unions, views, fixed-size lists, temporal types: Arrow's reader takes those)."""
    found = _LAYOUTS.get(id(schema))
    if found is None or found[0] is not schema:
        nodes: list[tuple[str, int]] | None = []

        def walk(kind: pa.DataType) -> bool:
            layout = _kind(kind)
            if layout is None:
                return False
            nodes.append((layout, _BUFFERS[layout]))
            return all(walk(child.type) for child in _children(kind))

        if not all(walk(field.type) for field in schema):
            nodes = None
        if len(_LAYOUTS) >= 256:
            _LAYOUTS.clear()
        found = _LAYOUTS[id(schema)] = (schema, nodes)
    return found[1]


_SCHEMAS: dict[int, tuple[pa.Schema, bytes]] = {}


def _schema_bytes(schema: pa.Schema) -> bytes:
    """The schema's IPC message (each shard table holds its schema object: one entry per open shard)."""
    found = _SCHEMAS.get(id(schema))
    if found is None or found[0] is not schema:
        if len(_SCHEMAS) >= 256:
            _SCHEMAS.clear()
        found = _SCHEMAS[id(schema)] = (schema, schema.serialize().to_pybytes())
    return found[1]


def _check_claims(message: pa.ipc.Message, name: str, index: int, block: Block, max_decoded: int) -> BatchClaims:
    """Refuse a record batch whose rows or buffers its bytes cannot justify, before decoding it.

    Every row of any column but the null type costs at least a bit of some buffer, so more rows
    than 8 x the decoded bytes (+64) is a lie (a 2^31-row null column in a 394-byte shard); the
    decoded bytes are what the compressed buffers' prefixes promise, within `max_decoded`."""
    try:
        claims = batch_claims(message.metadata.to_pybytes())
        decoded = decoded_size(claims, memoryview(message.body))
    except MalformedMessage as e:
        raise block_error(name, index, block, f"has a malformed message ({e})") from None
    if claims.rows != block.rows:
        raise block_error(name, index, block, f"holds {claims.rows} rows, not {block.rows}")
    if decoded > max_decoded:
        raise block_error(name, index, block, f"decodes to {decoded} bytes, more than the {max_decoded} allowed")
    limit = 8 * decoded + 64
    if claims.rows > limit or any(not 0 <= n <= limit for n in claims.node_lengths):
        raise block_error(name, index, block, f"claims {max([claims.rows, *claims.node_lengths])} rows, more "
                                              f"than its {decoded} bytes of buffers can hold")
    return claims


def block_schema(data: pa.Buffer, name: str, block: Block) -> pa.Schema:
    """The shard's own schema, from the start of block 0 (which may be only a prefix of it)."""
    try:
        message = block_messages(data, 0).read_next_message()
        if message.type != "schema":
            raise ValueError(f"first message is a {message.type}")
        return pa.ipc.read_schema(message)
    except (pa.ArrowException, OSError, ValueError, StopIteration) as e:
        raise block_error(name, 0, block, f"holds no readable schema ({e})") from None


def read_block(data: bytes | memoryview | pa.Buffer, schema: pa.Schema, info: ShardInfo, index: int) -> pa.RecordBatch:
    """Decode one block fetched by a ranged read, after checking its xxh3."""
    block = info.blocks[index]
    check_block(data, info.name, index, block)
    return decode_block(pa.py_buffer(data), schema, info.name, index, block, max_decoded=info.decoded_bytes)


def scan_blocks(path: str | Path) -> list[Block]:
    """The blocks of any IPC file (as `_write_ipc` cuts them), found by walking its messages.

    For a file whose blocks the manifest does not list (a tier's decoded form): block 0 runs
    from byte 0 to the end of the first record batch message, each next one to the end of the
    next; each carries its rows and xxh3-64. Reads every byte (call it on verified files).
    """
    blocks = []
    with pa.memory_map(str(path)) as source:
        mapped = source.read_buffer()
        source.seek(8)
        start = 0
        schema = None
        for message in pa.ipc.MessageReader.open_stream(source):
            if message.type == "schema":
                schema = pa.ipc.read_schema(message)
            if message.type != "record batch" or schema is None:
                continue
            end = source.tell()
            rows = pa.ipc.read_record_batch(message, schema).num_rows
            blocks.append(Block(start, end - start, rows, xxh3_hex(mapped.slice(start, end - start))))
            start = end
    return blocks


def verify_shard(path: str | Path, info: ShardInfo, form: Form = Form.AT_REST) -> list[str]:
    """Every problem with a shard file, as sentences naming the shard and block; empty if sound."""
    path = Path(path)
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        return [f"shard {info.name}: missing ({path})"]
    except ShardCorruptError as e:
        return [f"shard {info.name}: {e}"]
    verifier = ShardVerifier(info, form)
    with open(fd, "rb") as f:
        while chunk := f.read(CHUNK):
            verifier.write(chunk)
    return verifier.problems()


class ShardVerifier:
    """Checks a shard's bytes as they stream past (a file read, a download from a source), so a
    remote shard is verified without being stored: its size, every block's xxh3-64 (at rest) and
    the whole file's xxh3-128. `write` is a file-like sink; `problems()` says what failed.
    `on_block(index, bytes)` sees each block that verified, whole, as it completes (one block held
    at a time: how `verify` checks a remote shard's counts without reading it twice)."""

    def __init__(self, info: ShardInfo, form: Form | str = Form.AT_REST,
                 on_block: Callable[[int, bytes], None] | None = None) -> None:
        self._on_block = on_block
        self._held = bytearray()
        self.info = info
        self.form = Form(form)
        self.size = 0
        self._whole = xxhash.xxh3_128()
        self._block = xxhash.xxh3_64()
        blocks = info.blocks if self.form is Form.AT_REST else []
        self._blocks = sorted(enumerate(blocks), key=lambda ib: ib[1].offset)
        self._next = 0  # the first block of _blocks not yet complete
        self._bad: list[int] = []

    def write(self, data: bytes | memoryview) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        self._whole.update(view)
        position = self.size
        while len(view) and self._next < len(self._blocks):
            index, block = self._blocks[self._next]
            if position < block.offset:  # bytes between blocks (the IPC header, the footer)
                skip = min(len(view), block.offset - position)
                view, position = view[skip:], position + skip
                continue
            take = min(len(view), block.offset + block.length - position)
            self._block.update(view[:take])
            if self._on_block is not None:
                self._held += view[:take]
            view, position = view[take:], position + take
            if position == block.offset + block.length:
                if self._block.hexdigest() != block.checksum:
                    self._bad.append(index)
                elif self._on_block is not None:
                    self._on_block(index, bytes(self._held))
                self._held.clear()
                self._block.reset()
                self._next += 1
        self.size += n
        return n

    def problems(self) -> list[str]:
        """What the bytes written so far get wrong, naming the shard and each failing block."""
        info = self.info
        expected_size, expected_sum = info.bytes_in(self.form), info.checksum_in(self.form)
        problems = []
        if self.size != expected_size:
            problems.append(f"shard {info.name}: size {self.size} != {expected_size} in the manifest")
        unfinished = [index for index, _ in self._blocks[self._next:]]  # cut off by a short file
        for i in sorted(self._bad + unfinished):
            block = info.blocks[i]
            problems.append(f"shard {info.name}: block {i} (bytes {block.offset}+{block.length}, "
                            f"{block.rows} rows) fails its checksum")
        if not problems and self._whole.hexdigest() != expected_sum:
            problems.append(f"shard {info.name}: whole-file checksum mismatch (outside any block)")
        return problems
