"""Observe: exact tier and loader counters, stall attribution, and the bottleneck verdict on runs
built to be bound by one thing each (a slow step, a slow transform, a throttled source)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

import tierflow
from tierflow.loader import Loader, TieredDataset, BatchSpec, OrderSpec
from tierflow.policies.auto import Lifecycle
from tierflow.tiers.stager import Stager
from tierflow.telemetry import MetricsRegistry
from tierflow.telemetry.attribution import AttributedShards, thread_ledger
from tierflow.commands.bench import format_result, run_bench, simulated_step, startup_batches
from tierflow.telemetry.health import health_flags
from tierflow.telemetry.loader_metrics import LoaderTelemetry, loader_figures, split_wait
from tierflow.telemetry.tier_figures import tier_figures
from tierflow.telemetry.verdict import judge, stall_shares
from tierflow.testing.fileserver import serve_directory
from tierflow.tiers import TierConfig, build_stack


def pack_equal_docs(root: Path, count: int, repeats: int) -> Path:
    """`count` documents of `repeats` x 8 bytes (after a number), in shards of the 256 KB minimum."""
    with open(root / "docs.jsonl", "w") as f:
        for i in range(count):
            f.write(json.dumps({"text": f"{i:06d} " + "abcdefgh" * repeats}) + "\n")
    out = root / "ds"
    tierflow.pack(
        [root / "docs.jsonl"], out, tokenizer="bytes", workers=1, target_shard_bytes=256 << 10, compression="none"
    )
    return out


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    """About 20 near-equal shards (the 256 KB minimum) of equal-length documents."""
    return pack_equal_docs(tmp_path_factory.mktemp("observe"), 12000, 24)


@pytest.fixture(scope="module")
def packed_large_docs(tmp_path_factory) -> Path:
    """About 40 shards of 8 documents of 32 KB: a batch of 8 reads about a shard whatever the order's
    breadth, so a throttled source bounds the loop from its first batches."""
    return pack_equal_docs(tmp_path_factory.mktemp("observe_large"), 320, 4096)


def test_wait_split_adds_up_to_the_wait_and_charges_fetch_to_the_slowest_tier():
    timing = {
        "produce_s": 0.010,
        "fetch": {
            "L2": {"seconds": 0.002, "opens": 1, "bytes": 1},
            "source": {"seconds": 0.006, "opens": 1, "bytes": 1},
        },
    }
    parts = split_wait(0.015, timing)
    assert parts == pytest.approx({("copy", ""): 0.005, ("fetch", "source"): 0.008, ("prep", ""): 0.002})
    assert sum(split_wait(0.004, timing).values()) == pytest.approx(0.004)
    assert split_wait(0.003, None) == {("prep", ""): 0.003}
    assert split_wait(0.0, timing) == {}


def test_loader_counters_are_exact_on_a_scripted_sequence():
    telemetry = LoaderTelemetry(MetricsRegistry({"job": "j"}), stall_threshold_s=0.001)
    fetch = {"L2": {"seconds": 0.004, "opens": 2, "bytes": 300}}
    script = [(0.0005, 0.010), (0.008, 0.010), (0.002, 0.010), (0.0, 0.010)]
    for wait, step in script:
        telemetry.on_batch(wait, {"produce_s": 0.008, "fetch": fetch}, depth=1)
        telemetry.on_step(step)
    f = telemetry.figures()
    assert f.batches == 4 and f.stalls == 2
    assert f.wait_s == pytest.approx(0.0105)
    assert f.step_s == pytest.approx(0.040)
    assert f.bubble_rate == pytest.approx(0.0105 / 0.0505)
    assert f.fetch_bytes == {"L2": 1200}
    assert f.fetch_s["L2"] == pytest.approx(0.016)
    assert f.stall_s["fetch:L2"] == pytest.approx(0.0105 * 0.5)
    assert f.stall_s["prep"] == pytest.approx(0.0105 * 0.5)
    assert f.prefetch_depth_mean == 1.0


def test_tier_counters_are_exact_on_a_scripted_access_sequence(packed, tmp_path):
    manifest = tierflow.open_dataset(packed).manifest
    shards = manifest.shards[:3]
    sizes = [s.bytes for s in shards]
    capacity = 2 * max(sizes) + 1
    assert capacity < 3 * min(sizes), "the scripted sequence needs room for exactly two shards"
    registry = MetricsRegistry()
    stack = build_stack(
        str(packed), [TierConfig("L2", str(tmp_path / "l2"), capacity, policy="lru", form="at_rest")], registry=registry
    )
    # LRU with room for two: miss, miss, hit, prefetch 2 (evicts 1, which was read), miss 1 (evicts 0),
    # miss 0 (evicts 2: staged ahead and never read, an eviction before use)
    for i, prefetch in ((0, False), (1, False), (0, False), (2, True), (1, False), (0, False)):
        stack.ensure(shards[i], prefetch=prefetch).release()
    l2 = tier_figures(registry.snapshot())["L2"]
    assert (l2.hits, l2.misses, l2.promotions, l2.evictions, l2.evictions_before_use) == (1, 4, 5, 3, 1)
    assert registry.counter("tierflow_tier_prefetches_total", {"tier": "L2"}).value == 1
    assert l2.bytes_in == sizes[0] + sizes[1] + sizes[2] + sizes[1] + sizes[0]
    assert l2.bytes_out == sizes[0]
    assert l2.demand_hit_ratio == pytest.approx(0.2)
    assert l2.occupancy_bytes == sizes[1] + sizes[0]


def test_attributed_source_names_the_deepest_tier_that_served_each_open(packed, tmp_path):
    manifest = tierflow.open_dataset(packed).manifest
    stack = build_stack(
        str(packed),
        [
            TierConfig("L1", str(tmp_path / "l1"), 1 << 30, form="decoded"),
            TierConfig("L2", str(tmp_path / "l2"), 1 << 30, form="at_rest"),
        ],
    )
    info = manifest.shards[0]
    ledger = thread_ledger()
    mark = ledger.mark()

    def open_through_a_fresh_source() -> None:
        source = AttributedShards(stack)
        source.open_shard(0, info)
        source.open_shard(0, info)  # the same table again: not a fetch
        stack.close()

    open_through_a_fresh_source()  # cold: L1 and L2 miss, the source directory serves
    assert stack.tiers[0].evict() == 1
    open_through_a_fresh_source()  # L1 emptied: L2 serves
    open_through_a_fresh_source()  # L1 serves
    opened = ledger.since(mark)
    assert {tier: f["opens"] for tier, f in opened.items()} == {"source": 1, "L2": 1, "L1": 1}
    assert opened["source"]["bytes"] == info.decoded_bytes


def test_a_table_the_stack_let_go_of_is_a_new_open_though_the_reader_still_holds_the_old_one(packed, tmp_path):
    info = tierflow.open_dataset(packed).manifest.shards[0]
    stack = build_stack(str(packed), [TierConfig("L1", str(tmp_path / "l1"), 1 << 30, form="decoded")])
    source = AttributedShards(stack)
    ledger = thread_ledger()
    mark = ledger.mark()
    held = source.open_shard(0, info)  # cold: the source directory serves
    assert source.open_shard(0, info) is held  # still open: no open recorded
    stack.close()  # the stack lets go of its open tables
    again = source.open_shard(0, info)  # L1 serves a new table
    assert again is not held and source.open_shard(0, info) is again
    assert {tier: f["opens"] for tier, f in ledger.since(mark).items()} == {"source": 1, "L1": 1}


def test_a_table_another_reader_opened_is_one_mapped_open_and_a_known_one_stays_known_while_others_open(
    packed, tmp_path
):
    shards = tierflow.open_dataset(packed).manifest.shards
    stack = build_stack(str(packed), [TierConfig("L1", str(tmp_path / "l1"), 1 << 30, form="decoded")])
    source = AttributedShards(stack)
    ledger = thread_ledger()
    mark = ledger.mark()
    held = source.open_shard(0, shards[0])  # cold: the source directory serves
    assert source.open_shard(0, shards[0]) is held  # known, still open: no open recorded
    other = stack.open_shard(1, shards[1])  # a reader without attribution opens one: the open ones change
    assert source.open_shard(0, shards[0]) is held  # still known: no open recorded
    assert source.open_shard(1, shards[1]) is other  # open already, new to this reader: mapped, once
    assert source.open_shard(1, shards[1]) is other
    assert {tier: f["opens"] for tier, f in ledger.since(mark).items()} == {"source": 1, "mapped": 1}


def test_a_batch_is_charged_the_opens_of_its_own_build_only(packed):
    from tierflow.telemetry.attribution import TimedBatches

    ledger = thread_ledger()
    batches = iter(TimedBatches(samples_dataset(packed, batch_size=64)))
    first = next(batches).meta.timing
    assert first["produce_s"] > 0 and first["fetch"]["source"]["opens"] >= 1
    ledger.add("L9", 1.0, 1)  # opened between batches: no batch built it
    later = [next(batches).meta.timing for _ in range(5)]
    assert all("L9" not in t["fetch"] for t in later)
    assert "L9" in ledger.opens and ledger.take_batch() == {}  # in the thread's totals, held for no batch


def test_the_stack_says_which_tier_served_each_copy_and_how_long_it_took(packed, tmp_path):
    shards = tierflow.open_dataset(packed).manifest.shards
    stack = build_stack(
        str(packed),
        [
            TierConfig("L1", str(tmp_path / "l1"), 1 << 30, form="decoded"),
            TierConfig("L2", str(tmp_path / "l2"), 1 << 30, form="at_rest"),
        ],
    )
    stack.manifest()

    def served(info) -> tuple[str, str]:
        handle = stack.ensure(info)
        handle.release()
        assert handle.fetch_s > 0
        return handle.tier, handle.served_by

    assert served(shards[0]) == ("L1", "source")  # cold: no tier held it
    assert stack.tiers[0].evict() == 1
    assert served(shards[0]) == ("L1", "L2")  # L1 filled from L2
    assert served(shards[0]) == ("L1", "L1")
    first, again = stack.open_served(1, shards[1]), stack.open_served(1, shards[1])
    assert (first.served_by, again.served_by) == ("source", None) and first.table is again.table
    assert first.fetch_s > 0
    small = build_stack(str(packed), [TierConfig("L1", str(tmp_path / "tiny"), 16, form="decoded")])
    small.manifest()
    small.declare(Lifecycle(pattern="reshuffle"), 4 * shards[2].decoded_bytes, 2)
    held = small.ensure(shards[2])
    assert (held.tier, held.served_by) == ("staging", "source")  # no tier keeps it: the staging area does
    assert small.ensure(shards[2]).served_by == "staging"
    held.release()


def samples_dataset(data, transform=None, batch_size=8):
    return TieredDataset(
        data, BatchSpec(batch_size=batch_size, columns=["tokens"], transform=transform), OrderSpec(seed=1)
    )


def test_the_loader_records_wait_step_production_and_depth_for_every_batch(packed):
    registry = MetricsRegistry()
    loader = Loader(samples_dataset(packed), "cpu", telemetry=LoaderTelemetry(registry))
    taken = 0
    for batch in loader:
        assert loader.last_meta.timing["produce_s"] > 0 and not any(k.startswith("tf_") for k in batch)
        time.sleep(0.002)
        taken += 1
        if taken == 12:
            break
    loader.close()
    f = loader_figures(registry.snapshot())
    assert f.batches == 12
    assert f.step_s >= 11 * 0.002
    assert f.production_p50_s > 0
    assert sum(f.fetch_bytes.values()) > 0
    assert sum(f.stall_s.values()) == pytest.approx(f.wait_s)


def test_a_whole_epoch_records_a_step_per_batch_and_the_event_log_a_record_per_batch(packed, tmp_path):
    from tierflow.telemetry.eventlog import EventLog, read_events

    registry = MetricsRegistry()
    events = EventLog(tmp_path / "events.jsonl")
    loader = Loader(
        TieredDataset(packed, BatchSpec(batch_size=8, columns=["tokens"]), OrderSpec(seed=1), max_batches=20),
        "cpu",
        telemetry=LoaderTelemetry(registry, events=events),
    )
    assert sum(1 for _ in loader) == 20
    loader.close()
    events.close()
    step = next(h for h in registry.snapshot()["histograms"] if h["name"] == "tierflow_loader_step_seconds")
    assert step["count"] == 20  # between batches, and after the last one the loop asked past
    records = [e for e in read_events(tmp_path / "events.jsonl") if e["kind"] == "batch"]
    assert [r["i"] for r in records] == list(range(20))
    assert records[0]["step_s"] is None and all(r["step_s"] is not None for r in records[1:])
    assert loader_figures(registry.snapshot()).batches == 20


@pytest.mark.parametrize("background", [False, True], ids=["inline", "feed_thread"])
def test_without_workers_each_batch_carries_its_own_build_time_and_opens(packed, background):
    """No DataLoader workers: the device feed builds the batches (inline or on its thread) and its timing
    of each build is the batch's production time; the build's shard opens are the batch's fetches."""

    def slow(sample, rng):
        time.sleep(0.0005)
        return sample

    registry = MetricsRegistry()
    loader = Loader(
        samples_dataset(packed, transform=slow), "cpu", telemetry=LoaderTelemetry(registry), background=background
    )
    timings = []
    for _ in loader:
        timings.append(loader.last_meta.timing)
        if len(timings) == 12:
            break
    loader.close()
    assert all(t["produce_s"] >= 8 * 0.0005 for t in timings)  # 8 samples' transforms inside each build
    assert timings[0]["fetch"] and all(f["opens"] >= 1 for f in timings[0]["fetch"].values())
    opened = {}
    for t in timings:
        for tier, f in t["fetch"].items():
            opened[tier] = opened.get(tier, 0) + f["bytes"]
    f = loader_figures(registry.snapshot())
    assert f.batches == 12 and f.production_p50_s >= 8 * 0.0005
    assert f.fetch_bytes == opened  # each open charged to one batch, none lost
    assert sum(f.stall_s.values()) == pytest.approx(f.wait_s)


