"""The persistent, shared index of one tier directory (SQLite in WAL mode).

Every process on the node that uses the directory reads and writes the same index, so a
restarted job finds its cache warm with its heat statistics, and capacity and policy belong
to the directory, not to a job. Reservations record space promised to fetches in flight; one
whose process died is reclaimed.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import sqlite3
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterator

from tierflow.telemetry.metrics import Counter

log = logging.getLogger("tierflow.tiers")

SCHEMA = """
CREATE TABLE IF NOT EXISTS config (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS entries (
    key TEXT PRIMARY KEY, size INTEGER NOT NULL, checksum TEXT NOT NULL, dataset TEXT,
    admitted REAL NOT NULL, last_access REAL NOT NULL, hits INTEGER NOT NULL DEFAULT 0,
    stats TEXT NOT NULL DEFAULT '{}');
CREATE TABLE IF NOT EXISTS reservations (
    id INTEGER PRIMARY KEY AUTOINCREMENT, key TEXT NOT NULL, size INTEGER NOT NULL,
    pid INTEGER NOT NULL, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS readers (pid INTEGER NOT NULL, dataset TEXT NOT NULL, PRIMARY KEY (pid, dataset));
"""


@dataclass
class EntryRow:
    key: str
    size: int
    checksum: str
    dataset: str | None
    admitted: float
    last_access: float
    hits: int
    stats: dict[str, Any]


BUSY_TIMEOUT_S = 60.0
"""How long a statement waits for another process's transaction on the index."""
OPEN_BUSY_S = 0.25
"""How long opening waits on a lock at a time before it looks at the file (`TierIndex._open`)."""
SQLITE_HEADER_BYTES = 100
DAMAGED_CODES = frozenset({11, 26})
"""SQLITE_CORRUPT, SQLITE_NOTADB: the index file is damaged or not SQLite."""


class IndexDamaged(sqlite3.DatabaseError):
    """The index file is damaged in a way SQLite would not say, or only after a long wait."""


def index_damaged(error: BaseException) -> bool:
    """Whether `error` says the index file is damaged or not SQLite at all."""
    if isinstance(error, IndexDamaged):
        return True
    return isinstance(error, sqlite3.Error) and (getattr(error, "sqlite_errorcode", 0) or 0) & 0xFF in DAMAGED_CODES


_UNWRITABLE = {10, 13, 14}  # SQLITE_IOERR, SQLITE_FULL, SQLITE_CANTOPEN (primary result codes)


def index_unwritable(error: sqlite3.Error) -> bool:
    """Whether `error` says the index's filesystem is full or failing (not a bug, not contention)."""
    code = getattr(error, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in _UNWRITABLE
    return any(s in str(error) for s in ("disk is full", "disk I/O error", "unable to open"))


class IndexTrouble:
    """What a tier does when its index cannot be opened or written (the disk is full or failing):
    count it, warn once, and have the caller serve from the tier below instead of crashing.
    Nothing is cached meanwhile; once the index opens and writes again, the tier caches again."""

    def __init__(self, counter: Counter, where: str, broken: Callable[[BaseException], bool] | None = None) -> None:
        self.counter = counter
        self.where = where
        self.warned = False
        # weakly: a tier holding its IndexTrouble must be freed (closing its connections) when dropped
        self._broken = weakref.WeakMethod(broken) if broken is not None else None
        """The tier's own check, asked first: True when `error` means the tier is gone or its index
        damaged (the tier is then bypassed, with its own warning)."""

    def __call__(self, error: sqlite3.Error) -> bool:
        """True (counted, warned once) when `error` is such trouble; False for anything else."""
        broken = self._broken() if self._broken is not None else None
        if broken is not None and broken(error):
            return True
        if not index_unwritable(error):
            return False
        self.counter.inc()
        if not self.warned:
            log.warning(
                "%s: its index cannot be written (%s); serving from the tier below without caching until it can",
                self.where,
                error,
            )
            self.warned = True
        return True

    @contextmanager
    def tolerated(self) -> Iterator[None]:
        """An index write that may be skipped in such trouble (statistics, releases, removals)."""
        try:
            yield
        except sqlite3.Error as e:
            if not self(e):
                raise


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class TierIndex:
    """One SQLite connection per thread of each process (created lazily, re-created after fork)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._local = threading.local()

    @property
    def conn(self) -> sqlite3.Connection:
        local = self._local
        if getattr(local, "pid", None) != os.getpid():
            # switching to WAL while another process opens the same new index fails at once with
            # "database is locked" (SQLite takes no busy wait for it): open one process at a time
            try:
                guard = open(self.path.with_name(self.path.name + ".open-lock"), "a")
            except OSError as e:  # as SQLite says it: the index cannot be opened (IndexTrouble knows it)
                raise sqlite3.OperationalError(f"unable to open the index's open-lock ({e})") from e
            with guard:
                fcntl.flock(guard, fcntl.LOCK_EX)
                conn = self._open()
            local.conn, local.pid = conn, os.getpid()
        return local.conn

    def _open(self) -> sqlite3.Connection:
        """A new connection, in WAL mode with the schema. Opening waits on a lock only briefly at a
        time: between waits it looks at the file, and one that a running process's index can no
        longer be (truncated below SQLite's header beside a live write-ahead log: SQLite would wait
        on it for ever) is `IndexDamaged` at once, not "database is locked" after a minute."""
        conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
        try:
            conn.execute(f"PRAGMA busy_timeout={int(OPEN_BUSY_S * 1000)}")
            deadline = time.monotonic() + BUSY_TIMEOUT_S
            while True:
                try:
                    conn.execute("PRAGMA journal_mode=WAL")
                    conn.execute("PRAGMA synchronous=NORMAL")
                    conn.executescript(SCHEMA)
                    break
                except sqlite3.OperationalError as e:
                    if not str(e).startswith("database is locked") or time.monotonic() > deadline:
                        raise
                    damage = self.damage()
                    if damage is not None:
                        raise IndexDamaged(damage) from e
            conn.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT_S * 1000)}")
        except BaseException:
            conn.close()
            raise
        return conn

    def damage(self) -> str | None:
        """What is wrong with the index file as seen from outside SQLite, or None when nothing shows."""
        try:
            size = os.stat(self.path).st_size
        except FileNotFoundError:
            return None
        # an index in WAL mode has its header (a page) before its log and shared memory exist; a
        # connection opening one shorter than that deletes the log, then waits on the memory for ever
        beside = [side for side in ("-wal", "-shm") if os.path.exists(self.path.with_name(self.path.name + side))]
        if size < SQLITE_HEADER_BYTES and beside:
            return f"truncated to {size} bytes under the processes using it (its {' and '.join(beside)} remain)"
        return None

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """An IMMEDIATE transaction: the node-wide critical section for space accounting."""
        conn = self.conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:  # a failed COMMIT (disk full) may leave the transaction open
                try:
                    conn.execute("ROLLBACK")
                except sqlite3.Error:
                    pass  # SQLite rolled it back itself
            raise

    def config(self) -> dict[str, str]:
        return dict(self.conn.execute("SELECT name, value FROM config").fetchall())

    def set_config_if_absent(self, values: dict[str, str]) -> dict[str, str]:
        with self.transaction() as c:
            for k, v in values.items():
                c.execute("INSERT OR IGNORE INTO config VALUES (?, ?)", (k, v))
            return dict(c.execute("SELECT name, value FROM config").fetchall())

    def get(self, key: str, conn: sqlite3.Connection | None = None) -> EntryRow | None:
        row = (
            (conn or self.conn)
            .execute(
                "SELECT key, size, checksum, dataset, admitted, last_access, hits, stats FROM entries WHERE key=?",
                (key,),
            )
            .fetchone()
        )
        return _row(row) if row else None

    def entries(self, conn: sqlite3.Connection | None = None) -> list[EntryRow]:
        rows = (
            (conn or self.conn)
            .execute("SELECT key, size, checksum, dataset, admitted, last_access, hits, stats FROM entries")
            .fetchall()
        )
        return [_row(r) for r in rows]

    def keys(self) -> set[str]:
        """The keys of every admitted entry (one query: what a plan checks residency against)."""
        return {key for (key,) in self.conn.execute("SELECT key FROM entries").fetchall()}

    def used(self, conn: sqlite3.Connection) -> int:
        """Bytes of resident entries plus live reservations (dead processes' are reclaimed)."""
        for rid, pid in conn.execute("SELECT id, pid FROM reservations").fetchall():
            if not process_alive(pid):
                conn.execute("DELETE FROM reservations WHERE id=?", (rid,))
        entries = conn.execute("SELECT COALESCE(SUM(size), 0) FROM entries").fetchone()[0]
        reserved = conn.execute("SELECT COALESCE(SUM(size), 0) FROM reservations").fetchone()[0]
        return int(entries) + int(reserved)

    def occupancy(self) -> tuple[int, int]:
        """(bytes resident, bytes reserved)."""
        # one statement reads one snapshot: two would see an eviction and the next reservation twice
        e, r = self.conn.execute(
            "SELECT (SELECT COALESCE(SUM(size), 0) FROM entries), (SELECT COALESCE(SUM(size), 0) FROM reservations)"
        ).fetchone()
        return int(e), int(r)

    def reserve(self, conn: sqlite3.Connection, key: str, size: int) -> int:
        cur = conn.execute(
            "INSERT INTO reservations (key, size, pid, created) VALUES (?, ?, ?, ?)",
            (key, size, os.getpid(), time.time()),
        )
        assert cur.lastrowid is not None, "an INSERT gives its row id"
        return cur.lastrowid

    def release(self, reservation: int) -> None:
        self.conn.execute("DELETE FROM reservations WHERE id=?", (reservation,))

    def admit(self, conn: sqlite3.Connection, row: EntryRow, reservation: int) -> None:
        conn.execute("DELETE FROM reservations WHERE id=?", (reservation,))
        conn.execute(
            "INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (
                row.key,
                row.size,
                row.checksum,
                row.dataset,
                row.admitted,
                row.last_access,
                row.hits,
                json.dumps(row.stats),
            ),
        )

    def remove(self, conn: sqlite3.Connection, key: str) -> None:
        conn.execute("DELETE FROM entries WHERE key=?", (key,))

    def set_heat(
        self, conn: sqlite3.Connection, key: str, last_access: float, hits: int, stats: dict[str, Any]
    ) -> None:
        """An entry's statistics as restored from a checkpoint."""
        conn.execute(
            "UPDATE entries SET last_access=?, hits=?, stats=? WHERE key=?", (last_access, hits, json.dumps(stats), key)
        )

    def add_reader(self, dataset: str) -> None:
        """Record that this process reads `dataset` through the tier (until it dies)."""
        with self.transaction() as c:
            c.execute("INSERT OR IGNORE INTO readers VALUES (?, ?)", (os.getpid(), dataset))

    def read_datasets(self, conn: sqlite3.Connection) -> set[str]:
        """The datasets a live process reads through the tier (dead readers' rows are dropped)."""
        live = set()
        for pid, dataset in conn.execute("SELECT pid, dataset FROM readers").fetchall():
            if process_alive(pid):
                live.add(dataset)
            else:
                conn.execute("DELETE FROM readers WHERE pid=? AND dataset=?", (pid, dataset))
        return live

    def touch(self, conn: sqlite3.Connection, key: str, now: float, stats: dict[str, Any]) -> None:
        conn.execute(
            "UPDATE entries SET last_access=?, hits=hits+1, stats=? WHERE key=?", (now, json.dumps(stats), key)
        )


def _row(r: tuple) -> EntryRow:
    return EntryRow(r[0], int(r[1]), r[2], r[3], float(r[4]), float(r[5]), int(r[6]), json.loads(r[7]))
