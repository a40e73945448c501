"""Decoding one block's bytes into a record batch, safely: the IPC message's claims are bounded
before anything is allocated, zstd bodies are decoded by python-zstandard into `DECODE_POOL` (Arrow's
reader takes what that decoder does not lay out), and the batch is validated in full after."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.types as pat
import zstandard

from tierflow.errors import ShardCorruptError
from tierflow.format._ipcmeta import ZSTD, BatchClaims, MalformedMessage, batch_claims, decoded_size
from tierflow.format.shard import Block, ShardInfo
from tierflow.format.verify import block_error, check_block


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


def decode_block(
    data: pa.Buffer, schema: pa.Schema, name: str, index: int, block: Block, max_decoded: int | None = None
) -> pa.RecordBatch:
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
    if layout is None or len(layout) != len(claims.node_lengths) or sum(n for _, n in layout) != len(claims.buffers):
        return None
    body = message.body
    view = memoryview(body)
    context = _zstd()
    buffers: list[pa.Buffer | None] = []
    for offset, length in claims.buffers:
        if length == 0:
            buffers.append(None)
            continue
        promised = int.from_bytes(view[offset : offset + 8], "little", signed=True)
        if promised == -1:  # stored as is
            buffers.append(body.slice(offset + 8, length - 8))
            continue
        out = pa.allocate_buffer(promised, memory_pool=DECODE_POOL)
        target, filled = memoryview(out), 0
        with context.stream_reader(view[offset + 8 : offset + length]) as reader:
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
    if layout is None:
        raise ValueError(f"no buffer layout for {kind} (the schema's layout was checked first)")
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
        nodes: list[tuple[str, int]] = []

        def walk(kind: pa.DataType) -> bool:
            layout = _kind(kind)
            if layout is None:
                return False
            nodes.append((layout, _BUFFERS[layout]))
            return all(walk(child.type) for child in _children(kind))

        laid_out = nodes if all(walk(field.type) for field in schema) else None
        if len(_LAYOUTS) >= 256:
            _LAYOUTS.clear()
        found = _LAYOUTS[id(schema)] = (schema, laid_out)
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
        raise block_error(
            name,
            index,
            block,
            f"claims {max([claims.rows, *claims.node_lengths])} rows, more "
            f"than its {decoded} bytes of buffers can hold",
        )
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
