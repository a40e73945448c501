"""Which tier served each batch's shards, and how long fetching them took, measured where the batch is built.

`AttributedShardSource` wraps any shard source (a `TierStack`, a plain directory) and records every
shard open into the building thread's `FetchLedger`: seconds spent and the tier that served it (the
fastest tier that hit; a miss in L1 filled from L2 is served by L2, a miss everywhere by the source). `TimedBatches`
wraps a `TieredDataset` and stamps each batch's meta with its timing: production seconds and the fetch
seconds per serving tier inside them, so the training process can attribute a stall without
seeing the worker that built the batch.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any, Iterator

from torch.utils.data import IterableDataset

from tierflow.telemetry.loader_metrics import MAPPED, SOURCE


class FetchLedger:
    """Running totals of fetch seconds and shard opens per serving tier, for one thread."""

    __slots__ = ("seconds", "opens", "bytes")

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.opens: dict[str, int] = {}
        self.bytes: dict[str, int] = {}

    def add(self, tier: str, seconds: float, nbytes: int) -> None:
        self.seconds[tier] = self.seconds.get(tier, 0.0) + seconds
        self.opens[tier] = self.opens.get(tier, 0) + 1
        self.bytes[tier] = self.bytes.get(tier, 0) + nbytes

    def mark(self) -> tuple[dict[str, float], dict[str, int], dict[str, int]]:
        return dict(self.seconds), dict(self.opens), dict(self.bytes)

    def since(self, mark: tuple[dict[str, float], dict[str, int], dict[str, int]]) -> dict[str, dict[str, Any]]:
        """Per tier, what was added after `mark`: {"L2": {"seconds": s, "opens": n, "bytes": b}}."""
        seconds, opens, nbytes = mark
        out: dict[str, dict[str, Any]] = {}
        for tier, total in self.opens.items():
            added = total - opens.get(tier, 0)
            if added:
                out[tier] = {"seconds": self.seconds[tier] - seconds.get(tier, 0.0), "opens": added,
                             "bytes": self.bytes[tier] - nbytes.get(tier, 0)}
        return out


_local = threading.local()
def thread_ledger() -> FetchLedger:
    """The calling thread's ledger (a DataLoader worker or the feed's producer thread)."""
    ledger = getattr(_local, "ledger", None)
    if ledger is None:
        ledger = _local.ledger = FetchLedger()
    return ledger


class AttributedShardSource:
    """A shard source that records, per open, the seconds it took and the tier that served it."""

    def __init__(self, source: Any) -> None:
        self.source = source
        self._tables: dict[int, Any] = {}
        # fastest first: the first tier whose hit counter moved served the shard; if only misses,
        # bypasses or the stack's source counters moved, the source did; if nothing moved, it was open
        self._hits = [(t.name, t.m_hits) for t in getattr(source, "tiers", []) if hasattr(t, "m_hits")]
        self._below = [t.m_misses for t in getattr(source, "tiers", []) if hasattr(t, "m_misses")]
        self._below += [t.m_bypass for t in getattr(source, "tiers", []) if hasattr(t, "m_bypass")]
        served = getattr(source, "m_served", {})
        self._below += [served[name] for name in (SOURCE, "memory") if name in served]
        self._counted = bool(self._hits or self._below)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.source, name)

    def open_shard(self, index: int, info: Any) -> Any:
        before = self._counts()
        started = time.perf_counter()
        table = self.source.open_shard(index, info)
        seconds = time.perf_counter() - started
        known = self._tables.get(index)
        if known is not None and known() is table:
            return table
        tier = self._served_by(before)
        # weak: a strong reference would keep the shard's pin, so no tier could ever evict it
        self._tables[index] = weakref.ref(table)
        if len(self._tables) > 64:
            self._tables.pop(next(iter(self._tables)))
        decoded = int(getattr(info, "decoded_bytes", 0) or 0)
        thread_ledger().add(tier, seconds, decoded)
        return table

    def _counts(self) -> list[int | float]:
        return [c.value for _, c in self._hits] + [c.value for c in self._below]

    def _served_by(self, before: list[int | float]) -> str:
        if not self._counted:
            return SOURCE
        for (name, counter), value in zip(self._hits, before):
            if counter.value != value:
                return name
        if any(c.value != v for c, v in zip(self._below, before[len(self._hits):])):
            return SOURCE
        return MAPPED


def attribute_fetches(dataset: Any) -> None:
    """Make this process's reading context of a `TieredDataset` record its shard opens."""
    context = dataset._open()
    if not isinstance(context.dataset.source, AttributedShardSource):
        context.dataset.source = AttributedShardSource(context.dataset.source)


def stamp(batch: Any, timing: dict[str, Any]) -> None:
    """Put `timing` in a carried batch's meta, which travels beside its data to the training process."""
    batch.meta.timing = timing


class TimedBatches(IterableDataset):
    """A `TieredDataset` whose batches' meta carry `timing` = {"produce_s", "fetch": {tier: {...}}}."""

    def __init__(self, dataset: Any) -> None:
        super().__init__()
        self.dataset = dataset

    def __iter__(self) -> Iterator[dict[str, Any]]:
        attribute_fetches(self.dataset)
        ledger = thread_ledger()
        batches = iter(self.dataset)
        while True:
            mark = ledger.mark()
            started = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                return
            stamp(batch, {"produce_s": time.perf_counter() - started, "fetch": ledger.since(mark)})
            yield batch

    def __repr__(self) -> str:
        return f"TimedBatches({self.dataset!r})"
