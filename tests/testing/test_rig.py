"""The shared test rig: what the S3 server, the proxy and the directory server guarantee."""

from __future__ import annotations

import functools
import http.client
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tierflow.testing import Fault, LoopbackProxy, MotoS3Server, ProxyProcess, S3Endpoint, TokenBucket, serve_directory
from tierflow.testing.fileserver import parse_range


def _connection(url: str) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)


@functools.cache
def _client(url: str):
    return S3Endpoint(url).boto3_client()


def _put(proxy: LoopbackProxy, bucket: str, key: str, data: bytes) -> None:
    """Upload through the proxy, readable by unsigned plain clients."""
    _client(proxy.url).put_object(Bucket=bucket, Key=key, Body=data, ACL="public-read")


def _no_retries(proxy: LoopbackProxy):
    return S3Endpoint(proxy.url).boto3_client(retries={"total_max_attempts": 1})


# counting


def test_proxy_counts_uploaded_and_downloaded_body_bytes_exactly(s3_proxy: LoopbackProxy, s3_bucket: str) -> None:
    client = S3Endpoint(s3_proxy.url).boto3_client()
    sizes = {"shards/a.arrow": 1_234_567, "shards/b c+d.arrow": 65_536, "shards/empty": 0}
    blobs = {key: os.urandom(size) for key, size in sizes.items()}
    for key, blob in blobs.items():
        client.put_object(Bucket=s3_bucket, Key=key, Body=blob)
    for key, blob in blobs.items():
        assert client.get_object(Bucket=s3_bucket, Key=key)["Body"].read() == blob
    ranged = client.get_object(Bucket=s3_bucket, Key="shards/a.arrow", Range="bytes=1000-4999")
    assert ranged["Body"].read() == blobs["shards/a.arrow"][1000:5000]
    suffix = client.get_object(Bucket=s3_bucket, Key="shards/a.arrow", Range="bytes=-100")
    assert suffix["Body"].read() == blobs["shards/a.arrow"][-100:]
    assert client.head_object(Bucket=s3_bucket, Key="shards/a.arrow")["ContentLength"] == 1_234_567

    traffic = s3_proxy.traffic()
    assert traffic.request_bytes("PUT") == sum(sizes.values())
    assert traffic.request_bytes("PUT", key="b c+d") == 65_536
    assert traffic.response_bytes("GET", key="a.arrow") == 1_234_567 + 4000 + 100
    assert traffic.response_bytes("GET", key="b c+d.arrow") == 65_536
    assert traffic.response_bytes("GET", key="empty") == 0
    assert traffic.response_bytes("HEAD") == 0
    assert traffic.requests("GET", key="a.arrow") == 3
    assert traffic.requests("HEAD") == 1
    assert traffic.requests_per_path("PUT") == {f"/{s3_bucket}/{key}": 1 for key in sizes}
    assert [r.range for r in traffic.records if r.range] == ["bytes=1000-4999", "bytes=-100"]
    assert traffic.statuses("GET") == {200: 3, 206: 2}


def test_reset_counters_starts_the_counts_from_zero(s3_proxy: LoopbackProxy, s3_bucket: str) -> None:
    _put(s3_proxy, s3_bucket, "k", b"x" * 10)
    s3_proxy.reset_counters()
    assert s3_proxy.traffic().requests() == 0
    assert _client(s3_proxy.url).get_object(Bucket=s3_bucket, Key="k")["Body"].read() == b"x" * 10
    traffic = s3_proxy.traffic()
    assert (traffic.requests(), traffic.response_bytes(), traffic.request_bytes()) == (1, 10, 0)


def test_proxy_keeps_a_client_connection_alive_across_requests(s3_proxy: LoopbackProxy, s3_bucket: str) -> None:
    _put(s3_proxy, s3_bucket, "k", b"0123456789")
    connection = _connection(s3_proxy.url)
    sockets = []
    for start in range(3):
        connection.request("GET", f"/{s3_bucket}/k", headers={"Range": f"bytes={start}-{start}"})
        response = connection.getresponse()
        assert response.read() == b"0123456789"[start : start + 1]
        sockets.append(connection.sock)
    connection.close()
    assert sockets[0] is not None and all(s is sockets[0] for s in sockets)


