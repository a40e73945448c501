"""Which tier served each batch's shards, and how long fetching them took, measured where the batch is built.

`AttributedShards` wraps any shard supply (a `TierStack`, a plain directory) and records every
shard open into the building thread's `FetchLedger`: seconds spent and the tier that served it, as the
tier stack reports it (the fastest tier that held the shard; a miss in L1 filled from L2 is served
by L2, a miss everywhere by the source). Each batch's meta is stamped with its timing: production seconds
and the fetch seconds per serving tier inside them, so the training process can attribute a stall without
seeing the worker that built the batch. A DataLoader worker's batches are timed by `TimedBatches`, which
wraps the `TieredDataset`; without workers the device feed builds the batches, timing each `next()` of
the dataset already, and `production_timer` stamps its batches with that time (no generator or clock of
its own).
"""

from __future__ import annotations

import time
import weakref
from typing import Any
from collections.abc import Callable, Iterator

from torch.utils.data import IterableDataset

from tierflow.telemetry.ledger import FetchLedger as FetchLedger, _local, _unclaimed, thread_ledger  # re-exported
from tierflow.telemetry.loader_metrics import MAPPED, SOURCE


class AttributedShards:
    """A shard supply that records, per open, the seconds it took and the tier that served it, as the
    tier stack reports them (`TierStack.open_served`); a source without tiers serves every open itself.
    A table this reader opened before and the stack still holds open is no new open: nothing is recorded,
    and no clock is read (most batches open only such tables)."""

    def __init__(self, source: Any) -> None:
        self.source = source
        # a closure, not a method: attribute reads on a class with __getattr__ are not specialised, and
        # this runs for every shard a batch touches
        self.open_shard = _recording_opens(source)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.source, name)


def _recording_opens(source: Any) -> Callable[[int, Any], Any]:
    """`source.open_shard`, recording in the thread's ledger each open of a table this reader had not seen."""
    tables: dict[int, weakref.ref[Any]] = {}
    clock = time.perf_counter

    def record(index: int, info: Any, table: Any, tier: str, seconds: float) -> Any:
        # weak: a strong reference would keep the shard's pin, so no tier could ever evict it
        tables[index] = weakref.ref(table)
        if len(tables) > 64:
            tables.pop(next(iter(tables)))
        thread_ledger().add(tier, seconds, int(getattr(info, "decoded_bytes", 0) or 0))
        return table

    open_served = getattr(source, "open_served", None)
    if open_served is None:

        def open_timed(index: int, info: Any) -> Any:
            started = clock()
            table = source.open_shard(index, info)
            seconds = clock() - started
            known = tables.get(index)
            return table if known is not None and known() is table else record(index, info, table, SOURCE, seconds)

        return open_timed

    held_open = source.held_open
    verified: dict[int, int] = {}
    """{index: the stack's generation when the table it held for `index` was one in `tables`}: while the
    generation stays, that table is still the one held, and a lookup is all an open costs."""

    def open_tiered(index: int, info: Any) -> Any:
        table = held_open(index)  # also what keeps the table's place among the open ones, as a plain open does
        if verified.get(index) == source.generation:  # read after the look: nothing changed since the check
            return table
        generation = source.generation  # read before the look that is checked: a change after it shows
        table = held_open(index)
        known = tables.get(index)
        if table is not None and known is not None and known() is table:
            if len(verified) > 64:
                verified.clear()
            verified[index] = generation
            return table
        table, served_by, seconds = open_served(index, info)
        if served_by is None:  # the stack had it open, no fetch
            if known is not None and known() is table:
                return table
            return record(index, info, table, MAPPED, seconds)
        return record(index, info, table, served_by, seconds)

    return open_tiered


def attribute_fetches(dataset: Any) -> None:
    """Make this process's reading context of a `TieredDataset` record its shard opens."""
    dataset.wrap_shards(lambda source: source if isinstance(source, AttributedShards) else AttributedShards(source))


def production_timer(dataset: Any) -> Callable[[Any, float], None]:
    """`timed(batch, seconds)`, which stamps a batch built in this process with its timing: the device feed
    calls it with the seconds its `next()` of `dataset` took, in the thread that built the batch (inline, or
    the feed's own), so that thread's ledger holds the batch's opens. Makes `dataset` record its opens."""
    attribute_fetches(dataset)
    thread_ledger().take_batch()  # what was opened before the first build is no batch's
    local, unclaimed = _local, _unclaimed

    def timed(batch: Any, seconds: float) -> None:
        batch.meta.produce_s = seconds
        if unclaimed and local.ledger.batch:
            batch.meta.fetch = local.ledger.take_batch()

    return timed


class TimedBatches(IterableDataset):
    """A `TieredDataset` whose batches' meta carry their timing (`BatchMeta.produce_s` and `fetch`): what a
    DataLoader worker iterates (without workers, `production_timer` stamps the same timing)."""

    def __init__(self, dataset: Any) -> None:
        super().__init__()
        self.dataset = dataset

    def __iter__(self) -> Iterator[Any]:
        return time_batches(self.dataset, iter(self.dataset))

    def __repr__(self) -> str:
        return f"TimedBatches({self.dataset!r})"


def time_batches(dataset: Any, batches: Iterator[Any]) -> Iterator[Any]:
    """`batches` (of `dataset`, built in this process: a worker's), each stamped with its timing."""
    attribute_fetches(dataset)
    local, clock = _local, time.perf_counter
    ledger = thread_ledger()
    ledger.take_batch()  # what was opened before the first build is no batch's
    started = clock()
    for batch in batches:
        # the timing travels in the batch's meta, beside its data, to the training process
        batch.meta.produce_s = clock() - started
        if ledger.batch:
            batch.meta.fetch = ledger.take_batch()
        yield batch
        ledger = local.ledger  # this generator may move to the feed's thread between batches
        if ledger.batch:
            ledger.take_batch()  # opened between batches (outside any batch's build): no batch's fetch
        started = clock()
