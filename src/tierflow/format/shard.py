"""The shard: one Arrow IPC file, compressed per buffer at rest, content-addressed.

A shard exists in two forms with the same record batches: *at rest* (zstd/lz4 buffer
compression, what L4-L2 hold) and *decoded* (uncompressed, what a tier memory-maps for
zero-copy numpy views). Both forms' sizes and xxh3-128 hashes are in the manifest, and
every record batch (a *block*) of the at-rest file has its byte range and xxh3-64, so a
ranged read of one block verifies without reading the shard. See docs/format.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Sequence

import pyarrow as pa

from tierflow.format.checksum import CHUNK, HashingSink, file_xxh3_128, xxh3_hex
from tierflow.format.regular import open_regular
from tierflow.errors import ShardCorruptError

SHARD_PREFIX = "shard-"
SHARD_SUFFIX = ".arrow"
COMPRESSIONS = ("zstd", "lz4", "none")
#: at-rest compression is kept only when it saves at least this fraction of the decoded size
MIN_SAVING = 0.15


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
    blocks: list[Block] = field(default_factory=list)

    @property
    def key(self) -> str:
        """The entry key every tier uses for this shard: its at-rest content hash."""
        return self.checksum

    def to_json(self) -> dict:
        blocks = {
            "offset": [b.offset for b in self.blocks],
            "length": [b.length for b in self.blocks],
            "rows": [b.rows for b in self.blocks],
            "checksum": [b.checksum for b in self.blocks],
        }
        if self.blocks and all(b.tokens is not None for b in self.blocks):
            blocks["tokens"] = [b.tokens for b in self.blocks]
        return {
            "name": self.name,
            "samples": self.samples,
            "bytes": self.bytes,
            "decoded_bytes": self.decoded_bytes,
            "checksum": self.checksum,
            "decoded_checksum": self.decoded_checksum,
            "compression": self.compression,
            "tokens": self.tokens,
            "blocks": blocks,
        }

    @classmethod
    def from_json(cls, d: dict) -> "ShardInfo":
        b = d["blocks"]
        tokens = b.get("tokens")
        columns = [b["offset"], b["length"], b["rows"], b["checksum"]]
        columns.append(tokens if tokens is not None else [None] * len(columns[0]))
        for name, column, allowed in zip(("offset", "length", "rows", "checksum", "tokens"), columns,
                                         ({int}, {int}, {int}, {str}, {int} if tokens is not None else {type(None)})):
            if not isinstance(column, list) or not set(map(type, column)) <= allowed:  # untrusted JSON
                raise TypeError(f"blocks.{name} is not a list of {'/'.join(t.__name__ for t in allowed)}")
        blocks = list(map(Block._make, zip(*columns, strict=True)))
        return cls(
            name=str(d["name"]), samples=int(d["samples"]), bytes=int(d["bytes"]),
            decoded_bytes=int(d["decoded_bytes"]), checksum=str(d["checksum"]),
            decoded_checksum=str(d["decoded_checksum"]), compression=str(d["compression"]),
            tokens=int(d.get("tokens", 0)), blocks=blocks,
        )


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


def _block_tokens(batch: pa.RecordBatch, column: str | None) -> int | None:
    """Values of the list column `column` in one record batch (its token count), None without one."""
    if column is None:
        return None
    idx = batch.schema.get_field_index(column)
    if idx < 0:
        return 0
    offsets = batch.column(idx).offsets
    return int(offsets[-1].as_py() - offsets[0].as_py()) if len(offsets) else 0


def _write_ipc(batches: Sequence[pa.RecordBatch], schema: pa.Schema, sink: HashingSink,
               options: pa.ipc.IpcWriteOptions, token_column: str | None = None) -> list[Block]:
    """Write an IPC file through `sink`; return each record batch's block."""
    blocks = []
    with pa.ipc.new_file(pa.PythonFile(sink, mode="w"), schema, options=options) as writer:
        for batch in batches:
            start = sink.position
            sink.take_block_digest()
            writer.write_batch(batch)
            blocks.append(Block(start, sink.position - start, batch.num_rows, sink.take_block_digest(),
                                _block_tokens(batch, token_column)))
    return blocks


