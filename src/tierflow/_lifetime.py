"""Processes tierflow starts die with the process that owns them, however it ends (SIGKILL too).

Two mechanisms, because neither reaches every case alone:

- the parent-death signal (Linux `prctl(PR_SET_PDEATHSIG, SIGKILL)`): the kernel kills the child
  when its parent *thread* exits. It reaches fork children of a trainer's main thread at once,
  but not a forkserver's children (their parent is the forkserver, which lives on while they
  do: Python passes every child the forkserver's "alive" pipe) and it would kill a fork child
  of a short-lived thread too early;
- a watchdog thread that waits on the owner itself (a pidfd, which becomes readable when the
  owner exits; a poll of its pid and start time where pidfds are not offered) and SIGKILLs its
  own process when the owner is gone.

A child killed this way drops what the kernel holds for it (tier pins are flocks, so they go;
its copy of the owner's stdout closes), and the processes that live only as long as it does
follow: a forkserver exits once its last child has, the resource tracker once the forkserver,
the workers and the owner have all closed its pipe (it then unlinks what they leaked).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import select
import signal
import sys
import threading
import time
from dataclasses import dataclass

PR_SET_PDEATHSIG = 1
POLL_SECONDS = 0.25
"""How often the watchdog looks at the owner where it cannot wait on a pidfd."""


def request_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `sig` to this process when its parent (thread) exits; False where
    that is not offered (not Linux, no libc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _stat(pid: int) -> list[bytes] | None:
    """The fields of /proc/PID/stat after the command name (state first), or None when the process
    is gone or there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rfind(b")") + 2 :].split()  # the command name may hold spaces and parentheses


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks (field 22), or None: with the pid, it names one
    process, not whichever reuses the pid."""
    fields = _stat(pid)
    return fields[19].decode() if fields is not None and len(fields) > 19 else None


@dataclass(frozen=True)
class Owner:
    """A process, by pid and start time (so a reused pid is not mistaken for it); pickles."""

    pid: int
    start: str | None

    @classmethod
    def current(cls) -> Owner:
        pid = os.getpid()
        return cls(pid, _start_time(pid))

    def alive(self) -> bool:
        """Running (a zombie, exited but not yet reaped, is not), and not another process on a reused pid."""
        if self.start is not None:
            fields = _stat(self.pid)
            return (
                fields is not None
                and len(fields) > 19
                and fields[19].decode() == self.start
                and fields[0] not in (b"Z", b"X")
            )
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _wait_on_pidfd(fd: int) -> None:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while not poller.poll():  # readable once the process has exited; no GIL held meanwhile
        pass
    _kill_self()


def _poll_owner(owner: Owner, interval: float) -> None:
    while owner.alive():
        time.sleep(interval)
    _kill_self()


def watch_owner(owner: Owner, interval: float = POLL_SECONDS) -> threading.Thread:
    """Start a daemon thread that SIGKILLs this process once `owner` has exited."""
    pidfd = None
    opener = getattr(os, "pidfd_open", None)
    if opener is not None:
        try:
            pidfd = opener(owner.pid)
        except OSError:  # gone already (ESRCH), or a kernel without pidfds
            pidfd = None
    if pidfd is not None and not owner.alive():  # the pid was reused before we opened it
        os.close(pidfd)
        _kill_self()
    if pidfd is not None:
        thread = threading.Thread(target=_wait_on_pidfd, args=(pidfd,), name="tierflow-owner-watchdog", daemon=True)
    else:
        thread = threading.Thread(
            target=_poll_owner, args=(owner, interval), name="tierflow-owner-watchdog", daemon=True
        )
    thread.start()
    return thread


def die_with(owner: Owner, *, parent_signal: bool = True) -> None:
    """Make this process end when `owner` does: the parent-death signal (when `parent_signal`:
    the parent is a thread that lives as long as the owner) and a watchdog on the owner; if the
    owner is already gone, end now."""
    if parent_signal:
        request_parent_death_signal()
    if not owner.alive():
        _kill_self()
    watch_owner(owner)


def watch_parent(parent: int, interval: float = POLL_SECONDS) -> None:
    """Block until this process's parent is no longer `parent` (it exited; the orphan was
    re-parented), then SIGKILL this process."""
    while os.getppid() == parent:
        time.sleep(interval)
    _kill_self()


def die_with_parent(parent: int) -> None:
    """A process pool's initializer: this process ends when process `parent` (the pool's owner,
    single-threaded when it forks) does, however it ends."""
    if not request_parent_death_signal():
        threading.Thread(target=watch_parent, args=(parent,), name="tierflow-parent-watchdog", daemon=True).start()
    if os.getppid() != parent:  # the parent died before the request took effect
        _kill_self()


__all__ = ["Owner", "die_with", "die_with_parent", "request_parent_death_signal", "watch_owner", "watch_parent"]
