"""`tierflow plan` on a huge dataset replays a sample of its shards (commands/plan.py `choose_sample`):
a sample of every shard is the full forecast exactly, half of them land near it (the error is about
one shard of the sample's room: large on 128 shards), and a small dataset is never sampled."""

import json

import numpy as np
import pytest

import tierflow
from tierflow.commands.plan import SAMPLE_ABOVE, capacity_curve, choose_sample, node_uses
from tierflow.format.shard import Form
from tierflow.loader import BatchSpec, OrderSpec, TieredDataset


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """128 shards in 16 partitions."""
    root = tmp_path_factory.mktemp("plan-sample")
    rng = np.random.default_rng(5)
    with open(root / "docs.jsonl", "w") as f:
        for _ in range(100000):
            text = (rng.integers(0, 26, int(rng.integers(30, 300))) + 97).astype(np.uint8).tobytes().decode()
            f.write(json.dumps({"text": text}) + "\n")
    tierflow.pack([root / "docs.jsonl"], root / "ds", tokenizer="bytes", workers=1, target_shard_bytes=256 << 10)
    return TieredDataset(str(root / "ds"), BatchSpec(batch_size=8), OrderSpec(partitions=16, window_shards=2))


FRACTIONS = (0.1, 0.3, 0.6)


def warm(curve):
    return [(p.warm_ratio, p.warm_optimum) for p in curve]


@pytest.mark.slow
def test_a_small_dataset_is_not_sampled(dataset):
    assert len(dataset.manifest.shards) <= SAMPLE_ABOVE
    assert choose_sample(dataset) is None
    assert choose_sample(dataset, above=0) is None  # its working set is half of it: the staging area matters


def test_a_sample_of_every_shard_is_the_full_forecast_and_half_of_them_land_near_it(dataset):
    shards = len(dataset.manifest.shards)
    assert shards >= 100
    full = capacity_curve(dataset, FRACTIONS, form=Form.AT_REST)
    every = choose_sample(dataset, target=shards, above=0, sparse=0)
    assert every is not None and every.shards == shards and len(every.partitions) == 16
    assert warm(capacity_curve(dataset, FRACTIONS, form=Form.AT_REST, sample=every)) == warm(full)
    half = choose_sample(dataset, target=shards // 2, above=0, sparse=0)
    assert half is not None and 0 < half.shards < shards
    sampled = capacity_curve(dataset, FRACTIONS, form=Form.AT_REST, sample=half)
    assert {u.shard for u in node_uses(dataset, dataset.working_set, 3, half)} <= set(np.flatnonzero(half.mask))
    for (got, got_best), (want, want_best) in zip(warm(sampled), warm(full)):
        assert abs(got - want) < 0.05 and abs(got_best - want_best) < 0.05, (warm(sampled), warm(full))
