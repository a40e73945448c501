"""Specification of the block-group shuffle: groups cut from a window's shards, every window a
bijection, batches drawn from bounded runs of storage, pinned values, cursors that name it."""

import numpy as np
import pytest

from tierflow.order import CursorMismatchError, RankStream, SampleOrder
from tierflow.order.groups import GROUP_FLOOR_CAP, WindowGroups, floor_bytes, group_edges
from tierflow.order.permutation import FeistelPermutation, permute_each

COUNTS = [int(c) for c in np.random.default_rng(7).integers(5, 400, size=48)]
BYTES = [10 * c for c in COUNTS]  # 10 decoded bytes a sample


def grouped(group_bytes=256, seed=3, window_shards=3, partitions=8, counts=COUNTS, decoded=BYTES):
    return SampleOrder(
        counts,
        dataset_id="groups",
        seed=seed,
        partitions=partitions,
        window_shards=window_shards,
        group_bytes=group_bytes,
        decoded_bytes=decoded,
    )


def test_permute_each_is_each_elements_own_feistel_permutation():
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 5000, size=3000)
    sizes[:4] = [1, 2, 3, 1 << 40]
    keys = rng.integers(0, 1 << 63, size=sizes.size).astype(np.uint64)
    positions = (rng.random(sizes.size) * sizes).astype(np.int64)
    want = [FeistelPermutation(int(s), int(k)).at(int(p)) for p, s, k in zip(positions, sizes, keys)]
    assert permute_each(positions, sizes, keys).tolist() == want


def test_small_shards_share_a_group_and_large_ones_are_cut_into_equal_runs():
    counts = np.array([10, 10, 0, 10, 100, 5])
    decoded = np.array([100, 100, 0, 300, 1000, 50])
    # 100 + 100 fit in 350; 300 more does not; 1000 is cut in 3 runs of <= 350 bytes; 50 alone at the end
    assert group_edges(counts, decoded, 350).tolist() == [0, 20, 30, 63, 96, 130, 135]


@pytest.mark.parametrize("group_bytes", [10, 256, 1000, 10**9])
def test_every_window_is_a_permutation_whose_groups_are_runs_of_the_window(group_bytes):
    order = grouped(group_bytes)
    for partition in range(order.partitions):
        windows = order.windows(partition, 1)
        ids = windows.sample_ids(np.arange(windows.size))
        owned = np.concatenate(
            [np.arange(order.layout.shard_offsets[s], order.layout.shard_offsets[s + 1]) for s in windows.shard_order]
        )
        assert np.array_equal(np.sort(ids), np.sort(owned))
    for w in range(windows.num_windows):
        groups = windows._permutation(w)
        assert isinstance(groups, WindowGroups)
        for rank in range(groups.count):  # consecutive offsets of one group: one run of slots
            g = groups.order[rank]
            slots = groups(np.arange(groups.starts[rank], groups.starts[rank + 1]))
            assert np.array_equal(np.sort(slots), np.arange(groups.edges[g], groups.edges[g + 1]))


def test_a_batch_reads_runs_of_at_most_group_bytes_and_a_window_shuffle_does_not():
    counts, decoded = [4000] * 16, [40_000] * 16  # 10 B a sample: 400 samples a 4 KB group

    def runs_per_batch(order):
        stream = RankStream(order, order.start(), batch_size=64)
        spans = []
        for b in range(50):
            ids = np.sort(stream.batch(b).sample_ids)
            spans.append(int(ids[-1] - ids[0]))
        return np.median(spans)

    full = SampleOrder(counts, dataset_id="runs", seed=1, partitions=4, window_shards=2)
    blocks = grouped(4000, seed=1, window_shards=2, partitions=4, counts=counts, decoded=decoded)
    assert runs_per_batch(blocks) < 400 <= 10 * 400 < runs_per_batch(full)


def test_groups_are_read_in_a_shuffled_order_every_epoch():
    order = grouped(256, window_shards=4)
    firsts = [tuple(order.windows(0, epoch)._permutation(0).order.tolist()) for epoch in range(4)]
    assert len(set(firsts)) == 4 and firsts[0] != tuple(sorted(firsts[0]))


def test_golden_first_batches_of_a_grouped_order():
    order = SampleOrder(
        [40] * 12, dataset_id="golden", seed=3, partitions=4, window_shards=2, group_bytes=100, decoded_bytes=[400] * 12
    )
    stream = RankStream(order, order.start(), batch_size=6)
    assert [stream.batch(b).sample_ids.tolist() for b in range(3)] == GOLDEN


GOLDEN = [[335, 331, 337, 333, 330, 334], [52, 53, 57, 56, 58, 54], [260, 261, 267, 265, 269, 263]]


