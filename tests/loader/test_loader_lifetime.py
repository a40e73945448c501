"""Processes die with their trainer (issue 36, item 2).

A trainer reading through an L2 tier, with 0 or 2 DataLoader workers (fork over a local path,
forkserver over s3://), is killed mid-epoch the ways clusters kill it: SIGKILL to the trainer
alone (the OOM killer), SIGKILL to its process group (a node's job teardown), SIGTERM (a
scheduler's preemption). Every process it started (workers, the forkserver, the resource
tracker) must be gone within 5 s, its stdout pipe must reach EOF (`python train.py | tail`
ends), and no L2 entry may stay pinned: a fresh process evicts every entry.
"""

from __future__ import annotations

import functools
import os
import threading
from itertools import islice
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import tierflow
from tierflow.errors import TierflowError, WorkerLostError
from tierflow.loader._lifetime import WorkerLifetime
from tierflow.loader import Loader, TieredDataset, BatchSpec
from tierflow.storage.remote import upload_dataset

from corpora import write_letters
from tierflow.tiers import TierConfig
from tierflow.tiers._lock import is_pinned
from torch.utils.data import DataLoader

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]

GONE_WITHIN = 5.0
TRAINER = """
import os, signal, sys, time
import tierflow

def main():
    url, workers, l2, endpoint, on_term = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    if on_term == "exit":  # a trainer that handles preemption: SystemExit unwinds the loop
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    loader = tierflow.open_loader(url, tiers=[f"L2={l2}:50MB"], batch_size=64, seq_len=2048, num_workers=workers,
                                  device="cpu", endless=True, endpoint_url=endpoint or None)
    for step, batch in enumerate(loader):
        if step == 6:
            print("ready", os.getpid(), flush=True)
        time.sleep(0.05)  # a step: the workers run ahead and block writing batches the loop has not read

if __name__ == "__main__":
    main()
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A few small shards, so the L2 holds several entries a reader pins."""
    root = tmp_path_factory.mktemp("lifetime")
    write_letters(root / "docs.jsonl", 5000, 20, 300, seed=3)
    tierflow.pack([root / "docs.jsonl"], root / "ds", tokenizer="bytes", workers=1, target_shard_bytes=256 << 10)
    (root / "trainer.py").write_text(TRAINER)
    return root


