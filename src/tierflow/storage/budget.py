"""Bandwidth budgets: token buckets shared through small files (by default under /dev/shm).

Two buckets may govern a transfer. The node's: an operator sets it with TIERFLOW_NODE_BANDWIDTH
(bytes/s) in the environment of the node's jobs, and every tierflow process there charges it, so
the node as a whole stays within its rate. A job's own cap (`--bandwidth`, `bandwidth=`): the job
can only take less for itself; its bucket is private to the job (its process and workers), and
removed when the job exits, so nothing it set changes another job. The rates live in each
process's configuration, never in the files: a file holds tokens, nothing a later job inherits.
Demand reads take priority: low-priority traffic never takes the last `reserve` fraction of a
bucket, so background work cannot delay a read the training loop waits on.
"""

from __future__ import annotations

import atexit
import fcntl
import math
import os
import secrets
import struct
import tempfile
import threading
import time
from pathlib import Path
from typing import Literal, cast

from tierflow.telemetry.metrics import MetricsRegistry

Priority = Literal["high", "low"]

NODE_BANDWIDTH_ENV = "TIERFLOW_NODE_BANDWIDTH"
"""The node's budget in bytes/s (e.g. 2e9), set by the operator for every job on the node; unset: none."""

_MAGIC = b"TFBUDG02"
_STATE = struct.Struct("<8sdd")  # magic, tokens, monotonic stamp: no rate, which is each process's own
_LONGEST_SLEEP = 0.1  # a waiting low-priority caller re-reads the shared state this often
_UNSET = object()


