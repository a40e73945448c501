"""The shard format: verifiable blocks, a decoded form with a known hash, no half-written datasets."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import tierflow
from tierflow.commands.cli import main
from tierflow.format.manifest import ManifestError
from tierflow.errors import ShardCorruptError
from tierflow.format.block_decoder import read_block
from tierflow.format.shard_writer import decode_shard


def pack_small(tmp_path: Path, n: int = 3000, **kw) -> Path:
    src = tmp_path / "a.jsonl"
    with open(src, "w") as f:
        for i in range(n):
            f.write(json.dumps({"text": f"sample {i} " * (i % 40), "i": i}) + "\n")
    out = tmp_path / "out"
    kw.setdefault("block_bytes", 64 << 10)  # several blocks a shard
    tierflow.pack([src], out, workers=1, target_shard_bytes=256 << 10, **kw)
    return out


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def test_decoded_form_matches_the_manifest_hash(tmp_path):
    out = pack_small(tmp_path)
    m = tierflow.open_dataset(out).manifest
    for info in m.shards:
        size, checksum = decode_shard(out / info.name, tmp_path / "decoded.arrow", info)
        assert (size, checksum) == (info.decoded_bytes, info.decoded_checksum)


def test_flipped_byte_is_named_by_verify_and_caught_when_reading_the_block(tmp_path, capsys):
    out = pack_small(tmp_path)
    assert main(["verify", str(out)]) == 0
    ds = tierflow.open_dataset(out)
    info = ds.manifest.shards[1]
    block = info.blocks[2]
    flip_byte(out / info.name, block.offset + block.length // 2)
    capsys.readouterr()
    assert main(["verify", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"shard {info.name}: block 2" in err
    raw = (out / info.name).read_bytes()[block.offset : block.offset + block.length]
    with pytest.raises(ShardCorruptError, match=f"{info.name}: block 2"):
        read_block(raw, ds.manifest.schema, info, 2)
    in_block_2 = int(ds.sample_starts[1]) + sum(b.rows for b in info.blocks[:2])
    with pytest.raises(ShardCorruptError, match=f"{info.name}: block 2"):
        ds[in_block_2]
    with pytest.raises(ShardCorruptError, match=f"{info.name}: block 2"):
        ds[in_block_2 + info.blocks[2].rows - 1]  # asked again: still refused, never served
    assert ds[int(ds.sample_starts[1])]["i"] == int(ds.sample_starts[1])  # the sound blocks still read
    assert ds[0]["i"] == 0  # and the sound shards


def test_every_block_reads_on_its_own(tmp_path):
    out = pack_small(tmp_path)
    ds = tierflow.open_dataset(out)
    info = ds.manifest.shards[0]
    raw = (out / info.name).read_bytes()
    rows = 0
    for k, block in enumerate(info.blocks):
        batch = read_block(raw[block.offset : block.offset + block.length], ds.manifest.schema, info, k)
        assert batch.column("i").to_pylist()[0] == rows
        rows += batch.num_rows
    assert rows == info.samples


def _row_in_block(ds, shard: int, block: int) -> int:
    """The global index of the first row of one block."""
    info = ds.manifest.shards[shard]
    return int(ds.sample_starts[shard]) + sum(b.rows for b in info.blocks[:block])


@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_reading_a_row_verifies_and_decodes_only_its_block(tmp_path, compression, monkeypatch):
    import tierflow.format.verify as verify_module

    out = pack_small(tmp_path, n=6000, compression=compression)
    whole = []
    monkeypatch.setattr(verify_module, "ShardVerifier", lambda *a, **k: whole.append(a))  # whole-file checks
    ds = tierflow.open_dataset(out)
    info = ds.manifest.shards[1]
    assert info.compression == compression and len(info.blocks) >= 4
    table = ds.shard(1)  # opening costs the manifest's block list: nothing is read yet
    assert (table.num_rows, table.blocks_loaded, table.blocks_verified) == (info.samples, 0, 0)
    assert list(table.row_starts) == [0, *np.cumsum([b.rows for b in info.blocks])]
    i = _row_in_block(ds, 1, 3) + 5
    assert ds[i]["i"] == i
    assert (table.blocks_loaded, table.blocks_verified) == (1, 1)  # block 3 only (the schema came from
    assert ds[i + 1]["i"] == i + 1  # block 0's first bytes, not verified)
    assert (table.blocks_loaded, table.blocks_verified) == (1, 1)
    assert not whole  # no whole-file hash on the read path
    assert ds.source.opens == 1


@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_a_corrupted_block_is_never_served_while_the_others_are(tmp_path, compression):
    out = pack_small(tmp_path, n=6000, compression=compression)
    ds = tierflow.open_dataset(out)
    info = ds.manifest.shards[0]
    bad = info.blocks[2]
    flip_byte(out / info.name, bad.offset + bad.length - 3)  # its last bytes: the end of its values
    for k in (0, 1, 3):
        first = _row_in_block(ds, 0, k)
        rows = range(first, first + info.blocks[k].rows)
        assert [ds[i]["i"] for i in rows] == list(rows)
    first = _row_in_block(ds, 0, 2)
    for r in (0, info.blocks[2].rows - 1, 0):
        with pytest.raises(ShardCorruptError, match=f"shard {info.name}: block 2 "):
            ds[first + r]
    with pytest.raises(ShardCorruptError, match=f"shard {info.name}: block 2 "):
        list(ds)


def test_a_corrupted_schema_in_block_0_is_caught_before_any_row_is_read(tmp_path):
    out = pack_small(tmp_path, n=6000)
    ds = tierflow.open_dataset(out)
    info = ds.manifest.shards[0]
    flip_byte(out / info.name, 40)  # inside the schema message at the start of block 0
    with pytest.raises(ShardCorruptError, match=f"shard {info.name}: block 0 "):
        ds[_row_in_block(ds, 0, 3)]


def test_decoded_blocks_stay_within_the_byte_bound_under_concurrent_readers(tmp_path):
    import random
    import threading

    from tierflow.format.dataset import Dataset
    from tierflow.format.reader import DirectoryBlocks, ShardReader

    out = pack_small(tmp_path, n=6000)
    manifest = tierflow.Manifest.load(out)
    largest = max(b.rows for s in manifest.shards for b in s.blocks)
    source = ShardReader(DirectoryBlocks(out), max_decoded_bytes=3 * largest * 600, schema=manifest.schema)
    ds = Dataset(manifest, source, location=str(out))
    errors = []

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(1000):  # thousands of evictions among four threads
                i = rng.randrange(len(ds))
                assert ds[i]["i"] == i
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=reader, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert source.cache.bytes <= source.max_decoded_bytes or len(source.cache) == 1
    assert source.cache.evictions > 0 and source.blocks_read > sum(len(s.blocks) for s in manifest.shards)


def test_decoded_blocks_are_the_decode_pools_bytes_and_go_back_to_it_when_dropped(tmp_path):
    """Decoded blocks come from the C allocator's pool (mimalloc, Arrow's default, kept ~20% more
    resident than it held), so the bytes alive are the cache's, and none once it is gone."""
    import gc

    from tierflow.format.block_decoder import DECODE_POOL
    from tierflow.format.dataset import Dataset
    from tierflow.format.reader import DirectoryBlocks, ShardReader

    out = pack_small(tmp_path, n=6000)
    manifest = tierflow.Manifest.load(out)
    assert {s.compression for s in manifest.shards} == {"zstd"}
    gc.collect()  # an earlier test's blocks still held would leave with this one's
    base = DECODE_POOL.bytes_allocated()
    source = ShardReader(DirectoryBlocks(out), max_decoded_bytes=1, schema=manifest.schema)  # one block at a time
    ds = Dataset(manifest, source, location=str(out))
    for i in range(0, len(ds), 97):
        assert ds[i]["i"] == i
        held = DECODE_POOL.bytes_allocated() - base  # the block's buffers, each padded to 64 bytes
        assert len(source.cache) == 1 and 0 < source.cache.bytes <= held < source.cache.bytes + 64 * 8
    assert source.blocks_read > 10
    del ds, source
    gc.collect()
    assert DECODE_POOL.bytes_allocated() == base


