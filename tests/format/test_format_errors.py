"""Error paths of the shard format with real files: damage outside every block, a missing or
truncated shard, blocks asked for out of range, and the bound on decoded blocks once the tables
holding them are gone."""

from __future__ import annotations

import gc
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

import tierflow
from tierflow.errors import ShardCorruptError
from tierflow.format.reader import DirectoryBlocks, ShardReader
from tierflow.format.manifest import Manifest
from tierflow.format._checksum import file_xxh3_128, xxh3_128_hex
from tierflow.format.reads import TokenReader
from tierflow.format.shard_writer import ShardWriter, decode_shard
from tierflow.format.verify import verify_shard
from tierflow.testing.faults import write_corpus


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Compressed shards (zstd, the default) of several blocks each."""
    root = tmp_path_factory.mktemp("format-errors")
    src = write_corpus(root / "a.jsonl", docs=1500, seed=12)
    tierflow.pack([src], root / "out", workers=1, target_shard_bytes=256 << 10, block_bytes=64 << 10)
    return root / "out"


def copy(packed: Path, tmp_path: Path) -> tuple[Path, Manifest]:
    out = tmp_path / "ds"
    shutil.copytree(packed, out)
    return out, Manifest.load(out)


def test_a_byte_flipped_outside_every_block_is_found_by_verify_and_reading_stays_sound(packed, tmp_path) -> None:
    out, manifest = copy(packed, tmp_path)
    info = manifest.shards[0]
    path = out / info.name
    end = info.blocks[-1].offset + info.blocks[-1].length
    assert end < info.bytes  # the IPC footer follows the last block
    data = bytearray(path.read_bytes())
    data[end + 2] ^= 0x40
    path.write_bytes(bytes(data))
    assert verify_shard(path, info) == [f"shard {info.name}: whole-file checksum mismatch (outside any block)"]
    ds = tierflow.open_dataset(out)
    assert [ds[i]["id"] for i in range(0, info.samples, 97)] == list(range(0, info.samples, 97))


def test_a_missing_or_truncated_shard_is_named(packed, tmp_path) -> None:
    out, manifest = copy(packed, tmp_path)
    first, second = manifest.shards[0], manifest.shards[1]
    (out / first.name).unlink()
    assert verify_shard(out / first.name, first) == [f"shard {first.name}: missing ({out / first.name})"]
    data = (out / second.name).read_bytes()
    (out / second.name).write_bytes(data[:-100])
    with pytest.raises(ShardCorruptError, match=rf"shard {second.name}: {len(data) - 100} bytes, not {len(data)}"):
        decode_shard(out / second.name, tmp_path / "decoded.arrow", second)
    assert any(f"shard {second.name}" in p for p in verify_shard(out / second.name, second))


def test_blocks_out_of_range_are_an_index_error_naming_the_shard(packed) -> None:
    manifest = Manifest.load(packed)
    info = manifest.shards[0]
    table = ShardReader(DirectoryBlocks(packed), schema=manifest.schema).open_shard(0, info)
    blocks = table.blocks
    n = len(blocks)
    assert n == len(info.blocks) >= 3
    assert blocks[-1].num_rows == info.blocks[-1].rows and blocks[n - 1].equals(blocks[-1])
    assert [b.num_rows for b in blocks[1:3]] == [b.rows for b in info.blocks[1:3]]
    with pytest.raises(IndexError, match=rf"shard {info.name}: block {n} out of range"):
        blocks[n]
    with pytest.raises(IndexError, match=rf"shard {info.name}: block -1 out of range"):
        blocks[-n - 1]


def test_decoded_blocks_stay_bounded_after_the_tables_holding_them_are_gone(packed) -> None:
    """The block cache forgets a table that was dropped (its finalizer), so its bytes stop counting
    against the bound and the next tables' blocks are kept, not evicted at once."""
    manifest = Manifest.load(packed)
    source = ShardReader(DirectoryBlocks(packed), max_decoded_bytes=1 << 20, schema=manifest.schema)
    first = source.open_shard(0, manifest.shards[0])
    for b in range(first.num_blocks):
        first.block(b)
    held = source.cache.bytes
    assert held > 0 and len(source.cache) == first.num_blocks
    source._tables.clear()
    del first
    gc.collect()
    second = source.open_shard(1, manifest.shards[1])
    second.block(0)
    assert source.cache.bytes < held and len(source.cache) == 1  # only the live table's block counts
    assert source.cache.evictions == 0


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("format-errors-tokens")
    src = write_corpus(root / "a.jsonl", docs=400, seed=13)
    tierflow.pack([src], root / "out", workers=1, tokenizer="bytes", target_shard_bytes=256 << 10)
    return root / "out"


