"""A tier whose filesystem fills up under its index (SQLite) serves from the tier below."""

from __future__ import annotations

import json
import logging
import os
import subprocess
from pathlib import Path

import pytest

import tierflow
from tierflow.storage.remote import open_store
from tierflow.tiers.stack import TierStack
from tierflow.tiers.tier import Tier

WARNING = "its index cannot be written"


@pytest.fixture
def small_disk(small_tmpfs) -> Path:
    return small_tmpfs("2m")


def fill(directory: Path) -> Path:
    """Write a file until the filesystem has no byte left."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        for size in (1 << 16, 512, 1):
            try:
                while True:
                    os.write(fd, b"x" * size)
            except OSError:
                pass
    finally:
        os.close(fd)
    return filler


def samples(ds) -> list:
    return [{k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in s.items()} for s in ds]


@pytest.mark.parametrize("form", ["at_rest", "decoded"])
def test_a_full_disk_under_the_index_serves_from_below_warns_once_and_counts(tmp_path, small_disk, form, caplog):
    with open(tmp_path / "raw.jsonl", "w") as f:
        for i in range(2400):
            f.write(json.dumps({"text": f"doc {i} " + "lorem ipsum " * (i % 37)}) + "\n")
    tierflow.pack([tmp_path / "raw.jsonl"], tmp_path / "ds", workers=1, target_shard_bytes=256 << 10)
    expected = samples(tierflow.open_dataset(tmp_path / "ds"))

    def stack() -> tuple[Tier, TierStack]:
        tier = Tier(small_disk / "l2", 1 << 30, name="L2", form=form, ram=False)
        return tier, TierStack(open_store(str(tmp_path / "ds")), [tier])

    tier, running = stack()
    running.dataset()[0]  # one shard admitted while there was room
    filler = fill(small_disk)
    caplog.set_level(logging.WARNING, "tierflow.tiers")
    assert samples(running.dataset()) == expected  # the process that was running
    fresh, started = stack()
    assert samples(started.dataset()) == expected  # a process started on the full disk
    for t in (tier, fresh):
        assert t.m_index_unwritable.value >= 1
    assert sum(WARNING in r.getMessage() for r in caplog.records) == 2  # once per tier object
    assert not list((small_disk / "l2" / "tmp").iterdir())
    for row in fresh.index.entries():  # what the index lists is there, whole
        assert fresh.path_of(row.key).stat().st_size == row.size

    filler.unlink()  # room again: the next reader caches again
    again, restarted = stack()
    assert samples(restarted.dataset()) == expected
    assert again.m_promotions.value >= 1 and again.m_index_unwritable.value == 0
    assert {r.key for r in again.index.entries()} == {s.key for s in restarted.manifest().shards}


READER = """
import hashlib, json, sys
from tierflow.storage.remote import open_store
from tierflow.tiers.stack import TierStack
from tierflow.tiers.tier import Tier

tier = Tier(sys.argv[1], 1 << 30, name="L2", form=sys.argv[2], ram=False)
ds = TierStack(open_store(sys.argv[3]), [tier]).dataset()
rows = [ds[i] for i in range(int(sys.argv[4]) if len(sys.argv) > 4 else len(ds))]
digest = hashlib.sha256(json.dumps(rows, default=lambda v: v.tolist(), sort_keys=True).encode()).hexdigest()
print(json.dumps({"digest": digest, "unwritable": tier.m_index_unwritable.value, "snapshot": tier.snapshot()}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("form", ["at_rest", "decoded"])
def test_a_process_started_on_the_full_disk_opens_the_tier_and_serves_from_below(tmp_path, small_disk, form):
    """The index's WAL and shared-memory files went with the last process; a new one cannot make them."""
    import hashlib
    import sys

    with open(tmp_path / "raw.jsonl", "w") as f:
        for i in range(2400):
            f.write(json.dumps({"text": f"doc {i} " + "lorem ipsum " * (i % 37)}) + "\n")
    tierflow.pack([tmp_path / "raw.jsonl"], tmp_path / "ds", workers=1, target_shard_bytes=256 << 10)
    ds = tierflow.open_dataset(tmp_path / "ds")
    expected = hashlib.sha256(
        json.dumps([ds[i] for i in range(len(ds))], default=lambda v: v.tolist(), sort_keys=True).encode()
    ).hexdigest()

    def read(*extra: str) -> dict:
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "src")}
        done = subprocess.run(
            [sys.executable, "-c", READER, str(small_disk / "l2"), form, str(tmp_path / "ds"), *extra],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout)

    assert read("1")["unwritable"] == 0  # made the tier and cached a shard, then exited
    fill(small_disk)
    after = read()
    assert after["digest"] == expected and after["unwritable"] >= 1


def test_an_entry_the_full_index_cannot_record_is_removed_not_left_unaccounted(small_disk):
    """The disk fills between an entry's bytes landing and the index recording them (another job
    wrote meanwhile): the read is served from below (None), and the entry's file, which no row
    would account for, is removed with its reservation."""
    from tierflow.format._checksum import xxh3_128_hex

    data = os.urandom(64 << 10)
    tier = Tier(small_disk / "l2", 1 << 30, name="L2", form="at_rest", ram=False)

    def produce(tmp: Path) -> None:
        tmp.write_bytes(data)
        fill(small_disk)

    assert tier.ensure("k", len(data), xxh3_128_hex(data), produce) is None
    assert tier.m_index_unwritable.value >= 1 and not tier.path_of("k").exists()
    assert not list((small_disk / "l2" / "tmp").iterdir())
    (small_disk / "filler").unlink()
    assert tier.index.occupancy() == (0, 0)  # no row, no reservation left once the index writes again
