"""In-process metric primitives cheap enough for the per-batch hot path.

Counters, gauges, log-bucketed histograms and stage-boundary timers live in a
`MetricsRegistry`; `snapshot()` turns them into plain JSON-able data and
`snapshots.merge_snapshots` adds snapshots from several processes together. Names and
labels follow Prometheus rules so an exporter can map each metric 1:1
(`tier`, `job`, `node`, `rank` are the labels the rest of tierflow uses); tierflow's
own names are `tierflow_<stage>_<what>[_total|_seconds|_bytes]` (docs/observe.md).

Thread safety: every update takes the metric's own lock, so concurrent
updates from several threads never lose a count (this does not rely on the
GIL, and so also holds on free-threaded Python). Reads are not atomic across
metrics: a snapshot taken while threads update may show one metric a few
updates ahead of another.
"""

from __future__ import annotations

import collections
import itertools
import math
import re
import threading
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar
from collections.abc import Hashable, Iterable, Iterator, Mapping

import numpy as np

from tierflow.telemetry.snapshots import SNAPSHOT_SCHEMA, LabelKey, merge_snapshots

_log2 = math.log2

_METRIC_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")

GaugeAggregate = Literal["sum", "max", "min"]


def _label_key(name: str, labels: Mapping[str, Any] | None) -> LabelKey:
    if not _METRIC_NAME.match(name):
        raise ValueError(f"metric name {name!r} is not a valid Prometheus metric name")
    if not labels:
        return ()
    for label in labels:
        if not _LABEL_NAME.match(label) or label.startswith("__"):
            raise ValueError(f"label {label!r} of metric {name!r} is not a valid Prometheus label name")
    return tuple(sorted((label, str(value)) for label, value in labels.items()))


@dataclass(frozen=True)
class BucketLayout:
    """Fixed log-spaced buckets shared by every process, so histograms merge by adding counts.

    Bucket 0 holds values below `lowest` (including zero), bucket i in
    1..n holds [lowest * g**(i-1), lowest * g**i) with g = 2**(1/per_octave),
    and the last bucket holds everything from `highest` up. A percentile
    estimate is off by at most one bucket's width, a factor g (about 19% for
    the default 4 buckets per octave).
    """

    lowest: float
    highest: float
    per_octave: int

    def __post_init__(self) -> None:
        if not (0 < self.lowest < self.highest) or self.per_octave < 1:
            raise ValueError(f"bucket layout {self} needs 0 < lowest < highest and per_octave >= 1")

    @property
    def finite_buckets(self) -> int:
        return math.ceil(math.log2(self.highest / self.lowest) * self.per_octave)

    @property
    def size(self) -> int:
        return self.finite_buckets + 2

    def lower_bound(self, index: int) -> float:
        if index <= 0:
            return 0.0
        return self.lowest * 2.0 ** ((index - 1) / self.per_octave)

    def upper_bound(self, index: int) -> float:
        """The Prometheus `le` edge of bucket `index` (inf for the overflow bucket)."""
        if index >= self.size - 1:
            return math.inf
        return self.lowest * 2.0 ** (index / self.per_octave)

    def index(self, value: float) -> int:
        if value < self.lowest:
            return 0
        index = int(_log2(value * (1.0 / self.lowest)) * self.per_octave) + 1
        return min(index, self.size - 1)

    def as_dict(self) -> dict[str, float | int]:
        return {"lowest": self.lowest, "highest": self.highest, "per_octave": self.per_octave}


LATENCY_BUCKETS = BucketLayout(lowest=1e-7, highest=1e4, per_octave=4)
"""Seconds, 100 ns to about 3 hours."""

SIZE_BUCKETS = BucketLayout(lowest=1.0, highest=float(2**44), per_octave=2)
"""Bytes or counts, 1 to 16 Ti."""