class ShardWriter:
    """Writes one shard a record batch at a time, under its content name once closed.

    Each batch is compressed as it arrives, so the packer's parent compresses while its
    workers parse instead of in one burst per shard; the decoded form is serialised in the
    same pass, only to measure its size and xxh3-128. No batch is kept once written (in the
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

    def write(self, batch: pa.RecordBatch) -> None:
        """Append one record batch as the shard's next block."""
        start = self._sink.position
        self._sink.take_block_digest()
        self._writer.write_batch(batch)
        self._blocks.append(Block(start, self._sink.position - start, batch.num_rows,
                                  self._sink.take_block_digest(), _block_tokens(batch, self.token_column)))
        self._decoded_writer.write_batch(batch)

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


def decode_shard(src: str | Path, dst: str | Path) -> tuple[int, str]:
    """Write the decoded (uncompressed) form of an at-rest shard to `dst`; return (size, xxh3-128).

    The result is byte-identical to the decoded form measured at pack time, so the manifest's
    `decoded_checksum` verifies it.
    """
    with pa.memory_map(str(src)) as source:
        reader = pa.ipc.open_file(source)
        batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
        with open(dst, "wb", buffering=CHUNK) as f:
            sink = HashingSink(f)
            _write_ipc(batches, reader.schema, sink, _ipc_options("none", None))
    return sink.position, sink.hexdigest()


def block_error(name: str, index: int, block: Block, why: str = "fails its checksum") -> ShardCorruptError:
    return ShardCorruptError(f"shard {name}: block {index} (bytes {block.offset}+{block.length}) {why}")


def check_block(data: bytes | memoryview | pa.Buffer, name: str, index: int, block: Block) -> None:
    """Raise ShardCorruptError (naming shard and block) unless `data` are the block's bytes."""
    if len(data) != block.length or xxh3_hex(data) != block.checksum:
        raise block_error(name, index, block)


def block_messages(data: pa.Buffer, index: int) -> pa.ipc.MessageReader:
    """The IPC messages of one block's bytes; block 0 also holds the file's magic (8 bytes) and schema."""
    return pa.ipc.MessageReader.open_stream(data.slice(8) if index == 0 else data)


def decode_block(data: pa.Buffer, schema: pa.Schema, name: str, index: int, block: Block) -> pa.RecordBatch:
    """The record batch of one block's (already verified) bytes; zero-copy when uncompressed.
    Bytes that verify but do not decode (a hostile manifest lists their checksum) are
    ShardCorruptError naming shard and block, not Arrow's bare error."""
    try:
        for message in block_messages(data, index):
            if message.type == "record batch":
                return pa.ipc.read_record_batch(message, schema)
    except (pa.ArrowException, OSError, ValueError) as e:
        raise block_error(name, index, block, f"does not decode ({e})") from None
    raise block_error(name, index, block, "holds no record batch")


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
    return decode_block(pa.py_buffer(data), schema, info.name, index, block)


def scan_blocks(path: str | Path) -> list[Block]:
    """The blocks of any IPC file (as `_write_ipc` cuts them), found by walking its messages.

    For a file whose blocks the manifest does not list (a tier's decoded form): block 0 runs
    from byte 0 to the end of the first record batch, each next one to the end of the next
    batch; each carries its rows and xxh3-64. Reads every byte (call it on verified files).
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


def read_schema(path: str | Path) -> pa.Schema:
    with pa.memory_map(str(path)) as source:
        return pa.ipc.open_file(source).schema


def verify_shard(path: str | Path, info: ShardInfo, form: str = "at_rest") -> list[str]:
    """Every problem with a shard file, as sentences naming the shard and block; empty if sound."""
    path = Path(path)
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        return [f"shard {info.name}: missing ({path})"]
    except ShardCorruptError as e:
        return [f"shard {info.name}: {e}"]
    expected_size = info.bytes if form == "at_rest" else info.decoded_bytes
    expected_sum = info.checksum if form == "at_rest" else info.decoded_checksum
    problems = []
    with open(fd, "rb") as f:
        size = os.fstat(fd).st_size
        if size != expected_size:
            problems.append(f"shard {info.name}: size {size} != {expected_size} in the manifest")
        for i, block in enumerate(info.blocks if form == "at_rest" else ()):
            f.seek(block.offset)
            if xxh3_hex(f.read(block.length)) != block.checksum:
                problems.append(f"shard {info.name}: block {i} (bytes {block.offset}+{block.length}, "
                                f"{block.rows} rows) fails its checksum")
    if not problems and file_xxh3_128(path) != expected_sum:
        problems.append(f"shard {info.name}: whole-file checksum mismatch (outside any block)")
    return problems
