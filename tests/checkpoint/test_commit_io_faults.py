"""A checkpoint commit with its N-th I/O operation failed, for every N (tierflow.testing.faults).

The store holds step 1, committed here and at a local destination (retention keep_last=1), or
here only. Step 2's files are written, then `commit(2)` and `wait()` run with the N-th read,
write, fsync, rename, open-for-write, mkdir or unlink under the run's directory failing, the
upload and retention included (run in this process by `InProcessUploader`, through the
store's own job and answer plumbing). After every N: the error, if any, is typed (a
TierflowError, or the injected OSError itself); the newest checkpoint a fresh node finds, here
or only at the destination, is step 1 or step 2, whole, with its own bytes; a commit that
returned is step 2 everywhere; and committing step 2 again without faults succeeds.
"""

from __future__ import annotations

import errno
import json
import queue
import shutil
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import pytest

from tierflow.checkpoint import CheckpointStore
from tierflow.checkpoint.remote import open_dest, verify_remote
from tierflow.checkpoint.uploader import upload_part
from tierflow.errors import TierflowError
from tierflow.storage.remote import RetryPolicy
from tierflow.testing.faults import DEFAULT_OPS, Trial, fail_each

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class _Lines:
    """The fake process's stdout: the uploader's answer lines, ending when stdin is closed."""

    def __init__(self) -> None:
        self.q: queue.Queue[str | None] = queue.Queue()

    def __iter__(self) -> Iterator[str]:
        while (line := self.q.get()) is not None:
            yield line


class _Stdin:
    def __init__(self, answers: _Lines) -> None:
        self.answers = answers

    def write(self, line: str) -> None:
        job = json.loads(line)
        try:  # what tierflow.checkpoint.uploader.main does with a job
            answer = upload_part(job)
        except Exception as exc:
            answer = {"step": job.get("step"), "ok": False, "error": f"{type(exc).__name__}: {exc}"}
        self.answers.q.put(json.dumps(answer) + "\n")

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.answers.q.put(None)


class InProcessUploader:
    """Stands in for the uploader process: each job runs `upload_part` at once, on the caller's
    thread (so injected faults reach it), and answers through the store's own reader thread."""

    def __init__(self) -> None:
        self.stdout = _Lines()
        self.stdin = _Stdin(self.stdout)

    def poll(self) -> None:
        return None

    def wait(self) -> int:
        return 0

    def kill(self) -> None:
        self.stdin.close()


def in_process(store: CheckpointStore) -> CheckpointStore:
    import threading
    import weakref

    from tierflow.checkpoint.upload_queue import _read_answers

    def uploader() -> Any:
        if store.uploads._proc is None:
            store.uploads._proc = InProcessUploader()  # type: ignore[assignment]
            reader = threading.Thread(target=_read_answers, args=(weakref.ref(store.uploads), store.uploads._proc))
            reader.daemon = True
            reader.start()
        return store.uploads._proc

    store.uploads._uploader = uploader  # type: ignore[method-assign]
    return store


def step_files(step: int) -> dict[str, bytes]:
    """What the training code writes for a step (a model file, a nested one, a small one)."""
    return {
        "model.bin": bytes([step]) * 20000,
        "opt/state.bin": bytes([step + 100]) * 3000,
        "loader.json": json.dumps({"step": step}).encode(),
    }


def write_step(directory: Path, step: int) -> None:
    for name, data in step_files(step).items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(data)


def assert_whole(path: Path, step: int) -> None:
    for name, data in step_files(step).items():
        assert (path / name).read_bytes() == data, f"{path / name}: not step {step}'s bytes"


def acceptable(error: BaseException, injected: int) -> bool:
    """A typed outcome: one of ours, or the injected OSError itself (naming its file)."""
    return isinstance(error, TierflowError) or (
        isinstance(error, OSError) and error.errno == injected and error.filename is not None
    )


