"""The main process builds runs of planned batches as one (loader/runs.py): the same batches, array
for array, as building each alone; the same cursors; a run whose build fails still hands out every
batch before the failing one."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from tierflow.loader import BatchSpec, Loader, OrderSpec, TieredDataset
from tierflow.loader.batching import Samples
from tierflow.loader.runs import RUN_BATCHES

PARTITIONS = 4


def same_arrays(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, (np.ndarray, torch.Tensor)):
            assert type(x) is type(y) and x.dtype == y.dtype and x.shape == y.shape, key
            assert np.array_equal(np.asarray(x), np.asarray(y)), key
        else:
            assert x == y, key


@pytest.mark.parametrize("seq_len", [48, 700])  # 700: windows run into the next block
def test_a_run_of_token_batches_is_its_batches_built_one_by_one(long_tailed_docs, seq_len):
    ds = TieredDataset(long_tailed_docs, BatchSpec(batch_size=4, seq_len=seq_len), OrderSpec(partitions=PARTITIONS))
    ctx = ds._open()
    selections = list(itertools.islice(ds.batcher.plan(ctx, ds.stream(), None), 3 * RUN_BATCHES + 5))
    crossed = False
    for start in range(0, len(selections), 7):
        run = selections[start : start + 7]
        made = ds.batcher.build_run(ctx, run)
        assert len(made) == len(run)
        for selection, built in zip(run, made):
            alone = ds.batcher.build(ctx, selection)
            same_arrays(built.data, alone.data)
            assert built.stats == alone.stats
            assert np.array_equal(built.sample_ids, alone.sample_ids) and np.array_equal(built.epochs, alone.epochs)
            crossed |= built.stats["pieces"] > built.stats["samples"]
            ids, labels = built.data["input_ids"], built.data["labels"]
            assert ids.base is labels.base and ids.base.nbytes == ids.shape[0] * (seq_len + 1) * ids.itemsize
    assert crossed == (seq_len == 700)


@pytest.mark.parametrize("pad", [False, True])
def test_a_run_of_row_batches_is_its_batches_built_one_by_one(long_tailed_docs, pad):
    ds = TieredDataset(
        long_tailed_docs, BatchSpec(batch_size=5, batcher=Samples(pad=pad)), OrderSpec(partitions=PARTITIONS)
    )
    ctx = ds._open()
    selections = list(itertools.islice(ds.batcher.plan(ctx, ds.stream(), None), 2 * RUN_BATCHES + 3))
    for start in range(0, len(selections), RUN_BATCHES):
        run = selections[start : start + RUN_BATCHES]
        for selection, built in zip(run, ds.batcher.build_run(ctx, run)):
            alone = ds.batcher.build(ctx, selection)
            assert list(built.data) == list(alone.data) and {"text", "tokens", "mask"} <= set(built.data)
            for key, value in built.data.items():
                if isinstance(value, np.ndarray):
                    assert value.dtype == alone.data[key].dtype and np.array_equal(value, alone.data[key]), key
                else:
                    assert len(value) == len(alone.data[key]) and all(
                        np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b
                        for a, b in zip(value, alone.data[key])
                    ), key
            assert built.stats == alone.stats and np.array_equal(built.sample_ids, alone.sample_ids)


def one_by_one(ds: TieredDataset, batches: int) -> list:
    """The dataset's batches built a batch at a time, as the main process built them before runs."""
    ctx = ds._open()
    plan = ds.batcher.plan(ctx, ds.stream(), ds.cursor)
    return [ds._built(ctx, selection) for selection in itertools.islice(plan, batches)]


def test_the_main_process_hands_out_the_batches_built_one_by_one_and_resumes_exactly(long_tailed_docs):
    spec, order = BatchSpec(batch_size=4, seq_len=64), OrderSpec(seed=3, partitions=PARTITIONS)
    loader = Loader(TieredDataset(long_tailed_docs, spec, order), return_meta=True, endless=True)
    expected = one_by_one(TieredDataset(long_tailed_docs, spec, order), 3 * RUN_BATCHES + 3)
    saved = None
    for n, ((data, meta), alone) in enumerate(zip(loader, expected)):
        wide = {k: torch.from_numpy(v).long() if k in ("input_ids", "labels") else v for k, v in alone.data.items()}
        same_arrays(data, {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in wide.items()})
        assert meta.index == n and meta.stats == alone.meta.stats
        assert np.array_equal(meta.sample_ids, alone.meta.sample_ids)
        assert meta.planned.resolve() == alone.meta.planned.resolve()
        if n == RUN_BATCHES + 2:  # inside a run
            saved = loader.state_dict()
    loader.close()
    resumed = Loader(TieredDataset(long_tailed_docs, spec, order), return_meta=True, endless=True)
    resumed.load_state_dict(saved)
    for (data, meta), alone in zip(resumed, expected[RUN_BATCHES + 3 :]):
        assert np.array_equal(data["input_ids"].numpy(), alone.data["input_ids"])
        assert np.array_equal(meta.sample_ids, alone.meta.sample_ids)
    resumed.close()


