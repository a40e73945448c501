"""Exact resume, one conformance check over every batcher, worker count and mode.

`tierflow.testing.assert_resumes_exactly`: a reference run; for each stop, a new Loader consumes
that many batches and saves its state through JSON, another new dataset and Loader load it and
consume the rest; the concatenation equals the reference bit for bit (tensors, sample ids and
epochs, cursors, final state). Eval runs past its end, so a resumed eval must end where it does.
"""

from __future__ import annotations

import pytest

from tierflow.loader import LengthBuckets, Loader, TieredDataset, TokenBudget, BatchSpec, OrderSpec
from tierflow.testing import assert_resumes_exactly

PARTITIONS = 4
STOPS = (1, 3, 6)


@pytest.fixture
def packed(long_tailed_docs) -> str:
    return long_tailed_docs


def _keep(sample):
    return sample["id"] % 3 != 0


def _noise(sample, rng):
    return {**sample, "noise": rng.integers(0, 1 << 30)}


BATCHERS = {
    "samples": BatchSpec(batch_size=6, columns=["id", "text", "tokens"]),
    "samples-filter-transform": BatchSpec(batch_size=6, columns=["id"], filter=_keep, transform=_noise),
    "token-windows": BatchSpec(batch_size=8, seq_len=64),
    "length-buckets": BatchSpec(batch_size=4, batcher=LengthBuckets(max_length=2048, group=4)),
    "token-budget": BatchSpec(batch_size=16, max_tokens=1024),
}
EVAL = {
    "samples": BatchSpec(batch_size=320, columns=["id", "tokens"]),
    "samples-filter-transform": BatchSpec(batch_size=320, columns=["id"], filter=_keep, transform=_noise),
    "token-windows": BatchSpec(batch_size=320, seq_len=64),
    "length-buckets": BatchSpec(batch_size=320, batcher=LengthBuckets(max_length=2048, group=1)),
}


def with_workers(names, fast_with_workers=()):
    """(name, workers) for 0 and 2 workers; the 2-worker runs start worker processes for each of the
    seven loaders a check makes, so those not in `fast_with_workers` are `slow` (the full suite runs them)."""
    return [
        pytest.param(
            name,
            workers,
            id=f"{name}-{workers}",
            marks=pytest.mark.slow if workers and name not in fast_with_workers else (),
        )
        for name in names
        for workers in (0, 2)
    ]


@pytest.mark.parametrize("name,workers", with_workers(BATCHERS, fast_with_workers=["samples"]))
def test_training_resumes_exactly_after_any_batch(packed, name, workers):
    def make_loader(num_workers):
        return Loader(TieredDataset(packed, BATCHERS[name], OrderSpec(partitions=PARTITIONS)), num_workers=num_workers)

    assert_resumes_exactly(make_loader, STOPS, workers)


@pytest.mark.parametrize("name,workers", with_workers(EVAL))
def test_eval_resumes_exactly_and_ends_where_it_would_have(packed, name, workers):
    def make_loader(num_workers):
        return Loader(
            TieredDataset(packed, EVAL[name], OrderSpec(partitions=PARTITIONS), eval=True), num_workers=num_workers
        )

    assert_resumes_exactly(make_loader, STOPS, workers, batches=12)


def test_a_loader_that_does_not_resume_fails_the_check_naming_the_batch(packed):
    class Forgetful(Loader):
        def load_state_dict(self, state):
            pass  # starts over instead

    def make_loader(num_workers):
        return Forgetful(
            TieredDataset(packed, BATCHERS["samples"], OrderSpec(partitions=PARTITIONS)), num_workers=num_workers
        )

    with pytest.raises(AssertionError, match="resumed after 2 batches with 0 workers: batch 2: 'id' differs"):
        assert_resumes_exactly(make_loader, (2,), 0)


def test_the_budget_cursor_carries_its_pending_samples(packed):
    loader = Loader(
        TieredDataset(packed, BatchSpec(batch_size=16, batcher=TokenBudget(1024)), OrderSpec(partitions=PARTITIONS))
    )
    with loader:
        next(iter(loader))
    assert loader.state_dict()["cursor"]["pending"]["ids"]
