"""The first batch decodes a bounded number of blocks whatever the dataset's size (issue 17): the
block-group shuffle against the full-window one, counted in blocks read, on real zstd shards."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import tierflow
from tierflow.loader import Loader, TieredDataset

SHARDS = 4
BLOCK_BYTES = 16 << 10
GROUP_BYTES = 32 << 10  # a group spans 2 blocks: at most 4 blocks a group, straddling
BATCH = 64


@pytest.fixture(scope="module")
def small_and_large(tmp_path_factory):
    """Two datasets of SHARDS zstd shards of int64 rows, 256 KB (16 blocks) and 2 MB (128 blocks) a shard."""
    root = tmp_path_factory.mktemp("blocks")
    out = {}
    for name, rows in (("small", SHARDS * (32 << 10)), ("large", SHARDS * (256 << 10))):
        source = root / f"{name}.parquet"
        pq.write_table(pa.table({"x": np.arange(rows, dtype=np.int64)}), source, compression="none")
        tierflow.pack([source], root / name, workers=1, target_shard_bytes=rows * 8 // SHARDS,
                      block_bytes=BLOCK_BYTES)
        out[name] = root / name
    return out


def first_batch_blocks(path, **options) -> tuple[int, np.ndarray]:
    dataset = TieredDataset(path, batch_size=BATCH, partitions=SHARDS, **options)
    loader = Loader(dataset)
    try:
        batch = next(iter(loader))
        return dataset._open().dataset.source.blocks_read, np.asarray(batch["x"])
    finally:
        loader.close()


def test_the_first_batch_reads_the_same_few_blocks_at_8x_the_size(small_and_large):
    small, _ = first_batch_blocks(small_and_large["small"], group_bytes=GROUP_BYTES)
    large, _ = first_batch_blocks(small_and_large["large"], group_bytes=GROUP_BYTES)
    assert large <= 4 and small <= 4, (small, large)
    full_window, _ = first_batch_blocks(small_and_large["large"], group_bytes=0)
    assert full_window >= 8 * large, (full_window, large)  # what the window shuffle read


def test_a_resumed_first_batch_reads_as_few_blocks(small_and_large):
    path = small_and_large["large"]
    loader = Loader(TieredDataset(path, batch_size=BATCH, partitions=SHARDS, group_bytes=GROUP_BYTES))
    for step, _ in enumerate(loader):
        if step == 20:
            state = loader.state_dict()
            break
    loader.close()
    blocks, _ = first_batch_blocks(path, resume=state)
    assert blocks <= 4


@pytest.mark.parametrize("saved_with", [0, GROUP_BYTES])
def test_a_resume_continues_the_shuffle_its_cursor_was_saved_with(small_and_large, saved_with):
    """A cursor saved under the window shuffle (as every cursor before block groups was) resumes it."""
    path = small_and_large["small"]
    loader = Loader(TieredDataset(path, batch_size=BATCH, partitions=SHARDS, group_bytes=saved_with))
    seen = []
    for step, batch in enumerate(loader):
        seen.append(np.asarray(batch["x"]).copy())
        if step == 2:
            state = loader.state_dict()
        if step == 5:
            break
    loader.close()
    assert ("group_bytes" in json.dumps(state)) == bool(saved_with)
    resumed = Loader(TieredDataset(path, batch_size=BATCH, partitions=SHARDS, resume=state))
    loaded = Loader(TieredDataset(path, batch_size=BATCH, partitions=SHARDS))  # the Stateful way
    loaded.load_state_dict(state)
    for loader in (resumed, loaded):
        again = [np.asarray(b["x"]).copy() for _, b in zip(range(3), loader)]
        loader.close()
        assert all(np.array_equal(a, b) for a, b in zip(again, seen[3:]))


def test_a_start_makes_block_records_only_for_the_blocks_it_reads(small_and_large):
    """The manifest lists every block of every shard (64 and 512 here); a start makes a record only
    of those its first batch reads (and block 0 of each shard it opens, for the schema), so what it
    pays for the block lists does not grow with the dataset."""
    made = {}
    for name, path in small_and_large.items():
        dataset = TieredDataset(path, batch_size=BATCH, partitions=SHARDS, group_bytes=GROUP_BYTES)
        shards = dataset.manifest.shards
        assert sum(s.blocks.made for s in shards) == 0  # the order and the index read the columns alone
        loader = Loader(dataset)
        next(iter(loader))
        source = dataset._open().dataset.source
        made[name] = sum(s.blocks.made for s in shards)
        assert 1 <= made[name] <= source.blocks_read + source.opens, (name, made[name], source.blocks_read)
        loader.close()
    assert max(made.values()) <= 4 + SHARDS, made
