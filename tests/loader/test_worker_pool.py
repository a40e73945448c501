"""The Loader's own worker pool (loader/workers.py): batches through shared-memory rings.

Exact order and resume against the main process, a lost worker named in a `WorkerLostError`, a
worker's error raised in the loop, the backpressure bound (a worker runs at most its slots ahead),
a loop that keeps every batch (copied out, so no worker waits for ever), and a SIGKILLed trainer
that leaves no worker and no shared-memory segment behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from itertools import islice
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

import tierflow
from tierflow.errors import WorkerLostError
from tierflow.loader import BatchSpec, Loader, OrderSpec, TieredDataset
from tierflow.loader.batching import Samples
from tierflow.loader.workers import MAX_SLOTS
from tierflow.testing import assert_resumes_exactly

from corpora import write_letters

pytestmark = [pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


@pytest.fixture(scope="module")
def docs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pool")
    write_letters(root / "docs.jsonl", 3000, 20, 300, seed=5)
    tierflow.pack([root / "docs.jsonl"], root / "ds", tokenizer="bytes", workers=1, target_shard_bytes=256 << 10)
    return root / "ds"


def _windows(docs: Path) -> TieredDataset:
    return TieredDataset(str(docs), BatchSpec(batch_size=8, seq_len=64))


def _fingerprint(loader: Loader, n: int) -> list[tuple]:
    out = []
    for batch, meta in islice(loader, n):
        out.append(
            (
                {k: v.clone() for k, v in batch.items() if isinstance(v, torch.Tensor)},
                meta.sample_ids.tolist(),
                meta.index,
                meta.epoch,
                meta.cursor.to_dict(),
            )
        )
    return out


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_pool_batches_equal_the_main_processs_in_order(docs, workers):
    reference = _fingerprint(Loader(_windows(docs), device="cpu", return_meta=True, endless=True), 90)
    with Loader(_windows(docs), device="cpu", num_workers=workers, return_meta=True, endless=True) as loader:
        got = _fingerprint(loader, 90)
        assert len(loader._source.processes) == workers
    assert len(got) == len(reference) == 90
    for (data, ids, index, epoch, cursor), (rdata, rids, rindex, repoch, rcursor) in zip(got, reference):
        assert data.keys() == rdata.keys() and all(data[k].equal(rdata[k]) for k in data)
        assert (ids, index, epoch, cursor) == (rids, rindex, repoch, rcursor)


def test_text_columns_travel_in_the_ring_as_the_strings_they_were(docs):
    text = docs.parent / "text"
    if not (text / "manifest.json").exists():
        tierflow.pack([docs.parent / "docs.jsonl"], text, workers=1, target_shard_bytes=256 << 10)

    def batches(workers):
        ds = TieredDataset(str(text), BatchSpec(batch_size=8, batcher=Samples()))
        with Loader(ds, device="cpu", num_workers=workers, return_meta=True) as loader:
            return [(batch, meta.sample_ids.tolist()) for batch, meta in islice(loader, 40)]

    for (got, ids), (want, want_ids) in zip(batches(2), batches(0), strict=True):
        assert ids == want_ids and list(got) == list(want)
        for key, value in want.items():
            if isinstance(value, torch.Tensor):
                assert got[key].equal(value), key
            elif isinstance(value, np.ndarray):
                assert np.array_equal(got[key], value), key
            else:
                assert got[key] == value, key
        assert any(isinstance(v, list) and v and isinstance(v[0], str) for v in got.values())


def test_pool_resumes_exactly_mid_epoch(docs):
    assert_resumes_exactly(
        lambda workers: Loader(_windows(docs), device="cpu", num_workers=workers), stops=[7, 33], workers=2
    )
    reference = [b["input_ids"] for b in islice(Loader(_windows(docs), device="cpu"), 60)]
    with Loader(_windows(docs), device="cpu", num_workers=2) as loader:
        got = [b["input_ids"].clone() for b in islice(loader, 25)]
        state = json.loads(json.dumps(loader.state_dict()))
    with Loader(_windows(docs), device="cpu", num_workers=2) as resumed:
        resumed.load_state_dict(state)
        got += [b["input_ids"].clone() for b in islice(resumed, 35)]
    assert all(a.equal(b) for a, b in zip(got, reference, strict=True))


def test_a_loop_that_keeps_every_batch_gets_them_all(docs):
    """Beyond `hold` batches of a worker alive in the loop, batches are copied out of their slot."""
    reference = [b["input_ids"] for b in islice(Loader(_windows(docs), device="cpu", endless=True), 120)]
    with Loader(_windows(docs), device="cpu", num_workers=2, endless=True) as loader:
        kept = list(islice(loader, 120))  # far more than any worker's slots
    assert all(a["input_ids"].equal(b) for a, b in zip(kept, reference, strict=True))


def test_a_worker_sends_a_run_of_batches_per_message():
    """Batches built quickly go out a run per message (1, 2, 4, then up to RUN_BATCHES), not one each."""
    import multiprocessing.connection
    import socket
    from multiprocessing.reduction import recv_handle

    from tierflow.loader._collate import CarriedBatch
    from tierflow.loader.workers import _Ring

    ours, theirs = socket.socketpair()
    trainer = multiprocessing.connection.Connection(ours.detach())
    ring = _Ring(multiprocessing.connection.Connection(theirs.detach()), slots=40, hold=4)
    for n in range(30):
        ring.put(CarriedBatch({"x": np.full(8, n)}, None))
    ring.flush()
    sizes = []
    while trainer.poll(0.5) and sum(sizes) < 30:
        message = trainer.recv()
        if message[0] == "arena":
            os.close(recv_handle(trainer))
        else:
            sizes.append(len(message[1]))
    assert sum(sizes) == 30 and sizes[0] == 1 and len(sizes) < 30 / 2, sizes
    ring.connection.close()
    trainer.close()


def _slow(sample, rng):
    time.sleep(0.002)
    return sample


def test_batches_slow_to_build_each_go_out_as_soon_as_built(docs, monkeypatch):
    """A worker does not hold a built batch back for a run while it builds the next slow one."""
    from tierflow.loader.workers import PoolIterator

    sizes = []
    receive = PoolIterator._receive

    def counted(self, worker):
        message = receive(self, worker)
        if message[0] == "batches":
            sizes.append(len(message[1]))
        return message

    monkeypatch.setattr(PoolIterator, "_receive", counted)
    ds = TieredDataset(str(docs), BatchSpec(batch_size=8, batcher=Samples(), transform=_slow))
    with Loader(ds, device="cpu", num_workers=1, background=False, endless=True) as loader:
        assert len(list(islice(loader, 12))) == 12
    assert set(sizes) == {1}, sizes


def test_a_killed_worker_is_named_in_the_error(docs):
    loader = Loader(_windows(docs), device="cpu", num_workers=2, endless=True)
    with pytest.raises(WorkerLostError, match=r"tierflow worker 1 of 2 \(pid \d+\) was killed by signal SIGKILL"):
        for step, _ in enumerate(loader):
            if step == 3:
                os.kill(loader._source.processes[1].pid, signal.SIGKILL)
            assert step < 500
    loader.close()


def _fail_at_sample_100(sample, rng):
    if int(sample["id"]) == 100:
        raise KeyError("sample 100 is bad")
    return sample


def test_a_workers_error_is_raised_in_the_loop_with_its_traceback(docs):
    ds = TieredDataset(
        str(docs), BatchSpec(batch_size=8, batcher=Samples(), transform=_fail_at_sample_100), OrderSpec(shuffle=False)
    )
    with Loader(ds, device="cpu", num_workers=2) as loader, pytest.raises(KeyError, match="sample 100") as caught:
        for _ in loader:
            pass
    assert any("raised in tierflow worker" in note for note in getattr(caught.value, "__notes__", []))


def _count_built(sample):
    with open(os.environ["TIERFLOW_TEST_BUILT"], "a") as f:
        f.write("x")
    return True


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # Python prints what it drops
def test_an_exit_raised_by_a_signal_handler_inside_a_slots_finalizer_ends_the_loop(docs, monkeypatch):
    """A SIGTERM handler's `sys.exit` that lands while a finalizer gives a slot back is printed and
    dropped by Python; the loop must still exit, at its next batch."""
    previous = signal.signal(signal.SIGUSR1, lambda *_: sys.exit(143))
    try:
        with Loader(_windows(docs), device="cpu", num_workers=2, background=False, endless=True) as loader:
            iterator = iter(loader)
            batch = next(iterator)
            channels = loader._source._channels
            give_back = type(channels[0]).give_back

            def signalled(channel, generation, slot):
                signal.raise_signal(signal.SIGUSR1)  # its handler runs here, inside the finalizer
                give_back(channel, generation, slot)

            monkeypatch.setattr(type(channels[0]), "give_back", signalled)
            del batch
            with pytest.raises(SystemExit):
                for _ in range(4):
                    next(iterator)
    finally:
        signal.signal(signal.SIGUSR1, previous)


@pytest.mark.slow
def test_workers_run_ahead_only_as_far_as_their_slots(docs, tmp_path, monkeypatch):
    built = tmp_path / "built"
    built.touch()
    monkeypatch.setenv("TIERFLOW_TEST_BUILT", str(built))
    ds = TieredDataset(str(docs), BatchSpec(batch_size=8, batcher=Samples(), filter=_count_built))
    workers, depth = 2, 2
    with Loader(ds, device="cpu", num_workers=workers, depth=depth, background=False, endless=True) as loader:
        iterator = iter(loader)
        held = [next(iterator) for _ in range(3)]
        time.sleep(1.5)
        first = built.stat().st_size
        time.sleep(1.0)
        assert built.stat().st_size == first, "the workers kept building with the loop standing still"
        # a worker dealt none of the batches taken yet has not been heard from: its ring is at most MAX_SLOTS
        slots = [arena.slots if arena is not None else MAX_SLOTS for arena in loader._source._arenas]
        assert all(s >= 2 + depth + 2 for s in slots)  # at least prefetch_factor + hold
        received = 3 + 1  # what the loop took, and the feed's one read ahead
        assert first <= 8 * (received + sum(s + 1 for s in slots))  # + one built while waiting for a slot
        assert first < 8 * 300, "the workers ran far ahead"
        assert len(held) == 3


TRAINER = """
import os, sys, time
from tierflow.loader import BatchSpec, Loader, TieredDataset

