"""Pack workers die with their parent, and leave Ctrl-C to it.

A SIGKILLed `tierflow pack` cannot shut its process pool down, and a pool worker blocked on its
call queue would otherwise live for ever (holding memory and scratch files). On Linux each
worker asks the kernel for SIGKILL when its parent goes (prctl PR_SET_PDEATHSIG) and then
checks the parent is still the one that started it (it may have died before the request);
elsewhere a watchdog thread polls the parent. The mechanism is shared with the loader's
workers: tierflow._lifetime.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from tierflow import _lifetime
from tierflow._lifetime import request_parent_death_signal as _request_parent_death_signal  # noqa: F401
from tierflow._lifetime import watch_parent as _watch_parent  # noqa: F401  (the fallback's test calls it)


def die_with_parent(parent: int) -> None:
    """A worker initializer: this process ends when process `parent` (the pack) does, however it ends.

    Ctrl-C at a terminal reaches the whole process group: a worker ignores it (no traceback of its
    own per worker); the pack, interrupted, shuts its pool down."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _lifetime.die_with_parent(parent)


@contextmanager
def interrupts_held() -> Iterator[None]:
    """Hold Ctrl-C while the pool forks its workers, and raise it after.

    Python runs the at-fork callbacks (logging's lock release among them) in the parent; a
    KeyboardInterrupt raised inside one is printed as "Exception ignored" and lost, and the pack
    then ran to its end and exited 0 (1 in ~30 runs of a Ctrl-C at the pack's start). Caught
    here, it is only recorded, and sent again once the fork is done. Off the main thread (no handler
    can be set there) this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            signal.raise_signal(signal.SIGINT)  # to the handler it was meant for


__all__ = ["die_with_parent", "interrupts_held"]
