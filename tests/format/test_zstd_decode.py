"""zstd blocks are decoded by python-zstandard (one context per thread) into the decode pool, not by
Arrow's reader; the batch is the one Arrow's reader makes, and a frame that breaks its size promise
is refused naming shard and block."""

from __future__ import annotations

import struct

import numpy as np
import pyarrow as pa
import pytest

import tierflow.format.block_decoder as block_decoder
from tierflow.errors import ShardCorruptError
from tierflow.format._ipcmeta import batch_claims
from tierflow.format.block_decoder import block_schema, decode_block
from tierflow.format.blocks import open_blocks
from tierflow.format.shard import Block, ShardInfo
from tierflow.format.shard_writer import ShardWriter, decode_shard


def _columns(n: int, rng: np.random.Generator) -> dict[str, pa.Array]:
    lists = [None if i % 7 == 3 else rng.integers(0, 300, int(rng.integers(0, 40))).astype(np.uint16) for i in range(n)]
    return {
        "tokens": pa.array(lists, pa.list_(pa.uint16())),
        "text": pa.array([None if i % 5 == 1 else f"doc {i} é" * (i % 4) for i in range(n)]),
        "big": pa.array([f"x{i}" * (i % 3) for i in range(n)], pa.large_string()),
        "raw": pa.array([bytes([i % 256]) * (i % 6) for i in range(n)], pa.binary()),
        "i": pa.array([None if i % 9 == 0 else i for i in range(n)], pa.int64()),
        "x": pa.array(rng.random(n).astype(np.float32)),
        "flag": pa.array([i % 3 == 0 for i in range(n)]),
        "n": pa.nulls(n),
        "tags": pa.array([[f"t{i}"] * (i % 3) for i in range(n)], pa.large_list(pa.string())),
        "pair": pa.array([{"a": i, "b": None if i % 2 else f"b{i}"} for i in range(n)]),
    }


def _shard(tmp_path, columns) -> tuple[ShardInfo, pa.Schema, list[bytes]]:
    rng = np.random.default_rng(3)
    first = columns(41, rng)
    schema = pa.schema([(k, v.type) for k, v in first.items()])
    writer = ShardWriter(tmp_path, schema, compression="zstd")
    for n in (41, 0, 77, 5):
        writer.write(pa.record_batch(list(columns(n, rng).values()), schema=schema))
    info = writer.close()
    assert info.compression == "zstd"
    source = open_blocks(tmp_path / info.name, info)
    return info, schema, [source.read(i).to_pybytes() for i in range(len(info.blocks))]


def _arrows(tmp_path, info) -> list[pa.RecordBatch]:
    with pa.memory_map(str(tmp_path / info.name)) as f:
        reader = pa.ipc.open_file(f)
        return [reader.get_batch(i) for i in range(reader.num_record_batches)]


def test_zstd_blocks_decode_without_arrows_reader_to_the_batches_arrow_reads(tmp_path, monkeypatch):
    info, schema, blocks = _shard(tmp_path, _columns)

    def refuse(*_):
        raise AssertionError("Arrow's reader decoded a zstd block this schema lays out")

    monkeypatch.setattr(block_decoder, "_decompressed", refuse)
    for i, (data, expected) in enumerate(zip(blocks, _arrows(tmp_path, info))):
        got = decode_block(pa.py_buffer(data), schema, info.name, i, info.blocks[i], info.decoded_bytes)
        assert got.equals(expected) and got.schema.equals(schema)
        assert got.to_pylist() == expected.to_pylist()


def test_a_schema_without_a_layout_here_decodes_through_arrows_reader(tmp_path, monkeypatch):
    def columns(n, rng):
        return {
            "when": pa.array(np.arange(n).astype("datetime64[s]")),
            "key": pa.array([bytes([i % 256]) * 4 for i in range(n)], pa.binary(4)),
        }

    info, schema, blocks = _shard(tmp_path, columns)
    called = []
    arrow = block_decoder._decompressed
    monkeypatch.setattr(block_decoder, "_decompressed", lambda *a: called.append(1) or arrow(*a))
    for i, (data, expected) in enumerate(zip(blocks, _arrows(tmp_path, info))):
        got = decode_block(pa.py_buffer(data), schema, info.name, i, info.blocks[i], info.decoded_bytes)
        assert got.equals(expected)
    assert len(called) == len(blocks)


@pytest.mark.parametrize("change", [8, -8])
def test_a_zstd_buffer_that_decodes_to_other_than_its_promise_is_refused_naming_the_block(tmp_path, change):
    info, schema, blocks = _shard(tmp_path, _columns)
    index = 2
    data = bytearray(blocks[index])
    message = pa.ipc.MessageReader.open_stream(pa.py_buffer(bytes(data))).read_next_message()
    claims = batch_claims(message.metadata.to_pybytes())
    body = len(data) - claims.body_length
    offset, _ = max(claims.buffers, key=lambda b: b[1])  # the tokens' values: a compressed frame
    promised = struct.unpack_from("<q", data, body + offset)[0]
    assert promised > 8
    struct.pack_into("<q", data, body + offset, promised + change)
    block = Block(0, len(data), info.blocks[index].rows, "vouched-for")
    with pytest.raises(ShardCorruptError, match=f"shard {info.name}: block {index} .*does not decode"):
        decode_block(pa.py_buffer(bytes(data)), schema, info.name, index, block, info.decoded_bytes)


def test_the_schema_read_from_block_zero_lays_out_for_the_fast_path(tmp_path):
    info, schema, blocks = _shard(tmp_path, _columns)
    found = block_schema(pa.py_buffer(blocks[0]), info.name, info.blocks[0])
    assert block_decoder._layout(found) is not None


def test_the_decoded_form_written_from_these_batches_is_the_one_the_manifest_hashed(tmp_path):
    """A tier's decoded copy is written from decoded blocks and verified by the manifest's decoded
    xxh3-128: the batches must serialise byte for byte as Arrow's own do."""
    info, _, _ = _shard(tmp_path, _columns)
    size, digest = decode_shard(tmp_path / info.name, tmp_path / "decoded.arrow", info)
    assert (size, digest) == (info.decoded_bytes, info.decoded_checksum)
