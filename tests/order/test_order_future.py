"""Specification of the future view: every read falls inside a listed interval, across epochs."""

import numpy as np
import pytest

from tierflow.order import RankStream, SampleOrder, future_shard_uses

COUNTS = [int(c) for c in np.random.default_rng(8).integers(3, 30, size=96)]


def node_reads(order, cursor, node, num_nodes, batch_size, picks):
    """(node position of the batch start, shard, epoch) for every real sample of the node's
    first `picks` batches from `cursor`."""
    stream = RankStream(order, cursor, batch_size=batch_size, node=node, num_nodes=num_nodes)
    reads = []
    for j in range(picks):
        micro = stream.node_batch(j)
        shards = order.layout.shard_of(micro.sample_ids[micro.mask])
        for shard, sample_epoch in zip(shards.tolist(), micro.epochs[micro.mask].tolist()):
            reads.append((j * batch_size, shard, sample_epoch))
    return reads


def cursor_after_steps(order, num_nodes, batch_size, steps):
    return RankStream(order, order.start(), batch_size=batch_size, num_nodes=num_nodes).cursor_after(steps - 1)


@pytest.mark.parametrize("remainder", ["carry", "drop", "pad"])
@pytest.mark.parametrize("steps", [1, 37, 70])
def test_every_read_within_the_horizon_lies_inside_an_interval_of_its_shard(remainder, steps):
    order = SampleOrder(COUNTS, dataset_id="future", seed=4, partitions=8, window_shards=3, remainder=remainder)
    batch_size, num_nodes, node = 5, 2, 1
    cursor = cursor_after_steps(order, num_nodes, batch_size, steps)
    horizon = 600
    uses = future_shard_uses(order, cursor, node=node, num_nodes=num_nodes, batch_size=batch_size, horizon=horizon)
    by_shard = {}
    for use in uses:
        by_shard.setdefault((use.shard, use.epoch), []).append(use)
    for position, shard, epoch in node_reads(order, cursor, node, num_nodes, batch_size, horizon // batch_size):
        intervals = by_shard.get((shard, epoch), [])
        assert any(u.first_use <= position and position + batch_size - 1 <= u.last_use for u in intervals), (
            position,
            shard,
            epoch,
        )


def test_each_window_interval_runs_exactly_from_its_first_read_to_its_last():
    order = SampleOrder(COUNTS, dataset_id="future", seed=4, partitions=8, window_shards=3)
    batch_size, num_nodes = 5, 2
    cursor = cursor_after_steps(order, num_nodes, batch_size, 40)
    uses = future_shard_uses(order, cursor, node=0, num_nodes=num_nodes, batch_size=batch_size, horizon=400)
    reads = node_reads(order, cursor, 0, num_nodes, batch_size, max(u.last_use for u in uses) // batch_size + 1)
    windows = {}
    for use in uses:
        windows.setdefault((use.partition, use.epoch, use.first_use, use.last_use), set()).add(use.shard)
    for (_partition, epoch, first_use, last_use), shards in windows.items():
        positions = [p for p, s, e in reads if s in shards and e == epoch and first_use <= p <= last_use]
        assert min(positions) == first_use
        assert max(positions) + batch_size - 1 == last_use
        assert {s for p, s, e in reads if s in shards and e == epoch and first_use <= p <= last_use} == shards


def test_the_view_looks_across_the_epoch_boundary():
    order = SampleOrder(COUNTS, dataset_id="future", seed=4, partitions=8, window_shards=3)
    batch_size, num_nodes = 5, 2
    per_node = sum(int(order.layout.partition_sizes[p]) for p in order.layout.node_partitions(0, 2))
    cursor = cursor_after_steps(order, num_nodes, batch_size, per_node // batch_size - 10)
    uses = future_shard_uses(order, cursor, node=0, num_nodes=num_nodes, batch_size=batch_size, horizon=200)
    epochs = {u.epoch for u in uses}
    assert epochs == {0, 1}
    assert [u.first_use for u in uses] == sorted(u.first_use for u in uses)


def test_the_view_lists_only_the_nodes_shards():
    order = SampleOrder(COUNTS, dataset_id="future", seed=4, partitions=8)
    uses = future_shard_uses(order, order.start(), node=3, num_nodes=4, batch_size=4, horizon=10_000)
    owned = set()
    for p in order.layout.node_partitions(3, 4):
        owned.update(order.layout.partition_shards[p].tolist())
    assert {u.shard for u in uses} == owned
