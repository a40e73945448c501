"""Prometheus export: serve a `MetricsRegistry` (or several, e.g. the stager's and the loader's) on an
opt-in port, one exporter per node, every series labelled job, node, rank and tier as recorded.

Metrics are read at scrape time from the registries' snapshots, so recording costs nothing extra.
Counters are named `..._total` (docs/observe.md's rule; the family drops the suffix, which
prometheus-client adds back, and one that lacks it gains it); histograms keep their log buckets as
`le` edges (with +Inf).
"""

from __future__ import annotations

import math
from typing import Any
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from tierflow.telemetry.metrics import BucketLayout, MetricsRegistry
from tierflow.telemetry.snapshots import merge_snapshots

Snapshotter = Callable[[], Mapping[str, Any]]


class SnapshotCollector:
    """A prometheus-client collector over snapshot functions (registry.snapshot, or a file reader)."""

    def __init__(self, sources: Sequence[Snapshotter], const_labels: Mapping[str, Any] | None = None) -> None:
        self.sources = list(sources)
        self.const_labels = {k: str(v) for k, v in (const_labels or {}).items()}

    def collect(self) -> Iterator[Metric]:
        snapshot = merge_snapshots(source() for source in self.sources)
        yield from families(snapshot, self.const_labels)


def families(snapshot: Mapping[str, Any], const_labels: Mapping[str, str] | None = None) -> Iterator[Metric]:
    """Prometheus metric families of a snapshot (what a scrape shows)."""
    const = dict(const_labels or {})
    descriptions = snapshot.get("descriptions", {})

    def grouped(entries: Iterable[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
        out: dict[str, list[Mapping[str, Any]]] = {}
        for entry in entries:
            out.setdefault(entry["name"], []).append(entry)
        return out

    def label_set(entries: list[Mapping[str, Any]]) -> list[str]:
        names = set(const)
        for entry in entries:
            names.update(entry["labels"])
        return sorted(names)

    def values(entry: Mapping[str, Any], names: list[str]) -> list[str]:
        merged = {**const, **entry["labels"]}
        return [str(merged.get(n, "")) for n in names]

    for name, entries in grouped(snapshot["counters"]).items():
        names = label_set(entries)
        counter = CounterMetricFamily(name.removesuffix("_total"), descriptions.get(name, name), labels=names)
        for entry in entries:
            counter.add_metric(values(entry, names), entry["value"])
        yield counter
    for name, entries in grouped(snapshot["gauges"]).items():
        names = label_set(entries)
        gauge = GaugeMetricFamily(name, descriptions.get(name, name), labels=names)
        for entry in entries:
            gauge.add_metric(values(entry, names), entry["value"])
        yield gauge
    for name, entries in grouped(snapshot["histograms"]).items():
        names = label_set(entries)
        histogram = HistogramMetricFamily(name, descriptions.get(name, name), labels=names)
        for entry in entries:
            histogram.add_metric(values(entry, names), cumulative_buckets(entry), entry["sum"])
        yield histogram


def cumulative_buckets(entry: Mapping[str, Any]) -> list[tuple[str, float]]:
    """(le, cumulative count) for the non-empty buckets of a histogram snapshot, ending with +Inf."""
    layout = BucketLayout(**entry["layout"])
    out: list[tuple[str, float]] = []
    running = 0
    for index, count in sorted(entry["buckets"]):
        running += count
        edge = layout.upper_bound(index)
        if not math.isinf(edge):
            out.append((repr(edge), running))
    out.append(("+Inf", entry["count"]))
    return out


class PrometheusExporter:
    """`PrometheusExporter([registry], port=9464).start()`; port 0 picks a free one (see `.port`)."""

    def __init__(
        self,
        registries: Sequence[MetricsRegistry | Snapshotter],
        port: int = 9464,
        addr: str = "127.0.0.1",
        const_labels: Mapping[str, Any] | None = None,
    ) -> None:
        sources = [r.snapshot if isinstance(r, MetricsRegistry) else r for r in registries]
        self.registry = CollectorRegistry()
        self.registry.register(SnapshotCollector(sources, const_labels))
        self.requested_port = port
        self.addr = addr
        self.port: int | None = None
        self._server: Any = None
        self._thread: Any = None

    def start(self) -> PrometheusExporter:
        server, thread = start_http_server(self.requested_port, addr=self.addr, registry=self.registry)
        self._server, self._thread = server, thread
        self.port = server.server_address[1]
        return self

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError(f"Prometheus exporter on {self.addr}:{self.requested_port} is not started")
        return f"http://{self.addr}:{self.port}/metrics"

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join()
            self._server = None

    def __enter__(self) -> PrometheusExporter:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
