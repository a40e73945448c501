"""`tierflow report RUN.jsonl`: a PNG of a run over time: wait vs step, demand hit ratio per tier,
bytes served per tier, prefetch depth, occupancy per tier.

`run_series(events)` extracts the plotted series from the event log (pure); `write_report` plots
exactly those series, and `plotted_series(figure)` reads them back off the figure's lines, so a
test can check that what is drawn is the run's data.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from collections.abc import Iterable, Mapping

from tierflow.telemetry.eventlog import read_events
from tierflow.telemetry.tier_figures import OCCUPANCY, STACK_SOURCE_BYTES, TIER_COUNTERS

Series = dict[str, dict[str, tuple[list[float], list[float]]]]
PANELS = ("wait vs step", "demand hit ratio", "bytes served", "prefetch depth", "occupancy")


def run_series(events: Iterable[Mapping[str, Any]]) -> Series:
    """{panel: {line label: (x, y)}}; batch panels are by batch index, tier panels by seconds."""
    series: Series = {panel: {} for panel in PANELS}

    def point(panel: str, label: str, x: float, y: float) -> None:
        xs, ys = series[panel].setdefault(label, ([], []))
        xs.append(x)
        ys.append(y)

    for event in events:
        if event["kind"] == "batch":
            i = float(event["i"])
            point("wait vs step", "wait (ms)", i, event["wait_s"] * 1e3)
            if event.get("step_s") is not None:
                point("wait vs step", "step (ms)", i, event["step_s"] * 1e3)
            if event.get("depth") is not None:
                point("prefetch depth", "batches ready", i, float(event["depth"]))
        elif event["kind"] == "snapshot":
            t = float(event["t"])
            metrics = event["metrics"]
            hits: dict[str, float] = {}
            misses: dict[str, float] = {}
            for c in metrics["counters"]:
                tier = c["labels"].get("tier")
                if tier is None:
                    continue
                if c["name"] == TIER_COUNTERS["hits"]:
                    hits[tier] = hits.get(tier, 0) + c["value"]
                elif c["name"] == TIER_COUNTERS["misses"]:
                    misses[tier] = misses.get(tier, 0) + c["value"]
                elif c["name"] in (TIER_COUNTERS["bytes_out"], STACK_SOURCE_BYTES):
                    point("bytes served", tier, t, c["value"] / 1e6)
            for tier in sorted(set(hits) | set(misses)):
                asked = hits.get(tier, 0) + misses.get(tier, 0)
                if asked:
                    point("demand hit ratio", tier, t, hits.get(tier, 0) / asked)
            for g in metrics["gauges"]:
                if g["name"] == OCCUPANCY and "tier" in g["labels"]:
                    point("occupancy", g["labels"]["tier"], t, g["value"] / 1e6)
    return series


_AXES = {
    "wait vs step": ("batch", "ms"),
    "demand hit ratio": ("seconds", "hits / requests"),
    "bytes served": ("seconds", "MB (cumulative)"),
    "prefetch depth": ("batch", "batches"),
    "occupancy": ("seconds", "MB"),
}


def plot_series(series: Series, title: str = "") -> Any:
    """A matplotlib Figure with one panel per series group (Agg backend, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 12), layout="constrained")
    axes = figure.subplots(len(PANELS), 1)
    for ax, panel in zip(axes, PANELS):
        ax.set_title(panel)
        xlabel, ylabel = _AXES[panel]
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        for label, (xs, ys) in series[panel].items():
            ax.plot(xs, ys, label=label, linewidth=1)
        if series[panel]:
            ax.legend(loc="best", fontsize="small")
        else:
            ax.text(0.5, 0.5, "no data in this run", ha="center", va="center", transform=ax.transAxes)
    if title:
        figure.suptitle(title)
    return figure


def plotted_series(figure: Any) -> Series:
    """The series drawn on a report figure, read back from its lines."""
    out: Series = {}
    for ax in figure.axes:
        out[ax.get_title()] = {
            line.get_label(): ([float(x) for x in line.get_xdata()], [float(y) for y in line.get_ydata()])
            for line in ax.get_lines()
        }
    return out


def write_report(log: str | Path, png: str | Path | None = None) -> tuple[Path, Any]:
    """Plot the run at `log` into `png` (default: beside it, .png); returns the path and the figure."""
    log = Path(log)
    target = Path(png) if png is not None else log.with_suffix(".png")
    figure = plot_series(run_series(read_events(log)), title=str(log.name))
    figure.savefig(target, dpi=90)
    return target, figure
