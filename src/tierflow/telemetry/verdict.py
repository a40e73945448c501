"""The bottleneck verdict: which of compute, host-to-device copy, preprocessing, local storage or
remote storage bounds the run, the one change most likely to help, and cache sizes from measured rates.

It follows the tree users already walk: if the loop hardly waits, the step (compute) is the bound;
otherwise the largest share of the wait names the stage: moving the batch (copy), building it
(preprocessing), or fetching its shards, from a local tier (L1/L2: local storage) or from the
source (L3/L4: remote storage). Capacities follow capacity ~ consumption bandwidth x coverage time;
lookahead follows Little's law (shards in flight = consumption rate x fetch latency).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from collections.abc import Mapping

from tierflow.telemetry.loader_metrics import MAPPED, SOURCE, LoaderFigures
from tierflow.telemetry.tier_figures import TierFigures

BOUNDS = ("compute", "host-to-device copy", "preprocessing", "local storage", "remote storage")


@dataclass(frozen=True)
class Verdict:
    bound: str
    reason: str
    change: str
    consumption_bytes_per_s: float
    l1_bytes: int
    l2_bytes: int
    lookahead_batches: int
    shares: dict[str, float] = field(default_factory=dict)


def stall_shares(stall_s: Mapping[str, float]) -> dict[str, float]:
    """The loop's wait split by bound: {"host-to-device copy": 0.1, "remote storage": 0.8, ...}."""
    by_bound: dict[str, float] = {}
    for key, seconds in stall_s.items():
        cause, _, tier = key.partition(":")
        if cause == "copy":
            bound = "host-to-device copy"
        elif cause == "prep":
            bound = "preprocessing"
        elif tier in (SOURCE, "memory"):
            bound = "remote storage"
        elif tier == MAPPED:
            bound = "preprocessing"
        else:
            bound = "local storage"
        by_bound[bound] = by_bound.get(bound, 0.0) + seconds
    total = sum(by_bound.values())
    return {k: v / total for k, v in by_bound.items()} if total > 0 else {}


def recommended_capacity(bytes_per_s: float, coverage_s: float, dataset_bytes: int | None, floor: int = 0) -> int:
    """Bytes a tier needs to cover `coverage_s` of consumption; never more than the dataset."""
    want = max(int(bytes_per_s * coverage_s), floor)
    return min(want, dataset_bytes) if dataset_bytes else want


