"""What a training loop expects of epochs and dtypes: one epoch per `for`, an exact `len`, the
endless stream opt-in, eval re-run by each `for`, and token ids that reach the model as int64."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch

import tierflow

from tierflow.loader import (
    LengthBuckets,
    Loader,
    Samples,
    TieredDataset,
    TokenBudget,
    WorldPosition,
    BatchSpec,
    OrderSpec,
)
from tierflow.loader.spec import specs_from

PARTITIONS = 4


def dataset(packed, **options):
    batching, order = specs_from(options)
    return TieredDataset(packed, batching, order, **options)


def windows(packed, **kw):
    kw.setdefault("partitions", PARTITIONS)
    return dataset(packed, batch_size=8, seq_len=64, **kw)


BATCHERS = {
    "samples": lambda packed, **kw: dataset(
        packed, batch_size=16, batcher=Samples(select=["tokens"]), partitions=PARTITIONS, **kw
    ),
    "windows": windows,
    "buckets": lambda packed, **kw: dataset(
        packed, batch_size=4, batcher=LengthBuckets(max_length=512, group=4), partitions=PARTITIONS, **kw
    ),
}


def epochs_of(pairs):
    return sorted({m.epoch for _, m in pairs})


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(BATCHERS))
def test_each_for_is_one_epoch_and_len_says_how_many_batches_it_holds(long_tailed_docs, kind):
    loader = Loader(BATCHERS[kind](long_tailed_docs), return_meta=True)
    per_for: list[list[int]] = []
    for epoch in range(3):
        expected = len(loader)
        got = list(loader)
        assert len(got) == expected > 0
        assert epochs_of(got) == [epoch]
        per_for += [m.sample_ids.tolist() for _, m in got]
    # the three epochs together are the endless stream's first batches, nothing skipped or repeated
    endless = Loader(BATCHERS[kind](long_tailed_docs), endless=True, return_meta=True)
    ids = []
    for _, meta in endless:
        ids.append(meta.sample_ids.tolist())
        if len(ids) == loader.state_dict()["consumed"]:
            break
    assert [i for row in ids for i in row] == [i for row in per_for for i in row]


@pytest.mark.slow
def test_len_is_exact_after_a_resume_mid_epoch_and_for_every_rank(long_tailed_docs):
    first = Loader(windows(long_tailed_docs))
    for step, _ in enumerate(first):
        if step == 6:
            break
    whole = len(Loader(windows(long_tailed_docs)))
    # len() is the whole epoch before and after a resume (what Lightning and the Trainer count on);
    # `remaining` is what the next `for` yields, by the dataset's resume= or load_state_dict alike
    by_resume = Loader(windows(long_tailed_docs, resume=first.state_dict()), return_meta=True)
    by_load = Loader(windows(long_tailed_docs), return_meta=True)
    by_load.load_state_dict(first.state_dict())
    for resumed in (by_resume, by_load):
        assert len(resumed) == whole and resumed.remaining == whole - 7
        assert len(list(resumed)) == whole - 7 and resumed.remaining == len(resumed)
        assert len(resumed) == len(list(resumed))  # the next epoch, whole
    for rank in range(3):  # ranks of one node hold a batch more or less of an epoch
        ranked = Loader(windows(long_tailed_docs, world=WorldPosition(0, 1, rank, 3)))
        assert len(ranked) == len(list(ranked))
    lanes = Loader(windows(long_tailed_docs, lanes=2, window_shards=1, max_batches=5))
    assert len(lanes) == len(list(lanes)) == 5


@pytest.mark.slow
@pytest.mark.parametrize("drain", [True, False], ids=["drained", "len-then-iter"])
def test_ranks_of_an_uneven_split_run_whole_epochs_whether_the_loop_drains_or_stops_at_len(long_tailed_docs, drain):
    """What Lightning's fetcher and the Trainer do: take len() batches, then iter() again. Three
    ranks whose epoch does not split evenly agree on every epoch's length without a collective, no
    epoch is empty, and each rank's batches are its endless stream's, nothing skipped or repeated."""
    ranks = [Loader(windows(long_tailed_docs, world=WorldPosition(0, 1, r, 3)), return_meta=True) for r in range(3)]
    handed: list[list[list[int]]] = [[] for _ in ranks]
    lengths = []
    for epoch in range(3):
        lengths.append([len(loader) for loader in ranks])
        for r, loader in enumerate(ranks):
            if drain:
                got = list(loader)
            else:
                it = iter(loader)
                got = [next(it) for _ in range(len(loader))]
            assert loader.remaining == len(loader)  # the next epoch, whole
            assert epochs_of(got)[-1] == epoch
            handed[r] += [m.sample_ids.tolist() for _, m in got]
    assert all(len(set(row)) == 1 and row[0] > 0 for row in lengths)
    node_batches = sum(len(handed[r]) for r in range(3))
    for r in range(len(ranks)):
        endless = Loader(windows(long_tailed_docs, world=WorldPosition(0, 1, r, 3)), endless=True, return_meta=True)
        expected = []
        for _, meta in endless:
            if len(expected) == len(handed[r]):
                break
            expected.append(meta.sample_ids.tolist())
        assert handed[r] == expected
    assert node_batches == 3 * sum(row[0] for row in lengths)


def test_the_endless_stream_is_opt_in_and_has_no_length(long_tailed_docs):
    one = Loader(windows(long_tailed_docs))
    endless = Loader(windows(long_tailed_docs), endless=True, return_meta=True)
    with pytest.raises(TypeError, match="endless"):
        len(endless)
    count = len(one)
    _, meta = next(itertools.islice(endless, count + 3, None))
    assert meta.epoch == 1  # it ran past the epoch edge
    with pytest.raises(ValueError, match="endless=True"):
        Loader(windows(long_tailed_docs), epoch_end=None)


def test_a_token_budget_has_no_length_but_still_ends_each_epoch(long_tailed_docs):
    loader = Loader(
        TieredDataset(
            long_tailed_docs, BatchSpec(batch_size=16, batcher=TokenBudget(8192)), OrderSpec(partitions=PARTITIONS)
        ),
        return_meta=True,
    )
    with pytest.raises(TypeError, match="planned"):
        len(loader)
    assert epochs_of(list(loader)) == [0] and epochs_of(list(loader)) == [1]


def test_each_for_over_an_eval_loader_runs_the_whole_eval(long_tailed_docs):
    loader = Loader(windows(long_tailed_docs, eval=True), return_meta=True)
    steps = len(loader)
    first = [m.sample_ids.tolist() for _, m in loader]
    second = [m.sample_ids.tolist() for _, m in loader]
    assert len(first) == steps == len(loader) and first == second


def test_token_ids_reach_the_loop_as_int64_or_the_dtype_asked_for(long_tailed_docs):
    made = {
        "windows": lambda: windows(long_tailed_docs, max_batches=2),
        "buckets": lambda: BATCHERS["buckets"](long_tailed_docs, max_batches=2),
        "budget": lambda: TieredDataset(
            long_tailed_docs, BatchSpec(batch_size=16, max_tokens=1024), OrderSpec(partitions=PARTITIONS), max_batches=2
        ),
    }
    for name, make in made.items():
        wire = next(iter(make())).data
        batch = next(iter(Loader(make())))
        assert batch["input_ids"].dtype == torch.int64, name
        if "labels" in batch:
            assert batch["labels"].dtype == torch.int64, name
        assert np.array_equal(batch["input_ids"].numpy(), np.asarray(wire["input_ids"]).astype(np.int64))
        narrow = next(iter(Loader(make(), dtype=torch.int32)))
        assert narrow["input_ids"].dtype == torch.int32
        if "labels" in narrow:
            assert narrow["labels"].dtype == torch.int32
        if name == "budget":
            assert (batch["labels"] == -100).any()  # -100 survives the widening
    assert next(iter(windows(long_tailed_docs))).data["input_ids"].dtype == np.uint16  # the wire stays narrow


# -- shuffle=False: stored order for training ------------------------------------------------


def stored(packed, **kw):
    kw.setdefault("partitions", PARTITIONS)
    return dataset(packed, batch_size=16, columns=["id"], shuffle=False, **kw)


def epoch_ids(pairs, epoch):
    return [i for _, m in pairs for e, i in zip(m.epochs.tolist(), m.sample_ids.tolist()) if e == epoch]


@pytest.mark.slow
def test_shuffle_false_reads_every_sample_once_per_epoch_in_stored_order(long_tailed_docs):
    loader = Loader(stored(long_tailed_docs), return_meta=True)
    first, second = list(loader), list(loader)
    n = stored(long_tailed_docs).num_order_samples
    assert epoch_ids(first, 0) == list(range(n))  # one rank: the stored order itself
    assert epoch_ids(first + second, 1) == list(range(n))
    assert torch.equal(first[0][0]["id"], torch.arange(16))
    # ranks of one node split it round robin, two nodes each read their own partitions in order
    for world in ([WorldPosition(0, 1, r, 2) for r in range(2)], [WorldPosition(n, 2, 0, 1) for n in range(2)]):
        ranks = [list(Loader(stored(long_tailed_docs, world=w), epoch_end="rank", return_meta=True)) for w in world]
        ids = [epoch_ids(r, 0) for r in ranks]
        assert sorted(ids[0] + ids[1]) == list(range(n))
        assert all(rank == sorted(rank) for rank in ids)
    shuffled = Loader(
        TieredDataset(long_tailed_docs, BatchSpec(batch_size=16, columns=["id"]), OrderSpec(partitions=PARTITIONS)),
        return_meta=True,
    )
    assert epoch_ids(list(shuffled), 0) != list(range(n))


# with workers: slow (worker processes for each of the loaders the check makes; tests/loader/test_resume.py
# keeps resuming with workers in the fast set)
@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_shuffle_false_resumes_exactly(long_tailed_docs, workers):
    from tierflow.testing import assert_resumes_exactly

    assert_resumes_exactly(lambda w: Loader(stored(long_tailed_docs), num_workers=w), stops=[1, 17], workers=workers)


@pytest.mark.parametrize("endless", [False, True])
def test_a_loop_that_fetches_one_batch_ahead_saves_the_state_of_the_batch_it_trained(long_tailed_docs, endless):
    """Lightning's fetcher (a Loader without len()) and accelerate's DataLoaderShard hold one batch
    ahead of the step; with `lookahead=1` the state saved resumes right after the trained batch,
    and once the `for` has ended (nothing held ahead) after the last one."""

    def make():
        return Loader(windows(long_tailed_docs), endless=endless, return_meta=True)

    epochs = Loader(windows(long_tailed_docs), return_meta=True)
    reference = [[m.sample_ids.tolist() for _, m in epochs] for _ in range(2)]
    loader = make()
    loader.lookahead = 1
    it = iter(loader)
    trained, (_, meta) = [], next(it)
    saved = {}
    for step in range(len(reference[0]) - 1):
        ahead = next(it)  # the framework fetches the next batch before the step trains this one
        trained.append(meta.sample_ids.tolist())
        if step in (0, 5):
            saved[step + 1] = loader.state_dict()  # resumes at the batch after the trained one
        meta = ahead[1]
    trained.append(meta.sample_ids.tolist())
    if not endless:
        with pytest.raises(StopIteration):
            next(it)  # the fetch ahead finds the epoch's end: the last batch is the one being trained
        saved[len(reference[0])] = loader.state_dict()
    assert trained == reference[0]
    following = reference[0] + reference[1]
    for at, state in saved.items():
        resumed = make()
        resumed.load_state_dict(state)
        assert next(iter(resumed))[1].sample_ids.tolist() == following[at]


@pytest.mark.parametrize("kind", ["windows", "buckets"])
def test_epoch_lengths_are_what_the_epochs_yield_from_the_start_and_mid_epoch(long_tailed_docs, kind):
    loader = Loader(BATCHERS[kind](long_tailed_docs, world=WorldPosition(0, 1, 1, 3)))
    lengths = loader.epoch_lengths(4)
    assert lengths[0] == len(loader)
    it = iter(loader)
    for _ in range(5):
        next(it)
    assert loader.epoch_lengths(4) == lengths  # the epoch in progress counts whole
    ran = [5 + sum(1 for _ in it)] + [sum(1 for _ in loader) for _ in range(3)]
    assert ran == lengths
    if kind == "windows":
        assert len(set(lengths)) > 1  # carried remainders: epochs differ by a batch or so, and are counted so


def test_a_loader_refuses_to_be_rebuilt_or_collated_naming_the_supported_path(long_tailed_docs):
    loader = Loader(windows(long_tailed_docs))
    with pytest.raises(AttributeError, match="load_state_dict"):
        _ = loader.drop_last  # accelerate's skip_first_batches reads it
    batch = next(iter(TieredDataset(long_tailed_docs, BatchSpec(batch_size=2, seq_len=64))))
    with pytest.raises(TypeError, match="TierflowTrainer"):
        vars(batch)  # what the transformers Trainer's collator does with a sample


@pytest.fixture(scope="module")
def many_shards_of_long_docs(tmp_path_factory) -> str:
    """2,000 documents of ~6 KB in ~50 shards: a default order of many lanes, its first epoch narrowed."""
    root = tmp_path_factory.mktemp("long_docs")
    rng = np.random.default_rng(3)
    lines = []
    for i in range(2000):
        n = min(int(rng.lognormal(8.3, 0.8)) + 5, 40000)
        lines.append(json.dumps({"id": i, "text": (rng.integers(0, 26, n) + 97).astype(np.uint8).tobytes().decode()}))
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    tierflow.pack([root / "docs.jsonl"], root / "ds", tokenizer="bytes", workers=1, target_shard_bytes=256 << 10)
    return str(root / "ds")


@pytest.mark.slow
def test_each_for_under_a_token_budget_holds_every_sample_of_its_epoch(many_shards_of_long_docs):
    """Lanes reach their epoch ends apart (more so in a narrowed first epoch, read a group of lanes
    at a time): a budget batch of next-epoch samples must not end the `for` while samples of the
    epoch are still pending or unread (before: the first `for` held 1,275 of 4,000 documents)."""
    path = many_shards_of_long_docs
    loader = Loader(TieredDataset(path, BatchSpec(batch_size=8, max_tokens=16384)), return_meta=True)
    assert loader.dataset.order.first_epoch is not None and loader.dataset.working_set.lanes > 1
    total = len(tierflow.open_dataset(path))
    trained: list[tuple[int, int]] = []
    for epoch in range(3):
        got = list(loader)
        samples = [(e, i) for _, m in got for e, i in zip(m.epochs.tolist(), m.sample_ids.tolist())]
        assert {e for e, _ in samples} <= {epoch, epoch + 1}  # nothing of an epoch already ended
        trained += samples
        assert sorted(i for e, i in trained if e == epoch) == list(range(total))  # the epoch whole by its end
    assert len(trained) == len(set(trained))


@pytest.mark.parametrize("lanes", [1, 4])
def test_length_buckets_make_no_batch_of_two_epochs(long_tailed_docs, lanes):
    """A group of 8 order batches sorted by length straddles each epoch edge; sorted epoch-major,
    the older epoch's samples fill its first batches and no batch holds two epochs (sorted by
    length alone, all 8 did), and each `for` holds its own epoch's parts of the group only."""
    from tierflow.loader.batching import LengthBuckets

    batcher = LengthBuckets(max_length=1024, column="tokens")
    loader = Loader(
        TieredDataset(long_tailed_docs, BatchSpec(batch_size=8, batcher=batcher), OrderSpec(lanes=lanes)),
        return_meta=True,
    )
    mixed, seen = 0, []
    for _ in range(2):
        seen.append(set())
        for _, meta in loader:
            epochs = set(np.unique(meta.epochs).tolist())
            seen[-1] |= epochs
            mixed += len(epochs) > 1
    assert seen == [{0}, {1}] and mixed == 0


