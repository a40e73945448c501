"""The tier stack over a damaged source and in its less travelled paths, with real files: shard
bytes that never verify reach the reader as a typed error naming the shard (after the fetch
attempts) and no tier admits them; a shard no tier keeps is read block by block from the source,
each block verified, and an upper tier above such a tier fills from the source; a staging copy that cannot be read sends the reader to the source; tiers
out of order are refused; a pickled stack, an undeclared reader's working set and a larger
declaration behave as the workers and the stager rely on.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import tierflow
from tierflow.errors import FetchError, ShardCorruptError
from tierflow.format.manifest import Manifest
from tierflow.storage import datasets
from tierflow.storage.remote import RetryPolicy, open_store
from tierflow.testing.faults import write_corpus
from tierflow.tiers.stack import TierStack
from tierflow.tiers.tier import Tier


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(RetryPolicy, "delay", lambda self, attempt, rng=None: 0.0)


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("stack-errors")
    src = write_corpus(root / "raw.jsonl", docs=600, seed=11)
    tierflow.pack(
        [src],
        root / "packed",
        workers=1,
        target_shard_bytes=256 << 10,
        tokenizer="bytes",
        keep_text=True,
        block_bytes=64 << 10,
    )
    return root / "packed"


def damaged(packed: Path, tmp_path: Path) -> tuple[Path, str]:
    """A copy of the dataset whose first shard has one byte flipped inside its second block (size kept)."""
    local = tmp_path / "l4"
    shutil.copytree(packed, local)
    info = Manifest.load(local).shards[0]
    data = bytearray((local / info.name).read_bytes())
    data[info.blocks[1].offset + 10] ^= 0x01
    (local / info.name).write_bytes(bytes(data))
    return local, info.name


@pytest.mark.parametrize("form", ["at_rest", "decoded"])
def test_source_bytes_that_never_verify_are_a_typed_error_and_no_tier_admits_them(packed, tmp_path, form) -> None:
    local, name = damaged(packed, tmp_path)
    tier = Tier(tmp_path / "l2", 1 << 30, form=form, name="L2")
    stack = TierStack(open_store(str(local)), [tier])
    with pytest.raises(FetchError, match=name.removeprefix("shard-").removesuffix(".arrow")):
        stack.dataset()[0]
    # fetched again, each copy refused: at admission (at rest) or before decoding (decoded)
    assert stack.m_source_bytes.value == tier.fetch_attempts * Manifest.load(local).shards[0].bytes
    assert not list((tmp_path / "l2" / "entries").iterdir()) and not tier.index.entries()
    assert not [p for p in (tmp_path / "l2" / "tmp").iterdir()]  # no temporary left either


def test_a_shard_no_tier_keeps_is_read_block_by_block_and_a_damaged_block_refused(
    packed, tmp_path, monkeypatch
) -> None:
    """A tier smaller than a shard keeps none, and no staging area was declared: each read is
    served from memory, the source's blocks fetched as they are used (in runs up to the readahead
    budget) and each verified, as a reader without tiers reads them; the block that fails is
    named, as that reader names it."""
    tiny = Tier(tmp_path / "l2", 1 << 10, form="at_rest", name="L2")
    stack = TierStack(open_store(str(packed)), [tiny])
    first = Manifest.load(packed).shards[0]
    monkeypatch.setattr(datasets, "READAHEAD_BYTES", first.blocks[0].length)  # a run of one block
    assert stack.dataset()[0]["id"] == 0 and stack.m_served["memory"].value == 1
    assert stack.m_source_bytes.value == first.blocks[0].length  # block 0 only, once, not the shard
    monkeypatch.undo()
    local, name = damaged(packed, tmp_path)
    stack = TierStack(open_store(str(local)), [Tier(tmp_path / "l2b", 1 << 10, form="at_rest", name="L2")])
    ds = stack.dataset()
    assert ds[0]["id"] == 0  # block 0 is sound
    with pytest.raises(ShardCorruptError) as raised:
        ds[first.blocks[0].rows]  # the first row of block 1
    with pytest.raises(ShardCorruptError) as directly:
        tierflow.open_dataset(local.as_uri())[first.blocks[0].rows]
    assert name in str(raised.value) and "block 1" in str(raised.value) and str(raised.value) == str(directly.value)


def test_a_stack_with_an_at_rest_tier_above_a_decoded_one_is_refused(tmp_path) -> None:
    upper = Tier(tmp_path / "l1", 1 << 20, form="at_rest", name="L1")
    lower = Tier(tmp_path / "l2", 1 << 20, form="decoded", name="L2")
    with pytest.raises(ValueError, match="tier L1 stores at-rest shards above L2, which stores decoded ones"):
        TierStack(open_store(str(tmp_path)), [upper, lower])


def test_a_stack_pickled_for_a_spawned_worker_reopens_its_tiers_and_shares_the_staging_area(packed, tmp_path) -> None:
    """What a spawn/forkserver DataLoader worker gets: the configuration, not the parent's index
    connections or locks; the parent's staging area is used, not a second one made."""
    import pickle

    from tierflow.policies.auto import Lifecycle

    stack = TierStack(open_store(str(packed)), [Tier(tmp_path / "l2", 1 << 30, form="at_rest", name="L2")])
    ds = stack.dataset()
    stack.declare(Lifecycle(passes=2, pattern="reshuffle"), working_bytes=8 << 20, open_shards=2)
    assert stack.staging is not None
    child = pickle.loads(pickle.dumps(stack))
    assert child is not stack and child.staging is not None and child.staging.root == stack.staging.root
    assert (child.dataset_id, child.max_open, child.staging_bytes) == (stack.dataset_id, 2, stack.staging_bytes)
    assert [t.root for t in child.tiers] == [t.root for t in stack.tiers] and child.tiers[0] is not stack.tiers[0]
    served = {c["name"] for c in child.registry.snapshot()["counters"] if c["labels"].get("tier") == "staging"}
    assert "tierflow_stack_served_total" in served and "stack_served" not in served  # Prometheus names
    again = child.dataset()
    assert [again[i]["id"] for i in (0, 311, len(ds) - 1)] == [0, 311, len(ds) - 1]
    assert all((again[i]["tokens"] == ds[i]["tokens"]).all() for i in (0, 311, len(ds) - 1))


