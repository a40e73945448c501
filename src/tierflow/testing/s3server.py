"""An S3-compatible server for tests and benchmarks: moto's server in a child process.

A child process, not a thread, so the server neither competes for the test process's GIL
(client CPU measurements stay honest) nor leaves half-copied threads in forked workers. The
child reads its stdin and exits when it closes, so it never outlives the process that
started it. moto is imported only in the child; the parent needs boto3, obstore or s3fs only
for the client helpers it calls.
"""

from __future__ import annotations

import itertools
import os
import tempfile
import subprocess
import sys
import uuid
from dataclasses import dataclass
from typing import Any

from tierflow.testing.lifecycle import Startable, stop_child

FAKE_ACCESS_KEY_ID = "tierflow-test-key"
FAKE_SECRET_ACCESS_KEY = "tierflow-test-secret"
REGION = "us-east-1"
_bucket_numbers = itertools.count()


def fake_credentials_env() -> dict[str, str]:
    """Environment under which boto3, obstore and s3fs find fake credentials and never a real
    account, config file or instance-metadata endpoint."""
    return {
        "AWS_ACCESS_KEY_ID": FAKE_ACCESS_KEY_ID,
        "AWS_SECRET_ACCESS_KEY": FAKE_SECRET_ACCESS_KEY,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_REGION": REGION,
        "AWS_ALLOW_HTTP": "true",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    }


UNSET_AWS_VARIABLES = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")


@dataclass(frozen=True)
class S3Endpoint:
    """Where an S3 client should connect, with ready-made clients for each library we use."""

    endpoint_url: str
    region: str = REGION
    access_key_id: str = FAKE_ACCESS_KEY_ID
    secret_access_key: str = FAKE_SECRET_ACCESS_KEY

    def env(self) -> dict[str, str]:
        """Variables that point a child process's default S3 clients here."""
        return {
            **fake_credentials_env(),
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ENDPOINT_URL_S3": self.endpoint_url,
        }

    def boto3_client(self, **config: Any) -> Any:
        """A boto3 S3 client; `config` goes to botocore's Config (e.g. retries={...})."""
        import boto3
        from botocore.config import Config

        config.setdefault("s3", {"addressing_style": "path"})
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=self.region,
            aws_access_key_id=self.access_key_id,
            aws_secret_access_key=self.secret_access_key,
            config=Config(**config),
        )

    def s3fs_storage_options(self) -> dict[str, Any]:
        """Keyword arguments for `s3fs.S3FileSystem` / fsspec's `storage_options`."""
        return {
            "key": self.access_key_id,
            "secret": self.secret_access_key,
            "endpoint_url": self.endpoint_url,
            "client_kwargs": {"region_name": self.region},
        }

    def obstore_options(self) -> dict[str, Any]:
        """Keyword arguments for `obstore.store.S3Store(bucket, **options)`."""
        return {
            "endpoint": self.endpoint_url,
            "region": self.region,
            "access_key_id": self.access_key_id,
            "secret_access_key": self.secret_access_key,
            "virtual_hosted_style_request": False,
            "client_options": {"allow_http": True},
        }


class MotoS3Server(Startable):
    """moto's S3 server on 127.0.0.1 and a free port, in a child process."""

    def __init__(self, host: str = "127.0.0.1", start_timeout: float = 60.0) -> None:
        self.host = host
        self.start_timeout = start_timeout
        self._process: subprocess.Popen[str] | None = None
        self._log: Any = None
        self._port: int | None = None
        self._admin: Any = None  # the boto3 client of create_bucket/delete_bucket, made once

    @property
    def endpoint_url(self) -> str:
        if self._port is None:
            raise RuntimeError("moto S3 server is not started")
        return f"http://{self.host}:{self._port}"

    @property
    def endpoint(self) -> S3Endpoint:
        return S3Endpoint(self.endpoint_url)

    def start(self) -> MotoS3Server:
        if self._process is not None:
            return self
        env = {**os.environ, **fake_credentials_env()}
        self._log = tempfile.TemporaryFile("w+")
        process = subprocess.Popen(
            [sys.executable, "-c", _CHILD, self.host],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
        )
        self._process = process
        try:
            line = _read_line(process, self.start_timeout)
        except TimeoutError:
            self.stop()
            raise RuntimeError(f"moto S3 server did not report its port within {self.start_timeout} s") from None
        if not line.startswith("PORT "):
            process.wait(timeout=5)
            self._log.seek(0)
            error = self._log.read()[-2000:]
            self.stop()
            raise RuntimeError(f"moto S3 server failed to start: {line!r} {error}")
        self._port = int(line.split()[1])
        return self

    def stop(self) -> None:
        process, self._process = self._process, None
        self._port = None
        self._admin = None
        stop_child(process)
        if self._log is not None:
            self._log.close()
            self._log = None

    def create_bucket(self, prefix: str = "test") -> str:
        """Create a bucket with a name no other test uses, and return its name."""
        name = f"{prefix}-{os.getpid()}-{next(_bucket_numbers)}-{uuid.uuid4().hex[:8]}"
        self._admin_client().create_bucket(Bucket=name)
        return name

    def delete_bucket(self, name: str) -> None:
        """Delete a bucket and everything in it, so the server's memory stays bounded."""
        client = self._admin_client()
        paginator = client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=name):
            keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
            if keys:
                client.delete_objects(Bucket=name, Delete={"Objects": keys, "Quiet": True})
        client.delete_bucket(Bucket=name)

    def _admin_client(self) -> Any:
        if self._admin is None:
            self._admin = self.endpoint.boto3_client()
        return self._admin


def _read_line(process: subprocess.Popen[str], timeout: float) -> str:
    import selectors

    assert process.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        if not selector.select(timeout):
            raise TimeoutError
    return process.stdout.readline().strip()


_CHILD = "import sys; from tierflow.testing.s3server import _serve; _serve(sys.argv[1])"


def _serve(host: str) -> None:
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address=host, port=0, verbose=False)
    server.start()
    print(f"PORT {server.get_host_and_port()[1]}", flush=True)
    sys.stdin.read()  # returns when the parent closes our stdin or dies
    # and the process ends: the server's thread is a daemon (server.stop() would first wait out
    # werkzeug's half-second shutdown poll)