def test_concurrent_clients_each_get_their_bytes_and_totals_stay_exact(s3_proxy: LoopbackProxy, s3_bucket: str) -> None:
    blobs = {f"obj{i}": os.urandom(100_000 + i) for i in range(8)}
    for key, blob in blobs.items():
        _put(s3_proxy, s3_bucket, key, blob)
    s3_proxy.reset_counters()
    client = S3Endpoint(s3_proxy.url).boto3_client(max_pool_connections=8)
    results: dict[str, bytes] = {}

    def fetch(key: str) -> None:
        for _ in range(3):
            results[key] = client.get_object(Bucket=s3_bucket, Key=key)["Body"].read()

    threads = [threading.Thread(target=fetch, args=(key,)) for key in blobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == blobs
    traffic = s3_proxy.traffic()
    assert traffic.requests("GET") == 3 * len(blobs)
    assert traffic.response_bytes("GET") == 3 * sum(len(b) for b in blobs.values())


def test_chunked_request_bodies_are_forwarded_and_counted_by_payload(
    s3_server: MotoS3Server, s3_proxy: LoopbackProxy, s3_bucket: str
) -> None:
    s3_server.endpoint.boto3_client().put_bucket_acl(Bucket=s3_bucket, ACL="public-read-write")
    parts = [os.urandom(1000), os.urandom(70_000), b"!"]
    connection = _connection(s3_proxy.url)
    connection.request("PUT", f"/{s3_bucket}/chunked", body=iter(parts), encode_chunked=True)
    assert connection.getresponse().status == 200
    connection.close()
    stored = s3_server.endpoint.boto3_client().get_object(Bucket=s3_bucket, Key="chunked")
    assert stored["Body"].read() == b"".join(parts)
    assert s3_proxy.traffic().request_bytes("PUT", key="chunked") == 71_001


def test_obstore_and_s3fs_clients_work_through_the_proxy(s3_proxy: LoopbackProxy, s3_bucket: str) -> None:
    obstore = pytest.importorskip("obstore")
    s3fs = pytest.importorskip("s3fs")
    from obstore.store import S3Store

    endpoint = S3Endpoint(s3_proxy.url)
    store = S3Store(s3_bucket, **endpoint.obstore_options())
    blob = os.urandom(300_000)
    obstore.put(store, "via/obstore", blob)
    assert bytes(obstore.get_range(store, "via/obstore", start=10, end=1010)) == blob[10:1010]
    filesystem = s3fs.S3FileSystem(**endpoint.s3fs_storage_options(), skip_instance_cache=True)
    assert filesystem.cat_file(f"{s3_bucket}/via/obstore") == blob
    traffic = s3_proxy.traffic()
    assert traffic.request_bytes("PUT", key="via/obstore") == 300_000
    assert traffic.response_bytes("GET", key="via/obstore") == 1000 + 300_000


def test_default_clients_find_the_fake_credentials(s3_server: MotoS3Server, s3_bucket: str) -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=s3_server.endpoint_url)
    assert client.list_objects_v2(Bucket=s3_bucket).get("KeyCount") == 0
    assert os.environ["AWS_ACCESS_KEY_ID"] == s3_server.endpoint.access_key_id


# faults


def test_injected_503_reaches_a_plain_client_as_an_s3_slowdown_error(s3_proxy: LoopbackProxy, s3_bucket: str) -> None:
    _put(s3_proxy, s3_bucket, "k", b"payload")
    s3_proxy.inject(Fault.UNAVAILABLE, method="GET", key="/k")
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(f"{s3_proxy.url}/{s3_bucket}/k", timeout=10)
    assert raised.value.code == 503
    assert b"<Code>SlowDown</Code>" in raised.value.read()
    raised.value.close()
    with urllib.request.urlopen(f"{s3_proxy.url}/{s3_bucket}/k", timeout=10) as response:
        assert response.read() == b"payload"
    assert s3_proxy.traffic().faults("GET") == 1


def test_injected_503_reaches_boto3_without_retries_as_a_client_error(s3_proxy: LoopbackProxy, s3_bucket: str) -> None:
    from botocore.exceptions import ClientError

    s3_proxy.inject("503", method="PUT")
    with pytest.raises(ClientError) as raised:
        _no_retries(s3_proxy).put_object(Bucket=s3_bucket, Key="k", Body=b"x" * 1000)
    assert raised.value.response["Error"]["Code"] == "SlowDown"
    assert raised.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503
    assert s3_proxy.traffic().request_bytes("PUT") == 1000


