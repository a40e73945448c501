"""A tier's locks, races and clean-up with real files and kernel locks: a fetch lock whose holder
stays past the timeout is taken over (fetched anyway, counted); a pinned entry is never evicted;
`clean` removes what dead jobs left (temporaries, quarantined copies, entries and block lists
the index does not know) and nothing a live process or the index still owns.
"""

from __future__ import annotations

import errno
import fcntl
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tierflow.errors import TierIndexError
from tierflow.format._checksum import xxh3_128_hex
from tierflow.policies.auto import Lifecycle
from tierflow.testing.faults import FailNth
from tierflow.tiers.tier import EntryHeat, Tier

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
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    dead_pid = int(dead.stdout)
    leftovers = [
        root / "tmp" / f"k2.{dead_pid}.ab12cd34",
        root / "tmp" / "garbage",
        root / "quarantine" / "k3.ff00",
        root / "entries" / "unknown.arrow",
        root / "blocks" / "orphan.json",
    ]
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


def _waiting_on(path: Path) -> bool:
    """Whether some process waits for a flock on `path` (/proc/locks lists waiters as `-> ...`)."""
    st = os.stat(path)
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    return any("->" in line and line.split()[-3] == inode for line in Path("/proc/locks").read_text().splitlines())


def _locked_copy(tier: Tier, name: str) -> tuple[Path, int]:
    """A new copy of the entry, held exclusively as an evictor holds the file it is about to replace."""
    copy = tier.root / "tmp" / name
    copy.write_bytes(DATA)
    fd = os.open(copy, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return copy, fd


def _lookup_behind_evictor(tier: Tier, replacements: int) -> tuple[object, int]:
    """A reader's lookup started while an evictor holds the entry; the entry is replaced under it
    `replacements` times, each time just after the reader's pin has opened the old copy and waits."""
    result: list = []
    held = os.open(tier.path_of("k"), os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)
    reader = threading.Thread(target=lambda: result.append(tier.lookup("k", verify=False)))
    reader.start()
    try:
        for i in range(replacements):
            while not _waiting_on(tier.path_of("k")):
                time.sleep(0.001)
            copy, fd = _locked_copy(tier, f"k.copy{i}")
            os.replace(copy, tier.path_of("k"))
            os.close(held)  # the old copy's lock goes: the reader's pin takes it, finds it replaced
            held = fd
    finally:
        os.close(held)
        reader.join()
    return result[0], os.stat(tier.path_of("k")).st_ino


def test_a_pin_taken_while_the_entry_is_replaced_pins_the_new_copy(tmp_path: Path) -> None:
    tier = Tier(tmp_path / "l2", 1 << 20, name="L2", form="at_rest")
    tier.ensure("k", len(DATA), xxh3_128_hex(DATA), produce).release()
    pin, inode = _lookup_behind_evictor(tier, replacements=1)
    assert pin is not None and os.fstat(pin.fd).st_ino == inode  # not the unlinked old inode
    assert pin.path.read_bytes() == DATA
    pin.release()


def test_an_entry_that_keeps_changing_while_it_is_pinned_is_a_miss(tmp_path: Path) -> None:
    """Replaced under each of the pin's three tries: the reader is served from below (a miss, its
    row dropped so the next ensure fetches it afresh), never left holding a stale inode."""
    tier = Tier(tmp_path / "l2", 1 << 20, name="L2", form="at_rest")
    tier.ensure("k", len(DATA), xxh3_128_hex(DATA), produce).release()
    pin, _ = _lookup_behind_evictor(tier, replacements=3)
    assert pin is None and tier.index.get("k") is None and tier.m_hits.value == 0


def test_a_resumed_tiers_heat_takes_only_for_entries_resident_here_at_the_same_size(tmp_path: Path) -> None:
    tier = Tier(tmp_path / "l2", 1 << 20, name="L2", form="at_rest")
    tier.ensure("k", len(DATA), xxh3_128_hex(DATA), produce).release()
    saved = [
        EntryHeat("k", len(DATA), 7, 50.0, {}),
        EntryHeat("gone", len(DATA), 9, 60.0, {}),
        EntryHeat("k", len(DATA) + 1, 9, 60.0, {}),
    ]  # an entry of another size: another content
    assert tier.restore_heat(saved, shift=10.0) == 1
    (row,) = tier.index.entries()
    assert (row.key, row.hits, row.last_access) == ("k", 7, 60.0)


def test_clean_keeps_the_block_list_of_an_entry_not_indexed_yet(tmp_path: Path) -> None:
    """A fill records the block list, then renames the entry into place, then indexes it: between
    the last two the file is there and the index does not know it; its block list must stay."""
    tier = Tier(tmp_path / "l2", 1 << 20, name="L2", form="at_rest")
    tier.path_of("k").write_bytes(DATA)
    holder = os.open(tier.path_of("k"), os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_SH)  # the filling process's pin
    (tier.root / "blocks" / "k.json").write_text("{}")
    (tier.root / "blocks" / "orphan.json").write_text("{}")
    try:
        assert tier.clean() == 1
    finally:
        os.close(holder)
    assert (tier.root / "blocks" / "k.json").exists() and not (tier.root / "blocks" / "orphan.json").exists()


def test_quarantine_through_a_released_pin_moves_the_entry_aside(tmp_path: Path) -> None:
    tier = Tier(tmp_path / "l2", 1 << 20, name="L2", form="at_rest")
    tier.ensure("k", len(DATA), xxh3_128_hex(DATA), produce).release()
    pin = tier.lookup("k")
    pin.release()  # nothing left to compare the entry with: the caller's word is taken
    assert tier.quarantine("k", "failed verification of block 0 on read", pin=pin) is True
    assert not tier.path_of("k").exists() and tier.index.get("k") is None and tier.m_corruptions.value == 1


def test_a_lock_directory_that_is_not_one_is_raised_naming_it_not_taken_for_a_full_disk(tmp_path: Path) -> None:
    tier = Tier(tmp_path / "l2", 1 << 20, name="L2", form="at_rest")
    (tier.root / "locks").rmdir()
    (tier.root / "locks").write_bytes(b"")
    with pytest.raises(NotADirectoryError, match="locks"):
        tier.ensure("k", len(DATA), xxh3_128_hex(DATA), produce)
    assert tier.m_enospc.value == tier.m_write_errors.value == 0 and not tier.index.entries()


def test_a_reader_declaring_reshuffled_epochs_switches_an_auto_tier_in_use_to_keep_what_it_holds(
    tmp_path: Path,
) -> None:
    tier = Tier(tmp_path / "l2", 2 * len(DATA) + 100, policy="auto", name="L2", form="at_rest")
    for key in ("a", "b"):
        tier.ensure(key, len(DATA), xxh3_128_hex(DATA), produce).release()
    tier.set_lifecycle(Lifecycle(passes=None, pattern="reshuffle"))  # nochurn from now on
    assert tier.ensure("c", len(DATA), xxh3_128_hex(DATA), produce) is None
    assert tier.m_bypass.value == 1 and sorted(tier.index.keys()) == ["a", "b"]


def test_a_fetch_lock_the_device_cannot_create_serves_from_below_counted_and_warned_once(
    tmp_path: Path, caplog
) -> None:
    """The lock file is the first thing a fill writes: a full disk there counts as a no-space
    fallback, a failing device as a write error, each read served from below (None), nothing left."""
    tier = Tier(tmp_path / "l2", 1 << 20, name="L2", form="at_rest")
    with FailNth(1, [tier.root], ops=("open_write",), error=errno.ENOSPC, persistent=True):
        assert tier.ensure("k", len(DATA), xxh3_128_hex(DATA), produce) is None
    assert tier.m_enospc.value == 1 and tier.m_write_errors.value == 0
    with caplog.at_level("WARNING", logger="tierflow.tiers"):
        with FailNth(1, [tier.root], ops=("open_write",), error=errno.EIO, persistent=True):
            for _ in range(2):
                assert tier.ensure("k", len(DATA), xxh3_128_hex(DATA), produce) is None
    assert tier.m_write_errors.value == 2 and tier.m_misses.value == 0
    assert sum("a write failed" in r.getMessage() for r in caplog.records) == 1
    assert not tier.index.entries() and not list((tier.root / "tmp").iterdir())
    pin = tier.ensure("k", len(DATA), xxh3_128_hex(DATA), produce)  # the device back: cached again
    assert pin is not None and pin.path.read_bytes() == DATA
    pin.release()


@pytest.mark.parametrize("damage", ["foreign", "zeroed"])
def test_a_damaged_index_is_a_typed_error_naming_it_not_a_bare_sqlite_error(tmp_path: Path, damage: str) -> None:
    """Issue 18 (defect 6): a tier directory whose index is not SQLite (a foreign file, one
    zeroed) is TierIndexError naming the file and the remedy; before, sqlite3.DatabaseError
    ('file is not a database') reached the caller with no path."""
    Tier(tmp_path / "l2", 1 << 20, name="L2", form="at_rest").ensure(
        "k", len(DATA), xxh3_128_hex(DATA), produce
    ).release()
    index = tmp_path / "l2" / "tierflow-index.sqlite"
    for side in ("-wal", "-shm"):
        index.with_name(index.name + side).unlink(missing_ok=True)
    index.write_bytes(b'{"not": "an index"}\n' if damage == "foreign" else bytes(4096))
    with pytest.raises(TierIndexError, match=rf"{index}: .*remove the tier directory") as caught:
        Tier(tmp_path / "l2", 1 << 20, name="L2", form="at_rest")
    assert isinstance(caught.value, OSError)