def test_a_user_built_dataloader_without_workers_is_timed_from_its_first_pass(packed):
    from torch.utils.data import DataLoader

    registry = MetricsRegistry()
    loader = Loader(DataLoader(samples_dataset(packed), batch_size=None), "cpu", telemetry=LoaderTelemetry(registry))
    for taken, _ in enumerate(loader, 1):
        assert loader.last_meta.timing["produce_s"] > 0
        if taken == 4:
            break
    loader.close()
    f = loader_figures(registry.snapshot())
    assert f.batches == 4 and f.production_p50_s > 0 and sum(f.fetch_bytes.values()) > 0


def test_a_loader_without_telemetry_adds_nothing_to_batches(packed):
    loader = Loader(samples_dataset(packed), "cpu", telemetry=False)
    next(iter(loader))
    loader.close()
    assert loader.last_meta.timing is None and loader.telemetry is None


def test_verdict_names_compute_when_the_loop_hardly_waits():
    registry = MetricsRegistry()
    telemetry = LoaderTelemetry(registry)
    telemetry.on_batch(0.030, {"produce_s": 0.030, "fetch": {}}, depth=0)  # the first batch: start-up
    for _ in range(40):
        telemetry.on_batch(0.0001, {"produce_s": 0.003, "fetch": {}}, depth=2)
        telemetry.on_step(0.025)
    verdict = judge(loader_figures(registry.snapshot()))
    assert verdict.bound == "compute" and "make the step faster" in verdict.change
    telemetry.on_batch(0.060, {"produce_s": 0.060, "fetch": {}}, depth=0)  # one slow build tips it over 5%
    assert judge(loader_figures(registry.snapshot())).bound == "preprocessing"


