"""`tierflow top RUN.jsonl`: a live terminal view of a running job from the event log it publishes:
per-tier occupancy bars and hit ratios, throughput, the stall split, and health flags.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any
from collections.abc import Iterable, Mapping

from tierflow.telemetry.eventlog import read_events
from tierflow.telemetry.health import health_flags
from tierflow.telemetry.loader_metrics import loader_figures
from tierflow.telemetry.tier_figures import tier_figures


class RunState:
    """What the view shows, folded from events: the last metrics snapshot and recent batches."""

    def __init__(self, window: int = 50) -> None:
        self.window = window
        self.snapshot: Mapping[str, Any] | None = None
        self.batches: list[Mapping[str, Any]] = []
        self.ended = False
        self.facts: dict[str, Any] = {}

    def fold(self, events: Iterable[Mapping[str, Any]]) -> RunState:
        for event in events:
            kind = event["kind"]
            if kind == "batch":
                self.batches.append(event)
                del self.batches[: -self.window]
            elif kind == "snapshot":
                self.snapshot = event["metrics"]
            elif kind == "start":
                self.facts = {k: v for k, v in event.items() if k not in ("kind", "t")}
            elif kind == "end":
                self.ended = True
        return self

    def batches_per_s(self) -> float:
        if len(self.batches) < 2:
            return 0.0
        span = self.batches[-1]["t"] - self.batches[0]["t"]
        return (len(self.batches) - 1) / span if span > 0 else 0.0


def render(state: RunState) -> Any:
    """A rich renderable of the run's state."""
    from rich.console import Group
    from rich.progress_bar import ProgressBar
    from rich.text import Text

    from tierflow._console import folding_table

    header = Text(
        f"{state.facts.get('name', 'run')}  {state.batches_per_s():.1f} batches/s"
        + ("  (ended)" if state.ended else ""),
        style="bold",
    )
    parts: list[Any] = [header]
    if state.snapshot is None:
        parts.append(Text("waiting for the first metrics snapshot..."))
        return Group(*parts)
    tiers = tier_figures(state.snapshot)
    loader = loader_figures(state.snapshot)
    table = folding_table("tier", "occupancy", "", "hit ratio", "hits", "misses", "evicted unread", "fetch p99")
    for t in tiers.values():
        total = max(t.capacity_bytes, 1)
        table.add_row(
            t.tier,
            ProgressBar(total=total, completed=min(t.occupancy_bytes, total), width=24),
            f"{t.occupancy_bytes / 1e6:.0f}/{t.capacity_bytes / 1e6:.0f} MB",
            f"{t.demand_hit_ratio:.0%}",
            str(t.hits),
            str(t.misses),
            str(t.evictions_before_use),
            f"{t.fetch_p99_s * 1e3:.1f} ms",
        )
    parts.append(table)
    stall = sum(loader.stall_s.values())
    split = "  ".join(f"{k} {v / stall:.0%}" for k, v in sorted(loader.stall_s.items())) if stall else "none"
    parts.append(
        Text(
            f"bubble {loader.bubble_rate:.1%}   production p50 {loader.production_p50_s * 1e3:.1f} ms   "
            f"prefetch depth {loader.prefetch_depth_mean:.1f}   stall split: {split}"
        )
    )
    for flag in health_flags(loader, tiers):
        style = {"ok": "green", "warn": "yellow", "alarm": "red"}[flag.status]
        parts.append(Text(f"[{flag.status}] {flag.message}", style=style))
    return Group(*parts)


def run_top(log: str | Path, refresh_s: float = 1.0, once: bool = False) -> RunState:
    """Follow `log` until the run ends (or once); returns the last state shown."""
    from rich.live import Live

    from tierflow._console import output_console

    state = RunState().fold(read_events(log))
    if once:
        output_console().print(render(state))
        return state
    with Live(render(state), refresh_per_second=max(1, int(1 / refresh_s))) as live:
        while not state.ended:
            time.sleep(refresh_s)
            state = RunState().fold(read_events(log))
            live.update(render(state))
    return state
