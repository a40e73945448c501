"""Damaged or hostile commit markers and part manifests, here and at the destination.

A checkpoint's own manifests are its trust anchor: whatever bytes they hold (a flipped byte, a
truncated write, a hand edit, a file named outside the step), `verify` reports a problem naming
the file, `latest` falls back to the step before, and `load` raises CheckpointError; nothing
escapes as an untyped error and nothing is written or read outside the step directory.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any
from collections.abc import Callable

import pytest
import xxhash

from tierflow.checkpoint import COMMIT_NAME, CheckpointError, CheckpointStore, step_name
from tierflow.checkpoint.manifest import part_name

Mutation = Callable[[dict[str, Any], dict[str, Any], Path], tuple[bytes | None, bytes | None]]
SECRET = b"secret"  # a file beside the checkpoint directories, which no manifest may reach


def _json(body: Any) -> bytes:
    return json.dumps(body).encode()


def _rehash(marker: dict[str, Any], part: bytes) -> bytes:
    """The marker again, naming `part`'s hash: a consistent pair, hostile only in its content."""
    return _json({**marker, "parts": {"0": xxhash.xxh3_128_hexdigest(part)}})


def _part_with_files(files: Any) -> Mutation:
    def mutate(marker: dict[str, Any], part: dict[str, Any], root: Path) -> tuple[bytes | None, bytes | None]:
        listed = files(root) if callable(files) else files
        raw = _json({**part, "files": listed})
        return _rehash(marker, raw), raw

    return mutate


def _secret(name: Callable[[Path], str]) -> Callable[[Path], list[dict[str, Any]]]:
    """A part listing the secret file under `name`, with its true size and hash."""
    return lambda root: [{"name": name(root), "size": len(SECRET), "xxh3": xxhash.xxh3_128_hexdigest(SECRET)}]


MUTATIONS: dict[str, Mutation] = {
    "marker not JSON": lambda m, p, r: (b'{"format": ', None),
    "marker nested 100000 deep": lambda m, p, r: (b"[" * 100_000 + b"]" * 100_000, None),
    "marker a list": lambda m, p, r: (_json([m]), None),
    "marker parts not a dict": lambda m, p, r: (_json({**m, "parts": ["x"]}), None),
    "marker rank not a number": lambda m, p, r: (_json({**m, "parts": {"zero": m["parts"]["0"]}}), None),
    "marker rank negative": lambda m, p, r: (_json({**m, "parts": {"-1": m["parts"]["0"]}}), None),
    "marker hash not a string": lambda m, p, r: (_json({**m, "parts": {"0": 7}}), None),
    "marker world_size a string": lambda m, p, r: (_json({**m, "world_size": "1"}), None),
    "part replaced, marker kept": lambda m, p, r: (None, _json({**p, "files": []})),
    "part files not a list": _part_with_files(7),
    "part file entry not a dict": _part_with_files(["model.bin"]),
    "part size not a number": _part_with_files([{"name": "model.bin", "size": "big", "xxh3": "0"}]),
    "part size 1e999": _part_with_files([{"name": "model.bin", "size": 1e999, "xxh3": "0"}]),
    "part names a file above the step": _part_with_files(_secret(lambda root: "../../secret.bin")),
    "part names an absolute path": _part_with_files(_secret(lambda root: str(root / "secret.bin"))),
    "part names the step itself": _part_with_files([{"name": ".", "size": 0, "xxh3": "0"}]),
    "part names a file twice": _part_with_files(lambda root: [{"name": "model.bin", "size": 5000, "xxh3": "0"}] * 2),
}


def _commit(store: CheckpointStore, step: int) -> None:
    directory = store.begin(step)
    (directory / "model.bin").write_bytes(bytes([step]) * 5000)
    store.commit(step)


@pytest.mark.parametrize(
    "where", ["local", pytest.param("dest", marks=pytest.mark.slow)], ids=["local-only", "at-the-destination"]
)
@pytest.mark.parametrize("case", list(MUTATIONS))
def test_a_damaged_or_hostile_manifest_is_refused_naming_it(tmp_path: Path, case: str, where: str) -> None:
    dest, local = (tmp_path / "dest" if where == "dest" else None), tmp_path / "local"
    with CheckpointStore(dest, local, keep_last=None) as store:
        _commit(store, 1)
        _commit(store, 2)
    (tmp_path / "secret.bin").write_bytes(SECRET)
    step_dir = (dest or local) / step_name(2)
    marker = json.loads((step_dir / COMMIT_NAME).read_bytes())
    part = json.loads((step_dir / part_name(0)).read_bytes())
    new_marker, new_part = MUTATIONS[case](marker, part, tmp_path)
    if new_marker is not None:
        (step_dir / COMMIT_NAME).write_bytes(new_marker)
    if new_part is not None:
        (step_dir / part_name(0)).write_bytes(new_part)
    if where == "dest":
        shutil.rmtree(local)  # a fresh node: only the destination has the steps
    fresh = CheckpointStore(dest, local)
    report = fresh.verify(2)
    assert not report.ok and all(step_name(2) in problem for problem in report.problems), report.problems
    assert fresh.latest() == 1
    with pytest.raises(CheckpointError):
        fresh.load(2)
    assert fresh.load(1) == local / step_name(1)
    assert {p.name for p in tmp_path.iterdir()} == {where, "local", "secret.bin"}
    assert (tmp_path / "secret.bin").read_bytes() == SECRET