def test_a_failing_run_hands_out_the_batches_before_the_failing_one(long_tailed_docs, monkeypatch):
    ds = TieredDataset(long_tailed_docs, BatchSpec(batch_size=4, seq_len=64), OrderSpec(partitions=PARTITIONS))
    expected = one_by_one(
        TieredDataset(long_tailed_docs, BatchSpec(batch_size=4, seq_len=64), OrderSpec(partitions=PARTITIONS)), 12
    )
    batcher = ds.batcher
    build = type(batcher).build

    def failing(self, ctx, selection):  # the tenth batch's block is damaged
        if selection.index == 9:
            raise OSError("damaged block")
        return build(self, ctx, selection)

    monkeypatch.setattr(type(batcher), "build", failing)
    monkeypatch.setattr(type(batcher), "build_run", lambda self, ctx, run: [failing(self, ctx, s) for s in run])
    got = []
    with pytest.raises(OSError, match="damaged block"):
        for carried in ds:
            got.append(carried)
    assert len(got) == 9
    for carried, alone in zip(got, expected):
        same_arrays(carried.data, alone.data)


def test_a_runs_opens_are_charged_to_its_first_batch_and_none_is_lost(long_tailed_docs):
    from tierflow.telemetry.loader_metrics import LoaderTelemetry, loader_figures
    from tierflow.telemetry.metrics import MetricsRegistry

    registry = MetricsRegistry()
    spec, order = BatchSpec(batch_size=4, seq_len=64), OrderSpec(partitions=PARTITIONS)
    loader = Loader(TieredDataset(long_tailed_docs, spec, order), telemetry=LoaderTelemetry(registry), endless=True)
    timings = []
    for _ in loader:
        timings.append(loader.last_meta.timing)
        if len(timings) == 1 + 2 + 4 + 8 + 2 * RUN_BATCHES:  # runs grow 1, 2, 4, 8, then RUN_BATCHES
            break
    loader.close()
    firsts = {0, 1, 3, 7, 15, 15 + RUN_BATCHES}  # where the loop waited for a run's build
    assert all(not t["fetch"] for n, t in enumerate(timings) if n not in firsts)
    assert timings[0]["fetch"] and all(t["produce_s"] > 0 for t in timings)
    opened: dict[str, int] = {}
    for t in timings:
        for tier, f in t["fetch"].items():
            opened[tier] = opened.get(tier, 0) + f["bytes"]
    assert loader_figures(registry.snapshot()).fetch_bytes == opened  # each open charged once


def test_runs_through_a_tier_stack_stay_short_under_telemetry(long_tailed_docs, tmp_path):
    """A stager stages from the batch the loop consumed: a reader far ahead of it would ask for
    entries not staged yet, so runs through a tier stack stay short, telemetry's wrap or not."""
    from tierflow.loader.runs import STAGED_RUN_BATCHES, longest_run
    from tierflow.telemetry.attribution import attribute_fetches
    from tierflow.tiers import TierConfig, build_stack

    stack = build_stack(long_tailed_docs, [TierConfig("L2", str(tmp_path / "l2"), 64 << 20)])
    ds = TieredDataset(stack.dataset(), BatchSpec(batch_size=4, seq_len=64), OrderSpec(partitions=PARTITIONS))
    attribute_fetches(ds)
    assert longest_run(ds._open().dataset.source, ds.batcher) == STAGED_RUN_BATCHES < RUN_BATCHES
    local = TieredDataset(long_tailed_docs, BatchSpec(batch_size=4, seq_len=64))
    assert longest_run(local._open().dataset.source, local.batcher) == RUN_BATCHES
    rows = TieredDataset(long_tailed_docs, BatchSpec(batch_size=4))
    assert longest_run(rows._open().dataset.source, rows.batcher) == Samples.run_batches < RUN_BATCHES