def test_injected_reset_raises_a_connection_error_in_a_plain_client(s3_proxy: LoopbackProxy, s3_bucket: str) -> None:
    _put(s3_proxy, s3_bucket, "k", os.urandom(1_000_000))
    s3_proxy.inject(Fault.RESET, key="/k")
    connection = _connection(s3_proxy.url)
    with pytest.raises(ConnectionError):
        connection.request("GET", f"/{s3_bucket}/k")
        connection.getresponse().read()
    connection.close()
    assert s3_proxy.traffic().response_bytes("GET") == 500_000


def test_injected_truncation_raises_an_incomplete_read(s3_proxy: LoopbackProxy, s3_bucket: str) -> None:
    _put(s3_proxy, s3_bucket, "k", os.urandom(200_000))
    s3_proxy.inject(Fault.TRUNCATE, key="/k", after_bytes=12_345)
    connection = _connection(s3_proxy.url)
    connection.request("GET", f"/{s3_bucket}/k")
    response = connection.getresponse()
    assert response.getheader("Content-Length") == "200000"
    with pytest.raises(http.client.IncompleteRead) as raised:
        response.read()
    assert len(raised.value.partial) == 12_345
    connection.close()


def test_a_cut_past_the_end_still_withholds_the_last_byte(s3_proxy: LoopbackProxy, s3_bucket: str) -> None:
    _put(s3_proxy, s3_bucket, "k", b"0123456789")
    s3_proxy.inject(Fault.TRUNCATE, key="/k", after_bytes=1_000)
    with urllib.request.urlopen(f"{s3_proxy.url}/{s3_bucket}/k", timeout=10) as response:
        with pytest.raises(http.client.IncompleteRead) as raised:
            response.read()
    assert raised.value.partial == b"012345678"


def test_injected_truncation_raises_in_boto3_when_the_body_is_read(s3_proxy: LoopbackProxy, s3_bucket: str) -> None:
    from botocore.exceptions import ResponseStreamingError

    _put(s3_proxy, s3_bucket, "k", os.urandom(100_000))
    s3_proxy.inject(Fault.TRUNCATE, method="GET")
    body = _no_retries(s3_proxy).get_object(Bucket=s3_bucket, Key="k")["Body"]
    with pytest.raises(ResponseStreamingError, match="IncompleteRead"):
        body.read()


def test_faults_hit_only_the_next_n_requests_matching_method_and_key(s3_proxy: LoopbackProxy, s3_bucket: str) -> None:
    _put(s3_proxy, s3_bucket, "hot", b"h")
    _put(s3_proxy, s3_bucket, "cold", b"c")
    rule = s3_proxy.inject(Fault.UNAVAILABLE, 2, method="GET", key="hot")

    def status(method: str, key: str) -> int:
        connection = _connection(s3_proxy.url)
        connection.request(method, f"/{s3_bucket}/{key}")
        response = connection.getresponse()
        response.read()
        connection.close()
        return response.status

    assert status("HEAD", "hot") == 200
    assert status("GET", "cold") == 200
    assert [status("GET", "hot") for _ in range(3)] == [503, 503, 200]
    assert s3_proxy.pending_faults() == []
    assert (rule.fired, rule.remaining) == (2, 0)
    assert s3_proxy.traffic().faults() == 2


# the directory server, and the proxy in front of any upstream


def test_directory_server_serves_files_and_ranges_through_the_proxy(
    tmp_path: Path, make_proxy: Callable[..., LoopbackProxy]
) -> None:
    blob = os.urandom(50_000)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "shard 1.bin").write_bytes(blob)
    with serve_directory(tmp_path) as server:
        proxy = make_proxy(server.url)
        url = f"{proxy.url}/sub/shard%201.bin"
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.read() == blob
        request = urllib.request.Request(url, headers={"Range": "bytes=100-199"})
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 206
            assert response.headers["Content-Range"] == "bytes 100-199/50000"
            assert response.read() == blob[100:200]
        for missing in ("/nothing", "/sub", "/../etc/passwd", "/sub/..%2F..%2Fetc%2Fpasswd"):
            with pytest.raises(urllib.error.HTTPError) as raised:
                urllib.request.urlopen(f"{proxy.url}{missing}", timeout=10)
            assert raised.value.code == 404
            raised.value.close()
        assert proxy.traffic().response_bytes(key="shard 1.bin") == 50_000 + 100


