"""`tierflow bench`: the real loader driving a step, then the dry run (the same batches, preloaded
in RAM, driving the same step), side by side, with per-tier figures and the bottleneck verdict.

The dry run is the bound DESIGN.md names: a data path can at best reach the step's own rate.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Sequence

from tierflow.format.metadata import shard_column
from tierflow.format.shard import Form
from tierflow.telemetry.health import HealthFlag, health_flags
from tierflow.telemetry.loader_metrics import LoaderFigures, LoaderTelemetry, loader_figures
from tierflow.telemetry.metrics import MetricsRegistry
from tierflow.telemetry.tier_figures import STACK_SOURCE_BYTES, TierFigures, tier_figures
from tierflow.telemetry.verdict import Verdict, judge

Step = Callable[[Any], None]


def simulated_step(step_ms: float) -> Step:
    """A step that holds the loop for `step_ms` without holding the GIL (as a GPU step does)."""
    seconds = step_ms / 1e3

    def step(batch: Any) -> None:
        time.sleep(seconds)

    return step


def steps_per_second(batches: Any, steps: int, step_s: float) -> tuple[float, float]:
    """(steps/s after the first batch, seconds to the first batch) of a loop that sleeps `step_s`
    per batch; the benchmarks' common yardstick, start-up kept apart."""
    began = time.perf_counter()
    iterator = iter(batches)
    next(iterator)
    first = time.perf_counter() - began
    start = time.perf_counter()
    done = 0
    for _ in iterator:
        if step_s:
            time.sleep(step_s)
        done += 1
        if done == steps:
            break
    return done / (time.perf_counter() - start), first


def startup_batches(steps: int) -> int:
    """Batches of a `steps`-step run counted as start-up: the first one (processes, threads, the first
    shards) and those an automatic device feed reads inline before it settles on a thread, where the run
    is long enough to leave most of it timed."""
    from tierflow.loader.device_feed_readahead import AUTO_DECIDE_AFTER

    settled = 1 + AUTO_DECIDE_AFTER
    return settled if steps >= 4 * settled else 1 if steps > 1 else 0


@dataclass(frozen=True)
class BytesPerEpoch:
    """Bytes fetched from below the tiers per epoch of the run, as a share of the dataset at rest,
    beside what `tierflow plan` predicts for the same steps and the optimum with the same room."""

    measured: float
    predicted: float
    optimum: float
    epochs: float
    tier: str = ""
    capacity: int = 0
    """The top tier's capacity in bytes, stated against `dataset_bytes` (at rest, the user's yardstick)."""
    dataset_bytes: int = 0
    sampled: str | None = None
    """How the plan's figures were forecast when from a sample of the node's shards (plan.Sample)."""

    def describe(self) -> str:
        """The figures as a sentence: per epoch over a run of one epoch or more; over a shorter run,
        what it fetched in all (a cold start spread over 0.04 epochs is no per-epoch figure)."""
        if self.epochs >= 1:
            return (
                f"per epoch: {self.measured:.2f}x the dataset over {self.epochs:.1f} epochs "
                f"(plan {self.predicted:.2f}x; optimum with the same room {self.optimum:.2f}x)"
            )
        e = self.epochs
        return (
            f"in all: {self.measured * e:.2f}x the dataset in {e:.2g} of an epoch, too short a run for a "
            f"per-epoch figure (plan {self.predicted * e:.2f}x; optimum with the same room {self.optimum * e:.2f}x)"
        )


@dataclass(frozen=True)
class BenchResult:
    steps: int
    loader_s: float
    dry_run_s: float
    loader: LoaderFigures
    tiers: dict[str, TierFigures]
    verdict: Verdict
    health: list[HealthFlag]
    bytes_per_epoch: BytesPerEpoch | None = None
    startup_s: float = 0.0
    """Seconds of start-up: until the last of the `startup_batches` was in hand."""
    startup_batches: int = 0
    """Batches whose waits are start-up; the timed run (and the dry run) starts with the last of them."""

    @property
    def timed_steps(self) -> int:
        return self.steps - max(0, self.startup_batches - 1)

    @property
    def throughput(self) -> float:
        """Batches per second through the real loader, start-up excluded."""
        return self.timed_steps / self.loader_s if self.loader_s > 0 else 0.0

    @property
    def dry_run_throughput(self) -> float:
        return self.timed_steps / self.dry_run_s if self.dry_run_s > 0 else 0.0

    @property
    def ratio(self) -> float:
        """Loader throughput as a share of the dry run's (1.0: the data path costs nothing)."""
        return self.dry_run_s / self.loader_s if self.loader_s > 0 else 0.0


