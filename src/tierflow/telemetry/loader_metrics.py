"""The loader's own figures: time the training loop waited, step time, bubble rate, production
latency, prefetch depth, and each stall attributed to a tier (fetch), to preparation, or to the copy.

A batch's wait splits three ways. The part beyond the batch's whole production time went to moving
it (worker transfer, host-to-device copy): "copy". The rest splits in the proportion of the batch's
fetch seconds to its production seconds: fetch, charged to the tier that spent the most fetch time
on it, and "prep" (decode, batching, transforms). The parts always add up to the wait.
"""

from __future__ import annotations

import itertools
import struct
import threading
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from tierflow.telemetry.metrics import SIZE_BUCKETS, Histogram, MetricsRegistry
from tierflow.telemetry.snapshots import SNAPSHOT_SCHEMA, merge_snapshots

MAPPED = "mapped"
"""Served by a shard the source already held open: no fetch happened."""
SOURCE = "source"

WAIT = "tierflow_loader_wait_seconds"
STARTUP = "tierflow_loader_startup_seconds_total"
STEP = "tierflow_loader_step_seconds"
PRODUCTION = "tierflow_loader_production_seconds"
DEPTH = "tierflow_loader_prefetch_depth"
STALL = "tierflow_loader_stall_seconds_total"
STALLS = "tierflow_loader_stalls_total"
BATCHES = "tierflow_loader_batches_total"
FETCH = "tierflow_loader_fetch_seconds_total"
FETCH_BYTES = "tierflow_loader_fetch_bytes_total"
FLUSH_EVERY = 512
"""Batches `LoaderTelemetry` records per bulk update of its metrics. A flush's fixed cost (~40 numpy calls)
is spread over them: 512 costs ~0.6k instructions a batch less than 128 (callgrind). The records wait as
a flat list of numbers, not tuples or timing dicts: a batch leaves nothing waiting that the garbage collector
counts (a batch that opened a shard, its fetch dict), so waiting records start no young collection (a timing
dict and its fetch dict per batch started one every ~350 batches)."""
BatchRecord = tuple[float, float, float | None, float | None, Mapping[str, Any] | None, int | None]
"""One batch as a loader records it: (asked, handed, last handed, production seconds, fetch, depth), the last
three as its meta has them (`BatchMeta.produce_s`, `BatchMeta.fetch`); see `LoaderTelemetry.recorder`."""
RECORD_FIELDS = 6
"""A `BatchRecord`'s length: the records wait flattened, one after another, in one list."""
FLUSH_AT = FLUSH_EVERY * RECORD_FIELDS
"""The length of the pending list at which a recorder flushes."""


def split_wait(wait_s: float, timing: Mapping[str, Any] | None) -> dict[tuple[str, str], float]:
    """{(cause, tier): seconds} for one batch's wait; tier is "" for prep and copy."""
    parts: dict[tuple[str, str], float] = {}
    add_wait(parts, wait_s, timing)
    return parts


_PREP, _COPY = ("prep", ""), ("copy", "")


def add_wait(parts: dict[tuple[str, str], float], wait_s: float, timing: Mapping[str, Any] | None) -> None:
    """Add one batch's wait to `parts` by cause: what production does not explain is the copy after it;
    of the rest, the share its shard opens took is the fetch (charged to the tier that took longest),
    the remainder preparation."""
    if wait_s <= 0:
        return
    if timing is None:
        parts[_PREP] = parts.get(_PREP, 0.0) + wait_s
        return
    produce = float(timing.get("produce_s", 0.0))
    if wait_s > produce:
        parts[_COPY] = parts.get(_COPY, 0.0) + wait_s - produce
    explained = min(wait_s, produce)
    opened = timing.get("fetch")
    fetched = {t: f["seconds"] for t, f in opened.items() if t != MAPPED and f["seconds"] > 0} if opened else None
    fetch_s = min(sum(fetched.values()), produce) if fetched else 0.0
    if fetched and produce > 0 and fetch_s > 0:
        fetch_part = explained * fetch_s / produce
        key = ("fetch", max(fetched, key=fetched.__getitem__))
        parts[key] = parts.get(key, 0.0) + fetch_part
        explained -= fetch_part
    if explained > 0:
        parts[_PREP] = parts.get(_PREP, 0.0) + explained


