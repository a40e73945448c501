"""Sources: local directories and s3:// through the metering, fault-injecting proxy."""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
from pathlib import Path

import pytest

import tierflow
from tierflow.format.manifest import MANIFEST_NAME, Manifest
from tierflow.telemetry.metrics import MetricsRegistry
from tierflow.testing import Fault, LoopbackProxy
from tierflow.storage.budget import BandwidthBudget
from tierflow.storage.remote import (
    LocalStore,
    RetryPolicy,
    Store,
    SourceError,
    SourceNotFound,
    open_store,
    upload_dataset,
)
from tierflow.storage.s3 import S3Store

FAST_RETRIES = RetryPolicy(retries=3, base_delay=0.001, max_delay=0.01)


def counter(registry: MetricsRegistry, name: str, **labels: str) -> float:
    total = 0.0
    for entry in registry.snapshot()["counters"]:
        if entry["name"] == name and all(entry["labels"].get(k) == v for k, v in labels.items()):
            total += entry["value"]
    return total


@pytest.fixture
def s3_source(s3_proxy: LoopbackProxy, s3_bucket: str) -> S3Store:
    return S3Store(
        f"s3://{s3_bucket}/data", endpoint_url=s3_proxy.url, registry=MetricsRegistry(), retry_policy=FAST_RETRIES
    )


@pytest.fixture
def blob(tmp_path: Path) -> Path:
    path = tmp_path / "blob.bin"
    path.write_bytes(os.urandom(3_000_000 + 17))
    return path


# local directories


@pytest.mark.parametrize("as_url", [False, True], ids=["path", "file-url"])
def test_a_local_directory_round_trips_upload_download_range_and_list(tmp_path: Path, blob: Path, as_url: bool) -> None:
    root = tmp_path / "store"
    source = open_store(f"file://{root}" if as_url else str(root))
    assert isinstance(source, LocalStore) and isinstance(source, Store)
    source.upload(blob, "a/shard.arrow")
    source.upload(blob, "b.bin")
    data = blob.read_bytes()
    assert source.size("a/shard.arrow") == len(data)
    assert source.read_range("a/shard.arrow", 1000, 5000) == data[1000:6000]
    assert source.download("a/shard.arrow", tmp_path / "copy", expected_size=len(data)) == len(data)
    assert (tmp_path / "copy").read_bytes() == data
    assert source.list() == ["a/shard.arrow", "b.bin"]
    assert source.list("a/") == ["a/shard.arrow"]
    assert not [p for p in root.rglob(".tmp-*")]


def test_a_missing_local_object_is_source_not_found_and_not_retried(tmp_path: Path) -> None:
    registry = MetricsRegistry()
    source = open_store(str(tmp_path), registry=registry)
    with pytest.raises(FileNotFoundError) as raised:
        source.read_bytes("manifest.json")
    assert isinstance(raised.value, SourceNotFound)
    assert str(tmp_path / "manifest.json") in str(raised.value)
    assert counter(registry, "tierflow_source_requests_total") == 1


@pytest.mark.parametrize("name", ["../escape", "/abs", "a//b", "", "a/./b"])
def test_names_that_leave_the_source_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match="not a relative object name"):
        open_store(str(tmp_path)).read_bytes(name)


# s3 through the proxy


def test_s3_round_trips_upload_download_range_list_and_size(
    s3_source: S3Store, s3_proxy: LoopbackProxy, blob: Path, tmp_path: Path
) -> None:
    data = blob.read_bytes()
    s3_source.upload(blob, "shard-1.arrow")
    s3_source.upload(blob, "sub/shard-2.arrow")
    assert s3_source.list() == ["shard-1.arrow", "sub/shard-2.arrow"]
    assert s3_source.list("sub/") == ["sub/shard-2.arrow"]
    assert s3_source.list("shard-") == ["shard-1.arrow"]
    assert s3_source.size("shard-1.arrow") == len(data)
    assert s3_source.read_range("shard-1.arrow", 123_456, 65_536) == data[123_456 : 123_456 + 65_536]
    s3_proxy.reset_counters()
    assert s3_source.download("shard-1.arrow", tmp_path / "out", expected_size=len(data)) == len(data)
    assert (tmp_path / "out").read_bytes() == data
    traffic = s3_proxy.traffic()
    assert traffic.requests("GET", key="shard-1.arrow") == 1
    assert traffic.response_bytes("GET", key="shard-1.arrow") == len(data)
    assert counter(s3_source.registry, "tierflow_source_bytes_total", direction="in") >= len(data)


