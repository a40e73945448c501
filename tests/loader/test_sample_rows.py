"""The Samples batcher reads a batch's rows with one index lookup: each row is what the dataset
gives for its id, in the batch's order, across shards and blocks and with repeats (padding)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import tierflow
from tierflow.loader.batching import SampleContext, _rows


def pack_docs(tmp_path: Path, n: int = 12000) -> Path:
    src = tmp_path / "a.jsonl"
    with open(src, "w") as f:
        for i in range(n):
            f.write(json.dumps({"text": f"doc {i} " * (i % 23), "i": i, "maybe": None if i % 3 else i}) + "\n")
    out = tmp_path / "out"
    tierflow.pack([src], out, workers=1, target_shard_bytes=256 << 10, block_bytes=16 << 10)
    return out


def test_a_batchs_rows_are_the_datasets_rows_of_its_ids_in_order(tmp_path):
    ds = tierflow.open_dataset(pack_docs(tmp_path))
    assert len(ds.manifest.shards) >= 3
    rng = np.random.default_rng(1)
    ctx = SampleContext(ds, seed=0)
    for ids in (rng.integers(0, len(ds), 64), np.array([5, 5, len(ds) - 1, 0, 5]), np.arange(len(ds))):
        assert _rows(ctx, ids) == [ds[int(i)] for i in ids]


def test_an_id_outside_the_dataset_is_refused_as_a_single_read_refuses_it(tmp_path):
    ds = tierflow.open_dataset(pack_docs(tmp_path, n=50))
    with pytest.raises(IndexError, match=f"sample {len(ds)} out of range"):
        _rows(SampleContext(ds, seed=0), np.array([0, len(ds)]))
