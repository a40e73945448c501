"""Shared locks on mapped metadata tables: a reader keeps the tables it maps from being collected,
and gc removes only tables no process of the node has open (a file lock, so a killed reader's goes
with it)."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from pathlib import Path

from tierflow.errors import ManifestError
from tierflow.format._regular import open_regular


class TableGone(ManifestError):
    """A table the header named was removed before it was opened: gc removed a superseded one (a
    newer header was published), so the header is read again; or the dataset lost it (damaged)."""


def open_table(path: Path, where: str) -> int:
    """A table file opened, with a shared lock held as long as the descriptor is open (gc removes
    only tables it can lock exclusively: none a process has open), and still linked after the lock
    was taken (gc unlinks under its exclusive lock, so a table removed between the header's read and
    this open is TableGone, not a file mapped after its removal)."""
    try:
        fd = open_regular(path, ManifestError)
    except FileNotFoundError:
        raise TableGone(f"{where}: missing (the header names a table the dataset does not hold)") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        if os.fstat(fd).st_nlink == 0:
            raise TableGone(f"{where}: removed while it was opened (a newer header superseded it)")
    except BaseException:
        os.close(fd)
        raise
    return fd


def remove_if_unused(path: Path) -> bool:
    """Unlink a table file no process has open (`open_table`'s shared lock), under an exclusive
    lock; False (kept) when one has it open, or it is gone."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        if os.fstat(fd).st_nlink == 0:
            return False
        path.unlink()
        return True
    finally:
        os.close(fd)


class HeldTable:
    """A table file open under `open_table`'s shared lock, closed (the lock released) by `close` or when
    this is collected: what a mapped table keeps, and all a reader keeps of a table it does not map yet
    (a window length no loader has asked for), so gc leaves it."""

    def __init__(self, path: Path, where: str) -> None:
        self.fd = open_table(path, where)

    def close(self, _close: Callable[[int], None] = os.close) -> None:
        # os.close bound at definition: a table freed while the interpreter tears its modules down
        # (a loader left in a script's globals) finds the `os` global gone
        fd, self.fd = self.fd, -1
        if fd >= 0:
            _close(fd)

    def __del__(self) -> None:
        if hasattr(self, "fd"):
            self.close()
