"""Export: the Prometheus endpoint over HTTP, the JSONL event log, the report's plotted series,
the live view, and the `tierflow bench/report/top` commands end to end."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import tierflow
from tierflow.commands.cli import main
from tierflow.telemetry import MetricsRegistry
from tierflow.telemetry.eventlog import EventLog, read_events
from tierflow.telemetry.loader_metrics import LoaderTelemetry
from tierflow.telemetry.prometheus import PrometheusExporter
from tierflow.commands.report import plotted_series, run_series, write_report
from tierflow.commands.top import RunState, render
from tierflow.loader import Loader, TieredDataset, BatchSpec
from tierflow.storage.budget import BandwidthBudget
from tierflow.storage.remote import open_store, upload_dataset
from tierflow.tiers import TierConfig, TierStack
from tierflow.tiers.stager import Stager

from corpora import pack_lorem, pack_pictures

STAGES = ("tier", "stack", "stager", "source", "budget", "loader", "feed", "stage", "resized")
METRIC_NAME = re.compile(rf"^tierflow_({'|'.join(STAGES)})_[a-z][a-z0-9]*(_[a-z0-9]+)*$")


def naming_problems(snapshot: dict) -> list[str]:
    """Every way a snapshot's metric names break `tierflow_<stage>_<what>[_total|_seconds|_bytes]`
    (docs/observe.md): counters end _total, nothing else does, a unit (seconds, bytes) comes last."""
    problems = []
    for kind in ("counters", "gauges", "histograms"):
        for name in sorted({entry["name"] for entry in snapshot[kind]}):
            if not METRIC_NAME.match(name):
                problems.append(f"{name}: not tierflow_<stage>_<what> with a stage of {STAGES}")
            words = name.split("_")
            total = words[-1] == "total"
            if total != (kind == "counters"):
                problems.append(f"{name}: a {kind[:-1]} {'must' if kind == 'counters' else 'must not'} end _total")
            what = words[2:-2] if total else words[2:-1]
            problems += [f"{name}: the unit {unit} must come last" for unit in ("seconds", "bytes") if unit in what]
    return problems


def test_prometheus_endpoint_scraped_over_http_parses_with_labels():
    registry = MetricsRegistry({"job": "train", "node": "n0", "rank": 3})
    registry.counter("tierflow_tier_hits_total", {"tier": "L1"}).inc(7)
    registry.gauge("tierflow_tier_occupancy_bytes", {"tier": "L2"}).set(4096)
    wait = registry.histogram("tierflow_loader_wait_seconds")
    for seconds in (0.001, 0.002, 0.5):
        wait.observe(seconds)
    with PrometheusExporter([registry], port=0) as exporter:
        text = urllib.request.urlopen(exporter.url, timeout=10).read().decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    labels = (("job", "train"), ("node", "n0"), ("rank", "3"))
    assert samples[("tierflow_tier_hits_total", tuple(sorted(labels + (("tier", "L1"),))))] == 7
    assert samples[("tierflow_tier_occupancy_bytes", tuple(sorted(labels + (("tier", "L2"),))))] == 4096
    assert samples[("tierflow_loader_wait_seconds_count", labels)] == 3
    assert samples[("tierflow_loader_wait_seconds_sum", labels)] == pytest.approx(0.503)
    assert samples[("tierflow_loader_wait_seconds_bucket", tuple(sorted(labels + (("le", "+Inf"),))))] == 3


def scripted_log(path: Path) -> list[dict]:
    registry = MetricsRegistry()
    hits = registry.counter("tierflow_tier_hits_total", {"tier": "L2"})
    misses = registry.counter("tierflow_tier_misses_total", {"tier": "L2"})
    occupancy = registry.gauge("tierflow_tier_occupancy_bytes", {"tier": "L2"})
    with EventLog(path, registry, snapshot_every_s=0.0, name="scripted") as log:
        telemetry = LoaderTelemetry(registry, events=log)
        for i in range(6):
            (hits if i % 3 else misses).inc()
            occupancy.set(1_000_000 * (i + 1))
            telemetry.on_batch(0.001 * i, {"produce_s": 0.002, "fetch": {}}, depth=i % 2)
            telemetry.on_step(0.010 + 0.001 * i)
    return list(read_events(path))


def test_event_log_records_every_batch_and_snapshots(tmp_path):
    events = scripted_log(tmp_path / "run.jsonl")
    kinds = [e["kind"] for e in events]
    assert kinds[0] == "start" and kinds[-1] == "end"
    batches = [e for e in events if e["kind"] == "batch"]
    assert [b["i"] for b in batches] == list(range(6))
    assert [b["wait_s"] for b in batches] == pytest.approx([0.001 * i for i in range(6)])
    assert batches[0]["step_s"] is None  # a batch's record carries the step that ran before its wait
    assert [b["step_s"] for b in batches[1:]] == pytest.approx([0.010 + 0.001 * i for i in range(5)])
    snapshots = [e for e in events if e["kind"] == "snapshot"]
    assert snapshots and all(
        {"disk_read_bytes_per_s", "net_recv_bytes_per_s"} <= set(e["machine"]) for e in snapshots
    )  # the machine's view rides the same timeline


@pytest.mark.slow
def test_report_png_plots_exactly_the_runs_series(tmp_path):
    log = tmp_path / "run.jsonl"
    events = scripted_log(log)
    png, figure = write_report(log)
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    drawn = plotted_series(figure)
    batches = [e for e in events if e["kind"] == "batch"]
    assert drawn["wait vs step"]["wait (ms)"][1] == pytest.approx([b["wait_s"] * 1e3 for b in batches])
    assert drawn["wait vs step"]["step (ms)"][1] == pytest.approx([b["step_s"] * 1e3 for b in batches[1:]])
    assert drawn["prefetch depth"]["batches ready"][1] == [float(i % 2) for i in range(6)]
    snapshots = [e for e in events if e["kind"] == "snapshot"]
    ratios = []
    for s in snapshots:
        c = {x["name"]: x["value"] for x in s["metrics"]["counters"] if x["labels"].get("tier") == "L2"}
        hits, misses = c.get("tierflow_tier_hits_total", 0), c.get("tierflow_tier_misses_total", 0)
        ratios.append(hits / (hits + misses))
    assert drawn["demand hit ratio"]["L2"][1] == pytest.approx(ratios)
    assert drawn["demand hit ratio"]["L2"][1][-1] == pytest.approx(4 / 6)
    assert drawn["occupancy"]["L2"][1][-1] == pytest.approx(6.0)
    assert drawn == run_series(events)


def test_top_renders_tiers_stalls_and_health_from_the_log(tmp_path):
    from rich.console import Console

    state = RunState().fold(scripted_log(tmp_path / "run.jsonl"))
    console = Console(record=True, width=140)
    console.print(render(state))
    text = console.export_text()
    assert state.ended and "L2" in text and "67%" in text and "stall split" in text


@pytest.fixture(scope="module")
def small_dataset(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bench")
    with open(root / "docs.jsonl", "w") as f:
        for i in range(3000):
            f.write(json.dumps({"text": f"{i:05d} " + "xyz" * 60}) + "\n")
    tierflow.pack([root / "docs.jsonl"], root / "ds", tokenizer="bytes", workers=1, target_shard_bytes=256 << 10)
    return root / "ds"


@pytest.mark.slow
def test_bench_report_and_top_commands_run_end_to_end(small_dataset, tmp_path, capsys):
    log = tmp_path / "run.jsonl"
    assert (
        main(
            [
                "bench",
                str(small_dataset),
                "--steps",
                "15",
                "--step-ms",
                "2",
                "--log",
                str(log),
                "--tier",
                f"L2={tmp_path / 'l2'}:64M:lru:at_rest",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "dry run" in out and "verdict:" in out and "L2" in out
    assert main(["report", str(log)]) == 0
    assert log.with_suffix(".png").exists()
    assert main(["top", str(log), "--once"]) == 0
    assert "L2" in capsys.readouterr().out


def test_the_naming_rule_catches_the_old_names():
    registry = MetricsRegistry()
    registry.counter("tier_hits")
    registry.counter("tierflow_tier_hits")
    registry.counter("tierflow_tier_bytes_in_total")
    registry.gauge("tierflow_stager_ahead_total")
    registry.histogram("tierflow_tier_fetch_seconds")
    assert [p.split(":")[0] for p in naming_problems(registry.snapshot())] == [
        "tier_hits",
        "tier_hits",
        "tierflow_tier_bytes_in_total",
        "tierflow_tier_hits",
        "tierflow_stager_ahead_total",
    ]


def test_every_metric_of_a_real_run_follows_the_naming_rule(tmp_path, s3_server, s3_bucket):
    pack_lorem(tmp_path, 3000)
    url = f"s3://{s3_bucket}/ds"
    upload_dataset(tmp_path / "ds", url, endpoint_url=s3_server.endpoint_url)
    registry = MetricsRegistry()
    budget = BandwidthBudget(1e9, tmp_path / "budget", registry=registry)  # not the node's: others' runs share it
    source = open_store(url, endpoint_url=s3_server.endpoint_url, budget=budget, registry=registry)
    stack = TierStack(
        source,
        [
            TierConfig("L1", str(tmp_path / "l1"), 1 << 30, form="decoded").build(registry),
            TierConfig("L2", str(tmp_path / "l2"), 1 << 30, form="at_rest").build(registry),
        ],
        registry=registry,
    )
    ds = TieredDataset(stack.dataset(), BatchSpec(batch_size=8, seq_len=64))
    loader = Loader(ds, stager=Stager(ds, stack), telemetry=LoaderTelemetry(stack.registry))
    for step, _ in enumerate(loader):
        if step == 20:
            break
    loader.close()
    snapshot = stack.registry.snapshot()
    names = {e["name"] for kind in ("counters", "gauges", "histograms") for e in snapshot[kind]}
    assert {name.split("_")[1] for name in names} == set(STAGES) - {"resized"}, sorted(names)
    assert naming_problems(snapshot) == []


def test_the_image_caches_metrics_follow_the_naming_rule(tmp_path):
    """The resized-image cache (transforms/resized.py) counts into the loader's registry: its own
    stage's names and the tier names it reuses follow the rule docs/observe.md gives."""
    from tierflow.transforms import ImagePipeline, RandomResizedCrop, ResizedImages

    packed = pack_pictures(tmp_path, count=16)
    pipeline = ImagePipeline([RandomResizedCrop(16)], cache=ResizedImages(tmp_path / "l1", "10MB", short_side=24))
    with tierflow.open_loader(
        packed,
        tiers=[f"L2={tmp_path / 'l2'}:50MB"],
        batch_size=8,
        transform=pipeline,
        columns=["image", "image_width", "image_height"],
        epoch_end="rank",
    ) as loader:
        assert sum(len(batch["image"]) for batch in loader) == 16
        snapshot = loader.telemetry.registry.snapshot()
    names = {e["name"] for kind in ("counters", "gauges", "histograms") for e in snapshot[kind]}
    assert {"tierflow_resized_made_blocks_total", "tierflow_resized_made_bytes_total"} <= names, sorted(names)
    assert naming_problems(snapshot) == []
