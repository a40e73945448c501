"""Installing tierflow next to a user's current boto3: the s3 extra must not downgrade botocore."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

ROUND_TRIP = r"""
import importlib.util, sys
from tierflow.storage.remote import open_store

assert importlib.util.find_spec("s3fs") is None and importlib.util.find_spec("aiobotocore") is None
source = open_store(sys.argv[1], endpoint_url=sys.argv[2])
source.upload(sys.argv[3], "blob")
assert source.read_bytes("blob") == open(sys.argv[3], "rb").read()
print("round trip ok")
"""


def _pip(venv: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", *args], capture_output=True, text=True, timeout=timeout
    )


def _versions(venv: Path, *names: str) -> dict[str, str]:
    frozen = _pip(venv, "list", "--format=freeze").stdout.lower().splitlines()
    found = dict(line.split("==", 1) for line in frozen if "==" in line)
    return {name: found.get(name, "") for name in names}


@pytest.mark.slow
def test_the_s3_extra_installs_next_to_the_current_boto3_and_pip_check_passes(tmp_path, s3_server, s3_bucket):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    upgraded = _pip(venv, "install", "-q", "-U", "pip")
    if upgraded.returncode != 0:
        pytest.skip(f"the package index is unreachable (pip install -U pip failed): {upgraded.stderr[-500:]}")
    tree = tmp_path / "tierflow"  # a copy: building in place would leave build/ and egg-info in the checkout
    shutil.copytree(
        ROOT,
        tree,
        ignore=shutil.ignore_patterns(
            ".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis"
        ),
    )
    users = _pip(venv, "install", "-q", "boto3")  # the user's environment: the current boto3, first
    if users.returncode != 0:
        pytest.skip(f"the package index is unreachable (pip install boto3 failed): {users.stderr[-500:]}")
    before = _versions(venv, "boto3", "botocore")
    installed = _pip(venv, "install", "-q", "-c", str(tree / "constraints.txt"), f"{tree}[s3]", "boto3")
    assert installed.returncode == 0, installed.stderr
    check = _pip(venv, "check")
    assert check.returncode == 0, check.stdout + check.stderr
    assert _versions(venv, "boto3", "botocore") == before  # nothing downgraded
    listed = _pip(venv, "list", "--format=freeze").stdout.lower()
    assert "s3fs" not in listed and "aiobotocore" not in listed, listed
    blob = tmp_path / "blob"
    blob.write_bytes(os.urandom(100_000))
    env = {**os.environ, **s3_server.endpoint.env()}
    env.pop("PYTHONPATH", None)  # the venv's own tierflow, not this checkout's
    run = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            ROUND_TRIP,
            f"s3://{s3_bucket}/install",
            s3_server.endpoint_url,
            str(blob),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=tmp_path,
    )
    assert run.returncode == 0 and "round trip ok" in run.stdout, run.stderr
