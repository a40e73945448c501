"""A checkpoint store's error paths with real files and its real uploader process: an upload that
outlives `wait`'s deadline, an uploader that dies with steps queued, a damaged local copy, misuse.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tierflow.checkpoint import CheckpointStore, step_name
from tierflow.checkpoint.manifest import verify_local
from tierflow.errors import CheckpointError, CheckpointTimeout, TierflowError
from tierflow.storage.budget import BandwidthBudget
from tierflow.tiers.burst import Ride

PAYLOAD = bytes(range(256)) * 4096  # 1 MiB


def write_step(store: CheckpointStore, step: int, payload: bytes = b"weights") -> Path:
    directory = store.begin(step)
    (directory / "model.bin").write_bytes(payload + step.to_bytes(4, "little"))
    return store.commit(step)


def throttled(tmp_path: Path) -> BandwidthBudget:
    """64 KiB/s: a 1 MiB upload takes ~16 s, so it is still running when the test looks."""
    return BandwidthBudget(64 << 10, tmp_path / "budget", burst=16 << 10, node_rate=None)


def test_wait_past_its_deadline_is_a_typed_timeout_naming_the_step(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "dest", tmp_path / "local", budget=throttled(tmp_path))
    try:
        write_step(store, 4, PAYLOAD)
        with pytest.raises(CheckpointTimeout, match=rf"{step_name(4)}: upload still running after 0.05 s") as e:
            store.wait(timeout=0.05)
        assert isinstance(e.value, TimeoutError) and store.uploading() == [4]
    finally:
        store.close(wait=False)  # the uploader is killed, not waited for
    assert store.uploads._proc is None and store.latest() == 4  # the local copy is whole


def test_an_uploader_that_dies_fails_its_queued_steps_and_the_next_commit_starts_another(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "dest", tmp_path / "local", budget=throttled(tmp_path), keep_last=None)
    write_step(store, 1, PAYLOAD)
    write_step(store, 2, PAYLOAD)
    dead = store.uploads._proc
    assert dead is not None
    dead.send_signal(signal.SIGKILL)
    with pytest.raises(CheckpointError, match=rf"dest/{step_name(1)}: upload failed: uploader exited \(-9\)"):
        store.wait(timeout=30)
    assert store.uploading() == []
    store.budget = None  # the next upload at full speed
    write_step(store, 3)
    assert store.uploads._proc is not dead
    store.wait(timeout=30)
    assert store.remote_steps() == {3: True} and store.latest() == 3
    store.close()


def test_a_damaged_local_copy_is_replaced_by_the_destinations_on_load(tmp_path: Path) -> None:
    with CheckpointStore(tmp_path / "dest", tmp_path / "local") as store:
        final = write_step(store, 7)
        store.wait()
        data = bytearray((final / "model.bin").read_bytes())
        data[0] ^= 0xFF
        (final / "model.bin").write_bytes(bytes(data))
        assert not verify_local(final, 7, deep=True).ok and store.verify(7).ok  # the destination's is whole
        loaded = store.load(7)
    assert loaded == final and (final / "model.bin").read_bytes() == b"weights" + (7).to_bytes(4, "little")
    assert not list((tmp_path / "local").glob(".tmp-*"))


def test_misuse_is_a_typed_error_naming_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        CheckpointStore(None, tmp_path / "local", keep_last=0)
    with pytest.raises(ValueError, match="keep_every must be >= 1"):
        CheckpointStore(None, tmp_path / "local", keep_every=0)
    store = CheckpointStore(None, tmp_path / "local")
    with pytest.raises(CheckpointError, match="no committed checkpoint"):
        store.load()
    with pytest.raises(CheckpointError, match=rf"{step_name(5)}: commit without begin"):
        store.commit(5)
    write_step(store, 5)
    with pytest.raises(CheckpointError, match=rf"{step_name(5)}: commit without begin"):
        store.commit(5)  # committed twice
    with pytest.raises(TierflowError, match="no destination configured"):
        store._dest()
    with pytest.raises(ValueError, match="commit_async is for single-rank jobs"):
        CheckpointStore(None, tmp_path / "ranks", rank=0, world_size=2).commit_async(1)


def test_prune_applies_retention_at_the_destination_then_here(tmp_path: Path) -> None:
    with CheckpointStore(tmp_path / "dest", tmp_path / "local", keep_last=None) as store:
        for step in range(4):
            write_step(store, step)
        store.wait()
        store.keep_last = 2
        assert store.prune() == [0, 1]
        assert store.remote_steps() == {2: True, 3: True} and store.local_steps() == [2, 3]
    local = CheckpointStore(None, tmp_path / "alone", keep_last=None)
    for step in range(3):
        write_step(local, step)
    local.keep_last = 1
    assert local.prune() == [0, 1] and local.local_steps() == [2]


def test_retention_drops_the_local_copies_of_steps_the_destination_pruned(tmp_path: Path) -> None:
    """The uploader prunes the destination, then here: a local copy was dropped only while the
    destination still had that step, so every step it pruned stayed here for ever (a node's disk
    filled with old checkpoints)."""
    with CheckpointStore(tmp_path / "dest", tmp_path / "local", keep_last=2) as store:
        for step in range(5):
            write_step(store, step)
            store.wait()
        assert store.remote_steps() == {3: True, 4: True}
        assert store.local_steps() == [3, 4]


def test_a_step_missing_a_file_or_with_one_cut_short_is_named_here_and_at_the_destination(tmp_path: Path) -> None:
    from tierflow.checkpoint.remote import open_dest, verify_remote

    with CheckpointStore(tmp_path / "dest", tmp_path / "local", keep_last=None) as store:
        write_step(store, 1)
        directory = store.begin(2)
        (directory / "model.bin").write_bytes(b"m" * 1000)
        (directory / "optim" / "state.bin").parent.mkdir()
        (directory / "optim" / "state.bin").write_bytes(b"o" * 500)
        final = store.commit(2)
        store.wait()
    (final / "optim" / "state.bin").unlink()
    (final / "model.bin").write_bytes(b"m" * 999)
    assert verify_local(final, 2).problems == [
        f"{final}/model.bin: is 999 bytes, manifest says 1000",
        f"{final}/optim/state.bin: missing",
    ]
    dest = tmp_path / "dest" / step_name(2)
    (dest / "optim" / "state.bin").unlink()
    report = verify_remote(open_dest(tmp_path / "dest"), 2, deep=False)
    assert not report.ok and any(p.endswith(f"{step_name(2)}/optim/state.bin: missing") for p in report.problems)
    fresh = CheckpointStore(tmp_path / "dest", tmp_path / "fresh")
    assert fresh.latest() == 1  # neither copy of step 2 is whole
    with pytest.raises(CheckpointError, match=rf"{step_name(2)}.*optim/state.bin: missing"):
        fresh.load(2)
    with pytest.raises(ValueError, match="checkpoint step must be >= 0, got -1"):
        step_name(-1)


def test_an_upload_that_fails_in_the_uploader_is_raised_by_wait_naming_step_and_cause(tmp_path: Path) -> None:
    """Raised once, also when the answer came before `wait` was called: the uploader already
    running, step 4 fails fast. `wait` looked only at the steps still pending when it was called,
    so that failure was dropped (this test failed so at step 4 in a run under load)."""
    import time

    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the destination's directory would be")
    with CheckpointStore(blocked / "ck", tmp_path / "local") as store:
        write_step(store, 3)
        with pytest.raises(CheckpointError, match=rf"blocked/ck/{step_name(3)}: upload failed: \w+Error"):
            store.wait(timeout=60)
        assert verify_local(tmp_path / "local" / step_name(3), 3).ok  # the local copy stays whole
        write_step(store, 4)  # the uploader lives on for the next step
        deadline = time.monotonic() + 60
        while store.uploading() and time.monotonic() < deadline:
            time.sleep(0.01)  # its answer is in before wait is called
        assert store.uploading() == []
        with pytest.raises(CheckpointError, match=rf"{step_name(4)}: upload failed"):
            store.wait(timeout=60)
        store.wait(timeout=60)  # raised once: nothing else failed since


def test_loader_state_without_this_ranks_key_is_named_and_a_tensor_copy_decodes(tmp_path: Path) -> None:
    import torch

    from tierflow.checkpoint.stateful import LoaderState, decode_state, encode_state

    state = {"cursor": {"epoch": 2, "step": 17}, "name": "run7"}
    raw = encode_state(state)
    assert decode_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8)) == state

    class Plain:  # anything with a JSON-able state_dict()/load_state_dict()
        def state_dict(self) -> dict:
            return state

        def load_state_dict(self, loaded: dict) -> None:
            self.loaded = loaded

    holder = LoaderState(Plain(), key="rank3")
    with pytest.raises(KeyError, match="no loader state 'rank3' \\(saved with another world size\\?"):
        holder.load_state_dict({"rank0": raw})
    holder.load_state_dict({"rank3": raw})
    assert holder.loaded == state and holder.loader.loaded == state


def test_nothing_to_prune_and_strays_at_the_destination_are_not_steps(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    (dest / step_name(9)).mkdir(parents=True)
    (dest / step_name(9) / "model.bin").write_bytes(b"an upload that never committed")
    (dest / "README").write_text("not a step")
    (dest / "notes").mkdir()
    (dest / "notes" / "x").write_text("nor this")
    store = CheckpointStore(dest, tmp_path / "local")
    assert store.remote_steps() == {9: False}
    assert store.prune() == [] and (dest / step_name(9)).is_dir()  # nothing committed: nothing goes
    assert CheckpointStore(None, tmp_path / "never-made").prune() == []


class RecordingStager:
    """The node's stager as a store sees it (tiers.burst.RidesBursts): the rides it was asked for."""

    def __init__(self) -> None:
        self.rides: list[Ride] = []

    def ride_through(self, seconds: float) -> Ride:
        ride = Ride(seconds, 1.0, lambda ride: None)
        self.rides.append(ride)
        return ride