if __name__ == "__main__":
    loader = Loader(TieredDataset(sys.argv[1], BatchSpec(batch_size=8, seq_len=64)), device="cpu", num_workers=2, endless=True)
    for step, batch in enumerate(loader):
        if step == 20:
            print("ready", flush=True)
        time.sleep(0.01)
"""


@pytest.mark.slow
def test_a_sigkilled_trainer_leaves_no_worker_and_no_shared_memory(docs, tmp_path):
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(tierflow.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.Popen(
        [sys.executable, str(script), str(docs)], stdout=subprocess.PIPE, env=env, start_new_session=True
    )
    try:
        assert proc.stdout.readline().startswith(b"ready")
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 2
        rings = [p for p in children for m in p.memory_maps(grouped=False) if "tierflow-ring" in m.path]
        assert rings, "the workers map no ring"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 5
        while (
            any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in children) and time.monotonic() < deadline
        ):
            time.sleep(0.05)
        assert not [p.pid for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        shm_after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
        assert not [name for name in shm_after - shm_before if "tierflow" in name or name.startswith("torch")]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.stdout.close()


FORKSERVER_CHILD = """
import multiprocessing.forkserver as fs, sys, time
from tierflow.loader import BatchSpec, Loader, TieredDataset
loader = Loader(TieredDataset(sys.argv[1], BatchSpec(batch_size=8, seq_len=64)), num_workers=2,
                multiprocessing_context="forkserver")
