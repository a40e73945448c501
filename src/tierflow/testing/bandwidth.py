"""A token bucket that paces bytes to a rate, shared by every thread that sends through it.

The proxy uses one to throttle response bandwidth; the rate can change while traffic flows.
"""

from __future__ import annotations

import threading
import time


class TokenBucket:
    """Paces byte transfers to `rate` bytes/s, with bursts of at most `burst` bytes.

    `rate=None` means unlimited. Callers may overdraw the bucket: a sender that takes more
    tokens than are present sleeps for the debt, so concurrent senders share the rate fairly
    and no sender starves.
    """

    def __init__(self, rate: float | None = None, burst: int | None = None) -> None:
        self._lock = threading.Lock()
        self._rate: float | None = None
        self._burst = 0.0
        self._tokens = 0.0
        self._stamp = time.monotonic()
        self._fixed_burst = burst
        self.set_rate(rate)

    @property
    def rate(self) -> float | None:
        return self._rate

    def set_rate(self, rate: float | None) -> None:
        """Change the rate; takes effect for the next bytes taken."""
        if rate is not None and rate <= 0:
            raise ValueError(f"token bucket rate must be positive or None, got {rate!r}")
        with self._lock:
            self._rate = float(rate) if rate is not None else None
            if self._rate is None:
                self._burst = 0.0
                self._tokens = 0.0
            else:
                self._burst = float(self._fixed_burst or max(4096.0, self._rate / 20))
                self._tokens = min(self._tokens, self._burst)
            self._stamp = time.monotonic()

    def chunk_size(self, ceiling: int = 64 * 1024) -> int:
        """A send size small enough that pacing stays smooth at the current rate."""
        if self._rate is None:
            return ceiling
        return int(max(1024, min(ceiling, self._burst)))

    def take(self, nbytes: int) -> None:
        """Block until `nbytes` may be sent at the current rate."""
        with self._lock:
            if self._rate is None:
                return
            now = time.monotonic()
            self._tokens = min(self._burst, self._tokens + (now - self._stamp) * self._rate)
            self._stamp = now
            self._tokens -= nbytes
            wait = -self._tokens / self._rate if self._tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)