def test_an_undeclared_reader_that_comes_back_to_a_dropped_shard_keeps_more_open(packed, tmp_path) -> None:
    """Without a declaration the stack guesses its reader's working set: a shard it dropped and
    is asked for again means the set is larger than what it keeps open, so it keeps one more."""
    stack = TierStack(open_store(str(packed)), [Tier(tmp_path / "l2", 1 << 30, form="at_rest", name="L2")], max_open=1)
    infos = stack.manifest().shards
    for index in (0, 1, 0, 1):
        stack.open_shard(index, infos[index])
    assert stack.max_open == 2  # grew once, then both stayed open
    assert stack.tiers[0].m_hits.value == 1  # the second visit of shard 0 was a hit; shard 1's an open table


def test_a_larger_declaration_replaces_the_staging_area_with_a_larger_one(packed, tmp_path) -> None:
    from tierflow.policies.auto import Lifecycle

    stack = TierStack(open_store(str(packed)), [Tier(tmp_path / "l2", 1 << 30, form="at_rest", name="L2")])
    shards = stack.manifest().shards
    decoded_per_byte = sum(s.decoded_bytes for s in shards) / sum(s.bytes for s in shards)
    stack.declare(Lifecycle(), working_bytes=1 << 20, open_shards=2)
    first = stack.staging
    stack.declare(Lifecycle(), working_bytes=1 << 20, open_shards=2)  # the same: kept
    assert stack.staging is first
    stack.declare(Lifecycle(), working_bytes=4 << 20, open_shards=2)
    # the working set is declared in the top tier's form (at rest) and staged decoded
    assert stack.staging is not first and stack.staging.configured_capacity == int((4 << 20) * decoded_per_byte)


def test_an_upper_tier_fills_from_the_source_when_the_tier_below_keeps_nothing(packed, tmp_path) -> None:
    upper = Tier(tmp_path / "l1", 1 << 30, form="at_rest", name="L1")
    lower = Tier(tmp_path / "l2", 1 << 10, form="at_rest", name="L2")  # smaller than any shard
    stack = TierStack(open_store(str(packed)), [upper, lower])
    info = stack.manifest().shards[0]
    handle = stack.ensure(info)
    assert handle is not None and handle.tier == "L1" and handle.served_by == "source"
    handle.release()
    assert upper.path_of(info.key).stat().st_size == info.bytes and not lower.index.entries()
    assert stack.m_served["memory"].value == 0 and stack.m_source_bytes.value == info.bytes  # downloaded once


def test_a_staging_area_copy_that_cannot_be_read_is_read_from_the_source(packed, tmp_path) -> None:
    """No tier keeps the shard, so it is read through the staging area; that area's device
    failing every read sends the reader to the source (into memory), the samples unchanged."""
    from tierflow.policies.auto import Lifecycle
    from tierflow.testing.faults import FailNth

    expected = [tierflow.open_dataset(packed)[i]["id"] for i in range(0, 600, 50)]
    stack = TierStack(open_store(str(packed)), [Tier(tmp_path / "l2", 1 << 10, form="at_rest", name="L2")])
    ds = stack.dataset()
    stack.declare(Lifecycle(), working_bytes=8 << 20, open_shards=2)
    assert stack.staging is not None
    with FailNth(1, [stack.staging.root / "entries"], ops=("read",), persistent=True) as faults:
        got = [ds[i]["id"] for i in range(0, 600, 50)]
    assert faults.fired is not None and got == expected
    assert stack.m_served["memory"].value >= 1 and stack.staging.m_corruptions.value >= 1
