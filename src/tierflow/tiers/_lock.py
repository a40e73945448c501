"""Kernel file locks (`flock`): they die with their holder, so no stale-lock logic exists anywhere.

An entry's *fetch lock* makes one process per node fetch it; a *pin* is a shared lock on the
entry's data file, and eviction takes the exclusive lock without waiting, so an entry in use
by any process on the node is never evicted under it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from pathlib import Path

from tierflow.format._regular import open_regular


class FileLock:
    """An exclusive flock with a timeout; `acquired` says whether it was had or timed out."""

    def __init__(self, path: str | Path, timeout: float) -> None:
        self.path = Path(path)
        self.timeout = timeout
        self.fd: int | None = None
        self.acquired = False

    def __enter__(self) -> FileLock:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + self.timeout
        delay = 0.002
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self.acquired = True
                return self
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return self  # the holder is alive but too slow: the caller takes over
                time.sleep(delay)
                delay = min(delay * 2, 0.05)

    def __exit__(self, *exc: object) -> None:
        assert self.fd is not None, "released twice"  # only ever exited after __enter__ opened it
        os.close(self.fd)
        self.fd = None


class Pin:
    """A shared lock on an entry's data file, held while a reader uses the entry.

    Only a regular file is pinned: anything else raises ShardCorruptError (the tier quarantines it)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.fd: int | None = None
        for _ in range(3):
            fd = open_regular(self.path)  # a FIFO or device put in the tier: refused, never waited on
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)
                # an evictor may have taken its exclusive lock and unlinked the file between our
                # open and our flock: then this pin holds a deleted (or replaced) inode
                held = os.fstat(fd)
                now = os.stat(self.path)
            except BaseException:  # gone since the open: FileNotFoundError, a miss for the caller
                os.close(fd)
                raise
            if (now.st_ino, now.st_dev) == (held.st_ino, held.st_dev):
                self.fd = fd
                return
            os.close(fd)  # replaced by a new copy: pin that one
        raise FileNotFoundError(errno.ENOENT, "entry kept changing while being pinned", str(self.path))

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __del__(self) -> None:
        self.release()


def _with_exclusive(path: str | Path, action) -> bool | None:
    """Run `action()` holding an exclusive flock taken without waiting; None if the file is gone,
    False if some process pins it, else True."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # even a FIFO opens at once, to be removed
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # EWOULDBLOCK: pinned; any other error is raised
        return False
    else:
        action()
        return True
    finally:
        os.close(fd)


def try_remove_unpinned(path: str | Path) -> bool:
    """Unlink an entry's file only if no process holds a pin on it; True when removed (or gone)."""

    def unlink() -> None:
        Path(path).unlink(missing_ok=True)

    return _with_exclusive(path, unlink) is not False


def is_pinned(path: str | Path) -> bool:
    return _with_exclusive(path, lambda: None) is False
