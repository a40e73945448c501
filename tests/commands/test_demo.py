"""README's main job, end to end at a reduced size: pack, three epochs through the tiers, training."""

from __future__ import annotations

import json

import pytest

from tierflow.commands.demo import run_demo
from tierflow.telemetry.eventlog import read_events


@pytest.mark.slow
def test_demo_runs_end_to_end_at_a_reduced_size(tmp_path):
    result = run_demo(
        tmp_path / "demo", max_files=120, step_ms=2.0, epochs=2, train_steps=30, bandwidth=20e6, seq_len=256
    )
    assert result["samples"] == 120 and result["shards"] >= 2
    assert len(result["per_epoch_bytes"]) == 2 and result["per_epoch_bytes"][0] > 0
    assert len(result["losses"]) == 30 and result["losses"][-1] < result["losses"][0]
    assert 0 < result["ratio"] <= 1.5
    events = list(read_events(tmp_path / "demo" / "run.jsonl"))
    assert any(e.get("kind") == "batch" for e in events)
    assert (tmp_path / "demo" / "report.png").stat().st_size > 0
    json.dumps(result)  # the summary is plain data


DEMO = (
    "import sys; from tierflow.commands.demo import run_demo; run_demo(sys.argv[1], max_files=60, step_ms=2.0, "
    "epochs=1, train_steps=10, bandwidth=float(sys.argv[2]), seq_len=256)"
)


@pytest.mark.slow
def test_demos_with_other_bandwidths_print_no_python_warning(tmp_path):
    import os
    import subprocess
    import sys

    for run, bandwidth in enumerate(("20e6", "30e6")):  # a second job asking for another cap on the node
        done = subprocess.run(
            [sys.executable, "-W", "default", "-c", DEMO, str(tmp_path / f"demo{run}"), bandwidth],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "COLUMNS": "100"},
        )
        assert done.returncode == 0, done.stderr
        assert "Warning" not in done.stderr and "Warning" not in done.stdout, done.stderr + done.stdout