def test_start_up_batches_are_timed_apart_from_the_bubble():
    telemetry = LoaderTelemetry(MetricsRegistry(), startup_batches=1)
    telemetry.on_batch(0.500, {"produce_s": 0.5, "fetch": {}}, depth=0)
    for _ in range(10):
        telemetry.on_batch(0.001, {"produce_s": 0.003, "fetch": {}}, depth=2)
        telemetry.on_step(0.025)
    f = telemetry.figures()
    assert f.batches == 11 and f.startup_s == pytest.approx(0.5)
    assert f.wait_s == pytest.approx(0.010) and f.bubble_rate == pytest.approx(0.010 / 0.260)


@pytest.mark.slow
def test_bench_of_a_slow_step_names_compute_and_reports_start_up_apart(packed):
    steps = 140  # long enough that the automatic feed's inline batches count as start-up
    # a 20 ms step: the loader's own work in the loop (~0.2 ms a batch) stays far under the 5% a busy
    # machine could otherwise push it past, which the verdict now rightly calls preprocessing
    result = run_bench(samples_dataset(packed), steps, simulated_step(20))
    assert result.startup_batches == startup_batches(steps) > 1
    assert result.timed_steps == steps + 1 - result.startup_batches
    assert result.startup_s > 0 and result.loader.startup_s > 0 and result.loader.batches == steps
    assert "start-up" in format_result(result)
    assert result.verdict.bound == "compute", format_result(result)


