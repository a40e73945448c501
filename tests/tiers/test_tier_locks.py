"""A tier's locks, races and clean-up with real files and kernel locks: a fetch lock whose holder
stays past the timeout is taken over (fetched anyway, counted); a pinned entry is never evicted;
`clean` removes what dead jobs left (temporaries, quarantined copies, entries and block lists
the index does not know) and nothing a live process or the index still owns.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tierflow.format._checksum import xxh3_128_hex
from tierflow.tiers.tier import Tier

DATA = b"entry bytes " * 1000


def produce(tmp: Path) -> None:
    tmp.write_bytes(DATA)


def test_a_fetch_lock_held_past_its_timeout_is_taken_over_and_the_entry_admitted(tmp_path: Path) -> None:
    tier = Tier(tmp_path / "l2", 1 << 20, name="L2", form="at_rest", lock_timeout=0.05)
    holder = os.open(tmp_path / "l2" / "locks" / "k1.lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(holder, fcntl.LOCK_EX)  # another open file: a slow fetcher on the node
    try:
        pin = tier.ensure("k1", len(DATA), xxh3_128_hex(DATA), produce)
    finally:
        os.close(holder)
    assert pin is not None and tier.m_takeovers.value == 1
    assert pin.path.read_bytes() == DATA and [r.key for r in tier.index.entries()] == ["k1"]
    pin.release()


def test_a_pinned_entry_is_never_evicted(tmp_path: Path) -> None:
    tier = Tier(tmp_path / "l2", 1 << 20, name="L2", form="at_rest")
    for key in ("a", "b"):
        tier.ensure(key, len(DATA), xxh3_128_hex(DATA), produce).release()
    pin = tier.lookup("a")
    assert pin is not None
    assert tier.evict(["a"]) == 0 and tier.path_of("a").exists()  # in use
    assert tier.evict() == 1 and not tier.path_of("b").exists()  # all: only the unpinned one goes
    pin.release()
    assert tier.evict() == 1 and not tier.index.entries()


def test_clean_removes_what_dead_jobs_left_and_nothing_still_owned(tmp_path: Path) -> None:
    tier = Tier(tmp_path / "l2", 1 << 20, name="L2", form="at_rest")
    tier.ensure("kept", len(DATA), xxh3_128_hex(DATA), produce).release()
    root = tmp_path / "l2"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(dead.stdout)
    leftovers = [root / "tmp" / f"k2.{dead_pid}.ab12cd34", root / "tmp" / "garbage", root / "quarantine" / "k3.ff00",
                 root / "entries" / "unknown.arrow", root / "blocks" / "orphan.json"]
    live = [root / "tmp" / f"k4.{os.getpid()}.0011aabb", root / "entries" / "kept.arrow"]
    for path in leftovers + live[:1]:
        path.write_bytes(b"x")
    unknown_pinned = root / "entries" / "busy.arrow"
    unknown_pinned.write_bytes(b"y")
    holder = os.open(unknown_pinned, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_SH)  # a process reading an entry the index lost
    try:
        assert tier.clean() == len(leftovers)
    finally:
        os.close(holder)
    assert not any(p.exists() for p in leftovers)
    assert all(p.exists() for p in live) and unknown_pinned.exists()
    pin = tier.lookup("kept")
    assert pin is not None  # the indexed entry is untouched
    pin.release()


def test_an_indexed_entry_whose_file_is_gone_is_a_miss_and_its_row_dropped(tmp_path: Path) -> None:
    """An evictor killed between unlinking an entry and committing its removal: a lookup finds
    the row without its file, takes it for a miss and drops the row; the next ensure fetches it."""
    tier = Tier(tmp_path / "l2", 1 << 20, name="L2", form="at_rest")
    tier.ensure("k", len(DATA), xxh3_128_hex(DATA), produce).release()
    tier.path_of("k").unlink()
    assert tier.lookup("k") is None and tier.index.get("k") is None
    pin = tier.ensure("k", len(DATA), xxh3_128_hex(DATA), produce)
    assert pin is not None and pin.path.read_bytes() == DATA and tier.m_misses.value == 2
    pin.release()


def test_quarantine_through_a_stale_pin_leaves_the_copy_another_process_put_back(tmp_path: Path) -> None:
    """A reader found a bad block in the copy it pins, but another process already replaced (or
    removed) that entry: quarantining through the stale pin must not move the new copy aside."""
    tier = Tier(tmp_path / "l2", 1 << 20, name="L2", form="at_rest")
    tier.ensure("k", len(DATA), xxh3_128_hex(DATA), produce).release()
    stale = tier.lookup("k")
    fresh = tmp_path / "l2" / "tmp" / "k.fresh"
    fresh.write_bytes(DATA)
    os.replace(fresh, tier.path_of("k"))  # the other process's new copy, under the same name
    assert tier.quarantine("k", "failed verification of block 0 on read", pin=stale) is False
    assert tier.path_of("k").exists() and tier.index.get("k") is not None and tier.m_corruptions.value == 0
    tier.path_of("k").unlink()  # and when the entry is gone altogether
    assert tier.quarantine("k", "failed verification of block 0 on read", pin=stale) is False
    stale.release()
    assert tier.lookup("k") is None  # a miss (its row dropped), not an error


def test_a_fill_failing_with_an_unexpected_error_leaves_no_temporary_and_no_reservation(tmp_path: Path) -> None:
    tier = Tier(tmp_path / "l2", 1 << 20, name="L2", form="at_rest")

    def broken(tmp: Path) -> None:
        tmp.write_bytes(DATA[:100])
        raise RuntimeError("the decoder crashed")

    with pytest.raises(RuntimeError, match="the decoder crashed"):
        tier.ensure("k", len(DATA), xxh3_128_hex(DATA), broken)
    assert not list((tmp_path / "l2" / "tmp").iterdir()) and not tier.path_of("k").exists()
    assert tier.index.occupancy() == (0, 0)  # neither resident nor reserved bytes


def test_a_tier_full_of_fresh_entries_under_nochurn_serves_a_new_one_from_below(tmp_path: Path) -> None:
    """A uniform reshuffle reads every entry once an epoch: churning one out for a new one costs
    a hit later, so the policy declines and the reader is served from the tier below (None)."""
    tier = Tier(tmp_path / "l2", 2 * len(DATA) + 100, policy="nochurn", name="L2", form="at_rest")
    for key in ("a", "b"):
        tier.ensure(key, len(DATA), xxh3_128_hex(DATA), produce).release()
    assert tier.ensure("c", len(DATA), xxh3_128_hex(DATA), produce) is None
    assert tier.m_bypass.value == 1 and sorted(tier.index.keys()) == ["a", "b"]
    assert not list((tmp_path / "l2" / "tmp").iterdir())


def test_an_index_transaction_failing_half_way_leaves_no_partial_accounting(tmp_path: Path) -> None:
    tier = Tier(tmp_path / "l2", 1 << 20, name="L2", form="at_rest")
    with pytest.raises(RuntimeError, match="in the middle"):
        with tier.index.transaction() as c:
            tier.index.reserve(c, "k", 4096)
            raise RuntimeError("in the middle")
    assert tier.index.occupancy() == (0, 0)
    with tier.index.transaction() as c:  # the connection is usable again
        tier.index.reserve(c, "k", 4096)
    assert tier.index.occupancy() == (0, 4096)


def test_only_a_full_or_failing_index_is_tolerated_other_sqlite_errors_are_raised(tmp_path: Path) -> None:
    import sqlite3

    tier = Tier(tmp_path / "l2", 1 << 20, name="L2", form="at_rest")
    trouble = tier._index_trouble
    with trouble.tolerated():
        raise sqlite3.OperationalError("database or disk is full")
    assert tier.m_index_unwritable.value == 1
    with pytest.raises(sqlite3.IntegrityError):
        with trouble.tolerated():
            raise sqlite3.IntegrityError("UNIQUE constraint failed: entries.key")
    assert tier.m_index_unwritable.value == 1
