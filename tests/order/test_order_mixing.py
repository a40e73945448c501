"""Specification of the mixed stream: several datasets by weight in one rank stream, counts that
follow the weights, exactly-once epochs per dataset, exact and elastic resume, cursor checks."""

import json

import numpy as np
import pytest

from tierflow.order import CursorMismatchError, MixedOrder, MixedRankStream, RankStream, SampleOrder

WEIGHTS = [0.6, 0.3, 0.1]


def make_orders(seed=5):
    rng = np.random.default_rng(seed)
    return [
        SampleOrder(
            [int(c) for c in rng.integers(3, 9, size=8)], dataset_id="small", seed=seed, partitions=4, window_shards=2
        ),
        SampleOrder(
            [int(c) for c in rng.integers(10, 30, size=24)],
            dataset_id="medium",
            seed=seed,
            partitions=8,
            window_shards=3,
        ),
        SampleOrder(
            [int(c) for c in rng.integers(20, 60, size=16)],
            dataset_id="large",
            seed=seed,
            partitions=8,
            window_shards=2,
            remainder="pad",
        ),
    ]


def make_mixture(weights=WEIGHTS, seed=9):
    return MixedOrder(make_orders(), weights, seed=seed)


def run_steps(mixture, cursor, nodes, ranks, workers, batch_size, until_epoch=None, max_steps=None):
    """Synchronous steps; returns {dataset: [(ids, epochs, mask)]} in order and the last cursor."""
    streams = {
        (n, r): MixedRankStream(
            mixture, cursor, batch_size=batch_size, node=n, num_nodes=nodes, rank=r, ranks_per_node=ranks
        )
        for n in range(nodes)
        for r in range(ranks)
    }
    iters = {key: [s.batches(w, workers) for w in range(workers)] for key, s in streams.items()}
    seen = {d: [] for d in range(mixture.num_datasets)}
    last, step = cursor.to_dict(), 0
    while max_steps is None or step < max_steps:
        for key in streams:
            batch = next(iters[key][step % workers])
            assert batch.index == step
            seen[batch.dataset].append((batch.sample_ids, batch.epochs, batch.mask))
            last = batch.cursor
        step += 1
        if until_epoch is not None and min(c["epoch"] for c in last["datasets"]) >= until_epoch:
            break
    return seen, last


def epoch_ids(seen, dataset, epoch):
    parts = [ids[(epochs == epoch) & mask] for ids, epochs, mask in seen[dataset]]
    return np.concatenate(parts) if parts else np.array([], dtype=np.int64)


def test_each_dataset_supplies_its_weight_of_node_batches_within_two():
    mixture = make_mixture()
    stream = MixedRankStream(mixture, mixture.start(), batch_size=4)
    datasets = np.array([stream.batch(b).dataset for b in range(600)])
    for g in [1, 10, 97, 300, 600]:
        counts = np.bincount(datasets[:g], minlength=3)
        assert np.abs(counts - np.array(WEIGHTS) * g).max() <= 2


@pytest.mark.slow
@pytest.mark.parametrize("nodes,ranks,workers", [(1, 1, 1), (2, 2, 3), (4, 1, 2)])
def test_every_dataset_reads_each_of_its_samples_exactly_once_per_its_own_epoch(nodes, ranks, workers):
    mixture = make_mixture()
    seen, _ = run_steps(mixture, mixture.start(), nodes, ranks, workers, batch_size=5, until_epoch=2)
    for d, order in enumerate(mixture.orders):
        for epoch in (0, 1):
            assert np.array_equal(np.sort(epoch_ids(seen, d, epoch)), np.arange(order.layout.num_samples))


def test_a_small_heavy_dataset_repeats_with_a_fresh_shuffle_each_epoch():
    orders = [
        SampleOrder([6, 6, 6], dataset_id="tiny", seed=1, partitions=1, window_shards=3),
        SampleOrder([50] * 40, dataset_id="big", seed=1, partitions=4),
    ]
    mixture = MixedOrder(orders, [0.8, 0.2], seed=2)
    stream = MixedRankStream(mixture, mixture.start(), batch_size=6)
    seen = {0: [], 1: []}
    for b in range(60):
        batch = stream.batch(b)
        seen[batch.dataset].append((batch.sample_ids, batch.epochs, batch.mask))
    epochs = [epoch_ids(seen, 0, e) for e in range(4)]
    for ids in epochs:
        assert np.array_equal(np.sort(ids), np.arange(18))
    assert len({tuple(ids.tolist()) for ids in epochs}) == 4


