"""Checkpoints under SIGKILL, several gloo ranks and a throttled budget (all marked slow).

Each child is a real process (a training loop, or a rank of a gloo group) in its own process
group, so a SIGKILL of the group takes its uploader process down with it, as a node loss would.

The kills of commit and upload are the issue's 30 trials (20 to a directory, 10 to moto S3), at
moments drawn from a seeded generator: TIERFLOW_CKPT_KILL_TRIALS sets the total (split 2:1),
TIERFLOW_CKPT_KILL_SEED the seed (default 30; it is named in every assertion, to rerun one).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import tierflow
from tierflow.checkpoint import CheckpointStore, LoaderState, step_name
from tierflow.storage.budget import BandwidthBudget

from ckpt_rig import inputs, make_token_dataset

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]
KILL_TRIALS = int(os.environ.get("TIERFLOW_CKPT_KILL_TRIALS", "30"))
KILL_SEED = int(os.environ.get("TIERFLOW_CKPT_KILL_SEED", "30"))
SRC = str(Path(tierflow.__file__).resolve().parents[1])
TESTS = str(Path(__file__).resolve().parent)


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_token_dataset(tmp_path_factory.mktemp("ckpt-kill-data"))


def _spawn(script: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    full = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, TESTS]), **(env or {})}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full,
        start_new_session=True,
    )


def _kill_group(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _read_until(proc: subprocess.Popen[str], predicate, timeout: float = 90.0) -> list[str]:
    """Lines of the child's stdout until `predicate(lines)` holds (raises if the child ends first)."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while not predicate(lines):
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"child ended early: {proc.wait()} {proc.stderr.read() if proc.stderr else ''}")
        lines.append(line.strip())
        assert time.monotonic() < deadline, "child too slow"
    return lines


TRAINER = """
import sys, torch, torch.distributed.checkpoint as dcp, warnings
warnings.filterwarnings("ignore")
import tierflow
from tierflow.checkpoint import CheckpointStore, LoaderState
from tierflow.storage.budget import BandwidthBudget
data, dest, local, mode, budget_path = sys.argv[1:6]
loader = tierflow.open_loader(data, batch_size=4, seq_len=32)
model = torch.nn.Module()
model.w = torch.nn.Parameter(torch.zeros(64, 64))
model.register_buffer("step", torch.zeros(1, dtype=torch.int64))
budget = BandwidthBudget(8 << 20, budget_path, burst=256 << 10)
store = CheckpointStore(dest, local, keep_last=2, budget=budget)
stream = iter(loader)
for step in range(1, 10_000):
    batch = next(stream)
    with torch.no_grad():
        model.w += batch["input_ids"].float().mean()
        model.step.fill_(step)
    if step % 4 == 0:
        state = {"model": model.state_dict(), "loader": LoaderState(loader)}
        step_dir = store.begin(step)
        torch.save(torch.randn(512, 1024), step_dir / "optimizer-extra.pt")  # ~2 MB to upload
        if mode == "async":
            dcp.async_save(state, checkpoint_id=step_dir).result()
        else:
            dcp.save(state, checkpoint_id=step_dir)
        store.commit(step)
        print("committed", step, flush=True)
"""


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigkill_mid_training_resumes_model_and_stream_together(tokens: Path, tmp_path: Path, mode: str) -> None:
    """A trainer saving model + loader through DCP every 4 steps is SIGKILLed at random points
    (3 trials); the newest valid step, loaded on the same node and on a fresh one, has the model
    of step S with the cursor of step S, and the stream continues with the uninterrupted run's
    batches S+1... ."""
    reference_loader = tierflow.open_loader(tokens, batch_size=4, seq_len=32)
    stream = iter(reference_loader)
    reference = [inputs(next(stream)) for _ in range(200)]
    reference_loader.close()
    rng = random.Random(14)
    resumed_from = {"same node": 0, "fresh node": 0}
    for trial in range(3):
        dest, local = tmp_path / f"dest{trial}", tmp_path / f"local{trial}"
        child = _spawn(TRAINER, str(tokens), str(dest), str(local), mode, str(tmp_path / f"budget{trial}"))
        lines = _read_until(child, lambda ls: sum(line.startswith("committed") for line in ls) >= 2)
        if trial == 0:  # one kill after an upload landed, however slow the machine: a fresh node resumes
            uploaded = CheckpointStore(dest, tmp_path / "probe")
            deadline = time.monotonic() + 60
            while not any(uploaded.remote_steps().values()) and time.monotonic() < deadline:
                time.sleep(0.05)
        time.sleep(rng.uniform(0.3, 2.0))
        _kill_group(child)
        durable = int(lines[-1].split()[1])
        for where in (local, tmp_path / f"fresh{trial}"):
            store = CheckpointStore(dest, where)
            step = store.latest()
            if step is None and where != local:
                assert not any(store.remote_steps().values())  # killed before any upload finished
                continue
            assert step is not None and step % 4 == 0
            resumed_from["same node" if where == local else "fresh node"] += 1
            if where == local:
                assert step >= durable  # a step whose commit returned survives the kill locally
            model = torch.nn.Module()
            model.w = torch.nn.Parameter(torch.zeros(64, 64))
            model.register_buffer("step", torch.zeros(1, dtype=torch.int64))
            resumed = tierflow.open_loader(tokens, batch_size=4, seq_len=32)
            adapter = LoaderState(resumed)
            target = {"model": model.state_dict(), "loader": adapter}
            dcp.load(target, checkpoint_id=store.load(step))
            model.load_state_dict(target["model"])
            assert int(model.step) == step == adapter.loaded["consumed"]  # one commit, both halves
            again = iter(resumed)
            got = [inputs(next(again)) for _ in range(4)]
            resumed.close()
            assert all(torch.equal(a, b) for a, b in zip(got, reference[step : step + 4]))
    assert resumed_from["same node"] == 3 and resumed_from["fresh node"] >= 1, resumed_from