def test_a_grouped_order_names_its_group_size_and_refuses_a_full_window_cursor():
    full = SampleOrder(COUNTS, dataset_id="groups", seed=3, partitions=8, window_shards=3)
    saved = RankStream(full, full.start(), batch_size=5).batch(2).cursor
    assert "group_bytes" not in saved["config"]  # a full-window order's cursors keep their hash
    with pytest.raises(CursorMismatchError, match="group_bytes: cursor None vs order 256"):
        grouped(256).load(saved)
    again = grouped(256)
    assert again.load(RankStream(again, again.start(), batch_size=5).batch(2).cursor).config_hash == again.config_hash


def test_group_bytes_need_decoded_bytes_for_every_shard():
    with pytest.raises(ValueError, match="decoded_bytes for each of the 48 shards"):
        SampleOrder(COUNTS, dataset_id="groups", group_bytes=256, partitions=8)


def test_a_large_shard_is_never_cut_into_runs_smaller_than_its_largest_block():
    counts, decoded = np.array([100]), np.array([1000])
    assert group_edges(counts, decoded, 100).size == 11  # ten runs of 100 bytes
    assert group_edges(counts, decoded, 100, np.array([400])).tolist() == [0, 33, 66, 100]


def test_one_group_at_a_time_equals_every_group_at_once():
    groups = grouped(256).windows(2, 0)._permutation(0)
    whole = groups(np.arange(groups.starts[-1]))
    parts = [groups(np.arange(groups.starts[r], groups.starts[r + 1])) for r in range(groups.count)]
    assert np.array_equal(whole, np.concatenate(parts))


@pytest.mark.slow
def test_evaluating_a_grouped_order_imports_no_masked_arrays():
    """numpy 2.4's np.unique imports numpy.ma on its first call (~15 ms), which every fresh process
    paid inside its first batch; the order's window and group edges are made without it."""
    import subprocess
    import sys

    script = (
        "import sys\nfrom tierflow.order import RankStream, SampleOrder\n"
        "order = SampleOrder([40] * 12, dataset_id='x', seed=3, partitions=4, window_shards=2, group_bytes=100,"
        " decoded_bytes=[400] * 12)\n"
        "stream = RankStream(order, order.start(), batch_size=6)\n"
        "[stream.batch(b) for b in range(40)]\n"
        "assert 'numpy' in sys.modules\nprint('numpy.ma' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_a_group_holds_at_least_group_samples_samples():
    """1 KB samples: 256 KiB groups hold 256, one batch (the stored order shuffled within it); a floor
    of 1,024 samples cuts 1 MiB runs. 8-byte samples: 256 KiB holds 32,768, and the floor changes nothing."""
    large = [group_edges(np.array([10_000]), np.array([10_000 << 10]), 256 << 10, None, floor) for floor in (0, 1024)]
    assert np.diff(large[0]).max() <= 256 and np.diff(large[1]).min() >= 1000  # 40 runs against 10
    small = [group_edges(np.array([1 << 20]), np.array([8 << 20]), 256 << 10, None, floor) for floor in (0, 1024)]
    assert np.array_equal(small[0], small[1]) and small[0].size == 33
    merged = group_edges(np.array([300, 300, 300, 300]), np.array([300 << 10] * 4), 256 << 10, None, 1024)
    assert merged.tolist() == [0, 900, 1200]  # small shards share a group until it holds ~1,024 samples' bytes
    images = group_edges(np.array([60, 60, 60]), np.array([60 * (130 << 10)] * 3), 256 << 10, None, 1024)
    assert images.tolist() == [0, 30, 60, 90, 120, 150, 180]  # 130 KB samples: 4 MiB groups, not 130 MB ones
    assert floor_bytes(1024, 60 * (130 << 10), 60) == GROUP_FLOOR_CAP  # what the decoded-block bound counts too
    assert floor_bytes(1024, 1000 << 10, 1000) == 1 << 20


def test_an_order_without_a_sample_floor_keeps_the_cursor_hash_it_had_before_the_floor():
    """A cursor saved before group_samples existed (4 MiB groups, the default then) resumes that order."""
    old = SampleOrder(
        [1000] * 8,
        dataset_id="x",
        partitions=4,
        group_bytes=4 << 20,
        decoded_bytes=[10 << 20] * 8,
        block_bytes=[1 << 20] * 8,
    )
    assert "group_samples" not in old.config and old.config_hash == "ab268ff562e0832800e2d8e10ef10f63"
    floored = SampleOrder(
        [1000] * 8,
        dataset_id="x",
        partitions=4,
        group_bytes=4 << 20,
        decoded_bytes=[10 << 20] * 8,
        block_bytes=[1 << 20] * 8,
        group_samples=1024,
    )
    with pytest.raises(CursorMismatchError, match="group_samples: cursor None vs order 1024"):
        floored.load(old.start().to_dict())