def test_verdict_names_preprocessing_when_the_transform_is_slow(packed):
    def slow(sample, rng):
        time.sleep(0.004)
        return sample

    result = run_bench(samples_dataset(packed, transform=slow), 12, simulated_step(2))
    assert result.verdict.bound == "preprocessing", format_result(result)
    assert "num_workers" in result.verdict.change


def test_verdict_names_remote_storage_when_the_source_is_throttled(packed_large_docs, make_proxy):
    with serve_directory(packed_large_docs) as server:
        proxy = make_proxy(server.url, bandwidth=8_000_000)  # ~30 ms a shard against a 2 ms step
        registry = MetricsRegistry()
        stack = build_stack(proxy.url, [], registry=registry)
        result = run_bench(samples_dataset(stack.dataset()), 12, simulated_step(2), registry=registry)
    assert result.verdict.bound == "remote storage", format_result(result)
    assert "L2" in result.verdict.change
    assert result.verdict.l2_bytes > 0 and result.verdict.lookahead_batches >= 2


def test_bandwidth_use_against_the_node_budget_is_a_health_flag(packed_large_docs, tmp_path):
    from tierflow.storage.budget import BandwidthBudget

    registry = MetricsRegistry()
    budget = BandwidthBudget(8e6, path=tmp_path / "budget")
    stack = build_stack(
        str(packed_large_docs), [TierConfig("L2", str(tmp_path / "l2"), 1 << 30, form="decoded")], registry=registry
    )
    stack.source.budget = budget
    result = run_bench(samples_dataset(stack.dataset()), 12, simulated_step(2), registry=registry, budget=budget)
    flag = next(f for f in result.health if f.name == "bandwidth use")
    assert 0.2 < flag.value <= 1.5 and flag.status == "warn"  # cold L2: fetching at the budget's rate