def test_the_cache_hands_the_heap_back_after_each_trim_every_bytes_it_evicted(tmp_path, monkeypatch):
    """glibc keeps freed blocks' pages resident: the cache returns them once per TRIM_EVERY bytes
    evicted (a trim costs ~2 ms), so a churning cache does not grow the process beyond its bound."""
    import sys

    import tierflow.format.table as table
    from tierflow.format.dataset import Dataset
    from tierflow.format.reader import DirectoryBlocks, ShardReader

    out = pack_small(tmp_path, n=6000)
    manifest = tierflow.Manifest.load(out)
    source = ShardReader(DirectoryBlocks(out), max_decoded_bytes=1, schema=manifest.schema)
    ds = Dataset(manifest, source, location=str(out))
    monkeypatch.setattr(table, "TRIM_EVERY", 200_000)
    for i in range(0, len(ds), 97):  # one block held at a time: every read evicts the one before
        assert ds[i]["i"] == i
    cache = source.cache
    assert cache.evictions > 10 and cache._untrimmed < 200_000
    assert cache.trims >= 2 if sys.platform.startswith("linux") else cache.trims == 0


def test_a_token_block_read_once_keeps_its_second_chance_in_the_cache(tmp_path):
    """The cache drops first the oldest block not read since it was loaded; reading a token block's
    values counts as such a read also when the read loaded the block (its checks made the views)."""
    from tierflow.format.dataset import Dataset
    from tierflow.format.reader import DirectoryBlocks, ShardReader

    out = pack_small(tmp_path, n=6000, tokenizer="bytes")
    manifest = tierflow.Manifest.load(out)
    source = ShardReader(DirectoryBlocks(out), schema=manifest.schema)
    ds = Dataset(manifest, source, location=str(out))
    column = ds.token_column
    eager = tierflow.open_dataset(out).shard(0)
    sizes = [eager.block(b).get_total_buffer_size() for b in range(3)]
    table = ds.shard(0)
    table.list_values(0, column)  # loads block 0 and reads it
    table.list_parts(1, column)  # loads block 1, its values not read
    source.cache.max_bytes = sum(sizes) - 1  # block 2 makes one of them go
    table.list_values(2, column)
    loaded = table.blocks_loaded
    table.list_values(0, column)
    assert table.blocks_loaded == loaded  # kept: read since it was loaded
    table.list_parts(1, column)
    assert table.blocks_loaded == loaded + 1  # dropped, and loaded again


