"""The kill loop (issue 18; RocksDB's crash tests in small): SIGKILL at random moments of a pack,
a cache fill and a checkpoint commit, over and over, then check what a reader sees.

Each iteration forks a child from a server that has tierflow, pyarrow and torch loaded
(tierflow.testing.killer), lets it run for a random share of the operation's own duration and
kills it: its whole process group (its pack workers and checkpoint uploader with it), or the
child alone, whose workers must then die with it and whose uploader finishes the job in hand.
After each kill:
- pack: the directory holds no dataset, the previous one whole, or the new one whole (verify's
  checks pass, every sample's hash is the golden one); the same pack rerun over the leftovers
  gives the golden dataset and leaves no stray file; the child's workers are gone in < 5 s;
- cache fill (warm, or a loader epoch, over an L1 small enough to evict and an L2, both kept
  across kills as a node's cache is): every entry a reader could find is whole, no space stays
  reserved for the dead child, and reading the dataset through the tiers gives the golden
  samples; after the loop `cache clean` removes the killed children's temporaries, an unkilled
  epoch gives the golden batches and no staging area of a killed child is left after its sweep;
- checkpoint: every step that verifies holds exactly its own bytes, here and at the
  destination, the newest never goes back, and the next child resumes after it; after the
  loop an unkilled run commits to the end.

Randomness is seeded: TIERFLOW_KILL_SEED reruns a failure (the seed is printed and named in
every assertion); TIERFLOW_KILL_ITERATIONS sets iterations per operation (default 40, so 120).
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import shutil
import time
from pathlib import Path

import pytest

import tierflow
from tierflow.checkpoint import CheckpointStore
from tierflow.checkpoint.remote import open_dest, remote_steps
from tierflow.commands.cli import main as cli_main
from tierflow.errors import ManifestError
from tierflow.format.manifest import MANIFEST_NAME, Manifest
from tierflow.format.metadata import METADATA_NAME, MappedManifest
from tierflow.format.metadata_verify import verify_metadata
from tierflow.format.metadata_writer import referenced_tables
from tierflow.testing.faults import sample_digests, tier_problems, verified_golden as golden, write_corpus
from tierflow.testing.killer import ForkServer, RunResult
from tierflow.tiers import build_stack
from tierflow.tiers.stack import staging_root

import kill_ops

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]
TESTS = str(Path(__file__).resolve().parent)
ITERATIONS = int(os.environ.get("TIERFLOW_KILL_ITERATIONS", "40"))


@pytest.fixture(scope="module")
def seed() -> int:
    value = int(os.environ.get("TIERFLOW_KILL_SEED") or random.SystemRandom().randrange(1 << 32))
    print(f"\nkill loop seed: TIERFLOW_KILL_SEED={value}")
    return value


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    with ForkServer(["kill_ops"], path=[TESTS], scratch=tmp_path_factory.mktemp("fork-server")) as s:
        yield s


def visible(out: Path) -> tuple[str, list[str]] | None:
    """The dataset a reader sees at `out` (its id and samples' hashes), its metadata verified whole
    (the tables, the layouts stored with them: the window layout each pack stores among them)."""
    try:
        manifest = Manifest.load(out)
    except ManifestError:
        return None
    if isinstance(manifest, MappedManifest):
        assert verify_metadata(manifest) == [], f"{out}: its metadata does not verify"
        assert manifest.tables.stored_layout(kill_ops.WINDOW) is not None, f"{out}: no window layout"
    return golden(out)


def kill_point(rng: random.Random, duration: float) -> float:
    """Mostly inside the operation, sometimes at its very start, sometimes after it is done
    (`duration`: the longest unkilled run so far, so a loaded machine moves the points with it)."""
    return rng.choice([0.0, rng.uniform(0, 0.05)]) if rng.random() < 0.1 else rng.uniform(0, 1.15 * duration)


def baseline(server: ForkServer, call: str, args: dict, reset) -> float:
    """Seconds the operation takes unkilled (the median of three), after `reset()` each time."""
    times = []
    for _ in range(3):
        reset()
        result = server.run(call, args)
        assert result.ok, result.errors
        times.append(result.elapsed)
    return sorted(times)[1]


def tally(results: list[RunResult], name: str = "", seed: int = 0) -> str:
    """The loop's counts; with TIERFLOW_FAULTS_REPORT=path, also one JSON line there."""
    killed = sum(r.killed for r in results)
    report = os.environ.get("TIERFLOW_FAULTS_REPORT")
    if report and name:
        with open(report, "a") as f:
            f.write(
                json.dumps(
                    {
                        "test": f"kill loop: {name}",
                        "seed": seed,
                        "runs": len(results),
                        "killed": killed,
                        "lingered_max": max(r.lingered for r in results),
                    }
                )
                + "\n"
            )
    return f"{len(results)} runs: {killed} killed, {len(results) - killed} finished first"


# ---------------------------------------------------------------- pack


def test_kill_loop_pack(server: ForkServer, seed: int, tmp_path: Path) -> None:
    rng = random.Random(seed ^ 0x9ACC)
    corpus = write_corpus(tmp_path / "new.jsonl", 900, seed=1)
    old_corpus = write_corpus(tmp_path / "old.jsonl", 500, seed=2)
    kill_ops.pack(str(corpus), str(tmp_path / "reference"))
    new = golden(tmp_path / "reference")
    kill_ops.pack(str(old_corpus), str(tmp_path / "old"))
    old = golden(tmp_path / "old")
    out = tmp_path / "out"

    def prepare(over: bool) -> None:
        shutil.rmtree(out, ignore_errors=True)
        if over:
            shutil.copytree(tmp_path / "old", out)

    durations = {
        w: baseline(
            server,
            "kill_ops:pack",
            {"corpus": str(corpus), "out": str(out), "overwrite": True, "workers": w},
            lambda: prepare(True),
        )
        for w in (1, 2)
    }
    results = []
    for i in range(ITERATIONS):
        over, workers, group = rng.random() < 0.5, rng.choice([1, 1, 2]), rng.random() < 0.7
        delay = kill_point(rng, durations[workers])
        where = (
            f"seed {seed}, pack iteration {i} (overwrite={over}, workers={workers}, group={group}, "
            f"kill at {delay:.3f} s)"
        )
        prepare(over)
        result = server.run(
            "kill_ops:pack",
            {"corpus": str(corpus), "out": str(out), "overwrite": over, "workers": workers},
            kill_after=delay,
            group=group,
        )
        results.append(result)
        if result.ok:
            durations[workers] = max(durations[workers], result.elapsed)
        assert result.killed or result.ok, f"{where}: {result.errors}"
        assert 0 <= result.lingered < 5, f"{where}: the pack's workers outlived it by {result.lingered:.1f} s"
        seen = visible(out)
        assert seen in ([new, old] if over else [new, None]), f"{where}: a partial or wrong dataset is visible"
        if result.ok:
            assert seen == new, f"{where}: the pack finished but the dataset is not the new one"
        kill_ops.pack(str(corpus), str(out), overwrite=seen is not None or over)  # the rerun, over the leftovers
        assert golden(out) == new, f"{where}: the rerun is not the golden dataset"
        shards = {s.name for s in Manifest.load(out).shards}
        metadata = {METADATA_NAME, *referenced_tables(out)} if (out / METADATA_NAME).exists() else set()
        strays = {p.name for p in out.iterdir()} - shards - metadata - {MANIFEST_NAME, ".tierflow.lock"}
        assert not strays, f"{where}: the rerun left {sorted(strays)}"
    print(f"pack: {tally(results, 'pack', seed)}")
    assert sum(r.killed for r in results) >= ITERATIONS // 3


# ---------------------------------------------------------------- cache fill


def test_kill_loop_cache_fill(server: ForkServer, seed: int, tmp_path: Path) -> None:
    rng = random.Random(seed ^ 0xF111)
    write_corpus(tmp_path / "docs.jsonl", 1500, seed=3)
    l4 = tmp_path / "l4"
    kill_ops.pack(str(tmp_path / "docs.jsonl"), str(l4))
    manifest = Manifest.load(l4)
    assert len(manifest.shards) >= 4
    samples = sample_digests(tierflow.open_dataset(l4))
    node = tmp_path / "node"
    tiers = kill_ops.tier_specs(node)
    batches = kill_ops.epoch_digests(str(l4), kill_ops.tier_specs(tmp_path / "reference-node"))

    def cold() -> None:
        shutil.rmtree(node, ignore_errors=True)

    durations = {
        how: baseline(server, "kill_ops:fill", {"l4": str(l4), "tiers": tiers, "how": how}, cold)
        for how in ("warm", "epoch")
    }
    results, pids = [], []
    for i in range(ITERATIONS):
        how = rng.choice(["warm", "epoch"])
        if rng.random() < 0.15:
            cold()  # now and then a fresh node: the fill starts from empty tiers
        delay = kill_point(rng, durations[how])
        where = f"seed {seed}, fill iteration {i} ({how}, kill at {delay:.3f} s)"
        result = server.run("kill_ops:fill", {"l4": str(l4), "tiers": tiers, "how": how}, kill_after=delay)
        results.append(result)
        pids.append(result.pid)
        if result.ok and how == "epoch":  # a warm's length depends on what the tiers hold: keep the cold one
            durations[how] = max(durations[how], result.elapsed)
        assert result.killed or result.ok, f"{where}: {result.errors}"
        for spec, form in zip(tiers, ("decoded", "at_rest")):
            name, root = spec.split("=")[0], Path(spec.split("=")[1].split(":")[0])
            if root.exists():
                problems = tier_problems(root, manifest, name, form)
                assert not problems, f"{where}: {problems}"
        assert sample_digests(build_stack(str(l4), tiers).dataset()) == samples, (
            f"{where}: samples read through the tiers are not the golden ones"
        )
    # `tierflow cache clean` with the job's own tiers, as a user runs it: a child killed before its
    # first entry leaves a directory no job has configured, and a clean that opened it with another
    # capacity would configure it (the first to open a tier decides: test_tiers) and widen the order
    assert cli_main(["cache", "clean", *(a for spec in tiers for a in ("--tier", spec))]) == 0
    assert not [p for spec in tiers for p in (Path(spec.split("=")[1].split(":")[0]) / "tmp").iterdir()], (
        f"seed {seed}: temporaries of killed children survive a clean"
    )
    final = time.time()
    assert kill_ops.epoch_digests(str(l4), tiers) == batches, f"seed {seed}: the epoch after the loop"
    leftovers = [p for p in staging_root().glob("staging-*") if int(p.name.split("-")[1]) in pids]
    leftovers += [p for p in staging_root().glob("node-*.users") if p.stat().st_mtime < final and not _in_use(p)]
    assert not leftovers, f"seed {seed}: staging areas of killed children left after a sweep: {leftovers}"
    print(f"cache fill: {tally(results, 'cache fill', seed)}")
    assert sum(r.killed for r in results) >= ITERATIONS // 3


def _in_use(users: Path) -> bool:
    """Whether some live process holds a node staging area (its shared lock on the users file)."""
    try:
        fd = os.open(users, os.O_RDWR)
    except FileNotFoundError:
        return True  # removed meanwhile: not a leftover
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


# ---------------------------------------------------------------- checkpoint commit


def test_kill_loop_checkpoint(server: ForkServer, seed: int, tmp_path: Path) -> None:
    rng = random.Random(seed ^ 0xC4E0)
    dest, local = tmp_path / "dest", tmp_path / "local"
    keep_last, steps = 2, 3

    def fresh() -> None:
        shutil.rmtree(dest, ignore_errors=True)
        shutil.rmtree(local, ignore_errors=True)

    args = {"dest": str(dest), "local": str(local), "start": 0, "steps": steps, "keep_last": keep_last}
    duration = baseline(server, "kill_ops:checkpoint", args, fresh)
    fresh()
    newest = -1
    results = []
    for i in range(ITERATIONS):
        group = rng.random() < 0.7
        delay = kill_point(rng, duration)
        where = f"seed {seed}, checkpoint iteration {i} (from step {newest + 1}, group={group}, kill at {delay:.3f} s)"
        result = server.run("kill_ops:checkpoint", {**args, "start": newest + 1}, kill_after=delay, group=group)
        results.append(result)
        if result.ok:
            duration = max(duration, result.elapsed)
        assert result.killed or result.ok, f"{where}: {result.errors}"
        assert result.lingered >= 0, f"{where}: the uploader did not finish within 30 s of the kill"
        here = CheckpointStore(dest, local, keep_last=keep_last)
        here.wait()  # what it re-queued at open (committed here, not yet at the destination) lands, and is pruned
        latest = here.latest()
        assert latest is None or latest >= newest, f"{where}: the newest checkpoint went back to {latest}"
        if result.ok:
            assert latest == newest + steps, f"{where}: finished, but the newest step is {latest}"
        candidates = set(here.local_steps()) | set(remote_steps(open_dest(dest)))
        for step in candidates:
            if here.verify(step).ok:
                assert kill_ops.whole(here.load(step), step), f"{where}: step {step} verifies but is not its own"
        if latest is not None:
            assert kill_ops.whole(here.load(latest), latest), f"{where}: step {latest}"
            away = CheckpointStore(dest, tmp_path / f"away-{i}", keep_last=keep_last)
            remote = away.latest()
            if remote is not None:
                assert remote <= latest and kill_ops.whole(away.load(remote), remote), f"{where}: at the destination"
            shutil.rmtree(tmp_path / f"away-{i}", ignore_errors=True)
            newest = latest
        here.close()
    final = server.run("kill_ops:checkpoint", {**args, "start": newest + 1})
    assert final.ok, final.errors
    here = CheckpointStore(dest, tmp_path / "away-final", keep_last=keep_last)
    assert here.latest() == newest + steps and kill_ops.whole(here.load(), newest + steps)
    print(f"checkpoint: {tally(results, 'checkpoint', seed)}")
    assert sum(r.killed for r in results) >= ITERATIONS // 3


def test_an_uploader_orphaned_with_queued_steps_uploads_every_one(server: ForkServer, tmp_path: Path) -> None:
    """The trainer commits three steps, whose uploads queue behind a throttled budget, and is
    killed alone: its uploader, orphaned, still brings every committed step to the destination
    (it used to die of a broken pipe answering the first job, dropping the queued ones)."""
    dest, local = tmp_path / "dest", tmp_path / "local"
    args = {
        "dest": str(dest),
        "local": str(local),
        "start": 0,
        "steps": 3,
        "keep_last": None,
        "rate": 2e5,
        "budget": str(tmp_path / "budget"),
        "then_sleep": 60.0,
    }
    result = server.run("kill_ops:checkpoint", args, kill_after=1.0, group=False)  # committed, uploads queued
    assert result.killed and result.lingered >= 0
    assert remote_steps(open_dest(dest)) == {0: True, 1: True, 2: True}
    away = CheckpointStore(dest, tmp_path / "away")
    assert away.latest() == 2 and all(kill_ops.whole(away.load(s), s) for s in range(3))