def test_objects_live_under_the_url_prefix_in_the_bucket(
    s3_source: S3Store, s3_server, s3_bucket: str, blob: Path
) -> None:
    s3_source.upload(blob, "x.bin")
    keys = [o["Key"] for o in s3_server.endpoint.boto3_client().list_objects_v2(Bucket=s3_bucket)["Contents"]]
    assert keys == ["data/x.bin"]


def test_a_large_upload_goes_in_parts_and_reads_back_identical(
    s3_source: S3Store, s3_proxy: LoopbackProxy, tmp_path: Path
) -> None:
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(9 << 20))
    s3_source.upload(big, "big.bin")
    assert s3_proxy.traffic().requests("PUT", key="big.bin") == 2
    assert s3_source.read_bytes("big.bin") == big.read_bytes()


@pytest.mark.parametrize("fault", [Fault.UNAVAILABLE, Fault.RESET, Fault.TRUNCATE])
def test_download_faults_are_retried_counted_and_the_file_is_identical(
    s3_source: S3Store, s3_proxy: LoopbackProxy, blob: Path, tmp_path: Path, fault: Fault
) -> None:
    data = blob.read_bytes()
    s3_source.upload(blob, "shard.arrow")
    s3_proxy.inject(fault, count=2, method="GET", key="shard.arrow")
    assert s3_source.download("shard.arrow", tmp_path / "out") == len(data)
    assert (tmp_path / "out").read_bytes() == data
    assert s3_proxy.traffic().faults("GET") == 2
    assert counter(s3_source.registry, "tierflow_source_retries_total", op="download") == 2


def test_a_retried_download_resumes_from_the_last_byte_received(
    s3_source: S3Store, s3_proxy: LoopbackProxy, blob: Path, tmp_path: Path
) -> None:
    data = blob.read_bytes()
    s3_source.upload(blob, "shard.arrow")
    s3_proxy.reset_counters()
    s3_proxy.inject(Fault.TRUNCATE, method="GET", key="shard.arrow", after_bytes=2_500_000)
    s3_source.download("shard.arrow", tmp_path / "out", expected_size=len(data))
    assert (tmp_path / "out").read_bytes() == data
    traffic = s3_proxy.traffic()
    first, second = [r.range for r in traffic.records if r.method == "GET"]
    assert first is None and second is not None
    resumed_at = int(second.removeprefix("bytes=").split("-")[0])
    assert 0 < resumed_at <= 2_500_000
    assert traffic.response_bytes("GET", key="shard.arrow") == 2_500_000 + len(data) - resumed_at


@pytest.mark.parametrize("fault", [Fault.UNAVAILABLE, Fault.RESET, Fault.TRUNCATE])
def test_range_and_manifest_reads_survive_faults(
    s3_source: S3Store, s3_proxy: LoopbackProxy, blob: Path, fault: Fault
) -> None:
    data = blob.read_bytes()
    s3_source.upload(blob, "shard.arrow")
    s3_proxy.inject(fault, method="GET")
    assert s3_source.read_range("shard.arrow", 10, 200_000) == data[10:200_010]
    s3_proxy.inject(fault, method="GET")
    assert s3_source.read_bytes("shard.arrow") == data
    assert counter(s3_source.registry, "tierflow_source_retries_total") == 2