def budget_root() -> Path:
    """Where budget files live: tmpfs, so a node's state dies with its boot."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def node_bandwidth() -> float | None:
    """The node budget the operator set (TIERFLOW_NODE_BANDWIDTH, bytes/s), or None."""
    text = os.environ.get(NODE_BANDWIDTH_ENV, "").strip()
    if not text:
        return None
    try:
        rate = float(text)
    except ValueError:
        rate = math.nan
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(
            f"{NODE_BANDWIDTH_ENV}={text!r}: the node bandwidth budget must be a positive number of bytes/s (e.g. 2e9)"
        )
    return rate


def refilled(tokens: float, stamp: float, now: float, rate: float, burst: float) -> float:
    """Tokens in a bucket at `now` that held `tokens` at `stamp` (debt, a negative count, is repaid first)."""
    if now <= stamp:
        return min(tokens, burst)
    return min(burst, tokens + (now - stamp) * rate)


class BandwidthBudget:
    """What a job's transfers charge: its own cap `rate_bytes_per_s`, if it asked for one, then the
    node's budget, if the operator set one (`node_rate`, default TIERFLOW_NODE_BANDWIDTH).

    The job's bucket lives at `path` when given (every process that opens it shares it), else in
    a file private to this process and its workers, removed when the process exits. `burst` is a
    bucket's depth (default: a tenth of a second of its traffic, at least 1 MiB); `reserve` is
    the fraction of it only high-priority callers may take. With neither rate, `acquire` only
    counts and touches no file.
    """

    def __init__(
        self,
        rate_bytes_per_s: float | None = None,
        path: str | os.PathLike[str] | None = None,
        burst: int | None = None,
        *,
        reserve: float = 0.25,
        registry: MetricsRegistry | None = None,
        node_rate: float | None | object = _UNSET,
        node_path: str | os.PathLike[str] | None = None,
    ) -> None:
        if not 0.0 <= reserve < 1.0:
            raise ValueError(f"bandwidth budget reserve must be in [0, 1), got {reserve!r}")
        node = node_bandwidth() if node_rate is _UNSET else cast("float | None", node_rate)
        self.reserve = reserve
        self.job = _Bucket(rate_bytes_per_s, path, burst, reserve) if rate_bytes_per_s is not None else None
        if self.job is not None and path is None:
            _private(self.job)
        self.node = (
            _Bucket(node, node_path or budget_root() / "tierflow-bandwidth-node", None, reserve)
            if node is not None
            else None
        )
        self.waited_seconds: dict[str, float] = {"high": 0.0, "low": 0.0}
        self.acquired_bytes: dict[str, int] = {"high": 0, "low": 0}
        self._registry = registry

    @property
    def rate(self) -> float | None:
        """The rate this job may move at most: the smaller of its cap and the node's; None: unlimited."""
        rates = [b.rate for b in (self.job, self.node) if b is not None]
        return min(rates) if rates else None

    @property
    def unlimited(self) -> bool:
        return self.rate is None

    @property
    def path(self) -> Path | None:
        """The job's bucket file (None without a cap of its own)."""
        return self.job.path if self.job is not None else None

    @property
    def burst(self) -> float:
        return self.job.burst if self.job is not None else self.node.burst if self.node is not None else math.inf

    def acquire(self, nbytes: int, priority: Priority = "high") -> float:
        """Block until `nbytes` may move, under the job's cap and then the node's; returns the seconds waited.

        High priority takes its tokens at once, into debt if need be, and sleeps the debt off,
        so concurrent high callers are served in arrival order at the shared rate. Low priority
        takes tokens only while at least the reserve stays in the bucket, in pieces small
        enough to fit above it, and otherwise waits without taking anything.
        """
        if priority not in ("high", "low"):
            raise ValueError(f"bandwidth budget: priority must be 'high' or 'low', not {priority!r}")
        if nbytes < 0:
            raise ValueError(f"bandwidth budget: cannot acquire {nbytes} bytes")
        waited = 0.0
        if nbytes:
            for bucket in (self.job, self.node):
                if bucket is not None:
                    waited += bucket.acquire(nbytes, priority)
        self._account(priority, nbytes, waited)
        return waited

    def available(self) -> float:
        """Tokens this job could take now (negative while high-priority callers are in debt)."""
        return min((b.available() for b in (self.job, self.node) if b is not None), default=math.inf)

    def close(self) -> None:
        for bucket in (self.job, self.node):
            if bucket is not None:
                bucket.close()

    def _locked(self) -> _StateLock:
        """The job bucket's lock (tests hold it to make others wait)."""
        assert self.job is not None
        return self.job.locked()

    def _account(self, priority: str, nbytes: int, waited: float) -> None:
        self.waited_seconds[priority] += waited
        self.acquired_bytes[priority] += nbytes
        if self._registry is not None:
            labels = {"priority": priority}
            self._registry.counter(
                "tierflow_budget_bytes_total", labels, "bytes charged to the node's bandwidth budget"
            ).inc(nbytes)
            self._registry.counter(
                "tierflow_budget_wait_seconds_total", labels, "seconds callers waited on the bandwidth budget"
            ).inc(waited)

    def __repr__(self) -> str:
        job = "none" if self.job is None else f"{self.job.rate:.0f} B/s at {str(self.job.path)!r}"
        node = "none" if self.node is None else f"{self.node.rate:.0f} B/s"
        return f"BandwidthBudget(job cap {job}, node {node}, reserve={self.reserve})"


