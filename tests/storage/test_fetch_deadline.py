"""Defect 5 of issue 18: every fetch has a total deadline and a minimum throughput.

A peer sending a byte every few seconds never trips a read timeout, and a silent one used to cost
(read timeout) x (attempts). Small configured limits keep these tests to seconds; the deadline
assertions are generous (several times the configured limit), never tight wall-clock bounds.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tierflow.errors import SourceError, SourceTimeout
from tierflow.storage._deadline import FetchLimits
from tierflow.storage.remote import RetryPolicy, RetryingStore

LIMITS = FetchLimits(deadline=0.3, slow_rate=1e9, min_throughput=50_000, window=0.1)
ROOMY = FetchLimits(deadline=2.0, slow_rate=1e9, min_throughput=50_000, window=0.1)  # for peers that must succeed
FAST = RetryPolicy(retries=3, base_delay=0.01, max_delay=0.02)
PAYLOAD = bytes(range(256)) * 400  # 102,400 bytes


class ScriptedPeer(RetryingStore):
    """A network source whose peer behaves as scripted: `pace(attempt)` -> seconds between chunks
    (None: silent for ever)."""

    scheme = "test"

    def __init__(self, pace, chunk: int = 8192, limits: FetchLimits = LIMITS, **options) -> None:
        super().__init__("test://peer/data", retry_policy=FAST, limits=limits, chunk_bytes=chunk, **options)
        self.pace = pace
        self.attempts = 0
        self.chunk = chunk
        self.hang = threading.Event()

    def _wait(self) -> None:
        gap = self.pace(self.attempts)
        if gap is None:
            self.hang.wait(30)  # silent (released at the end of the test)
        else:
            time.sleep(gap)

    def _head(self, key: str) -> int:
        self.attempts += 1
        self._wait()
        return len(PAYLOAD)

    def _get_range(self, key: str, offset: int, length: int) -> bytes:
        self.attempts += 1
        self._wait()
        return PAYLOAD[offset : offset + length]

    def _get(self, key: str) -> bytes:
        return self._get_range(key, 0, len(PAYLOAD))

    def _stream(self, key: str, offset: int) -> tuple[int, Iterator[bytes]]:
        self.attempts += 1

        def chunks() -> Iterator[bytes]:
            for at in range(offset, len(PAYLOAD), self.chunk):
                self._wait()
                yield PAYLOAD[at : at + self.chunk]

        return len(PAYLOAD), chunks()


@pytest.fixture
def peers():
    made: list[ScriptedPeer] = []

    def make(pace, **options) -> ScriptedPeer:
        made.append(ScriptedPeer(pace, **options))
        return made[-1]

    yield make
    for peer in made:
        peer.hang.set()


def timed(fn):
    started = time.monotonic()
    try:
        return fn(), time.monotonic() - started
    except Exception as e:
        return e, time.monotonic() - started


def test_a_drip_feeding_peer_is_cut_and_fails_typed_naming_the_url(peers):
    peer = peers(lambda attempt: 0.02, chunk=1)  # one byte every 20 ms: 50 B/s, far below the minimum
    out = bytearray()
    error, seconds = timed(lambda: peer.read_into("shard-x.arrow", out.extend))
    assert isinstance(error, SourceTimeout), error
    assert "test://peer/data/shard-x.arrow" in str(error)
    assert seconds < 5 * LIMITS.deadline
    assert peer.attempts >= 2  # a stalled attempt is retried while the deadline lasts


def test_a_silent_peer_fails_at_the_deadline_not_after_every_read_timeout(peers):
    from concurrent.futures import ThreadPoolExecutor

    peer = peers(lambda attempt: None)
    calls = (
        lambda: peer.read_into("s.arrow", lambda chunk: None),
        lambda: peer.read_range("s.arrow", 0, 100),
        lambda: peer.read_bytes("manifest.json"),
        lambda: peer.size("s.arrow"),
    )
    with ThreadPoolExecutor(len(calls)) as pool:  # each operation has a deadline of its own: wait for them at once
        outcomes = list(pool.map(timed, calls))
    for error, seconds in outcomes:
        assert isinstance(error, SourceTimeout) and isinstance(error, TimeoutError), error
        assert "test://peer/data/" in str(error)
        assert seconds < 5 * LIMITS.deadline


def test_a_stalled_attempt_is_retried_and_the_download_resumes(peers):
    peer = peers(lambda attempt: None if attempt == 1 else 0.0, limits=ROOMY)
    out = bytearray()
    assert peer.read_into("s.arrow", out.extend) == len(PAYLOAD)
    assert bytes(out) == PAYLOAD and peer.attempts == 2


def test_a_slow_but_sufficient_peer_is_not_cut(peers):
    peer = peers(lambda attempt: 0.01, limits=ROOMY)  # 8 KiB every 10 ms: ~800 KB/s against a 50 KB/s minimum
    out = bytearray()
    assert peer.read_into("s.arrow", out.extend) == len(PAYLOAD) and peer.attempts == 1


def test_time_the_caller_holds_a_download_back_does_not_count(peers):
    peer = peers(lambda attempt: 0.0, chunk=len(PAYLOAD) // 4)

    def slow_disk(chunk) -> None:
        time.sleep(LIMITS.deadline / 2)  # twice the deadline in all: a budget or a disk, not the peer

    assert peer.read_into("s.arrow", slow_disk) == len(PAYLOAD) and peer.attempts == 1


def test_limits_are_configurable_and_checked(monkeypatch):
    monkeypatch.setenv("TIERFLOW_FETCH_DEADLINE", "7.5")
    assert FetchLimits.from_env().deadline == 7.5
    assert FetchLimits().total(256 << 20) > 256 / 0.25  # a 256 MB shard gets over 17 minutes at worst
    with pytest.raises(ValueError):
        FetchLimits(min_throughput=0)


def test_the_timeout_error_survives_a_process_boundary():
    error = SourceTimeout("s3://b/p", "shard-1.arrow", "download outlived its 30 s deadline", 3)
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is SourceTimeout and str(again) == str(error) and isinstance(again, SourceError)


def test_s3_behind_a_stalling_proxy_fails_at_the_deadline(s3_proxy, s3_bucket, tmp_path: Path):
    from tierflow.storage.s3 import S3Store

    source = S3Store(
        f"s3://{s3_bucket}/data", endpoint_url=s3_proxy.url, retry_policy=FAST, limits=LIMITS, chunk_bytes=64 << 10
    )
    blob = tmp_path / "blob.bin"
    blob.write_bytes(PAYLOAD * 4)
    source.upload(blob, "shard-x.arrow")
    s3_proxy.set_bandwidth(1.0)  # after its first burst, a kilobyte every 17 minutes: a stalled peer
    try:
        error, seconds = timed(lambda: source.download("shard-x.arrow", tmp_path / "out.bin"))
    finally:
        s3_proxy.set_bandwidth(None)
    assert isinstance(error, SourceTimeout), error
    assert f"s3://{s3_bucket}/data/shard-x.arrow" in str(error)
    assert seconds < 10 * LIMITS.deadline