def test_the_flat_keywords_of_before_the_specs_are_refused_saying_what_to_write(long_tailed_docs):
    with pytest.raises(
        TypeError,
        match=r"TieredDataset\(data, BatchSpec\(batch_size=\.\.\., seq_len=\.\.\.\), "
        r"OrderSpec\(seed=\.\.\.\)\)",
    ):
        TieredDataset(long_tailed_docs, batch_size=8, seq_len=64, seed=1)
    with pytest.raises(TypeError, match=r"BatchSpec\(batch_size=\.\.\.\)"):
        TieredDataset(long_tailed_docs)
    with pytest.raises(TypeError, match="'colour'"):
        TieredDataset(long_tailed_docs, BatchSpec(batch_size=8), colour="red")


def test_a_loop_that_steps_after_epochs_without_a_step_gets_the_read_ahead_thread(long_tailed_docs):
    """Each `for` measures its loop afresh: epochs drained with no step chose to read inline, and a
    `for` with a step after them read inline too (0.88 of the dry run through a 10 ms step)."""
    import time

    from tierflow.loader.device_feed_readahead import AUTO_DECIDE_AFTER

    loader = Loader(dataset(long_tailed_docs, batch_size=2, seq_len=64, partitions=PARTITIONS))
    assert len(loader) > 2 * AUTO_DECIDE_AFTER
    for _batch in loader:  # no step
        pass
    assert not loader._feed_iterator.background
    for n, _batch in enumerate(loader):
        time.sleep(0.002)  # a step
        if n == 2 * AUTO_DECIDE_AFTER:
            break
    assert loader._feed_iterator.background
    loader.close()