loader.start_prefetch()
deadline = time.monotonic() + 60
while fs._forkserver._forkserver_pid is None and time.monotonic() < deadline:
    time.sleep(0.05)
print(fs._forkserver._forkserver_pid)
sys.stdout.flush()
time.sleep(20 if len(sys.argv) > 2 else 0)
next(iter(loader))
loader.close()
"""


def test_start_prefetch_starts_the_forkserver_with_torch_already_imported(docs: Path) -> None:
    """Over an object store the workers come from a forkserver: `start_prefetch` (open_loader calls
    it) starts it at once, with torch and tierflow imported there, so that cost overlaps the model's
    loading and no worker pays it again."""
    env = {**os.environ, "PYTHONPATH": str(Path(tierflow.__file__).parents[1])}
    child = subprocess.Popen(
        [sys.executable, "-c", FORKSERVER_CHILD, str(docs), "wait"], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        line = child.stdout.readline().strip() if child.stdout else ""
        assert line.isdigit(), f"no forkserver started before the first batch: {line!r}"
        server = psutil.Process(int(line))
        deadline = time.monotonic() + 60
        while not any("libtorch" in m.path for m in server.memory_maps()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert any("libtorch" in m.path for m in server.memory_maps())
    finally:
        child.kill()
        child.wait()


FORK_AFTER_A_DROPPED_RING = """
import gc, os
from tierflow.loader.ring import Arena, anonymous_memory

