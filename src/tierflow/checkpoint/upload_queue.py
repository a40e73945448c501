"""The checkpoint store's side of its uploader process (`checkpoint.uploader`): jobs written to
its stdin, one JSON line each, and its answers read back on a thread, so the training process
never copies a byte itself. An uploader that dies fails every job it had not answered, and the
next job starts another. A queue dropped without `close` (its store collected) closes its
uploader's stdin: the uploader ends after the jobs in hand, and so does the thread reading it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import weakref
from pathlib import Path
from typing import Any

from tierflow.checkpoint.manifest import step_name
from tierflow.errors import CheckpointTimeout
from tierflow.tiers.burst import Ride


class UploadQueue:
    """Steps queued for upload, their answers, and the stager rides that wait on them."""

    def __init__(self, dest: str | None) -> None:
        self.dest = dest
        self.last_answer: dict[str, Any] | None = None
        """The uploader's latest answer (step, ok, bytes, seconds, error)."""
        self.rate: float | None = None
        """Bytes/s of the last upload (its answer's bytes over its seconds); None until one is done."""
        self._results: dict[int, dict[str, Any]] = {}
        self._pending: dict[int, threading.Event] = {}
        self._failed: list[dict[str, Any]] = []  # failed answers `wait` has not returned yet
        self._rides: dict[int, Ride] = {}
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[str] | None = None

    def submit(self, job: dict[str, Any]) -> None:
        """Queue one step's upload (`job["step"]`), starting the uploader if none runs."""
        proc = self._uploader()
        with self._lock:
            self._pending[job["step"]] = threading.Event()
            self._results.pop(job["step"], None)
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(job) + "\n")
        proc.stdin.flush()

    def hold_ride(self, step: int, ride: Ride) -> None:
        """Keep the stager's `ride` going until `step`'s upload is answered (or the uploader dies)."""
        with self._lock:
            self._rides[step] = ride

    def end_ride(self, step: int) -> None:
        with self._lock:
            ride = self._rides.pop(step, None)
        if ride is not None:
            ride.end()

    def result(self, step: int) -> dict[str, Any] | None:
        """The answer to `step`'s upload, None while there is none."""
        return self._results.get(step)

    def uploading(self) -> list[int]:
        """Steps whose upload has not finished yet."""
        with self._lock:
            return sorted(self._pending)

    def wait(self, timeout: float | None = None) -> list[dict[str, Any]]:
        """Block until every queued upload is answered; returns the failed answers since the last
        wait, whether they came before this call or during it. CheckpointTimeout past `timeout`."""
        with self._lock:
            events = list(self._pending.items())
        for step, event in events:
            if not event.wait(timeout):
                raise CheckpointTimeout(f"{self.dest}/{step_name(step)}", f"upload still running after {timeout} s")
        with self._lock:
            failed, self._failed = self._failed, []
        return failed

    def detach(self) -> subprocess.Popen[str] | None:
        """Take the uploader out of the queue (to stop it): the next job starts another."""
        proc, self._proc = self._proc, None
        return proc

    def _uploader(self) -> subprocess.Popen[str]:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        import tierflow

        env = dict(os.environ)
        root = str(Path(tierflow.__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tierflow.checkpoint.uploader"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self._proc.stdin is not None
        weakref.finalize(self, self._proc.stdin.close)
        threading.Thread(
            target=_read_answers, args=(weakref.ref(self), self._proc), daemon=True, name="tierflow-ckpt-answers"
        ).start()
        return self._proc

    def _answered(self, answer: dict[str, Any]) -> None:
        step = int(answer["step"])
        with self._lock:
            self._results[step] = answer
            event = self._pending.pop(step, None)
            if not answer.get("ok"):
                self._failed.append(answer)
        self.last_answer = answer
        if answer.get("ok") and answer.get("bytes") and answer.get("seconds"):
            self.rate = float(answer["bytes"]) / float(answer["seconds"])
        self.end_ride(step)
        if event is not None:
            event.set()

    def _uploader_ended(self, code: int) -> None:
        with self._lock:  # nothing pending will ever be answered
            for step, event in self._pending.items():
                self._results[step] = {"step": step, "ok": False, "error": f"uploader exited ({code})"}
                self._failed.append(self._results[step])
                event.set()
            self._pending.clear()
            rides, self._rides = list(self._rides.values()), {}
        for ride in rides:
            ride.end()


def _read_answers(queue: weakref.ref[UploadQueue], proc: subprocess.Popen[str]) -> None:
    """The uploader's answers to its queue, while the queue lives (a strong reference here would keep
    it, its uploader and this thread alive for ever once its store is dropped); reaped at its end."""
    assert proc.stdout is not None
    for line in proc.stdout:
        try:
            answer = json.loads(line)
        except ValueError:
            continue
        alive = queue()
        if alive is not None:
            alive._answered(answer)
        del alive
    code = proc.wait()
    alive = queue()
    if alive is not None:
        alive._uploader_ended(code)


def stop_uploader(proc: subprocess.Popen[str], kill: bool) -> None:
    """End an uploader taken out of its queue: after the jobs in hand, or at once (`kill`)."""
    assert proc.stdin is not None  # opened as a pipe
    proc.stdin.close()
    if kill:
        proc.kill()
    proc.wait()
