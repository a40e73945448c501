"""What a tier does when it cannot be used: the read is served from the tier below, counted.

Tiers are optional, so no failure of a tier's own files fails a read. Four cases:
- bypass: the policy declines an entry, or no room can be made (counted where decided, tiers/tier.py);
- a vanished tier: its directory was deleted (an operator freeing a disk) or replaced, or its index
  is damaged, under this process: the tier is bypassed from now on (`unavailable`,
  `TierUnavailableWarning` once; a new process sets the directory up again);
- a full disk, whether the entry's write, its fetch lock or the index (SQLite) hits it: a warning
  once, counted in `tierflow_tier_enospc_fallbacks_total` / `tierflow_tier_index_unwritable_total`;
- a write failed: a failing device (EIO, a read-only file system) while writing an entry, its fetch
  lock or the index, counted in `tierflow_tier_write_error_fallbacks_total`.
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tierflow.errors import TierUnavailableWarning
from tierflow.telemetry import Counter
from tierflow.tiers._index import IndexTrouble, index_damaged
from tierflow.tiers._lock import FileLock
from tierflow.tiers.entries import INDEX_NAME, SUBDIRS

log = logging.getLogger("tierflow.tiers")
NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})
DEVICE_FAILED = frozenset({errno.EIO, errno.EROFS})
"""Write errors of a tier's own files after which the read is served from below (tiers are optional)."""


class TierFallbacks:
    """One tier's failures as this process met them: whether it is bypassed, and what was warned."""

    def __init__(
        self,
        root: Path,
        name: str,
        *,
        enospc: Counter,
        write_errors: Counter,
        unavailable: Counter,
        index_unwritable: Counter,
    ) -> None:
        """`root` must exist: its identity now is what `vanished` compares against."""
        self.root = root
        self.name = name
        found = os.stat(root)
        self._identity = (found.st_dev, found.st_ino)
        self._lock = threading.Lock()
        self.unavailable: str | None = None
        """Why this process no longer uses the tier (its directory vanished or was replaced, its index
        broke), or None: then every read is served from below (`TierUnavailableWarning`, once)."""
        self.m_enospc = enospc
        self.m_write_errors = write_errors
        self.m_unavailable = unavailable
        self.index_trouble = IndexTrouble(index_unwritable, f"tier {name} ({root})", self.broken)
        self._warned_enospc = False
        self._warned_write_error = False

    # ------------------------------------------------------------ a tier that vanished or broke
    def vanished(self) -> str | None:
        """What is gone of the tier's directory (an operator deleted it to free a disk, or replaced
        it), or None while it is the directory this tier opened, whole."""
        try:
            found = os.stat(self.root)
        except FileNotFoundError:
            return "its directory vanished"
        except OSError:
            return None  # a failing device: the write-error paths decide
        if (found.st_dev, found.st_ino) != self._identity:
            return "its directory was replaced by another"
        missing = [sub for sub in SUBDIRS if not os.path.lexists(self.root / sub)]
        return f"{', '.join(missing)} vanished from its directory" if missing else None

    def bypassed(self) -> bool:
        """Whether this tier is no longer used (checked on a miss: one look at the directory); a read
        it turns away is counted."""
        if self.unavailable is None:
            reason = self.vanished()
            if reason is not None:
                self.bypass(reason)
        if self.unavailable is not None:
            self.m_unavailable.inc()
            return True
        return False

    def broken(self, error: BaseException) -> bool:
        """Whether `error`, raised using the tier's files or index, means the tier cannot be used by
        this process any more: its directory vanished or was replaced, or its index is damaged.
        Then the tier is bypassed from now on (warned once) and True is returned; any other error
        (the source's, a bug) is False, for the caller to raise."""
        if self.unavailable is not None:
            return True
        reason = None
        if index_damaged(error):
            reason = f"its index {self.root / INDEX_NAME} is damaged ({error})"
        elif isinstance(error, (OSError, sqlite3.Error)):
            reason = self.vanished()
        if reason is None:
            return False
        self.bypass(reason)
        return True

    def bypass(self, reason: str) -> None:
        with self._lock:  # one warning, whichever thread finds it first
            if self.unavailable is not None:
                return
            self.unavailable = reason
        warnings.warn(
            TierUnavailableWarning(
                f"tier {self.name} ({self.root}): {reason}; this process bypasses the tier from now on, reading from "
                f"the tier below (or the source); a new process sets the directory up again"
            ),
            stacklevel=3,
        )

    # ------------------------------------------------------------ a full or failing disk
    def write_failed(self, error: OSError) -> None:
        self.m_write_errors.inc()
        if not self._warned_write_error:
            log.warning(
                "tier %s (%s): a write failed (%s); serving from the tier below without caching",
                self.name,
                self.root,
                error,
            )
            self._warned_write_error = True

    def no_space(self) -> None:
        self.m_enospc.inc()
        if not self._warned_enospc:
            log.warning(
                "tier %s (%s): no space left on the device; serving from the tier below without caching",
                self.name,
                self.root,
            )
            self._warned_enospc = True

    @contextmanager
    def fetch_lock(self, key: str, timeout: float) -> Iterator[FileLock | None]:
        """The entry's fetch lock, held; None when its file cannot be made (a full or failing device)."""
        lock = FileLock(self.root / "locks" / f"{key}.lock", timeout)
        try:
            lock.__enter__()
        except OSError as e:
            if e.errno in NO_SPACE:
                self.m_enospc.inc()
            elif e.errno in DEVICE_FAILED:
                self.write_failed(e)
            else:
                raise
            yield None
            return
        try:
            yield lock
        finally:
            lock.__exit__()
