"""Reading through tiers checks the manifest's size before reading it (issue 36, item 4).

`open_dataset` asked the manifest's size first; `TierStack.manifest()` read it whole, then
refused it (a 1.5 GB manifest cost 1,567 MB before the refusal). Now both refuse it unread.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import tierflow
from tierflow.errors import ManifestError
from tierflow.storage.remote import RetryPolicy
from tierflow.storage.s3 import S3Store
from tierflow.telemetry import MetricsRegistry
from tierflow.testing import LoopbackProxy
from tierflow.tiers.stack import TierStack
from tierflow.tiers.tier import Tier

LIMIT = 64 << 10


def padded_dataset(root: Path) -> Path:
    with open(root / "raw.jsonl", "w") as f:
        for i in range(200):
            f.write(json.dumps({"text": f"doc {i}"}) + "\n")
    tierflow.pack([root / "raw.jsonl"], root / "ds", workers=1)
    manifest = root / "ds" / "manifest.json"
    manifest.write_bytes(manifest.read_bytes() + b" " * (4 << 20))  # still valid JSON, 4 MiB larger
    return root / "ds"


def test_a_stack_over_s3_refuses_an_oversized_manifest_before_downloading_it(
    tmp_path, s3_proxy: LoopbackProxy, s3_bucket: str, monkeypatch
):
    data = padded_dataset(tmp_path)
    size = (data / "manifest.json").stat().st_size
    source = S3Store(
        f"s3://{s3_bucket}/ds",
        endpoint_url=s3_proxy.url,
        registry=MetricsRegistry(),
        retry_policy=RetryPolicy(retries=1, base_delay=0.01, max_delay=0.02),
    )
    for path in sorted(data.iterdir()):
        source.upload(path, path.name)
    monkeypatch.setenv("TIERFLOW_MAX_MANIFEST_BYTES", str(LIMIT))
    s3_proxy.reset_counters()
    stack = TierStack(source, [Tier(tmp_path / "l2", 1 << 30, name="L2", form="at_rest", ram=False)])
    with pytest.raises(ManifestError, match=rf"manifest.json: {size} bytes, more than the {LIMIT}"):
        stack.manifest()
    assert s3_proxy.traffic().response_bytes("GET", key="manifest.json") < LIMIT  # before: all 4 MiB


def test_a_stack_over_a_directory_refuses_an_oversized_manifest(tmp_path, monkeypatch):
    data = padded_dataset(tmp_path)
    monkeypatch.setenv("TIERFLOW_MAX_MANIFEST_BYTES", str(LIMIT))
    stack = tierflow.tiers.build_stack(str(data), [])
    with pytest.raises(ManifestError, match=rf"more than the {LIMIT}"):
        stack.manifest()
