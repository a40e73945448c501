"""The tier stack over a damaged source, with real files: shard bytes that never verify reach the
reader as a typed error naming the shard (after the fetch attempts), and no tier admits them;
sound bytes no tier keeps are verified in memory; a stack whose tiers are out of order is refused.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import tierflow
from tierflow.errors import FetchError, ShardCorruptError
from tierflow.format.manifest import Manifest
from tierflow.storage.remote import RetryPolicy, open_source
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
    tierflow.pack([src], root / "packed", workers=1, target_shard_bytes=256 << 10, tokenizer="bytes",
                  keep_text=True, block_bytes=64 << 10)
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
    stack = TierStack(open_source(str(local)), [tier])
    with pytest.raises(FetchError, match=name.removeprefix("shard-").removesuffix(".arrow")):
        stack.dataset()[0]
    # fetched again, each copy refused: at admission (at rest) or before decoding (decoded)
    assert stack.m_source_bytes.value == tier.fetch_attempts * Manifest.load(local).shards[0].bytes
    assert not list((tmp_path / "l2" / "entries").iterdir()) and not tier.index.entries()
    assert not [p for p in (tmp_path / "l2" / "tmp").iterdir()]  # no temporary left either


def test_a_shard_no_tier_keeps_is_verified_in_memory_and_a_damaged_one_refused(packed, tmp_path) -> None:
    """A tier smaller than a shard keeps none, and no staging area was declared: each read is
    served from memory, after its bytes verified against the manifest."""
    tiny = Tier(tmp_path / "l2", 1 << 10, form="at_rest", name="L2")
    stack = TierStack(open_source(str(packed)), [tiny])
    assert stack.dataset()[0]["id"] == 0 and stack.m_served["memory"].value == 1
    local, name = damaged(packed, tmp_path)
    stack = TierStack(open_source(str(local)), [Tier(tmp_path / "l2b", 1 << 10, form="at_rest", name="L2")],
                      fetch_attempts=2)
    with pytest.raises(ShardCorruptError, match=rf"shard {name} from .*: bytes do not match the manifest"):
        stack.dataset()[0]
    assert stack.m_source_bytes.value == 2 * Manifest.load(local).shards[0].bytes  # both attempts read it whole


def test_a_stack_with_an_at_rest_tier_above_a_decoded_one_is_refused(tmp_path) -> None:
    upper = Tier(tmp_path / "l1", 1 << 20, form="at_rest", name="L1")
    lower = Tier(tmp_path / "l2", 1 << 20, form="decoded", name="L2")
    with pytest.raises(ValueError, match="tier L1 stores at-rest shards above L2, which stores decoded ones"):
        TierStack(open_source(str(tmp_path)), [upper, lower])


def test_a_stack_pickled_for_a_spawned_worker_reopens_its_tiers_and_shares_the_staging_area(packed, tmp_path) -> None:
    """What a spawn/forkserver DataLoader worker gets: the configuration, not the parent's index
    connections or locks; the parent's staging area is used, not a second one made."""
    import pickle

    from tierflow.policies.auto import Lifecycle

    stack = TierStack(open_source(str(packed)), [Tier(tmp_path / "l2", 1 << 30, form="at_rest", name="L2")])
    ds = stack.dataset()
    stack.declare(Lifecycle(passes=2, pattern="reshuffle"), working_bytes=8 << 20, open_shards=2)
    assert stack.staging is not None
    child = pickle.loads(pickle.dumps(stack))
    assert child is not stack and child.staging is not None and child.staging.root == stack.staging.root
    assert (child.dataset_id, child.max_open, child.staging_bytes) == (stack.dataset_id, 2, stack.staging_bytes)
    assert [t.root for t in child.tiers] == [t.root for t in stack.tiers] and child.tiers[0] is not stack.tiers[0]
    again = child.dataset()
    assert [again[i]["id"] for i in (0, 311, len(ds) - 1)] == [0, 311, len(ds) - 1]
    assert all((again[i]["tokens"] == ds[i]["tokens"]).all() for i in (0, 311, len(ds) - 1))
