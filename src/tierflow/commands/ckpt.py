"""`tierflow ckpt ls|verify|prune DEST`: look after a run's checkpoints at their destination.

Works on the destination alone (s3://, a directory, an fsspec URL), the way an operator meets
it after a job died: which steps are committed, whether their bytes still match, and retention.
With `--local DIR` (a node's local checkpoint directory), `ls` also shows the steps committed
there that the destination lacks or holds incomplete (`local-only`: a store opened on that
directory uploads them again).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def add_ckpt_parser(sub: Any) -> None:
    """The `ckpt` verb's arguments (called from commands/cli.py's build_parser)."""
    p = sub.add_parser("ckpt", help="list, verify or prune the checkpoints at a destination")
    p.add_argument(
        "action",
        choices=("ls", "verify", "prune"),
        help="list steps (committed or not), check every checksum of committed steps, or apply retention",
    )
    p.add_argument("dest", help="checkpoint destination: s3://bucket/prefix, a directory or an fsspec URL")
    p.add_argument("--endpoint-url", help="S3-compatible endpoint for s3:// destinations")
    p.add_argument(
        "--local",
        help="ls: a node's local checkpoint directory, to show the steps committed there "
        "that are not (whole) at the destination",
    )
    p.add_argument(
        "--step",
        type=int,
        action="append",
        default=[],
        help="verify only this step (repeatable; default: every committed step)",
    )
    p.add_argument("--shallow", action="store_true", help="verify sizes only, without reading every byte through xxh3")
    p.add_argument("--keep-last", type=int, default=3, help="prune: committed steps to keep, newest first (3)")
    p.add_argument(
        "--keep-every",
        type=int,
        default=None,
        help="prune: also keep every step that is a multiple of this (default: none)",
    )


def run_ckpt(args: argparse.Namespace) -> int:
    """Run `tierflow ckpt ACTION DEST`; exit 1 when verify finds a bad step."""
    from tierflow.checkpoint.manifest import COMMIT_NAME, decode, part_entries, step_name
    from tierflow.checkpoint.remote import open_dest, prune_remote, remote_steps, verify_remote

    source = open_dest(args.dest, args.endpoint_url)
    steps = remote_steps(source)
    if args.action == "ls":
        local_only = _local_only(args.local, source, steps) if args.local else {}
        print(f"{'step':>10}  {'state':<10} {'parts':>5} {'files':>6} {'bytes':>14}")
        for step in sorted(set(steps) | set(local_only)):
            if step in local_only:
                files, size = local_only[step]
                print(f"{step:>10}  {'local-only':<10} {1:>5} {files:>6} {size:>14,}")
                continue
            done = steps[step]
            parts, files, size = _summary(source, step, done, decode, part_entries, step_name, COMMIT_NAME)
            print(f"{step:>10}  {'committed' if done else 'incomplete':<10} {parts:>5} {files:>6} {size:>14,}")
        committed = sum(done for s, done in steps.items() if s not in local_only)
        incomplete = sum(not done for s, done in steps.items() if s not in local_only)
        tail = f", {len(local_only)} local-only (in {args.local})" if args.local else ""
        print(f"{args.dest}: {committed} committed, {incomplete} incomplete{tail}")
        return 0
    if args.action == "verify":
        chosen = args.step or sorted(s for s, done in steps.items() if done)
        bad = 0
        for step in chosen:
            report = verify_remote(source, step, deep=not args.shallow)
            if report.ok:
                print(f"{step_name(step)}: {len(report.files)} files, {report.bytes:,} bytes: all checksums match")
            else:
                bad += 1
                for problem in report.problems:
                    print(problem, file=sys.stderr)
        if bad:
            print(f"{args.dest}: {bad} of {len(chosen)} step(s) do not verify", file=sys.stderr)
        return 1 if bad else 0
    removed = prune_remote(source, args.keep_last, args.keep_every)
    print(json.dumps({"dest": args.dest, "removed_steps": removed}))
    return 0


def _local_only(local: str, source: Any, steps: dict[int, bool]) -> dict[int, tuple[int, int]]:
    """Steps committed in `local` whose copy at the destination is missing, uncommitted or not
    whole (sizes checked) -> (files, bytes) of the local copy."""
    from pathlib import Path

    from tierflow.checkpoint.manifest import parse_step, step_name, verify_local
    from tierflow.checkpoint.remote import verify_remote

    found: dict[int, tuple[int, int]] = {}
    root = Path(local)
    for child in sorted(root.iterdir()) if root.is_dir() else []:
        step = parse_step(child.name)
        if step is None or not child.is_dir():
            continue
        report = verify_local(root / step_name(step), step, deep=False)
        if not report.ok:
            continue
        if steps.get(step) and verify_remote(source, step, deep=False).ok:
            continue
        found[step] = (len(report.files), report.bytes)
    return found


def _summary(
    source: Any, step: int, done: bool, decode: Any, part_entries: Any, step_name: Any, commit_name: str
) -> tuple[int, int, int]:
    """(parts, files, bytes) of a step from its part manifests; zeros where none is readable."""
    prefix = step_name(step)
    names = [n for n in source.list(f"{prefix}/") if n.rsplit("/", 1)[-1].startswith("tierflow-part-")]
    files = size = 0
    for name in names:
        entries = part_entries(decode(source.read_bytes(name), name), name)
        files += len(entries)
        size += sum(e.size for e in entries)
    return len(names), files, size
