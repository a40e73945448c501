"""The future view of a sample of partitions (a forecast of a huge dataset) is the full view's uses
of those partitions, exactly: the partitions stepped over move no window and end the walk where
the full one ends."""

import numpy as np
import pytest

from tierflow.order import RankStream, SampleOrder, future_shard_uses

COUNTS = [int(c) for c in np.random.default_rng(9).integers(3, 30, size=96)]


@pytest.mark.parametrize("remainder", ["carry", "drop", "pad"])
@pytest.mark.parametrize("steps", [0, 37])
@pytest.mark.parametrize("keep", [{0}, {1, 5}, {0, 2, 3, 4, 6, 7}])
def test_the_uses_of_a_sample_of_partitions_are_the_full_views_uses_of_them(remainder, steps, keep):
    order = SampleOrder(COUNTS, dataset_id="sample", seed=3, partitions=8, window_shards=3, remainder=remainder)
    batch_size, num_nodes, node = 5, 2, 0
    stream = RankStream(order, order.start(), batch_size=batch_size, num_nodes=num_nodes)
    cursor = order.start() if steps == 0 else stream.cursor_after(steps - 1)
    horizon = 2 * order.layout.node_samples(node, num_nodes) + batch_size  # across an epoch edge
    full = future_shard_uses(order, cursor, node=node, num_nodes=num_nodes, batch_size=batch_size, horizon=horizon)
    some = future_shard_uses(
        order, cursor, node=node, num_nodes=num_nodes, batch_size=batch_size, horizon=horizon, partitions=keep
    )
    assert some == [use for use in full if use.partition in keep]
