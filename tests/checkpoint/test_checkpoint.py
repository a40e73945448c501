"""Checkpoints (tierflow.checkpoint), the fast set: one process, real files, the moto S3 server.

The multi-process and SIGKILL tests are in tests/test_checkpoint_kill.py (marked slow).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

import tierflow
from tierflow.checkpoint import COMMIT_NAME, CheckpointError, CheckpointStore, LoaderState, step_name
from tierflow.commands.cli import main as cli_main
from tierflow.errors import CheckpointWarning, TierflowError

from ckpt_rig import inputs, make_letter_dataset, make_token_dataset

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_token_dataset(tmp_path_factory.mktemp("ckpt-data"))


def _files(step_dir: Path, n: int = 3, size: int = 4096) -> None:
    for i in range(n):
        (step_dir / f"part{i}.bin").write_bytes(bytes([i]) * size)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_loader_state_commits_with_dcp_and_resumes_the_exact_stream(tokens: Path, tmp_path: Path, mode: str) -> None:
    """The cursor saved through DCP beside the model loads back as the identical dict, and the
    resumed loader yields the very input tensors the uninterrupted run yields next."""
    loader = tierflow.open_loader(tokens, batch_size=4, seq_len=32)
    model = torch.nn.Linear(4, 2)
    store = CheckpointStore(tmp_path / "dest", tmp_path / "local")
    stream = iter(loader)
    for _ in range(6):
        next(stream)
    saved_state = loader.state_dict()
    step_dir = store.begin(6)
    state = {"model": model.state_dict(), "loader": LoaderState(loader)}
    if mode == "sync":
        dcp.save(state, checkpoint_id=step_dir)
    else:
        dcp.async_save(state, checkpoint_id=step_dir).result()
    store.commit(6)
    expected = [inputs(next(stream)) for _ in range(5)]
    loader.close()
    store.wait()
    store.close()

    fresh = CheckpointStore(tmp_path / "dest", tmp_path / "fresh-node")
    assert fresh.latest() == 6
    resumed = tierflow.open_loader(tokens, batch_size=4, seq_len=32)
    adapter = LoaderState(resumed)
    assert isinstance(adapter, Stateful)  # DCP calls state_dict/load_state_dict on it
    other = torch.nn.Linear(4, 2)
    target = {"model": other.state_dict(), "loader": adapter}
    dcp.load(target, checkpoint_id=fresh.load(6))
    other.load_state_dict(target["model"])
    assert adapter.loaded == saved_state
    assert torch.equal(other.weight, model.weight)
    again = iter(resumed)
    got = [inputs(next(again)) for _ in range(5)]
    resumed.close()
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_a_step_is_visible_only_once_committed(tmp_path: Path) -> None:
    """begin() gives a temporary that is never listed; commit() makes the whole step appear."""
    store = CheckpointStore(tmp_path / "dest", tmp_path / "local")
    step_dir = store.begin(3)
    _files(step_dir)
    assert step_dir.name.startswith(".tmp-")
    assert store.local_steps() == [] and store.latest() is None
    final = store.commit(3)
    assert final == tmp_path / "local" / step_name(3)
    assert (final / COMMIT_NAME).is_file() and not step_dir.exists()
    assert store.latest() == 3  # locally, before the upload is known to be done
    store.wait()
    assert store.remote_steps() == {3: True}
    part = json.loads((tmp_path / "dest" / step_name(3) / "tierflow-part-0.json").read_text())
    assert [f["name"] for f in part["files"]] == ["part0.bin", "part1.bin", "part2.bin"]
    store.close()


def test_a_store_dropped_without_close_ends_its_uploader_after_the_upload_in_hand(tmp_path: Path) -> None:
    """The thread reading the uploader's answers held the store's queue, which held the uploader's
    stdin open: a store dropped without close() left its uploader process and that thread alive until
    the training process exited. Now the uploader finishes the step it was given and exits."""
    import gc

    import psutil

    before = {p.pid for p in psutil.Process().children()}
    store = CheckpointStore(tmp_path / "dest", tmp_path / "local")
    _files(store.begin(1), size=1 << 20)
    store.commit(1)  # the upload is queued, not waited for
    uploaders = [p for p in psutil.Process().children() if p.pid not in before]
    assert len(uploaders) == 1
    del store
    gc.collect()
    _, alive = psutil.wait_procs(uploaders, timeout=60)
    assert not alive
    assert CheckpointStore(tmp_path / "dest", tmp_path / "fresh").remote_steps() == {1: True}


def test_leftovers_of_a_crash_are_never_a_checkpoint(tmp_path: Path) -> None:
    """A step directory without a marker, a half-moved step and temporaries are skipped."""
    store = CheckpointStore(None, tmp_path / "local")
    _files(store.begin(1))
    store.commit(1)
    partial = tmp_path / "local" / step_name(2)
    partial.mkdir()
    _files(partial)  # files moved in, the manifest never written
    stale = tmp_path / "local" / f".tmp-{step_name(3)}-rank0-999999"
    stale.mkdir()
    _files(stale)
    assert store.local_steps() == [1, 2]
    assert store.latest() == 1
    with pytest.raises(CheckpointError, match="not committed"):
        store.load(2)


def test_s3_upload_with_retention_and_a_fresh_node_load(s3_server, s3_bucket: str, tmp_path: Path) -> None:
    """Uploads to moto S3 through storage/remote.py; keep_last/keep_every prune both sides; a
    fresh node downloads and verifies the newest step."""
    dest = f"s3://{s3_bucket}/run/ckpt"
    store = CheckpointStore(dest, tmp_path / "local", keep_last=2, keep_every=3, endpoint_url=s3_server.endpoint_url)
    for step in range(1, 7):
        _files(store.begin(step), size=1000 + step)
        store.commit(step)
    store.wait()
    assert store.remote_steps() == {3: True, 5: True, 6: True}
    assert set(store.local_steps()) <= {3, 5, 6}
    store.close()
    fresh = CheckpointStore(dest, tmp_path / "fresh", endpoint_url=s3_server.endpoint_url)
    assert fresh.latest() == 6
    path = fresh.load(6)
    assert (path / "part1.bin").read_bytes() == bytes([1]) * 1006
    assert fresh.verify(6).ok and fresh.local_steps() == [6]


def test_a_flipped_byte_is_named_and_skipped(tmp_path: Path) -> None:
    """verify() and load() name the corrupt file (a TierflowError); latest() falls back a step."""
    dest = tmp_path / "dest"
    store = CheckpointStore(dest, tmp_path / "local")
    for step in (1, 2):
        _files(store.begin(step))
        store.commit(step)
    store.close()
    victim = dest / step_name(2) / "part1.bin"
    data = bytearray(victim.read_bytes())
    data[100] ^= 0xFF
    victim.write_bytes(bytes(data))
    fresh = CheckpointStore(dest, tmp_path / "fresh")
    report = fresh.verify(2)
    assert not report.ok and "part1.bin" in report.problems[0]
    with pytest.raises(CheckpointError, match="part1.bin") as caught:
        fresh.load(2)
    assert isinstance(caught.value, TierflowError)
    with pytest.warns(CheckpointWarning, match=r"step-00000002 skipped: .*part1.bin"):
        assert fresh.latest() == 1
    # the failed download left nothing that looks like a step; the verified one is kept for load()
    assert fresh.local_steps() == [1]


def test_local_only_store_keeps_its_retention(tmp_path: Path) -> None:
    """Without a destination the local directory is the store: keep_last/keep_every apply there."""
    store = CheckpointStore(None, tmp_path / "local", keep_last=2, keep_every=2)
    for step in range(1, 6):
        _files(store.begin(step), n=1)
        store.commit(step)
    assert store.local_steps() == [2, 4, 5] and store.latest() == 5


def test_commit_async_waits_for_the_writer_then_commits(tmp_path: Path) -> None:
    """commit_async(after=future) commits only once the write (e.g. dcp.async_save) is done."""
    from concurrent.futures import ThreadPoolExecutor

    store = CheckpointStore(tmp_path / "dest", tmp_path / "local")
    step_dir = store.begin(7)
    with ThreadPoolExecutor(1) as pool:
        written = pool.submit(lambda: (step_dir / "model.bin").write_bytes(b"m" * 100_000))
        assert store.commit_async(7, after=written).result() == tmp_path / "local" / step_name(7)
    store.wait()
    assert store.remote_steps() == {7: True} and store.verify(7).ok
    store.close()


def test_a_failed_upload_is_raised_by_wait_and_the_local_copy_stays(s3_server, tmp_path: Path) -> None:
    """The uploader's error (here: no such bucket) comes back as a CheckpointError from wait();
    the step stays whole locally, so the run can go on and retry."""
    store = CheckpointStore("s3://tierflow-no-such-bucket/ck", tmp_path / "local", endpoint_url=s3_server.endpoint_url)
    _files(store.begin(1), n=1)
    store.commit(1)
    with pytest.raises(CheckpointError, match="upload failed"):
        store.wait()
    assert store.local_steps() == [1] and store.verify(1).ok
    store.close(wait=False)


def test_recommitting_a_step_after_a_crash_replaces_it(tmp_path: Path) -> None:
    """A step directory left by a crashed commit is replaced file by file, manifest last."""
    store = CheckpointStore(None, tmp_path / "local")
    (tmp_path / "local" / step_name(5)).mkdir()
    (tmp_path / "local" / step_name(5) / "part0.bin").write_bytes(b"old")
    _files(store.begin(5))
    store.commit(5)
    assert store.verify(5).ok and store.latest() == 5


@pytest.mark.slow
def test_cli_ls_verify_prune(s3_server, s3_bucket: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`tierflow ckpt ls|verify|prune DEST` on S3: lists steps, names a bad file (exit 1), prunes."""
    dest = f"s3://{s3_bucket}/ck"
    store = CheckpointStore(dest, tmp_path / "local", keep_last=None, endpoint_url=s3_server.endpoint_url)
    for step in (10, 20, 30):
        _files(store.begin(step))
        store.commit(step)
    store.close()
    endpoint = ["--endpoint-url", s3_server.endpoint_url]
    assert cli_main(["ckpt", "ls", dest, *endpoint]) == 0
    listed = capsys.readouterr().out
    assert all(str(s) in listed for s in (10, 20, 30)) and "committed" in listed
    assert cli_main(["ckpt", "verify", dest, *endpoint]) == 0
    capsys.readouterr()
    s3 = s3_server.endpoint.boto3_client()
    s3.put_object(Bucket=s3_bucket, Key=f"ck/{step_name(20)}/part2.bin", Body=b"\x07" * 4096)  # same size
    assert cli_main(["ckpt", "verify", dest, *endpoint]) == 1
    assert f"{step_name(20)}/part2.bin" in capsys.readouterr().err
    assert cli_main(["ckpt", "prune", dest, "--keep-last", "1", *endpoint]) == 0
    capsys.readouterr()
    remote = CheckpointStore(dest, tmp_path / "other", endpoint_url=s3_server.endpoint_url).remote_steps()
    assert remote == {30: True}


