"""The shard format: verifiable blocks, a decoded form with a known hash, no half-written datasets."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tierflow
from tierflow.cli import main
from tierflow.format.manifest import ManifestError
from tierflow.format.shard import ShardCorruptError, decode_shard, read_block


def pack_small(tmp_path: Path, n: int = 3000, **kw) -> Path:
    src = tmp_path / "a.jsonl"
    with open(src, "w") as f:
        for i in range(n):
            f.write(json.dumps({"text": f"sample {i} " * (i % 40), "i": i}) + "\n")
    out = tmp_path / "out"
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
        size, checksum = decode_shard(out / info.name, tmp_path / "decoded.arrow")
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
    raw = (out / info.name).read_bytes()[block.offset:block.offset + block.length]
    with pytest.raises(ShardCorruptError, match=f"{info.name}: block 2"):
        read_block(raw, ds.manifest.schema, info, 2)
    with pytest.raises(ShardCorruptError, match=info.name):
        ds[int(ds.sample_starts[1])]
    assert ds[0]["i"] == 0  # the sound shards still read


def test_every_block_reads_on_its_own(tmp_path):
    out = pack_small(tmp_path)
    ds = tierflow.open_dataset(out)
    info = ds.manifest.shards[0]
    raw = (out / info.name).read_bytes()
    rows = 0
    for k, block in enumerate(info.blocks):
        batch = read_block(raw[block.offset:block.offset + block.length], ds.manifest.schema, info, k)
        assert batch.column("i").to_pylist()[0] == rows
        rows += batch.num_rows
    assert rows == info.samples


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
