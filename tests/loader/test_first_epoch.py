"""The loader's default narrow first epoch (working_set.first_epoch_breadth): a few shards at once in
epoch 0, the full breadth after, every sample once per epoch, exact resume on either side of the
boundary, and cursors saved before the rule existed resuming as wide as they were saved."""

from __future__ import annotations

import json

import numpy as np
import pytest

import tierflow
from tierflow.loader import Loader, TieredDataset
from tierflow.loader.spec import specs_from
from tierflow.order.working_set import FIRST_EPOCH_LEAST, FIRST_EPOCH_SHARE

BATCH = 16


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> str:
    """About 40 near-equal shards (the 256 KB minimum) of documents numbered by `i`."""
    root = tmp_path_factory.mktemp("first_epoch")
    with open(root / "docs.jsonl", "w") as f:
        for i in range(24000):
            f.write(json.dumps({"i": i, "text": f"{i:06d} " + "abcdefgh" * 24}) + "\n")
    out = root / "ds"
    tierflow.pack(
        [root / "docs.jsonl"], out, tokenizer="bytes", workers=1, target_shard_bytes=256 << 10, compression="none"
    )
    return str(out)


def dataset(packed, **options) -> TieredDataset:
    """Groups of 4 MiB, a whole window of these shards: the shards open at once are the breadth's
    (lanes x window shards) alone, not cut by the default groups of ~1,024 samples, one shard here."""
    options = {"batch_size": BATCH, "columns": ["i"], "seed": 5, "group_bytes": 4 << 20, **options}
    batching, order = specs_from(options)
    return TieredDataset(packed, batching, order, **options)


def samples(ds: TieredDataset) -> int:
    return sum(s.samples for s in ds.manifest.shards)


def run(loader: Loader, batches: int) -> list:
    out = []
    for _, meta in loader:
        out.append(meta)
        if len(out) == batches:
            break
    return out


def shard_of(packed, ids: np.ndarray) -> np.ndarray:
    ends = np.cumsum([s.samples for s in tierflow.Manifest.load(packed).shards])
    return np.searchsorted(ends, ids, side="right")


def most_open(packed, metas, epoch: int) -> int:
    """The most shards started and not yet finished at once by the epoch's samples."""
    first, last = {}, {}
    for b, meta in enumerate(metas):
        for shard in shard_of(packed, meta.sample_ids[meta.epochs == epoch]).tolist():
            first.setdefault(shard, b)
            last[shard] = b
    return max(sum(1 for s in first if first[s] <= b <= last[s]) for b in range(len(metas)))


@pytest.mark.slow
def test_the_default_first_epoch_reads_a_few_shards_at_once_and_the_next_all_lanes(packed):
    ds = dataset(packed)
    shards = len(ds.manifest.shards)
    assert shards >= 2 * FIRST_EPOCH_SHARE and ds.working_set.lanes * ds.working_set.window_shards > 4
    lanes, window = ds.working_set.first_epoch
    assert lanes * window <= max(FIRST_EPOCH_LEAST, shards // FIRST_EPOCH_SHARE) < shards // 2
    assert ds.order.config["first_epoch"] == [lanes, window]
    per_epoch = -(-samples(ds) // BATCH)
    metas = run(Loader(ds, return_meta=True, endless=True), 2 * per_epoch + 40)  # lanes end apart, carrying
    epochs = np.concatenate([m.epochs for m in metas])
    ids = np.concatenate([m.sample_ids for m in metas])
    for epoch in (0, 1):
        assert np.array_equal(np.sort(ids[epochs == epoch]), np.arange(samples(ds)))
    assert most_open(packed, metas, 0) <= 2 * lanes * window  # a shard finishing as the next one starts
    wide = run(Loader(dataset(packed, narrow_first_epoch=False), return_meta=True, endless=True), per_epoch)
    full = ds.working_set.reading  # the dataset's default breadth: at most a quarter of its shards at once
    assert shards // 4 - 1 <= full <= shards // 4
    assert most_open(packed, wide, 0) >= full > most_open(packed, metas, 0)
    later = [m for m in metas if m.epoch == 1]
    assert len(later) > per_epoch // 2
    assert most_open(packed, later, 1) >= full


def test_narrow_first_epoch_false_orders_as_before_the_rule(packed):
    ds = dataset(packed, narrow_first_epoch=False)
    assert ds.working_set.first_epoch is None and "first_epoch" not in ds.order.config
    given = dataset(packed, lanes=ds.working_set.lanes, window_shards=ds.working_set.window_shards)
    assert given.working_set.first_epoch is None and given.order.config_hash == ds.order.config_hash


@pytest.mark.parametrize("stop_at", ["first epoch", "its last batch", "second epoch"])
def test_resume_continues_exactly_on_either_side_of_the_first_epochs_end(packed, stop_at):
    per_epoch = -(-samples(dataset(packed)) // BATCH)
    whole = run(Loader(dataset(packed), return_meta=True, endless=True), per_epoch + 60)
    last = max(b for b, m in enumerate(whole) if m.epoch == 0)
    stop = {"first epoch": per_epoch // 3, "its last batch": last, "second epoch": last + 5}[stop_at]
    first = Loader(dataset(packed), return_meta=True, endless=True)
    run(first, stop)
    state = json.loads(json.dumps(first.state_dict()))
    again = Loader(dataset(packed), return_meta=True, endless=True)
    again.load_state_dict(state)
    rest = run(again, 8)
    assert len(rest) == 8
    for a, b in zip(rest, whole[stop:]):
        assert np.array_equal(a.sample_ids, b.sample_ids) and np.array_equal(a.epochs, b.epochs)


def test_a_cursor_saved_as_wide_resumes_as_wide_under_the_default(packed):
    wide = Loader(dataset(packed, narrow_first_epoch=False), return_meta=True, endless=True)
    whole = run(Loader(dataset(packed, narrow_first_epoch=False), return_meta=True, endless=True), 20)
    run(wide, 12)
    state = json.loads(json.dumps(wide.state_dict()))
    for resumed in (dataset(packed, resume=state["cursor"]), dataset(packed)):
        loader = Loader(resumed, return_meta=True, endless=True)
        loader.load_state_dict(state)
        assert resumed.order.first_epoch is None
        rest = run(loader, 8)
        assert len(rest) == 8
        assert all(np.array_equal(a.sample_ids, b.sample_ids) for a, b in zip(rest, whole[12:]))


def test_a_cursor_with_a_bad_first_epoch_is_refused_naming_the_field_and_the_dataset(packed):
    from tierflow.errors import CursorMismatchError

    first = Loader(dataset(packed), return_meta=True, endless=True)
    run(first, 3)
    state = json.loads(json.dumps(first.state_dict()))
    state["cursor"]["order"]["config"]["first_epoch"] = ["4", 0]
    with pytest.raises(CursorMismatchError, match=r"first_epoch: cursor \['4', 0\] vs order None") as info:
        Loader(dataset(packed), return_meta=True).load_state_dict(state)
    assert packed in str(info.value)
