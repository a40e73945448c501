"""A small file published whole or not at all: the one way this package writes a manifest, a
metadata header or a checkpoint marker."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomically(path: Path, data: bytes) -> Path:
    """Write `data` under a temporary name beside `path`, fsync, rename over `path`, fsync the
    directory: a crash leaves the old file or the new one, never a torn one or the temporary."""
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path
