"""What a finished pack says: its `PackSummary`, a warning naming the inputs it did not pack, and
with `progress` a live bar while it runs (`PackProgress`) and a summary table at the end."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tierflow.format.manifest import Manifest
from tierflow.pack.units import UnitStats

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

log = logging.getLogger("tierflow.pack")


@dataclass(repr=False)
class PackSummary:
    manifest: Manifest
    seconds: float
    input_bytes: int
    units_packed: int = 0
    """Units this run packed; with `units_resumed`, those an interrupted run had finished."""
    units_resumed: int = 0

    @property
    def mb_per_s(self) -> float:
        return self.input_bytes / 1e6 / max(self.seconds, 1e-9)

    def __repr__(self) -> str:
        """One line (the dataclass's own would print the whole manifest, every shard's block table)."""
        m = self.manifest
        tokens = f", {m.num_tokens:,} tokens" if m.token_column else ""
        skipped = m.stats.get("skipped_records", 0)
        return (
            f"PackSummary(dataset_id={m.dataset_id!r}, {m.num_samples:,} samples{tokens} in {len(m.shards)} "
            f"shards, {sum(s.bytes for s in m.shards) / 1e6:.1f} MB at rest, {self.seconds:.2f} s"
            + (f", {skipped:,} records skipped" if skipped else "")
            + ")"
        )


def skipped_note(totals: UnitStats) -> str:
    skipped = totals.skipped_summary()
    return "; skipped " + describe_skipped(skipped) if skipped else ""


def describe_skipped(skipped: dict[str, dict[str, Any]]) -> str:
    return ", ".join(
        f"{v['count']:,} file{'s' * (v['count'] != 1)} ({reason}, e.g. {v['example']})" for reason, v in skipped.items()
    )


def report(summary: PackSummary, target: str, progress: bool) -> None:
    """Say what was not packed (always: a log warning) and, with progress, the summary table."""
    skipped = summary.manifest.stats.get("skipped_files")
    if skipped:
        log.warning("%s: packed without %s", target, describe_skipped(skipped))
    if progress:
        print_summary(summary, target)


class PackProgress:
    """A rich progress bar (input bytes, files, samples, shards, MB/s, ETA) or nothing."""

    task: TaskID

    def __init__(self, total: int | None, enabled: bool) -> None:
        self.enabled = enabled
        self.total = total
        self.progress: Progress | None = None
        self.started = time.perf_counter()
        self.done = 0

    def __enter__(self) -> PackProgress:
        if self.enabled:
            from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

            self.progress = Progress(
                TextColumn("[bold]pack"),
                BarColumn(),
                TaskProgressColumn(),
                TextColumn("{task.description}"),
                TimeRemainingColumn(),
                transient=False,
            )
            self.progress.start()
            self.task = self.progress.add_task("starting", total=self.total)
        return self

    def advance(self, nbytes: int, totals: UnitStats, shards: int) -> None:
        self.done += nbytes
        if self.progress is not None:
            self.progress.update(self.task, advance=nbytes, description=self._describe(totals, shards))

    def finish(self, totals: UnitStats, shards: int) -> None:
        """The final counts: every shard sealed, and the bar full (the total is known by now)."""
        if self.progress is not None:
            self.progress.update(
                self.task, total=self.done, completed=self.done, description=self._describe(totals, shards)
            )

    def _describe(self, totals: UnitStats, shards: int) -> str:
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        return (
            f"{totals.files:,} files  {totals.samples:,} samples  {shards} shards  {self.done / 1e6 / elapsed:.1f} MB/s"
        )

    def __exit__(self, *exc: Any) -> None:
        if self.progress is not None:
            self.progress.stop()


def print_summary(summary: PackSummary, out: str | os.PathLike) -> None:
    from tierflow._console import folding_table, output_console

    m = summary.manifest
    at_rest = sum(s.bytes for s in m.shards)
    decoded = sum(s.decoded_bytes for s in m.shards)
    table = folding_table("", "", title="packed", show_header=False)
    rows = [
        ("output", str(out)),
        ("dataset id", m.dataset_id),
        ("samples", f"{m.num_samples:,}"),
        (
            "shards",
            f"{len(m.shards)} (at rest {at_rest / 1e6:.1f} MB, decoded {decoded / 1e6:.1f} MB, "
            f"ratio {decoded / max(at_rest, 1):.2f}x)",
        ),
        ("input", f"{summary.input_bytes / 1e6:.1f} MB, {m.stats.get('files', 0):,} files"),
        (
            "time",
            f"{summary.seconds:.2f} s, {summary.mb_per_s:.1f} MB/s, "
            f"{m.stats.get('files', 0) / max(summary.seconds, 1e-9):,.0f} files/s",
        ),
    ]
    if summary.units_resumed:
        rows.append(
            (
                "resumed",
                f"{summary.units_resumed:,} units an interrupted run had packed, {summary.units_packed:,} packed now",
            )
        )
    if m.token_column:
        rows.append(("tokens", f"{m.num_tokens:,} ({m.token_dtype}, {(m.tokenizer or {}).get('name')})"))
    if m.stats.get("sidecars"):
        rows.append(("sidecars", f"{m.stats['sidecars']:,} caption files, read with their images"))
    if m.stats.get("kept_as_bytes"):
        rows.append(("kept as bytes", f"{m.stats['kept_as_bytes']:,} (not valid UTF-8)"))
    if m.stats.get("skipped_records"):
        reasons = m.stats.get("skipped_records_by_reason") or {}
        rows.append(
            (
                "skipped",
                f"{m.stats['skipped_records']:,} record{'s' * (m.stats['skipped_records'] != 1)}"
                + (
                    " ("
                    + ", ".join(f"{v['count']:,} {reason}, e.g. {v['example']}" for reason, v in reasons.items())
                    + ")"
                    if reasons
                    else ""
                ),
            )
        )
    if m.stats.get("skipped_files"):
        rows.append(("skipped files", describe_skipped(m.stats["skipped_files"])))
    for k, v in rows:
        table.add_row(k, v)
    output_console().print(table)