def test_a_range_past_the_end_is_refused_with_416(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"abc")
    with serve_directory(tmp_path) as server:
        request = urllib.request.Request(f"{server.url}/f", headers={"Range": "bytes=3-"})
        with pytest.raises(urllib.error.HTTPError) as raised:
            urllib.request.urlopen(request, timeout=10)
        assert raised.value.code == 416
        raised.value.close()


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("bytes=0-0", (0, 1)),
        ("bytes=2-", (2, 10)),
        ("bytes=5-100", (5, 10)),
        ("bytes=-3", (7, 10)),
        ("bytes=-30", (0, 10)),
        ("bytes=10-", None),
        ("bytes=-0", None),
    ],
)
def test_parse_range_maps_a_single_range_to_half_open_bounds(header: str, expected: tuple[int, int] | None) -> None:
    assert parse_range(header, 10) == expected


@pytest.mark.parametrize("header", ["bytes=0-1,4-5", "items=0-1", "bytes=5-2", "bytes=-"])
def test_parse_range_rejects_headers_it_does_not_serve(header: str) -> None:
    with pytest.raises(ValueError, match="Range"):
        parse_range(header, 10)


def test_proxy_refuses_an_upstream_that_is_not_http() -> None:
    with pytest.raises(ValueError, match="ftp://x"):
        LoopbackProxy("ftp://x")


def test_token_bucket_refuses_a_rate_that_is_not_positive() -> None:
    with pytest.raises(ValueError, match="-5"):
        TokenBucket(-5)


def test_proxy_in_a_child_process_offers_the_same_controls(s3_server: MotoS3Server, s3_bucket: str) -> None:
    with ProxyProcess(s3_server.endpoint_url) as proxy:
        client = S3Endpoint(proxy.url).boto3_client(retries={"total_max_attempts": 1})
        client.put_object(Bucket=s3_bucket, Key="k", Body=b"a" * 777, ACL="public-read")
        assert client.get_object(Bucket=s3_bucket, Key="k", Range="bytes=0-9")["Body"].read() == (b"a" * 10)
        traffic = proxy.traffic()
        assert (traffic.request_bytes("PUT"), traffic.response_bytes("GET")) == (777, 10)
        assert traffic.records[-1].range == "bytes=0-9"
        proxy.reset_counters()
        rule = proxy.inject(Fault.UNAVAILABLE, 2, method="GET", key="/k")
        assert proxy.pending_faults() == [rule]
        proxy.clear_faults()
        assert proxy.pending_faults() == []
        proxy.inject("truncate", method="GET")
        with urllib.request.urlopen(f"{proxy.url}/{s3_bucket}/k", timeout=10) as response:
            with pytest.raises(http.client.IncompleteRead):
                response.read()
        proxy.set_bandwidth(10_000_000)
        assert proxy.bandwidth == 10_000_000
        assert proxy.traffic().faults() == 1
        client.close()


# slow


@pytest.mark.slow
def test_throttled_download_takes_at_least_size_over_rate(s3_proxy: LoopbackProxy, s3_bucket: str) -> None:
    size, rate = 768 * 1024, 512 * 1024
    blob = os.urandom(size)
    _put(s3_proxy, s3_bucket, "k", blob)
    s3_proxy.set_bandwidth(rate)
    started = time.monotonic()
    with urllib.request.urlopen(f"{s3_proxy.url}/{s3_bucket}/k", timeout=30) as response:
        assert response.read() == blob
    elapsed = time.monotonic() - started
    assert elapsed >= 0.7 * size / rate
    s3_proxy.set_bandwidth(None)
    assert s3_proxy.bandwidth is None


@pytest.mark.slow
def test_a_child_process_reaches_the_server_through_the_endpoint_environment(
    s3_proxy: LoopbackProxy, s3_bucket: str
) -> None:
    _put(s3_proxy, s3_bucket, "k", b"from the parent")
    script = (
        "import boto3, sys;"
        f"body = boto3.client('s3').get_object(Bucket='{s3_bucket}', Key='k')['Body'].read();"
        "sys.stdout.write(body.decode())"
    )
    env = {**os.environ, **S3Endpoint(s3_proxy.url).env()}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert result.stdout == "from the parent", result.stderr
    assert s3_proxy.traffic().requests("GET", key="/k") == 1


@pytest.mark.slow
def test_the_server_process_exits_when_stopped() -> None:
    server = MotoS3Server().start()
    process = server._process
    assert process is not None and process.poll() is None
    server.stop()
    assert process.poll() is not None
