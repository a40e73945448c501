"""`pack(engine="ray")`: the same dataset id and shard bytes as the local engine, a Ray worker
killed mid-pack retried without a duplicate or missing sample, a killed driver publishes nothing
and its rerun resumes from the units it had finished.

Every test here starts a 2-CPU local Ray cluster (seconds), so they are `slow`; they skip, saying
so, where Ray is not installed (`pip install 'tierflow[ray]'`; `.[dev]` includes it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import tierflow
from tierflow.errors import ManifestError
from tierflow.format.manifest import MANIFEST_NAME
from tierflow.pack._journal import JOURNAL_NAME
from tierflow.pack.tokenize import PackInputError

from pack_rig import lake, shard_bytes

pytestmark = pytest.mark.slow
SRC = str(Path(__file__).resolve().parents[2] / "src")


@pytest.fixture(autouse=True, scope="module")
def ray():
    """Ray, imported when a test here runs (not when the fast set is collected: it takes a while)."""
    return pytest.importorskip("ray", reason="Ray is not installed: pip install 'tierflow[ray]' to run these")


@pytest.fixture(scope="module")
def cluster(ray):
    os.environ["PYTHONPATH"] = SRC + os.pathsep + os.environ.get("PYTHONPATH", "")  # for the workers
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


OPTS = dict(tokenizer="bytes", target_shard_bytes=256 << 10, chunk_bytes=64 << 10)


def test_ray_pack_is_byte_identical_to_local(cluster, tmp_path):
    sources = lake(tmp_path)
    local = tierflow.pack(sources, tmp_path / "local", workers=2, **OPTS)
    remote = tierflow.pack(sources, tmp_path / "ray", engine="ray", **OPTS)
    assert remote.manifest.dataset_id == local.manifest.dataset_id
    assert len(local.manifest.shards) > 3  # several shards, several units per shard and across them
    assert shard_bytes(tmp_path / "ray") == shard_bytes(tmp_path / "local")
    assert (tmp_path / "ray" / MANIFEST_NAME).read_bytes() == (tmp_path / "local" / MANIFEST_NAME).read_bytes()
    assert not (tmp_path / "ray" / ".tmp-pack").exists()


def _die_once(marker_dir: str):
    def fn(row: dict) -> dict:
        if row["id"] % 1000 == 7:  # a few rows, in different units: the worker dies on the first try
            marker = os.path.join(marker_dir, str(row["id"]))
            if not os.path.exists(marker):
                open(marker, "w").close()
                os._exit(1)
        return row

    return fn


def test_killed_worker_is_retried_without_duplicates_or_gaps(cluster, tmp_path):
    sources = lake(tmp_path)
    markers = tmp_path / "markers"
    markers.mkdir()
    summary = tierflow.pack(sources, tmp_path / "ray", fn=_die_once(str(markers)), engine="ray", **OPTS)
    assert len(os.listdir(markers)) == 5  # ids 7, 1007, 2007, 3007, 4007: five workers died
    local = tierflow.pack(sources, tmp_path / "local", fn=lambda r: r, workers=1, **OPTS)
    assert summary.manifest.dataset_id == local.manifest.dataset_id
    assert shard_bytes(tmp_path / "ray") == shard_bytes(tmp_path / "local")
    ds = tierflow.open_dataset(tmp_path / "ray")
    assert sorted(s["id"] for s in ds) == list(range(4500))


def test_bad_input_fails_naming_the_file_not_retried(cluster, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"text": \n')
    with pytest.raises(PackInputError, match="bad.jsonl"):
        tierflow.pack([bad], tmp_path / "out", engine="ray", **OPTS)
    assert not (tmp_path / "out" / MANIFEST_NAME).exists()
    assert not list((tmp_path / "out").glob("shard-*"))


DRIVER = """
import json, os, sys, time
import ray
import tierflow
def slow(row):
    time.sleep(0.002)
    return row
if __name__ == "__main__":
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    summary = tierflow.pack(sys.argv[1:-1], sys.argv[-1], fn=slow, engine="ray", workers=2, tokenizer="bytes",
                            target_shard_bytes=256 << 10, chunk_bytes=32 << 10)
    print(json.dumps({"packed": summary.units_packed, "resumed": summary.units_resumed}))
"""


def test_killed_driver_leaves_no_dataset_and_the_rerun_resumes_from_finished_units(tmp_path):
    sources = lake(tmp_path, files=2, rows=3000)
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(DRIVER))
    out = tmp_path / "out"
    journal = out / JOURNAL_NAME
    env = dict(os.environ, PYTHONPATH=SRC, RAY_ADDRESS="")
    argv = [sys.executable, str(script), *map(str, sources), str(out)]
    proc = subprocess.Popen(argv, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while _sealed(journal) < 3 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert proc.poll() is None, "the pack finished before it could be killed: give it more input"
        assert _sealed(journal) >= 3, "no three shards sealed within 120 s"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    if _group_alive(proc.pid):
        os.killpg(proc.pid, signal.SIGKILL)  # Ray's processes the driver started, if any outlived it
    assert not (out / MANIFEST_NAME).exists()
    with pytest.raises(ManifestError):
        tierflow.open_dataset(out)
    rerun = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, start_new_session=True)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    counts = json.loads(rerun.stdout.strip().splitlines()[-1])
    whole = tierflow.pack(
        sources,
        tmp_path / "whole",
        fn=lambda r: r,
        workers=1,
        tokenizer="bytes",
        target_shard_bytes=256 << 10,
        chunk_bytes=32 << 10,
    )
    assert counts["resumed"] > 0 and counts["packed"] < whole.units_packed, counts  # not started over
    assert counts["resumed"] + counts["packed"] >= whole.units_packed
    assert tierflow.open_dataset(out).manifest.dataset_id == whole.manifest.dataset_id
    assert shard_bytes(out) == shard_bytes(tmp_path / "whole")
    assert not journal.exists()


def _sealed(journal: Path) -> int:
    """Shards the pack's resume journal records as sealed (its lines after the header)."""
    try:
        return max(0, journal.read_bytes().count(b"\n") - 1)
    except FileNotFoundError:
        return 0


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def test_cli_engine_ray_to_s3(cluster, tmp_path, s3_server, s3_bucket):
    """`tierflow pack --engine ray` to s3://: the shards go through the upload path, manifest last."""
    from tierflow.commands.cli import main

    sources = lake(tmp_path, files=2, rows=800)
    url = f"s3://{s3_bucket}/ray-ds"
    assert (
        main(
            [
                "pack",
                *map(str, sources),
                "--out",
                url,
                "--engine",
                "ray",
                "--tokenizer",
                "bytes",
                "--shard-size",
                "256KiB",
                "--endpoint-url",
                s3_server.endpoint_url,
                "--quiet",
            ]
        )
        == 0
    )
    local = tierflow.pack(sources, tmp_path / "local", tokenizer="bytes", target_shard_bytes=256 << 10)
    assert (
        tierflow.open_dataset(url, endpoint_url=s3_server.endpoint_url).manifest.dataset_id == local.manifest.dataset_id
    )