def run_bench(
    dataset: Any,
    steps: int,
    step: Step,
    *,
    device: str = "cpu",
    num_workers: int = 0,
    registry: MetricsRegistry | None = None,
    events: Any = None,
    tier_layout: Sequence[tuple[str, int, bool]] = (),
    stager: Any = None,
    on_batch: Callable[[int, Any], None] | None = None,
    budget: Any = None,
) -> BenchResult:
    """Run `steps` batches of `dataset` (a TieredDataset) through the Loader, then the dry run.

    `registry` should be the tier stack's, so tier figures land beside the loader's; `tier_layout`
    lists (name, capacity bytes, stores decoded) fastest first; the top one's bytes from below per
    epoch are set beside the plan's prediction and the optimum for the same steps. The first
    `startup_batches(steps)` batches are start-up: their waits are timed apart (`startup_s`), so a
    short run judges the steady state.
    """
    from tierflow.loader.loader import Loader

    if steps < 1:
        raise ValueError(f"bench of {dataset!r}: steps must be >= 1, got {steps}")
    registry = registry if registry is not None else MetricsRegistry()
    warmup = startup_batches(steps)
    telemetry = LoaderTelemetry(registry, events=events, startup_batches=warmup)
    start = dataset.state_dict()
    loader = Loader(
        dataset, device, num_workers=num_workers, telemetry=telemetry, stager=stager, endless=True
    )  # `steps` steps, across epoch edges
    kept: list[Any] = []
    acquired_before = sum(budget.acquired_bytes.values()) if budget is not None else 0
    began = started = time.perf_counter()
    startup_s = 0.0
    for batch in loader:
        if len(kept) + 1 == warmup:
            started = time.perf_counter()  # the timed run starts with the last start-up batch in hand
            startup_s = started - began
        step(batch)
        kept.append(batch)
        if on_batch is not None:
            on_batch(len(kept) - 1, batch)
        if len(kept) == steps:
            break
    loader_s = time.perf_counter() - started
    elapsed_s = time.perf_counter() - began
    loader.close()
    bandwidth_use = None
    if budget is not None and budget.rate and elapsed_s > 0:
        # this process's fetches against the node budget (all of them when batches are built here)
        bandwidth_use = (sum(budget.acquired_bytes.values()) - acquired_before) / (budget.rate * elapsed_s)
    dataset.load_state_dict(start)

    started = time.perf_counter()
    timed = kept[max(0, warmup - 1) :]  # the batches the loader's timed run covered
    for batch in timed:
        step(batch)
    dry_run_s = time.perf_counter() - started

    snapshot = registry.snapshot()  # the workers' tier counters are included as they ship them
    figures = loader_figures(snapshot)
    tiers = tier_figures(snapshot)
    manifest = getattr(dataset, "manifest", None)
    dataset_bytes = int(shard_column(manifest, "decoded_bytes").sum()) if manifest is not None else None
    shard_bytes = dataset_bytes // max(1, len(manifest.shards)) if manifest is not None and dataset_bytes else None
    verdict = judge(
        figures,
        tiers,
        dry_run_step_s=dry_run_s / len(timed),
        dataset_bytes=dataset_bytes,
        shard_bytes=shard_bytes,
        workers=num_workers,
        loader_ratio=dry_run_s / loader_s if loader_s > 0 else None,
    )
    per_epoch = _bytes_per_epoch(dataset, snapshot, len(kept), tier_layout) if tier_layout else None
    if events is not None:
        events.close(loader_s=loader_s, dry_run_s=dry_run_s, steps=len(kept), verdict=verdict)
    return BenchResult(
        len(kept),
        loader_s,
        dry_run_s,
        figures,
        tiers,
        verdict,
        health_flags(figures, tiers, bandwidth_use=bandwidth_use),
        per_epoch,
        startup_s,
        warmup,
    )


