"""Each thread's fetch ledger: the seconds, opens and bytes of shard fetches per serving tier, as the
thread that builds a batch records them (`telemetry.attribution` stamps each batch with them).

Torch-free, so a tier stack records its block reads from the store here without importing torch.
"""

from __future__ import annotations

import threading
from typing import Any


_unclaimed: list[FetchLedger] = []
"""The ledgers whose `batch` holds opens no batch has taken yet: while there is none (most batches), a timer
knows its thread's ledger has nothing for its batch without the thread-local lookup."""


class FetchLedger:
    """Running totals of fetch seconds and shard opens per serving tier, for one thread, and what was
    opened since the last `take_batch` (what `TimedBatches` stamps on the batch it is building)."""

    __slots__ = ("seconds", "opens", "bytes", "adds", "_mark", "batch")

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.opens: dict[str, int] = {}
        self.bytes: dict[str, int] = {}
        self.adds = 0
        self._mark: tuple[int, dict[str, float], dict[str, int], dict[str, int]] | None = None
        self.batch: dict[str, list[Any]] = {}
        """{tier: [seconds, opens, bytes]} added since the last `take_batch`; empty for most batches."""

    def add(self, tier: str, seconds: float, nbytes: int) -> None:
        self.seconds[tier] = self.seconds.get(tier, 0.0) + seconds
        self.opens[tier] = self.opens.get(tier, 0) + 1
        self.bytes[tier] = self.bytes.get(tier, 0) + nbytes
        self.adds += 1
        added = self.batch.get(tier)
        if added is None:
            if not self.batch:
                _unclaimed.append(self)
            self.batch[tier] = [seconds, 1, nbytes]
        else:
            added[0] += seconds
            added[1] += 1
            added[2] += nbytes

    def take_batch(self) -> dict[str, dict[str, Any]]:
        """Per tier, what was added since the last call (as `since` says it), and start afresh."""
        added, self.batch = self.batch, {}
        if added:
            _unclaimed.remove(self)
        return {
            tier: {"seconds": seconds, "opens": opens, "bytes": nbytes}
            for tier, (seconds, opens, nbytes) in added.items()
        }

    def mark(self) -> tuple[int, dict[str, float], dict[str, int], dict[str, int]]:
        """The totals now (the last mark again while nothing was added: no copies per batch)."""
        mark = self._mark
        if mark is None or mark[0] != self.adds:
            mark = self._mark = (self.adds, dict(self.seconds), dict(self.opens), dict(self.bytes))
        return mark

    def since(self, mark: tuple[int, dict[str, float], dict[str, int], dict[str, int]]) -> dict[str, dict[str, Any]]:
        """Per tier, what was added after `mark`: {"L2": {"seconds": s, "opens": n, "bytes": b}}."""
        adds, seconds, opens, nbytes = mark
        out: dict[str, dict[str, Any]] = {}
        if adds == self.adds:  # most batches open no shard
            return out
        for tier, total in self.opens.items():
            added = total - opens.get(tier, 0)
            if added:
                out[tier] = {
                    "seconds": self.seconds[tier] - seconds.get(tier, 0.0),
                    "opens": added,
                    "bytes": self.bytes[tier] - nbytes.get(tier, 0),
                }
        return out


class _ThreadLedgers(threading.local):
    """Each thread's own `ledger`, made when the thread first reads it."""

    def __init__(self) -> None:
        self.ledger = FetchLedger()


_local = _ThreadLedgers()


def thread_ledger() -> FetchLedger:
    """The calling thread's ledger (a DataLoader worker or the feed's producer thread)."""
    return _local.ledger


__all__ = ["FetchLedger", "thread_ledger"]
