"""`open_loader(events=PATH)`: a user's own loop writes the event log `tierflow top` and `tierflow report` read."""

from __future__ import annotations

import json
from pathlib import Path

import tierflow
from tierflow.commands.top import run_top
from tierflow.testing.faults import write_corpus


def test_a_loop_over_open_loader_writes_the_log_top_and_report_read(tmp_path: Path) -> None:
    data = tmp_path / "ds"
    tierflow.pack([write_corpus(tmp_path / "corpus.jsonl", 400, seed=0)], data, workers=1, target_shard_bytes=256 << 10)
    log = tmp_path / "run.jsonl"
    with tierflow.open_loader(data, batch_size=8, events=log, tiers=[f"L2={tmp_path / 'l2'}:50%"]) as loader:
        handed = sum(1 for _ in loader)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    kinds = [r["kind"] for r in records]
    assert kinds[0] == "start" and kinds[-1] == "end"
    assert kinds.count("batch") == handed == len(loader)
    assert "stage" in kinds  # the stager's transfers land in the same log
    assert records[-1]["batches"] == handed
    state = run_top(log, once=True)
    assert state.ended
