"""A kill loop's engine (RocksDB's crash tests, in small): run an operation in a child process
and SIGKILL it at a chosen moment, many times a second.

    with ForkServer(["kill_ops"], path=[tests_dir]) as server:
        result = server.run("kill_ops:pack", {"out": "/tmp/ds"}, kill_after=0.05)
        result.killed        # True: SIGKILL arrived before the operation finished

Starting Python and importing pyarrow and torch takes a second or more; a kill loop of a hundred
iterations cannot pay it each time. The server is one process that imports everything once, is
single-threaded at each fork, and forks a child per run; the child is the leader of its own
process group, so its pack workers and checkpoint uploader die with it when the group is
killed (`group=True`), or outlive it when only the child is (`group=False`: what a crash of
the training process alone looks like). The server is a child subreaper, so it reaps what the
child left behind and reports how long the group lingered after the kill (orphans).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Sequence

SERVER = r'''
import ctypes, importlib, json, os, signal, sys, time, traceback
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans come to us

def reap_group(pgid, limit):
    """Reap every process of the group until none is left (or `limit` seconds); seconds it took."""
    started = time.monotonic()
    while True:
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return time.monotonic() - started
        if time.monotonic() - started > limit:
            os.killpg(pgid, signal.SIGKILL)
            return -1.0
        time.sleep(0.005)

print(json.dumps({"ready": os.getpid()}), flush=True)
for line in sys.stdin:
    job = json.loads(line)
    module, _, function = job["call"].partition(":")
    target = getattr(importlib.import_module(module), function)
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        os.setpgid(0, 0)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        code = 0
        try:
            target(**job["args"])
        except BaseException:
            code = 1
            with open(job["errors"], "w") as f:
                f.write(traceback.format_exc())
        os._exit(code)
    try:
        os.setpgid(pid, pid)
    except OSError:
        pass  # the child did it first (or has already exited)
    killed_at = None
    if job["kill_after"] is not None:
        deadline = started + job["kill_after"]
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(min(0.002, max(0.0, deadline - time.monotonic())))
        else:
            done = 0
        if not done:
            killed_at = time.monotonic() - started
            if job["group"]:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
    else:
        _, status = os.waitpid(pid, 0)
    elapsed = time.monotonic() - started
    lingered = reap_group(pid, job["linger_limit"])
    print(json.dumps({"pid": pid, "status": status, "killed_at": killed_at, "elapsed": elapsed,
                      "lingered": lingered}), flush=True)
'''


@dataclass(frozen=True)
class RunResult:
    """One run: the child's pid, its wait status, when it was killed (None: it finished first),
    seconds it took, how long its process group outlived it (-1: still there after the limit,
    then killed) and the traceback it ended with, if any."""

    pid: int
    status: int
    killed_at: float | None
    elapsed: float
    lingered: float
    errors: str

    @property
    def killed(self) -> bool:
        return os.WIFSIGNALED(self.status) and os.WTERMSIG(self.status) == 9

    @property
    def ok(self) -> bool:
        return os.WIFEXITED(self.status) and os.WEXITSTATUS(self.status) == 0


class ForkServer:
    """A process that imports `modules` once and forks a child per `run` (see the module's doc)."""

    def __init__(
        self,
        modules: Sequence[str],
        path: Sequence[str | os.PathLike] = (),
        scratch: str | os.PathLike = "",
        env: dict[str, str] | None = None,
    ) -> None:
        self.modules = list(modules)
        self.path = [str(p) for p in path]
        self.scratch = Path(scratch or os.environ.get("TMPDIR", "/tmp"))
        self.env = env
        self.proc: subprocess.Popen[str] | None = None
        self._runs = 0

    def __enter__(self) -> ForkServer:
        import tierflow

        src = str(Path(tierflow.__file__).resolve().parents[1])
        env = {**os.environ, **(self.env or {})}
        env["PYTHONPATH"] = os.pathsep.join([src, *self.path, *filter(None, [env.get("PYTHONPATH")])])
        self.proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(SERVER), json.dumps(self.modules)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"fork server failed to start (exit {self.proc.wait()})")
        return self

    def run(
        self,
        call: str,
        args: dict[str, Any],
        kill_after: float | None = None,
        *,
        group: bool = True,
        linger_limit: float = 30.0,
    ) -> RunResult:
        """Run `module:function(**args)` in a fresh child; SIGKILL it after `kill_after` seconds
        unless it finished (its whole process group with `group`, else the child alone)."""
        assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
        self._runs += 1
        errors = self.scratch / f"fork-server-{os.getpid()}-{self._runs}.err"
        job = {
            "call": call,
            "args": args,
            "kill_after": kill_after,
            "group": group,
            "linger_limit": linger_limit,
            "errors": str(errors),
        }
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"fork server died (exit {self.proc.wait()})")
        answer = json.loads(line)
        text = ""
        if errors.exists():
            text = errors.read_text()
            errors.unlink()
        return RunResult(
            answer["pid"], answer["status"], answer["killed_at"], answer["elapsed"], answer["lingered"], text
        )

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


__all__ = ["ForkServer", "RunResult"]
