"""A node's batches evaluated many at a time (lane walks and the interleave's picks, vectorised) are
the batches read one at a time through the lanes' spans: same ids, epochs, masks and partitions,
for every remainder rule, world shape, skewed (elastic) cursor, stride and jump back."""

from functools import partial

import numpy as np
import pytest

from tierflow.order import SampleOrder
from tierflow.order import stream as stream_module
from tierflow.order.stream import NodeStream


def random_case(rng):
    shards = int(rng.integers(4, 40))
    counts = [int(c) for c in rng.integers(1, 60, shards)]
    partitions = int(rng.choice([p for p in (1, 2, 4, 8, 16) if p <= shards]))
    order = SampleOrder(
        counts,
        dataset_id="batches",
        seed=int(rng.integers(0, 99)),
        partitions=partitions,
        window_shards=int(rng.integers(1, 5)),
        lanes=int(rng.integers(1, partitions + 1)),
        remainder=str(rng.choice(["carry", "drop", "pad"])),
        shuffle=bool(rng.random() < 0.8),
    )
    if rng.random() < 0.5:  # partitions at different epochs and offsets, as an elastic resume leaves them
        cursor = order.cursor(
            [int(rng.integers(0, 3)) for _ in range(partitions)],
            [int(rng.integers(0, int(n))) for n in order.layout.partition_sizes],
        )
    else:
        cursor = order.start()
    nodes = int(rng.choice([n for n in (1, 2, 4) if partitions % n == 0]))
    return order, cursor, nodes, int(rng.integers(1, 12))


def assert_same_batches(order, cursor, nodes, batch_size, picks_of):
    for node in range(nodes):
        try:
            fast = NodeStream(order, cursor, node=node, num_nodes=nodes, batch_size=batch_size)
        except ValueError:  # drop with a partition smaller than a batch
            return
        slow = NodeStream(order, cursor, node=node, num_nodes=nodes, batch_size=batch_size)
        for j in picks_of(order.layout.node_samples(node, nodes)):
            got, want = fast.read(j), slow.read_by_spans(j)
            assert got.partition == want.partition
            assert got.sample_ids.tolist() == want.sample_ids.tolist()
            assert got.epochs.tolist() == want.epochs.tolist()
            assert got.mask.tolist() == want.mask.tolist()
            real = want.epochs[want.mask] if want.mask.any() else want.epochs
            assert fast.read_parts(j)[4] == int(real.min())


@pytest.mark.parametrize("seed", range(6))
def test_batches_evaluated_in_runs_are_the_batches_read_one_by_one(seed):
    rng = np.random.default_rng(seed)
    for _ in range(20):
        order, cursor, nodes, batch_size = random_case(rng)
        stride = int(rng.choice([1, 2, 3, 8, 64]))
        back = rng.random() < 0.3
        assert_same_batches(order, cursor, nodes, batch_size, partial(strided_picks, rng, batch_size, stride, back))


def strided_picks(rng: np.random.Generator, batch_size: int, stride: int, back: bool, samples: int) -> list[int]:
    """Every `stride`-th batch from a random start; `back`: then a third of them again (a rewind)."""
    run = list(range(int(rng.integers(0, 3)), min(3 * samples // batch_size + 5, 1000), stride))
    return run + run[: len(run) // 3] if back else run


def test_picks_past_int64_keys_merge_by_the_walkers_rule(monkeypatch):
    monkeypatch.setattr(stream_module, "_KEY_LIMIT", 1 << 30)
    rng = np.random.default_rng(11)
    for _ in range(10):
        order, cursor, nodes, batch_size = random_case(rng)
        assert_same_batches(order, cursor, nodes, batch_size, lambda samples: range(min(samples, 600)))


def test_a_batch_of_two_lane_epochs_or_more_reads_as_it_always_has():
    order = SampleOrder([3, 2, 4, 3], dataset_id="tiny", partitions=4, lanes=4)
    assert_same_batches(order, order.start(), 1, 8, lambda samples: range(50))


def test_a_batch_larger_than_its_lane_reads_every_sample_of_each_lane_epoch_it_spans():
    """Under carry a batch of 8 from lanes of 2-4 samples holds 8 real samples: the lane's epochs in
    turn, each sample once per epoch (a batch of two lane epochs or more read only its last ones)."""
    order = SampleOrder([3, 2, 4, 3], dataset_id="tiny", partitions=4, lanes=4)
    stream = NodeStream(order, order.start(), node=0, num_nodes=1, batch_size=8)
    layout = order.layout
    partition_of_shard = {int(s): p for p, shards in enumerate(layout.partition_shards) for s in shards}
    lane_of = {p: k for k, lane in enumerate(stream.lanes) for p in lane.members}
    every = np.arange(sum([3, 2, 4, 3]))
    lane_of_sample = np.array([lane_of[partition_of_shard[int(s)]] for s in layout.shard_of(every)])
    seen: dict[tuple[int, int], list[int]] = {}  # (lane, epoch) -> ids read
    for pick in range(24):
        micro = stream.read(pick)
        assert micro.mask.all()
        for sample, epoch in zip(micro.sample_ids.tolist(), micro.epochs.tolist()):
            seen.setdefault((int(lane_of_sample[sample]), epoch), []).append(sample)
    complete = [(k, e) for (k, e) in seen if (k, e + 1) in seen]  # lane epochs read to their end
    assert len(complete) >= 8
    for k, e in complete:
        assert sorted(seen[(k, e)]) == every[lane_of_sample == k].tolist(), (k, e)