gc.disable()
class Cycle:
    pass
dropped = Cycle()
dropped.me, dropped.arena = dropped, Arena(anonymous_memory(16 << 16), 16, 1 << 16, 0)
dropped.view = dropped.arena.slot(0)
del dropped  # the training process's ring of an ended pool, left for the cycle collector
pid = os.fork()
if pid == 0:
    ring = Arena(anonymous_memory(16 << 16), 16, 1 << 16, 0)  # a new worker's ring
    ring.slot(1)[:] = 1
    gc.collect()
    ring.slot(1)[:] = 2
    os._exit(0)
_, status = os.waitpid(pid, 0)
print(os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
"""


@pytest.mark.slow
def test_a_forked_worker_collecting_an_inherited_ring_keeps_its_own():
    """A ring mapped MADV_DONTFORK is not in a forked worker, but its Python object is: when the
    worker's cycle collector freed it, munmap removed the worker's own ring mapped since at that
    address, and the worker died of SIGSEGV (an intermittent WorkerLostError under load)."""
    done = subprocess.run(
        [sys.executable, "-c", FORK_AFTER_A_DROPPED_RING], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0", f"the forked worker ended by signal/status {done.stdout.strip()}"


def test_views_of_one_window_buffer_come_out_of_the_ring_as_views_of_one_array():
    """`input_ids` and `labels` of a worker's window buffer widen once in the device feed, as they do
    without workers, and the slot stays the loop's while either view lives."""
    import gc
    import weakref

    from tierflow.loader.device_feed_tensors import widen_numpy
    from tierflow.loader.ring import Arena, anonymous_memory, lay_out, view_batch

    windows = np.arange(4 * 9, dtype=np.uint16).reshape(4, 9)
    data = {"input_ids": windows[:, :-1], "labels": windows[:, 1:], "text": ["a", "bé"], "n": 3}
    placed, layout, rest, _ = lay_out(data)
    arena = Arena(anonymous_memory(2 << 16), 2, 1 << 16, 0)
    arena.write(0, placed)
    slot = arena.slot(0)
    returned: list[int] = []
    weakref.finalize(slot, returned.append, 0)
    batch = view_batch(slot, layout, rest, list(data))
    del slot
    assert batch["text"] == ["a", "bé"] and batch["n"] == 3
    owners: dict = {}
    ids, made = widen_numpy(batch["input_ids"], np.dtype(np.int64), owners)
    labels, again = widen_numpy(batch["labels"], np.dtype(np.int64), owners)
    assert (ids == windows[:, :-1]).all() and (labels == windows[:, 1:]).all()
    assert made == windows.size * 8 and again == 0
    kept = batch["labels"]
    del batch, ids, labels, owners
    gc.collect()
    assert returned == [] and (kept == windows[:, 1:]).all()
    del kept
    gc.collect()
    assert returned == [0]


@pytest.mark.slow
def test_text_goes_through_the_ring_as_utf8_and_arrives_as_the_main_process_reads_it(tmp_path):
    """A worker hands a string column to its ring as views of the block's UTF-8 bytes (no decode and
    encode between), and the loop gets the same strings, nulls and order as without workers."""
    source = tmp_path / "docs.jsonl"
    with open(source, "w") as f:
        for i in range(4000):
            text = None if i >= 3600 and i % 97 == 5 else "é" * (i % 7) + f"document {i} " + "x" * (i % 300)
            f.write(json.dumps({"id": i, "text": text}) + "\n")
    data = tmp_path / "docs"
    tierflow.pack([str(source)], str(data), workers=1, target_shard_bytes=256 << 10)

    def batches(workers: int) -> list[tuple[list, list]]:
        with tierflow.open_loader(str(data), batch_size=8, num_workers=workers, seed=3) as loader:
            return [(list(b["text"]), [int(x) for x in b["id"]]) for b in loader]

    alone, pooled = batches(0), batches(2)
    assert pooled == alone and len(alone) == 500
    assert any(None in texts for texts, _ in alone)
    assert all(type(t) is str for texts, _ in pooled for t in texts if t is not None)
    ds = TieredDataset(str(data), BatchSpec(batch_size=8, batcher=Samples()))
    sent = [t for b in islice(ds.worker_batches(0, 2, text_views=True), 50) for t in b.data["text"]]
    assert any(type(t) is memoryview for t in sent)  # from the blocks without nulls


def test_text_columns_are_written_into_their_slot_value_after_value():
    """A text column's values (strings, bytes, or UTF-8 views of a block) land in the slot one after
    another behind their offsets, in a slot past the first, and come out as they went in."""
    from tierflow.loader.ring import Arena, anonymous_memory, lay_out, view_batch

    block = memoryview("añb€cd".encode())
    data = {
        "views": [block[0:3], block[3:7], block[7:9]],
        "blobs": [b"\x00\x01", b"", b"xyz"],
        "names": ["é", "f"],
    }
    placed, layout, rest, size = lay_out(data)
    assert size >= 9 + 4 * 8 and not rest
    arena = Arena(anonymous_memory(4 << 12), 4, 1 << 12, 0)
    arena.write(2, placed)
    batch = view_batch(arena.slot(2), layout, rest, list(data))
    assert batch == {"views": ["añ", "b€", "cd"], "blobs": [b"\x00\x01", b"", b"xyz"], "names": ["é", "f"]}
    assert not arena.slot(1).any() and not arena.slot(3).any()


@pytest.fixture(scope="module")
def many_blocks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~8 MB of text in shards of 1 MB and blocks of 256 KB (38 blocks): blocks enough that dealing
    a lane's batches to one worker shows in the decodes."""
    root = tmp_path_factory.mktemp("blocks")
    write_letters(root / "docs.jsonl", 4000, 1000, 3000, seed=11)
    tierflow.pack([root / "docs.jsonl"], root / "ds", workers=1, target_shard_bytes=1 << 20, block_bytes=256 << 10)
    return root / "ds"


@pytest.mark.slow
def test_the_pool_deals_a_lanes_batches_to_one_worker_so_its_blocks_are_decoded_about_once(
    many_blocks, tmp_path, monkeypatch
):
    """Dealt in turn, both workers read most blocks and each decodes them; dealt by lane, a block is
    decoded by the worker that holds its lane (counted in every process: the instrumented load is
    inherited by the forked workers). The batches are the main process's either way."""
    from tierflow.format import table

    load = table.LazyShardTable._load
    log = tmp_path / "loads"

    def counted(self, block):
        with open(log, "a") as out:
            out.write(f"{os.getpid()} {self.name} {block}\n")
        return load(self, block)

    monkeypatch.setattr(table.LazyShardTable, "_load", counted)

    def epoch(workers):
        log.unlink(missing_ok=True)
        ds = TieredDataset(str(many_blocks), BatchSpec(batch_size=8, batcher=Samples()), OrderSpec(seed=3))
        with Loader(ds, device="cpu", num_workers=workers, return_meta=True) as loader:
            ids = [meta.sample_ids.tolist() for _, meta in loader]
        rows = [line.split() for line in log.read_text().splitlines()]
        return ids, len(rows), len({(name, block) for _, name, block in rows}), len({pid for pid, _, _ in rows})

    ids, loads, blocks, processes = epoch(0)
    assert loads == blocks >= 32 and processes == 1
    pooled, loads, blocks_read, processes = epoch(2)
    assert pooled == ids and blocks_read == blocks and processes == 2
    # by lane 61 decodes of 38 blocks (a lane moves when one worker is dealt `lag` more), in turn 88
    assert loads <= 2 * blocks, f"{loads} decodes of {blocks} blocks by 2 workers"


def test_a_worker_dealt_lanes_bounds_its_decoded_blocks_by_its_share_of_the_lanes(many_blocks):
    """Dealt by lane among 2 workers, a worker reads about half the lanes at once (and one moving to
    it): its decoded-block cache is bounded by those, where a DataLoader worker's (in turn) is not."""

    def bound(lag):
        order = OrderSpec(seed=3, lanes=8, window_shards=1)
        ds = TieredDataset(str(many_blocks), BatchSpec(batch_size=8, batcher=Samples()), order)
        next(ds.worker_batches(0, 2, lag=lag))
        return ds, ds._open().dataset.source.cache.max_bytes

    ds, in_turn = bound(None)
    lanes = ds.working_set.lanes
    assert lanes >= 4 and in_turn == ds.decoded_bound(0)
    _, by_lane = bound(8)
    assert by_lane == ds.decoded_bound(0, share=2) < in_turn
