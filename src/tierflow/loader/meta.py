"""What the loader knows about a batch, kept beside the user's tensors instead of inside their dict.

The dataset makes one `BatchMeta` per batch it builds; telemetry adds the batch's timing and a
worker its metrics snapshot; the device feed passes it along untouched; the Loader reads it (the
cursor to save, the order check, epoch edges, counts) and hands the user only their tensors,
unless they ask: `loader.last_meta`, or `Loader(..., return_meta=True)` yielding (batch, meta).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from tierflow.loader._collate import CarriedBatch
from tierflow.loader.cursor import LoaderCursor
from tierflow.loader.plan import PlannedCursor, Selection
from tierflow.telemetry.metrics import MetricsRegistry
from tierflow.telemetry.snapshots import merge_snapshots


class WorkerSnapshot(NamedTuple):
    """A DataLoader worker's metrics, cumulative since the process started (its readers' tier and
    cache counters live in that process); `pid` tells a worker of the next iteration from this one."""

    worker: int
    pid: int
    snapshot: dict[str, Any]


@dataclass(slots=True, eq=False)
class BatchMeta:
    """One batch's bookkeeping: the loader's state once it is consumed (`cursor`, computed on first
    use from `planned`, see `PlannedCursor`), its number since the iteration started (`index`),
    the epoch it belongs to, its samples in row order (global ids and their epochs), the batcher's
    counts (`stats`: copied_bytes, filtered, samples, ...), production timing when telemetry is
    on (`timing`), now and then its worker's metrics, and in a mixture the dataset of each sample."""

    planned: LoaderCursor | PlannedCursor
    index: int
    epoch: int
    sample_ids: np.ndarray
    epochs: np.ndarray
    stats: dict[str, int]
    produce_s: float | None = None
    """Seconds building this batch took where it was built, when telemetry timed it."""
    fetch: dict[str, dict[str, Any]] | None = None
    """What its build opened, per serving tier: {tier: {"seconds", "opens", "bytes"}}; None: nothing."""
    metrics: WorkerSnapshot | None = None
    datasets: np.ndarray | None = None
    """In a mixture, the dataset (its index in `MixedDataset`'s datasets) each sample came from."""

    @property
    def cursor(self) -> LoaderCursor:
        planned = self.planned
        return planned if isinstance(planned, LoaderCursor) else planned.resolve()

    @property
    def timing(self) -> dict[str, Any] | None:
        """{"produce_s", "fetch": {tier: {...}}} when telemetry timed the batch, else None. Made when asked:
        a timed batch carries two fields, not two dicts, so recording it allocates nothing the collector counts."""
        if self.produce_s is None:
            return None
        return {"produce_s": self.produce_s, "fetch": self.fetch if self.fetch is not None else {}}


METRICS_EVERY = 16
METRICS_EVERY_S = 0.1
"""A DataLoader worker ships its metrics with a batch at least every METRICS_EVERY batches or
METRICS_EVERY_S seconds (a snapshot costs ~0.1 ms: nothing beside an image batch, much beside a
small token batch)."""
_RESET_IN: set[int] = set()


def with_worker_metrics(
    plan: Iterator[Selection],
    build: Callable[[Selection], CarriedBatch],
    worker: int,
    registries: list[MetricsRegistry],
) -> Iterator[CarriedBatch]:
    """The worker's batches; its metrics (its readers' tier and cache counters live in this
    process), cumulative, ride in a batch's meta for the Loader to include in its telemetry:
    every METRICS_EVERY batches or METRICS_EVERY_S seconds, and on the worker's last batch of
    each epoch (the plan is looked at one selection ahead), so at an epoch's end the Loader
    holds exactly what built that epoch's batches."""
    unique = list({id(r): r for r in registries}.values())
    pid = os.getpid()
    if pid not in _RESET_IN:
        for registry in unique:
            registry.reset()  # a forked worker's copy of the parent's totals must not be counted twice
        _RESET_IN.add(pid)
    shipped, n = -math.inf, 0
    selections = iter(plan)
    selection = next(selections, None)
    while selection is not None:
        batch = build(selection)
        following = next(selections, None)
        now = time.monotonic()
        if (
            following is None
            or following.epoch != selection.epoch
            or n % METRICS_EVERY == 0
            or now - shipped >= METRICS_EVERY_S
        ):
            snapshots = [r.snapshot() for r in unique]
            batch.meta.metrics = WorkerSnapshot(
                worker, pid, snapshots[0] if len(snapshots) == 1 else merge_snapshots(snapshots)
            )
            shipped = now
        n += 1
        yield batch
        selection = following