class Counter:
    """A monotonically increasing total (Prometheus counter; name it `..._total`)."""

    kind = "counter"
    __slots__ = ("name", "labels", "description", "_value", "_lock")

    def __init__(self, name: str, labels: LabelKey = (), description: str = "") -> None:
        self.name = name
        self.labels = labels
        self.description = description
        self._value: int | float = 0
        self._lock = threading.Lock()

    def inc(self, amount: int | float = 1) -> None:
        if amount < 0:
            raise ValueError(f"counter {self.name} cannot decrease (got {amount})")
        with self._lock:
            self._value += amount

    @property
    def value(self) -> int | float:
        return self._value

    def snapshot(self) -> dict[str, Any]:
        return {"name": self.name, "labels": dict(self.labels), "value": self._value}

    def _reset(self) -> None:
        self._value = 0
        self._lock = threading.Lock()


class Gauge:
    """A value that goes up and down; `aggregate` says how processes' values combine."""

    kind = "gauge"
    __slots__ = ("name", "labels", "description", "aggregate", "_value", "_lock")

    def __init__(
        self, name: str, labels: LabelKey = (), description: str = "", aggregate: GaugeAggregate = "sum"
    ) -> None:
        if aggregate not in ("sum", "max", "min"):
            raise ValueError(f"gauge {name}: aggregate must be sum, max or min, not {aggregate!r}")
        self.name = name
        self.labels = labels
        self.description = description
        self.aggregate = aggregate
        self._value: int | float = 0
        self._lock = threading.Lock()

    def set(self, value: int | float) -> None:
        self._value = value

    def inc(self, amount: int | float = 1) -> None:
        with self._lock:
            self._value += amount

    def dec(self, amount: int | float = 1) -> None:
        with self._lock:
            self._value -= amount

    @property
    def value(self) -> int | float:
        return self._value

    def _reset(self) -> None:
        self._value = 0
        self._lock = threading.Lock()

    def snapshot(self) -> dict[str, Any]:
        return {"name": self.name, "labels": dict(self.labels), "value": self._value, "aggregate": self.aggregate}


FOLD_EVERY = 256
"""Queued observations a histogram folds into its buckets at once."""
FOLD_ARRAYS = 8
"""Queued bulks (`Histogram.observe_many`) a histogram folds into its buckets at once."""


