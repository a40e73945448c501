"""A dataset URL is read one way, whatever the entry point (issue 41, item 2).

`open_dataset`, `TieredDataset`, `open_loader` without tiers and a tier stack whose tiers keep
nothing all read a shard in runs of whole blocks: the store's request log (the loopback proxy in
front of moto) shows one ranged GET per run of consecutive blocks (up to the readahead budget),
never a GET of a whole shard larger than that, and block 0 fetched once though the schema is read
from it first; a damaged block is
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
from tierflow.storage import datasets
from tierflow.storage.remote import open_store, upload_dataset
from tierflow.testing import LoopbackProxy
from tierflow.testing.faults import write_corpus
from tierflow.tiers import Tier, TierStack


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("one-way")
    raw = write_corpus(root / "raw.jsonl", docs=600, seed=3)
    tierflow.pack(
        [raw],
        root / "packed",
        workers=1,
        target_shard_bytes=256 << 10,
        tokenizer="bytes",
        keep_text=True,
        block_bytes=64 << 10,
    )
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

    return {
        "open_dataset": lambda i: tierflow.open_dataset(url, endpoint_url=proxy)[i],
        "TieredDataset": tiered_dataset,
        "stack without tiers": stack_without_tiers,
        "stack whose tier keeps nothing": stack_whose_tier_keeps_nothing,
    }


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


def block_runs(manifest: Manifest, gets: list[tuple[str, int, int]]) -> list[list[int]]:
    """The blocks each GET fetched (a GET of anything but a run of whole blocks fails)."""
    shards = {s.name: s for s in manifest.shards}
    runs = []
    for name, start, length in gets:
        edges = {b.offset: i for i, b in enumerate(shards[name].blocks)}
        ends = {b.offset + b.length: i for i, b in enumerate(shards[name].blocks)}
        assert start in edges and start + length in ends, (name, start, length)
        runs.append(list(range(edges[start], ends[start + length] + 1)))
    return runs


def test_every_entry_point_reads_a_url_in_runs_of_blocks(packed, s3_proxy, s3_bucket, tmp_path, monkeypatch) -> None:
    url = f"s3://{s3_bucket}/ds"
    upload_dataset(packed, url, endpoint_url=s3_proxy.url)
    manifest = Manifest.load(packed)
    expected = tierflow.open_dataset(packed)[0]["id"]
    first = manifest.shards[0]
    assert len(first.blocks) > 3
    budget = first.blocks[0].length + first.blocks[1].length  # a run of two blocks, not the shard
    monkeypatch.setattr(datasets, "READAHEAD_BYTES", budget)
    for path, read in first_rows(url, s3_proxy.url, tmp_path).items():
        s3_proxy.reset_counters()
        assert read(0)["id"] == expected, path
        # the sample's run, once (block 0's head gave the schema and is not fetched again): not the shard
        assert block_runs(manifest, shard_gets(s3_proxy)) == [[0, 1]], path
        assert {name for name, _, _ in shard_gets(s3_proxy)} == {first.name}
    s3_proxy.reset_counters()
    assert main(["inspect", url, "--endpoint-url", s3_proxy.url, "-n", "1"]) == 0
    assert block_runs(manifest, shard_gets(s3_proxy)) == [[0, 1]]
    s3_proxy.reset_counters()
    with tierflow.open_loader(url, endpoint_url=s3_proxy.url, batch_size=4) as loader:  # no tiers: a TierStack
        next(iter(loader))
    gets = shard_gets(s3_proxy)
    runs = block_runs(manifest, gets)  # runs of whole blocks, within the budget
    assert runs and all(len(run) == 1 or length <= budget for (_, _, length), run in zip(gets, runs)), gets
    opened = {name for name, _, _ in gets}
    assert len(gets) < sum(len(s.blocks) for s in manifest.shards if s.name in opened), gets


def test_the_loader_without_tiers_fetches_a_shard_in_one_get_per_run(packed, s3_proxy, s3_bucket) -> None:
    """An epoch of `open_loader(url)` without tiers costs about one ranged GET per shard read (each
    shard here is smaller than the readahead budget), and fetches each shard's bytes once."""
    url = f"s3://{s3_bucket}/epoch"
    upload_dataset(packed, url, endpoint_url=s3_proxy.url)
    manifest = Manifest.load(packed)
    assert all(s.bytes < datasets.READAHEAD_BYTES for s in manifest.shards)
    s3_proxy.reset_counters()
    with tierflow.open_loader(url, endpoint_url=s3_proxy.url, batch_size=4, seq_len=64) as loader:
        batches = sum(1 for _ in loader)
    gets = shard_gets(s3_proxy)
    read = {name for name, _, _ in gets}
    assert batches and len(read) >= len(manifest.shards) - 1, (len(read), len(manifest.shards))
    assert len(gets) <= len(read) + 3, gets
    fetched = sum(length for _, _, length in gets)
    assert fetched <= sum(s.bytes for s in manifest.shards if s.name in read) * 1.1, fetched
    block_runs(manifest, gets)  # runs of whole blocks


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