def test_resume_from_a_batch_cursor_yields_exactly_the_uninterrupted_continuation():
    mixture = make_mixture()
    world = dict(num_nodes=2, ranks_per_node=3, batch_size=6)
    for stop in np.random.default_rng(0).integers(0, 150, size=5).tolist():
        for node in range(2):
            for rank in range(3):
                whole = MixedRankStream(mixture, mixture.start(), node=node, rank=rank, **world)
                saved = json.loads(json.dumps(whole.batch(stop).cursor))
                again = MixedRankStream(make_mixture(), make_mixture().load(saved), node=node, rank=rank, **world)
                for k in range(5):
                    expected, got = whole.batch(stop + 1 + k), again.batch(k)
                    assert got.dataset == expected.dataset
                    assert np.array_equal(got.sample_ids, expected.sample_ids)
                    assert np.array_equal(got.mask, expected.mask)
                    assert got.cursor == expected.cursor


def test_elastic_resume_from_four_nodes_to_two_covers_each_dataset_epoch_exactly_once():
    mixture = make_mixture()
    first, cursor = run_steps(mixture, mixture.start(), 4, 2, 2, batch_size=5, max_steps=7)
    resumed = mixture.load(json.loads(json.dumps(cursor)))
    second, _ = run_steps(mixture, resumed, 2, 3, 1, batch_size=5, until_epoch=1)
    for d, order in enumerate(mixture.orders):
        ids = np.concatenate([epoch_ids(first, d, 0), epoch_ids(second, d, 0)])
        assert np.array_equal(np.sort(ids), np.arange(order.layout.num_samples))


def test_cursor_is_the_same_on_every_rank_and_node_and_is_small_json():
    mixture = make_mixture()
    cursors = {
        json.dumps(
            MixedRankStream(mixture, mixture.start(), batch_size=4, num_nodes=2, node=n, ranks_per_node=2, rank=r)
            .batch(11)
            .cursor,
            sort_keys=True,
        )
        for n in range(2)
        for r in range(2)
    }
    assert len(cursors) == 1
    saved = json.loads(cursors.pop())
    assert saved["draws"] == 12 * 2
    assert saved["weights"] == WEIGHTS and len(saved["datasets"]) == 3
    assert len(json.dumps(saved)) < 4000


def test_golden_first_batches_for_a_small_config():
    orders = [
        SampleOrder([4] * 6, dataset_id="a", seed=3, partitions=2, window_shards=2),
        SampleOrder([5] * 4, dataset_id="b", seed=3, partitions=2, window_shards=2),
    ]
    mixture = MixedOrder(orders, [0.7, 0.3], seed=1)
    stream = MixedRankStream(mixture, mixture.start(), batch_size=3)
    got = [(stream.batch(b).dataset, stream.batch(b).sample_ids.tolist()) for b in range(8)]
    assert got == GOLDEN


GOLDEN = [
    (0, [16, 2, 17]),
    (0, [6, 12, 14]),
    (0, [0, 19, 1]),
    (1, [13, 4, 1]),
    (0, [5, 4, 15]),
    (0, [18, 3, 9]),
    (1, [19, 17, 7]),
    (0, [13, 7, 21]),
]


def test_a_datasets_batches_are_its_own_node_stream_in_order():
    mixture = make_mixture()
    mixed = MixedRankStream(mixture, mixture.start(), batch_size=4, num_nodes=2, node=1)
    own = [RankStream(order, order.start(), batch_size=4, num_nodes=2, node=1) for order in mixture.orders]
    taken = [0, 0, 0]
    for b in range(80):
        batch = mixed.batch(b)
        expected = own[batch.dataset].batch(taken[batch.dataset])
        taken[batch.dataset] += 1
        assert np.array_equal(batch.sample_ids, expected.sample_ids)
        assert np.array_equal(batch.epochs, expected.epochs)
    assert min(taken) > 0


def test_different_weights_are_refused_naming_them_unless_allowed():
    saved = MixedRankStream(make_mixture(), make_mixture().start(), batch_size=4).batch(20).cursor
    other = make_mixture(weights=[0.2, 0.3, 0.5])
    with pytest.raises(CursorMismatchError, match="weights"):
        other.load(saved)
    resumed = other.load(saved, allow_mismatch=True)
    stream = MixedRankStream(other, resumed, batch_size=4)
    assert [stream.batch(b).dataset for b in range(40)].count(2) >= 40 * 0.5 - 2


def test_a_changed_dataset_is_refused_naming_it():
    saved = MixedRankStream(make_mixture(), make_mixture().start(), batch_size=4).batch(3).cursor
    orders = make_orders()
    orders[1] = SampleOrder([7] * 24, dataset_id="medium-v2", seed=5, partitions=8, window_shards=3)
    with pytest.raises(CursorMismatchError, match="dataset 1.*dataset_id"):
        MixedOrder(orders, WEIGHTS, seed=9).load(saved)


def test_a_cursor_with_another_number_of_datasets_is_refused_even_when_allowed():
    saved = MixedRankStream(make_mixture(), make_mixture().start(), batch_size=4).batch(3).cursor
    two = MixedOrder(make_orders()[:2], [0.5, 0.5], seed=9)
    with pytest.raises(CursorMismatchError, match="3 datasets"):
        two.load(saved, allow_mismatch=True)
