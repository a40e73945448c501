"""What makes a checkpoint step trustworthy: per-rank part manifests and one commit marker.

A step directory `step-00000042/` holds the files the training code wrote (DCP's `.metadata`
and `*.distcp`, or anything else), one part manifest per rank (`tierflow-part-R.json`: every
file of that rank's part with its size and xxh3-128) and, once every rank's part is in place,
the commit marker (`tierflow-commit.json`: the world size and each part manifest's hash).
Writers put a part manifest after its files and the marker after every part, so a step whose
marker is absent, or whose files do not match, is never resumed from. The same layout is used
locally and at the destination, so one verifier serves both.

A step is bound to its name: the marker and every part manifest record the step (and a part its
rank), the marker records each part manifest's hash, and verification compares the recorded step
with the name the step was found under, so a step copied or moved under another name (an rsync
or a restore gone wrong) is refused. Local manifests and files are opened only when they are
regular files (O_NONBLOCK, then fstat: a FIFO never blocks a reader), and every I/O error of a
commit is a CheckpointError naming its file.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterable, Iterator

import xxhash

from tierflow.errors import CheckpointError, TierflowError
from tierflow.format._atomic import write_atomically
from tierflow.format._regular import open_regular, read_regular

STEP_PREFIX = "step-"
COMMIT_NAME = "tierflow-commit.json"
PART_PATTERN = re.compile(r"^tierflow-part-(\d+)\.json$")
STEP_PATTERN = re.compile(r"^step-(\d{8,})$")
FORMAT = "tierflow-checkpoint/1"
HASH_CHUNK = 8 << 20
MANIFEST_MAX_BYTES = 256 << 20
"""The largest marker or part manifest read (a part lists every file: ~100 bytes each)."""


def step_name(step: int) -> str:
    """The directory (or object prefix) of a step: zero-padded so names sort as numbers."""
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    return f"{STEP_PREFIX}{step:08d}"


def part_name(rank: int) -> str:
    return f"tierflow-part-{rank}.json"


def parse_step(name: str) -> int | None:
    """The step of a committed-or-not step directory name, None for anything else (temporaries)."""
    match = STEP_PATTERN.match(name)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class FileEntry:
    """One file of a part: its path relative to the step directory, size and xxh3-128."""

    name: str
    size: int
    xxh3: str


def hash_file(path: Path) -> str:
    """xxh3-128 of a local file, streamed (checkpoint files can be larger than RAM)."""
    h = xxhash.xxh3_128()
    with open(open_regular(path, CheckpointError), "rb") as f:  # a FIFO or directory: refused, never waited on
        while block := f.read(HASH_CHUNK):
            h.update(block)
    return h.hexdigest()


def read_manifest(path: Path) -> bytes:
    """A local marker or part manifest: a regular file of at most MANIFEST_MAX_BYTES, else a
    CheckpointError naming it (FileNotFoundError passes through)."""
    return read_regular(path, MANIFEST_MAX_BYTES, CheckpointError)


def named(exc: OSError, path: str | os.PathLike[str]) -> CheckpointError:
    """`exc` (e.g. ENOSPC from a write, which names no file) as a CheckpointError naming `path`;
    it keeps the errno, so code testing `errno == ENOSPC` still works."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    code = f" ({errno.errorcode.get(exc.errno, exc.errno)})" if exc.errno else ""
    error = CheckpointError(os.fspath(path), f"{reason}{code}")
    error.errno = exc.errno  # not strerror: OSError.__str__ would then drop the message naming the file
    return error


@contextmanager
def naming(path: str | os.PathLike[str]) -> Iterator[None]:
    """Re-raise a bare OSError of the block as a CheckpointError naming `path` (its own file
    name, when the error has one)."""
    try:
        yield
    except TierflowError:
        raise
    except OSError as exc:
        raise named(exc, exc.filename or path) from exc


def part_files(root: Path, exclude: Iterable[str] = ()) -> list[FileEntry]:
    """Every regular file under `root` except tierflow's own manifests, hashed, sorted by name."""
    skip = set(exclude)
    entries = []
    for directory, _, files in os.walk(root):
        for file in files:
            path = Path(directory, file)
            rel = path.relative_to(root).as_posix()
            if rel in skip or rel == COMMIT_NAME or PART_PATTERN.match(rel):
                continue
            entries.append(FileEntry(rel, path.stat().st_size, hash_file(path)))
    return sorted(entries, key=lambda e: e.name)


def encode_part(step: int, rank: int, files: list[FileEntry]) -> bytes:
    body = {
        "format": FORMAT,
        "step": step,
        "rank": rank,
        "files": [{"name": f.name, "size": f.size, "xxh3": f.xxh3} for f in files],
    }
    return json.dumps(body, indent=1, sort_keys=True).encode()


def encode_commit(step: int, part_hashes: dict[int, str]) -> bytes:
    """The commit marker: the world size and the xxh3-128 of each rank's part manifest."""
    body = {
        "format": FORMAT,
        "step": step,
        "world_size": len(part_hashes),
        "parts": {str(r): h for r, h in sorted(part_hashes.items())},
    }
    return json.dumps(body, indent=1, sort_keys=True).encode()


