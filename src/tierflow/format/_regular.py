"""Open only regular files, and read no more than their declared size.

A dataset directory comes from untrusted places: a FIFO named `manifest.json` would block a
plain `open()` for ever, and a symlink to /dev/zero would be read without end. Files are opened
with O_NONBLOCK (so the open itself cannot wait for a FIFO's writer), checked with `fstat` on
the descriptor (no race with a rename), and refused with the caller's typed error unless they
are regular files.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from collections.abc import Callable

from tierflow.errors import ShardCorruptError, SourceNotFound

ErrorFactory = Callable[[str], Exception]

_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a directory"),
)


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "a special file")


def open_regular(path: str | os.PathLike, error: ErrorFactory = ShardCorruptError) -> int:
    """A read-only descriptor of `path`, which must be a regular file (after symlinks);
    `error(message naming the path)` is raised otherwise. FileNotFoundError passes through."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ENXIO:  # a socket (or a FIFO opened for writing) cannot be opened to read
            raise error(f"{os.fspath(path)}: a socket or device, not a regular file; refused") from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise error(f"{os.fspath(path)}: {_kind(mode)}, not a regular file; refused")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_shard_file(path: Path) -> int:
    """`open_regular` for a dataset's shard: a missing one is SourceNotFound naming it (a bare
    FileNotFoundError would not say it is a shard of the dataset)."""
    try:
        return open_regular(path)
    except FileNotFoundError:
        raise SourceNotFound(str(path.parent), path.name, "no such shard file") from None


def read_regular(path: str | os.PathLike, max_bytes: int | None, error: ErrorFactory = ShardCorruptError) -> bytes:
    """The whole of a regular file (of at most `max_bytes`; larger is `error`, as is a special file)."""
    fd = open_regular(path, error)
    try:
        size = os.fstat(fd).st_size
        if max_bytes is not None and size > max_bytes:
            raise error(f"{os.fspath(path)}: {size} bytes, more than the {max_bytes} it may have; refused")
        chunks, got = [], 0
        while got < size:  # at most the size fstat gave: a file growing while read adds nothing
            chunk = os.read(fd, size - got)
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def fd_path(fd: int, path: str | os.PathLike) -> str:
    """A name that opens the very file `fd` refers to (Linux: /proc/self/fd), for APIs that take
    only names (pyarrow's memory_map): the file checked is the file mapped. Elsewhere, `path`."""
    proc = f"/proc/self/fd/{fd}"
    return proc if os.path.exists(proc) else os.fspath(path)
