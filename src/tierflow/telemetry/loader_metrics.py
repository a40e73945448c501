"""The loader's own figures: time the training loop waited, step time, bubble rate, production
latency, prefetch depth, and each stall attributed to a tier (fetch), to preparation, or to the copy.

A batch's wait splits three ways. The part beyond the batch's whole production time went to moving
it (worker transfer, host-to-device copy): "copy". The rest splits in the proportion of the batch's
fetch seconds to its production seconds: fetch, charged to the tier that spent the most fetch time
on it, and "prep" (decode, batching, transforms). The parts always add up to the wait.
"""

from __future__ import annotations

import collections
import itertools
import threading
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from tierflow.telemetry.metrics import SIZE_BUCKETS, SNAPSHOT_SCHEMA, Histogram, MetricsRegistry, merge_snapshots

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
FLUSH_EVERY = 256
"""Batches `LoaderTelemetry` records per bulk update of its metrics."""


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

    def __init__(self, registry: MetricsRegistry | None = None, labels: Mapping[str, Any] | None = None,
                 stall_threshold_s: float = 1e-3, events: Any = None, startup_batches: int = 0) -> None:
        self.registry = registry if registry is not None else MetricsRegistry()
        self.labels = dict(labels or {})
        self.events = events
        """An `EventLog` that gets one record per batch, or None."""
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
        self.startup_batches = startup_batches
        """The first batches are start-up (processes, threads, first shards): a short run's bubble would be
        mostly start-up, so their waits are counted apart (`LoaderFigures.startup_s`)."""
        self.startup = r.counter(STARTUP, base, "time the training loop waited for the start-up batches")
        self._pending: collections.deque[tuple[float, Mapping[str, Any] | None, int | None, float | None]] = \
            collections.deque()
        self._flushing = threading.Lock()
        self.registry.add_buffer(self)

    def on_batch(self, wait_s: float, timing: Mapping[str, Any] | None = None, depth: int | None = None,
                 step_s: float | None = None) -> None:
        """One batch handed over after `wait_s` in next(); `timing` is its meta's (`BatchMeta.timing`);
        `step_s`, the loop's step just before it asked for this batch (what `on_step` records), given here
        so a loader records both in one call. Recorded in bulk every `FLUSH_EVERY` batches and before any
        snapshot: per batch, an append."""
        if step_s is not None:
            self._last_step = step_s
        if self.events is not None:
            self.events.batch(self._handed, wait_s, self._last_step, depth, timing)
        self._handed += 1
        if self._handed <= self.startup_batches:
            self.startup.inc(wait_s)
            wait_s = 0.0
        pending = self._pending
        pending.append((wait_s, timing, depth, step_s))
        if len(pending) >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        """Apply the batches recorded since the last flush to the registry's metrics, in bulk: one numpy pass
        per histogram, one update per counter."""
        pending = self._pending
        if not pending:
            return
        with self._flushing:
            n = len(pending)
            if not n:
                return
            waits, timings, depths, steps = zip(*itertools.starmap(pending.popleft, itertools.repeat((), n)))
            wait = np.asarray(waits, dtype=np.float64)
            self.wait.observe_many(wait)
            stalls = int(np.count_nonzero(wait > self.stall_threshold_s))
            stepped = [step_s for step_s in steps if step_s is not None]
            if stepped:
                self.step.observe_many(stepped)
            known = [depth for depth in depths if depth is not None]
            if known:
                self.depth.observe_many(known)
                self.depth_now.set(known[-1])
            produced = []
            stalled: dict[tuple[str, str], float] = {}
            prep = copy = 0.0  # the waits of batches that opened no shard, split as add_wait would, inline
            for wait_s, timing in zip(waits, timings):
                if timing is None:
                    add_wait(stalled, wait_s, timing)
                    continue
                produce = float(timing.get("produce_s", 0.0))
                produced.append(produce)
                opened = timing.get("fetch")
                if opened:
                    for tier, fetched in opened.items():
                        seconds, nbytes = self._fetch_counters(tier)
                        seconds.inc(fetched["seconds"])
                        nbytes.inc(fetched["bytes"])
                    add_wait(stalled, wait_s, timing)
                elif wait_s > produce:
                    copy += wait_s - produce
                    prep += produce
                elif wait_s > 0:
                    prep += wait_s
            if prep > 0:
                stalled[_PREP] = stalled.get(_PREP, 0.0) + prep
            if copy > 0:
                stalled[_COPY] = stalled.get(_COPY, 0.0) + copy
            if produced:
                self.production.observe_many(produced)
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
    stall = by_label(STALL, "", key=lambda l: l["cause"] + (f":{l['tier']}" if "tier" in l else ""))
    return LoaderFigures(
        batches=int(sum(by_label(BATCHES, "").values())),
        wait_s=wait.sum, step_s=step.sum, bubble_rate=wait.sum / busy if busy > 0 else 0.0,
        wait_p90_s=wait.quantile(0.9), wait_p99_s=wait.quantile(0.99),
        production_p50_s=production.quantile(0.5), production_p90_s=production.quantile(0.9),
        production_p99_s=production.quantile(0.99), step_mean_s=step.mean,
        prefetch_depth_mean=depth.mean, stall_s=stall, stalls=int(sum(by_label(STALLS, "").values())),
        fetch_s=by_label(FETCH, "tier"), fetch_bytes={k: int(v) for k, v in by_label(FETCH_BYTES, "tier").items()},
        startup_s=sum(by_label(STARTUP, "").values()),
    )