def _floats(values: Iterable[float | None], n: int) -> tuple[np.ndarray, bool]:
    """The `n` values as a float64 array and whether none was None (a None reads NaN). Packed by a `struct`,
    which converts a float in a few instructions where `np.fromiter` spends ~200 (a flush converts five
    columns of 128)."""
    packer = _PACKERS.get(n)
    if packer is None:
        packer = _PACKERS[n] = struct.Struct(f"{n}d")
    try:
        return np.frombuffer(packer.pack(*values), dtype=np.float64), True
    except struct.error:  # a None among them
        return np.fromiter(values, dtype=np.float64, count=n), False


_PACKERS: dict[int, struct.Struct] = {}


def _split_unfetched(wait: np.ndarray, produced: np.ndarray, parts: dict[tuple[str, str], float]) -> None:
    """`add_wait` for batches that opened no shard, all at once: of a positive wait, the part past production
    is the copy, the rest (all of it, when production took longer or nobody timed the batch: NaN) preparation."""
    waited = np.maximum(wait, 0.0)
    copy = float(np.add.reduce(np.fmax(waited - produced, 0.0)))  # production is never negative
    prep = float(np.add.reduce(waited)) - copy
    if copy > 0:
        parts[_COPY] = parts.get(_COPY, 0.0) + copy
    if prep > 0:
        parts[_PREP] = parts.get(_PREP, 0.0) + prep


@dataclass(frozen=True)
class LoaderFigures:
    """What the training loop saw, in seconds unless named otherwise."""

    batches: int
    wait_s: float
    step_s: float
    bubble_rate: float
    wait_p90_s: float
    wait_p99_s: float
    production_p50_s: float
    production_p90_s: float
    production_p99_s: float
    step_mean_s: float
    prefetch_depth_mean: float
    stall_s: dict[str, float]
    stalls: int
    fetch_s: dict[str, float]
    fetch_bytes: dict[str, int]
    startup_s: float = 0.0
    """What the loop waited for the start-up batches (`LoaderTelemetry.startup_batches`), kept out of the
    wait figures and the bubble rate."""