def usable_cores() -> int:
    """The cores this process may run on (its affinity, as a container or `taskset` sets it)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def judge(
    loader: LoaderFigures,
    tiers: Mapping[str, TierFigures] | None = None,
    *,
    dry_run_step_s: float | None = None,
    dataset_bytes: int | None = None,
    shard_bytes: int | None = None,
    bubble_ok: float = 0.05,
    l1_coverage_s: float = 60.0,
    l2_coverage_s: float = 3600.0,
    workers: int = 0,
    loader_ratio: float | None = None,
    cores: int | None = None,
    hit_ratio_wanted: Mapping[str, float] | None = None,
    min_requests: int = 20,
) -> Verdict:
    """The verdict for one run; `dry_run_step_s` (the step with data preloaded) sets the target rate,
    `workers` is the DataLoader worker count the run used (a change never recommends it again).

    `loader_ratio` (the loader's rate over the dry run's, when one ran) counts as much as the loop's
    waits: a loop that hardly waited yet ran at 0.79 of the dry run lost 21% to the data path's work
    in its own process, which is not compute. A worker count recommended is at most the `cores`
    (default: this process's) less one for the loop. The caches are called fine only when each tier's
    demand hit ratio is above its `hit_ratio_wanted` (the health flags' thresholds)."""
    from tierflow.telemetry.health import Thresholds

    tiers = tiers or {}
    cores = cores or usable_cores()
    wanted_hits = Thresholds().hit_ratio if hit_ratio_wanted is None else hit_ratio_wanted
    step_s = dry_run_step_s if dry_run_step_s else loader.step_mean_s
    opened = sum(v for t, v in loader.fetch_bytes.items() if t != MAPPED)
    per_batch = opened / loader.batches if loader.batches else 0.0
    bandwidth = per_batch / step_s if step_s > 0 else 0.0
    mean_shard = shard_bytes or 0
    l1 = recommended_capacity(bandwidth, l1_coverage_s, dataset_bytes, floor=2 * mean_shard)
    l2 = recommended_capacity(bandwidth, l2_coverage_s, dataset_bytes, floor=2 * mean_shard)
    fetch_latency = max((t.fetch_p99_s for t in tiers.values()), default=0.0) or loader.production_p99_s
    lookahead = math.ceil(fetch_latency / step_s) + 1 if step_s > 0 else 2
    shares = stall_shares(loader.stall_s)

    def verdict(bound: str, reason: str, change: str) -> Verdict:
        return Verdict(bound, reason, change, bandwidth, l1, l2, lookahead, shares)

    lost = 1.0 - loader_ratio if loader_ratio is not None and loader_ratio > 0 else 0.0
    rate = f"the loop ran at {loader_ratio:.2f} of the dry run's rate and " if loader_ratio else "the loop "
    if (loader.bubble_rate <= bubble_ok or not shares) and lost <= bubble_ok:
        return verdict(
            "compute",
            f"{rate}waited {loader.bubble_rate:.1%} of its time (<= {bubble_ok:.0%})",
            "the data path keeps up: make the step faster (larger batch, mixed precision, compile); "
            + _caches(tiers, wanted_hits, min_requests, l1, l2),
        )
    if loader.bubble_rate <= bubble_ok or not shares:  # slower than the dry run, without waiting for it
        bound = "preprocessing"
        reason = (
            f"{rate}waited only {loader.bubble_rate:.1%} of its time: the other {lost:.0%} went to the "
            f"data path's work in the training process (building batches, staging shards), taken from the step"
        )
    else:
        bound = max(shares, key=shares.__getitem__)
        reason = f"{rate}waited {loader.bubble_rate:.1%} of its time; {shares[bound]:.0%} of that wait was {bound}"
    if bound == "host-to-device copy":
        change = (
            "move less per step: keep token ids narrow and widen on the device, raise the feed depth, "
            "use DataLoader workers with shared-memory batches"
        )
    elif bound == "preprocessing":
        wanted = max(2, math.ceil(loader.production_p50_s / step_s) + 1) if step_s > 0 else 2
        cap = max(1, cores - 1)  # a core stays with the training loop
        capped = f", all {cores} cores but the loop's" if wanted > cap else ""
        wanted = min(wanted, cap)
        if wanted > workers:
            change = (
                f"build batches in parallel (num_workers={wanted}{capped}: a batch takes "
                f"{loader.production_p50_s * 1e3:.1f} ms against a {step_s * 1e3:.1f} ms step) or make the "
                f"transform cheaper"
            )
        else:
            why = (
                f"this machine has {cores} cores"
                if wanted < workers or capped
                else f"{workers} workers already build batches in parallel"
            )
            change = (
                f"make the transform cheaper (or the step does not need more workers: {why}); a batch "
                f"takes {loader.production_p50_s * 1e3:.1f} ms against a {step_s * 1e3:.1f} ms step"
            )
    elif bound == "local storage":
        change = f"put an L1 tier in RAM (tmpfs) of {_size(l1)} so shards are read from memory"
    else:
        change = (
            f"add or grow the L2 tier to {_size(l2)} and stage {lookahead} batches ahead "
            f"(shard fetch p99 {fetch_latency * 1e3:.0f} ms)"
        )
    return verdict(bound, reason, change)


def _caches(tiers: Mapping[str, TierFigures], wanted: Mapping[str, float], min_requests: int, l1: int, l2: int) -> str:
    """What a compute-bound run says of its caches: fine only where every tier's hit ratio is."""
    low = [
        (name, t.demand_hit_ratio, wanted[name])
        for name, t in tiers.items()
        if name in wanted and t.hits + t.misses >= min_requests and t.demand_hit_ratio <= wanted[name]
    ]
    if not low:
        return "the caches can stay as they are"
    said = ", ".join(f"{name} served {ratio:.0%} (want > {want:.0%})" for name, ratio, want in low)
    grow = ", ".join(f"{name} to {_size(l1 if name == 'L1' else l2)}" for name, _, _ in low)
    return (
        f"the caches miss more than they should ({said}): harmless while the loop does not wait, but a "
        f"faster step would wait on them: grow {grow}"
    )


def _size(nbytes: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} B"