def decode(raw: bytes, where: str) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than the parser goes
        raise CheckpointError(where, f"not JSON ({exc})") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise CheckpointError(where, f"not a {FORMAT} manifest")
    return body


def part_entries(body: dict[str, Any], where: str) -> list[FileEntry]:
    try:
        entries = [FileEntry(str(f["name"]), int(f["size"]), str(f["xxh3"])) for f in body["files"]]
    except (KeyError, TypeError, ValueError, OverflowError):
        raise CheckpointError(where, "part manifest without a valid file list") from None
    for entry in entries:  # the step's own files only: never one above it, or anywhere else
        parts = entry.name.split("/")
        if entry.name.startswith("/") or "\\" in entry.name or any(p in ("", ".", "..") for p in parts):
            raise CheckpointError(where, f"names {entry.name!r}, which is not a file inside the step")
    return entries


@dataclass(frozen=True)
class StepReport:
    """What verifying one step found: its files, and each problem naming the file."""

    step: int
    files: list[FileEntry]
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)


def verify_step(
    step: int,
    read: Callable[[str], bytes],
    sized: Callable[[str], int | None],
    hashed: Callable[[str], str] | None,
    where: str,
) -> StepReport:
    """Check a step through three accessors (local files or a remote source): the marker, each
    part manifest against the marker, each file's size and (with `hashed`) its xxh3-128.

    `read(name)` returns bytes or raises FileNotFoundError; `sized(name)` the size or None."""
    problems: list[str] = []
    files: list[FileEntry] = []
    try:
        marker = decode(read(COMMIT_NAME), f"{where}/{COMMIT_NAME}")
    except FileNotFoundError:
        return StepReport(step, [], [f"{where}/{COMMIT_NAME}: missing (step not committed)"])
    except CheckpointError as exc:
        return StepReport(step, [], [str(exc)])
    if marker.get("step") != step:
        return StepReport(
            step,
            [],
            [
                f"{where}/{COMMIT_NAME}: records step {marker.get('step')!r}, found under "
                f"{step_name(step)} (a step copied or moved under another name); refused"
            ],
        )
    parts = marker.get("parts", {})
    if not isinstance(parts, dict) or len(parts) != marker.get("world_size"):
        return StepReport(step, [], [f"{where}/{COMMIT_NAME}: parts do not match world_size"])
    if not all(isinstance(r, str) and r.isdecimal() for r in parts):
        return StepReport(step, [], [f"{where}/{COMMIT_NAME}: a part's rank is not a number"])
    for rank, expected in sorted(parts.items(), key=lambda kv: int(kv[0])):
        name = part_name(int(rank))
        try:
            raw = read(name)
        except FileNotFoundError:
            problems.append(f"{where}/{name}: missing")
            continue
        except CheckpointError as exc:
            problems.append(str(exc))
            continue
        if xxhash.xxh3_128_hexdigest(raw) != expected:
            problems.append(f"{where}/{name}: does not match the commit marker")
            continue
        try:
            body = decode(raw, f"{where}/{name}")
            entries = part_entries(body, f"{where}/{name}")
        except CheckpointError as exc:
            problems.append(str(exc))
            continue
        if body.get("step") != step or body.get("rank") != int(rank):
            problems.append(
                f"{where}/{name}: records step {body.get('step')!r} rank {body.get('rank')!r}, found "
                f"under {step_name(step)} as rank {int(rank)}; refused"
            )
            continue
        for entry in entries:
            files.append(entry)
            try:
                size = sized(entry.name)
                if size is None:
                    problems.append(f"{where}/{entry.name}: missing")
                elif size != entry.size:
                    problems.append(f"{where}/{entry.name}: is {size} bytes, manifest says {entry.size}")
                elif hashed is not None and hashed(entry.name) != entry.xxh3:
                    problems.append(f"{where}/{entry.name}: checksum mismatch (xxh3 {entry.xxh3} expected)")
            except FileNotFoundError:
                problems.append(f"{where}/{entry.name}: missing")
            except CheckpointError as exc:
                problems.append(str(exc))
    return StepReport(step, files, problems)


def verify_local(step_dir: Path, step: int, deep: bool = True) -> StepReport:
    """`verify_step` on a local step directory."""

    def read(name: str) -> bytes:
        try:
            return read_manifest(step_dir / name)
        except FileNotFoundError:
            raise
        except NotADirectoryError:  # the step "directory" is a file
            raise FileNotFoundError(str(step_dir / name)) from None
        except TierflowError:
            raise
        except OSError as exc:
            raise named(exc, step_dir / name) from None

    def sized(name: str) -> int | None:
        path = step_dir / name
        try:
            info = path.stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise named(exc, path) from None
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointError(str(path), "not a regular file; refused")
        return info.st_size

    def hashed(name: str) -> str:
        with naming(step_dir / name):
            return hash_file(step_dir / name)

    return verify_step(step, read, sized, hashed if deep else None, str(step_dir))


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (renames, new files) durable."""
    with naming(path):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def fsync_file(path: Path) -> None:
    with naming(path):
        fd = open_regular(path, CheckpointError)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_durably(path: Path, data: bytes) -> None:
    """Write a small file whole or not at all (format/_atomic.py); an I/O error (a full disk) is
    a CheckpointError naming `path`, and leaves no temporary."""
    with naming(path):
        write_atomically(path, data)
