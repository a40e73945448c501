"""Writing shard files: the at-rest form a block at a time (`ShardWriter`, under its content name
once sealed) and the decoded form from an at-rest file (`decode_shard`), both cut into blocks the
same way (`scan_blocks` finds them again in any such file)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import pyarrow as pa

from tierflow.errors import ShardCorruptError
from tierflow.format._checksum import CHUNK, HashingSink, xxh3_hex
from tierflow.format.block_decoder import block_schema, decode_block
from tierflow.format.shard import COMPRESSIONS, SHARD_SUFFIX, Block, ShardInfo, shard_name

#: at-rest compression is kept only when it saves at least this fraction of the decoded size
MIN_SAVING = 0.15

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


def _write_ipc(
    blocks: Iterable[pa.RecordBatch],
    schema: pa.Schema,
    sink: HashingSink,
    options: pa.ipc.IpcWriteOptions,
    token_column: str | None = None,
) -> list[Block]:
    """Write an IPC file of `blocks` through `sink`; return where each landed."""
    written = []
    with pa.ipc.new_file(pa.PythonFile(sink, mode="w"), schema, options=options) as writer:
        for block in blocks:
            start = sink.position
            sink.take_block_digest()
            writer.write_batch(block)
            written.append(
                Block(
                    start,
                    sink.position - start,
                    block.num_rows,
                    sink.take_block_digest(),
                    _block_tokens(block, token_column),
                )
            )
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

    def __init__(
        self,
        directory: str | Path,
        schema: pa.Schema,
        compression: str = "zstd",
        level: int | None = None,
        token_column: str | None = None,
    ) -> None:
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
        self._decoded_writer = pa.ipc.new_file(
            pa.PythonFile(self._decoded, mode="w"), schema, options=_ipc_options("none", None)
        )
        self._file = open(self.tmp, "wb", buffering=CHUNK)
        self._sink = HashingSink(self._file)
        self._writer = pa.ipc.new_file(
            pa.PythonFile(self._sink, mode="w"), schema, options=_ipc_options(compression, level)
        )

    def write(self, block: pa.RecordBatch) -> None:
        """Append one record batch as the shard's next block."""
        start = self._sink.position
        self._sink.take_block_digest()
        self._writer.write_batch(block)
        self._blocks.append(
            Block(
                start,
                self._sink.position - start,
                block.num_rows,
                self._sink.take_block_digest(),
                _block_tokens(block, self.token_column),
            )
        )
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
            name=name,
            samples=sum(b.rows for b in blocks),
            bytes=sink.position,
            decoded_bytes=self._decoded.position,
            checksum=checksum,
            decoded_checksum=self._decoded.hexdigest(),
            compression=chosen,
            tokens=tokens,
            blocks=blocks,
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
            sink.limit_error = ShardCorruptError(
                f"shard {info.name}: decodes to more than the {info.decoded_bytes} bytes the manifest declares"
            )
            _write_ipc(_bounded_batches(mapped, schema, info), schema, sink, _ipc_options("none", None))
    return sink.position, sink.hexdigest()


def _bounded_batches(mapped: pa.Buffer, schema: pa.Schema, info: ShardInfo) -> Iterator[pa.RecordBatch]:
    for i, block in enumerate(info.blocks):
        yield decode_block(
            mapped.slice(block.offset, block.length), schema, info.name, i, block, max_decoded=info.decoded_bytes
        )


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
