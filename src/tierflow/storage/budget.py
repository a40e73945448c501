"""The node-wide bandwidth budget: one token bucket shared by every process that moves bytes.

Fetches, prefetches and checkpoint uploads on a node all charge the same bucket, kept in a small
file (by default under /dev/shm) and updated under `flock`, so the node as a whole stays within
its rate. Demand reads take priority: low-priority traffic never takes the last `reserve`
fraction of the bucket, so background work cannot delay a read the training loop waits on.
"""

from __future__ import annotations

import fcntl
import math
import os
import struct
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Literal

from tierflow.telemetry.metrics import MetricsRegistry

Priority = Literal["high", "low"]

_MAGIC = b"TFBUDG01"
_STATE = struct.Struct("<8sdddd")  # magic, rate, burst, tokens, monotonic stamp
_LONGEST_SLEEP = 0.1  # a waiting low-priority caller re-reads the shared state this often


def default_budget_path(name: str = "fetch") -> Path:
    """Where a node's budget lives unless told otherwise: tmpfs, so it dies with the node's boot."""
    shm = Path("/dev/shm")
    root = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return root / f"tierflow-bandwidth-{name}"


def refilled(tokens: float, stamp: float, now: float, rate: float, burst: float) -> float:
    """Tokens in a bucket at `now` that held `tokens` at `stamp` (debt, a negative count, is repaid first)."""
    if now <= stamp:
        return min(tokens, burst)
    return min(burst, tokens + (now - stamp) * rate)


