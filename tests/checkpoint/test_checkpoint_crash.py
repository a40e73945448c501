"""Checkpoints after crashes and damage (issue 36): a restart uploads what the destination lacks,
`latest()` says what it skipped, a step is bound to its name, special files never block, an
unreadable newest step is passed over, a full disk names its file, temporaries of dead commits
are swept, uploads have a deadline. Real files, the real uploader process, moto S3, real kills.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import tierflow
from tierflow.checkpoint import COMMIT_NAME, CheckpointStore, step_name
from tierflow.checkpoint.manifest import part_name
from tierflow.commands.cli import main as cli_main
from tierflow.errors import CheckpointError, CheckpointWarning, TierflowError
from tierflow.storage.budget import BandwidthBudget

SRC = str(Path(tierflow.__file__).resolve().parents[1])
TESTS = str(Path(__file__).resolve().parent)


def write_step(store: CheckpointStore, step: int, size: int = 5000) -> Path:
    directory = store.begin(step)
    (directory / "model.bin").write_bytes(bytes([step % 256]) * size)
    (directory / "sub").mkdir()
    (directory / "sub" / "opt.bin").write_bytes(bytes([(step + 1) % 256]) * 100)
    return store.commit(step)


def flip(path: Path, at: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def within(seconds: float, fn: Callable[[], Any], fifo: Path | None = None) -> Any:
    """fn() on a thread, which must return within `seconds`; a FIFO it blocks on is then opened
    for writing so the thread ends, and the test fails."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        if fifo is not None:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"blocked for more than {seconds} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


# ------------------------------------------------------------------ 1. reconcile at open
def test_a_reopened_store_uploads_the_committed_steps_the_destination_lacks_newest_first(tmp_path: Path) -> None:
    """Local steps 1-3 committed; the destination lost step 2 and holds step 3 incomplete (its
    marker up, a file missing). Reopening the store queues 3 then 2, wait() blocks until they are
    up, and `ckpt ls --local` shows them as local-only before and as committed after."""
    dest, local = tmp_path / "dest", tmp_path / "local"
    with CheckpointStore(dest, local, keep_last=3) as store:
        for step in (1, 2, 3):
            write_step(store, step)
    shutil.rmtree(dest / step_name(2))
    (dest / step_name(3) / "sub" / "opt.bin").unlink()
    reopened = CheckpointStore(dest, local, keep_last=3)
    assert reopened.requeued == [3, 2]
    reopened.wait(timeout=60)
    assert reopened.remote_steps() == {1: True, 2: True, 3: True}
    assert all(reopened.verify(s).ok for s in (1, 2, 3))
    reopened.close()
    assert CheckpointStore(dest, tmp_path / "fresh").latest() == 3


def test_reconcile_queues_only_what_retention_keeps(tmp_path: Path) -> None:
    """With keep_last=1 only the newest local step goes up again; the older one is retention's."""
    dest, local = tmp_path / "dest", tmp_path / "local"
    store = CheckpointStore(None, local, keep_last=None)  # steps committed by a run that had no upload
    for step in (1, 2):
        write_step(store, step)
    reopened = CheckpointStore(dest, local, keep_last=1)
    assert reopened.requeued == [2]
    reopened.wait(timeout=60)
    assert reopened.remote_steps() == {2: True}
    reopened.close()


def test_ckpt_ls_with_local_shows_local_only_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dest, local = tmp_path / "dest", tmp_path / "local"
    with CheckpointStore(dest, local, keep_last=None) as store:
        write_step(store, 1)
    store = CheckpointStore(None, local, keep_last=None)
    write_step(store, 2)  # committed here, never uploaded
    assert cli_main(["ckpt", "ls", str(dest), "--local", str(local)]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1] for line in out.splitlines() if line.split()[0].isdecimal()}
    assert rows == {"1": "committed", "2": "local-only"}
    assert "1 local-only" in out
    CheckpointStore(dest, local, keep_last=None).close()  # opening it uploads step 2
    assert cli_main(["ckpt", "ls", str(dest), "--local", str(local)]) == 0
    out = capsys.readouterr().out
    assert "2  committed" in out and "0 local-only" in out


TRAINER = """
import sys
from pathlib import Path
from tierflow.checkpoint import CheckpointStore
from tierflow.storage.budget import BandwidthBudget
dest, local, endpoint, budget_path = sys.argv[1:5]
budget = BandwidthBudget(4 << 20, budget_path, burst=256 << 10, node_rate=None)  # 4 MB/s: ~1.5 s a step
store = CheckpointStore(dest, local, keep_last=3, endpoint_url=endpoint, budget=budget)
for step in range(1, 5):
    step_dir = store.begin(step)
    (step_dir / "model.bin").write_bytes(bytes([step]) * (6 << 20))
    store.commit(step)
    print("committed", step, flush=True)
import time
time.sleep(600)
"""