class _Clock:
    """A tier's clock the test advances by one per reading, from `start`."""

    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def _tier(root: Path, clock: _Clock, policy: str):
    from tierflow.tiers import Tier

    return Tier(
        root,
        capacity=4 * 1000,
        policy=policy,
        form="at_rest",
        name="L2",
        verify_hits=False,
        policy_options={"half_life": 50.0} if policy == "hotscore" else None,
        clock=clock,
    )


def _read(tier, key: str) -> None:
    """What a reader does: ensure the entry (a hit, or fetched and admitted), then release it."""
    from tierflow.format._checksum import xxh3_128_hex

    data = key.encode() * (1000 // len(key))
    pin = tier.ensure(key, len(data), xxh3_128_hex(data), lambda tmp: tmp.write_bytes(data))
    assert pin is not None
    pin.release()


@pytest.mark.parametrize("policy", ["hotscore", "lru"])
def test_restored_heat_makes_the_evictions_an_uninterrupted_run_makes(tmp_path: Path, policy: str) -> None:
    """A tier's heat saved at a checkpoint (through JSON, as the warm record carries it) and
    restored into a fresh tier on another clock (an hour later) gives the policy back its
    ranking: for the same reads after the resume, the resident set after every read is the
    uninterrupted tier's. The same staging without the restore (statistics dropped) differs."""
    from tierflow.checkpoint.warm import restore_heat, tier_heat

    first = _tier(tmp_path / "before", _Clock(0.0), policy)
    for key in ["k3", "k2", "k1", "k0", "k0", "k0", "k1", "k1", "k2", "k0", "k1"]:  # k0, k1 hot; k3 cold
        _read(first, key)
    saved = json.loads(json.dumps(tier_heat([first])))
    staged = [e["key"] for e in saved["L2"]["entries"]]  # hottest first, as restore_warm stages them
    later = ["k4", "k0", "k5", "k1", "k6", "k0", "k7", "k3", "k1"]

    def run(tier) -> list[list[str]]:
        residents = []
        for key in later:
            _read(tier, key)
            residents.append(sorted(tier.index.keys()))
        return residents

    uninterrupted = run(first)
    resumed = _tier(tmp_path / "after", _Clock(3600.0), policy)
    dropped = _tier(tmp_path / "dropped", _Clock(3600.0), policy)
    for tier in (resumed, dropped):
        for key in staged:
            _read(tier, key)
    assert restore_heat([resumed], saved) == 4
    assert run(resumed) == uninterrupted
    assert run(dropped) != uninterrupted


@pytest.mark.slow
def test_an_upload_stretches_the_stagers_lookahead_until_it_is_done(tmp_path: Path) -> None:
    """A store told the node's stager announces each upload before it hashes: while the upload
    runs (held here by holding its budget's lock) the stager looks ahead the upload's expected
    duration (bytes / the measured upload rate) of consumption, bounded by its tier's room;
    commit_async hands off only once that is staged, so the next batches' shards are resident
    and reading them misses nothing; when the upload's answer comes, the lookahead returns."""
    import time

    from tierflow.checkpoint.warm import cursor_of, next_shards
    from tierflow.storage.budget import BandwidthBudget

    data = make_letter_dataset(tmp_path, docs=4000)  # ~8 shards
    loader = tierflow.open_loader(data, batch_size=4, seq_len=32, tiers=[f"L2={tmp_path / 'L2'}:64MB"], endless=True)
    stager = loader.stager
    stream = iter(loader)
    for _ in range(8):
        next(stream)
        time.sleep(0.005)  # a loop of at most 200 steps/s: its lookahead stays below the tier's room
    calm = stager.lookahead().bytes
    assert stager.consumption_rate() > 0 and calm < stager.node.max_bytes
    budget = BandwidthBudget(64 << 20, tmp_path / "budget", burst=1 << 20)
    store = CheckpointStore(tmp_path / "dest", tmp_path / "local", budget=budget, stager=stager)
    store.uploads.rate = 1.0  # as if the last upload had gone at 1 B/s: this one is expected to take 2**20 s
    (store.begin(8) / "model.bin").write_bytes(b"\x01" * (1 << 20))
    with budget._locked():  # the uploader cannot take a byte: the upload is in flight until released
        assert store.commit_async(8).result() == tmp_path / "local" / step_name(8)
        assert store.uploading() == [8]
        assert stager.burst_seconds() == pytest.approx(2.0**20)
        riding = stager.lookahead().bytes
        assert riding == stager.node.max_bytes > calm  # 12 days of consumption, bounded by the tier's room
        tier = stager.stack.tiers[0]
        ahead = next_shards(loader.dataset, cursor_of(loader), 24)
        assert {loader.dataset.manifest.shards[s].key for s in ahead} <= tier.index.keys()
        misses = tier.m_misses.value
        for _ in range(24):
            next(stream)
        assert tier.m_misses.value == misses  # every read during the upload was staged ahead
    store.wait()
    assert stager.burst_seconds() == 0.0 and store.uploads.rate > 1.0  # measured on this upload
    assert stager.lookahead().bytes < riding
    loader.close()
    store.close()


def test_loader_state_resumes_elastically_under_another_world_size(tokens: Path, tmp_path: Path) -> None:
    """Two ranks (two nodes) save their loader states through DCP, each under its own key; one
    process resumes (world size 1) with `checkpoint=`: it reads the saved ranks from the DCP
    metadata and takes the cursor they share, and the resumed stream reads, up to the end of
    the epoch, exactly the samples the two ranks had not read. Without `checkpoint=` the rank's
    missing key is named; ranks whose states differ are refused, naming the step."""
    from tierflow.errors import CursorError
    from tierflow.loader import WorldPosition

    def ids(loader, steps: int | None = None) -> list[int]:
        """The first epoch's sample ids the loader yields (a batch at the edge carries the next's too)."""
        out = []
        for step, (_, meta) in enumerate(loader):
            out += [int(i) for i, e in zip(meta.sample_ids.tolist(), meta.epochs.tolist()) if e == 0]
            if steps is not None and step + 1 == steps:
                break
        return out

    shape = {"batch_size": 4, "seq_len": 32, "lanes": 1, "window_shards": 1}  # the breadth the cursor carries
    ranks = [
        tierflow.open_loader(tokens, **shape, world=WorldPosition(n, 2, 0, 1), return_meta=True, endless=False)
        for n in range(2)
    ]
    seen = [i for loader in ranks for i in ids(loader, 6)]
    states = [LoaderState(loader, key=f"rank{n}") for n, loader in enumerate(ranks)]
    saved = {"loader": {**states[0].state_dict(), **states[1].state_dict()}}  # what two ranks' dcp.save holds
    dcp.save(saved, checkpoint_id=tmp_path / "two")
    assert ranks[0].state_dict() == ranks[1].state_dict()  # synchronous steps: one cursor for both

    resumed = tierflow.open_loader(tokens, **shape, return_meta=True, endless=False)
    with pytest.raises(BaseException, match="rank2"):  # a third rank's own key (DCP raises a BaseException)
        dcp.load({"loader": LoaderState(resumed, key="rank2")}, checkpoint_id=tmp_path / "two")
    adapter = LoaderState(resumed, checkpoint=tmp_path / "two")
    assert adapter.saved_ranks == [0, 1]
    dcp.load({"loader": adapter}, checkpoint_id=tmp_path / "two")
    assert adapter.loaded == ranks[0].state_dict()
    rest = ids(resumed)
    total = resumed.dataset.num_order_samples
    assert sorted(seen + rest) == list(range(total))  # nothing skipped or read twice across the change
    for loader in ranks:
        loader.close()
    resumed.close()

    differ = dict(saved["loader"])
    other = json.loads(differ["rank1"])
    other["consumed"] += 1
    differ["rank1"] = json.dumps(other, sort_keys=True).encode()
    dcp.save({"loader": differ}, checkpoint_id=tmp_path / "differ")
    fresh = tierflow.open_loader(tokens, **shape)
    with pytest.raises(CursorError, match="differ"):
        dcp.load({"loader": LoaderState(fresh, checkpoint=tmp_path / "differ")}, checkpoint_id=tmp_path / "differ")
    fresh.close()


def test_load_without_a_step_hands_out_the_latest_committed_one(tmp_path: Path) -> None:
    store = CheckpointStore(None, tmp_path / "local", keep_last=None)
    for step in (1, 2):
        _files(store.begin(step))
        store.commit(step)
    (tmp_path / "local" / step_name(3)).mkdir()  # a newer step never committed is not the latest
    assert store.load() == tmp_path / "local" / step_name(2)


def test_two_ranks_sharing_a_nodes_directory_move_their_parts_into_one_step_left_uncommitted(tmp_path: Path) -> None:
    """Ranks 0 and 1 of a two-rank job on one node: the first part renames the step into place,
    the second moves in file by file (its part manifest last); neither writes the marker, which
    waits for the ranks to agree (`wait`), so the step is no checkpoint yet."""
    ranks = [CheckpointStore(None, tmp_path / "local", rank=r, world_size=2) for r in (0, 1)]
    for rank, store in enumerate(ranks):
        step_dir = store.begin(4)
        (step_dir / f"model-{rank}.bin").write_bytes(bytes([rank]) * 4096)
        assert store.commit(4) == tmp_path / "local" / step_name(4)
    final = tmp_path / "local" / step_name(4)
    assert sorted(p.name for p in final.iterdir()) == [
        "model-0.bin",
        "model-1.bin",
        "tierflow-part-0.json",
        "tierflow-part-1.json",
    ]
    assert not list((tmp_path / "local").glob(".tmp-*"))
    assert ranks[0].latest() is None and ranks[1].local_steps() == [4]


def test_commit_async_commits_steps_in_the_order_they_were_handed_over(tmp_path: Path) -> None:
    store = CheckpointStore(None, tmp_path / "local", keep_last=None)
    futures = []
    for step in (1, 2):
        _files(store.begin(step))
        futures.append(store.commit_async(step))
    assert [f.result() for f in futures] == [tmp_path / "local" / step_name(s) for s in (1, 2)]
    store.wait()
    assert store.latest() == 2 and store.verify(1).ok


class Cursor:
    """Anything with a JSON state (what LoaderState wraps): here, a counter."""

    def __init__(self, consumed: int = 0) -> None:
        self.consumed = consumed

    def state_dict(self) -> dict:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.consumed = state["consumed"]


def test_a_step_resumed_under_its_own_world_size_with_checkpoint_takes_the_ranks_own_state(tmp_path: Path) -> None:
    dcp.save({"loader": LoaderState(Cursor(7), key="rank0")}, checkpoint_id=tmp_path / "one")
    resumed = Cursor()
    dcp.load({"loader": LoaderState(resumed, checkpoint=tmp_path / "one")}, checkpoint_id=tmp_path / "one")
    assert resumed.consumed == 7


def test_a_step_without_loader_state_under_the_name_is_a_cursor_error_naming_it(tmp_path: Path) -> None:
    from tierflow.errors import CursorError

    dcp.save({"model": {"w": torch.zeros(2)}}, checkpoint_id=tmp_path / "model-only")
    with pytest.raises(CursorError, match=rf"{tmp_path / 'model-only'}: no loader state under 'loader'"):
        LoaderState(Cursor(), checkpoint=tmp_path / "model-only")
