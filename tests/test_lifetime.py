"""tierflow._lifetime: a process bound to an owner dies when the owner does (pidfd or polling)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tierflow._lifetime import Owner, die_with, watch_owner


def _wait(pid: int, seconds: float) -> int | None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.02)
    return None


def _start(pid: int) -> str | None:
    from tierflow._lifetime import _start_time

    return _start_time(pid)


def test_an_owner_is_its_pid_and_start_time_and_a_zombie_is_not_alive():
    me = Owner.current()
    assert me.alive()
    assert not Owner(me.pid, "1").alive()  # another process on the same pid
    child = os.fork()
    if child == 0:
        time.sleep(0.3)
        os._exit(0)
    owner = Owner(child, _start(child))
    assert owner.alive()
    time.sleep(0.8)  # exited, not yet reaped: a zombie
    assert not owner.alive()
    os.waitpid(child, 0)
    assert not owner.alive()


def test_a_process_whose_owner_is_already_gone_kills_itself():
    child = os.fork()
    if child == 0:
        os._exit(0)
    os.waitpid(child, 0)
    bound = os.fork()
    if bound == 0:
        die_with(Owner(child, "1"), parent_signal=False)
        os._exit(0)
    status = _wait(bound, 10)
    assert status is not None and os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "polling"])
def test_the_watchdog_kills_its_process_once_the_owner_is_killed(pidfd):
    owner = os.fork()
    if owner == 0:
        time.sleep(60)
        os._exit(0)
    start = _start(owner)
    bound = os.fork()
    if bound == 0:
        if not pidfd and hasattr(os, "pidfd_open"):
            del os.pidfd_open  # this child only: the fallback that polls the owner
        watch_owner(Owner(owner, start), interval=0.05)
        time.sleep(60)
        os._exit(0)
    try:
        time.sleep(0.3)
        assert _wait(bound, 0) is None  # the owner lives: so does the bound process
        os.kill(owner, signal.SIGKILL)
        os.waitpid(owner, 0)
        status = _wait(bound, 5)
        assert status is not None and os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    finally:
        for pid in (owner, bound):
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
