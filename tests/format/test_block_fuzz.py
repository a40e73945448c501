"""Structured fuzz of the block reader: a mutated block decodes to rows that are all readable, or is
a ShardCorruptError naming shard and block; in under a second, in bounded memory.

The attacker controls the manifest too, so the block's checksum is taken as vouched for and the
reader's remaining defences are exercised: `decode_block` (the message's claims bounded, then
full validation) and every getter and list view of the decoded block. Mutations target the
message's flatbuffer (its int64 fields: rows, node lengths, buffer offsets and lengths), the
body, and the block's length. Inputs that once escaped live in tests/format/corpus/block-*.json (block
bytes, the schema, the rows the manifest claims) and are replayed. Longer runs by hand:
TIERFLOW_FUZZ_EXAMPLES=20000 pytest tests/test_block_fuzz.py
"""

from __future__ import annotations

import base64
import json
import os
import struct
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tierflow.errors import ShardCorruptError
from tierflow.format.blocks import open_blocks
from tierflow.format.block_decoder import decode_block
from tierflow.format.shard import Block
from tierflow.format.shard_writer import ShardWriter
from tierflow.format.table import ShardTable

from hostile import record_batch_metadata

CORPUS = Path(__file__).parent / "corpus"
EXAMPLES = int(os.environ.get("TIERFLOW_FUZZ_EXAMPLES", "150"))
HOSTILE_INTS = [0, 1, -1, 7, 1 << 31, (1 << 31) - 1, 1 << 32, 1 << 33, 1 << 62, -(1 << 63), (1 << 63) - 1]
MEMORY_BOUND = 64 << 20


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> list[tuple[pa.Schema, str, list[tuple[Block, bytes]], int]]:
    """(schema, name, [(block, bytes)], decoded size) of a compressed and an uncompressed shard of
    tokens, text, integers, floats and a null column."""
    root = tmp_path_factory.mktemp("blockfuzz")
    rng = np.random.default_rng(5)
    schema = pa.schema(
        [
            ("tokens", pa.list_(pa.uint16())),
            ("text", pa.string()),
            ("i", pa.int64()),
            ("x", pa.float32()),
            ("n", pa.null()),
            ("tags", pa.list_(pa.string())),
        ]
    )
    found = []
    for compression in ("zstd", "none"):
        writer = ShardWriter(root, schema, compression=compression)
        for b in range(3):
            n = 40 + b
            writer.write(
                pa.record_batch(
                    [
                        pa.array(
                            [rng.integers(0, 300, int(k)).astype(np.uint16) for k in rng.integers(0, 30, n)],
                            pa.list_(pa.uint16()),
                        ),
                        pa.array([f"doc {i} é" * (i % 5) for i in range(n)]),
                        pa.array(np.arange(n)),
                        pa.array(rng.random(n).astype(np.float32)),
                        pa.nulls(n),
                        pa.array([[f"t{i}"] * (i % 3) for i in range(n)], pa.list_(pa.string())),
                    ],
                    schema=schema,
                )
            )
        info = writer.close()
        source = open_blocks(root / info.name, info)
        found.append(
            (
                schema,
                info.name,
                [(blk, source.read(i).to_pybytes()) for i, blk in enumerate(info.blocks)],
                info.decoded_bytes,
            )
        )
    return found


def read_everything(batch: pa.RecordBatch) -> None:
    """Every value through every reader path (getters, list views): none may crash or read outside."""
    table = ShardTable([batch])
    for name in batch.schema.names:
        get = table.getter(0, name)
        for r in range(batch.num_rows):
            get(r)
        column = batch.column(name)
        if pa.types.is_list(column.type) and pa.types.is_primitive(column.type.value_type):
            table.list_parts(0, name)


def check_input(data: bytes, schema: pa.Schema, name: str, index: int, rows: int, decoded_bytes: int) -> str:
    """Decode and read one (mutated) block; 'ok' or 'refused'. Anything else fails the test."""
    block = Block(0, len(data), rows, "vouched-for")
    pool = pa.default_memory_pool()
    started = time.perf_counter()
    try:
        read_everything(decode_block(pa.py_buffer(data), schema, name, index, block, decoded_bytes))
        outcome = "ok"
    except ShardCorruptError as e:
        assert f"shard {name}: block {index}" in str(e), e
        outcome = "refused"
    assert time.perf_counter() - started < 1.0
    assert pool.bytes_allocated() < MEMORY_BOUND
    return outcome


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_mutated_block_decodes_to_readable_rows_or_is_refused(shards, data):
    schema, name, blocks, decoded_bytes = data.draw(st.sampled_from(shards))
    index = data.draw(st.integers(0, len(blocks) - 1))
    block, raw = blocks[index]
    buf = bytearray(raw)
    start, size = record_batch_metadata(buf, 0, len(buf), index == 0)
    rows = block.rows
    for _ in range(data.draw(st.integers(1, 3))):
        how = data.draw(st.sampled_from(["int64", "byte", "body", "rows"]))
        if how == "int64":  # a field of the flatbuffer: rows, a node length, a buffer offset/length
            at = start + 8 * data.draw(st.integers(0, size // 8 - 1))
            struct.pack_into("<q", buf, at, data.draw(st.sampled_from(HOSTILE_INTS + [rows + 1, rows * 2])))
        elif how == "byte":
            buf[data.draw(st.integers(start, start + size - 1))] = data.draw(st.integers(0, 255))
        elif how == "body" and len(buf) > start + size:
            at = data.draw(st.integers(start + size, len(buf) - 1))
            buf[at] ^= 1 << data.draw(st.integers(0, 7))
        else:  # the manifest claims other rows
            rows = data.draw(st.sampled_from([0, rows + 1, max(0, rows - 1), 1 << 33]))
    cut = data.draw(st.sampled_from([len(buf), len(buf), len(buf) - 1, len(buf) // 2]))
    event(check_input(bytes(buf[:cut]), schema, name, index, rows, decoded_bytes))


def test_unmutated_blocks_decode_and_read(shards):
    for schema, name, blocks, decoded_bytes in shards:
        for index, (block, raw) in enumerate(blocks):
            assert check_input(raw, schema, name, index, block.rows, decoded_bytes) == "ok"


def corpus_entry(data: bytes, schema: pa.Schema, index: int, rows: int, decoded_bytes: int) -> dict:
    """What tests/format/corpus/block-*.json holds for one input (see `test_corpus_blocks_are_refused`)."""
    return {
        "block": base64.b64encode(data).decode(),
        "schema": base64.b64encode(schema.serialize()).decode(),
        "index": index,
        "rows": rows,
        "decoded_bytes": decoded_bytes,
    }


@pytest.mark.parametrize("case", sorted(CORPUS.glob("block-*.json")), ids=lambda p: p.name)
def test_corpus_blocks_are_refused(case):
    d = json.loads(case.read_text())
    schema = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(d["schema"])))
    assert (
        check_input(
            base64.b64decode(d["block"]), schema, "shard-corpus.arrow", d["index"], d["rows"], d["decoded_bytes"]
        )
        == "refused"
    )


def test_the_corpus_is_not_empty():
    assert len(list(CORPUS.glob("block-*.json"))) >= 3
