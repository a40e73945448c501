"""Checkpoint steps at a destination (s3://, a shared directory, any fsspec URL): list, verify,
delete and retention, through storage/remote.py's sources so retries, the bandwidth budget and
request counts are the same as for shards. Used by the uploader process, the store and the CLI.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any
from collections.abc import Iterable

import xxhash

from tierflow.checkpoint.manifest import COMMIT_NAME, HASH_CHUNK, StepReport, parse_step, step_name, verify_step
from tierflow.storage.remote import RetryingStore, open_store
from tierflow.errors import CheckpointError, SourceError, SourceNotFound


def open_dest(dest: str | Path, endpoint_url: str | None = None, budget: Any = None) -> RetryingStore:
    """The destination as a source; a local directory is created so it can be listed at once."""
    text = str(dest)
    if "://" not in text or text.startswith("file://"):
        Path(text.removeprefix("file://")).mkdir(parents=True, exist_ok=True)
    return open_store(text, endpoint_url=endpoint_url, budget=budget)


def remote_steps(source: RetryingStore) -> dict[int, bool]:
    """Every step with any object at the destination -> whether its commit marker is there."""
    steps: dict[int, bool] = {}
    for name in source.list(""):
        head, _, tail = name.partition("/")
        step = parse_step(head)
        if step is None or not tail:
            continue
        steps[step] = steps.get(step, False) or tail == COMMIT_NAME
    return steps


def verify_remote(source: RetryingStore, step: int, deep: bool = True) -> StepReport:
    """`verify_step` at the destination; `deep` streams every file through xxh3 (reads it all).
    An object that cannot be read (a 403, 503s past the retries, a deadline) is a problem of the
    report naming it, as a damaged one is: the caller falls back past the step."""
    prefix = step_name(step)
    where = f"{source.url.rstrip('/')}/{prefix}"

    def unreadable(name: str, exc: SourceError) -> CheckpointError:
        return CheckpointError(f"{where}/{name}", f"unreadable ({exc.reason or exc})")

    def read(name: str) -> bytes:
        try:
            return source.read_bytes(f"{prefix}/{name}")
        except SourceNotFound as exc:
            raise FileNotFoundError(str(exc)) from None
        except SourceError as exc:
            raise unreadable(name, exc) from None

    def sized(name: str) -> int | None:
        try:
            return source.size(f"{prefix}/{name}")
        except SourceNotFound:
            return None
        except SourceError as exc:
            raise unreadable(name, exc) from None

    def hashed(name: str) -> str:
        key = f"{prefix}/{name}"
        h = xxhash.xxh3_128()
        try:
            size = source.size(key)
            for offset in range(0, size, HASH_CHUNK):
                h.update(source.read_range(key, offset, min(HASH_CHUNK, size - offset)))
        except SourceNotFound:
            raise FileNotFoundError(key) from None
        except SourceError as exc:
            raise unreadable(name, exc) from None
        return h.hexdigest()

    return verify_step(step, read, sized, hashed if deep else None, where)


def delete_objects(source: RetryingStore, names: Iterable[str]) -> int:
    """Delete objects of a source (retention is the only deleter of checkpoints)."""
    names = list(names)
    for name in names:
        source.delete(name)
    return len(names)


def delete_step(source: RetryingStore, step: int) -> int:
    """Remove a step at the destination: its marker first, so it stops being a checkpoint before
    any of its files go."""
    prefix = f"{step_name(step)}/"
    names = source.list(prefix)
    marker = [n for n in names if n == prefix + COMMIT_NAME]
    delete_objects(source, marker)
    return delete_objects(source, [n for n in names if n not in marker]) + len(marker)


def retained(
    committed: Iterable[int], keep_last: int | None, keep_every: int | None, floor: int | None = None
) -> set[int]:
    """The committed steps retention keeps: the newest `keep_last`, every multiple of `keep_every`,
    and every step older than `floor` (the newest step a `latest()` skipped as damaged: the steps
    a run fell back to are never deleted because a damaged one counts among the newest)."""
    ordered = sorted(committed)
    keep = set(ordered[-keep_last:]) if keep_last else set(ordered)
    if keep_every:
        keep |= {s for s in ordered if s % keep_every == 0}
    if floor is not None:
        keep |= {s for s in ordered if s < floor}
    return keep


def prune_remote(
    source: RetryingStore, keep_last: int | None, keep_every: int | None, floor: int | None = None
) -> list[int]:
    """Apply retention at the destination: committed steps outside the kept set, and leftovers
    of uploads that never committed and are older than the newest committed step (never one
    older than `floor`: see `retained`). Returns the steps removed."""
    steps = remote_steps(source)
    committed = [s for s, done in steps.items() if done]
    if not committed:
        return []
    keep = retained(committed, keep_last, keep_every, floor)
    newest = max(committed)
    doomed = [
        s
        for s, done in steps.items()
        if (done and s not in keep) or (not done and s < newest and (floor is None or s >= floor))
    ]
    for step in sorted(doomed):
        delete_step(source, step)
    return sorted(doomed)


def prune_local(
    local: Path, source: RetryingStore | None, keep_last: int | None, keep_every: int | None, floor: int | None = None
) -> list[int]:
    """Local retention: drop committed steps outside the kept set once the destination has them
    or has gone past them (older than every step committed there: retention dropped them there
    first, as the uploader prunes the destination before this), and uncommitted leftovers older
    than the newest committed step. A step still waiting for its upload is never dropped (the
    uploads go in order: one older than every committed step at the destination is done).
    `source` None: there is no destination, the local copies are all."""
    if not local.is_dir():
        return []
    remote = {s for s, done in remote_steps(source).items() if done} if source is not None else None
    present = {}
    for child in local.iterdir():
        step = parse_step(child.name)
        if step is not None and child.is_dir():
            present[step] = (child / COMMIT_NAME).is_file()
    committed = [s for s, done in present.items() if done]
    if not committed:
        return []
    keep = retained(committed, keep_last, keep_every, floor)
    newest = max(committed)
    passed = min(remote) if remote else None

    def uploaded(s: int) -> bool:
        return remote is None or s in remote or (passed is not None and s < passed)

    doomed = [
        s
        for s, done in present.items()
        if (done and s not in keep and uploaded(s)) or (not done and s < newest and (floor is None or s >= floor))
    ]
    for step in doomed:
        shutil.rmtree(local / step_name(step), ignore_errors=True)
    return sorted(doomed)
