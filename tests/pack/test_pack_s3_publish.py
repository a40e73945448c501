"""`pack --out s3://` whose manifest PUT answer is lost (issue 36, item 4).

Before: the manifest landed, its answer was lost (the connection reset after the store took it),
so every retry did the same and the pack reported failure for a dataset it had published; a
rerun was then refused ("already holds a finished dataset"). Now the manifest is looked at (HEAD,
then its bytes) before the pack fails: landed whole, the pack succeeded.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import tierflow
from tierflow.errors import SourceError
from tierflow.storage.remote import RetryPolicy
from tierflow.storage.s3 import S3Store
from tierflow.testing import LoopbackProxy


def docs(path: Path) -> Path:
    with open(path, "w") as f:
        for i in range(300):
            f.write(json.dumps({"text": f"doc {i} " + "x" * (i % 40)}) + "\n")
    return path


def test_a_manifest_put_whose_answer_is_lost_publishes_the_dataset(tmp_path, s3_server, s3_bucket):
    raw = docs(tmp_path / "docs.jsonl")
    url = f"s3://{s3_bucket}/ds"
    with LoopbackProxy(s3_server.endpoint_url) as proxy:
        # the store takes every manifest PUT, its client never hears back
        rule = proxy.inject("reset", count=100, method="PUT", key="manifest.json")
        summary = tierflow.pack([raw], url, endpoint_url=proxy.url, workers=1, progress=False)
        assert rule.fired >= 1
    assert summary is not None
    tierflow.pack([raw], tmp_path / "local", workers=1, progress=False)
    local = tierflow.open_dataset(tmp_path / "local")
    remote = tierflow.open_dataset(url, endpoint_url=s3_server.endpoint_url)
    assert remote.manifest.dataset_id == local.manifest.dataset_id and len(remote) == len(local) == 300


def test_publish_raises_when_the_object_did_not_land(tmp_path, s3_proxy: LoopbackProxy, s3_bucket):
    """A PUT that never reached the store (a 503 on every attempt): the HEAD finds nothing, the
    upload's error stands."""
    src = tmp_path / "manifest.json"
    src.write_text("{}")
    s3 = S3Store(
        f"s3://{s3_bucket}/ds",
        endpoint_url=s3_proxy.url,
        retry_policy=RetryPolicy(retries=2, base_delay=0.01, max_delay=0.02),
    )
    s3_proxy.inject("503", count=100, method="PUT")
    with pytest.raises(SourceError, match="manifest.json: put failed"):
        s3.publish(src, "manifest.json")


def test_publish_raises_when_another_object_is_there(tmp_path, s3_proxy: LoopbackProxy, s3_bucket):
    """An object of the same name with other bytes (an older manifest, same size): not landed."""
    s3 = S3Store(
        f"s3://{s3_bucket}/ds",
        endpoint_url=s3_proxy.url,
        retry_policy=RetryPolicy(retries=2, base_delay=0.01, max_delay=0.02),
    )
    old = tmp_path / "old.json"
    old.write_text('{"a": 1}')
    s3.upload(old, "manifest.json")
    new = tmp_path / "manifest.json"
    new.write_text('{"a": 2}')
    s3_proxy.inject("503", count=100, method="PUT")
    with pytest.raises(SourceError, match="put failed"):
        s3.publish(new, "manifest.json")
