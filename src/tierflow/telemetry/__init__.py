"""tierflow.telemetry: measure where time goes in the data path.

`metrics` holds the in-process primitives (counters, gauges, histograms,
stage-boundary timers) that every stage records into.
"""

from tierflow.telemetry.metrics import (
    LATENCY_BUCKETS,
    SIZE_BUCKETS,
    BoundaryTimer,
    BucketLayout,
    Counter,
    Gauge,
    Histogram,
    MetricsRegistry,
)
from tierflow.telemetry.snapshots import merge_snapshots

__all__ = [
    "LATENCY_BUCKETS",
    "SIZE_BUCKETS",
    "BoundaryTimer",
    "BucketLayout",
    "Counter",
    "Gauge",
    "Histogram",
    "MetricsRegistry",
    "merge_snapshots",
]