def test_an_upload_nothing_gives_a_duration_for_is_not_announced_to_the_stager(tmp_path: Path) -> None:
    """No budget and no upload measured yet: no expected duration, so no ride (a guess could hold
    the loop's lookahead at the tier's room for nothing); the upload itself goes ahead and is
    measured, so the next one is announced (test_checkpoint.py's stager test)."""
    stager = RecordingStager()
    with CheckpointStore(tmp_path / "dest", tmp_path / "local", stager=stager) as store:
        write_step(store, 1)
        store.wait(timeout=30)
        assert stager.rides == [] and store.remote_steps() == {1: True}
        assert store.uploads.rate is not None and store.uploads.rate > 0


def test_an_uploader_that_dies_ends_the_stagers_rides_for_its_uploads(tmp_path: Path) -> None:
    stager = RecordingStager()
    store = CheckpointStore(tmp_path / "dest", tmp_path / "local", budget=throttled(tmp_path), stager=stager)
    write_step(store, 1, PAYLOAD)
    (ride,) = stager.rides
    assert not ride._ended.is_set()
    store.uploads._proc.send_signal(signal.SIGKILL)
    with pytest.raises(CheckpointError, match="uploader exited"):
        store.wait(timeout=30)
    assert ride._ended.is_set() and store.uploads._rides == {}  # the loop's lookahead is not left stretched
    store.close(wait=False)


def test_a_node_whose_local_directory_is_gone_has_nothing_to_prune(tmp_path: Path) -> None:
    """The uploader prunes the node's copies after each upload; a directory removed meanwhile (the
    node's disk wiped) is no error for it."""
    from tierflow.checkpoint.remote import prune_local

    assert prune_local(tmp_path / "wiped", None, keep_last=1, keep_every=None) == []
