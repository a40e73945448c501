"""A FIFO, a device or an oversized file where a manifest, shard or tier entry belongs: refused at
once with a typed error naming the path, never waited on and never read without limit."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any
from collections.abc import Callable

import pytest

import tierflow
from tierflow.errors import ManifestError, ShardCorruptError, SourceError
from tierflow.format._regular import read_regular
from tierflow.format.verify import verify_shard
from tierflow.storage.remote import open_store
from tierflow.tiers.stack import TierStack
from tierflow.tiers.tier import Tier


def promptly(call: Callable[[], Any], fifos: list[Path] = (), seconds: float = 5.0) -> Any:
    """`call()`'s result or exception, which must come within `seconds`; a reader left blocked on
    one of `fifos` is released (a writer opens it) so the test never hangs."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as e:
            outcome["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        for fifo in fifos:
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        thread.join(5)
        pytest.fail(f"blocked for more than {seconds} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def fifo_at(path: Path) -> Path:
    path.unlink()
    os.mkfifo(path)
    return path


def zero_at(path: Path) -> Path:
    path.unlink()
    path.symlink_to("/dev/zero")
    return path


def socket_at(path: Path) -> Path:
    """`path` made a link to a bound Unix socket beside the dataset (a socket's path has at most 108 bytes)."""
    import socket

    where = path.parent.parent / "sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(where))  # the socket file stays once it is closed; opening it is ENXIO
    path.unlink()
    path.symlink_to(where)
    return path


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("special")
    with open(root / "docs.jsonl", "w") as f:
        for i in range(2000):
            f.write(json.dumps({"id": i, "text": f"doc {i} " + "ab" * (i % 40)}) + "\n")
    for compression in ("none", "zstd"):
        tierflow.pack(
            [root / "docs.jsonl"], root / compression, workers=1, target_shard_bytes=256 << 10, compression=compression
        )
    return root


@pytest.fixture
def dataset(packed, tmp_path, request) -> Path:
    out = tmp_path / "ds"
    shutil.copytree(packed / getattr(request, "param", "none"), out)
    return out


def first_shard(dataset: Path) -> Path:
    return dataset / json.loads((dataset / "manifest.json").read_text())["shards"][0]["name"]


@pytest.mark.parametrize("make", [fifo_at, zero_at, socket_at], ids=["fifo", "dev-zero", "socket"])
def test_a_special_manifest_is_a_manifest_error_naming_it(dataset, make):
    manifest = make(dataset / "manifest.json")
    with pytest.raises(ManifestError, match=rf"{manifest}: a (FIFO|character device|socket or device), not a regular"):
        promptly(lambda: tierflow.open_dataset(dataset), [manifest])


def test_an_oversized_file_is_refused_unread(tmp_path):
    big = tmp_path / "big.json"
    big.write_bytes(b" " * 1001)
    with pytest.raises(ManifestError, match=rf"{big}: 1001 bytes, more than the 1000"):
        read_regular(big, 1000, ManifestError)
    assert read_regular(big, 1001, ManifestError) == b" " * 1001


@pytest.mark.parametrize("dataset", ["none", "zstd"], indirect=True)
@pytest.mark.parametrize("make", [fifo_at, zero_at, socket_at], ids=["fifo", "dev-zero", "socket"])
def test_a_special_shard_is_a_shard_error_naming_it(dataset, make):
    ds = tierflow.open_dataset(dataset)
    shard = make(first_shard(dataset))
    with pytest.raises(ShardCorruptError, match=rf"{shard}: a (FIFO|character device|socket or device), not a regular"):
        promptly(lambda: ds[0], [shard])
    problems = promptly(lambda: verify_shard(shard, ds.manifest.shards[0]), [shard])
    assert problems and "not a regular file" in problems[0] and ds.manifest.shards[0].name in problems[0]


def test_a_special_file_in_the_local_source_is_a_source_error(dataset, tmp_path):
    stack = TierStack(open_store(str(dataset)), [Tier(tmp_path / "l2", 1 << 30, name="L2", form="at_rest")])
    ds = stack.dataset()
    shard = fifo_at(first_shard(dataset))
    with pytest.raises(SourceError, match=rf"{shard}: a FIFO, not a regular file"):
        promptly(lambda: ds[0], [shard])
    manifest = fifo_at(dataset / "manifest.json")
    with pytest.raises(SourceError, match=rf"{manifest}: a FIFO"):
        promptly(stack.manifest, [manifest])
    with pytest.raises(SourceError, match="character device"):
        promptly(lambda: stack.source.read_range(zero_at(manifest).name, 0, 10))


@pytest.mark.parametrize("form", ["at_rest", "decoded"])
@pytest.mark.parametrize("make", [fifo_at, zero_at], ids=["fifo", "dev-zero"])
def test_a_special_file_as_a_tier_entry_is_quarantined_and_fetched_again(dataset, tmp_path, form, make):
    expected = [tierflow.open_dataset(dataset)[i] for i in range(5)]
    tier = Tier(tmp_path / "l2", 1 << 30, name="L2", form=form)
    stack = TierStack(open_store(str(dataset)), [tier])
    info = stack.manifest().shards[0]
    stack.ensure(info).release()
    entry = make(tier.path_of(info.key))
    # a fresh process's view of the same tier directory: nothing cached in memory
    fresh = Tier(tmp_path / "l2", 1 << 30, name="L2", form=form)
    ds = TierStack(open_store(str(dataset)), [fresh]).dataset()
    assert promptly(lambda: [ds[i] for i in range(5)], [entry]) == expected
    assert fresh.m_corruptions.value == 1
    assert fresh.path_of(info.key).is_file() and not fresh.path_of(info.key).is_symlink()