class BandwidthBudget:
    """A token bucket of `rate_bytes_per_s` shared by every process that opens the same `path`.

    `burst` is the bucket's depth (default: a tenth of a second of traffic, at least 1 MiB);
    `reserve` is the fraction of it that only high-priority callers may take. `rate=None` means
    unlimited: `acquire` returns at once and touches no file. The rate and burst most recently
    configured on a node win; a process that finds different ones in the file warns and
    overwrites them.
    """

    def __init__(
        self,
        rate_bytes_per_s: float | None,
        path: str | os.PathLike[str] | None = None,
        burst: int | None = None,
        *,
        reserve: float = 0.25,
        registry: MetricsRegistry | None = None,
    ) -> None:
        if rate_bytes_per_s is not None and not (rate_bytes_per_s > 0 and math.isfinite(rate_bytes_per_s)):
            raise ValueError(f"bandwidth budget rate must be a positive number or None, got {rate_bytes_per_s!r}")
        if not 0.0 <= reserve < 1.0:
            raise ValueError(f"bandwidth budget reserve must be in [0, 1), got {reserve!r}")
        self.rate = float(rate_bytes_per_s) if rate_bytes_per_s is not None else None
        self.burst = float(burst) if burst is not None else max(1 << 20, (self.rate or 0.0) / 10)
        if self.burst <= 0:
            raise ValueError(f"bandwidth budget burst must be positive, got {burst!r}")
        self.reserve = reserve
        self.path = Path(path) if path is not None else default_budget_path()
        self.waited_seconds: dict[str, float] = {"high": 0.0, "low": 0.0}
        self.acquired_bytes: dict[str, int] = {"high": 0, "low": 0}
        self._registry = registry
        self._thread_lock = threading.Lock()
        self._lock_pid = os.getpid()
        self._fd: int | None = None
        self._fd_pid = -1
        if self.rate is not None:
            self._configure()

    @property
    def unlimited(self) -> bool:
        return self.rate is None

    def acquire(self, nbytes: int, priority: Priority = "high") -> float:
        """Block until `nbytes` may move; returns the seconds waited.

        High priority takes its tokens at once, into debt if need be, and sleeps the debt off,
        so concurrent high callers are served in arrival order at the shared rate. Low priority
        takes tokens only while at least the reserve stays in the bucket, in pieces small
        enough to fit above it, and otherwise waits without taking anything.
        """
        if priority not in ("high", "low"):
            raise ValueError(f"bandwidth budget {self.path}: priority must be 'high' or 'low', not {priority!r}")
        if nbytes < 0:
            raise ValueError(f"bandwidth budget {self.path}: cannot acquire {nbytes} bytes")
        if self.rate is None or nbytes == 0:
            self._account(priority, nbytes, 0.0)
            return 0.0
        waited = self._acquire_high(nbytes) if priority == "high" else self._acquire_low(nbytes)
        self._account(priority, nbytes, waited)
        return waited

    def available(self) -> float:
        """Tokens in the shared bucket now (negative while high-priority callers are in debt)."""
        if self.rate is None:
            return math.inf
        with self._locked() as fd:
            tokens, _ = self._read(fd, time.monotonic())
        return tokens

    def close(self) -> None:
        with self._thread_lock:
            if self._fd is not None and self._fd_pid == os.getpid():
                os.close(self._fd)
            self._fd = None

    # the shared state

    def _acquire_high(self, nbytes: int) -> float:
        assert self.rate is not None
        with self._locked() as fd:
            now = time.monotonic()
            tokens, _ = self._read(fd, now)
            tokens -= nbytes
            self._write(fd, tokens, now)
        wait = -tokens / self.rate if tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)
        return wait

    def _acquire_low(self, nbytes: int) -> float:
        assert self.rate is not None
        floor = self.reserve * self.burst
        largest_piece = max(1, int(self.burst - floor))
        remaining = nbytes
        waited = 0.0
        while remaining > 0:
            piece = min(remaining, largest_piece)
            with self._locked() as fd:
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

    def _configure(self) -> None:
        with self._locked() as fd:
            state = self._decode(os.pread(fd, _STATE.size, 0))
            now = time.monotonic()
            if state is None:
                self._write(fd, self.burst, now)
                return
            rate, burst, tokens, stamp = state
            if (rate, burst) != (self.rate, self.burst):
                warnings.warn(
                    f"bandwidth budget {self.path} was configured as {rate:.0f} B/s (burst {burst:.0f} B); "
                    f"now {self.rate:.0f} B/s (burst {self.burst:.0f} B) for every process on this node",
                    stacklevel=3,
                )
                self._write(fd, min(tokens, self.burst), stamp)

    def _read(self, fd: int, now: float) -> tuple[float, float]:
        assert self.rate is not None
        state = self._decode(os.pread(fd, _STATE.size, 0))
        if state is None:
            return self.burst, now
        _, _, tokens, stamp = state
        if stamp > now:  # written before a reboot, on a path that outlived it
            stamp = now
        return refilled(tokens, stamp, now, self.rate, self.burst), now

    def _write(self, fd: int, tokens: float, stamp: float) -> None:
        assert self.rate is not None
        os.pwrite(fd, _STATE.pack(_MAGIC, self.rate, self.burst, tokens, stamp), 0)

    def _decode(self, raw: bytes) -> tuple[float, float, float, float] | None:
        """The stored (rate, burst, tokens, stamp), or None for a missing or unreadable state."""
        if len(raw) != _STATE.size:
            return None
        magic, rate, burst, tokens, stamp = _STATE.unpack(raw)
        if magic != _MAGIC or not all(math.isfinite(v) for v in (rate, burst, tokens, stamp)):
            return None
        if rate <= 0 or burst <= 0:
            return None
        return rate, burst, tokens, stamp

    def _locked(self) -> _StateLock:
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
        rate = "unlimited" if self.rate is None else f"{self.rate:.0f} B/s"
        return f"BandwidthBudget({rate}, path={str(self.path)!r}, burst={self.burst:.0f}, reserve={self.reserve})"

    def __getstate__(self) -> dict[str, object]:
        state = self.__dict__.copy()
        state.update(_thread_lock=None, _lock_pid=-1, _fd=None, _fd_pid=-1)
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._thread_lock = threading.Lock()


class _StateLock:
    """Holds the thread lock (flock is per open file, shared by threads) and then the file lock."""

    def __init__(self, budget: BandwidthBudget) -> None:
        self.budget = budget

    def __enter__(self) -> int:
        if self.budget._lock_pid != os.getpid():  # a forked child: the parent's lock state is not ours
            self.budget._thread_lock = threading.Lock()
            self.budget._lock_pid = os.getpid()
        self.budget._thread_lock.acquire()
        try:
            fd = self.budget._descriptor()
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            self.budget._thread_lock.release()
            raise
        self.fd = fd
        return fd

    def __exit__(self, *exc: object) -> None:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        finally:
            self.budget._thread_lock.release()
