"""Bursts the stager rides through: a transfer (a checkpoint upload) about to share the node's
bandwidth with training reads for a while.

Whoever starts one tells the node's stager through `RidesBursts.ride_through(seconds)`: for as
long as the returned `Ride` is open, the stager's lookahead covers `seconds` of consumption at
its measured rate (bounded by the room its tier has beside the shards being read), so the
shards the loop reads during the burst are staged before it starts or while the burst takes
only what training reads leave (the budget's low priority). `Ride.wait` says when that much is
staged; `Ride.end` (the upload finished) returns the lookahead to Little's law. The interface
lives in tiers/ so that checkpoint/ can use it without tiers/ knowing checkpoints.
"""

from __future__ import annotations

import threading
from typing import Protocol, runtime_checkable
from collections.abc import Callable


class Ride:
    """One burst the stager covers: `seconds` expected, `cover_bytes` it aims to hold ahead."""

    def __init__(self, seconds: float, cover_bytes: float, on_end: Callable[[Ride], None] | None = None) -> None:
        self.seconds = float(seconds)
        self.cover_bytes = float(cover_bytes)
        self._on_end = on_end
        self._staged = threading.Event()
        self._ended = threading.Event()
        if on_end is None or cover_bytes <= 0:
            self._staged.set()  # nothing to stage for it: covered from the start

    def staged(self) -> None:
        """The stager holds what this ride asked for (or all it can)."""
        self._staged.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the stager holds `cover_bytes` ahead (or the ride ended); True if covered."""
        self._staged.wait(timeout)
        return self._staged.is_set()

    def end(self) -> None:
        """The burst is over (idempotent): the stager's lookahead returns to what the reads need."""
        if self._ended.is_set():
            return
        self._ended.set()
        self._staged.set()
        if self._on_end is not None:
            self._on_end(self)


@runtime_checkable
class RidesBursts(Protocol):
    """What a transfer's owner tells the stager (a `Stager` satisfies it)."""

    def ride_through(self, seconds: float) -> Ride:
        """A burst of about `seconds` starts now: look ahead far enough to read through it."""
        ...


__all__ = ["Ride", "RidesBursts"]
