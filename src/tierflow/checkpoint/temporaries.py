"""The `.tmp-*` directories of a checkpoint store's commits and downloads: each is locked (flock)
by the process making it while that process lives, so a sweep removes only the temporaries of
owners that died or failed, never one a live commit or download is still writing."""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import time
from pathlib import Path

from tierflow.checkpoint.manifest import naming

UNOWNED_TEMPORARY_AGE_S = 3600.0
"""A temporary whose name carries no process id is swept once unlocked and this old."""

_TEMPORARY_PID = re.compile(r"-(\d+)$")


class Temporaries:
    """The temporaries of one local checkpoint directory, and the locks this process holds on its own."""

    def __init__(self, local: Path) -> None:
        self.local = local
        self._locks: dict[Path, int] = {}  # temporaries this process owns -> the descriptor holding its flock

    def make(self, tmp: Path) -> Path:
        """A fresh, empty temporary `tmp` (a leftover of this name is removed), locked by this process."""
        self.release(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        with naming(tmp):
            tmp.mkdir(parents=True)
        fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # just made, under this process's own name: free
        self._locks[tmp] = fd
        return tmp

    def release(self, tmp: Path) -> None:
        """Drop this process's lock on `tmp` (if it holds one): a sweep may remove it from now on."""
        fd = self._locks.pop(tmp, None)
        if fd is not None:
            os.close(fd)

    def remove(self, tmp: Path) -> None:
        """Release `tmp` and delete what is left of it."""
        self.release(tmp)
        shutil.rmtree(tmp, ignore_errors=True)

    def sweep(self) -> list[str]:
        """Remove the temporaries (`.tmp-*` directories) of commits and downloads that no live
        owner holds: unlocked (its owner's flock went with its process, or its commit failed) and
        made by a process of this node that is gone or by this one, or unnamed and an hour old.
        Returns the names removed."""
        removed: list[str] = []
        try:
            children = [c for c in self.local.iterdir() if c.name.startswith(".tmp-")]
        except OSError:
            return removed
        for child in children:
            if child in self._locks:
                continue
            try:
                fd = os.open(child, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                continue  # gone, or not a directory
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    continue  # a live commit or download holds it
                if not _abandoned(child, fd):
                    continue
                shutil.rmtree(child, ignore_errors=True)
                removed.append(child.name)
            finally:
                os.close(fd)
        return removed


def _abandoned(tmp: Path, fd: int) -> bool:
    """Whether an unlocked temporary has no live owner: its process (the id its name ends with)
    is gone from this node or is this one, or, without an id, it is an hour old."""
    match = _TEMPORARY_PID.search(tmp.name)
    if match is None:
        return time.time() - os.fstat(fd).st_mtime > UNOWNED_TEMPORARY_AGE_S
    pid = int(match.group(1))
    if pid == os.getpid():
        return True  # this process holds the lock of each temporary it is still writing
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False
