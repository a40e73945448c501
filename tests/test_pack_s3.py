"""`pack(..., out="s3://...")` against the loopback S3 server (issue 13, the summary and
progress items of "the first batch")."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

import tierflow

SMALL = 256 << 10


def write_docs(path: Path, n: int) -> Path:
    rng = np.random.default_rng(5)
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"text": rng.bytes(int(rng.integers(50, 400))).hex(), "i": i}) + "\n")
    return path


def test_the_summary_names_the_url_and_the_progress_bar_ends_full(tmp_path, s3_server, s3_bucket, capsys):
    src = write_docs(tmp_path / "docs.jsonl", 3_000)
    url = f"s3://{s3_bucket}/ds"
    m = tierflow.pack([src], url, workers=1, target_shard_bytes=SMALL, endpoint_url=s3_server.endpoint_url,
                      progress=True).manifest
    out = capsys.readouterr().out
    assert f"packed {url}" in out and "tierflow-pack-" not in out
    bar = next(line for line in out.splitlines() if line.startswith("pack "))
    assert "100%" in bar and f"{m.num_samples:,} samples" in bar and f"{len(m.shards)} shards" in bar
