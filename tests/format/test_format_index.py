"""The dataset index: where a sample and a token live, from the manifest's counts, for every reader."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import tierflow
from tierflow.format.index import DatasetIndex, cumulative
from tierflow.format.manifest import MANIFEST_NAME
from tierflow.format.reads import SampleLengths, TokenReader
from tierflow.format.shard import Block, ShardInfo, block_lists


def pack_tokens(tmp_path: Path, n: int = 12000) -> Path:
    src = tmp_path / "a.jsonl"
    with open(src, "w") as f:
        for i in range(n):
            f.write(json.dumps({"text": f"doc {i} " * (i % 23), "i": i}) + "\n")
    out = tmp_path / "out"
    tierflow.pack([src], out, workers=1, target_shard_bytes=256 << 10, block_bytes=32 << 10, tokenizer="bytes")
    return out


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    return pack_tokens(tmp_path_factory.mktemp("index"))


def stream(ds) -> np.ndarray:
    return np.concatenate([ds[i]["tokens"] for i in range(len(ds))])


def test_every_sample_is_where_the_index_says(packed):
    ds = tierflow.open_dataset(packed)
    assert len(ds.manifest.shards) >= 3 and all(len(s.blocks) >= 3 for s in ds.manifest.shards[:-1])
    ids = np.arange(len(ds))
    shards, blocks, rows = ds.index.locate_samples(ids)
    for i in range(0, len(ds), 7):
        table = ds.shard(int(shards[i]))
        assert table.getter(int(blocks[i]), "i")(int(rows[i])) == i
        assert ds.index.locate_sample(i) == (shards[i], blocks[i], rows[i])
    # the first row of every block, from the manifest's block list
    first = 0
    for s, info in enumerate(ds.manifest.shards):
        for b, block in enumerate(info.blocks):
            assert ds.index.locate_sample(first) == (s, b, 0)
            assert ds.index.locate_sample(first + block.rows - 1) == (s, b, block.rows - 1)
            first += block.rows


@pytest.mark.slow
def test_every_token_is_where_the_index_says(packed):
    ds = tierflow.open_dataset(packed)
    expected = stream(ds)
    assert ds.num_tokens == expected.size
    positions = np.arange(0, ds.num_tokens, 13)
    places = ds.index.locate_tokens(positions)
    for t, shard, block, offset, left in zip(positions.tolist(), *(a.tolist() for a in places)):
        offsets, values = ds.shard(shard).list_parts(block, "tokens")
        assert values[int(offsets[0]) + offset] == expected[t]
        assert left == int(offsets[-1] - offsets[0]) - offset  # the tokens left in its block
        assert ds.index.locate_token(t) == (shard, block, offset, left)


def test_empty_blocks_and_shards_never_hold_a_sample_or_a_token():
    def info(rows_tokens):
        return ShardInfo(
            "s",
            sum(r for r, _ in rows_tokens),
            1,
            1,
            "x",
            "y",
            "none",
            tokens=sum(t for _, t in rows_tokens),
            blocks=[Block(0, 1, r, "", t) for r, t in rows_tokens],
        )

    index = DatasetIndex([info([(2, 5), (0, 0), (3, 4)]), info([]), info([(0, 0), (1, 2)]), info([(1, 0)])])
    assert [index.locate_sample(i) for i in range(7)] == [
        (0, 0, 0),
        (0, 0, 1),
        (0, 2, 0),
        (0, 2, 1),
        (0, 2, 2),
        (2, 1, 0),
        (3, 0, 0),
    ]
    assert [index.locate_token(t)[:3] for t in (0, 4, 5, 8, 9, 10)] == [
        (0, 0, 0),
        (0, 0, 4),
        (0, 2, 0),
        (0, 2, 3),
        (2, 1, 0),
        (2, 1, 1),
    ]
    assert index.num_samples == 7 and index.num_tokens == 11
    assert cumulative([]).tolist() == [0]


def test_a_pack_without_block_token_counts_reads_them_for_the_shard_it_needs_only(packed, tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    manifest = json.loads((packed / MANIFEST_NAME).read_text())
    for shard in manifest["shards"]:
        (old / shard["name"]).symlink_to(packed / shard["name"])
        shard["blocks"] = block_lists(shard["blocks"])  # format version 1's lists
        del shard["blocks"]["tokens"]  # a pack from before blocks recorded their token counts
    manifest["format_version"] = 1
    manifest.pop("manifest_checksum")  # such a pack predates the checksum too
    (old / MANIFEST_NAME).write_text(json.dumps(manifest))
    ds, fresh = tierflow.open_dataset(old), tierflow.open_dataset(packed)
    assert all(b.tokens is None for s in ds.manifest.shards for b in s.blocks)
    start = int(ds.token_starts[2]) + 100
    assert ds.tokens(start, start + 50).tolist() == fresh.tokens(start, start + 50).tolist()
    assert ds.source.opens == 1  # shard 2's offsets were read, no other shard was opened
    positions = np.arange(0, ds.num_tokens, 11)
    assert all(
        np.array_equal(a, b) for a, b in zip(ds.index.locate_tokens(positions), fresh.index.locate_tokens(positions))
    )


def test_token_windows_copy_across_blocks_and_shards(packed):
    ds = tierflow.open_dataset(packed, columns=["tokens"])
    expected = stream(tierflow.open_dataset(packed))
    reader = TokenReader(ds)
    width = 700  # longer than some blocks: rows cross blocks, and shards
    starts = np.array([0, 5, int(ds.token_starts[1]) - 3, int(ds.token_starts[2]) - 350, ds.num_tokens - width])
    out = np.empty((starts.size, width), dtype=expected.dtype)
    reader.copy_windows(out, starts)
    for row, start in enumerate(starts.tolist()):
        assert out[row].tolist() == expected[start : start + width].tolist()
        assert ds.tokens(start, start + width).tolist() == expected[start : start + width].tolist()
    assert reader.pieces > starts.size  # the crossing rows went piece by piece
    with pytest.raises(IndexError, match="past the stream end"):
        reader.copy_windows(out[:1], np.array([ds.num_tokens - width + 1]))


def test_sample_lengths_come_from_the_offsets_in_any_order(packed):
    ds = tierflow.open_dataset(packed)
    lengths = SampleLengths(ds, "tokens")
    ids = np.random.default_rng(0).permutation(len(ds))[:500]
    assert lengths(ids).tolist() == [len(ds[int(i)]["tokens"]) for i in ids]
    assert lengths(np.zeros(0, dtype=np.int64)).size == 0


def test_a_dataset_without_tokens_says_so(tmp_path):
    src = tmp_path / "a.jsonl"
    src.write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(10)))
    tierflow.pack([src], tmp_path / "out", workers=1)
    ds = tierflow.open_dataset(tmp_path / "out")
    with pytest.raises(TypeError, match="not a token dataset"):
        TokenReader(ds)
    with pytest.raises(TypeError, match="not a token dataset"):
        ds.tokens(0, 1)


def test_a_manifests_block_columns_are_the_records_pack_wrote(packed):
    """A loaded shard's `BlockList` equals the list of `Block` records its columns describe (a
    `ShardInfo` from the manifest compares equal to one built from records), survives pickling for
    spawned workers, and is no string or shorter list."""
    import pickle

    from tierflow.format.manifest import Manifest
    from tierflow.format.shard import BlockList

    info = Manifest.load(packed).shards[0]
    blocks = info.blocks
    assert isinstance(blocks, BlockList) and blocks.made == 0 and len(blocks) >= 2
    lists = block_lists(json.loads((packed / MANIFEST_NAME).read_text())["shards"][0]["blocks"])
    records = [
        Block(*values)
        for values in zip(lists["offset"], lists["length"], lists["rows"], lists["checksum"], lists["tokens"])
    ]
    assert all(len(c) == 16 for c in lists["checksum"])
    assert blocks == records and blocks[1:] == records[1:] and list(blocks) == records
    assert ShardInfo(**{**info.__dict__, "blocks": records}) == info
    assert blocks != records[:-1] and blocks != "not blocks" and blocks != 3
    again = pickle.loads(pickle.dumps(blocks))
    assert again.made == 0 and again == records  # records are made again, on demand


def test_a_lookup_of_many_shards_at_once_is_each_position_looked_up_alone(packed):
    """token_blocks and locate_samples over positions of several shards in any order (one lookup
    over the shards' block rows) give each position's own row, the clamped ends included."""
    ds = tierflow.open_dataset(packed)
    rng = np.random.default_rng(5)
    tokens = np.concatenate([rng.integers(0, ds.num_tokens, 40), [0, ds.num_tokens - 1, ds.num_tokens + 9, -3]])
    together = ds.index.token_blocks(tokens)
    alone = np.concatenate([ds.index.token_blocks(np.array([t])) for t in tokens.tolist()])
    assert together.tolist() == alone.tolist()
    first, end = ds.index.token_blocks(np.array([-3, ds.num_tokens + 9])).tolist()
    assert first == ds.index.token_blocks(np.array([0])).tolist()[0]
    assert end == ds.index.token_blocks(np.array([ds.num_tokens - 1])).tolist()[0]
    ids = rng.integers(0, len(ds), 40)
    places = ds.index.locate_samples(ids)
    assert [tuple(p) for p in np.stack(places, axis=1).tolist()] == [ds.index.locate_sample(i) for i in ids.tolist()]
