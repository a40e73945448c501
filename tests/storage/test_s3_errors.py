"""S3 mistakes read as what they are (issue 39, item 3): a bucket that does not exist is named as
such, not "no manifest"; a pack to it says so in one clean line, not S3's XML cut mid-word; missing
credentials say what to set, not only that 169.254.169.254 failed."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

import tierflow
from tierflow.errors import ManifestError, SourceError
from tierflow.storage.remote import open_store


def docs(path: Path) -> Path:
    path.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(50)))
    return path


def test_a_bucket_that_does_not_exist_is_named_not_read_as_no_manifest(s3_server, s3_bucket):
    with pytest.raises(SourceError, match=r"bucket 'no-such-bucket-39' does not exist at http") as caught:
        tierflow.open_dataset("s3://no-such-bucket-39/ds", endpoint_url=s3_server.endpoint_url)
    assert not isinstance(caught.value, ManifestError) and "--endpoint-url" in str(caught.value)
    with pytest.raises(ManifestError, match="no manifest"):  # the bucket exists, the dataset does not
        tierflow.open_dataset(f"s3://{s3_bucket}/nothing-here", endpoint_url=s3_server.endpoint_url)


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_pack_to_a_missing_bucket_says_so_in_one_clean_line(s3_server, tmp_path, overwrite):
    src = docs(tmp_path / "a.jsonl")
    with pytest.raises(SourceError) as caught:
        tierflow.pack(
            [src],
            "s3://no-such-bucket-39/ds",
            endpoint_url=s3_server.endpoint_url,
            workers=1,
            target_shard_bytes=256 << 10,
            overwrite=overwrite,
        )
    message = str(caught.value)
    assert "bucket 'no-such-bucket-39' does not exist" in message
    assert "<" not in message and "\n" not in message


def test_a_pack_to_a_missing_bucket_through_the_cli_is_one_line(s3_server, tmp_path, capsys):
    from tierflow.commands.cli import main

    src = docs(tmp_path / "a.jsonl")
    assert (
        main(
            [
                "pack",
                str(src),
                "--out",
                "s3://no-such-bucket-39/ds",
                "--endpoint-url",
                s3_server.endpoint_url,
                "--workers",
                "1",
                "--quiet",
            ]
        )
        != 0
    )
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "does not exist" in err and "<?xml" not in err


def test_missing_credentials_say_what_to_set_and_are_not_retried(s3_server, s3_bucket, monkeypatch):
    with socket.socket() as s:  # a port nobody listens on, standing in for the metadata service
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_METADATA_ENDPOINT", f"http://127.0.0.1:{port}")
    source = open_store(f"s3://{s3_bucket}/ds", endpoint_url=s3_server.endpoint_url)
    with pytest.raises(SourceError) as caught:
        source.size("manifest.json")
    message = str(caught.value)
    assert "no S3 credentials found" in message and "metadata service" in message
    for what in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_PROFILE",
        "endpoint_url=",
        "AWS_ENDPOINT_URL_S3",
        "docs/scale-out.md",
    ):
        assert what in message
    assert caught.value.attempts == 1