def _start(tiny: Path, url: str, workers: int, l2: Path, endpoint: str, on_term: str) -> subprocess.Popen:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(tierflow.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    # stdout is a pipe we read, as `| tail` would; the trainer leads its own session and group
    return subprocess.Popen(
        [sys.executable, str(tiny / "trainer.py"), url, str(workers), str(l2), endpoint, on_term],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,
    )


def _read_line(stream, deadline: float) -> bytes:
    line = b""
    while time.monotonic() < deadline and not line.endswith(b"\n"):
        ready, _, _ = select.select([stream], [], [], 0.1)
        if ready:
            chunk = os.read(stream.fileno(), 1)
            if not chunk:
                break
            line += chunk
    return line


def _eof_within(stream, seconds: float) -> bool:
    """Whether every writer of the pipe is gone within `seconds` (what ends `| tail`)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        ready, _, _ = select.select([stream], [], [], 0.1)
        if ready and not os.read(stream.fileno(), 65536):
            return True
    return False


def _alive(processes: list[psutil.Process]) -> list[str]:
    left = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            pass
    return left


def _run_and_kill(tiny: Path, tmp_path: Path, url: str, workers: int, how: str, endpoint: str = "") -> None:
    l2 = tmp_path / "l2"
    proc = _start(tiny, url, workers, l2, endpoint, "exit" if how == "sigterm-handled" else "default")
    try:
        line = _read_line(proc.stdout, time.monotonic() + 120)
        if not line.startswith(b"ready"):
            proc.kill()
            pytest.fail(f"trainer did not start: {line!r} {proc.communicate(timeout=30)[1].decode()[-3000:]}")
        time.sleep(0.5)  # mid-epoch, the workers' batches waiting in the result pipe
        trainer = psutil.Process(proc.pid)
        descendants = trainer.children(recursive=True)
        if workers:
            assert len(descendants) >= workers, descendants
        if how == "sigkill":
            os.kill(proc.pid, signal.SIGKILL)  # the trainer alone, as the OOM killer does
        elif how == "sigkill-group":
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            os.kill(proc.pid, signal.SIGTERM)
        killed = time.monotonic()
        proc.wait(timeout=30)
        if how.startswith("sigterm"):  # ~0.5 s with a handler that exits (the Loader stops its workers); room for load
            assert time.monotonic() - killed < 1.5, f"SIGTERMed trainer took {time.monotonic() - killed:.1f} s to exit"
        assert _eof_within(proc.stdout, GONE_WITHIN - (time.monotonic() - killed)), (
            f"the trainer's stdout is still held open: {_alive(descendants)}"
        )
        deadline = killed + GONE_WITHIN
        while _alive(descendants) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(descendants), f"outlived their trainer ({how}): {_alive(descendants)}"
        where = "s3" if url.startswith("s3://") else "local"
        print(
            f"{where}, {workers} workers, {how}: {len(descendants)} descendants gone "
            f"{time.monotonic() - killed:.2f} s after the kill"
        )
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for p in psutil.Process().children(recursive=True):  # nothing may leak into the next test
            try:
                if p.pid != proc.pid and str(tiny) in " ".join(p.cmdline()):
                    p.kill()
            except psutil.NoSuchProcess:  # gone, or a zombie (ZombieProcess): nothing left to kill
                pass
        proc.stdout.close()
        proc.stderr.close()
    entries = sorted((l2 / "entries").glob("*.arrow"))
    assert entries, "the trainer read nothing through its L2"
    assert [e.name for e in entries if is_pinned(e)] == []
    tier = TierConfig("L2", str(l2), 50 << 20).build(configure=False)
    assert tier.evict() == len(entries)  # a fresh process evicts every entry: no pin left


# a group kill takes every process of the group along: the case with the most processes (s3) is enough
@pytest.mark.parametrize(
    "workers,how", [(0, "sigkill"), (0, "sigterm"), (2, "sigkill"), (2, "sigterm"), (2, "sigterm-handled")]
)
def test_a_killed_trainer_over_a_local_path_leaves_no_process_pipe_or_pin(tiny, tmp_path, workers, how):
    _run_and_kill(tiny, tmp_path, str(tiny / "ds"), workers, how)


@pytest.mark.parametrize(
    "workers,how", [(0, "sigkill"), (2, "sigkill"), (2, "sigkill-group"), (2, "sigterm"), (2, "sigterm-handled")]
)
def test_a_killed_trainer_over_s3_leaves_no_process_pipe_or_pin(tiny, tmp_path, s3_server, s3_bucket, workers, how):
    url = f"s3://{s3_bucket}/ds"
    upload_dataset(tiny / "ds", url, endpoint_url=s3_server.endpoint_url)
    _run_and_kill(tiny, tmp_path, url, workers, how, endpoint=s3_server.endpoint_url)


def test_a_killed_worker_reaches_the_loop_as_a_tierflow_error_and_state_dict_resumes_exactly(tiny):
    """Not torch's bare RuntimeError: a WorkerLostError that says state_dict() resumes, and it does."""

    def dataset() -> TieredDataset:
        return TieredDataset(str(tiny / "ds"), BatchSpec(batch_size=8, seq_len=64))

    reference = [b["input_ids"].clone() for b in islice(Loader(dataset(), device="cpu"), 240)]
    loader = Loader(dataset(), device="cpu", num_workers=2)
    got = []
    with pytest.raises(WorkerLostError, match=r"state_dict\(\) .* resumes exactly") as caught:
        for step, batch in enumerate(loader):
            got.append(batch["input_ids"].clone())
            if step == 2:
                os.kill(loader._source.processes[0].pid, signal.SIGKILL)
            assert step < 200, "the loop never heard of the dead worker"  # the batches already sent come first
    assert isinstance(caught.value, TierflowError) and isinstance(caught.value, RuntimeError)
    state = loader.state_dict()
    loader.close()
    resumed = Loader(dataset(), device="cpu")
    resumed.load_state_dict(state)
    got += [b["input_ids"] for b in islice(resumed, 240 - len(got))]
    assert len(got) == 240 and all(a.equal(b) for a, b in zip(got, reference))


def test_torchs_sigchld_report_of_a_dead_worker_is_raised_as_a_tierflow_error():
    """torch's SIGCHLD handler raises its RuntimeError wherever the main thread is; wrapped, it is typed."""
    from tierflow.loader._lifetime import _LostWorkerHandler

    def torch_handler(signum, frame):
        raise RuntimeError("DataLoader worker (pid 4242) is killed by signal: Killed. ")

    def other(signum, frame):
        raise RuntimeError("something else")

    with pytest.raises(WorkerLostError, match=r"pid 4242\) is killed by signal: Killed; .*state_dict\(\)"):
        _LostWorkerHandler(torch_handler)(signal.SIGCHLD, None)
    with pytest.raises(RuntimeError, match="something else") as caught:
        _LostWorkerHandler(other)(signal.SIGCHLD, None)
    assert type(caught.value) is RuntimeError


def _mark_worker(folder: Path, worker_id: int) -> None:
    (folder / f"worker-{worker_id}").write_text(str(os.getpid()))


def test_the_users_worker_init_fn_still_runs_after_the_loaders(tiny, tmp_path):
    ds = TieredDataset(str(tiny / "ds"), BatchSpec(batch_size=8, seq_len=64))
    dataloader = DataLoader(
        ds, batch_size=None, num_workers=2, worker_init_fn=functools.partial(_mark_worker, tmp_path)
    )
    with Loader(dataloader, device="cpu") as loader:
        assert len(list(islice(loader, 6))) == 6
        assert isinstance(dataloader.worker_init_fn, WorkerLifetime)
        pids = {p.read_text() for p in tmp_path.glob("worker-*")}
        assert len(pids) == 2 and str(os.getpid()) not in pids


def test_workers_forked_by_a_thread_that_ends_live_on_with_the_trainer(tiny):
    """The parent-death signal fires when the forking *thread* exits: a thread that starts the
    workers and ends must not take them along (the watchdog on the trainer still stands)."""
    loader = Loader(
        TieredDataset(str(tiny / "ds"), BatchSpec(batch_size=8, seq_len=64)),
        device="cpu",
        num_workers=2,
        background=False,
    )
    started: list = []
    thread = threading.Thread(target=lambda: (started.append(iter(loader)), time.sleep(0.5)))  # workers set up
    thread.start()
    thread.join()
    time.sleep(0.3)
    with loader:
        assert len(list(islice(started[0], 40))) == 40
