"""A tier directory deleted, or its index damaged, under a running reader (issue 36, item 4).

An operator frees a full disk by deleting a tier directory while a job reads through it; a tier
index is truncated under a running process. Before: the reader died with an untyped
FileNotFoundError, and the next connection to the truncated index waited 60 s for
`sqlite3.OperationalError: database is locked`. Now the tier that vanished or broke is bypassed,
every read served from the tier below (or the source), with one TierUnavailableWarning naming
the tier directory, and nothing waits.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import threading
import time
import warnings
from pathlib import Path

import pytest

import tierflow
from tierflow.errors import TierIndexError, TierUnavailableWarning
from tierflow.storage.remote import open_store
from tierflow.tiers.stack import TierStack
from tierflow.tiers.entries import INDEX_NAME
from tierflow.tiers.tier import Tier


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("vanished")
    with open(root / "raw.jsonl", "w") as f:
        for i in range(2400):
            f.write(json.dumps({"text": f"doc {i} " + "lorem ipsum " * (i % 37)}) + "\n")
    tierflow.pack([root / "raw.jsonl"], root / "ds", tokenizer="bytes", workers=1, target_shard_bytes=256 << 10)
    return root / "ds"


def samples(ds) -> list:
    return [{k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in ds[i].items()} for i in range(len(ds))]


def stack_of(packed: Path, where: Path, form: str) -> tuple[Tier, Tier, TierStack]:
    l1 = Tier(where / "l1", 1 << 30, name="L1", form="decoded", ram=False)
    l2 = Tier(where / "l2", 1 << 30, name="L2", form=form, ram=False)
    return l1, l2, TierStack(open_store(str(packed)), [l1, l2])


def unavailable(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, TierUnavailableWarning)]


@pytest.mark.slow
@pytest.mark.parametrize("form", ["at_rest", "decoded"])
@pytest.mark.parametrize("deleted", ["l1", "l2", "both"])
def test_a_tier_directory_deleted_under_a_reader_is_bypassed_with_one_typed_warning(packed, tmp_path, form, deleted):
    expected = samples(tierflow.open_dataset(packed))
    l1, l2, stack = stack_of(packed, tmp_path, form)
    ds = stack.dataset()
    ds[0]  # the first shard admitted into both tiers and held open
    gone = {"l1": [l1], "l2": [l2], "both": [l1, l2]}[deleted]
    for tier in gone:
        shutil.rmtree(tier.root)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert samples(ds) == expected
        assert samples(stack.dataset()) == expected  # and again: nothing more is warned
    said = unavailable(caught)
    assert len(said) == len(gone), said
    for tier in gone:
        assert tier.unavailable is not None and tier.m_unavailable.value >= 1
        assert sum(f"tier {tier.name} ({tier.root})" in m and "vanished" in m for m in said) == 1
        assert not tier.root.exists()  # bypassed, not made again under the operator's feet
    for tier in {l1, l2} - set(gone):
        assert tier.unavailable is None


def test_a_tier_directory_replaced_under_a_reader_is_bypassed(packed, tmp_path):
    """Deleted, then made again by another process (a new job's Tier): this process's index
    connection is the old, deleted one, so it must not write entries beside the new index."""
    expected = samples(tierflow.open_dataset(packed))
    _, l2, stack = stack_of(packed, tmp_path, "at_rest")
    ds = stack.dataset()
    ds[0]
    shutil.rmtree(tmp_path / "l1")  # nothing in L1: every read goes to L2
    shutil.rmtree(l2.root)
    Tier(l2.root, 1 << 30, name="L2", form="at_rest", ram=False)  # another process sets it up anew
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert samples(ds) == expected
    assert any("L2" in m and "replaced" in m for m in unavailable(caught))
    assert not list((l2.root / "entries").iterdir())


def test_a_loader_keeps_its_batches_when_its_l2_is_deleted_mid_epoch(packed, tmp_path):
    """The loader's stager thread and its reader both meet the vanished tier."""

    def loader(where: Path):
        return tierflow.open_loader(str(packed), tiers=[f"L2={where}:64MB:lru:at_rest"], batch_size=16, seq_len=64)

    golden = loader(tmp_path / "golden")
    expected = [b["input_ids"].numpy().tobytes() for b in golden]
    golden.close()
    running = loader(tmp_path / "l2")
    got = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for i, batch in enumerate(running):
                got.append(batch["input_ids"].numpy().tobytes())
                if i == 2:  # gone at once (the stager thread may be writing into it: rmtree alone races it)
                    os.rename(tmp_path / "l2", tmp_path / "l2-deleted")
                    shutil.rmtree(tmp_path / "l2-deleted", ignore_errors=True)
        finally:
            running.close()
    assert got == expected
    said = unavailable(caught)
    assert said and all(str(tmp_path / "l2") in m for m in said)


def _truncate_index(root: Path) -> Path:
    index = root / INDEX_NAME
    os.truncate(index, 0)
    return index


def test_an_index_truncated_under_a_running_process_is_bypassed_at_once(packed, tmp_path):
    """The next connection (here a new thread's) to an index truncated to nothing beside its live
    write-ahead log waited 60 s for 'database is locked'; now the tier is bypassed at once."""
    expected = samples(tierflow.open_dataset(packed))
    l2 = Tier(tmp_path / "l2", 1 << 30, name="L2", form="at_rest", ram=False)
    stack = TierStack(open_store(str(packed)), [l2])
    ds = stack.dataset()
    ds[0]
    _truncate_index(l2.root)
    result: dict = {}

    def read() -> None:
        try:
            result["samples"] = samples(stack.dataset())
        except BaseException as e:
            result["error"] = e

    started = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reader = threading.Thread(target=read)
        reader.start()
        reader.join(30)
        assert samples(ds) == expected  # the main thread, its connection open before
    assert not reader.is_alive() and "error" not in result, result.get("error")
    assert result["samples"] == expected
    assert time.monotonic() - started < 10
    said = unavailable(caught)
    assert len(said) == 1 and f"({l2.root})" in said[0] and "index" in said[0] and "truncated" in said[0]


def test_a_new_tier_on_an_index_truncated_under_a_running_process(packed, tmp_path):
    """A Tier a user opens on it is TierIndexError naming the file at once (not after 60 s); the
    same tier unpickled in a running job's worker is bypassed with the warning instead."""
    running = Tier(tmp_path / "l2", 1 << 30, name="L2", form="at_rest", ram=False)
    stack = TierStack(open_store(str(packed)), [running])
    stack.dataset()[0]
    index = _truncate_index(running.root)
    started = time.monotonic()
    with pytest.raises(TierIndexError, match=rf"{index}: .*truncated.*remove the tier directory"):
        Tier(tmp_path / "l2", 1 << 30, name="L2", form="at_rest", ram=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        worker = pickle.loads(pickle.dumps(running))
        assert worker.ensure("k", 1, "x", lambda tmp: tmp.write_bytes(b"1")) is None
    assert time.monotonic() - started < 10
    assert worker.unavailable is not None and len(unavailable(caught)) == 1
