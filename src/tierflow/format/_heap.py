"""Giving the C heap's free pages back to the system once decoded blocks have been freed.

Decoded blocks are allocated from the C allocator (shard.DECODE_POOL). glibc serves blocks of a few
hundred KB from its heap once a freed one has raised its mmap threshold, and keeps the pages of
freed chunks resident: reading the peers' token corpus with a decoded cache of ~33 MB, the
process's anonymous memory grew ~30 MB over an epoch while the cache stayed at its bound
(docs/memory.md). `malloc_trim(0)` returns every free page of every arena (~2 ms on that heap); the
cache calls it after each TRIM_EVERY bytes it evicted. Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Callable

TRIM_EVERY = 16 << 20
"""Evicted bytes between trims: ~2 ms each, against the ~20 ms it takes to decode that much again."""


def _find_trim() -> Callable[[], None] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # musl and other C libraries have no malloc_trim
        return None
    trim.argtypes = [ctypes.c_size_t]
    return lambda: trim(0)


_trim = _find_trim()


def release_free_heap() -> bool:
    """Return the C heap's free pages to the system; False where the C library cannot."""
    if _trim is None:
        return False
    _trim()
    return True
