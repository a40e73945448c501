"""`pack(..., out="s3://...")` against the loopback S3 server: shards leave the local disk as they
are sealed (bounded staging), the manifest goes last, and the result equals a local pack
(issue 13, defect 4 and the summary/progress items of "the first batch")."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import tierflow
from tierflow.pack._assemble import SHARDS_IN_FLIGHT
from tierflow.pack.tokenize import PackInputError
from tierflow.pack._upload import UPLOADS_IN_FLIGHT

SMALL = 256 << 10
LOCAL_SHARDS_BOUND = 1 + SHARDS_IN_FLIGHT + UPLOADS_IN_FLIGHT
"""The shard being assembled, those sealing, and those uploading: all a remote pack keeps."""


def write_docs(path: Path, n: int) -> Path:
    rng = np.random.default_rng(5)
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"text": rng.bytes(int(rng.integers(50, 400))).hex(), "i": i}) + "\n")
    return path


def objects(s3_server, bucket: str, prefix: str) -> dict[str, bytes]:
    client = s3_server.endpoint.boto3_client()
    listed = client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", [])
    return {o["Key"][len(prefix) + 1 :]: client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read() for o in listed}


class ShardWatcher(threading.Thread):
    """Samples how many shard files (sealed or being written) are under a directory: the peak."""

    def __init__(self, root: Path) -> None:
        super().__init__(daemon=True)
        self.root, self.peak, self.samples = root, 0, 0
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            count = sum(
                1
                for _, _, names in os.walk(self.root)
                for n in names
                if n.endswith(".arrow") and (n.startswith("shard-") or n.startswith(".tmp-"))
            )
            self.peak = max(self.peak, count)
            self.samples += 1
            time.sleep(0.002)

    def __enter__(self) -> ShardWatcher:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        self.join()


@pytest.fixture
def staging(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "staging"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    return root


@pytest.mark.slow
def test_pack_to_s3_keeps_a_few_shards_locally_and_equals_a_local_pack(tmp_path, staging, s3_server, s3_bucket):
    src = write_docs(tmp_path / "docs.jsonl", 14_000)  # ~25 shards: five times what may be held locally
    local = tierflow.pack([src], tmp_path / "local", workers=1, target_shard_bytes=SMALL).manifest
    with ShardWatcher(staging) as watcher:
        remote = tierflow.pack(
            [src], f"s3://{s3_bucket}/ds", workers=2, target_shard_bytes=SMALL, endpoint_url=s3_server.endpoint_url
        ).manifest
    assert len(local.shards) >= 20
    assert 1 <= watcher.peak <= LOCAL_SHARDS_BOUND, (watcher.peak, watcher.samples)
    assert remote.dataset_id == local.dataset_id
    uploaded = objects(s3_server, s3_bucket, "ds")
    on_disk = {p.name: p.read_bytes() for p in (tmp_path / "local").iterdir() if not p.name.startswith(".")}
    assert uploaded.keys() == on_disk.keys()
    assert all(uploaded[name] == on_disk[name] for name in on_disk)  # manifest included
    assert not list(staging.iterdir())


class RaiseAt:
    """A pack fn that fails at one record (or never): the same samples up to there either way."""

    def __init__(self, index: int | None) -> None:
        self.index = index

    def __call__(self, record: dict) -> dict:
        if record["i"] == self.index:
            raise RuntimeError("the pack dies here")
        return record


@pytest.mark.slow
def test_a_pack_to_s3_that_fails_mid_way_publishes_no_manifest_and_its_shards_are_reused(
    tmp_path, staging, s3_server, s3_bucket, s3_proxy
):
    src = write_docs(tmp_path / "docs.jsonl", 12_000)
    url = f"s3://{s3_bucket}/ds"
    with pytest.raises(PackInputError, match="the pack dies here"):
        tierflow.pack(
            [src],
            url,
            fn=RaiseAt(9_000),
            workers=1,
            target_shard_bytes=SMALL,
            chunk_bytes=64 << 10,
            endpoint_url=s3_proxy.url,
        )
    left = objects(s3_server, s3_bucket, "ds")
    assert "manifest.json" not in left
    assert len(left) >= 3, "shards were not uploaded while the pack ran"
    assert not list(staging.iterdir())
    puts_before = s3_proxy.traffic().requests("PUT")
    m = tierflow.pack(
        [src],
        url,
        fn=RaiseAt(None),
        workers=1,
        target_shard_bytes=SMALL,
        chunk_bytes=64 << 10,
        endpoint_url=s3_proxy.url,
    ).manifest
    done = objects(s3_server, s3_bucket, "ds")
    assert {s.name for s in m.shards} | {"manifest.json"} == {k for k in done if not k.startswith("metadata")}
    assert (
        "metadata.json" in done and sum(k.startswith("metadata-") for k in done) == 4
    )  # version 3's tables (shards, blocks, layout, block chunks)
    assert set(left) <= set(done)
    assert s3_proxy.traffic().requests("PUT") - puts_before == len(done) - len(left)  # left shards not resent


KILL_SCRIPT = """
import sys, time, tierflow
def slow(r):
    time.sleep(0.0005)
    return r
tierflow.pack([sys.argv[1]], sys.argv[2], fn=slow, workers=1, target_shard_bytes=256 << 10,
              chunk_bytes=64 << 10, endpoint_url=sys.argv[3])
"""


@pytest.mark.slow
def test_a_pack_to_s3_killed_mid_way_leaves_no_manifest(tmp_path, s3_server, s3_bucket):
    src = write_docs(tmp_path / "docs.jsonl", 24_000)
    env = {**os.environ, **s3_server.endpoint.env(), "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, "-c", KILL_SCRIPT, str(src), f"s3://{s3_bucket}/ds", s3_server.endpoint_url],
        env=env,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 120
        while time.time() < deadline and len(objects(s3_server, s3_bucket, "ds")) < 2 and proc.poll() is None:
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    left = objects(s3_server, s3_bucket, "ds")
    assert len(left) >= 2, f"no shard reached the bucket before the kill (rc {proc.returncode})"
    assert "manifest.json" not in left


def test_the_summary_names_the_url_and_the_progress_bar_ends_full(tmp_path, s3_server, s3_bucket, capsys):
    src = write_docs(tmp_path / "docs.jsonl", 3_000)
    url = f"s3://{s3_bucket}/ds"
    m = tierflow.pack(
        [src], url, workers=1, target_shard_bytes=SMALL, endpoint_url=s3_server.endpoint_url, progress=True
    ).manifest
    out = capsys.readouterr().out
    assert url in out and "tierflow-pack-" not in out
    bar = next(line for line in out.splitlines() if line.startswith("pack "))
    assert "100%" in bar and f"{m.num_samples:,} samples" in bar and f"{len(m.shards)} shards" in bar
