"""A dataset URL is read one way, whatever the entry point (issue 41, item 2).

`open_dataset`, `TieredDataset`, `open_loader` without tiers and a tier stack whose tiers keep
nothing all read a shard block by block: the store's request log (the loopback proxy in front of
moto) shows one ranged GET per block used, never a GET of a whole shard; a damaged block is
refused with the same error on each path, and `tierflow verify` names that block too.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import tierflow
from tierflow.commands.cli import main
from tierflow.errors import ShardCorruptError
from tierflow.format.dataset import Dataset, ShardSupply
from tierflow.format.manifest import Manifest
from tierflow.loader import BatchSpec, OrderSpec, TieredDataset
from tierflow.storage.remote import open_store, upload_dataset
from tierflow.testing import LoopbackProxy
from tierflow.testing.faults import write_corpus
from tierflow.tiers import Tier, TierStack


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("one-way")
    raw = write_corpus(root / "raw.jsonl", docs=600, seed=3)
    tierflow.pack([raw], root / "packed", workers=1, target_shard_bytes=256 << 10, tokenizer="bytes",
                  keep_text=True, block_bytes=64 << 10)
    return root / "packed"


def damaged_copy(packed: Path, tmp_path: Path) -> tuple[Path, str, int]:
    """The dataset with one byte flipped in block 1 of its first shard; that shard's name and the
    first row of the block."""
    local = tmp_path / "damaged"
    shutil.copytree(packed, local)
    info = Manifest.load(local).shards[0]
    data = bytearray((local / info.name).read_bytes())
    data[info.blocks[1].offset + 10] ^= 0x01
    (local / info.name).write_bytes(bytes(data))
    return local, info.name, info.blocks[0].rows


def first_rows(url: str, proxy: str, tmp_path: Path) -> dict[str, Callable[[int], Any]]:
    """Each entry point's way to read sample `i` of the dataset at `url`."""

    def stack_without_tiers(i: int) -> Any:
        return TierStack(open_store(url, endpoint_url=proxy)).dataset()[i]

    def stack_whose_tier_keeps_nothing(i: int) -> Any:  # smaller than any shard, no staging area declared
        tiny = Tier(tmp_path / f"tiny-{i}", 1 << 10, form="at_rest", name="L2")
        return TierStack(open_store(url, endpoint_url=proxy), [tiny]).dataset()[i]

    def tiered_dataset(i: int) -> Any:  # the shard supply a TieredDataset over the URL reads through
        dataset = TieredDataset(url, BatchSpec(batch_size=1), OrderSpec(seed=0), endpoint_url=proxy)
        supplies: list[ShardSupply] = []

        def keep(supply: ShardSupply) -> ShardSupply:
            supplies.append(supply)
            return supply

        dataset.wrap_shards(keep)
        return Dataset(dataset.manifest, supplies[0])[i]

    return {"open_dataset": lambda i: tierflow.open_dataset(url, endpoint_url=proxy)[i],
            "TieredDataset": tiered_dataset, "stack without tiers": stack_without_tiers,
            "stack whose tier keeps nothing": stack_whose_tier_keeps_nothing}


def shard_gets(proxy: LoopbackProxy) -> list[tuple[str, int, int]]:
    """(shard name, offset, length) of every GET of a shard object the proxy saw."""
    gets = []
    for record in proxy.traffic().records:
        name = record.path.rsplit("/", 1)[-1]
        if record.method == "GET" and name.startswith("shard-"):
            found = re.fullmatch(r"bytes=(\d+)-(\d+)", record.range or "")
            assert found is not None, f"a GET of {name} without a range: the whole shard"
            start, end = int(found[1]), int(found[2])
            gets.append((name, start, end - start + 1))
    return gets


def test_every_entry_point_reads_a_url_block_by_block(packed, s3_proxy, s3_bucket, tmp_path) -> None:
    url = f"s3://{s3_bucket}/ds"
    upload_dataset(packed, url, endpoint_url=s3_proxy.url)
    manifest = Manifest.load(packed)
    blocks = {(s.name, b.offset, b.length) for s in manifest.shards for b in s.blocks}
    expected = tierflow.open_dataset(packed)[0]["id"]
    first = manifest.shards[0]
    for path, read in first_rows(url, s3_proxy.url, tmp_path).items():
        s3_proxy.reset_counters()
        assert read(0)["id"] == expected, path
        # the sample's block, once (its head gave the schema): not the shard
        assert shard_gets(s3_proxy) == [(first.name, first.blocks[0].offset, first.blocks[0].length)], path
    s3_proxy.reset_counters()
    assert main(["inspect", url, "--endpoint-url", s3_proxy.url, "-n", "1"]) == 0
    assert shard_gets(s3_proxy) == [(first.name, first.blocks[0].offset, first.blocks[0].length)]
    s3_proxy.reset_counters()
    with tierflow.open_loader(url, endpoint_url=s3_proxy.url, batch_size=4) as loader:  # no tiers: a TierStack
        next(iter(loader))
    gets = shard_gets(s3_proxy)
    assert gets and set(gets) <= blocks, gets  # whole blocks, of the shards the first batch drew from
    opened = {name for name, _, _ in gets}
    assert len(gets) < sum(len(s.blocks) for s in manifest.shards if s.name in opened), gets


def test_a_damaged_block_is_refused_the_same_way_on_every_path(packed, s3_proxy, s3_bucket, tmp_path, capsys) -> None:
    local, name, row = damaged_copy(packed, tmp_path)
    url = f"s3://{s3_bucket}/damaged"
    upload_dataset(local, url, endpoint_url=s3_proxy.url)
    errors = {}
    for path, read in first_rows(url, s3_proxy.url, tmp_path).items():
        assert read(row - 1)["id"] == row - 1, path  # block 0 is sound
        with pytest.raises(ShardCorruptError) as raised:
            read(row)
        errors[path] = str(raised.value)
    assert len(set(errors.values())) == 1, errors
    message = next(iter(errors.values()))
    assert name in message and "block 1" in message, message
    with tierflow.open_loader(url, endpoint_url=s3_proxy.url, batch_size=4) as loader:
        with pytest.raises(ShardCorruptError) as raised:
            for _ in loader:  # an epoch reads every block
                pass
    assert message in str(raised.value)
    assert main(["verify", url, "--endpoint-url", s3_proxy.url]) == 1
    said = capsys.readouterr().err.replace("\n", " ")
    assert name in said and "block 1" in said, said
