"""Shared fixtures: the test rig of tierflow.testing.

- `s3_server` (session): moto's S3 server in a child process on 127.0.0.1; `.endpoint_url`,
  `.endpoint` (an `S3Endpoint` with boto3 / s3fs / obstore helpers and `.env()` for child
  processes), `.create_bucket()`. While it runs, the AWS_* variables hold fake credentials
  (and nothing points at a real account), so default-constructed boto3, obstore and s3fs
  clients authenticate; they still need an explicit endpoint.
- `s3_bucket`: a fresh, empty bucket name for one test, deleted afterwards.
- `s3_proxy`: a `LoopbackProxy` in front of `s3_server`, fresh per test: clean counters, no
  throttle, no faults. Point clients at `S3Endpoint(s3_proxy.url)`.
- `small_tmpfs(size)`: a fresh tmpfs of `size` (e.g. "8m") mounted under the test's tmp_path, for
  full-disk tests; unmounted afterwards. Skips where mounting is refused (not root), fails in CI.
- `make_proxy(upstream_url, **options)`: a `LoopbackProxy` in front of any HTTP upstream
  (e.g. `serve_directory(tmp_path).url`), stopped after the test.
- `long_tailed_docs` (session): a packed dataset of 5000 documents of long-tailed lengths (id,
  text, blob; byte tokens kept beside the text) in small shards, for the loader's tests.

The proxy runs as threads of the test process; `tierflow.testing.ProxyProcess` offers the same
controls from a child process (for benchmarks, so the proxy's CPU stays out of the figures).
moto's server closes every connection after one response; the proxy keeps clients' connections
alive regardless.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

import tierflow

from tierflow.testing import LoopbackProxy, MotoS3Server
from tierflow.testing.s3server import UNSET_AWS_VARIABLES, fake_credentials_env


@pytest.fixture(scope="session")
def s3_server() -> Iterator[MotoS3Server]:
    if importlib.util.find_spec("moto") is None:
        pytest.skip("moto[server] is not installed (it comes with the dev extra)")
    with pytest.MonkeyPatch.context() as env:
        for name, value in fake_credentials_env().items():
            env.setenv(name, value)
        for name in UNSET_AWS_VARIABLES:
            env.delenv(name, raising=False)
        with MotoS3Server() as server:
            yield server


@pytest.fixture
def s3_bucket(s3_server: MotoS3Server) -> Iterator[str]:
    name = s3_server.create_bucket()
    yield name
    s3_server.delete_bucket(name)


@pytest.fixture
def s3_proxy(s3_server: MotoS3Server) -> Iterator[LoopbackProxy]:
    with LoopbackProxy(s3_server.endpoint_url) as proxy:
        yield proxy


@pytest.fixture
def make_proxy() -> Iterator[Callable[..., LoopbackProxy]]:
    proxies: list[LoopbackProxy] = []

    def start(upstream: str, **options: object) -> LoopbackProxy:
        proxy = LoopbackProxy(upstream, **options).start()  # type: ignore[arg-type]
        proxies.append(proxy)
        return proxy

    yield start
    for proxy in proxies:
        proxy.stop()


@pytest.fixture(scope="session")
def long_tailed_docs(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Long-tailed document lengths (Pareto), byte tokens, small shards."""
    root = tmp_path_factory.mktemp("long_tailed_docs")
    rng = np.random.default_rng(7)
    with open(root / "docs.jsonl", "w") as f:
        for i in range(5000):
            n = min(int(rng.pareto(1.3) * 30) + 3, 2500)
            text = (rng.integers(0, 26, n) + 97).astype(np.uint8).tobytes().decode()  # n random letters
            f.write(json.dumps({"id": i, "text": text, "blob": "x" * (i % 7)}) + "\n")
    out = root / "ds"
    tierflow.pack(
        [root / "docs.jsonl"], out, tokenizer="bytes", keep_text=True, workers=1, target_shard_bytes=256 << 10
    )
    return str(out)


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        path = tmp_path / f"tmpfs-{len(mounted)}"
        path.mkdir()
        if (
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
            ).returncode
            != 0
        ):
            if os.environ.get("CI") == "true":
                pytest.fail("cannot mount a tmpfs for a full-disk test, and CI must not skip it")
            pytest.skip("mounting a tmpfs is refused here (needs root)")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], check=False)