def test_health_flags_apply_the_thresholds():
    registry = MetricsRegistry()
    telemetry = LoaderTelemetry(registry)
    for _ in range(30):
        telemetry.on_batch(0.002, {"produce_s": 0.009, "fetch": {}}, depth=0)
        telemetry.on_step(0.010)
    for _ in range(30):
        registry.counter("tierflow_tier_hits_total", {"tier": "L1"}).inc()
    registry.counter("tierflow_tier_misses_total", {"tier": "L1"}).inc(10)
    flags = {
        f.name: f
        for f in health_flags(loader_figures(registry.snapshot()), tier_figures(registry.snapshot()), bandwidth_use=0.9)
    }
    assert flags["L1 demand hit ratio"].status == "warn"  # 75% < 85%
    assert flags["bandwidth use"].status == "warn"
    assert flags["production latency"].status == "alarm"  # 90% of the step
    assert flags["bubble rate"].status == "warn"  # 2/12
    assert stall_shares({"fetch:L2": 1.0, "prep": 3.0}) == {"local storage": 0.25, "preprocessing": 0.75}
    assert judge(loader_figures(registry.snapshot())).bound == "preprocessing"


def test_tier_figures_include_what_readers_in_workers_fetched(packed, tmp_path):
    registry = MetricsRegistry()
    stack = build_stack(
        str(packed), [TierConfig("L2", str(tmp_path / "l2"), 1 << 30, form="decoded")], registry=registry
    )
    ds = TieredDataset(stack.dataset(), BatchSpec(batch_size=16), OrderSpec(partitions=2))
    result = run_bench(ds, 40, simulated_step(1), registry=registry, num_workers=2)
    l2 = result.tiers["L2"]
    # the readers run in the two workers: their misses reach the main process with the batches
    assert l2.misses > 0 and l2.bytes_in > 0
    assert l2.misses <= len(tierflow.open_dataset(packed).manifest.shards)  # the parent's copy not counted twice


@pytest.mark.slow
def test_bench_sets_bytes_per_epoch_beside_the_plan_and_never_below_the_optimum(packed, tmp_path):
    registry = MetricsRegistry()
    shards = tierflow.open_dataset(packed).manifest.shards
    capacity = int(0.3 * sum(s.decoded_bytes for s in shards))
    stack = build_stack(str(packed), [TierConfig("L2", str(tmp_path / "l2"), capacity)], registry=registry)
    ds = TieredDataset(stack.dataset(), BatchSpec(batch_size=16, seq_len=64))
    per_epoch = ds.num_order_samples // 16
    result = run_bench(
        ds,
        2 * per_epoch,
        simulated_step(1),
        registry=registry,
        stager=Stager(ds, stack),
        tier_layout=[("L2", capacity, True)],
    )
    b = result.bytes_per_epoch
    assert b is not None and b.epochs == pytest.approx(2.0, abs=0.01)
    assert b.optimum <= b.predicted <= 1.0
    assert b.optimum - 0.02 <= b.measured <= b.predicted + 0.1
    assert "bytes from below per epoch" in format_result(result)


def test_the_verdict_never_recommends_the_worker_count_already_in_use():
    registry = MetricsRegistry()
    telemetry = LoaderTelemetry(registry)
    for _ in range(40):
        telemetry.on_batch(0.008, {"produce_s": 0.012, "fetch": {}}, depth=0)
        telemetry.on_step(0.010)
    figures = loader_figures(registry.snapshot())
    assert "num_workers=3" in judge(figures, workers=0, cores=8).change
    assert "num_workers=" not in judge(figures, workers=3, cores=8).change
