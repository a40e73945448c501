"""Specification of the telemetry metric primitives."""

import json
import math
import threading

import numpy as np
import pytest

from tierflow.telemetry.metrics import (
    LATENCY_BUCKETS,
    SIZE_BUCKETS,
    BucketLayout,
    Histogram,
    MetricsRegistry,
)
from tierflow.telemetry.snapshots import merge_snapshots

GROWTH = 2 ** (1 / LATENCY_BUCKETS.per_octave)


def test_counter_loses_no_increments_from_concurrent_threads():
    counter = MetricsRegistry().counter("tierflow_test_total")
    per_thread, threads = 20_000, 4

    def work():
        for _ in range(per_thread):
            counter.inc()

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert counter.value == per_thread * threads


def test_histogram_loses_no_observations_from_concurrent_threads():
    histogram = MetricsRegistry().histogram("tierflow_test_seconds")

    def work():
        for _ in range(10_000):
            histogram.observe(0.001)

    workers = [threading.Thread(target=work) for _ in range(3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert histogram.count == 30_000
    assert sum(c for _, c in histogram.snapshot()["buckets"]) == 30_000


def test_counter_refuses_to_decrease():
    counter = MetricsRegistry().counter("tierflow_test_total")
    with pytest.raises(ValueError, match="tierflow_test_total"):
        counter.inc(-1)


def test_every_value_falls_between_its_bucket_bounds():
    rng = np.random.default_rng(0)
    for value in np.exp(rng.uniform(math.log(1e-7), math.log(1e4), 2000)):
        index = LATENCY_BUCKETS.index(value)
        assert (
            LATENCY_BUCKETS.lower_bound(index) * (1 - 1e-12) <= value < LATENCY_BUCKETS.upper_bound(index) * (1 + 1e-12)
        )


@pytest.mark.parametrize(
    "distribution",
    [
        lambda rng: rng.uniform(0.001, 0.1, 20_000),
        lambda rng: rng.lognormal(math.log(0.005), 1.0, 20_000),
        lambda rng: rng.exponential(0.0002, 20_000),
        lambda rng: np.concatenate([rng.normal(0.010, 0.0005, 19_000), rng.normal(0.5, 0.01, 1_000)]),
    ],
    ids=["uniform", "lognormal", "exponential", "bimodal-tail"],
)
def test_percentile_estimates_are_within_one_bucket_of_the_true_percentile(distribution):
    values = distribution(np.random.default_rng(1))
    histogram = Histogram("tierflow_test_seconds")
    for value in values:
        histogram.observe(float(value))
    for q in (0.5, 0.9, 0.99):
        true = float(np.quantile(values, q, method="inverted_cdf"))
        estimate = histogram.quantile(q)
        assert true / GROWTH <= estimate <= true * GROWTH, (q, true, estimate)


def test_percentiles_of_a_constant_are_exact_and_of_nothing_are_zero():
    histogram = Histogram("tierflow_test_seconds")
    assert histogram.quantile(0.99) == 0.0
    for _ in range(100):
        histogram.observe(0.0123)
    assert histogram.summary()["p50"] == pytest.approx(0.0123)
    assert histogram.summary()["p99"] == pytest.approx(0.0123)
    assert histogram.mean == pytest.approx(0.0123)


def test_values_outside_the_layout_land_in_the_edge_buckets_and_estimate_as_observed_extremes():
    histogram = Histogram("tierflow_test_seconds")
    histogram.observe(0.0)
    histogram.observe(1e6)
    assert histogram.quantile(0.0) == 0.0
    assert histogram.quantile(1.0) == 1e6
    buckets = dict(histogram.snapshot()["buckets"])
    assert buckets == {0: 1, LATENCY_BUCKETS.size - 1: 1}


def test_const_labels_go_on_every_metric_and_labels_follow_prometheus_names():
    registry = MetricsRegistry({"job": "j1", "node": "n0", "rank": 3})
    registry.counter("tierflow_tier_hits_total", {"tier": "L2"}).inc(5)
    [entry] = registry.snapshot()["counters"]
    assert entry["labels"] == {"job": "j1", "node": "n0", "rank": "3", "tier": "L2"}
    with pytest.raises(ValueError, match="bad-label"):
        registry.counter("tierflow_x_total", {"bad-label": 1})
    with pytest.raises(ValueError, match="2bad"):
        registry.counter("2bad")


def test_one_name_is_one_kind_of_metric():
    registry = MetricsRegistry()
    registry.counter("tierflow_thing")
    with pytest.raises(ValueError, match="tierflow_thing"):
        registry.histogram("tierflow_thing")


def test_the_same_name_and_labels_return_the_same_metric():
    registry = MetricsRegistry()
    assert registry.counter("a_total", {"tier": "L1"}) is registry.counter("a_total", {"tier": "L1"})
    assert registry.counter("a_total", {"tier": "L1"}) is not registry.counter("a_total", {"tier": "L2"})


def test_snapshot_is_json_data_that_round_trips():
    registry = MetricsRegistry({"job": "j"})
    registry.counter("c_total").inc(2)
    registry.gauge("g_bytes", aggregate="max").set(7)
    registry.histogram("h_seconds").observe(0.25)
    snapshot = registry.snapshot()
    assert json.loads(json.dumps(snapshot)) == snapshot


def _process_registry(rank: int, values: list[float]) -> MetricsRegistry:
    registry = MetricsRegistry({"job": "j", "rank": rank})
    registry.counter("tierflow_tier_bytes_total", {"tier": "L2"}).inc(len(values) * 1000 + rank)
    histogram = registry.histogram("tierflow_fetch_seconds", {"tier": "L2"})
    for value in values:
        histogram.observe(value)
    registry.gauge("tierflow_tier_occupancy_bytes", {"tier": "L2"}, aggregate="max").set(100 * (rank + 1))
    registry.gauge("tierflow_inflight_bytes").set(10 * (rank + 1))
    return registry


def test_merged_snapshots_sum_counters_and_buckets_exactly():
    rng = np.random.default_rng(2)
    per_rank = [list(rng.lognormal(-5, 1, 500 + 100 * r)) for r in range(4)]
    snapshots = [_process_registry(rank, values).snapshot() for rank, values in enumerate(per_rank)]
    merged = merge_snapshots(snapshots, drop_labels=("rank",))

    [counter] = merged["counters"]
    assert counter["value"] == sum(len(v) * 1000 + r for r, v in enumerate(per_rank))
    assert counter["labels"] == {"job": "j", "tier": "L2"}

    everything = Histogram("tierflow_fetch_seconds")
    for values in per_rank:
        for value in values:
            everything.observe(value)
    [histogram] = merged["histograms"]
    assert histogram["buckets"] == everything.snapshot()["buckets"]
    assert histogram["count"] == everything.count
    assert histogram["sum"] == pytest.approx(everything.sum)
    assert histogram["min"] == everything.snapshot()["min"]
    assert Histogram.from_snapshot(histogram).quantile(0.99) == everything.quantile(0.99)

    gauges = {g["name"]: g["value"] for g in merged["gauges"]}
    assert gauges == {"tierflow_tier_occupancy_bytes": 400, "tierflow_inflight_bytes": 100}


def test_merging_keeps_series_apart_when_labels_differ():
    snapshots = [_process_registry(rank, [0.01]).snapshot() for rank in range(2)]
    merged = merge_snapshots(snapshots)
    assert sorted(c["labels"]["rank"] for c in merged["counters"]) == ["0", "1"]


def test_merging_refuses_histograms_with_different_layouts():
    a, b = MetricsRegistry(), MetricsRegistry()
    a.histogram("h_seconds").observe(1.0)
    b.histogram("h_seconds", layout=BucketLayout(1e-3, 1e3, 2)).observe(1.0)
    with pytest.raises(ValueError, match="h_seconds"):
        merge_snapshots([a.snapshot(), b.snapshot()])


def test_boundary_timer_reports_blocked_time_on_each_side():
    registry = MetricsRegistry()
    boundary = registry.boundary("decode", {"tier": "L1"})
    for _ in range(90):
        boundary.blocked_get(0.001)
    for _ in range(10):
        boundary.blocked_get(0.1)
    boundary.blocked_put(0.002)
    summary = boundary.summary()
    assert summary["get"]["count"] == 100
    assert summary["get"]["mean"] == pytest.approx((90 * 0.001 + 10 * 0.1) / 100)
    assert summary["get"]["p50"] == pytest.approx(0.001, rel=GROWTH - 1)
    assert summary["get"]["p99"] == pytest.approx(0.1, rel=GROWTH - 1)
    assert summary["put"]["total"] == pytest.approx(0.002)
    sides = {h["labels"]["side"] for h in registry.snapshot()["histograms"] if h["labels"]["stage"] == "decode"}
    assert sides == {"get", "put"}


def test_a_registry_counts_what_it_includes_live_or_shipped_and_forgets_it_on_reset():
    """A live registry is read at each snapshot; a shipped (cumulative) snapshot replaces the one under
    its key; including itself changes nothing; a cycle is refused; reset (a forked child) forgets both."""
    main, readers = MetricsRegistry(), MetricsRegistry()
    main.counter("tierflow_tier_hits_total", {"tier": "L2"}).inc(1)
    main.include("readers", readers)
    main.include("self", main)
    hits = readers.counter("tierflow_tier_hits_total", {"tier": "L2"})
    hits.inc(2)
    worker = MetricsRegistry()
    shipped = worker.counter("tierflow_tier_hits_total", {"tier": "L2"})
    for _ in range(2):  # the same worker ships twice: its later, cumulative snapshot replaces the first
        shipped.inc(10)
        main.include(("worker", 7), worker.snapshot())
    hits.inc(100)

    def total(registry: MetricsRegistry) -> float:
        return sum(c["value"] for c in registry.snapshot()["counters"] if c["name"] == "tierflow_tier_hits_total")

    assert total(main) == 1 + 102 + 20
    with pytest.raises(ValueError, match="already includes this one"):
        readers.include("main", main)
    main.reset()
    assert total(main) == 0 and total(readers) == 102


@pytest.mark.parametrize("layout", [LATENCY_BUCKETS, SIZE_BUCKETS], ids=["latency", "size"])
def test_a_bulk_observation_counts_each_value_in_the_bucket_the_layout_places_it(layout):
    rng = np.random.default_rng(2)
    edges = [layout.upper_bound(i) for i in range(layout.size - 1)]
    values = [
        0.0,
        -1.0,
        -math.inf,
        math.inf,
        1e300,
        layout.lowest,
        layout.highest,
        *edges,
        *(e * (1 - 1e-9) for e in edges),
        *np.exp(rng.uniform(math.log(layout.lowest) - 2, math.log(layout.highest) + 2, 3000)),
    ]
    expected: dict[int, int] = {}
    for value in values:
        index = 0 if value < layout.lowest else layout.size - 1 if math.isinf(value) else layout.index(value)
        expected[index] = expected.get(index, 0) + 1
    bulk, one_by_one = Histogram("tierflow_test_bulk", layout=layout), Histogram("tierflow_test_single", layout=layout)
    bulk.observe_many(values)
    for value in values:
        one_by_one.observe(value)
    assert dict(bulk.snapshot()["buckets"]) == dict(one_by_one.snapshot()["buckets"]) == expected
    assert bulk.count == one_by_one.count == len(values)


def test_a_nan_observation_is_refused_naming_the_histogram():
    histogram = Histogram("tierflow_test_seconds")
    with pytest.raises(ValueError, match="tierflow_test_seconds.*NaN"):
        histogram.observe_many([0.1, math.nan])
    histogram.observe_many([0.1])
    assert histogram.count == 1