def test_token_blocks_record_their_counts_so_tokens_read_only_their_block(tmp_path):
    out = pack_small(tmp_path, n=6000, tokenizer="bytes")
    ds = tierflow.open_dataset(out)
    info = ds.manifest.shards[1]
    assert all(b.tokens is not None for b in info.blocks) and sum(b.tokens for b in info.blocks) == info.tokens
    eager = tierflow.open_dataset(out)
    start = int(ds.token_starts[1]) + sum(b.tokens for b in info.blocks[:3]) + 7
    got = ds.tokens(start, start + 100)
    assert ds.shard(1).blocks_loaded == 1
    expected = np.concatenate([eager[i]["tokens"] for i in range(len(eager))])[start : start + 100]
    assert got.tolist() == expected.tolist()


def test_inspect_prints_summary_and_samples(tmp_path, capsys):
    out = pack_small(tmp_path, tokenizer="bytes")
    assert main(["inspect", str(out), "-n", "2"]) == 0
    text = capsys.readouterr().out
    assert "3,000 samples" in text and "uint16" in text


KILL_SCRIPT = """
import json, sys, time, tierflow
def slow(r):
    time.sleep(0.002)
    return r
tierflow.pack([sys.argv[1]], sys.argv[2], fn=slow, workers=2, target_shard_bytes=256 << 10,
              chunk_bytes=64 << 10)
"""


@pytest.mark.slow
def test_pack_killed_mid_way_leaves_no_dataset_and_the_rerun_completes(tmp_path):
    src = tmp_path / "a.jsonl"
    with open(src, "w") as f:
        for i in range(6000):
            f.write(json.dumps({"text": "z" * 200, "i": i}) + "\n")
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(src), str(out)], start_new_session=True)
    deadline = time.time() + 60
    while time.time() < deadline and not list(out.glob("shard-*.arrow")):
        time.sleep(0.05)
    assert list(out.glob("shard-*.arrow")), "the pack never wrote a shard"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    with pytest.raises(ManifestError, match="no manifest"):
        tierflow.open_dataset(out)
    tierflow.pack([src], out, workers=2, target_shard_bytes=256 << 10, chunk_bytes=64 << 10)
    assert main(["verify", str(out)]) == 0
    ds = tierflow.open_dataset(out)
    assert [s["i"] for s in ds] == list(range(6000))
    assert {p.name for p in out.glob("shard-*")} == {s.name for s in ds.manifest.shards}
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp")]