class Histogram:
    """Counts observations in fixed log-spaced buckets; estimates percentiles from them.

    `observe` only appends to a queue (a per-batch hot path pays ~0.1 us, not a lock and a log);
    the queue is folded into the buckets when it grows or when anything reads the histogram.
    """

    kind = "histogram"
    __slots__ = (
        "name",
        "labels",
        "description",
        "layout",
        "_pending",
        "_bulks",
        "_counts",
        "_count",
        "_sum",
        "_min",
        "_max",
        "_lock",
        "_lowest",
        "_inv_lowest",
        "_per_octave",
        "_top",
        "_cap",
    )

    def __init__(
        self, name: str, labels: LabelKey = (), description: str = "", layout: BucketLayout = LATENCY_BUCKETS
    ) -> None:
        self.name = name
        self.labels = labels
        self.description = description
        self.layout = layout
        self._lowest = layout.lowest
        self._inv_lowest = 1.0 / layout.lowest
        self._per_octave = layout.per_octave
        self._top = layout.size - 1
        self._cap = layout.lowest * 2.0 ** (self._top / layout.per_octave + 1)  # well inside the top bucket
        self._reset()

    def _reset(self) -> None:
        self._pending: collections.deque[float] = collections.deque()
        self._bulks: collections.deque[np.ndarray] = collections.deque()
        self._counts = np.zeros(self.layout.size, dtype=np.int64)
        self._count = 0
        self._sum = 0.0
        self._min = math.inf
        self._max = -math.inf
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        pending = self._pending
        pending.append(value)
        if len(pending) >= FOLD_EVERY:
            self._fold()

    def observe_many(self, values: Iterable[float]) -> None:
        """`observe` each of `values`: a bulk recorder's path, queued as one array and counted into the
        buckets with the next `FOLD_ARRAYS` - 1 bulks (one numpy pass for them all) or when anything reads."""
        array = np.asarray(values, dtype=np.float64).ravel()
        if array.size:
            if np.logical_or.reduce(np.isnan(array)):
                raise ValueError(f"histogram {self.name}: a NaN was observed")
            self.observe_vector(array)

    def observe_vector(self, array: np.ndarray) -> None:
        """`observe_many` for a recorder that made `array` itself: a non-empty float64 vector without NaN,
        queued as it is (no conversion, no check)."""
        bulks = self._bulks
        bulks.append(array)
        if len(bulks) >= FOLD_ARRAYS:
            self._fold()

    def _fold(self) -> None:
        """Move queued observations into the buckets (appends racing with this stay queued)."""
        pending, bulks = self._pending, self._bulks
        if not pending and not bulks:
            return
        with self._lock:
            n, arrays = len(pending), len(bulks)
            if not n and not arrays:
                return
            parts = [bulks.popleft() for _ in range(arrays)]
            if n:
                parts.append(np.fromiter(itertools.starmap(pending.popleft, itertools.repeat((), n)), np.float64, n))
            self._count_in(parts[0] if len(parts) == 1 else np.concatenate(parts))

    def _count_in(self, array: np.ndarray) -> None:
        """Count `array`'s values into the buckets, each where `BucketLayout.index` places it; the lock is held."""
        with np.errstate(invalid="ignore"):
            total = float(np.add.reduce(array))
        if total != total and np.isnan(array).any():  # a NaN sum is also inf + -inf, both observed
            raise ValueError(f"histogram {self.name}: a NaN was observed")  # observe's: observe_many refuses one
        # clamped: no product overflows, and a value past the top bucket's edge still lands in it
        clamped = np.minimum(np.maximum(array, self._lowest), self._cap)
        scaled = np.log2(clamped * self._inv_lowest)
        scaled *= self._per_octave
        index = scaled.astype(np.int64)
        index += 1
        np.minimum(index, self._top, out=index)
        index[array < self._lowest] = 0
        self._counts += np.bincount(index, minlength=self._top + 1)
        self._count += int(array.size)
        self._sum += total
        self._min = min(self._min, float(np.minimum.reduce(array)))
        self._max = max(self._max, float(np.maximum.reduce(array)))

    @property
    def count(self) -> int:
        self._fold()
        return self._count

    @property
    def sum(self) -> float:
        self._fold()
        return self._sum

    @property
    def mean(self) -> float:
        self._fold()
        return self._sum / self._count if self._count else 0.0

    def quantile(self, q: float) -> float:
        """Estimate of the q-quantile (0 <= q <= 1); 0.0 when nothing was observed."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"histogram {self.name}: quantile {q} is outside [0, 1]")
        self._fold()
        with self._lock:
            counts = self._counts.tolist()
            count, low, high = self._count, self._min, self._max
        return _quantile(self.layout, counts, count, low, high, q)

    def summary(self) -> dict[str, float]:
        """Mean, p50, p90, p99, count and total: what a stage report prints."""
        return {
            "count": self.count,
            "total": self._sum,
            "mean": self.mean,
            "p50": self.quantile(0.5),
            "p90": self.quantile(0.9),
            "p99": self.quantile(0.99),
        }

    def snapshot(self) -> dict[str, Any]:
        self._fold()
        with self._lock:
            buckets = [[i, c] for i, c in enumerate(self._counts.tolist()) if c]
            count, total, low, high = self._count, self._sum, self._min, self._max
        return {
            "name": self.name,
            "labels": dict(self.labels),
            "layout": self.layout.as_dict(),
            "count": count,
            "sum": total,
            "min": low if count else None,
            "max": high if count else None,
            "buckets": buckets,
        }

    @classmethod
    def from_snapshot(cls, entry: Mapping[str, Any]) -> Histogram:
        """Rebuild a histogram (for percentiles of merged snapshots)."""
        histogram = cls(
            entry["name"], _label_key(entry["name"], entry["labels"]), layout=BucketLayout(**entry["layout"])
        )
        for index, count in entry["buckets"]:
            histogram._counts[index] = count
        histogram._count = entry["count"]
        histogram._sum = entry["sum"]
        histogram._min = entry["min"] if entry["min"] is not None else math.inf
        histogram._max = entry["max"] if entry["max"] is not None else -math.inf
        return histogram


def _quantile(layout: BucketLayout, counts: list[int], count: int, low: float, high: float, q: float) -> float:
    if count == 0:
        return 0.0
    rank = max(1, math.ceil(q * count))
    index = next((i for i, below in enumerate(itertools.accumulate(counts)) if below >= rank), len(counts) - 1)
    lower, upper = layout.lower_bound(index), layout.upper_bound(index)
    if index == 0 or math.isinf(upper):
        estimate = low if index == 0 else high
    else:
        estimate = math.sqrt(lower * upper)
    return min(max(estimate, low), high)


class BoundaryTimer:
    """Time one stage boundary spent blocked: on get (upstream empty) and on put (downstream full).

    A stage that mostly waits on get is starved by its upstream; one that
    mostly waits on put is faster than its downstream. Reading both sides of
    every boundary names the bottleneck. Pass seconds measured with
    `time.perf_counter()`; the timer itself never reads the clock.
    """

    __slots__ = ("stage", "get", "put")

    def __init__(self, get: Histogram, put: Histogram, stage: str) -> None:
        self.stage = stage
        self.get = get
        self.put = put

    def blocked_get(self, seconds: float) -> None:
        self.get.observe(seconds)

    def blocked_put(self, seconds: float) -> None:
        self.put.observe(seconds)

    def summary(self) -> dict[str, dict[str, float]]:
        return {"get": self.get.summary(), "put": self.put.summary()}


Metric = Counter | Gauge | Histogram
MetricT = TypeVar("MetricT", Counter, Gauge, Histogram)

BOUNDARY_METRIC = "tierflow_stage_blocked_seconds"


class Buffered(Protocol):
    """What `MetricsRegistry.add_buffer` takes."""

    def flush(self) -> None:
        """Apply every update held back."""

    def clear(self) -> None:
        """Drop the updates held back (a forked child's copies of its parent's)."""


class MetricsRegistry:
    """Get-or-create metrics by (name, labels); `const_labels` (job, node, rank) go on every metric."""

    def __init__(self, const_labels: Mapping[str, Any] | None = None) -> None:
        self.const_labels = dict(_label_key("const_labels", const_labels))
        self._metrics: dict[tuple[str, LabelKey], Metric] = {}
        self._kinds: dict[str, str] = {}
        self._lock = threading.Lock()
        self._buffers: list[Buffered] = []
        self._included: dict[Hashable, MetricsRegistry | Mapping[str, Any]] = {}

    def include(self, key: Hashable, source: MetricsRegistry | Mapping[str, Any]) -> None:
        """Count another process's or stage's metrics in this registry's snapshots: a live registry
        (snapshotted with this one), or a cumulative snapshot (a DataLoader worker's, shipped with
        its batches), which replaces the one included under the same `key` (say, the worker's pid).
        Including the registry itself changes nothing; a registry that includes this one is refused
        (its snapshot would recurse)."""
        if source is self:
            return
        if isinstance(source, MetricsRegistry) and source._includes(self):
            raise ValueError(f"metrics registry {key!r} already includes this one: including it would count forever")
        with self._lock:
            self._included[key] = source

    def _includes(self, other: MetricsRegistry) -> bool:
        with self._lock:
            live = [s for s in self._included.values() if isinstance(s, MetricsRegistry)]
        return any(s is other or s._includes(other) for s in live)

    def add_buffer(self, buffer: Buffered) -> None:
        """A recorder that batches its updates (a per-batch hot path): flushed before every snapshot,
        cleared by `reset`."""
        self._buffers.append(buffer)

    def counter(self, name: str, labels: Mapping[str, Any] | None = None, description: str = "") -> Counter:
        return self._get_or_create(Counter, name, labels, description=description)

    def gauge(
        self,
        name: str,
        labels: Mapping[str, Any] | None = None,
        description: str = "",
        aggregate: GaugeAggregate = "sum",
    ) -> Gauge:
        return self._get_or_create(Gauge, name, labels, description=description, aggregate=aggregate)

    def histogram(
        self,
        name: str,
        labels: Mapping[str, Any] | None = None,
        description: str = "",
        layout: BucketLayout = LATENCY_BUCKETS,
    ) -> Histogram:
        histogram = self._get_or_create(Histogram, name, labels, description=description, layout=layout)
        if histogram.layout != layout:
            raise ValueError(f"histogram {name} already exists with bucket layout {histogram.layout}")
        return histogram

    def boundary(self, stage: str, labels: Mapping[str, Any] | None = None) -> BoundaryTimer:
        """The blocked-on-get/put timer of `stage` (fetch, decode, batch, device_copy, train_loop...)."""
        base = dict(labels or {})
        get = self.histogram(
            BOUNDARY_METRIC,
            {**base, "stage": stage, "side": "get"},
            "time a stage waited on its upstream (get) or downstream (put)",
        )
        put = self.histogram(BOUNDARY_METRIC, {**base, "stage": stage, "side": "put"})
        return BoundaryTimer(get, put, stage)

    def _get_or_create(
        self, cls: type[MetricT], name: str, labels: Mapping[str, Any] | None, **options: Any
    ) -> MetricT:
        merged = {**self.const_labels, **(labels or {})}
        key = (name, _label_key(name, merged))
        metric = self._metrics.get(key)
        if isinstance(metric, cls):
            return metric
        with self._lock:
            kind = self._kinds.setdefault(name, cls.kind)
            if kind != cls.kind:
                raise ValueError(f"metric {name} is already registered as a {kind}, not a {cls.kind}")
            existing = self._metrics.get(key)
            if isinstance(existing, cls):  # another thread made it first
                return existing
            created = cls(name, key[1], **options)
            self._metrics[key] = created
            return created

    def __reduce__(self) -> tuple[Any, ...]:
        """Unpickled empty, with the same constant labels: counts belong to the process that made
        them (a spawned worker starts at zero, as `reset` makes a forked one)."""
        return (MetricsRegistry, (self.const_labels,))

    def reset(self) -> None:
        """Zero every metric, forget what was included and renew every lock: for a forked child, whose
        copies of the parent's totals would otherwise be counted twice when snapshots merge."""
        self._lock = threading.Lock()
        self._included = {}
        for buffer in self._buffers:
            buffer.clear()
        for metric in self._metrics.values():
            metric._reset()

    def metrics(self) -> Iterator[Metric]:
        with self._lock:
            metrics = list(self._metrics.values())
        return iter(metrics)

    def snapshot(self) -> dict[str, Any]:
        """Plain JSON-able data: {"schema", "counters", "gauges", "histograms"}, entries sorted by name;
        with what was included (`include`) merged in."""
        own = self._own_snapshot()
        with self._lock:
            included = list(self._included.values())
        if not included:
            return own
        return merge_snapshots([own, *(s.snapshot() if isinstance(s, MetricsRegistry) else s for s in included)])

    def _own_snapshot(self) -> dict[str, Any]:
        for buffer in self._buffers:
            buffer.flush()
        snapshot: dict[str, Any] = {"schema": SNAPSHOT_SCHEMA, "counters": [], "gauges": [], "histograms": []}
        descriptions: dict[str, str] = {}
        for metric in sorted(self.metrics(), key=lambda m: (m.name, m.labels)):
            snapshot[metric.kind + "s"].append(metric.snapshot())
            if metric.description:
                descriptions.setdefault(metric.name, metric.description)
        snapshot["descriptions"] = descriptions
        return snapshot
