"""The first batch decodes a bounded number of blocks whatever the dataset's size (issue 17): the
block-group shuffle against the full-window one, counted in blocks read, on real zstd shards."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import tierflow
from tierflow.loader import Loader, TieredDataset, BatchSpec, OrderSpec
from tierflow.loader.spec import specs_from

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
        tierflow.pack([source], root / name, workers=1, target_shard_bytes=rows * 8 // SHARDS, block_bytes=BLOCK_BYTES)
        out[name] = root / name
    return out


def first_batch_blocks(path, **options) -> tuple[int, np.ndarray]:
    options = {"batch_size": BATCH, "partitions": SHARDS, **options}
    batching, order = specs_from(options)
    dataset = TieredDataset(path, batching, order, **options)
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


def test_with_the_default_groups_the_first_batch_reads_a_few_blocks_at_any_size(small_and_large):
    """No group_bytes given: a group is a run of about 256 KiB (the packer's smallest block), so the
    first batch, from a start and from a resume, decodes at most those 16 blocks and the two a run
    straddles, whether a shard holds 256 KB or 8x that (4 MiB groups read all 128 of a large shard)."""
    read = {}
    for name, path in small_and_large.items():
        loader = Loader(TieredDataset(path, BatchSpec(batch_size=BATCH), OrderSpec(partitions=SHARDS)))
        for step, _ in enumerate(loader):
            if step == 20:
                state = loader.state_dict()
                break
        loader.close()
        read[name] = [first_batch_blocks(path)[0], first_batch_blocks(path, resume=state)[0]]
    assert max(read["small"] + read["large"]) <= (256 << 10) // BLOCK_BYTES + 2, read


def test_a_resumed_first_batch_reads_as_few_blocks(small_and_large):
    path = small_and_large["large"]
    loader = Loader(
        TieredDataset(path, BatchSpec(batch_size=BATCH), OrderSpec(partitions=SHARDS, group_bytes=GROUP_BYTES))
    )
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
    loader = Loader(
        TieredDataset(path, BatchSpec(batch_size=BATCH), OrderSpec(partitions=SHARDS, group_bytes=saved_with))
    )
    seen = []
    for step, batch in enumerate(loader):
        seen.append(np.asarray(batch["x"]).copy())
        if step == 2:
            state = loader.state_dict()
        if step == 5:
            break
    loader.close()
    assert ("group_bytes" in json.dumps(state)) == bool(saved_with)
    resumed = Loader(TieredDataset(path, BatchSpec(batch_size=BATCH), OrderSpec(partitions=SHARDS), resume=state))
    loaded = Loader(TieredDataset(path, BatchSpec(batch_size=BATCH), OrderSpec(partitions=SHARDS)))  # the Stateful way
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
        dataset = TieredDataset(
            path, BatchSpec(batch_size=BATCH), OrderSpec(partitions=SHARDS, group_bytes=GROUP_BYTES)
        )
        shards = dataset.manifest.shards
        assert sum(s.blocks.made for s in shards) == 0  # the order and the index read the columns alone
        loader = Loader(dataset)
        next(iter(loader))
        source = dataset._open().dataset.source
        made[name] = sum(s.blocks.made for s in shards)
        assert 1 <= made[name] <= source.blocks_read + source.opens, (name, made[name], source.blocks_read)
        loader.close()
    assert max(made.values()) <= 4 + SHARDS, made


def test_a_cursor_saved_before_the_sample_floor_resumes_its_order(small_and_large):
    """A cursor of the 4 MiB default without group_samples (its config hashed as then) resumes, with
    the floor it was saved with (none), exactly where it stopped."""
    path = small_and_large["small"]
    loader = Loader(TieredDataset(path, BatchSpec(batch_size=BATCH), OrderSpec(partitions=SHARDS, group_bytes=4 << 20)))
    seen = []
    for step, batch in enumerate(loader):
        seen.append(np.asarray(batch["x"]).copy())
        if step == 2:
            state = json.loads(json.dumps(loader.state_dict()))
        if step == 5:
            break
    loader.close()
    order = state["cursor"]["order"]
    assert order["config"].pop("group_samples") == 1024
    canonical = json.dumps(order["config"], sort_keys=True, separators=(",", ":"))
    order["config_hash"] = hashlib.sha256(canonical.encode()).hexdigest()[:32]
    dataset = TieredDataset(path, BatchSpec(batch_size=BATCH), OrderSpec(partitions=SHARDS), resume=state)
    assert dataset.order.group_samples == 0 and dataset.order.config_hash == order["config_hash"]
    resumed = Loader(dataset)
    again = [np.asarray(b["x"]).copy() for _, b in zip(range(3), resumed)]
    resumed.close()
    assert all(np.array_equal(a, b) for a, b in zip(again, seen[3:]))
