"""The dataset verbs (inspect, verify, gc) and the dataset constructors on every URL build_stack
takes, and gc's refusals: against the loopback S3 server and real directories."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import tierflow
from tierflow.commands.cli import main


def pack_rows(tmp_path: Path, n: int = 3000) -> Path:
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps({"text": f"doc {i} " + "lorem " * (i % 40), "i": i}) + "\n" for i in range(n)))
    out = tmp_path / "ds"
    tierflow.pack([src], out, workers=1, target_shard_bytes=256 << 10, block_bytes=64 << 10)
    return out


# gc refuses what is not a dataset


def test_gc_on_a_folder_that_is_not_a_dataset_refuses_and_writes_nothing(tmp_path, capsys):
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "holiday.jpg").write_bytes(b"\xff\xd8")
    assert main(["gc", str(folder)]) != 0
    err = capsys.readouterr().err
    assert str(folder) in err and "manifest.json" in err
    assert sorted(p.name for p in folder.iterdir()) == ["holiday.jpg"]


def test_gc_on_a_missing_folder_refuses_and_creates_nothing(tmp_path, capsys):
    assert main(["gc", str(tmp_path / "nope")]) != 0
    assert str(tmp_path / "nope") in capsys.readouterr().err
    assert not (tmp_path / "nope").exists()
