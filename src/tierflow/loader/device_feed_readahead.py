"""How the device feed reads ahead of the training loop: inline, or from a background thread, or
(on the CPU by default) inline until the loop's first batches show a step a thread can hide behind.

A background thread that is still reading when the interpreter exits is stopped and joined by an
`atexit` hook: left running, it would be killed inside a torch call at finalization
(std::terminate, SIGABRT)."""

from __future__ import annotations

import atexit
import collections
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tierflow.loader.device_feed import DeviceFeed

_END = object()
_RUNNING: weakref.WeakSet[FeedIterator] = weakref.WeakSet()
"""Feed iterators whose background thread may still run; `_stop_running` ends them at exit."""


@atexit.register
def _stop_running() -> None:
    """Stop every feed thread before the interpreter finalizes. A daemon thread that is inside a
    torch call then (one that released the GIL) is killed when it takes the GIL back, by an unwind
    through a C++ destructor that may not throw: std::terminate, SIGABRT at the end of a script that
    broke out of its loop without close(). atexit runs before finalization, while threads still can."""
    for iterator in list(_RUNNING):
        iterator.close(timeout=10.0)


AUTO_DECIDE_AFTER = 32
"""Batches an automatic feed reads inline before it decides whether a background thread pays."""
AUTO_WARMUP_GAPS = 8
"""The loop's first gaps between batches, left out of the decision: they hold its first torch calls
and first metric updates (a loop with no step showed 0.8-1.4 ms, then 0.2 ms, then its steady ~40 us)."""
AUTO_MIN_STEP_S = 100e-6
"""A loop whose gaps between batches are at least this long (their lower quartile) gets the background
thread. The quartile, not the median: a loop with no step took ~110 us a gap for its first ~15
batches of a fresh process, then 10-40 us, and a median of its first gaps chose the thread, which
cost that loop ~20% (a real step is long in every gap, so its lower quartile is long too)."""


class FeedIterator:
    """One pass over the source: reads ahead inline or from a background thread.

    An automatic feed (`background=None` on the CPU) starts inline and measures the loop: a
    thread overlaps production with the step only where there is a step to hide it behind; with
    none (a raw read, a tiny eval model) the hand-over between threads and their turns at the GIL
    cost more per batch than building it, so it stays inline.
    """

    def __init__(self, feed: DeviceFeed) -> None:
        self._feed = feed
        self._source = iter(feed._batches)
        self._slot = 0
        self._closed = False
        self._pending: collections.deque[Any] = collections.deque()
        self.ready: Callable[[], int] = self._pending.__len__
        """Batches read and converted ahead of the loop right now (what telemetry asks per batch): the
        inline read-ahead's length, a C call; with a background thread, that and its queue's."""
        self._exhausted = False
        self._thread: threading.Thread | None = None
        self._gaps: list[float] | None = [] if feed._background is None else None
        self._returned: float | None = None
        if feed._background:
            self._start_thread()

    def _start_thread(self) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=self._feed.depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, name="tierflow-device-feed", daemon=True)
        self.ready = self._ready_with_thread
        _RUNNING.add(self)
        self._thread.start()

    def choose_again(self) -> None:
        """Measure the loop afresh (a new `for` reading on from an epoch edge): an automatic feed
        still inline decides again over the next AUTO_DECIDE_AFTER batches. A loop of no step that
        chose inline for the whole feed kept a stepped loop after it inline (benchmarks/cache.py's
        throughput after its unstepped epochs: 0.88 of the dry run through a 10 ms step, 1.00 with
        the thread)."""
        if self._thread is None and self._feed._background is None and not self._exhausted:
            self._gaps, self._returned = [], None

    @property
    def background(self) -> bool:
        """Whether a background thread reads ahead now."""
        return self._thread is not None

    def _ready_with_thread(self) -> int:
        return len(self._pending) + self._queue.qsize()

    def __iter__(self) -> FeedIterator:
        return self

    def __next__(self) -> Any:
        if self._closed:
            raise StopIteration
        started = time.perf_counter()
        gaps = self._gaps
        if gaps is not None and self._returned is not None:
            gaps.append(started - self._returned)
            if len(gaps) >= AUTO_DECIDE_AFTER:
                self._gaps = None
                steady = sorted(gaps[AUTO_WARMUP_GAPS:])
                if steady[len(steady) // 4] >= AUTO_MIN_STEP_S and not self._exhausted:
                    self._start_thread()
        if self._thread is not None and not self._pending:
            converted, ready = self._next_background()
        else:
            converted, ready = self._next_inline()
        batch = self._feed._hand_off(converted, ready)
        self._feed._batch_count.inc()
        self._returned = now = time.perf_counter()
        self._feed._loop_boundary.blocked_get(now - started)
        return batch

    def _pull(self) -> tuple[Any, Any]:
        """Read and convert the next source batch (raises StopIteration at the end)."""
        started = time.perf_counter()
        batch = next(self._source)
        took = time.perf_counter() - started
        self._feed._copy_boundary.blocked_get(took)
        timed = self._feed._timed  # an attribute load, then a call: a method load of it is not specialised
        if timed is not None:
            timed(batch, took)
        converted, ready = self._feed._prepare(batch, self._slot)
        self._slot = (self._slot + 1) % (self._feed.depth + 1)
        return converted, ready

    def _next_inline(self) -> tuple[Any, Any]:
        while self._thread is None and not self._exhausted and len(self._pending) < self._feed._lookahead:
            try:
                self._pending.append(self._pull())
            except StopIteration:
                self._exhausted = True
        if not self._pending:
            self._closed = True
            raise StopIteration
        return self._pending.popleft()

    def _next_background(self) -> tuple[Any, Any]:
        kind, payload = self._queue.get()
        if kind is _END or kind == "error":
            self._closed = True
            assert self._thread is not None  # read from the background thread's queue only while there is one
            self._thread.join()
            if kind == "error":
                raise payload
            raise StopIteration
        return payload

    def _produce(self) -> None:
        try:
            if self._feed._cuda:
                torch.cuda.set_device(self._feed.device)
            while not self._stop.is_set():
                try:
                    item = self._pull()
                except StopIteration:
                    break
                if not self._put(("batch", item)):
                    return
            self._put((_END, None))
        except BaseException as error:  # handed to the training loop, which re-raises it
            self._put(("error", error))

    def _put(self, message: tuple[Any, Any]) -> bool:
        started = time.perf_counter()
        while not self._stop.is_set():
            try:
                self._queue.put(message, timeout=0.05)
            except queue.Full:
                continue
            self._feed._copy_boundary.blocked_put(time.perf_counter() - started)
            return True
        return False

    def close(self, timeout: float | None = None) -> None:
        """Stop reading ahead; a background thread is joined (for at most `timeout` seconds)."""
        if self._closed:
            return
        self._closed = True
        self._pending.clear()
        if self._thread is None:
            return
        self._stop.set()
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._thread.is_alive() and (deadline is None or time.monotonic() < deadline):
            try:
                self._queue.get(timeout=0.05)
            except queue.Empty:
                pass
        self._thread.join(timeout=0 if deadline is not None else None)
        _RUNNING.discard(self)
