"""A shard read from a store is fetched in runs of blocks (`RangeBlocks`): each block once while the
blocks fetched fit their bound (`HeldBlocks`), at most twice past it, never more held than the bound."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

import tierflow
from tierflow.errors import ShardCorruptError
from tierflow.format.manifest import Manifest
from tierflow.format.reader import ShardReader
from tierflow.storage.datasets import HeldBlocks, RangeBlocks, StoreBlocks
from tierflow.storage.remote import open_store
from tierflow.testing.faults import write_corpus


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("readahead")
    raw = write_corpus(root / "raw.jsonl", docs=2000, seed=5)
    tierflow.pack([raw], root / "ds", workers=1, target_shard_bytes=1 << 20, tokenizer="bytes", block_bytes=64 << 10)
    return root / "ds"


def fetches(packed: Path, readahead: int, max_held: int, order: list[int]) -> tuple[list[int], int, HeldBlocks]:
    """(bytes of each ranged read, most bytes held at once, the bound) reading blocks in `order`."""
    info = Manifest.load(packed).shards[0]
    sizes: list[int] = []
    held = HeldBlocks(max_held)
    blocks = RangeBlocks(open_store(str(packed)), info, lambda n, _: sizes.append(n), readahead, held)
    most = 0
    for b in order:
        assert blocks.checked(b, info.name).size == info.blocks[b].length
        most = max(most, held.bytes)
    return sizes, most, held


def test_a_shard_read_in_any_order_is_fetched_once_in_runs(packed) -> None:
    info = Manifest.load(packed).shards[0]
    n = len(info.blocks)
    assert n >= 8
    order = random.Random(0).sample(range(n), n)
    sizes, _, _ = fetches(packed, 1 << 30, 1 << 30, order)
    total = sum(b.length for b in info.blocks)
    assert sizes == [total]  # every block in one read: the shard is smaller than the budget
    budget = 3 * max(b.length for b in info.blocks)
    sizes, _, held = fetches(packed, budget, 1 << 30, order)
    assert sum(sizes) == total and len(sizes) <= -(-total // (budget // 3)) and max(sizes) <= budget
    assert held.bytes == total and not held.dropped  # every block used, and kept while there is room
    sizes, _, held = fetches(packed, budget, 1 << 30, order + order)  # read again (a decoded cache let them go)
    assert sum(sizes) == total  # from memory, not the store


def test_blocks_fetched_ahead_stay_within_their_bound_and_cost_at_most_one_refetch(packed) -> None:
    info = Manifest.load(packed).shards[0]
    n = len(info.blocks)
    largest = max(b.length for b in info.blocks)
    order = random.Random(1).sample(range(n), n)
    sizes, most, held = fetches(packed, 4 * largest, 2 * largest, order)
    assert most <= 2 * largest + largest  # the bound, plus the block being read
    total = sum(b.length for b in info.blocks)
    assert held.dropped and total < sum(sizes) <= 2 * total, (held.dropped, sum(sizes), total)


def test_a_reader_of_a_damaged_run_names_the_block(packed, tmp_path) -> None:
    import shutil

    local = tmp_path / "damaged"
    shutil.copytree(packed, local)
    info = Manifest.load(local).shards[0]
    data = bytearray((local / info.name).read_bytes())
    data[info.blocks[2].offset + 7] ^= 0x01
    (local / info.name).write_bytes(bytes(data))
    reader = ShardReader(StoreBlocks(open_store(str(local))), Manifest.load(local).schema)
    table = reader.open_shard(0, info)
    table.block(1)  # fetched with block 2 in one run; only block 2 is refused, when used
    for _ in range(2):  # refused on every attempt, each read from the store again (not kept)
        with pytest.raises(ShardCorruptError, match=f"shard {info.name}.*block 2"):
            table.block(2)
    assert not reader.blocks.held.holds(info.name, 2)