COMMITTER = """
import os, sys
from tierflow.checkpoint import CheckpointStore
from tierflow.storage.budget import BandwidthBudget
dest, local, budget_path = sys.argv[1:4]
store = CheckpointStore(dest, local, keep_last=2,
                        budget=BandwidthBudget(16 << 20, budget_path, burst=256 << 10))
for step in range(1, 1000):
    d = store.begin(step)
    for i in range(4):
        (d / f"shard{i}.bin").write_bytes(os.urandom(1 << 20))
    print("begun", step, flush=True)
    store.commit(step)
    print("committed", step, flush=True)
"""


@pytest.mark.parametrize("where,trials", [("dir", KILL_TRIALS - KILL_TRIALS // 3), ("s3", KILL_TRIALS // 3)])
def test_sigkill_at_random_points_of_commit_and_upload(
    tmp_path: Path, request: pytest.FixtureRequest, where: str, trials: int
) -> None:
    """A process committing 4 MB steps (uploads throttled to 16 MB/s, so commits and uploads
    overlap) is SIGKILLed with its uploader at a random moment, 20 times to a directory and 10 to
    moto S3. Afterwards latest() is always a whole, verified step (never a temporary), is at
    least the last step whose commit returned (same node), and a fresh node gets a whole step
    from the destination."""
    rng = random.Random(f"{KILL_SEED}-{where}")
    local = tmp_path / "local"
    env: dict[str, str] = {}
    endpoint = None
    if where == "s3":
        server = request.getfixturevalue("s3_server")
        dest = f"s3://{request.getfixturevalue('s3_bucket')}/run/ckpt"
        env, endpoint = server.endpoint.env(), server.endpoint_url
    else:
        dest = str(tmp_path / "dest")
    last_durable = 0
    landed = {"writing or committing": 0, "after a commit returned": 0}
    for trial in range(trials):
        child = _spawn(COMMITTER, dest, str(local), str(tmp_path / "budget"), env=env)
        first = _read_until(child, lambda ls: any(line.startswith("begun") for line in ls))
        time.sleep(rng.uniform(0.0, 1.2))
        _kill_group(child)
        rest = child.stdout.read() if child.stdout else ""
        out = first + [line for line in rest.split("\n")[:-1] if line]  # whole lines: the kill can cut the last one
        landed["writing or committing" if out and out[-1].startswith("begun") else "after a commit returned"] += 1
        done = [int(m.group(1)) for m in map(re.compile(r"committed (\d+)$").match, out) if m]
        last_durable = max(done, default=last_durable)
        store = CheckpointStore(dest, local, keep_last=2, endpoint_url=endpoint)
        step = store.latest()
        trace = f"TIERFLOW_CKPT_KILL_SEED={KILL_SEED} {where} trial {trial}"
        assert step is not None or last_durable == 0, trace
        if step is not None:
            assert step >= last_durable and store.verify(step).ok, trace
        fresh = CheckpointStore(dest, tmp_path / f"fresh{trial}", endpoint_url=endpoint)
        remote = fresh.latest()
        if remote is not None:
            assert fresh.verify(remote).ok and (fresh.load(remote) / "shard3.bin").stat().st_size == 1 << 20, trace
        listed = {step_name(s) for s in store.local_steps()}  # each a real step directory, never a temporary
        assert listed <= {p.name for p in local.iterdir() if not p.name.startswith(".tmp")}, trace
    print(f"{where}: {trials} kills (TIERFLOW_CKPT_KILL_SEED={KILL_SEED}), landed {landed}")


RANK = """
import os, sys, time, datetime
import torch.distributed as dist
from tierflow.checkpoint import CheckpointStore
from tierflow.storage.budget import BandwidthBudget
rank, world, init, dest, root = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                        timeout=datetime.timedelta(seconds=30))
slow = BandwidthBudget(1 << 20, f"{root}/budget-{rank}", burst=128 << 10) if rank == world - 1 else None
store = CheckpointStore(dest, f"{root}/node{rank}", keep_last=None, budget=slow)
for step in (1, 2):
    d = store.begin(step)
    size = (64 << 10) if step == 1 else (4 << 20)
    (d / f"__{rank}_0.distcp").write_bytes(bytes([rank]) * size)
    if rank == 0:
        (d / ".metadata").write_bytes(b"meta")
    store.commit(step)
    print("committed", step, flush=True)
    if step == 1:
        store.wait()
        print("settled", step, flush=True)
try:
    store.wait()
    print("settled", 2, flush=True)
except Exception as exc:
    print("failed", type(exc).__name__, flush=True)
"""


def test_a_rank_killed_before_its_upload_leaves_the_step_uncommitted_for_all(tmp_path: Path) -> None:
    """4 gloo ranks, one node directory each. Step 1 commits for all (rank 0's marker after the
    barrier; a fresh node merges every rank's part). In step 2 the last rank's upload is slow and
    the rank is killed with its uploader: no rank writes a marker, the destination keeps step 2
    uncommitted, and latest() is 1 everywhere."""
    world, dest = 4, tmp_path / "dest"
    init = f"file://{tmp_path / 'rendezvous'}"
    ranks = [_spawn(RANK, str(r), str(world), init, str(dest), str(tmp_path)) for r in range(world)]
    try:
        for proc in ranks:
            _read_until(proc, lambda ls: "committed 2" in ls, timeout=120)
        assert CheckpointStore(dest, tmp_path / "probe").remote_steps().get(1) is True
        _kill_group(ranks[-1])  # its 4 MB at 1 MB/s is still on the way
        for proc in ranks[:-1]:
            out, _ = proc.communicate(timeout=90)
            assert "settled 2" not in out and "failed" in out, out
    finally:
        for proc in ranks:
            _kill_group(proc)
    steps = CheckpointStore(dest, tmp_path / "fresh").remote_steps()
    assert steps == {1: True, 2: False}
    fresh = CheckpointStore(dest, tmp_path / "fresh")
    assert fresh.latest() == 1
    merged = fresh.load(1)
    assert sorted(p.name for p in merged.iterdir() if p.name.startswith("__")) == [
        f"__{r}_0.distcp" for r in range(world)
    ]
    for r in range(world - 1):
        assert CheckpointStore(dest, tmp_path / f"node{r}").latest() == 1


def test_upload_rate_follows_the_budget_and_training_reads_keep_theirs(tmp_path: Path) -> None:
    """An 8 MB upload through a 4 MB/s budget never runs above the cap less what a high-priority reader
    takes meanwhile, and the reader (1 MB/s asked) hardly waits for the budget. Bounds that load on the
    machine cannot break: it only slows the upload down; how close the upload comes to the cap is
    benchmarks/checkpoint.py's figure."""
    cap = 4 << 20
    path = tmp_path / "budget"
    store = CheckpointStore(tmp_path / "dest", tmp_path / "local", budget=BandwidthBudget(cap, path, burst=128 << 10))
    d = store.begin(1)
    (d / "big.bin").write_bytes(os.urandom(8 << 20))
    reader = BandwidthBudget(cap, path, burst=128 << 10)
    got = {"bytes": 0, "seconds": 0.0, "waited": 0.0}
    stop = threading.Event()

    def read() -> None:  # paced at 1 MB/s in 64 KB reads, as a demand reader would ask
        started = time.perf_counter()
        while not stop.is_set():
            got["waited"] += reader.acquire(64 << 10, "high")
            got["bytes"] += 64 << 10
            time.sleep(max(0.0, started + got["bytes"] / (1 << 20) - time.perf_counter()))
        got["seconds"] = time.perf_counter() - started

    thread = threading.Thread(target=read)
    thread.start()
    store.commit(1)
    store.wait()
    stop.set()
    thread.join()
    answer = store.uploads.last_answer
    store.close()
    assert answer is not None
    reader_rate = got["bytes"] / got["seconds"]
    assert answer["bytes"] / answer["seconds"] + reader_rate <= 1.1 * cap, (answer, got)
    assert got["waited"] <= 0.1 * got["seconds"], got  # training reads keep theirs


def _tiered_loader(data: Path, l2: Path, state: dict | None = None):
    """A Loader reading through one L2 tier with no stager, so every shard read is counted as a
    demand hit or miss of the tier (a stager turns waits into hits and hides the difference)."""
    from tierflow.loader import Loader, TieredDataset, BatchSpec, OrderSpec
    from tierflow.storage.remote import open_store
    from tierflow.telemetry import MetricsRegistry
    from tierflow.tiers import TierConfig, TierStack

    registry = MetricsRegistry()
    stack = TierStack(
        open_store(str(data), registry=registry),
        [TierConfig.parse(f"L2={l2}:256MB").build(registry)],
        registry=registry,
    )
    dataset = TieredDataset(
        stack.dataset(), BatchSpec(batch_size=32, seq_len=1024), OrderSpec(partitions=1, window_shards=1, lanes=1)
    )
    loader = Loader(dataset, endless=True)  # the test counts steps across the epoch edge
    if state is not None:
        loader.load_state_dict(state)
    return loader, stack


def _hit_ratio(loader, tier, steps: int, stream=None) -> float:
    stream = stream if stream is not None else iter(loader)
    hits, misses = tier.m_hits.value, tier.m_misses.value
    for _ in range(steps):
        next(stream)
    hits, misses = tier.m_hits.value - hits, tier.m_misses.value - misses
    assert hits + misses >= 10, "too few shard reads in the window to measure a ratio"
    return hits / (hits + misses)


def test_warm_restart_hits_as_before_the_stop_on_an_empty_l2(tmp_path: Path) -> None:
    """A run past its first epoch (its L2 holds what it reads) checkpoints with the loader; a
    fresh node (empty L2) restores the step and `restore_warm` pre-stages the next batches'
    shards with their saved statistics: the first K steps hit within 5% of the K steps before the stop. Without the warm
    restart the same K steps miss (the control, so the test can fail)."""
    from ckpt_rig import make_letter_dataset

    data = make_letter_dataset(tmp_path)
    k = 60
    loader, stack = _tiered_loader(data, tmp_path / "L2-before")
    stream = iter(loader)
    for _ in range(190):  # one epoch is ~180 steps: every shard read once, now resident
        next(stream)
    before = _hit_ratio(loader, stack.tiers[0], k, stream)
    store = CheckpointStore(tmp_path / "dest", tmp_path / "local")
    step = 190 + k
    store.begin(step)
    store.commit(step, loader=loader, warm_batches=k + 8, stack=stack)
    saved_hits = {e.key: e.hits for e in stack.tiers[0].heat()}
    loader.close()
    store.close()

    fresh = CheckpointStore(tmp_path / "dest", tmp_path / "fresh-local")
    saved = fresh.latest()
    assert saved == step
    warm, warm_stack = _tiered_loader(data, tmp_path / "L2-fresh")
    warm.load_state_dict(_loader_state_of(fresh.load(step)))
    staged = fresh.restore_warm(step, warm, warm_stack)
    assert staged >= 10
    restored = {e.key: e.hits for e in warm_stack.tiers[0].heat()}
    assert restored and all(restored[key] == saved_hits.get(key, 0) for key in restored)  # the heat came back too
    after = _hit_ratio(warm, warm_stack.tiers[0], k)
    warm.close()
    cold, cold_stack = _tiered_loader(data, tmp_path / "L2-cold", _loader_state_of(fresh.load(step)))
    control = _hit_ratio(cold, cold_stack.tiers[0], k)
    cold.close()
    print(
        f"hit ratio: {k} steps before the stop {before:.3f}, first {k} after a warm restart {after:.3f}, "
        f"cold {control:.3f}"
    )
    assert abs(after - before) <= 0.05, (before, after)
    assert control < before - 0.5, (before, control)


def _loader_state_of(step_dir: Path) -> dict:
    """The loader state recorded for warm restart (this test saves no DCP state of its own)."""
    return json.loads((step_dir / "tierflow-warm-0.json").read_text())["loader"]


TINY_LM = """
import sys, time, torch, torch.distributed.checkpoint as dcp, warnings
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
warnings.filterwarnings("ignore")
import tierflow
from tierflow.checkpoint import CheckpointStore, LoaderState
from tierflow.storage.budget import BandwidthBudget
data, dest, node, endpoint = sys.argv[1:5]
torch.manual_seed(0)
torch.set_num_threads(1)
class TinyLM(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.embed = nn.Embedding(257, d)
        self.head = nn.Linear(d, 257)
        self.register_buffer("step", torch.zeros(1, dtype=torch.int64))
    def forward(self, ids):
        return self.head(self.embed(ids))
model = TinyLM()
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
loader = tierflow.open_loader(data, batch_size=4, seq_len=32, tiers=[f"L2={node}/L2:64MB"], endless=True)
store = CheckpointStore(dest, f"{node}/ckpt", keep_last=2, endpoint_url=endpoint,
                        budget=BandwidthBudget(4 << 20, f"{node}/budget", burst=256 << 10))
uploaded = None
for step, batch in enumerate(loader, start=1):
    logits = model(batch["input_ids"].long())
    loss = nn.functional.cross_entropy(logits.reshape(-1, 257), batch["labels"].long().reshape(-1))
    opt.zero_grad(); loss.backward(); opt.step()
    model.step.fill_(step)
    if step % 8 == 0:
        step_dir = store.begin(step)
        model_sd, opt_sd = get_state_dict(model, opt)
        torch.save(torch.randn(768, 1024), step_dir / "extra.pt")  # 3 MB: ~0.75 s at 4 MB/s
        dcp.save({"model": model_sd, "optim": opt_sd, "loader": LoaderState(loader)}, checkpoint_id=step_dir)
        store.commit(step, loader=loader, warm_batches=64)
        print("committed", step, flush=True)
    if store.uploads.last_answer is not None and store.uploads.last_answer["step"] != uploaded:
        uploaded = store.uploads.last_answer["step"]
        print("uploaded", uploaded, flush=True)
    time.sleep(0.01)
"""


def test_tiny_lm_killed_mid_upload_resumes_on_an_empty_node_warm_and_exact(
    tokens: Path, tmp_path: Path, s3_server, s3_bucket: str
) -> None:
    """The issue's 'done when': a tiny LM trains through an L2 tier and checkpoints model,
    optimizer and loader with DCP through CheckpointStore to moto S3; it is SIGKILLed (with its
    uploader) while a later step is still uploading. A fresh node (empty checkpoint directory,
    empty L2) resumes from the newest committed step: model and cursor of the same step,
    restore_warm pre-stages the next shards, and the stream continues exactly."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch import nn

    dest = f"s3://{s3_bucket}/tiny/ckpt"
    endpoint = s3_server.endpoint_url
    child = _spawn(TINY_LM, str(tokens), dest, str(tmp_path / "node-a"), endpoint, env=s3_server.endpoint.env())
    _read_until(child, lambda ls: any(line.startswith("uploaded") for line in ls), timeout=120)
    time.sleep(random.Random(5).uniform(0.2, 0.6))
    _kill_group(child)

    fresh = CheckpointStore(dest, tmp_path / "node-b" / "ckpt", endpoint_url=endpoint)
    step = fresh.latest()
    assert step is not None and step % 8 == 0
    print(f"resumed from {step}; at the destination: {fresh.remote_steps()} (False: cut off by the kill)")
    reference_loader = tierflow.open_loader(tokens, batch_size=4, seq_len=32, tiers=[f"L2={tmp_path / 'ref-L2'}:64MB"])
    stream = iter(reference_loader)
    reference = [inputs(next(stream)) for _ in range(step + 6)]
    reference_loader.close()

    torch.manual_seed(1)
    model = nn.Module()
    model.embed, model.head = nn.Embedding(257, 32), nn.Linear(32, 257)
    model.register_buffer("step", torch.zeros(1, dtype=torch.int64))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = tierflow.open_loader(tokens, batch_size=4, seq_len=32, tiers=[f"L2={tmp_path / 'node-b' / 'L2'}:64MB"])
    adapter = LoaderState(loader)
    model_sd, opt_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": opt_sd, "loader": adapter}
    dcp.load(state, checkpoint_id=fresh.load(step))
    model.load_state_dict(state["model"])
    assert int(model.step) == step == adapter.loaded["consumed"]
    staged = fresh.restore_warm(step, loader)
    assert staged >= 1
    again = iter(loader)
    got = [inputs(next(again)) for _ in range(6)]
    loader.close()
    assert all(torch.equal(a, b) for a, b in zip(got, reference[step : step + 6]))


DCP_RANK = """
import sys, datetime, warnings
warnings.filterwarnings("ignore")
import torch.distributed as dist, torch.distributed.checkpoint as dcp
import tierflow
from tierflow.checkpoint import LoaderState
from tierflow.loader import WorldPosition
rank, world, init, data, step_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
loader = tierflow.open_loader(data, batch_size=4, seq_len=32, lanes=1, window_shards=1, return_meta=True,
                              world=WorldPosition(rank, world, 0, 1), endless=False)
seen = []
for step, (_, meta) in enumerate(loader):
    seen += [int(i) for i, e in zip(meta.sample_ids.tolist(), meta.epochs.tolist()) if e == 0]
    if step == 5:
        break
dcp.save({"loader": LoaderState(loader)}, checkpoint_id=step_dir)
print("seen", *seen, flush=True)
loader.close()
dist.destroy_process_group()
"""


def test_two_gloo_ranks_saved_through_dcp_resume_as_one(tokens: Path, tmp_path: Path) -> None:
    """Two gloo ranks save their loader states with a real multi-rank `dcp.save` (each rank's
    bytes under its own key); one process resumes them elastically (`checkpoint=`) and reads
    exactly the first epoch's samples the two ranks had not."""
    init = f"file://{tmp_path / 'rendezvous'}"
    step_dir = tmp_path / "step"
    ranks = [_spawn(DCP_RANK, str(r), "2", init, str(tokens), str(step_dir)) for r in range(2)]
    seen: list[int] = []
    try:
        for proc in ranks:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err
            seen += [int(i) for i in next(line for line in out.splitlines() if line.startswith("seen")).split()[1:]]
    finally:
        for proc in ranks:
            _kill_group(proc)
    resumed = tierflow.open_loader(
        tokens, batch_size=4, seq_len=32, lanes=1, window_shards=1, return_meta=True, endless=False
    )
    adapter = LoaderState(resumed, checkpoint=step_dir)
    assert adapter.saved_ranks == [0, 1]
    dcp.load({"loader": adapter}, checkpoint_id=step_dir)
    rest = [int(i) for _, meta in resumed for i, e in zip(meta.sample_ids.tolist(), meta.epochs.tolist()) if e == 0]
    resumed.close()
    assert sorted(seen + rest) == list(range(resumed.dataset.num_order_samples))
