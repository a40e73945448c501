"""Specification of the sample order as the loader sees it: exactly-once epochs for any world
shape, exact resume (also elastic), seek, determinism, cursor checks."""

import json
import subprocess
import sys

import numpy as np
import pytest

from tierflow.order import CursorMismatchError, RankStream, SampleOrder

COUNTS = [int(c) for c in np.random.default_rng(5).integers(5, 41, size=64)]


GROUPED = 64
"""group_bytes for the block-group shuffle at 10 decoded bytes a sample: shards of 5-40 samples are
cut into runs of <= 6 samples, or merged while they fit."""


NARROW = (3, 1)
"""first_epoch: epoch 0 reads a node's lanes three at a time, windows of one shard."""


def make_order(
    remainder="carry", seed=11, partitions=16, window_shards=3, counts=COUNTS, group_bytes=0, first_epoch=None
):
    return SampleOrder(
        counts,
        dataset_id="synthetic-64",
        seed=seed,
        partitions=partitions,
        window_shards=window_shards,
        remainder=remainder,
        group_bytes=group_bytes,
        decoded_bytes=[10 * c for c in counts],
        first_epoch=first_epoch,
    )


def run_epoch_zero(order, cursor, nodes, ranks, workers, batch_size, max_steps=None):
    """Synchronous steps from `cursor`; every rank's workers build their batches b = w mod W.
    Returns epoch-0 real ids seen and the cursor after the last step."""
    streams = {
        (n, r): RankStream(order, cursor, batch_size=batch_size, node=n, num_nodes=nodes, rank=r, ranks_per_node=ranks)
        for n in range(nodes)
        for r in range(ranks)
    }
    worker_iters = {key: [s.batches(w, workers) for w in range(workers)] for key, s in streams.items()}
    seen, last_cursor, step = [], cursor.to_dict(), 0
    while max_steps is None or step < max_steps:
        for key in streams:
            batch = next(worker_iters[key][step % workers])
            assert batch.index == step
            seen.append(batch.sample_ids[(batch.epochs == 0) & batch.mask])
            last_cursor = batch.cursor
        step += 1
        if max_steps is None and last_cursor["epoch"] >= 1:
            break
    return np.concatenate(seen), last_cursor


@pytest.mark.parametrize("first_epoch", [None, NARROW])
@pytest.mark.parametrize("group_bytes", [0, GROUPED])
@pytest.mark.parametrize("remainder", ["carry", "pad"])
@pytest.mark.parametrize("nodes,ranks,workers", [(1, 1, 1), (2, 2, 2), (4, 1, 3), (2, 4, 1), (8, 2, 2)])
def test_every_sample_exactly_once_per_epoch_for_any_world_shape(
    remainder, nodes, ranks, workers, group_bytes, first_epoch
):
    order = make_order(remainder, group_bytes=group_bytes, first_epoch=first_epoch)
    ids, _ = run_epoch_zero(order, order.start(), nodes, ranks, workers, batch_size=7)
    assert np.array_equal(np.sort(ids), np.arange(sum(COUNTS)))


