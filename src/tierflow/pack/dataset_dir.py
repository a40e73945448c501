"""The directory a pack writes into: an exclusive lock while it does (`DatasetLock`), the leftovers
of an earlier run cleared before it starts (`prepare_out`), and the files no manifest references
removed after (`remove_unreferenced`, also `tierflow gc`)."""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Container
from pathlib import Path
from typing import Any

from tierflow.format.manifest import Manifest
from tierflow.format.metadata import TABLE_PREFIX, TABLE_SUFFIX
from tierflow.format.table_locks import remove_if_unused
from tierflow.format.metadata_index import ShardNames
from tierflow.format.metadata_writer import is_published, referenced_tables
from tierflow.format.shard import SHARD_PREFIX, SHARD_SUFFIX
from tierflow.pack._journal import JOURNAL_NAME
from tierflow.pack.tokenize import PackInputError

TMP_DIR = ".tmp-pack"
"""The workers' scratch (their units' Arrow files), inside the output directory."""
LOCK_NAME = ".tierflow.lock"


def prepare_out(out: Path, overwrite: bool, keep: Container[str] = frozenset()) -> None:
    """Clear what an earlier run left, but the shards in `keep` (those a resumed pack carries on from)."""
    out.mkdir(parents=True, exist_ok=True)
    if is_published(out) and not overwrite:
        raise PackInputError(f"{out} already holds a finished dataset; pass --overwrite to replace it")
    shutil.rmtree(out / TMP_DIR, ignore_errors=True)
    for p in out.iterdir():
        if p.name.startswith(".tmp-") and p.is_file():
            p.unlink()
    if not is_published(out):
        for p in out.glob(f"{SHARD_PREFIX}*{SHARD_SUFFIX}"):
            if p.name not in keep:
                p.unlink()  # leftovers of a pack that died before publishing its manifest


def remove_unreferenced(out: Path, manifest: Manifest | None) -> list[Path]:
    """Delete shard files, temporaries and a resume journal the manifest (if any) does not reference
    (`tierflow gc`), and the metadata tables the header does not name that no process has open (a
    reader holds its tables' shared lock; gc, holding the dataset lock, takes each one's exclusive
    lock before the unlink, so a table in use stays until a gc after its readers closed it)."""
    shards: Container[str] = (
        ShardNames(manifest) if manifest is not None else set()
    )  # no string per shard of a mapped one
    tables = referenced_tables(out)  # the version-3 tables its header names (a header last written keeps them)
    removed = []
    for p in out.iterdir():
        if p.name.startswith(TABLE_PREFIX) and p.name.endswith(TABLE_SUFFIX):
            if p.name not in tables and remove_if_unused(p):
                removed.append(p)
        elif (p.name.startswith(SHARD_PREFIX) and p.name.endswith(SHARD_SUFFIX) and p.name not in shards) or (
            p.name.startswith(".tmp-") and p.is_file()
        ):
            p.unlink()
            removed.append(p)
    if (out / TMP_DIR).exists():
        shutil.rmtree(out / TMP_DIR)
        removed.append(out / TMP_DIR)
    if (out / JOURNAL_NAME).exists():
        (out / JOURNAL_NAME).unlink()
        removed.append(out / JOURNAL_NAME)
    return removed


_HELD_LOCK_FDS: set[int] = set()


def _close_inherited_locks() -> None:
    """In a forked child (a pack worker): drop the copies of the parent's lock descriptors.

    An flock belongs to the open file, which fork shares: a worker still holding a copy would
    keep the dataset locked after its parent died. Closing the copy leaves the parent's lock.
    """
    for fd in _HELD_LOCK_FDS:
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD_LOCK_FDS.clear()


os.register_at_fork(after_in_child=_close_inherited_locks)


class DatasetLock:
    """An exclusive kernel lock on a dataset directory, released if the holder dies."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / LOCK_NAME
        self.fd: int | None = None

    def __enter__(self) -> DatasetLock:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise PackInputError(f"{self.path.parent}: another tierflow process is writing this dataset") from None
        _HELD_LOCK_FDS.add(self.fd)
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self.fd is not None
        _HELD_LOCK_FDS.discard(self.fd)
        os.close(self.fd)
