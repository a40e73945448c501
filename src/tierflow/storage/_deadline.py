"""Deadlines for fetches and uploads: a total time per operation and a minimum throughput per attempt.

A client's read timeout only notices silence: a peer sending one byte every 3 s never trips it,
and a silent one costs (read timeout) x (attempts) (181 s with the defaults). So every source
operation gets a deadline of its own, `FetchLimits.total(size)`, spent only while waiting on the
peer (not while the node's bandwidth budget or the caller's disk holds a download back), and
each attempt must keep up `min_throughput`: a chunk that does not arrive within
`chunk_wait(chunk_bytes)`, or an attempt averaging less once `window` seconds of waiting have
passed, is cut and retried (a download resumes from its last byte). Past the deadline the
operation fails with `SourceTimeout` naming the URL.

The blocking read runs in a daemon thread the caller waits on with a timeout, since neither
obstore nor fsspec can be interrupted mid-read; a thread abandoned on a silent peer ends when the
client's own read timeout fires, and holds at most one chunk.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

_T = TypeVar("_T")


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


@dataclass(frozen=True)
class FetchLimits:
    """How long a source operation may wait on its peer, and how slow an attempt may be.

    `total(nbytes)` = `deadline` + nbytes / `slow_rate`: 30 s for a manifest or a block, ~17 min
    for a 256 MB shard at 256 KiB/s. An attempt below `min_throughput` (64 KiB/s) over `window`
    (10 s) of waiting is cut. TIERFLOW_FETCH_DEADLINE and TIERFLOW_FETCH_MIN_THROUGHPUT set the
    defaults for a whole job."""

    deadline: float = 30.0
    slow_rate: float = 256 << 10
    min_throughput: float = 64 << 10
    window: float = 10.0

    @classmethod
    def from_env(cls) -> FetchLimits:
        return cls(
            deadline=_env_float("TIERFLOW_FETCH_DEADLINE", cls.deadline),
            min_throughput=_env_float("TIERFLOW_FETCH_MIN_THROUGHPUT", cls.min_throughput),
        )

    def __post_init__(self) -> None:
        if min(self.deadline, self.slow_rate, self.min_throughput, self.window) <= 0:
            raise ValueError(f"fetch limits must be positive: {self}")

    def total(self, nbytes: int | None) -> float:
        """Seconds an operation moving `nbytes` (None: unknown) may wait on its peer, retries included."""
        return self.deadline + (nbytes or 0) / self.slow_rate

    def chunk_wait(self, chunk_bytes: int) -> float:
        """Seconds one chunk (or one whole small request) may take to arrive."""
        return max(self.window, chunk_bytes / self.min_throughput)


class Deadline:
    """An operation's budget of time spent waiting on its peer."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.spent = 0.0

    def left(self) -> float:
        return self.seconds - self.spent


class Stalled(TimeoutError):
    """One attempt was too slow or silent; retried (transient) while the deadline lasts."""


def _never_held() -> float:
    return 0.0


def call_within(
    fn: Callable[[], _T], seconds: float, deadline: Deadline, what: str, held: Callable[[], float] = _never_held
) -> _T:
    """fn(), run in a daemon thread, waited for at most `seconds` (and what is left of `deadline`).

    A call that paces itself (an upload pulling its body through the bandwidth budget) says through
    `held()` how many seconds it has spent held back by the pacing: they count against neither
    `seconds` nor `deadline`, only the time spent waiting on the peer does."""
    box: queue.Queue = queue.Queue(maxsize=1)

    def run() -> None:
        try:
            box.put((True, fn()))
        except BaseException as exc:  # handed to the caller
            box.put((False, exc))

    limit = max(0.0, min(seconds, deadline.left()))
    started = time.monotonic()
    threading.Thread(target=run, daemon=True, name="tierflow-call").start()
    try:
        while True:
            left = limit - (time.monotonic() - started - held())
            if left <= 0:
                raise Stalled(f"{what}: no answer within {limit:.3g} s")
            try:
                ok, value = box.get(timeout=min(left, 1.0))
                break
            except queue.Empty:
                continue
    finally:
        deadline.spent += max(0.0, time.monotonic() - started - held())
    if not ok:
        raise value
    return value


class GuardedChunks:
    """The chunks of a stream, each awaited with a timeout; enforces the minimum throughput.

    A daemon thread pulls the stream into a queue of two (memory: two chunks); `close()` tells it
    to stop and close the stream once its current read returns."""

    _END = object()

    def __init__(
        self, chunks: Iterator[Any], limits: FetchLimits, deadline: Deadline, chunk_bytes: int, what: str
    ) -> None:
        self._limits, self._deadline, self._what = limits, deadline, what
        self._wait = limits.chunk_wait(chunk_bytes)
        self._queue: queue.Queue = queue.Queue(maxsize=2)
        self._stop = threading.Event()
        self._waited = 0.0
        self._bytes = 0
        self._thread = threading.Thread(target=self._pump, args=(chunks,), daemon=True, name="tierflow-fetch")
        self._thread.start()

    def _pump(self, chunks: Iterator[Any]) -> None:
        try:
            for chunk in chunks:
                while not self._stop.is_set():
                    try:
                        self._queue.put((True, chunk), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    break
            item: tuple[bool, Any] = (True, self._END)
        except BaseException as exc:  # handed to the consumer
            item = (False, exc)
        finally:
            close = getattr(chunks, "close", None)
            if close is not None and self._stop.is_set():
                try:
                    close()
                except Exception:  # the stream is abandoned either way
                    pass
        if not self._stop.is_set():
            self._queue.put(item)

    def __iter__(self) -> GuardedChunks:
        return self

    def __next__(self) -> Any:
        limit = max(0.0, min(self._wait, self._deadline.left()))
        started = time.monotonic()
        try:
            ok, value = self._queue.get(timeout=limit)
        except queue.Empty:
            raise Stalled(f"{self._what}: no data for {limit:.3g} s after {self._bytes} bytes") from None
        finally:
            elapsed = time.monotonic() - started
            self._waited += elapsed
            self._deadline.spent += elapsed
        if not ok:
            raise value
        if value is self._END:
            raise StopIteration
        self._bytes += len(value)
        limits = self._limits
        if self._waited > limits.window and self._bytes < limits.min_throughput * self._waited:
            raise Stalled(
                f"{self._what}: {self._bytes / self._waited:.0f} B/s over {self._waited:.3g} s, "
                f"below the minimum of {limits.min_throughput:.0f} B/s"
            )
        return value

    def close(self) -> None:
        self._stop.set()
