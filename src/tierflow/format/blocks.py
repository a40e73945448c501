"""A shard file's blocks and where their bytes come from: a memory map or positioned reads.

A block is one Arrow record batch of a shard file, with its byte range and xxh3-64 (from the
manifest for the at-rest form, from the tier's block list for the decoded form). A source hands
out one block's bytes, checked before use, so a row never needs the whole file
(docs/format.md, "Reading and verification").
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any
from collections.abc import Sequence

import pyarrow as pa

from tierflow.format._regular import fd_path, open_shard_file
from tierflow.errors import ShardCorruptError
from tierflow.format.shard import Block, BlockList, Form, ShardInfo
from tierflow.format.verify import check_block


class BlockBytes:
    """Where the bytes of one shard file's blocks come from (a mapped file, a file, an object store's ranged reads).

    `blocks` are the file's blocks (the manifest's for the at-rest form, the tier's block list
    for the decoded form); `verified` means every byte was checked already (a whole buffer
    verified on download), so blocks need no second check; `compressed` bytes decode into memory.
    """

    def __init__(
        self, blocks: Sequence[Block], compressed: bool, verified: bool = False, keepalive: Any = None
    ) -> None:
        self.blocks = blocks if isinstance(blocks, BlockList) else list(blocks)  # records made as blocks are read
        self.compressed = compressed
        self.verified = verified
        self.keepalive = keepalive  # a tier pin: alive as long as decoded blocks may point into the file
        self.max_decoded: int | None = None
        """Decoded bytes a block may take (the shard's decoded size, when known): a hostile block
        promising more is refused before it is decompressed."""
        self.loaded: Sequence[object | None] | None = None
        """Its reader's decoded blocks (None where not loaded, `LazyShardTable`'s slots): a source that
        fetches blocks ahead of use fetches none of these again."""

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

    def __init__(
        self,
        path: str | Path,
        blocks: Sequence[Block],
        name: str,
        expected_size: int,
        compressed: bool = False,
        keepalive: Any = None,
    ) -> None:
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

    def __init__(
        self, path: str | Path, blocks: Sequence[Block], compressed: bool = True, keepalive: Any = None
    ) -> None:
        super().__init__(blocks, compressed, keepalive=keepalive)
        self.path = Path(path)

    def read(self, index: int, length: int | None = None) -> pa.Buffer:
        block = self.blocks[index]
        fd = open_shard_file(self.path)
        try:
            return pa.py_buffer(
                os.pread(fd, block.length if length is None else min(length, block.length), block.offset)
            )
        finally:
            os.close(fd)


def open_blocks(
    path: str | Path,
    info: ShardInfo,
    form: Form = Form.AT_REST,
    blocks: Sequence[Block] | None = None,
    keepalive: Any = None,
) -> BlockBytes:
    """The block source of a local shard file: at rest (the manifest's blocks) or decoded (`blocks`,
    the tier's list). Uncompressed files are memory-mapped; compressed ones read block by block."""
    source: BlockBytes
    if form == Form.AT_REST:
        if info.compression == "none":
            source = MappedBlocks(path, info.blocks, info.name, info.bytes, keepalive=keepalive)
        else:
            source = FileBlocks(path, info.blocks, keepalive=keepalive)
    elif blocks is None:
        raise ValueError(f"shard {info.name}: a decoded file needs its block list")
    else:
        source = MappedBlocks(path, blocks, info.name, info.decoded_bytes, keepalive=keepalive)
    source.max_decoded = info.decoded_bytes
    return source