class CommitRig:
    """A run directory with step 1 committed (a template copied before each trial); `remote`:
    with a destination directory (uploaded in this process), else a local-only store."""

    def __init__(self, root: Path, remote: bool = True) -> None:
        self.root = root
        self.remote = remote
        self.template = root / "template"
        self.run = root / "run"
        store = in_process(CheckpointStore(self._dest(self.template), self.template / "local", keep_last=1))
        write_step(store.begin(1), 1)
        store.commit(1)
        store.wait()
        store.close()
        self.store: CheckpointStore | None = None

    def _dest(self, root: Path) -> Path | None:
        return root / "dest" if self.remote else None

    def reset(self) -> None:
        shutil.rmtree(self.run, ignore_errors=True)
        shutil.copytree(self.template, self.run)
        self.store = in_process(CheckpointStore(self._dest(self.run), self.run / "local", keep_last=1))
        write_step(self.store.begin(2), 2)

    def commit(self) -> int:
        assert self.store is not None
        self.store.commit(2)
        self.store.wait()
        return 2

    def check(self, trial: Trial, injected: int) -> None:
        if self.store is not None:
            self.store.close(wait=False)
        if trial.error is not None:
            assert acceptable(trial.error, injected), f"N={trial.n} ({trial.fault}): untyped {trial.error!r}"
        # this node's directory, and a fresh node that has only the destination
        dest = self._dest(self.run)
        here = CheckpointStore(dest, self.run / "local", keep_last=1)
        away = CheckpointStore(dest, self.root / f"fresh-{trial.n}", keep_last=1)
        try:
            for store in (here, away) if self.remote else (here,):
                latest = store.latest()
                assert latest in (1, 2), f"N={trial.n} ({trial.fault}): latest() is {latest}"
                if trial.error is None:
                    assert latest == 2, f"N={trial.n} ({trial.fault}): commit returned but latest() is {latest}"
                assert_whole(store.load(latest), latest)
            if trial.error is None and dest is not None:
                assert verify_remote(open_dest(dest), 2).ok
            # the retry, without faults
            retry = in_process(CheckpointStore(dest, self.run / "local", keep_last=1))
            write_step(retry.begin(2), 2)
            retry.commit(2)
            retry.wait()
            retry.close()
            fresh = CheckpointStore(dest, self.root / f"fresh-retry-{trial.n}")
            for store in (here, fresh) if self.remote else (here,):
                assert store.latest() == 2, f"N={trial.n} ({trial.fault}): the retry did not commit"
                assert_whole(store.load(2), 2)
        finally:
            for opened in (here, away):  # a store opened re-queues what the destination lacks: let it land
                opened.close()
            for n in (f"fresh-{trial.n}", f"fresh-retry-{trial.n}"):
                shutil.rmtree(self.root / n, ignore_errors=True)


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """Retries of the destination's writes without their sleeps (a persistent fault retries every one)."""
    monkeypatch.setattr(RetryPolicy, "delay", lambda self, attempt, rng=None: 0.0)


OPS = (*DEFAULT_OPS, "unlink")
"""Retention's deletes at the destination fail too."""


@pytest.mark.parametrize("remote", [pytest.param(True, marks=pytest.mark.slow), False], ids=["with-dest", "local-only"])
def test_a_commit_failing_at_any_io_leaves_the_previous_or_the_new_step_whole(tmp_path: Path, remote: bool) -> None:
    rig = CommitRig(tmp_path, remote)
    run = fail_each(rig.commit, lambda t: rig.check(t, errno.EIO), [rig.run], ops=OPS, reset=rig.reset)
    assert run.operations > (20 if remote else 15)  # commit (and the upload) reached
    assert len(run.trials) == run.operations + 1
    assert {"read", "write", "fsync", "rename", "open_write"} <= set(run.by_op())


VARIANTS = [(errno.EIO, True), (errno.ENOSPC, False), (errno.ENOSPC, True)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "injected,persistent", VARIANTS, ids=[f"{errno.errorcode[e]}-{'from-n-on' if p else 'once'}" for e, p in VARIANTS]
)
@pytest.mark.parametrize("remote", [True, False], ids=["with-dest", "local-only"])
def test_a_commit_failing_at_any_io_with_any_error_leaves_the_previous_or_the_new_step_whole(
    tmp_path: Path, injected: int, persistent: bool, remote: bool
) -> None:
    rig = CommitRig(tmp_path, remote)
    run = fail_each(
        rig.commit,
        lambda t: rig.check(t, injected),
        [rig.run],
        ops=OPS,
        error=injected,
        persistent=persistent,
        reset=rig.reset,
    )
    assert len(run.trials) == run.operations + 1
