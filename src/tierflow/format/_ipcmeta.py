"""What a record batch message claims, read from its flatbuffer before Arrow allocates anything.

Arrow's IPC reader believes a message: a row count of 2^33, or a compressed buffer whose prefix
promises a gigabyte, is allocated (or read past the body) before any check runs. This reads the
few numbers that decide the cost (rows, field node lengths, buffer ranges, the uncompressed size
each compressed buffer promises) straight from the message, bounds-checked, so a block can be
refused in microseconds with no memory spent (see `tierflow.format.block_decoder.decode_block`).
Layout: Arrow's Message.fbs / Schema.fbs (Message.header = RecordBatch; RecordBatch.length,
nodes [FieldNode{length, null_count}], buffers [Buffer{offset, length}], compression
BodyCompression{codec: LZ4_FRAME 0 | ZSTD 1}).
"""

from __future__ import annotations

import struct
from typing import NamedTuple

_U8, _U16, _U32, _I32, _I64 = (
    struct.Struct("<B"),
    struct.Struct("<H"),
    struct.Struct("<I"),
    struct.Struct("<i"),
    struct.Struct("<q"),
)
_RECORD_BATCH = 3  # MessageHeader union tag


class MalformedMessage(ValueError):
    """The flatbuffer points outside itself or is not a record batch."""


class BatchClaims(NamedTuple):
    """A record batch message's claims: rows, field node lengths, buffer (offset, length) pairs
    within the body, the body length, and whether the buffers are compressed (and by which codec,
    `ZSTD` or `LZ4_FRAME`; None when not); each node's null count."""

    rows: int
    node_lengths: list[int]
    buffers: list[tuple[int, int]]
    body_length: int
    compressed: bool
    rows_at: int  # byte position of the row count in the metadata (tests forge it)
    null_counts: list[int] = []
    codec: int | None = None


LZ4_FRAME, ZSTD = 0, 1
"""BodyCompression.codec values."""


class _Table:
    """One flatbuffer table: fields by index, every read bounds-checked."""

    def __init__(self, data: bytes, pos: int) -> None:
        self.data, self.pos = data, pos
        vtable = pos - self._read(_I32, pos)
        self.vtable = vtable
        self.vsize = self._read(_U16, vtable)

    def _read(self, fmt: struct.Struct, at: int) -> int:
        if not 0 <= at <= len(self.data) - fmt.size:
            raise MalformedMessage(f"offset {at} outside the {len(self.data)}-byte metadata")
        return fmt.unpack_from(self.data, at)[0]

    def field(self, index: int) -> int | None:
        """Absolute position of field `index`, None when absent."""
        slot = 4 + 2 * index
        if slot + 2 > self.vsize:
            return None
        off = self._read(_U16, self.vtable + slot)
        return self.pos + off if off else None

    def scalar(self, index: int, fmt: struct.Struct, default: int = 0) -> int:
        at = self.field(index)
        return default if at is None else self._read(fmt, at)

    def table(self, index: int) -> _Table | None:
        at = self.field(index)
        return None if at is None else _Table(self.data, at + self._read(_U32, at))

    def structs(self, index: int, width: int) -> list[tuple[int, int]]:
        """A vector of 16-byte structs of two int64s (FieldNode, Buffer)."""
        at = self.field(index)
        if at is None:
            return []
        start = at + self._read(_U32, at)
        count = self._read(_U32, start)
        if count * width > len(self.data) - start - 4:
            raise MalformedMessage(f"a vector of {count} entries runs past the metadata")
        if width != 16:
            raise ValueError(f"structs of {width} bytes: only two int64s are read")
        values = struct.unpack_from(f"<{2 * count}q", self.data, start + 4)  # one call, not two per entry
        return list(zip(values[::2], values[1::2]))


def batch_claims(metadata: bytes) -> BatchClaims:
    """The claims of a record batch message's metadata (`pa.ipc.Message.metadata`)."""
    if len(metadata) < 8:
        raise MalformedMessage(f"{len(metadata)} bytes of metadata")
    message = _Table(metadata, _U32.unpack_from(metadata, 0)[0])
    if message.scalar(1, struct.Struct("<B")) != _RECORD_BATCH:
        raise MalformedMessage("not a record batch message")
    body_length = message.scalar(3, _I64)
    batch = message.table(2)
    if batch is None:
        raise MalformedMessage("a record batch message without its header")
    rows_at = batch.field(0)
    nodes = batch.structs(1, 16)
    compression = batch.table(3)
    return BatchClaims(
        rows=batch.scalar(0, _I64),
        node_lengths=[n for n, _ in nodes],
        buffers=batch.structs(2, 16),
        body_length=body_length,
        compressed=compression is not None,
        rows_at=rows_at if rows_at is not None else -1,
        null_counts=[k for _, k in nodes],
        codec=None if compression is None else compression.scalar(0, _U8, LZ4_FRAME),
    )


def decoded_size(claims: BatchClaims, body: bytes | memoryview) -> int:
    """Bytes the body's buffers take once decoded: each compressed buffer's 8-byte prefix is its
    uncompressed length (-1: stored as is); every range is checked to lie inside the body."""
    total = 0
    for offset, length in claims.buffers:
        if offset < 0 or length < 0 or offset + length > len(body):
            raise MalformedMessage(f"buffer {offset}+{length} outside the {len(body)}-byte body")
        if not claims.compressed or length == 0:
            total += length
            continue
        if length < 8:
            raise MalformedMessage(f"compressed buffer of {length} bytes has no length prefix")
        promised = _I64.unpack_from(body, offset)[0]
        total += length - 8 if promised == -1 else promised
        if promised < -1:
            raise MalformedMessage(f"compressed buffer promises {promised} bytes")
    return total
