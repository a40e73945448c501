"""Defects 2 and 3 of issue 18: a hostile shard (with a manifest vouching for it) gets a typed error, fast,
in bounded memory, never a row read from outside its buffers, a segfault or a gigabyte.

The crashing and memory-hungry cases run in a child process: a regression then fails the test
(a signal, or an RSS over the bound) instead of killing or swapping the test run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

import tierflow
from tierflow.errors import ManifestError, ShardCorruptError
from tierflow.format._ipcmeta import MalformedMessage, _Table, batch_claims
from tierflow.format.manifest import MANIFEST_NAME, Manifest
from tierflow.format.block_decoder import block_schema
from tierflow.format.shard_writer import ShardWriter, decode_shard

from hostile import forge, listed, record_batch_metadata, set_rows

SRC = Path(tierflow.__file__).resolve().parents[1]  # the tierflow under test, in the child too
TESTS = Path(__file__).resolve().parent


def pack_plain(tmp_path: Path, compression: str = "none") -> Path:
    src = tmp_path / "docs.jsonl"
    with open(src, "w") as f:
        for i in range(3000):
            f.write(json.dumps({"i": i, "text": f"doc {i} " + "q" * (i % 70)}) + "\n")
    out = tmp_path / "ds"
    tierflow.pack([src], out, workers=1, compression=compression, block_bytes=16 << 10)
    return out


def run_child(code: str, timeout: float = 60) -> tuple[int, str, float]:
    """(returncode, stdout, peak RSS in MB beyond what importing tierflow takes) of `code` run in a
    fresh interpreter."""
    prologue = (
        "import resource, sys, tierflow, tierflow.format.dataset\n"
        "_base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "def peak_mb():\n"
        "    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - _base) / 1024\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{TESTS}"}
    done = subprocess.run(
        [sys.executable, "-c", prologue + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    lines = done.stdout.strip().splitlines()
    peak = float(lines[-1]) if lines and lines[-1].replace(".", "").isdigit() else -1.0
    return done.returncode, done.stdout + done.stderr, peak


def test_a_block_claiming_more_rows_than_its_buffers_hold_is_refused(tmp_path):
    root = pack_plain(tmp_path)
    rows = listed(json.loads((root / MANIFEST_NAME).read_text()))["shards"][0]["blocks"]["rows"]
    shard = forge(root, 0, lambda data, s: set_rows(data, s, 1, rows[1] + 1001))
    ds = tierflow.open_dataset(root)
    first = rows[0]
    with pytest.raises(ShardCorruptError, match=rf"shard {shard['name']}: block 1 .*does not decode"):
        ds[first + rows[1] + 500]  # a row beyond the buffers
    with pytest.raises(ShardCorruptError, match=rf"shard {shard['name']}: block 1"):
        ds[first]  # nor any row of that block
    assert ds[0]["i"] == 0  # the other blocks are sound


def test_a_row_count_of_2_to_the_33_is_a_typed_error_not_a_segfault(tmp_path):
    root = pack_plain(tmp_path)
    forge(root, 0, lambda data, s: set_rows(data, s, 0, 1 << 33))
    rc, out, peak = run_child(f"""
        import tierflow
        from tierflow.errors import ShardCorruptError
        ds = tierflow.open_dataset({str(root)!r})
        try:
            ds[5]
            print("served")
        except ShardCorruptError as e:
            print("refused:", e)
        print(peak_mb())
    """)
    assert rc == 0, out
    assert "refused:" in out and "block 0" in out, out
    assert 0 <= peak < 100, out


def write_null_shard(root: Path, rows: int) -> None:
    """A dataset of one tiny shard: one block of a null column of `rows` rows (no buffers at all)."""
    root.mkdir()
    schema = pa.schema([("n", pa.null())])
    writer = ShardWriter(root, schema, compression="none")
    # from_buffers rather than pa.nulls: the same array and shard bytes, without the second or so that
    # pa.nulls takes over 2**31 rows
    writer.write(pa.record_batch([pa.NullArray.from_buffers(pa.null(), rows, [None])], schema=schema))
    info = writer.close()
    Manifest(schema=schema, shards=[info]).save(root)


def test_a_tiny_shard_with_a_null_column_of_2_31_rows_is_refused_in_bounded_memory(tmp_path):
    root = tmp_path / "nulls"
    write_null_shard(root, (1 << 31) - 1)
    assert sum(f.stat().st_size for f in root.glob("shard-*")) < 1024
    rc, out, peak = run_child(f"""
        import time, tierflow
        from tierflow.errors import ShardCorruptError
        started = time.perf_counter()
        ds = tierflow.open_dataset({str(root)!r})
        try:
            print("served", ds[7])
        except ShardCorruptError as e:
            print("refused:", e, "in", time.perf_counter() - started)
        print(peak_mb())
    """)
    assert rc == 0 and "refused:" in out and "block 0" in out, out
    assert 0 <= peak < 100, out  # was 2.1-2.4 GB


def test_a_small_null_column_beside_real_columns_still_reads(tmp_path):
    root = tmp_path / "mixed"
    root.mkdir()
    schema = pa.schema([("n", pa.null()), ("i", pa.int64())])
    writer = ShardWriter(root, schema, compression="zstd")
    writer.write(pa.record_batch([pa.nulls(5000), pa.array(np.arange(5000))], schema=schema))
    Manifest(schema=schema, shards=[writer.close()]).save(root)
    ds = tierflow.open_dataset(root)
    assert ds[4999] == {"n": None, "i": 4999}


def zeros_shard(root: Path) -> tierflow.format.shard.ShardInfo:
    """A compressed shard that decodes to 32 MB from a few KB (columns of zeros)."""
    root.mkdir()
    schema = pa.schema([("z", pa.int64())])
    writer = ShardWriter(root, schema, compression="zstd")
    for _ in range(4):
        writer.write(pa.record_batch([pa.array(np.zeros(1 << 20, dtype=np.int64))], schema=schema))
    return writer.close()


def test_decoding_a_shard_is_bounded_by_its_declared_decoded_size(tmp_path):
    info = zeros_shard(tmp_path / "z")
    assert info.bytes < 64 << 10 and info.decoded_bytes > 32 << 20
    src = tmp_path / "z" / info.name
    size, checksum = decode_shard(src, tmp_path / "ok.arrow", info)
    assert (size, checksum) == (info.decoded_bytes, info.decoded_checksum)
    info.decoded_bytes = 1 << 20  # the manifest lies: admission sized the entry at 1 MB
    rc, out, peak = run_child(f"""
        import json
        from tierflow.format.shard import ShardInfo
        from tierflow.format.shard_writer import decode_shard
        from tierflow.errors import ShardCorruptError
        info = ShardInfo.from_json(json.loads({json.dumps(info.to_json())!r}))
        try:
            decode_shard({str(src)!r}, {str(tmp_path / "bad.arrow")!r}, info)
            print("decoded")
        except ShardCorruptError as e:
            print("refused:", e)
        print(peak_mb())
    """)
    assert rc == 0 and "refused:" in out and "more than the 1048576" in out, out
    assert 0 <= peak < 20, out  # not one 8 MB block decoded
    assert not (tmp_path / "bad.arrow").exists() or (tmp_path / "bad.arrow").stat().st_size <= 1 << 20


def test_decoding_a_shard_ignores_its_footer(tmp_path):
    root = pack_plain(tmp_path, compression="zstd")
    info = tierflow.open_dataset(root).manifest.shards[0]
    data = bytearray((root / info.name).read_bytes())
    last = info.blocks[-1]
    data[last.offset + last.length : -10] = b"\x00" * (len(data) - 10 - last.offset - last.length)
    (tmp_path / "garbled.arrow").write_bytes(bytes(data))  # the footer: zeroes (a lying one could list 1000 blocks)
    size, checksum = decode_shard(tmp_path / "garbled.arrow", tmp_path / "out.arrow", info)
    assert (size, checksum) == (info.decoded_bytes, info.decoded_checksum)


def test_a_100_mb_manifest_is_refused_fast_and_unread(tmp_path):
    root = tmp_path / "big"
    root.mkdir()
    with open(root / MANIFEST_NAME, "wb") as f:
        f.truncate(100 << 20)
    started = time.perf_counter()
    with pytest.raises(ManifestError, match="more than the"):
        Manifest.load(root)
    assert time.perf_counter() - started < 5  # generous: it is a stat, not a read


def test_a_remote_manifest_over_the_limit_is_refused_before_download(tmp_path, monkeypatch):
    from tierflow.storage.datasets import read_manifest
    from tierflow.storage.remote import open_store

    (tmp_path / MANIFEST_NAME).write_bytes(b" " * 5000)
    monkeypatch.setenv("TIERFLOW_MAX_MANIFEST_BYTES", "4096")
    source = open_store(str(tmp_path))
    read = []
    monkeypatch.setattr(source, "read_into", lambda *a, **k: read.append(a))
    with pytest.raises(ManifestError, match="5000 bytes, more than the 4096"):
        read_manifest(source)
    assert not read


def _record_batch_meta(root: Path) -> bytes:
    m = listed(json.loads((root / MANIFEST_NAME).read_text()))
    shard = m["shards"][0]
    data = (root / shard["name"]).read_bytes()
    start, size = record_batch_metadata(data, shard["blocks"]["offset"][1], shard["blocks"]["length"][1], False)
    return data[start : start + size]


def test_record_batch_metadata_pointing_outside_itself_is_malformed_never_a_struct_error(tmp_path):
    """The claims reader runs before Arrow's: cut short, pointing past its end, or with a vector
    longer than the bytes left, the metadata is MalformedMessage (a ValueError decode_block turns
    into ShardCorruptError naming shard and block), never struct.error, IndexError or a huge list."""
    meta = _record_batch_meta(pack_plain(tmp_path))
    assert batch_claims(meta).rows > 0  # the real one reads
    with pytest.raises(MalformedMessage, match="4 bytes of metadata"):
        batch_claims(meta[:4])
    with pytest.raises(MalformedMessage, match=r"offset \d+ outside the 8-byte metadata"):
        batch_claims(struct.pack("<I", 1 << 20) + b"\0" * 4)
    nodes = _Table(meta, struct.unpack_from("<I", meta, 0)[0]).table(2).field(1)
    count_at = nodes + struct.unpack_from("<I", meta, nodes)[0]
    forged = bytearray(meta)
    struct.pack_into("<I", forged, count_at, 1 << 30)  # a billion field nodes in a few hundred bytes
    with pytest.raises(MalformedMessage, match="a vector of 1073741824 entries runs past the metadata"):
        batch_claims(bytes(forged))


def test_a_shard_decoding_to_more_than_its_declared_size_over_several_blocks_is_refused(tmp_path):
    """Each block within the declared decoded size, their sum one byte over it: the decode's
    output bound, not the per-block one, refuses it, naming the shard."""
    root = pack_plain(tmp_path)
    info = Manifest.load(root).shards[0]
    assert len(info.blocks) > 2
    info.decoded_bytes -= 1
    with pytest.raises(
        ShardCorruptError,
        match=rf"shard {info.name}: decodes to more than the "
        rf"{info.decoded_bytes} bytes the manifest declares",
    ):
        decode_shard(root / info.name, tmp_path / "decoded.arrow", info)


def test_a_shard_listed_without_blocks_or_whose_first_block_holds_no_schema_is_refused(tmp_path):
    root = pack_plain(tmp_path)
    info = Manifest.load(root).shards[0]
    with pytest.raises(ShardCorruptError, match=rf"shard {info.name}: no blocks"):
        decode_shard(root / info.name, tmp_path / "decoded.arrow", dataclasses.replace(info, blocks=[]))
    data = (root / info.name).read_bytes()
    second = info.blocks[1]  # a record batch where block 0's schema should be (after the file's magic)
    forged = pa.py_buffer(data[:8] + data[second.offset : second.offset + second.length])
    with pytest.raises(ShardCorruptError, match=rf"shard {info.name}: block 0 .*first message is a record batch"):
        block_schema(forged, info.name, info.blocks[0])
