"""The test proxy injects resets without a word (issue 36, item 4): before, every reset it
injected printed a traceback ("ValueError: I/O operation on closed file", from the HTTP server
flushing the streams the reset had closed), burying a fault test's own output."""

from __future__ import annotations

import os

from tierflow.storage.remote import RetryPolicy
from tierflow.storage.s3 import S3Store
from tierflow.testing import LoopbackProxy


def test_injected_resets_print_no_traceback(tmp_path, s3_proxy: LoopbackProxy, s3_bucket, capsys):
    s3 = S3Store(
        f"s3://{s3_bucket}/d",
        endpoint_url=s3_proxy.url,
        retry_policy=RetryPolicy(retries=5, base_delay=0.01, max_delay=0.02),
    )
    blob = tmp_path / "blob"
    blob.write_bytes(os.urandom(300_000))
    s3.upload(blob, "blob")
    capsys.readouterr()
    for method in ("GET", "PUT", "HEAD"):
        s3_proxy.inject("reset", count=2, method=method)
    s3.upload(blob, "again")  # each call meets two resets, then succeeds
    assert s3.read_bytes("blob") == blob.read_bytes()
    assert s3.size("blob") == blob.stat().st_size
    assert s3_proxy.traffic().faults() == 6
    s3_proxy.stop()
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Exception occurred" not in err, err