def test_drop_reads_each_sample_at_most_once_and_skips_only_partition_tails():
    order = make_order("drop")
    ids, _ = run_epoch_zero(order, order.start(), 2, 2, 2, batch_size=7)
    assert np.unique(ids).size == ids.size
    expected = sum((int(n) // 7) * 7 for n in order.layout.partition_sizes)
    assert ids.size == expected


def test_pad_marks_repeats_in_the_mask_and_keeps_batches_full():
    order = make_order("pad")
    stream = RankStream(order, order.start(), batch_size=7)
    batches = [stream.batch(b) for b in range(400)]
    assert all(b.sample_ids.size == 7 for b in batches)
    padded = [b for b in batches if not b.mask.all()]
    assert padded
    for b in padded:
        real = b.sample_ids[b.mask]
        assert set(b.sample_ids[~b.mask].tolist()) <= set(real.tolist())


@pytest.mark.parametrize("first_epoch", [None, NARROW])
@pytest.mark.parametrize("group_bytes", [0, GROUPED])
@pytest.mark.parametrize("new_nodes,new_ranks", [(2, 2), (8, 1), (4, 3)])
def test_elastic_resume_covers_the_epoch_exactly_once(new_nodes, new_ranks, group_bytes, first_epoch):
    order = make_order(group_bytes=group_bytes, first_epoch=first_epoch)
    first, cursor = run_epoch_zero(order, order.start(), 4, 2, 2, batch_size=5, max_steps=9)
    resumed = order.load(json.loads(json.dumps(cursor)))
    second, _ = run_epoch_zero(order, resumed, new_nodes, new_ranks, 2, batch_size=5)
    assert np.array_equal(np.sort(np.concatenate([first, second])), np.arange(sum(COUNTS)))


@pytest.mark.parametrize("first_epoch", [None, NARROW])
@pytest.mark.parametrize("group_bytes", [0, GROUPED])
@pytest.mark.parametrize("remainder", ["carry", "drop", "pad"])
def test_resume_from_a_batch_cursor_yields_exactly_the_uninterrupted_continuation(remainder, group_bytes, first_epoch):
    order = make_order(remainder, group_bytes=group_bytes, first_epoch=first_epoch)
    world = dict(num_nodes=2, ranks_per_node=3, batch_size=6)
    rng = np.random.default_rng(0)
    stops = rng.integers(0, 120, size=5).tolist()
    if first_epoch is not None:  # and right before, at and after the first epoch's last batch
        last = RankStream(order, order.start(), **world).epoch_batches()[1] - 1
        stops += [last - 1, last, last + 1]
    for stop in stops:
        for node in range(2):
            for rank in range(3):
                whole = RankStream(order, order.start(), node=node, rank=rank, **world)
                saved = whole.batch(stop).cursor
                again = RankStream(
                    order,
                    make_order(remainder, group_bytes=group_bytes, first_epoch=first_epoch).load(saved),
                    node=node,
                    rank=rank,
                    **world,
                )
                for k in range(4):
                    assert np.array_equal(again.batch(k).sample_ids, whole.batch(stop + 1 + k).sample_ids)
                    assert again.batch(k).cursor == whole.batch(stop + 1 + k).cursor


@pytest.mark.parametrize("first_epoch", [None, NARROW])
@pytest.mark.parametrize("group_bytes", [0, GROUPED])
def test_seeking_to_a_batch_equals_iterating_to_it(group_bytes, first_epoch):
    order = make_order(group_bytes=group_bytes, first_epoch=first_epoch)
    stream = RankStream(order, order.start(), batch_size=4, num_nodes=4, node=1, ranks_per_node=2, rank=1)
    iterated = [b.sample_ids for _, b in zip(range(150), stream.batches())]
    for b in np.random.default_rng(1).integers(0, 150, size=10).tolist():
        fresh = RankStream(order, order.start(), batch_size=4, num_nodes=4, node=1, ranks_per_node=2, rank=1)
        assert np.array_equal(fresh.batch(b).sample_ids, iterated[b])


@pytest.mark.parametrize("group_bytes", [0, GROUPED])
def test_cursor_is_world_independent_across_ranks_and_nodes(group_bytes):
    order = make_order(group_bytes=group_bytes)
    cursors = {
        json.dumps(
            RankStream(order, order.start(), batch_size=5, num_nodes=2, node=n, ranks_per_node=2, rank=r)
            .batch(13)
            .cursor,
            sort_keys=True,
        )
        for n in range(2)
        for r in range(2)
    }
    assert len(cursors) == 1


def test_golden_first_batches_for_a_small_config():
    order = SampleOrder([10] * 20, dataset_id="golden", seed=3, partitions=4, window_shards=2)
    stream = RankStream(order, order.start(), batch_size=6)
    got = [stream.batch(b).sample_ids.tolist() for b in range(3)]
    assert got == GOLDEN


GOLDEN = [[40, 8, 46, 43, 9, 1], [176, 97, 95, 90, 173, 93], [143, 148, 69, 65, 140, 146]]


@pytest.mark.parametrize("group_bytes", [0, GROUPED])
def test_same_seed_gives_the_same_order_in_another_process(group_bytes):
    code = (
        "import json;from tierflow.order import SampleOrder, RankStream;"
        f"o=SampleOrder({COUNTS}, dataset_id='synthetic-64', seed=11, partitions=16, window_shards=3, "
        f"group_bytes={group_bytes}, decoded_bytes={[10 * c for c in COUNTS]});"
        "s=RankStream(o,o.start(),batch_size=7,num_nodes=2,node=1);"
        "print(json.dumps([s.batch(b).sample_ids.tolist() for b in range(20)]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    order = make_order(group_bytes=group_bytes)
    stream = RankStream(order, order.start(), batch_size=7, num_nodes=2, node=1)
    assert json.loads(out) == [stream.batch(b).sample_ids.tolist() for b in range(20)]


def test_different_seeds_give_different_orders():
    a = RankStream(make_order(seed=1), make_order(seed=1).start(), batch_size=50).batch(0).sample_ids
    b = RankStream(make_order(seed=2), make_order(seed=2).start(), batch_size=50).batch(0).sample_ids
    assert not np.array_equal(a, b)


def test_cursor_from_another_configuration_is_refused_naming_the_fields():
    saved = RankStream(make_order(), make_order().start(), batch_size=5).batch(3).cursor
    other = make_order(seed=12, window_shards=4)
    with pytest.raises(CursorMismatchError, match="seed: cursor 11 vs order 12") as info:
        other.load(saved)
    assert "window_shards: cursor 3 vs order 4" in str(info.value)
    assert "dataset_id" not in str(info.value)


def test_allow_mismatch_resumes_positions_under_the_new_configuration():
    saved = RankStream(make_order(), make_order().start(), batch_size=5).batch(3).cursor
    other = make_order(seed=12)
    cursor = other.load(saved, allow_mismatch=True)
    assert list(cursor.offsets) == saved["offsets"] and cursor.seed == 12
    assert cursor.config_hash == other.config_hash


def test_cursor_with_a_different_partition_count_is_refused_even_when_mismatch_is_allowed():
    saved = make_order().start().to_dict()
    with pytest.raises(CursorMismatchError, match="16 partitions"):
        make_order(partitions=8).load(saved, allow_mismatch=True)


def test_cursor_is_small_json():
    cursor = RankStream(make_order(), make_order().start(), batch_size=5).batch(3).cursor
    text = json.dumps(cursor)
    assert json.loads(text) == cursor and len(text) < 2000
    assert {"version", "seed", "epoch", "partitions", "epochs", "offsets", "config_hash"} <= cursor.keys()


def test_node_count_that_does_not_divide_partitions_is_an_error_listing_valid_counts():
    order = make_order()
    with pytest.raises(ValueError, match=r"valid node counts: \[1, 2, 4, 8, 16\]"):
        RankStream(order, order.start(), batch_size=4, num_nodes=3)


def _shards_open(order, batches):
    """Per batch: how many shards have been started and not yet finished by the epoch-0 samples so far."""
    first, last = {}, {}
    ends = np.cumsum(COUNTS)
    for b, batch in enumerate(batches):
        for shard in np.searchsorted(ends, batch.sample_ids[(batch.epochs == 0) & batch.mask], side="right"):
            first.setdefault(int(shard), b)
            last[int(shard)] = b
    return max(sum(1 for s in first if first[s] <= b <= last[s]) for b in range(len(batches)))


def test_a_narrowed_first_epoch_reads_a_few_shards_at_once_and_later_epochs_all_lanes():
    wide, narrow = make_order(), make_order(first_epoch=(2, 1))
    streams = [RankStream(o, o.start(), batch_size=4) for o in (wide, narrow)]
    epoch = streams[1].epoch_batches()[1]
    firsts = [[s.batch(b) for b in range(epoch)] for s in streams]
    assert _shards_open(wide, firsts[0]) >= 16 * 2  # every lane's window of 3 at once
    assert _shards_open(narrow, firsts[1]) <= 2 * 2  # two lanes, each finishing one shard as it starts the next
    ends = np.cumsum(COUNTS)
    seconds = [[s.batch(b) for b in range(epoch, epoch + 40)] for s in streams]
    shards_read = [
        len(set(np.searchsorted(ends, np.concatenate([b.sample_ids for b in batches]), side="right")))
        for batches in seconds
    ]
    assert shards_read[1] == shards_read[0] > 16  # epoch 1 as wide as the wide order's
    through = streams[1].epoch_batches(after=0)[1]  # a lane's carried batch starts its epoch 1 early: from 0
    ids = np.concatenate([b.sample_ids[(b.epochs == 1) & b.mask] for b in map(streams[1].batch, range(through))])
    assert np.array_equal(np.sort(ids), np.arange(sum(COUNTS)))


def test_a_first_epoch_cursor_is_refused_by_an_order_as_wide_in_every_epoch():
    narrow = make_order(first_epoch=NARROW)
    saved = RankStream(narrow, narrow.start(), batch_size=5).batch(3).cursor
    with pytest.raises(CursorMismatchError, match=r"first_epoch: cursor \[3, 1\] vs order None"):
        make_order().load(saved)
    assert make_order().config_hash != make_order(first_epoch=NARROW).config_hash


@pytest.mark.parametrize(
    "shards,lanes,k,expected",
    [
        (25, 16, 4, (4, 1)),  # a small dataset: the least, lanes first
        (400, 16, 4, (16, 1)),  # 1/16 of 400: 25 shards, one a lane
        (800, 16, 4, (16, 3)),
        (2000, 16, 4, None),  # 64 shards at once is already within 1/16
        (25, 2, 2, None),  # no wider than the least
        (40, 1, 8, (1, 4)),  # one lane: a narrower window
    ],
)
def test_the_first_epoch_breadth_is_a_sixteenth_of_the_nodes_shards_and_at_least_four(shards, lanes, k, expected):
    from tierflow.order.working_set import first_epoch_breadth

    assert first_epoch_breadth(shards, lanes, k) == expected
