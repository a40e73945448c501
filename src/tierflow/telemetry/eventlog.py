"""The per-run event log: one JSON object per line, appended as the run goes, read by `report` and `top`.

Events: {"kind": "start", ...run facts}, {"kind": "batch", "i", "t", "wait_s", "step_s",
"depth", "produce_s", "fetch"} for each batch the loop took, {"kind": "stage", "t", "shard", "name",
"first_use", "began", "served_by"} for each transfer the stager made (tiers/stager.py), {"kind":
"snapshot", "t", "metrics", "machine"} (disk and network bytes/s, GPU utilisation when NVML is there)
with the whole metrics snapshot every `snapshot_every_s`, and {"kind": "end", ...summary}. Times are
seconds since the log started. A line is flushed when written, so a live reader sees it at once.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any
from collections.abc import Iterator, Mapping

from tierflow.telemetry.health import MachineView
from tierflow.telemetry.metrics import MetricsRegistry


class EventLog:
    """Append-only JSONL writer for one run; thread-safe."""

    def __init__(
        self, path: str | Path, registry: MetricsRegistry | None = None, snapshot_every_s: float = 1.0, **run_facts: Any
    ) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.registry = registry
        self.snapshot_every_s = snapshot_every_s
        self._file = open(self.path, "w", encoding="utf-8")
        self._lock = threading.Lock()
        self._started = time.perf_counter()
        self._last_snapshot = -float("inf")
        self._machine = MachineView()
        self._machine.sample()  # the baseline the first snapshot's rates are taken against
        self.write("start", wall_time=time.time(), **run_facts)

    def elapsed(self) -> float:
        return time.perf_counter() - self._started

    def write(self, kind: str, **fields: Any) -> None:
        line = json.dumps({"kind": kind, "t": self.elapsed(), **fields}, default=_plain)
        with self._lock:
            if not self._file.closed:
                self._file.write(line + "\n")
                self._file.flush()

    def batch(
        self,
        index: int,
        wait_s: float,
        step_s: float | None,
        depth: int | None,
        produce_s: float | None,
        fetch: Mapping[str, Any] | None,
    ) -> None:
        """One batch's record (`produce_s` and `fetch` as its meta holds them), then a metrics snapshot when
        one is due."""
        self.write(
            "batch",
            i=index,
            wait_s=wait_s,
            step_s=step_s,
            depth=depth,
            produce_s=produce_s,
            fetch=None if produce_s is None else fetch or {},
        )
        if self.registry is not None and self.elapsed() - self._last_snapshot >= self.snapshot_every_s:
            self.snapshot()

    def snapshot(self) -> None:
        if self.registry is not None:
            self._last_snapshot = self.elapsed()
            # the machine's own view (disk, network, GPU) on the same timeline as the data path
            self.write("snapshot", metrics=self.registry.snapshot(), machine=self._machine.sample())

    def close(self, **summary: Any) -> None:
        if self._file.closed:
            return
        self.snapshot()
        self.write("end", **summary)
        with self._lock:
            self._file.close()

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def read_events(path: str | Path) -> Iterator[dict[str, Any]]:
    """The events of a log; a partly written last line (a live run) is skipped."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.endswith("\n"):
                return
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not a JSON event ({e})") from None


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "__dataclass_fields__"):
        from dataclasses import asdict

        return asdict(value)
    raise TypeError(f"event field of type {type(value).__name__} is not JSON-able")
