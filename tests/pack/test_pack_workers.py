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


def _same_command(child: psutil.Process, parent: psutil.Process) -> bool:
    """Forked pool workers share the parent's command line (a resource tracker would not); a child
    that has just exited (a zombie, or gone) is no worker."""
    try:
        return child.cmdline() == parent.cmdline()
    except (psutil.ZombieProcess, psutil.NoSuchProcess):
        return False


@pytest.mark.slow
def test_pack_workers_die_within_seconds_of_a_sigkilled_parent(tmp_path):
    with open(tmp_path / "docs.jsonl", "w") as f:
        for i in range(40000):
            f.write(json.dumps({"id": i, "text": f"document {i}"}) + "\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "src")}
    parent = subprocess.Popen(
        [sys.executable, "-c", SLOW_PACK, str(tmp_path / "docs.jsonl"), str(tmp_path / "out")], env=env
    )
    workers: list[int] = []
    try:
        me = psutil.Process(parent.pid)
        deadline = time.monotonic() + 60
        while len(workers) < 2 and time.monotonic() < deadline and parent.poll() is None:
            workers = [c.pid for c in me.children() if _same_command(c, me)]
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
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def small_disk(small_tmpfs) -> Path:
    return small_tmpfs("8m")


def compressible(path: Path, rows: int = 20000) -> Path:
    """~11.5 MB of JSONL whose decoded Arrow form is ~11 MB and whose shards are ~0.1 MB."""
    with open(path, "w") as f:
        for i in range(rows):
            f.write(json.dumps({"id": i, "text": f"doc {i} " + "lorem ipsum dolor sit amet " * 20}) + "\n")
    return path


def test_pack_scratch_is_bounded_by_the_units_in_flight_not_the_dataset(tmp_path, small_disk):
    import tierflow

    src = compressible(tmp_path / "docs.jsonl")
    # 8 MB of disk for a dataset of 11 MB decoded in one 256 MB shard: the workers' scratch files
    # must go as the shard writer consumes them, not when the shard is sealed
    summary = tierflow.pack([src], small_disk / "out", workers=2, chunk_bytes=512 << 10)
    decoded = sum(s.decoded_bytes for s in summary.manifest.shards)
    assert decoded > 8 << 20 > 10 * sum(s.bytes for s in summary.manifest.shards)
    assert tierflow.open_dataset(small_disk / "out")[19999]["id"] == 19999
    assert not (small_disk / "out" / ".tmp-pack").exists()


def test_pack_without_room_for_its_scratch_says_how_much_it_needs_and_where(tmp_path, small_disk):
    import tierflow
    from tierflow.errors import PackInputError

    src = compressible(tmp_path / "docs.jsonl")  # one 16 MB unit: 11.5 MB of scratch at once
    out = small_disk / "out"
    with pytest.raises(
        PackInputError,
        match=rf"{out}: no space left .* needs about 11\.\d MB of scratch in "
        rf"{out / '.tmp-pack'} \(1 unit of up to 11\.\d MB .* MB are free",
    ):
        tierflow.pack([src], out, workers=2)
    assert [p.name for p in out.iterdir()] == [".tierflow.lock"]


def test_a_shard_whose_compression_does_not_pay_is_rewritten_plain_from_its_own_file(tmp_path):
    import numpy as np
    import pyarrow as pa

    from tierflow.format.shard_writer import ShardWriter
    from tierflow.format.verify import verify_shard

    schema = pa.schema([("blob", pa.binary()), ("tokens", pa.list_(pa.uint16()))])
    rng = np.random.default_rng(3)
    batches = [
        pa.RecordBatch.from_arrays(
            [
                pa.array([rng.bytes(300 + i) for i in range(50)]),
                pa.array([list(range(i % 7)) for i in range(50)], pa.list_(pa.uint16())),
            ],
            schema=schema,
        ).slice(3, 40)
        for _ in range(5)
    ]  # random bytes do not compress; slices, as the assembler cuts them
    infos = {}
    for compression in ("zstd", "none"):
        directory = tmp_path / compression
        directory.mkdir()
        writer = ShardWriter(directory, schema, compression, token_column="tokens")
        for batch in batches:
            writer.write(batch)
        infos[compression] = info = writer.close()
        assert [p.name for p in directory.iterdir()] == [info.name]  # no temporary left
        assert verify_shard(directory / info.name, info) == []
    assert infos["zstd"].compression == "none"
    assert infos["zstd"] == infos["none"]
    assert infos["none"].checksum == infos["none"].decoded_checksum


def test_a_worker_whose_parent_is_already_gone_kills_itself():
    from tierflow.pack._workers import die_with_parent

    child = os.fork()
    if child == 0:  # started by "parent" 1, which is not (no longer) its parent: the race
        die_with_parent(1)
        os._exit(0)
    _, status = os.waitpid(child, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


WATCHED = """
import os, sys, time
from tierflow.pack._workers import _watch_parent

parent = os.getpid()
child = os.fork()
if child == 0:
    _watch_parent(parent)
    os._exit(0)
print(child, flush=True)
time.sleep(60)
"""


@pytest.mark.slow
def test_the_watchdog_ends_a_worker_whose_parent_was_killed():
    """The fallback where the kernel offers no parent-death signal."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "src")}
    parent = subprocess.Popen([sys.executable, "-c", WATCHED], env=env, stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        assert not _gone(child)
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 5
        while not _gone(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(child)
    finally:
        parent.kill()
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
