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

from tierflow import _lifetime
from tierflow._lifetime import request_parent_death_signal as _request_parent_death_signal  # noqa: F401
from tierflow._lifetime import watch_parent as _watch_parent  # noqa: F401  (the fallback's test calls it)


def die_with_parent(parent: int) -> None:
    """A worker initializer: this process ends when process `parent` (the pack) does, however it ends.

    Ctrl-C at a terminal reaches the whole process group: a worker ignores it (no traceback of its
    own per worker); the pack, interrupted, shuts its pool down."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _lifetime.die_with_parent(parent)


__all__ = ["die_with_parent"]
