"""Bringing a committed step back from the destination: every file streamed into a locked
temporary and hashed as it arrives (one read), checked against the step's part manifests, then
renamed over the local copy, so a step is never half here."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import xxhash

from tierflow.checkpoint.manifest import (
    COMMIT_NAME,
    CheckpointError,
    decode,
    fsync_dir,
    fsync_file,
    naming,
    part_entries,
    part_name,
    step_name,
    verify_local,
    write_durably,
)
from tierflow.checkpoint.remote import verify_remote
from tierflow.checkpoint.temporaries import Temporaries
from tierflow.errors import SourceError


def download_step(source: Any, step: int, final: Path, temporaries: Temporaries) -> Path:
    """Copy `step` from `source` to `final` (in `temporaries`' directory), hashing each file as it
    streams, into a locked temporary, then rename it over the local copy. CheckpointError naming
    the first file that is missing, unreadable or does not match."""
    local = temporaries.local
    prefix = step_name(step)
    where = f"{source.url.rstrip('/')}/{prefix}"
    report = verify_remote(source, step, deep=False)
    if not report.ok:
        raise CheckpointError(where, "; ".join(report.problems))
    tmp = temporaries.make(local / f".tmp-load-{prefix}-{os.getpid()}")
    try:
        marker_raw = _read_remote(source, f"{prefix}/{COMMIT_NAME}", where)
        marker = decode(marker_raw, f"{where}/{COMMIT_NAME}")
        for rank in sorted(int(r) for r in marker["parts"]):
            raw = _read_remote(source, f"{prefix}/{part_name(rank)}", where)
            for entry in part_entries(decode(raw, f"{where}/{part_name(rank)}"), f"{where}/{part_name(rank)}"):
                target = tmp / entry.name
                with naming(target):
                    target.parent.mkdir(parents=True, exist_ok=True)
                    digest = _download_hashed(source, f"{prefix}/{entry.name}", target, entry.size, where)
                if digest != entry.xxh3:
                    raise CheckpointError(f"{where}/{entry.name}", f"checksum mismatch (xxh3 {entry.xxh3} expected)")
            write_durably(tmp / part_name(rank), raw)
        write_durably(tmp / COMMIT_NAME, marker_raw)
        check = verify_local(tmp, step, deep=False)  # what was written is the step verified above
        if not check.ok:
            raise CheckpointError(where, "; ".join(check.problems))
        for directory, _, files in os.walk(tmp):
            for file in files:
                fsync_file(Path(directory, file))
            fsync_dir(Path(directory))
        with naming(final):
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
        fsync_dir(local)
    finally:
        temporaries.remove(tmp)
    return final


def _read_remote(source: Any, name: str, where: str) -> bytes:
    try:
        return source.read_bytes(name)
    except SourceError as exc:
        raise CheckpointError(f"{where}/{name.rsplit('/', 1)[-1]}", f"unreadable ({exc.reason or exc})") from None


def _download_hashed(source: Any, name: str, target: Path, size: int, where: str) -> str:
    """Stream one object to `target`, hashing the bytes as they arrive; its xxh3-128."""
    digest = xxhash.xxh3_128()
    with open(target, "wb") as out:

        def write(chunk: Any) -> None:
            out.write(chunk)
            digest.update(chunk)

        try:
            source.read_into(name, write, size, priority="high")
        except SourceError as exc:
            raise CheckpointError(f"{where}/{name.split('/', 1)[-1]}", f"unreadable ({exc.reason or exc})") from None
        out.flush()
        os.fsync(out.fileno())
    return digest.hexdigest()
