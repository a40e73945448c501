"""Tables printed into a pipe or a log keep whole paths and ids (rich assumes 80 columns there)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import tierflow


def test_pack_summary_piped_keeps_the_whole_output_path_and_dataset_id(tmp_path: Path) -> None:
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(50)))
    out = tmp_path / ("a-dataset-directory-whose-name-alone-is-longer-than-a-narrow-console-" + "x" * 40)
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    done = subprocess.run(
        [sys.executable, "-m", "tierflow", "pack", str(src), "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    printed = done.stdout + done.stderr
    assert str(out) in printed, printed
    assert "…" not in printed, printed
    assert tierflow.open_dataset(out).manifest.dataset_id in printed
