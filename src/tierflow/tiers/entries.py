"""A tier directory's entries: the files, their rows in the index, their block lists, quarantine.

Why apart from the tier: this is everything a tier keeps on disk and how it is checked, with no
decision in it. What to keep is the admission controller's (policies/admission.py); what to do
when the disk or the directory fails is the fallbacks' (tiers/fallbacks.py).

A hit is verified whole (xxh3-128) unless the caller verifies by block as it reads: then it
costs a size check, and the entry's block list (byte ranges + xxh3-64, `blocks/<key>.json`,
recorded at admission from verified bytes for a form whose blocks the manifest does not list) is
what the reader checks against.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import sqlite3
from collections.abc import Callable, Sequence
from pathlib import Path

from tierflow.errors import ShardCorruptError
from tierflow.format._checksum import file_xxh3_128, xxh3_hex
from tierflow.format._regular import read_regular
from tierflow.format.shard import Block
from tierflow.telemetry import Counter
from tierflow.tiers._index import EntryRow, IndexTrouble, TierIndex, process_alive
from tierflow.tiers._lock import Pin, is_pinned, try_remove_unpinned

log = logging.getLogger("tierflow.tiers")
INDEX_NAME = "tierflow-index.sqlite"
MAX_BLOCK_LIST_BYTES = 64 << 20
SUBDIRS = ("entries", "locks", "tmp", "quarantine", "blocks")

BlockLister = Callable[[Path], Sequence[Block]]
"""How to cut a verified file into blocks (a form whose blocks the manifest does not list)."""


class EntryStore:
    """The entries of one tier directory and their rows in its shared index."""

    def __init__(
        self,
        root: Path,
        name: str,
        index_trouble: IndexTrouble,
        corruptions: Counter,
        broken: Callable[[BaseException], bool],
    ) -> None:
        """`index_trouble` tolerates a full or failing index (a read then misses); `corruptions`
        counts entries that fail verification; `broken` is told of a directory found gone."""
        self.root = root
        self.name = name
        for sub in SUBDIRS:
            (root / sub).mkdir(parents=True, exist_ok=True)
        self.index = TierIndex(root / INDEX_NAME)
        self._trouble = index_trouble
        self._corruptions = corruptions
        self._broken = broken
        self._block_lists: dict[str, list[Block]] = {}  # content-addressed: never stale

    def path_of(self, key: str) -> Path:
        return self.root / "entries" / f"{key}.arrow"

    def temporary(self, key: str, suffix: str = "") -> Path:
        """A fresh name under tmp/ for this process (`clean` removes those of dead processes)."""
        return self.root / "tmp" / f"{key}.{os.getpid()}.{secrets.token_hex(4)}{suffix}"

    # ------------------------------------------------------------ lookup and verification
    def find(self, key: str, whole: bool, block_list: BlockLister | None = None) -> tuple[Pin, EntryRow] | None:
        """The entry pinned and verified, with its row; None on a miss (a corrupt entry is quarantined).

        `whole=False`: the caller verifies each block before it serves a byte of it, so only the
        size is checked here; with `block_list` the entry must have its block list, which is made
        now, after one whole-file check, if it has none (an entry admitted without one)."""
        row = None
        with self._trouble.tolerated():  # an index that cannot be opened: a miss
            row = self.index.get(key)
        if row is None:
            return None
        try:
            pin = Pin(self.path_of(key))
        except FileNotFoundError:
            with self._trouble.tolerated(), self.index.transaction() as c:
                self.index.remove(c, key)
            return None
        except ShardCorruptError:  # not a regular file (a FIFO, a device)
            self.quarantine(key, "is not a regular file")
            return None
        assert pin.fd is not None, "a pin holds its file open"
        sound = os.fstat(pin.fd).st_size == row.size
        if sound and not whole and block_list is not None and self.blocks_of(key, row.size, row.checksum) is None:
            whole = True
        if sound and whole:
            try:
                sound = file_xxh3_128(pin.path) == row.checksum
            except ShardCorruptError:  # replaced by a special file since it was pinned
                sound = False
            if sound and block_list is not None and self.blocks_of(key, row.size, row.checksum) is None:
                self.record_blocks(key, row.size, row.checksum, block_list(pin.path))
        if not sound:
            pin.release()
            self.quarantine(key, "failed verification on read")
            return None
        return pin, row

    def resident_keys(self) -> set[str]:
        """The keys of the admitted entries; none where the index is unreadable."""
        with self._trouble.tolerated():
            return self.index.keys()
        return set()

    def is_resident(self, key: str) -> bool:
        """Whether the index lists `key` (False where it is unreadable)."""
        with self._trouble.tolerated():
            return self.index.get(key) is not None
        return False

    # ------------------------------------------------------------ block lists
    def _blocks_path(self, key: str) -> Path:
        return self.root / "blocks" / f"{key}.json"

    def blocks_of(self, key: str, size: int | None = None, checksum: str | None = None) -> list[Block] | None:
        """The entry's block list (recorded at admission), or None when it has none or it is unsound."""
        found = self._block_lists.get(key)
        if found is not None:
            return found
        try:
            d = json.loads(read_regular(self._blocks_path(key), MAX_BLOCK_LIST_BYTES))
            body = {k: v for k, v in d.items() if k != "digest"}
            if d["digest"] != xxh3_hex(json.dumps(body, sort_keys=True).encode()) or d["key"] != key:
                raise ValueError("digest")
            if (size is not None and d["size"] != size) or (checksum is not None and d["checksum"] != checksum):
                raise ValueError("another entry")
            b = d["blocks"]
            blocks = [
                Block(int(o), int(n), int(r), str(c))
                for o, n, r, c in zip(b["offset"], b["length"], b["rows"], b["checksum"], strict=True)
            ]
            end = 0
            for block in blocks:  # contiguous from 0, inside the file
                if block.offset != end or block.length <= 0 or block.rows < 0:
                    raise ValueError("layout")
                end += block.length
            if end > d["size"]:
                raise ValueError("layout")
        except (OSError, ValueError, KeyError, TypeError, RecursionError):
            return None
        self._block_lists[key] = blocks
        return blocks

    def record_blocks(self, key: str, size: int, checksum: str, blocks: Sequence[Block]) -> None:
        """Keep the block list of a verified file (in memory, and beside the entry for other processes)."""
        blocks = list(blocks)
        self._block_lists[key] = blocks
        body: dict[str, object] = {
            "key": key,
            "size": size,
            "checksum": checksum,
            "blocks": {
                "offset": [b.offset for b in blocks],
                "length": [b.length for b in blocks],
                "rows": [b.rows for b in blocks],
                "checksum": [b.checksum for b in blocks],
            },
        }
        body["digest"] = xxh3_hex(json.dumps(body, sort_keys=True).encode())
        tmp = self.temporary(key, ".blocks")
        try:
            tmp.write_text(json.dumps(body))
            os.replace(tmp, self._blocks_path(key))
        except OSError as e:  # no room for it: this process keeps it; others verify whole
            tmp.unlink(missing_ok=True)
            log.warning("tier %s: could not record the block list of %s (%s)", self.name, key, e)

    def drop_blocks(self, key: str) -> None:
        self._blocks_path(key).unlink(missing_ok=True)

    # ------------------------------------------------------------ removal
    def remove_unpinned(self, c: sqlite3.Connection, key: str) -> bool:
        """Remove the entry, its block list and its row unless some process uses it (then False)."""
        if not try_remove_unpinned(self.path_of(key)):
            return False
        self.drop_blocks(key)
        self.index.remove(c, key)
        return True

    def remove_file(self, key: str) -> None:
        """Remove an entry's file and block list whose row was never written (the index filled)."""
        if try_remove_unpinned(self.path_of(key)):
            self.drop_blocks(key)

    def quarantine(self, key: str, why: str, pin: Pin | None = None) -> bool:
        """Move a corrupt entry aside (it is fetched again on next use); with `pin`, only if the
        entry is still the file that pin holds (another process may have replaced it already)."""
        if pin is not None and pin.fd is not None:
            try:
                if os.stat(self.path_of(key)).st_ino != os.fstat(pin.fd).st_ino:
                    return False
            except FileNotFoundError as e:
                self._broken(e)  # the whole directory may be gone: then the tier is bypassed
                return False
        self._corruptions.inc()
        log.warning("tier %s: entry %s %s; quarantined, it will be fetched again", self.name, key, why)
        try:
            os.replace(self.path_of(key), self.root / "quarantine" / f"{key}.{secrets.token_hex(4)}")
        except FileNotFoundError:
            pass
        with self._trouble.tolerated(), self.index.transaction() as c:
            self.index.remove(c, key)
        return True

    def evict(self, keys: list[str] | None = None) -> int:
        """Drop entries (all when None) that no process is using; returns how many went."""
        removed = 0
        with self.index.transaction() as c:
            for row in self.index.entries(c):
                if (keys is None or row.key in keys) and self.remove_unpinned(c, row.key):
                    removed += 1
        return removed

    def clean(self) -> int:
        """Remove leftovers of dead jobs: temporaries, quarantined files, files the index does not know."""
        removed = 0
        known = {r.key for r in self.index.entries()}
        for p in (self.root / "tmp").iterdir():
            pid = p.name.split(".")[1] if p.name.count(".") >= 2 else ""
            if not pid.isdigit() or not process_alive(int(pid)):
                p.unlink(missing_ok=True)
                removed += 1
        for p in (self.root / "quarantine").iterdir():
            p.unlink(missing_ok=True)
            removed += 1
        for p in (self.root / "entries").iterdir():
            if p.name.removesuffix(".arrow") not in known and not is_pinned(p):
                p.unlink(missing_ok=True)
                removed += 1
        for p in (self.root / "blocks").iterdir():
            if p.name.removesuffix(".json") not in known and not self.path_of(p.name.removesuffix(".json")).exists():
                p.unlink(missing_ok=True)
                removed += 1
        return removed