@pytest.mark.slow
def test_a_step_committed_just_before_a_node_crash_reaches_the_destination_after_the_restart(
    s3_server, s3_bucket: str, tmp_path: Path
) -> None:
    """A trainer commits steps 1-4 (6 MB each) to moto S3 under a 4 MB/s budget; its process group
    (trainer and uploader) is SIGKILLed right after commit(4), before step 4 is up. A restart on
    the same node (a new store on the same local directory) queues step 4 again and its wait()
    returns once it is at the destination; a fresh node then finds and loads step 4."""
    dest = f"s3://{s3_bucket}/run/ckpt"
    local = tmp_path / "local"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, TESTS])}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(TRAINER),
            dest,
            str(local),
            s3_server.endpoint_url,
            str(tmp_path / "budget"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 120
        for line in proc.stdout:
            if line.strip() == "committed 4":
                break
            assert time.monotonic() < deadline, "trainer too slow"
        else:
            pytest.fail(f"trainer ended early: {proc.wait()} {proc.stderr.read() if proc.stderr else ''}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    time.sleep(0.5)  # the group is gone: nothing uploads any more
    restart = CheckpointStore(dest, local, keep_last=3, endpoint_url=s3_server.endpoint_url)
    assert not restart.remote_steps().get(4), "step 4 was already up: the kill came too late to test anything"
    assert restart.latest() == 4  # locally
    restart.wait(timeout=120)
    assert restart.remote_steps().get(4) is True
    assert restart.requeued[0] == 4  # newest first
    restart.close()
    fresh = CheckpointStore(dest, tmp_path / "fresh", endpoint_url=s3_server.endpoint_url)
    assert fresh.latest() == 4
    assert (fresh.load(4) / "model.bin").read_bytes() == bytes([4]) * (6 << 20)


# ------------------------------------------------------------------ 2. latest() says what it skipped
def test_a_damaged_newest_remote_step_is_reported_and_the_previous_one_loaded_and_kept(tmp_path: Path) -> None:
    """One byte flipped in the destination's newest step: a fresh node's latest() warns naming the
    step and the file, returns the step before, which loads; the resumed run's commits then never
    delete a step older than the skipped one, though keep_last=2 would have."""
    dest = tmp_path / "dest"
    with CheckpointStore(dest, tmp_path / "local", keep_last=3) as store:
        for step in (1, 2, 3):
            write_step(store, step)
    flip(dest / step_name(3) / "model.bin")
    fresh = CheckpointStore(dest, tmp_path / "fresh", keep_last=2)
    with pytest.warns(CheckpointWarning, match=rf"{step_name(3)} skipped: .*{step_name(3)}/model.bin: checksum"):
        assert fresh.latest() == 2
    assert set(fresh.skipped) == {3}
    assert (fresh.load(2) / "model.bin").read_bytes() == bytes([2]) * 5000
    for step in (1, 2):  # what the resume fell back to is never written over
        with pytest.raises(CheckpointError, match=rf"{step_name(step)}: committed, and older than {step_name(3)}"):
            fresh.begin(step)
    for step in (3, 4, 5):  # the run goes on from step 2
        write_step(fresh, step)
    fresh.wait(timeout=60)
    assert fresh.remote_steps() == {1: True, 2: True, 4: True, 5: True}
    assert fresh.local_steps() == [2, 4, 5]
    fresh.close()


def test_latest_then_load_read_a_remote_step_once(s3_server, s3_bucket: str, s3_proxy, tmp_path: Path) -> None:
    """A fresh node's deep latest() downloads the step once, verifying as it streams, and load()
    hands out that copy: the step's bytes cross the wire once, not twice."""
    dest = f"s3://{s3_bucket}/ck"
    size = 3 << 20
    with CheckpointStore(dest, tmp_path / "local", endpoint_url=s3_server.endpoint_url) as store:
        write_step(store, 1, size=size)
    s3_proxy.reset_counters()
    fresh = CheckpointStore(dest, tmp_path / "fresh", endpoint_url=s3_proxy.url)
    assert fresh.latest() == 1
    path = fresh.load(1)
    assert (path / "model.bin").read_bytes() == bytes([1]) * size
    assert s3_proxy.traffic().response_bytes("GET", key="model.bin") == size


# ------------------------------------------------------------------ 3. a step is bound to its name
def test_swapped_and_copied_local_steps_are_refused(tmp_path: Path) -> None:
    local = tmp_path / "local"
    store = CheckpointStore(None, local, keep_last=None)
    for step in (1, 2):
        write_step(store, step)
    shutil.copytree(local / step_name(1), local / step_name(3))  # a restore gone wrong
    fresh = CheckpointStore(None, local, keep_last=None)
    with pytest.warns(
        CheckpointWarning, match=rf"{step_name(3)} skipped: .*records step 1, found under {step_name(3)}"
    ):
        assert fresh.latest() == 2
    with pytest.raises(CheckpointError, match="records step 1"):
        fresh.load(3)
    os.rename(local / step_name(1), tmp_path / "one")  # swap steps 1 and 2
    os.rename(local / step_name(2), local / step_name(1))
    os.rename(tmp_path / "one", local / step_name(2))
    for step in (1, 2):
        report = fresh.verify(step)
        assert not report.ok and f"found under {step_name(step)}" in report.problems[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert fresh.latest() is None
    assert sorted(str(w.message).split()[1] for w in caught) == [step_name(s) for s in (1, 2, 3)]


def test_a_copied_step_at_the_destination_fails_ckpt_verify(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dest = tmp_path / "dest"
    with CheckpointStore(dest, tmp_path / "local", keep_last=None) as store:
        for step in (1, 2):
            write_step(store, step)
    assert cli_main(["ckpt", "verify", str(dest)]) == 0
    shutil.rmtree(dest / step_name(2))
    shutil.copytree(dest / step_name(1), dest / step_name(2))
    capsys.readouterr()
    assert cli_main(["ckpt", "verify", str(dest)]) == 1
    assert f"{step_name(2)}/{COMMIT_NAME}: records step 1" in capsys.readouterr().err
    fresh = CheckpointStore(dest, tmp_path / "fresh")
    with pytest.warns(CheckpointWarning, match=step_name(2)):
        assert fresh.latest() == 1


# ------------------------------------------------------------------ 4. special files
@pytest.mark.parametrize("name", [COMMIT_NAME, part_name(0)])
def test_a_fifo_as_a_local_marker_or_part_manifest_never_blocks(tmp_path: Path, name: str) -> None:
    local = tmp_path / "local"
    store = CheckpointStore(None, local, keep_last=None)
    for step in (1, 2):
        write_step(store, step)
    fifo = local / step_name(2) / name
    fifo.unlink()
    os.mkfifo(fifo)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert within(10, store.latest, fifo) == 1
    assert any(
        issubclass(w.category, CheckpointWarning) and "a FIFO" in str(w.message) and name in str(w.message)
        for w in caught
    ), [str(w.message) for w in caught]
    assert not within(10, lambda: store.verify(2), fifo).ok
    with pytest.raises(CheckpointError, match="a FIFO"):
        within(10, lambda: store.load(2), fifo)


@pytest.mark.parametrize("name", [COMMIT_NAME, part_name(0), "model.bin"])
def test_a_directory_in_place_of_a_step_file_is_a_typed_error(tmp_path: Path, name: str) -> None:
    local = tmp_path / "local"
    store = CheckpointStore(None, local, keep_last=None)
    for step in (1, 2):
        write_step(store, step)
    (local / step_name(2) / name).unlink()
    (local / step_name(2) / name).mkdir()
    with pytest.warns(CheckpointWarning, match=name):
        assert store.latest() == 1
    with pytest.raises(CheckpointError, match=name) as caught:
        store.load(2)
    assert isinstance(caught.value, TierflowError) and not isinstance(caught.value, IsADirectoryError)


def test_a_fifo_written_into_a_step_fails_its_commit_and_leaves_no_temporary(tmp_path: Path) -> None:
    local = tmp_path / "local"
    store = CheckpointStore(None, local)
    write_step(store, 1)
    step_dir = store.begin(2)
    os.mkfifo(step_dir / "pipe")
    with pytest.raises(CheckpointError, match="pipe.*a FIFO"):
        within(10, lambda: store.commit(2), step_dir / "pipe")
    assert sorted(p.name for p in local.iterdir()) == [step_name(1)]


# ------------------------------------------------------------------ 5. unreadable newest remote step
def test_a_fresh_node_falls_back_past_an_unreadable_newest_marker(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    with CheckpointStore(dest, tmp_path / "local", keep_last=None) as store:
        for step in (1, 2):
            write_step(store, step)
    marker = dest / step_name(2) / COMMIT_NAME
    marker.unlink()
    os.mkfifo(marker)  # listed as an object, never readable
    fresh = CheckpointStore(dest, tmp_path / "fresh")
    with pytest.warns(CheckpointWarning, match=rf"{step_name(2)} skipped: .*{COMMIT_NAME}: unreadable"):
        assert within(30, fresh.latest, marker) == 1
    assert fresh.load(1).is_dir()


@pytest.mark.slow
def test_a_fresh_node_falls_back_past_503s_on_the_newest_marker(
    s3_server, s3_bucket: str, s3_proxy, tmp_path: Path
) -> None:
    dest = f"s3://{s3_bucket}/ck"
    with CheckpointStore(dest, tmp_path / "local", keep_last=None, endpoint_url=s3_server.endpoint_url) as store:
        for step in (1, 2):
            write_step(store, step)
    s3_proxy.inject("503", 1000, method="GET", key=f"{step_name(2)}/{COMMIT_NAME}")
    fresh = CheckpointStore(dest, tmp_path / "fresh", endpoint_url=s3_proxy.url)
    with pytest.warns(CheckpointWarning, match=rf"{step_name(2)} skipped: .*{COMMIT_NAME}: unreadable"):
        assert fresh.latest() == 1
    assert (fresh.load(1) / "model.bin").read_bytes() == bytes([1]) * 5000


# ------------------------------------------------------------------ 6. full disk, temporaries
def test_a_commit_on_a_full_disk_names_its_file_and_leaves_no_temporary(tmp_path: Path, small_tmpfs) -> None:
    local = small_tmpfs("1m")
    store = CheckpointStore(None, local)
    write_step(store, 1)
    step_dir = store.begin(2)
    fd = os.open(step_dir / "model.bin", os.O_WRONLY | os.O_CREAT)  # a model write, until the disk is full
    try:
        while True:
            os.write(fd, b"\x01" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    with pytest.raises(CheckpointError) as caught:
        store.commit(2)
    assert caught.value.errno == errno.ENOSPC
    assert str(local) in str(caught.value) and ("tierflow-" in str(caught.value) or "model.bin" in str(caught.value))
    assert "ENOSPC" in str(caught.value)
    assert sorted(p.name for p in local.iterdir()) == [step_name(1)]  # the temporary is gone, step 1 whole
    assert store.latest() == 1


HOLDER = """
import sys, time
from tierflow.checkpoint import CheckpointStore
store = CheckpointStore(None, sys.argv[1])
step_dir = store.begin(int(sys.argv[2]))
(step_dir / "model.bin").write_bytes(b"x" * 1000)
print(step_dir.name, flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_temporaries_of_dead_commits_are_swept_and_live_ones_kept(tmp_path: Path) -> None:
    """Two processes begin a step each; one is SIGKILLed. A store opened next sweeps the dead
    one's temporary and keeps the live one's (its flock), then sweeps it too once it is killed."""
    local = tmp_path / "local"
    env = {**os.environ, "PYTHONPATH": SRC}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(HOLDER), str(local), str(step)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for step in (5, 6)
    ]
    try:
        names = [p.stdout.readline().strip() for p in procs]  # type: ignore[union-attr]
        assert all(n.startswith(".tmp-step-") for n in names)
        procs[0].kill()
        procs[0].wait()
        store = CheckpointStore(None, local)
        assert store.swept == [names[0]]
        assert sorted(p.name for p in local.iterdir()) == [names[1]]
        procs[1].kill()
        procs[1].wait()
        write_step(store, 7)  # begin() sweeps as well
        assert sorted(p.name for p in local.iterdir()) == [step_name(7)]
        assert store.swept == names
    finally:
        for p in procs:
            p.kill()
            p.wait()


# ------------------------------------------------------------------ 7. upload deadline
@pytest.mark.slow
def test_an_upload_to_a_silent_peer_fails_at_the_deadline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer that accepts connections and never answers: the uploader's PUT fails after the
    deadline reads have (TIERFLOW_FETCH_DEADLINE, 3 s here), not after 6 x 30 s."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    monkeypatch.setenv("TIERFLOW_FETCH_DEADLINE", "3")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    try:
        store = CheckpointStore(
            "s3://silent/ck", tmp_path / "local", endpoint_url=f"http://127.0.0.1:{silent.getsockname()[1]}"
        )
        write_step(store, 1)
        started = time.monotonic()
        with pytest.raises(CheckpointError, match=r"upload failed: SourceTimeout: .*step-00000001/"):
            store.wait(timeout=90)
        assert time.monotonic() - started < 30
        assert store.verify(1).ok  # the local step stays whole
        store.close(wait=False)
    finally:
        silent.close()


@pytest.mark.slow
def test_an_upload_held_by_the_budget_is_not_cut_by_the_deadline(
    s3_server, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Time spent waiting on the bandwidth budget is not time spent on the peer: a 512 KiB upload at
    256 KiB/s (~2 s) to S3 outlives a 1 s deadline and still succeeds."""
    from tierflow.storage.remote import open_store

    monkeypatch.setenv("TIERFLOW_FETCH_DEADLINE", "1")
    budget = BandwidthBudget(256 << 10, tmp_path / "budget", burst=64 << 10, node_rate=None)
    src = tmp_path / "blob"
    src.write_bytes(os.urandom(512 << 10))
    source = open_store(f"s3://{s3_bucket}/x", endpoint_url=s3_server.endpoint_url, budget=budget)
    started = time.monotonic()
    source.upload(src, "blob")
    assert time.monotonic() - started > 1.5
    assert source.read_bytes("blob") == src.read_bytes()
