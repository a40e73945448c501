"""Weighted mixing from the loader: proportions, meta per sample, exact and elastic resume."""

from __future__ import annotations

import collections
import json

import numpy as np
import pytest
import torch

import tierflow
from tierflow.errors import CursorError
from tierflow.loader import Loader, TieredDataset, WorldPosition, BatchSpec, MixedDataset, OrderSpec
from tierflow.loader.spec import specs_from
from tierflow.testing import assert_resumes_exactly


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("mixture")
    out = []
    for name, n in (("a", 3000), ("b", 800)):
        (root / f"{name}.jsonl").write_text(
            "".join(json.dumps({"text": f"{name} doc {i} " * 30, "id": i}) + "\n" for i in range(n))
        )
        tierflow.pack([root / f"{name}.jsonl"], root / name, tokenizer="bytes", workers=1, target_shard_bytes=256 << 10)
        out.append(str(root / name))
    return out


def mixed(two, world=None, **kw):
    kw.setdefault("columns", ["id"])
    kw = {"batch_size": 8, "partitions": 2, **kw}
    batching, order = specs_from(kw)
    return MixedDataset(two, batching, order, weights=[0.7, 0.3], world=world or WorldPosition(), **kw)


def test_batches_come_from_each_dataset_at_its_weight_and_say_which(two):
    loader = Loader(mixed(two), endless=True, return_meta=True)
    counts = collections.Counter()
    for step, (batch, meta) in enumerate(loader):
        assert set(batch) == {"id", "mask"}  # the dataset index is in the meta, not the user's dict
        assert meta.datasets.shape == meta.sample_ids.shape and len(set(meta.datasets.tolist())) == 1
        counts[int(meta.datasets[0])] += 1
        if step == 1999:
            break
    assert abs(counts[0] / 2000 - 0.7) < 0.005 and abs(counts[1] / 2000 - 0.3) < 0.005
    # the small dataset repeats, every sample of it once per its own epoch
    sizes = [3000, 800]
    assert counts[1] * 8 > 3 * sizes[1]


def test_a_mixture_epoch_is_the_datasets_total_and_len_is_exact(two):
    loader = Loader(mixed(two), return_meta=True)
    for epoch in range(2):
        expected = len(loader)
        got = list(loader)
        assert len(got) == expected == -(-3800 // 8) and {m.epoch for _, m in got} == {epoch}
    for rank in range(3):
        ranked = Loader(mixed(two, WorldPosition(0, 1, rank, 3)))
        assert len(ranked) == len(list(ranked))


# with workers: slow (worker processes for each of the loaders the check makes; tests/loader/test_resume.py
# keeps resuming with workers in the fast set)
@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_a_mixture_resumes_exactly(two, workers):
    assert_resumes_exactly(
        lambda w: Loader(mixed(two, seq_len=32, columns=None), num_workers=w), stops=[1, 9], workers=workers
    )


def test_a_mixture_resumes_elastically_from_two_nodes_to_one(two):
    def seen(pairs):
        return [
            (int(d), int(e), int(i))
            for _, m in pairs
            for d, e, i in zip(m.datasets.tolist(), m.epochs.tolist(), m.sample_ids.tolist())
        ]

    nodes = [Loader(mixed(two, WorldPosition(n, 2, 0, 1)), endless=True, return_meta=True) for n in range(2)]
    before = []
    for loader in nodes:
        for step, pair in enumerate(loader):
            before.append(pair)
            if step == 59:
                break
    states = [loader.state_dict() for loader in nodes]
    assert states[0] == states[1]  # synchronous steps: one cursor for every rank
    after = []
    resumed = Loader(mixed(two, resume=json.loads(json.dumps(states[0]))), endless=True, return_meta=True)
    for step, pair in enumerate(resumed):
        after.append(pair)
        if step == 700:
            break
    drawn = seen(before) + seen(after)
    for dataset, size in ((0, 3000), (1, 800)):
        epoch0 = [i for d, e, i in drawn if d == dataset and e == 0]
        assert sorted(epoch0) == list(range(size)), dataset  # nothing skipped or repeated across the change
    with pytest.raises(CursorError):
        TieredDataset(two[0], BatchSpec(batch_size=8, columns=["id"]), OrderSpec(partitions=2), resume=states[0])


def test_open_loader_mixes_urls_by_weight(two):
    loader = tierflow.open_loader(two, weights=[0.5, 0.5], batch_size=4, seq_len=16, partitions=2, return_meta=True)
    batch, meta = next(iter(loader))
    assert batch["input_ids"].dtype == torch.int64 and meta.datasets is not None
    with pytest.raises(TypeError, match="weights"):
        TieredDataset(two[0], BatchSpec(batch_size=4), weights=[1.0])
    with pytest.raises(ValueError, match="token budget"):
        MixedDataset(two, BatchSpec(batch_size=4, max_tokens=64))
    np.testing.assert_array_equal(meta.datasets, np.full(4, meta.datasets[0]))