def _bytes_per_epoch(
    dataset: Any, snapshot: dict, steps: int, tier_layout: Sequence[tuple[str, int, bool]]
) -> BytesPerEpoch | None:
    """The run's bytes from below against the plan for the same steps (epochs prorated)."""
    from tierflow.commands import plan as planning

    manifest = getattr(dataset, "manifest", None)
    if manifest is None or not hasattr(dataset, "working_set"):
        return None
    at_rest = int(shard_column(manifest, "bytes").sum())  # a column: no object per shard
    fetched = sum(
        c["value"]
        for c in snapshot.get("counters", [])
        if c["name"] == STACK_SOURCE_BYTES and c["labels"].get("tier") == "source"
    )
    world = dataset.world
    node_samples = dataset.order.layout.node_samples(world.node, world.num_nodes)
    samples = steps * dataset.batch_size * dataset.batcher.batches_per_group * world.ranks_per_node
    epochs = samples / max(1, node_samples)
    top, capacity, decoded = tier_layout[0]
    sample = planning.choose_sample(  # as `tierflow plan`: a node reading more than 16,384 shards is sampled
        dataset,
        dataset.working_set,
        target=planning.SAMPLE_SHARDS,
        above=planning.SAMPLE_ABOVE,
        sparse=planning.SAMPLE_SPARSE,
    )
    plan = planning.plan_cache(
        dataset,
        capacity,
        epochs=max(1, -(-samples // max(1, node_samples))),
        form=Form.DECODED if decoded else Form.AT_REST,
        working_set=dataset.working_set,
        sample=sample,
    )

    def prorated(per: list[Any]) -> float:
        whole, part = int(epochs), epochs - int(epochs)
        total = sum(e.ratio for e in per[:whole]) + (per[whole].ratio * part if whole < len(per) else 0.0)
        return total / epochs if epochs else 0.0

    return BytesPerEpoch(
        fetched / at_rest / epochs if epochs and at_rest else 0.0,
        prorated(plan.predicted),
        prorated(plan.optimum),
        epochs,
        top,
        int(capacity),
        at_rest,
        None if sample is None else sample.describe(),
    )


def format_result(result: BenchResult, step_ms: float | None = None) -> str:
    """The table `tierflow bench` prints: ours, the bound, the ratio; tiers; stalls; verdict."""
    lf = result.loader
    lines = [
        f"{'':<24}{'loader':>12}{'dry run':>12}{'ratio':>8}",
        f"{'batches/s':<24}{result.throughput:12.1f}{result.dry_run_throughput:12.1f}{result.ratio:8.2f}",
        f"{'seconds':<24}{result.loader_s:12.2f}{result.dry_run_s:12.2f}",
        f"start-up {result.startup_s:.2f} s ({result.startup_batches} batch(es), kept out of the figures here)",
        "",
        f"bubble rate {lf.bubble_rate:.1%}  wait p90 {lf.wait_p90_s * 1e3:.1f} ms  p99 {lf.wait_p99_s * 1e3:.1f} ms  "
        f"production p50 {lf.production_p50_s * 1e3:.1f} ms  p99 {lf.production_p99_s * 1e3:.1f} ms  "
        f"prefetch depth {lf.prefetch_depth_mean:.1f}",
        "stalls: " + (", ".join(f"{k} {v:.2f}s" for k, v in sorted(lf.stall_s.items())) or "none"),
    ]
    if result.tiers:
        lines += [
            "",
            f"{'tier':<8}{'hit ratio':>10}{'hits':>8}{'misses':>8}{'MB in':>9}{'MB out':>9}{'evict':>7}"
            f"{'unused':>8}{'occupancy':>12}{'fetch p99':>11}",
        ]
        for t in result.tiers.values():
            lines.append(
                f"{t.tier:<8}{t.demand_hit_ratio:10.1%}{t.hits:8d}{t.misses:8d}{t.bytes_in / 1e6:9.1f}"
                f"{t.bytes_out / 1e6:9.1f}{t.evictions:7d}{t.evictions_before_use:8d}"
                f"{t.occupancy_bytes / 1e6:7.1f}/{t.capacity_bytes / 1e6:.0f}MB"
                f"{t.fetch_p99_s * 1e3:9.1f}ms"
            )
    b = result.bytes_per_epoch
    if b is not None:
        lines.append("bytes from below " + b.describe())
        if b.sampled:
            lines.append(f"plan {b.sampled}")
        if b.dataset_bytes:
            lines.append(
                f"{b.tier} {b.capacity / 1e6:.1f} MB: {b.capacity / b.dataset_bytes:.0%} of the dataset's "
                f"{b.dataset_bytes / 1e6:.1f} MB at rest"
            )
    v = result.verdict
    lines += [
        "",
        f"verdict: {v.bound} - {v.reason}",
        f"change: {v.change}",
        f"recommended L1 {v.l1_bytes / 1e6:.1f} MB, L2 {v.l2_bytes / 1e6:.1f} MB, lookahead "
        f"{v.lookahead_batches} batches (consumption {v.consumption_bytes_per_s / 1e6:.1f} MB/s)",
    ]
    lines += [f"[{f.status}] {f.message}" for f in result.health]
    return "\n".join(lines)
