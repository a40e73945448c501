"""The node's staging area: where a shard no tier keeps is read from, fetched once per node.

It is a small LRU tier in host RAM (tmpfs), named by the directory of the top tier it stands
beside, so every process reading through that tier (the node's ranks, their DataLoader workers,
another job on the node) finds the same area without talking to the others, and the area's
per-entry kernel lock makes one of them fetch a shard while the others wait for it and read the
copy (entries are content-addressed: two jobs on the same data share them, as they share L2).

A process using the area holds a shared flock on its `.users` file (beside it); the last one to
leave takes the exclusive lock without waiting and removes the area and the file. A process
killed without its exit hook loses its lock with its life, so the next process to join or leave
finds the area unused and removes it: RAM is never lost to a dead job, and no process waits on
one (a dead reader's pins and reservations die with it too).
"""

from __future__ import annotations

import atexit
import fcntl
import logging
import os
import shutil
import struct
import tempfile
from pathlib import Path

from tierflow.format._checksum import xxh3_hex
from tierflow.tiers._index import process_alive

log = logging.getLogger("tierflow.tiers")

AREA_PREFIX = "node-"


def staging_root() -> Path:
    """Where staging areas live: host RAM (/dev/shm) when there is one, else the temp directory."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return base / f"tierflow-{os.getuid()}"


def area_path(top: Path, job: str, root: Path | None = None) -> Path:
    """The staging area of `job` beside the tier directory `top`: the same in each of its processes."""
    try:
        where = str(top.resolve())
    except OSError:
        where = os.path.abspath(top)
    name = xxh3_hex("\0".join((where, job)).encode())[:16]
    return (root or staging_root()) / f"{AREA_PREFIX}{name}"


def _users(area: Path) -> Path:
    return area.with_name(area.name + ".users")


def sweep_unused(root: Path) -> None:
    """Remove staging areas no live process uses (their users died without leaving)."""
    for users in root.glob(f"{AREA_PREFIX}*.users"):
        area = users.with_name(users.name.removesuffix(".users"))
        try:
            fd = os.open(users, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # in use
        else:
            _remove(area, users)
        finally:
            os.close(fd)
    for path in root.glob("staging-*"):  # per-process areas of earlier versions
        pid = path.name.split("-")[1]
        if pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _remove(area: Path, users: Path) -> None:
    """Remove an area no process uses, holding its users file's exclusive lock (a process that
    opened the file meanwhile finds it unlinked once it has its lock, and opens the new one)."""
    shutil.rmtree(area, ignore_errors=True)
    users.unlink(missing_ok=True)


class Membership:
    """This process's use of a staging area: a shared flock on its users file, held until exit.

    Joining waits only for a sweep or a last user's removal in progress (both brief), then makes
    the directory, so a joined area is never removed under its users. A forked child shares its
    parent's lock and never leaves on its behalf."""

    def __init__(self, area: Path) -> None:
        self.area = area
        self.owner = os.getpid()
        area.parent.mkdir(parents=True, exist_ok=True)
        users = _users(area)
        self.fd: int | None = None
        while self.fd is None:
            fd = os.open(users, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)
                held = os.fstat(fd)
                try:
                    now = os.stat(users)
                except FileNotFoundError:
                    now = None
                if now is None or (now.st_ino, now.st_dev) != (held.st_ino, held.st_dev):
                    os.close(fd)  # removed by the last user or a sweep since the open: join anew
                    continue
                area.mkdir(exist_ok=True)
            except BaseException:
                os.close(fd)
                raise
            self.fd = fd
        atexit.register(self.leave)

    def leave(self) -> None:
        """Stop using the area; the last user removes it."""
        if self.fd is None or os.getpid() != self.owner:
            return
        fd, self.fd = self.fd, None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pass  # others use it still: the last of them removes it
        else:
            _remove(self.area, _users(self.area))
        finally:
            os.close(fd)


class NodeProgress:
    """How many batches each of the node's ranks has consumed, in a small file of their staging area.

    One slot per local rank (its pid and its count), written in place at every step (two words,
    no rename), read by the node's stager, which holds what a slower rank still needs, and by a
    reader waiting for room, which waits while the slowest rank moves. A slot whose process died,
    or that its rank left (`leave`), counts for nothing."""

    SLOT = struct.Struct("<qq")

    def __init__(self, area: Path, ranks: int) -> None:
        self.path = area / "progress"
        self.ranks = ranks
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)

    def publish(self, rank: int, steps: int) -> None:
        if 0 <= rank < self.ranks:
            os.pwrite(self.fd, self.SLOT.pack(os.getpid(), steps), rank * self.SLOT.size)

    def leave(self, rank: int) -> None:
        if 0 <= rank < self.ranks:
            os.pwrite(self.fd, self.SLOT.pack(0, 0), rank * self.SLOT.size)

    def steps(self) -> dict[int, tuple[int, int]]:
        """Local rank -> (pid, batches consumed), for the ranks with a live process in their slot."""
        data = os.pread(self.fd, self.SLOT.size * self.ranks, 0)
        out = {}
        for rank in range(len(data) // self.SLOT.size):
            pid, steps = self.SLOT.unpack_from(data, rank * self.SLOT.size)
            if pid > 0 and process_alive(pid):
                out[rank] = (pid, steps)
        return out

    def lag(self) -> tuple[int | None, int | None]:
        """(this process's rank's steps, the slowest other rank's steps); None where unknown. A
        DataLoader worker counts as its parent's rank."""
        mine, others = None, []
        for pid, steps in self.steps().values():
            if pid in (os.getpid(), os.getppid()):
                mine = steps
            else:
                others.append(steps)
        return mine, (min(others) if others else None)