def test_a_dataset_asked_for_what_it_does_not_hold_names_itself(packed, tokens) -> None:
    with pytest.raises(KeyError, match=rf"{packed}: no column\(s\) \['nope'\]"):
        tierflow.open_dataset(packed, columns=["nope"])
    ds = tierflow.open_dataset(packed, columns=["id"])
    n = len(ds)
    assert repr(ds) == f"Dataset({str(packed)!r}, samples={n}, shards={len(ds.manifest.shards)}, columns=['id'])"
    assert ds[-1] == ds[n - 1] == {"id": n - 1}
    for bad in (n, -n - 1):
        with pytest.raises(IndexError, match=rf"{packed}: sample {bad if bad >= 0 else bad + n} out of range"):
            ds[bad]
    with pytest.raises(TypeError, match="not a token dataset"):
        ds.tokens(0, 1)
    stream = tierflow.open_dataset(tokens)
    total = stream.num_tokens
    with pytest.raises(IndexError, match=rf"tokens \[0, {total + 1}\) outside \[0, {total}\)"):
        stream.tokens(0, total + 1)
    empty = stream.tokens(5, 5)
    assert empty.size == 0 and empty.dtype == stream.tokens(0, 1).dtype
    reader = TokenReader(stream)
    out = np.zeros((2, 8), dtype=np.int32)
    with pytest.raises(IndexError, match=rf"{tokens}: a window of 8 tokens from {total - 4} runs past the stream end"):
        reader.copy_windows(out, np.array([0, total - 4]))
    assert reader.pieces == 0 and not out.any()  # refused before a token was copied
    reader.copy_windows(out[:0], np.array([], dtype=np.int64))  # no rows: nothing to do, no error


def test_a_shard_writer_refuses_a_compression_it_does_not_know(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"unknown compression 'lz5'; expected one of"):
        ShardWriter(tmp_path, pa.schema([("i", pa.int64())]), compression="lz5")
    assert not list(tmp_path.iterdir())  # not even its temporary file


def test_an_empty_file_hashes_as_no_bytes(tmp_path) -> None:
    """An empty entry or shard (mmap cannot map zero bytes) and a range past a file's end."""
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    full = tmp_path / "full"
    full.write_bytes(b"0123456789")
    assert file_xxh3_128(empty) == xxh3_128_hex(b"") == file_xxh3_128(full, start=10)
    assert file_xxh3_128(full, start=2, length=3) == xxh3_128_hex(b"234")


def test_a_truncated_uncompressed_shard_is_refused_before_it_is_mapped(tmp_path) -> None:
    """Uncompressed shards are memory-mapped: a file shorter than the manifest says would fault
    (SIGBUS) on a slice past its end, so its size is checked first, by readers and by verify."""
    from tierflow.format._audit import audit_shard

    src = write_corpus(tmp_path / "a.jsonl", docs=300, seed=14)
    out = tmp_path / "plain"
    tierflow.pack([src], out, workers=1, compression="none", block_bytes=16 << 10)
    manifest = Manifest.load(out)
    info = manifest.shards[0]
    data = (out / info.name).read_bytes()
    (out / info.name).write_bytes(data[:-64])
    expected = rf"shard {info.name}: size {len(data) - 64} != {len(data)} expected"
    with pytest.raises(ShardCorruptError, match=expected):
        tierflow.open_dataset(out)[0]
    problems = audit_shard(out / info.name, info, manifest)
    assert len(problems) == 1 and problems[0].startswith(f"shard {info.name}: size ")
