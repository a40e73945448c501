"""The stager's fault log, apart from the stager: one warning per cause, repeats counted."""

from __future__ import annotations

import logging
import threading


class FaultLog:
    """One warning per cause (the error's type and message), not one traceback per occurrence: a
    shard whose bytes never verify, or a full disk, fails every staging attempt, and the stager
    retries. Repeats are counted; `close()` says how many there were. A traceback goes to DEBUG."""

    def __init__(self, logger: logging.Logger, limit: int = 1000) -> None:
        self.log = logger
        self.limit = limit
        self.counts: dict[tuple[str, str], int] = {}
        self.said: dict[tuple[str, str], str] = {}
        self._lock = threading.Lock()

    def warn(self, what: str, error: BaseException, then: str) -> None:
        """`what` failed with `error`; `then` is what happens instead. Warned once per cause."""
        cause = (type(error).__name__, str(error).splitlines()[0] if str(error) else "")
        with self._lock:
            first = cause not in self.counts
            if first and len(self.counts) >= self.limit:
                return
            self.counts[cause] = self.counts.get(cause, 0) + 1
        if first:
            self.said[cause] = f"{what}: {cause[0]}: {cause[1]}"
            self.log.warning(
                "%s; %s (repeats of this cause are counted, and their count logged when the stager stops)",
                self.said[cause],
                then,
            )
        self.log.debug("%s", what, exc_info=error)

    def close(self) -> None:
        """Log the count of every cause that happened more than once, then start again."""
        with self._lock:
            counts, self.counts = self.counts, {}
        for cause, n in counts.items():
            if n > 1:
                self.log.warning("%s: %d times in all", self.said[cause], n)
