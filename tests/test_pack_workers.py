"""Pack's worker processes and scratch space: no orphans after a SIGKILL, bounded scratch."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

SLOW_PACK = """
import sys, time
import tierflow

def slow(record):
    time.sleep(0.005)
    return record

tierflow.pack([sys.argv[1]], sys.argv[2], fn=slow, workers=2, chunk_bytes=16 << 10)
"""


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # dead, not yet reaped by init
    except psutil.NoSuchProcess:
        return True


@pytest.mark.slow
def test_pack_workers_die_within_seconds_of_a_sigkilled_parent(tmp_path):
    with open(tmp_path / "docs.jsonl", "w") as f:
        for i in range(40000):
            f.write(json.dumps({"id": i, "text": f"document {i}"}) + "\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    parent = subprocess.Popen([sys.executable, "-c", SLOW_PACK, str(tmp_path / "docs.jsonl"), str(tmp_path / "out")],
                              env=env)
    try:
        me = psutil.Process(parent.pid)
        deadline = time.monotonic() + 60
        workers: list[int] = []
        while len(workers) < 2 and time.monotonic() < deadline and parent.poll() is None:
            # forked pool workers share the parent's command line (a resource tracker would not)
            workers = [c.pid for c in me.children() if c.cmdline() == me.cmdline()]
            time.sleep(0.05)
        assert len(workers) == 2, "the pack never started its two workers"
        time.sleep(0.5)  # well inside the pack: the workers are busy with units
        assert parent.poll() is None, "the pack finished before it could be killed; give it more input"
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 5
        while not all(_gone(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        alive = [pid for pid in workers if not _gone(pid)]
        assert not alive, f"pack workers {alive} outlived their SIGKILLed parent"
    finally:
        parent.kill()
        for pid in workers if "workers" in dir() else []:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
