"""The background uploader: a separate process that copies committed steps to the destination.

A process, not a thread, so hashing-free but CPU-bound client work (TLS, multipart framing) never
takes the training process's GIL. It reads one JSON job per line on stdin and answers one JSON
line per job on stdout. Every byte goes through the node's bandwidth budget at low priority, so
training reads keep theirs; a step's files go first, its part manifest after them, and (for a
single-rank job) the commit marker last, then retention runs. When its parent dies it finishes
the job in hand and those queued, and exits at end of input: steps committed just before a
crash still arrive (their answers, with no one to read them, are dropped). A job whose step
directory retention already removed (a step re-queued at open that a newer one made redundant)
is answered `ok` with `gone`. Each PUT is bounded by the same deadline as reads (see
storage/_deadline.py), so a silent or trickling peer fails the job instead of hanging it.

    python -m tierflow.checkpoint.uploader     # started by CheckpointStore, not by hand
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from tierflow.checkpoint.manifest import (
    COMMIT_NAME,
    decode,
    parse_step,
    part_entries,
    part_name,
    read_manifest,
    step_name,
)
from tierflow.checkpoint.remote import open_dest, prune_local, prune_remote, retained
from tierflow.storage.budget import BandwidthBudget


def budget_from(spec: dict[str, Any] | None) -> BandwidthBudget | None:
    """The training process's budget, reopened here (the same shared file, so the same bucket)."""
    if not spec or spec.get("rate") is None:
        return None
    return BandwidthBudget(spec["rate"], spec["path"], int(spec["burst"]), reserve=spec["reserve"])


def upload_part(job: dict[str, Any]) -> dict[str, Any]:
    """Copy one rank's part of a step: files, then the part manifest, then (world size 1) the marker."""
    started = time.perf_counter()
    step, rank = int(job["step"]), int(job["rank"])
    step_dir = Path(job["dir"])
    prefix = step_name(step)
    manifest = step_dir / part_name(rank)
    gone = {"step": step, "ok": True, "bytes": 0, "seconds": 0.0, "pruned": [], "gone": True}
    try:
        raw = read_manifest(manifest)
        entries = part_entries(decode(raw, str(manifest)), str(manifest))
        source = open_dest(job["dest"], job.get("endpoint_url"), budget_from(job.get("budget")))
        sent = 0
        for entry in entries:
            source.upload(step_dir / entry.name, f"{prefix}/{entry.name}", priority="low")
            sent += entry.size
        source.upload(manifest, f"{prefix}/{manifest.name}", priority="low")
    except FileNotFoundError:
        # retention dropped the step after the job was queued (a step re-queued at open, newest first,
        # that newer commits have since pushed out of keep_last): nothing to send, and what was sent
        # is a step without its marker, which no reader takes
        if not (step_dir / COMMIT_NAME).exists() or _superseded(step, job):
            return gone
        raise
    pruned: list[int] = []
    if job.get("marker"):
        source.upload(step_dir / COMMIT_NAME, f"{prefix}/{COMMIT_NAME}", priority="low")
        pruned = prune_remote(source, job.get("keep_last"), job.get("keep_every"), job.get("floor"))
        prune_local(Path(job["local"]), source, job.get("keep_last"), job.get("keep_every"), job.get("floor"))
    seconds = time.perf_counter() - started
    return {"step": step, "ok": True, "bytes": sent, "seconds": seconds, "pruned": pruned}


def _superseded(step: int, job: dict[str, Any]) -> bool:
    """Whether local retention keeps `step` no longer: newer committed steps push it out of
    keep_last, so the local copy may be going under the upload (its removal is not atomic)."""
    local = Path(job["local"])
    committed = (
        {
            s
            for s in (parse_step(p.name) for p in local.iterdir())
            if s is not None and (local / step_name(s) / COMMIT_NAME).is_file()
        }
        if local.is_dir()
        else set()
    )
    keep = retained(committed | {step}, job.get("keep_last"), job.get("keep_every"), job.get("floor"))
    return step not in keep


def main() -> int:
    answering = True
    for line in sys.stdin:  # one JSON job a line, as CheckpointStore._submit writes them
        job = json.loads(line)
        try:
            answer = upload_part(job)
        except Exception as exc:
            answer = {
                "step": job.get("step"),
                "ok": False,
                "error": f"{type(exc).__name__}: {exc}",
                "trace": traceback.format_exc(limit=5),
            }
        if answering:
            try:
                print(json.dumps(answer), flush=True)
            except BrokenPipeError:  # the store's process died: no one to answer, the queued jobs still go up
                answering = False
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nor at exit's flush
    return 0


if __name__ == "__main__":
    sys.exit(main())
