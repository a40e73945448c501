"""Specification of shuffle quality and node locality on a 4,000-shard synthetic manifest."""

import numpy as np
import pytest

from tierflow.order import RankStream, SampleOrder

SHARDS = 4000
COUNTS = [25] * SHARDS
BYTES = [int(b) for b in np.random.default_rng(3).lognormal(mean=18.0, sigma=0.6, size=SHARDS)]


def node_epoch_ids(order, node, num_nodes, batch_size):
    """Epoch-0 real ids in the node's order (all its ranks), walking node batches."""
    stream = RankStream(order, order.start(), batch_size=batch_size, node=node, num_nodes=num_nodes)
    node_samples = order.layout.node_samples(node, num_nodes)
    picks = -(-node_samples // batch_size) + len(stream.partitions)
    out = []
    for j in range(picks):
        micro = stream.node_batch(j)
        out.append(micro.sample_ids[(micro.epochs == 0) & micro.mask])
    ids = np.concatenate(out)
    assert ids.size == node_samples
    return ids


@pytest.mark.slow
def test_global_position_is_uncorrelated_with_stored_index():
    order = SampleOrder(COUNTS, dataset_id="quality", seed=1, partitions=64, window_shards=4)
    ids = node_epoch_ids(order, 0, 1, batch_size=32)
    assert np.array_equal(np.sort(ids), np.arange(sum(COUNTS)))
    positions = np.arange(ids.size, dtype=float)
    rho = np.corrcoef(positions, ids.astype(float))[0, 1]  # both are ranks: Pearson = Spearman
    assert abs(rho) < 0.05, rho


@pytest.mark.slow
@pytest.mark.parametrize("num_nodes", [1, 4])
def test_a_round_over_a_nodes_partitions_reads_at_least_k_shards_per_partition(num_nodes):
    window_shards, batch_size = 4, 32
    order = SampleOrder(COUNTS, dataset_id="quality", seed=2, partitions=64, window_shards=window_shards)
    per_node = 64 // num_nodes
    ids = node_epoch_ids(order, 0, num_nodes, batch_size)
    rounds = ids.size // (per_node * batch_size)
    shards = order.layout.shard_of(ids[: rounds * per_node * batch_size]).reshape(rounds, -1)
    distinct = np.array([np.unique(row).size for row in shards])
    target = min(window_shards * per_node, per_node * batch_size)
    assert distinct.mean() >= target, (distinct.mean(), target)


@pytest.mark.parametrize("num_nodes", [1, 2, 4, 8, 16, 32])
def test_each_node_reads_at_most_125_percent_of_its_share_of_bytes_per_epoch(num_nodes):
    order = SampleOrder(COUNTS, dataset_id="quality", seed=3, partitions=64, shard_bytes=BYTES)
    share = sum(BYTES) / num_nodes
    for node in range(num_nodes):
        stream = RankStream(order, order.start(), batch_size=64, node=node, num_nodes=num_nodes)
        read = set()
        for p in stream.partitions:
            windows = order.windows(p, 0)
            read.update(windows.shard_order.tolist())
        node_bytes = sum(BYTES[s] for s in read)
        assert node_bytes <= 1.25 * share, (node, node_bytes / share)


def test_shards_touched_by_a_nodes_epoch_are_exactly_its_partitions_shards():
    order = SampleOrder(COUNTS[:800], dataset_id="quality", seed=4, partitions=16)
    ids = node_epoch_ids(order, 1, 4, batch_size=16)
    touched = set(np.unique(order.layout.shard_of(ids)).tolist())
    owned = set()
    for p in order.layout.node_partitions(1, 4):
        owned.update(order.layout.partition_shards[p].tolist())
    assert touched == owned


def test_samples_of_a_micro_batch_come_from_one_window_of_k_shards_unless_it_straddles():
    order = SampleOrder(COUNTS[:800], dataset_id="quality", seed=5, partitions=8, window_shards=3)
    stream = RankStream(order, order.start(), batch_size=10)
    for b in range(200):
        batch = stream.batch(b)
        assert np.unique(order.layout.shard_of(batch.sample_ids)).size <= 2 * 3