class LoaderTelemetry:
    """Records what `Loader` sees per batch into a `MetricsRegistry` (shared with the tiers if you like)."""

    def __init__(
        self,
        registry: MetricsRegistry | None = None,
        labels: Mapping[str, Any] | None = None,
        stall_threshold_s: float = 1e-3,
        events: Any = None,
        startup_batches: int = 0,
        owns_events: bool = False,
    ) -> None:
        self.registry = registry if registry is not None else MetricsRegistry()
        self.labels = dict(labels or {})
        self.events = events
        """An `EventLog` that gets one record per batch, or None."""
        self.owns_events = owns_events
        """`close()` ends the event log (`open_loader(events=...)` made it for this telemetry alone)."""
        self._last_step: float | None = None
        self.stall_threshold_s = stall_threshold_s
        r, base = self.registry, self.labels
        self.wait = r.histogram(WAIT, base, "time the training loop waited inside next()")
        self.step = r.histogram(STEP, base, "time the training loop spent between next() calls")
        self.production = r.histogram(PRODUCTION, base, "request to complete batch, where it was built")
        self.depth = r.histogram(DEPTH, base, "batches ready ahead when the loop asked", layout=SIZE_BUCKETS)
        self.depth_now = r.gauge(DEPTH + "_now", base, "batches ready ahead now", aggregate="sum")
        self.batches = r.counter(BATCHES, base, "batches handed to the training loop")
        self.stalls = r.counter(STALLS, base, f"batches the loop waited more than {stall_threshold_s}s for")
        self._stall: dict[tuple[str, str], Any] = {}
        self._fetch: dict[str, tuple[Any, Any]] = {}
        self._handed = 0
        """Batches recorded with an event log attached (each record's index)."""
        self._recorded = 0
        """Batches flushed so far."""
        self.startup_batches = startup_batches
        """The first batches are start-up (processes, threads, first shards): a short run's bubble would be
        mostly start-up, so their waits are counted apart (`LoaderFigures.startup_s`)."""
        self.startup = r.counter(STARTUP, base, "time the training loop waited for the start-up batches")
        self._pending: list[Any] = []
        """The `BatchRecord`s not flushed yet, flattened: a record is one `extend` (atomic under the GIL), and
        a flush takes its columns as slices, with no step per record."""
        self._flushing = threading.Lock()
        self.registry.add_buffer(self)

    def on_batch(
        self,
        wait_s: float,
        timing: Mapping[str, Any] | None = None,
        depth: int | None = None,
        step_s: float | None = None,
    ) -> None:
        """One batch handed over after `wait_s` in next(); `timing` is its meta's (`BatchMeta.timing`);
        `step_s`, the loop's step just before it asked for this batch (what `on_step` records), given here
        so a caller records both in one call. Recorded in bulk every `FLUSH_EVERY` batches and before any
        snapshot: per batch, an append."""
        # as clock readings: asked at 0, handed at the wait, the last batch handed one step before 0
        produce_s, fetch = (None, None) if timing is None else (timing.get("produce_s"), timing.get("fetch") or None)
        self._add((0.0, wait_s, None if step_s is None else -step_s, produce_s, fetch, depth))

    def _add(self, record: BatchRecord) -> None:
        """Pend one record (and write its event, with an event log), flushing at `FLUSH_AT`."""
        if self.events is not None:
            asked, handed, last, produce_s, fetch, depth = record
            if last is not None:
                self._last_step = asked - last
            self.events.batch(self._handed, handed - asked, self._last_step, depth, produce_s, fetch)
            self._handed += 1
        pending = self._pending
        pending.extend(record)
        if len(pending) >= FLUSH_AT:
            self.flush()

    def recorder(self) -> tuple[Callable[[BatchRecord], None], list[Any]]:
        """`(record, pending)`: a loader calls `record((asked, handed, last_handed, produce_s, fetch, depth))` per
        batch (the clock when the loop asked for the batch, when it got it, when it got the one before (None: the
        first of a `for`), the batch's timing as its meta holds it and the batches ready ahead), then `flush()`
        once `len(pending) >= FLUSH_AT`. The wait and the step are taken from these in bulk when the records are
        flushed: per batch a C call (the pending list's `extend`), no arithmetic, no Python frame."""
        return (self._add if self.events is not None else self._pending.extend), self._pending

    def flush(self) -> None:
        """Apply the batches recorded since the last flush to the registry's metrics, in bulk: one numpy pass
        per histogram, one update per counter, and no Python step per batch unless a batch opened a shard."""
        pending = self._pending
        if not pending:
            return
        with self._flushing:
            size = len(pending) // RECORD_FIELDS * RECORD_FIELDS
            if not size:
                return
            records = pending[:size]
            del pending[:size]  # records appended meanwhile stay, after these
            n = size // RECORD_FIELDS
            askeds, handeds, lasts, produces, fetches, depths = (
                records[i::RECORD_FIELDS] for i in range(RECORD_FIELDS)
            )
            asked = _floats(askeds, n)[0]
            wait = _floats(handeds, n)[0] - asked
            last, every = _floats(lasts, n)  # None (NaN): no step, before the first batch of a `for`
            step = asked - last
            if not every:
                step = step[~np.isnan(step)]
            if step.size:
                self.step.observe_vector(step)
            startup = min(n, self.startup_batches - self._recorded)
            self._recorded += n
            if startup > 0:  # the run's first batches: their waits are start-up, counted apart
                self.startup.inc(float(np.add.reduce(wait[:startup])))
                wait[:startup] = 0.0
            self.wait.observe_vector(wait)
            stalls = int(np.count_nonzero(wait > self.stall_threshold_s))
            depth, every = _floats(depths, n)  # None (NaN): the feed knew no depth
            if not every:
                depth = depth[~np.isnan(depth)]
            if depth.size:
                self.depth.observe_vector(depth)
                self.depth_now.set(next(d for d in reversed(depths) if d is not None))
            stalled: dict[tuple[str, str], float] = {}
            produced, timed = _floats(produces, n)  # None (NaN): a batch nobody timed (a DataLoader you built)
            # the batches that opened a shard, found in C (a Python loop over 512 records costs ~10 opcodes a
            # batch: most flushes hold one such batch)
            each = list(itertools.compress(range(n), fetches)) if any(fetches) else []
            if each:  # a few per flush, where a batch moved to a shard its reader had not opened
                plain = np.ones(n, dtype=bool)
                plain[each] = False
                _split_unfetched(wait[plain], produced[plain], stalled)
                self._split_each(wait[each].tolist(), produced[each].tolist(), [fetches[i] for i in each], stalled)
            else:
                _split_unfetched(wait, produced, stalled)
            if not timed:
                produced = produced[~np.isnan(produced)]
            if produced.size:
                self.production.observe_vector(produced)
            if stalls:
                self.stalls.inc(stalls)
            self.batches.inc(n)
            for key, seconds in stalled.items():
                counter = self._stall.get(key)
                if counter is None:
                    cause, tier = key
                    labels = {**self.labels, "cause": cause, **({"tier": tier} if tier else {})}
                    counter = self._stall[key] = self.registry.counter(STALL, labels, "loop wait by cause and tier")
                counter.inc(seconds)

    def _split_each(
        self,
        waits: Sequence[float],
        produced: Sequence[float],
        fetches: Sequence[Mapping[str, Any]],
        stalled: dict[tuple[str, str], float],
    ) -> None:
        """Count the fetches of batches that opened a shard and add their waits to `stalled` by cause."""
        for wait_s, produce_s, fetch in zip(waits, produced, fetches):
            for tier, fetched in fetch.items():
                seconds, nbytes = self._fetch_counters(tier)
                seconds.inc(fetched["seconds"])
                nbytes.inc(fetched["bytes"])
            add_wait(stalled, wait_s, {"produce_s": produce_s, "fetch": fetch})

    def clear(self) -> None:
        self._pending.clear()

    def on_step(self, step_s: float) -> None:
        """The training loop's own time for one step (measured between next() calls, or reported)."""
        self.step.observe(step_s)
        self._last_step = step_s

    def _fetch_counters(self, tier: str) -> tuple[Any, Any]:
        pair = self._fetch.get(tier)
        if pair is None:
            labels = {**self.labels, "tier": tier}
            pair = self._fetch[tier] = (
                self.registry.counter(FETCH, labels, "seconds spent opening shards, by serving tier"),
                self.registry.counter(FETCH_BYTES, labels, "decoded bytes of shards opened, by serving tier"),
            )
        return pair

    def figures(self) -> LoaderFigures:
        return loader_figures(self.registry.snapshot())  # the snapshot flushes

    def close(self) -> None:
        """The Loader closes: an event log this telemetry owns gets its last snapshot and its `end`
        record, with the run's figures."""
        if self.events is not None and self.owns_events:
            figures = self.figures()
            self.events.close(batches=figures.batches, wait_s=figures.wait_s, step_s=figures.step_s)


