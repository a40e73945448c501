"""`restore_warm` on a fresh node, with a real loader and tiers: it stages what the step's record
names, or what the loader's cursor needs next when the record is of another dataset, damaged or absent,
stops at the top tier's capacity, and does nothing without tiers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import tierflow
from tierflow.checkpoint.warm import cursor_of, next_shards, restore_warm, warm_name

from ckpt_rig import make_token_dataset


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_token_dataset(tmp_path_factory.mktemp("warm"), docs=900)


def loader_for(data: Path, tiers: list[str], staging: bool = True):
    """A loader over `tiers`; without `staging` its stager is stopped and what it staged dropped, so
    what a restore stages is all the tier holds (a running stager fills the same tier at the same time)."""
    loader = tierflow.open_loader(str(data), tiers=tiers, batch_size=8, seq_len=64)
    if not staging and loader.stager is not None:
        loader.stager.close()
        for tier in loader.stager.stack.tiers:
            tier.evict()
            assert not tier.index.keys()
    return loader


def commit_after(loader, tmp_path: Path, batches: int, warm_batches: int):
    """Consume `batches`, commit step `batches` with the loader: the store, the step and its warm record."""
    from tierflow.checkpoint import CheckpointStore

    stream = iter(loader)
    for _ in range(batches):
        next(stream)
    store = CheckpointStore(None, tmp_path / "local")
    store.begin(batches)
    final = store.commit(batches, loader=loader, warm_batches=warm_batches)
    return store, final, json.loads((final / warm_name(0)).read_text())


RECORDS = {
    "another dataset's": json.dumps({"next_shards": ["shard-of-another-dataset.arrow"]}),
    "not JSON": "{next_shards: [",
    "no list": json.dumps({"next_shards": {"a": 1}}),
    "nested past the parser": "[" * 100_000,
    "no object": json.dumps([1, 2]),
}


@pytest.mark.parametrize("record", list(RECORDS))
def test_a_record_of_another_dataset_or_damaged_gives_way_to_what_the_cursor_needs(
    data: Path, tmp_path: Path, record: str
) -> None:
    loader = loader_for(data, [f"L2={tmp_path}/l2:64MB:lru:at_rest"], staging=False)
    try:
        step = tmp_path / "step"
        step.mkdir()
        (step / warm_name(0)).write_text(RECORDS[record])
        wanted = next_shards(loader.dataset, cursor_of(loader), 256)
        assert restore_warm(step, loader) == len(wanted) >= 2
        tier = loader.stager.stack.tiers[0]
        names = [loader.dataset.manifest.shards[i].key for i in wanted]
        assert sorted(tier.index.keys()) == sorted(names)
    finally:
        loader.close()


def test_staging_stops_at_the_top_tiers_capacity(data: Path, tmp_path: Path) -> None:
    shards = tierflow.open_dataset(data).manifest.shards
    room = int(1.2 * max(s.bytes for s in shards))  # one shard, not two
    loader = loader_for(data, [f"L2={tmp_path}/l2:{room}:lru:at_rest"], staging=False)
    try:
        order = next_shards(loader.dataset, cursor_of(loader), 256)
        fits = next(
            k for k in range(len(order) + 1) if k == len(order) or sum(shards[i].bytes for i in order[: k + 1]) > room
        )
        assert fits < len(order)  # the order wants more than the tier holds
        assert restore_warm(tmp_path, loader, batches=256) == fits
        assert sorted(loader.stager.stack.tiers[0].index.keys()) == sorted(shards[i].key for i in order[:fits])
    finally:
        loader.close()


def test_without_tiers_nothing_is_staged(data: Path, tmp_path: Path) -> None:
    loader = loader_for(data, [])
    try:
        assert restore_warm(tmp_path, loader) == 0
    finally:
        loader.close()


def test_a_commit_with_the_loader_records_the_next_shards_and_each_tiers_heat(data: Path, tmp_path: Path) -> None:
    loader = loader_for(data, [f"L2={tmp_path}/l2:64MB:lru:at_rest"])
    try:
        _, _, record = commit_after(loader, tmp_path, 3, warm_batches=16)
        names = {s.name for s in loader.dataset.manifest.shards}
        assert record["batches"] == 16 and record["next_shards"] and set(record["next_shards"]) <= names
        saved = record["tiers"]["L2"]
        assert isinstance(saved["clock"], float) and saved["entries"]
        # the stager keeps staging after the commit's snapshot: entries it admits later are not in it
        assert {e["key"] for e in saved["entries"]} <= set(loader.stager.stack.tiers[0].index.keys())
    finally:
        loader.close()


def test_a_commit_of_a_loader_without_tiers_records_its_next_shards_and_no_heat(data: Path, tmp_path: Path) -> None:
    from tierflow.checkpoint import CheckpointStore

    loader = loader_for(data, [])
    try:
        store = CheckpointStore(None, tmp_path / "local")
        store.begin(1)
        record = json.loads((store.commit(1, loader=loader, warm_batches=8) / warm_name(0)).read_text())
        assert record["next_shards"] and "tiers" not in record
    finally:
        loader.close()


def test_a_record_without_a_tiers_clock_stages_its_shards_and_leaves_the_statistics_fresh(
    data: Path, tmp_path: Path
) -> None:
    """A record of the first format (hits only, no clock) cannot be rebased to this tier's clock:
    its shards are staged, its heat is not taken."""
    loader = loader_for(data, [f"L2={tmp_path}/l2:64MB:lru:at_rest"], staging=False)
    try:
        shards = loader.dataset.manifest.shards
        order = next_shards(loader.dataset, cursor_of(loader), 8)
        first = shards[order[0]]
        entries = [{"key": first.key, "size": first.bytes, "hits": 50, "last_access": 1.0, "stats": {}}]
        record = {"next_shards": [shards[i].name for i in order], "tiers": {"L2": {"entries": entries}}}
        (tmp_path / warm_name(0)).write_text(json.dumps(record))
        assert restore_warm(tmp_path, loader) == len(order)
        assert loader.stager.stack.tiers[0].index.get(first.key).hits < 50
    finally:
        loader.close()


def test_a_commit_records_the_loops_rate_and_minutes_stage_what_that_many_batches_read(
    data: Path, tmp_path: Path
) -> None:
    """`restore_warm(minutes=)` turns minutes into batches at the rate the stopped loop ran (saved at
    commit from its telemetry), and stages what those batches read from the cursor."""
    loader = loader_for(data, [f"L2={tmp_path}/l2:64MB:lru:at_rest"])
    try:
        store, _, record = commit_after(loader, tmp_path, 4, warm_batches=2)
        assert record["batches_per_s"] > 0
    finally:
        loader.close()
    minutes = 359.5 / 60 / record["batches_per_s"]  # 360 batches at that rate, far past the 2 recorded
    fresh = loader_for(data, [f"L2={tmp_path}/fresh:1MB:lru:at_rest"], staging=False)
    try:
        wanted = next_shards(fresh.dataset, cursor_of(fresh), 360)
        assert len(wanted) > len(record["next_shards"])
        assert store.restore_warm(4, fresh, minutes=minutes) == len(wanted)
        keys = [fresh.dataset.manifest.shards[i].key for i in wanted]
        assert sorted(fresh.stager.stack.tiers[0].index.keys()) == sorted(keys)
    finally:
        fresh.close()


def test_minutes_need_a_recorded_rate_and_a_positive_number(data: Path, tmp_path: Path) -> None:
    from tierflow.errors import CheckpointError

    step = tmp_path / "step"
    step.mkdir()
    (step / warm_name(0)).write_text(json.dumps({"next_shards": []}))  # telemetry off: no rate saved
    loader = loader_for(data, [f"L2={tmp_path}/l2:64MB:lru:at_rest"], staging=False)
    try:
        with pytest.raises(CheckpointError, match=f"{warm_name(0)}: records no loop rate.*batches="):
            restore_warm(step, loader, minutes=1)
        for minutes in (0, -1, float("nan")):
            with pytest.raises(ValueError, match="minutes must be a positive number"):
                restore_warm(step, loader, minutes=minutes)
        with pytest.raises(ValueError, match="batches= or minutes="):
            restore_warm(step, loader, batches=4, minutes=1)
        assert not loader.stager.stack.tiers[0].index.keys()  # refused before staging anything
    finally:
        loader.close()


def test_a_resume_on_a_version_3_dataset_makes_no_shard_info_per_shard(tmp_path: Path, monkeypatch) -> None:
    """The record's names and keys are looked up in the mapped checksum column: commit and restore
    make a ShardInfo only for the shards they stage, not one per shard of the dataset."""
    from tierflow.checkpoint import CheckpointStore
    from tierflow.format.metadata import MappedManifest, MetadataTables

    (tmp_path / "many").mkdir()
    data = make_token_dataset(tmp_path / "many", docs=6000)
    loader = loader_for(data, [f"L2={tmp_path}/l2:64MB:lru:at_rest"])
    try:
        manifest = loader.dataset.manifest
        assert isinstance(manifest, MappedManifest) and len(manifest.shards) >= 8
        made: list[int] = []
        shard = MetadataTables.shard

        def counted(self: MetadataTables, i: int, keep: bool = True):
            made.append(i)
            return shard(self, i, keep)

        stream = iter(loader)
        for _ in range(3):
            next(stream)
        loader.stager.close()  # what the loop and the stager make is theirs; the commit's is counted
        monkeypatch.setattr(MetadataTables, "shard", counted)
        store = CheckpointStore(None, tmp_path / "local")
        store.begin(3)
        final = store.commit(3, loader=loader, warm_batches=4)
        record = json.loads((final / warm_name(0)).read_text())
        assert made == [] and record["next_shards"]
        loader.close()
        fresh = loader_for(data, [f"L2={tmp_path}/fresh:1MB:lru:at_rest"], staging=False)
        fresh.load_state_dict(loader.state_dict())
        made.clear()
        fresh.dataset.manifest.shards._made.clear()
        staged = restore_warm(final, fresh)
        assert staged >= len(record["next_shards"]) and len(set(made)) == staged < len(manifest.shards) / 2
        fresh.close()
    finally:
        loader.close()