def test_upload_faults_are_retried(s3_source: S3Store, s3_proxy: LoopbackProxy, blob: Path) -> None:
    s3_proxy.inject(Fault.UNAVAILABLE, count=2, method="PUT")
    s3_source.upload(blob, "up.bin")
    assert s3_source.read_bytes("up.bin") == blob.read_bytes()
    assert counter(s3_source.registry, "tierflow_source_retries_total", op="put") == 2


def test_past_the_retry_budget_the_error_names_the_object_and_url(
    s3_source: S3Store, s3_proxy: LoopbackProxy, s3_bucket: str, blob: Path, tmp_path: Path
) -> None:
    s3_source.upload(blob, "shard-dead.arrow")
    s3_proxy.inject(Fault.UNAVAILABLE, count=FAST_RETRIES.retries + 1, method="GET")
    with pytest.raises(SourceError) as raised:
        s3_source.download("shard-dead.arrow", tmp_path / "out")
    error = raised.value
    assert f"s3://{s3_bucket}/data/shard-dead.arrow" in str(error)
    assert error.attempts == FAST_RETRIES.retries + 1 and "503" in str(error)
    assert s3_proxy.traffic().requests("GET", key="shard-dead.arrow") == FAST_RETRIES.retries + 1


def test_a_missing_s3_object_fails_at_once_as_not_found(s3_source: S3Store, s3_proxy: LoopbackProxy) -> None:
    with pytest.raises(SourceNotFound, match="manifest.json"):
        s3_source.read_bytes("manifest.json")
    assert s3_proxy.traffic().requests("GET", key="manifest.json") == 1  # (and one listing: is it the bucket?)


def test_a_size_other_than_expected_fails_without_retrying(
    s3_source: S3Store, s3_proxy: LoopbackProxy, blob: Path, tmp_path: Path
) -> None:
    s3_source.upload(blob, "shard.arrow")
    with pytest.raises(SourceError, match="expected 5"):
        s3_source.download("shard.arrow", tmp_path / "out", expected_size=5)
    assert counter(s3_source.registry, "tierflow_source_retries_total") == 0


def test_a_full_local_disk_is_raised_as_enospc_and_not_retried(s3_source: S3Store, blob: Path) -> None:
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    s3_source.upload(blob, "shard.arrow")
    with pytest.raises(OSError) as raised:
        s3_source.download("shard.arrow", "/dev/full")
    assert raised.value.errno == errno.ENOSPC and not isinstance(raised.value, SourceError)
    assert counter(s3_source.registry, "tierflow_source_retries_total") == 0


def test_every_byte_moved_is_charged_to_the_budget_at_its_priority(
    s3_proxy: LoopbackProxy, s3_bucket: str, blob: Path, tmp_path: Path
) -> None:
    budget = BandwidthBudget(1e12, path=tmp_path / "budget")
    source = open_store(f"s3://{s3_bucket}", endpoint_url=s3_proxy.url, budget=budget)
    size = blob.stat().st_size
    source.upload(blob, "b.bin")
    source.download("b.bin", tmp_path / "out")
    source.upload(blob, "c.bin", priority="high")
    assert budget.acquired_bytes == {"low": size, "high": 2 * size}


def _read_in_child(source: S3Store, queue: multiprocessing.Queue) -> None:
    try:
        queue.put(("read", source.read_range("x.bin", 0, 1000)))
    except SourceError as exc:
        queue.put(("refused", str(exc)))


def test_a_child_forked_after_obstore_ran_is_refused_at_once_saying_what_to_do(s3_source: S3Store, blob: Path) -> None:
    s3_source.upload(blob, "x.bin")
    parent_store = s3_source.store
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_read_in_child, args=(s3_source, queue))
    child.start()
    outcome, said = queue.get(timeout=30)  # obstore would hang here; no s3fs to fall back on
    child.join(timeout=30)
    assert child.exitcode == 0 and outcome == "refused"
    assert "forked after its parent used obstore" in said and "forkserver" in said and s3_source.url in said
    assert s3_source.store is parent_store


