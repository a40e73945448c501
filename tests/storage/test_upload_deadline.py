"""Uploads under the same deadline as reads (issue 36, item 4).

Before: a PUT to a silent or trickling peer was cut only by the client's own read timeout, once
per attempt: 181 s (6 x 30 s) for `pack --out s3://` and the checkpoint uploader, where reads
stop at their 30 s deadline. Now an upload gets `FetchLimits.total(size)`, each attempt at most
`chunk_wait(size)` of it, and the time the node's bandwidth budget holds the body back is not
the peer's. Small configured limits keep these tests to seconds; the client's own timeout (5 s)
is what the old code waited out six times.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

import tierflow
from tierflow.errors import SourceTimeout
from tierflow.storage._deadline import FetchLimits
from tierflow.storage.budget import BandwidthBudget
from tierflow.storage.remote import RetryPolicy
from tierflow.storage.s3 import S3Store
from tierflow.telemetry import MetricsRegistry
from tierflow.testing import LoopbackProxy

LIMITS = FetchLimits(deadline=1.0, slow_rate=1e9, min_throughput=50_000, window=0.3)
FAST = RetryPolicy(retries=5, base_delay=0.01, max_delay=0.02)
CLIENT_TIMEOUT = 5.0


def source(proxy: LoopbackProxy, bucket: str, **options) -> S3Store:
    options = {
        "limits": LIMITS,
        "retry_policy": FAST,
        "timeout": CLIENT_TIMEOUT,
        "registry": MetricsRegistry(),
        **options,
    }
    return S3Store(f"s3://{bucket}/data", endpoint_url=proxy.url, **options)


@pytest.fixture
def small_file(tmp_path: Path) -> Path:
    path = tmp_path / "small.bin"
    path.write_bytes(os.urandom(10_000))  # one attempt may wait chunk_wait: 0.3 s
    return path


def test_a_put_to_a_silent_peer_fails_within_the_deadline(s3_proxy, s3_bucket, small_file):
    s3 = source(s3_proxy, s3_bucket)
    s3_proxy.inject("silent", count=100, method="PUT")
    started = time.monotonic()
    with pytest.raises(SourceTimeout, match=r"data/small.bin: put outlived its \d.* s deadline"):
        s3.upload(small_file, "small.bin")
    took = time.monotonic() - started
    assert took < 3 * LIMITS.deadline + 1, took  # before: 6 attempts x the client's 5 s
    assert s3_proxy.traffic().requests("PUT", key="small.bin") >= 2  # cut and retried while the deadline lasted


def test_a_put_cut_on_a_silent_attempt_is_retried_and_lands(s3_proxy, s3_bucket, small_file):
    s3 = source(s3_proxy, s3_bucket)
    s3_proxy.inject("silent", count=1, method="PUT")
    s3.upload(small_file, "small.bin")
    assert s3.read_bytes("small.bin") == small_file.read_bytes()


@pytest.mark.slow
def test_time_the_bandwidth_budget_holds_an_upload_back_is_not_the_peers(s3_proxy, s3_bucket, tmp_path):
    """1.5 MB through a 600 KB/s budget takes ~2 s, twice the deadline: it must still land."""
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(1_500_000))
    budget = BandwidthBudget(600_000, burst=64 << 10, node_rate=None)
    s3 = source(s3_proxy, s3_bucket, budget=budget, chunk_bytes=64 << 10)
    started = time.monotonic()
    s3.upload(big, "big.bin")
    assert time.monotonic() - started > LIMITS.deadline  # the budget did hold it back
    assert s3.read_bytes("big.bin") == big.read_bytes()


def test_pack_to_s3_fails_within_the_deadline_when_the_manifest_put_goes_unanswered(
    tmp_path, s3_server, s3_bucket, monkeypatch
):
    """The pack's manifest PUT to a peer gone quiet: SourceTimeout in seconds, no manifest."""
    with open(tmp_path / "docs.jsonl", "w") as f:
        for i in range(300):
            f.write(json.dumps({"text": f"doc {i}"}) + "\n")
    monkeypatch.setenv("TIERFLOW_FETCH_DEADLINE", "1")
    with LoopbackProxy(s3_server.endpoint_url) as proxy:
        proxy.inject("silent", count=100, method="PUT", key="manifest.json")
        started = time.monotonic()
        with pytest.raises(SourceTimeout, match="manifest.json"):
            tierflow.pack(
                [tmp_path / "docs.jsonl"], f"s3://{s3_bucket}/ds", endpoint_url=proxy.url, workers=1, progress=False
            )
        assert time.monotonic() - started < 25  # before: 6 x 30 s
    client = s3_server.endpoint.boto3_client()
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket, Prefix="ds/").get("Contents", [])]
    assert "ds/manifest.json" not in keys and keys  # its shards went, its manifest did not