def loader_figures(snapshot: Mapping[str, Any]) -> LoaderFigures:
    """The loader's figures from a registry snapshot (one process's, or merged)."""

    def histogram(name: str) -> Histogram:
        entries = [h for h in snapshot["histograms"] if h["name"] == name]
        if not entries:
            return Histogram(name)
        labels = {k for e in entries for k in e["labels"]}
        only = {"schema": SNAPSHOT_SCHEMA, "counters": [], "gauges": [], "histograms": entries}
        return Histogram.from_snapshot(merge_snapshots([only], drop_labels=labels)["histograms"][0])

    def by_label(name: str, label: str, key: Any = None) -> dict[str, float]:
        out: dict[str, float] = {}
        for c in snapshot["counters"]:
            if c["name"] == name:
                k = key(c["labels"]) if key else c["labels"].get(label, "")
                out[k] = out.get(k, 0) + c["value"]
        return out

    wait, step, production, depth = histogram(WAIT), histogram(STEP), histogram(PRODUCTION), histogram(DEPTH)
    busy = wait.sum + step.sum
    stall = by_label(STALL, "", key=lambda labels: labels["cause"] + (f":{labels['tier']}" if "tier" in labels else ""))
    return LoaderFigures(
        batches=int(sum(by_label(BATCHES, "").values())),
        wait_s=wait.sum,
        step_s=step.sum,
        bubble_rate=wait.sum / busy if busy > 0 else 0.0,
        wait_p90_s=wait.quantile(0.9),
        wait_p99_s=wait.quantile(0.99),
        production_p50_s=production.quantile(0.5),
        production_p90_s=production.quantile(0.9),
        production_p99_s=production.quantile(0.99),
        step_mean_s=step.mean,
        prefetch_depth_mean=depth.mean,
        stall_s=stall,
        stalls=int(sum(by_label(STALLS, "").values())),
        fetch_s=by_label(FETCH, "tier"),
        fetch_bytes={k: int(v) for k, v in by_label(FETCH_BYTES, "tier").items()},
        startup_s=sum(by_label(STARTUP, "").values()),
    )