def test_a_pickled_s3_source_reads_in_a_spawned_process_through_its_own_client(s3_source: S3Store, blob: Path) -> None:
    s3_source.upload(blob, "x.bin")
    assert s3_source.store is not None  # this process's client exists, and does not travel
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_read_in_child, args=(s3_source, queue))
    child.start()
    outcome, got = queue.get(timeout=60)
    child.join(timeout=30)
    assert (outcome, got) == ("read", blob.read_bytes()[:1000])


def test_s3_urls_never_need_s3fs(s3_proxy: LoopbackProxy, s3_bucket: str, blob: Path, monkeypatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_s3fs(name: str, *args, **kwargs):
        if name.split(".")[0] in ("s3fs", "aiobotocore", "fsspec"):
            raise ImportError(f"{name} is not installed")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_s3fs)
    source = open_store(f"s3://{s3_bucket}/plain", endpoint_url=s3_proxy.url)
    source.upload(blob, "f.bin")
    assert source.read_range("f.bin", 3, 30) == blob.read_bytes()[3:33] and source.list() == ["f.bin"]


def test_other_fsspec_urls_go_through_fsspec(blob: Path, tmp_path: Path) -> None:
    pytest.importorskip("fsspec")
    source = open_store(f"memory://tierflow-test-{os.getpid()}/via")
    source.upload(blob, "f.bin")
    data = blob.read_bytes()
    assert source.list() == ["f.bin"] and [e.size for e in source.entries()] == [len(data)]
    assert source.read_range("f.bin", 7, 70) == data[7:77]
    assert source.download("f.bin", tmp_path / "out") == len(data)
    assert (tmp_path / "out").read_bytes() == data
    source.delete("f.bin")
    assert source.list() == []


# datasets


def test_upload_dataset_sends_shards_first_and_the_manifest_last(
    s3_proxy: LoopbackProxy, s3_bucket: str, tmp_path: Path
) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": f"doc {i} " * (i % 50), "id": i}) + "\n" for i in range(8000)))
    tierflow.pack([rows], tmp_path / "ds", workers=1, target_shard_bytes=256 << 10)
    local = Manifest.load(tmp_path / "ds")
    assert len(local.shards) >= 2
    url = f"s3://{s3_bucket}/datasets/ds"
    assert upload_dataset(tmp_path / "ds", url, endpoint_url=s3_proxy.url) == len(local.shards)
    puts = [r.path.rsplit("/", 1)[1] for r in s3_proxy.traffic().records if r.method == "PUT"]
    shards = len(local.shards)  # then the version-3 tables and their header, the manifest last
    assert puts[-1] == MANIFEST_NAME and sorted(puts[:shards]) == sorted(s.name for s in local.shards)
    assert puts[-2] == "metadata.json" and all(p.startswith("metadata-") for p in puts[shards:-2])
    source = open_store(url, endpoint_url=s3_proxy.url)
    remote = Manifest.from_bytes(source.read_bytes(MANIFEST_NAME), url)
    assert remote.to_json() == local.to_json()
    for shard in remote.shards:
        assert source.read_bytes(shard.name) == (tmp_path / "ds" / shard.name).read_bytes()
    assert upload_dataset(tmp_path / "ds", url, endpoint_url=s3_proxy.url) == 0


def test_an_explicit_endpoint_wins_over_aws_endpoint_url_s3_in_the_environment(
    s3_server, s3_bucket: str, s3_proxy: LoopbackProxy, blob: Path, monkeypatch
) -> None:
    S3Store(f"s3://{s3_bucket}/data", endpoint_url=s3_server.endpoint_url).upload(blob, "obj")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server.endpoint_url)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint_url)
    source = S3Store(f"s3://{s3_bucket}/data", endpoint_url=s3_proxy.url)
    assert source.read_range("obj", 0, 10) == blob.read_bytes()[:10]
    assert s3_proxy.traffic().requests(method="GET") == 1  # it went where it was told, not where the env points
