"""Pack workers die with their parent.

A SIGKILLed `tierflow pack` cannot shut its process pool down, and a pool worker blocked on its
call queue would otherwise live for ever (holding memory and scratch files). On Linux each
worker asks the kernel for SIGKILL when its parent goes (prctl PR_SET_PDEATHSIG) and then
checks the parent is still the one that started it (it may have died before the request);
elsewhere a watchdog thread polls the parent pid.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1
WATCHDOG_SECONDS = 0.5


def _request_parent_death_signal() -> bool:
    """Ask the kernel to SIGKILL this process when its parent exits; False where that is not offered."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(WATCHDOG_SECONDS)
    os.kill(os.getpid(), signal.SIGKILL)


def die_with_parent(parent: int) -> None:
    """A worker initializer: this process ends when process `parent` (the pack) does, however it ends.

    Ctrl-C at a terminal reaches the whole process group: a worker ignores it (no traceback of its
    own per worker); the pack, interrupted, shuts its pool down."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not _request_parent_death_signal():
        threading.Thread(target=_watch_parent, args=(parent,), name="tierflow-parent-watchdog",
                         daemon=True).start()
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)