class _Bucket:
    """One token bucket of `rate` shared by every process that opens `path` (updated under flock)."""

    def __init__(self, rate: float, path: str | os.PathLike[str] | None, burst: int | None, reserve: float) -> None:
        if not (rate > 0 and math.isfinite(rate)):
            raise ValueError(f"bandwidth budget rate must be a positive number or None, got {rate!r}")
        self.rate = float(rate)
        self.burst = float(burst) if burst is not None else max(1 << 20, self.rate / 10)
        if self.burst <= 0:
            raise ValueError(f"bandwidth budget burst must be positive, got {burst!r}")
        self.reserve = reserve
        self.path = (
            Path(path)
            if path is not None
            else budget_root() / f"tierflow-bandwidth-job-{os.getpid()}-{secrets.token_hex(4)}"
        )
        self._thread_lock = threading.Lock()
        self._lock_pid = os.getpid()
        self._fd: int | None = None
        self._fd_pid = -1
        self._descriptor()  # fails here, naming the file, rather than on the first transfer

    def acquire(self, nbytes: int, priority: Priority) -> float:
        return self._acquire_high(nbytes) if priority == "high" else self._acquire_low(nbytes)

    def available(self) -> float:
        with self.locked() as fd:
            tokens, _ = self._read(fd, time.monotonic())
        return tokens

    def close(self) -> None:
        with self._thread_lock:
            if self._fd is not None and self._fd_pid == os.getpid():
                os.close(self._fd)
            self._fd = None

    def _acquire_high(self, nbytes: int) -> float:
        with self.locked() as fd:
            now = time.monotonic()
            tokens, _ = self._read(fd, now)
            tokens -= nbytes
            self._write(fd, tokens, now)
        wait = -tokens / self.rate if tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)
        return wait

    def _acquire_low(self, nbytes: int) -> float:
        floor = self.reserve * self.burst
        largest_piece = max(1, int(self.burst - floor))
        remaining = nbytes
        waited = 0.0
        while remaining > 0:
            piece = min(remaining, largest_piece)
            with self.locked() as fd:
                now = time.monotonic()
                tokens, _ = self._read(fd, now)
                shortfall = floor + piece - tokens
                if shortfall <= 0:
                    self._write(fd, tokens - piece, now)
                    remaining -= piece
                    continue
            pause = min(_LONGEST_SLEEP, shortfall / self.rate)
            time.sleep(pause)
            waited += pause
        return waited

    def _read(self, fd: int, now: float) -> tuple[float, float]:
        """(tokens, stamp) now; a missing or unreadable state is a full bucket."""
        raw = os.pread(fd, _STATE.size, 0)
        if len(raw) != _STATE.size:
            return self.burst, now
        magic, tokens, stamp = _STATE.unpack(raw)
        if magic != _MAGIC or not (math.isfinite(tokens) and math.isfinite(stamp)):
            return self.burst, now
        if stamp > now:  # written before a reboot, on a path that outlived it
            stamp = now
        return refilled(tokens, stamp, now, self.rate, self.burst), now

    def _write(self, fd: int, tokens: float, stamp: float) -> None:
        os.pwrite(fd, _STATE.pack(_MAGIC, tokens, stamp), 0)

    def locked(self) -> _StateLock:
        return _StateLock(self)

    def _descriptor(self) -> int:
        """This process's own open file: a descriptor inherited across fork shares its flock."""
        pid = os.getpid()
        if self._fd is None or self._fd_pid != pid:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
            except OSError as exc:
                raise OSError(exc.errno, f"cannot open bandwidth budget {self.path}: {exc.strerror}") from exc
            self._fd_pid = pid
        return self._fd

    def __getstate__(self) -> dict[str, object]:
        state = self.__dict__.copy()
        state.update(_thread_lock=None, _lock_pid=-1, _fd=None, _fd_pid=-1)
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._thread_lock = threading.Lock()


class _StateLock:
    """Holds the thread lock (flock is per open file, shared by threads) and then the file lock."""

    def __init__(self, bucket: _Bucket) -> None:
        self.bucket = bucket

    def __enter__(self) -> int:
        if self.bucket._lock_pid != os.getpid():  # a forked child: the parent's lock state is not ours
            self.bucket._thread_lock = threading.Lock()
            self.bucket._lock_pid = os.getpid()
        self.bucket._thread_lock.acquire()
        try:
            fd = self.bucket._descriptor()
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            self.bucket._thread_lock.release()
            raise
        self.fd = fd
        return fd

    def __exit__(self, *exc: object) -> None:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        finally:
            self.bucket._thread_lock.release()


def _private(bucket: _Bucket) -> None:
    """A job's own bucket goes with the job: removed at its exit (not a worker's), and the files of
    jobs that died without exiting are swept when the next one starts."""
    owner = os.getpid()
    for stale in bucket.path.parent.glob("tierflow-bandwidth-job-*"):
        pid = stale.name.split("-")[3]
        if pid.isdigit() and int(pid) != owner and not _alive(int(pid)):
            stale.unlink(missing_ok=True)
    atexit.register(_remove, bucket.path, owner)


def _remove(path: Path, owner: int) -> None:
    if os.getpid() == owner:
        path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        return True
    return True
