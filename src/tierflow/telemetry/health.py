"""Health flags: the data path's figures held against the thresholds users already watch, plus the
machine's own view (disk and network bytes/s, GPU utilisation and memory) to read beside them.

Thresholds: demand hit ratio L1 > 85%, L2 > 70%; bandwidth use < 80% of the node budget;
production latency < 50% of the step healthy, > 80% alarm; bubble rate > 5% a warning; a sharp
rise in evictions-before-use (the share of evictions that were never read) flags a failing policy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal
from collections.abc import Mapping

from tierflow.telemetry.loader_metrics import LoaderFigures
from tierflow.telemetry.tier_figures import TierFigures

Status = Literal["ok", "warn", "alarm"]


@dataclass(frozen=True)
class Thresholds:
    hit_ratio: Mapping[str, float] = field(default_factory=lambda: {"L1": 0.85, "L2": 0.70})
    bandwidth_use: float = 0.80
    production_healthy: float = 0.50
    production_alarm: float = 0.80
    bubble_warn: float = 0.05
    evicted_unused_warn: float = 0.25
    evicted_unused_alarm: float = 0.50
    min_samples: int = 20


@dataclass(frozen=True)
class HealthFlag:
    """One figure, its status, and what it was held against."""

    name: str
    status: Status
    value: float
    threshold: float
    message: str


def health_flags(
    loader: LoaderFigures | None,
    tiers: Mapping[str, TierFigures],
    bandwidth_use: float | None = None,
    thresholds: Thresholds = Thresholds(),
) -> list[HealthFlag]:
    """Flags for what has enough data to judge; figures with too few events are left out, not passed."""
    flags: list[HealthFlag] = []
    th = thresholds
    for tier, want in th.hit_ratio.items():
        t = tiers.get(tier)
        if t is None or t.hits + t.misses < th.min_samples:
            continue
        ratio = t.demand_hit_ratio
        status: Status = "ok" if ratio > want else "warn"
        flags.append(
            HealthFlag(
                f"{tier} demand hit ratio",
                status,
                ratio,
                want,
                f"{tier} served {ratio:.0%} of requests (want > {want:.0%})",
            )
        )
    if bandwidth_use is not None:
        status = "ok" if bandwidth_use < th.bandwidth_use else "warn"
        flags.append(
            HealthFlag(
                "bandwidth use",
                status,
                bandwidth_use,
                th.bandwidth_use,
                f"{bandwidth_use:.0%} of the node's bandwidth budget (want < {th.bandwidth_use:.0%})",
            )
        )
    if loader is not None and loader.batches >= th.min_samples and loader.step_mean_s > 0:
        share = loader.production_p50_s / loader.step_mean_s
        status = "ok" if share < th.production_healthy else "alarm" if share > th.production_alarm else "warn"
        flags.append(
            HealthFlag(
                "production latency",
                status,
                share,
                th.production_healthy,
                f"a batch takes {share:.0%} of a step to build (healthy < "
                f"{th.production_healthy:.0%}, alarm > {th.production_alarm:.0%})",
            )
        )
        status = "ok" if loader.bubble_rate <= th.bubble_warn else "warn"
        flags.append(
            HealthFlag(
                "bubble rate",
                status,
                loader.bubble_rate,
                th.bubble_warn,
                f"the training loop waited {loader.bubble_rate:.1%} of its time (warn > {th.bubble_warn:.0%})",
            )
        )
    for tier, t in tiers.items():
        if t.evictions < th.min_samples:
            continue
        unused = t.evictions_before_use / t.evictions
        status = "ok" if unused < th.evicted_unused_warn else "alarm" if unused >= th.evicted_unused_alarm else "warn"
        flags.append(
            HealthFlag(
                f"{tier} evictions before use",
                status,
                unused,
                th.evicted_unused_warn,
                f"{unused:.0%} of {tier}'s evictions were never read: the policy admits what it cannot keep"
                if status != "ok"
                else f"{unused:.0%} of {tier}'s evictions unread",
            )
        )
    return flags


class MachineView:
    """Disk and network bytes/s since the previous `sample()`, and GPU utilisation/memory through NVML."""

    def __init__(self) -> None:
        self._last: tuple[float, Any, Any] | None = None
        self._nvml: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
        except Exception:  # no NVML library or no GPU: the view leaves the GPU out
            self._nvml = None

    def sample(self) -> dict[str, float]:
        import psutil

        now = time.monotonic()
        disk, net = psutil.disk_io_counters(), psutil.net_io_counters()
        out: dict[str, float] = {}
        if self._last is not None and disk is not None and net is not None:
            then, last_disk, last_net = self._last
            span = max(now - then, 1e-9)
            if last_disk is not None:
                out["disk_read_bytes_per_s"] = (disk.read_bytes - last_disk.read_bytes) / span
                out["disk_write_bytes_per_s"] = (disk.write_bytes - last_disk.write_bytes) / span
            if last_net is not None:
                out["net_recv_bytes_per_s"] = (net.bytes_recv - last_net.bytes_recv) / span
                out["net_sent_bytes_per_s"] = (net.bytes_sent - last_net.bytes_sent) / span
        self._last = (now, disk, net)
        if self._nvml is not None:
            for i in range(self._nvml.nvmlDeviceGetCount()):
                handle = self._nvml.nvmlDeviceGetHandleByIndex(i)
                out[f"gpu{i}_utilization"] = self._nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0
                out[f"gpu{i}_memory_used_bytes"] = float(self._nvml.nvmlDeviceGetMemoryInfo(handle).used)
        return out
