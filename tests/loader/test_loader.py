"""Specification of the loader: token windows, collation, buckets, cursors and exact resume."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import tierflow
from tierflow.loader import (
    BatchOrderError,
    CursorError,
    LengthBuckets,
    Loader,
    TieredDataset,
    TokenBudget,
    WorldPosition,
    bucket_shapes,
    BatchSpec,
    OrderSpec,
)
from tierflow.loader._collate import collate_samples
from tierflow.loader.tokens import (
    WindowStarts,
    document_segments,
    num_windows,
    tokens_outside_windows,
    window_counts,
    window_token_starts,
)

PARTITIONS = 4


@pytest.fixture
def packed(long_tailed_docs) -> str:
    return long_tailed_docs


def take(iterable, n):
    out = []
    for batch in iterable:
        out.append(batch)
        if len(out) == n:
            break
    return out


def meta_of(item):
    """The meta of a dataset's carried batch, or of a Loader's (batch, meta) pair."""
    return item.meta if hasattr(item, "meta") else item[1]


def ids_of(items):
    return [meta_of(item).sample_ids.tolist() for item in items]


# -- token windows --------------------------------------------------------------------------


def test_windows_stay_inside_their_shard_and_the_tails_they_leave_are_counted():
    token_starts = np.array([0, 100, 100, 250, 301])
    counts = window_counts(token_starts, 50)
    assert counts.tolist() == [num_windows(100, 50), 0, num_windows(150, 50), num_windows(51, 50)] == [1, 0, 2, 1]
    starts = window_token_starts(token_starts, 50, np.arange(counts.sum()))
    assert starts.tolist() == [0, 100, 150, 250]
    shard_of = np.searchsorted(token_starts, starts, side="right") - 1
    assert np.all(starts + 50 + 1 <= token_starts[shard_of + 1])  # L + 1 tokens, all in the shard
    assert tokens_outside_windows(token_starts, 50) == (100 - 51) + (150 - 101) + (51 - 51)


def test_document_segments_restart_positions_after_each_eos():
    eos = 9
    inputs = np.array([[1, 2, 9, 3, 4, 9], [5, 9, 9, 6, 7, 8]])
    cu, max_len, positions = document_segments(inputs, eos)
    assert cu.dtype == np.int32 and cu.tolist() == [0, 3, 6, 8, 9, 12]
    assert max_len == 3
    assert positions.tolist() == [[0, 1, 2, 0, 1, 2], [0, 1, 0, 0, 1, 2]]


def _segments_by_definition(inputs, eos):
    """document_segments spelled out: a segment starts at each row start and after each EOS."""
    rows, length = inputs.shape
    flat = inputs.reshape(-1)
    starts = [k for k in range(rows * length) if k % length == 0 or flat[k - 1] == eos]
    cu = np.array(starts + [rows * length], dtype=np.int32)
    positions = np.array([k - max(s for s in starts if s <= k) for k in range(rows * length)], dtype=np.int32)
    return cu, int(np.diff(cu).max()) if cu.size > 1 else 0, positions.reshape(rows, length)


@pytest.mark.parametrize("eos_share", [0.0, 0.02, 0.3, 1.0])
def test_document_segments_match_their_definition_for_few_and_many_documents(eos_share):
    rng = np.random.default_rng(7)
    for _ in range(40):
        rows, length = int(rng.integers(0, 5)), int(rng.integers(1, 70))
        windows = rng.integers(0, 5, (rows, length + 1)).astype(np.uint16)
        windows[rng.random(windows.shape) < eos_share] = 9
        inputs = windows[:, :-1]  # the batch's view of its (B, L + 1) buffer
        cu, max_len, positions = document_segments(inputs, 9)
        want_cu, want_max, want_positions = _segments_by_definition(inputs, 9)
        assert cu.dtype == np.int32 and cu.tolist() == want_cu.tolist()
        assert max_len == want_max
        assert positions.dtype == np.int32 and positions.flags.c_contiguous and positions.flags.writeable
        assert positions.tolist() == want_positions.tolist()


def test_window_token_starts_are_the_same_with_the_tables_made_once():
    token_starts = np.array([0, 100, 100, 250, 301, 301, 700])
    ids = np.arange(int(window_counts(token_starts, 50).sum()))
    assert (
        WindowStarts(token_starts, 50)(ids).tolist()
        == window_token_starts(token_starts, 50, ids).tolist()
        == [0, 100, 150, 250, 301, 351, 401, 451, 501, 551, 601]
    )


def test_token_windows_cover_the_stream_exactly_once_per_epoch(packed):
    length = 64
    ds = TieredDataset(packed, BatchSpec(batch_size=8, seq_len=length), OrderSpec(partitions=PARTITIONS))
    total = int(window_counts(tierflow.open_dataset(packed).token_starts, length).sum())
    assert ds.num_order_samples == total
    seen: dict[int, np.ndarray] = {}
    for batch in ds:
        data = batch.data
        for window, epoch, row in zip(
            batch.meta.sample_ids.tolist(),
            batch.meta.epochs.tolist(),
            np.concatenate([data["input_ids"], data["labels"][:, -1:]], axis=1),
        ):
            if epoch == 0:
                assert window not in seen, f"window {window} twice in epoch 0"
                seen[window] = row
        if len(seen) == total:
            break
    reader = tierflow.open_dataset(packed)
    stream = reader.tokens(0, reader.manifest.num_tokens)
    starts = window_token_starts(tierflow.open_dataset(packed).token_starts, length, np.arange(total))
    for window, begin in enumerate(starts.tolist()):
        assert np.array_equal(seen[window], stream[begin : begin + length + 1])


def test_token_batches_are_narrow_and_labels_are_next_tokens(packed):
    carried = next(iter(TieredDataset(packed, BatchSpec(batch_size=4, seq_len=32), OrderSpec(partitions=PARTITIONS))))
    batch = carried.data
    assert batch["input_ids"].dtype == np.uint16 and batch["labels"].dtype == np.uint16
    assert np.array_equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])
    assert batch["cu_seqlens"].dtype == np.int32 and batch["position_ids"].dtype == np.int32
    assert carried.meta.stats["copied_bytes"] == 4 * 33 * 2


def test_cu_seqlens_match_document_boundaries(packed):
    length = 48
    reader = tierflow.open_dataset(packed)
    doc_ends = np.cumsum([len(reader[i]["tokens"]) for i in range(len(reader))])
    ds = TieredDataset(
        packed, BatchSpec(batch_size=8, seq_len=length), OrderSpec(partitions=PARTITIONS), max_batches=20
    )
    checked = 0
    for carried in ds:
        batch = carried.data
        cu = batch["cu_seqlens"].tolist()
        assert batch["max_seqlen"] == max(np.diff(cu))
        begins = window_token_starts(
            tierflow.open_dataset(packed).token_starts, length, carried.meta.sample_ids
        ).tolist()
        for row, begin in enumerate(begins):
            inside = doc_ends[(doc_ends > begin) & (doc_ends < begin + length)] - begin
            expected = [row * length] + [row * length + int(e) for e in inside]
            got = [c for c in cu if row * length <= c < (row + 1) * length]
            assert got == expected
            positions = batch["position_ids"][row]
            starts = np.array([0] + inside.tolist())
            expect_pos = np.arange(length) - starts[np.searchsorted(starts, np.arange(length), side="right") - 1]
            assert np.array_equal(positions, expect_pos)
            checked += 1
    assert checked == 160


def test_future_shard_uses_list_every_shard_holding_windows_once_per_epoch(packed):
    ds = TieredDataset(packed, BatchSpec(batch_size=8, seq_len=64), OrderSpec(partitions=PARTITIONS))
    uses = ds.future_shard_uses(horizon_batches=2000)
    holding = set(np.flatnonzero(window_counts(tierflow.open_dataset(packed).token_starts, 64)).tolist())
    epoch_zero = [u.shard for u in uses if u.epoch == 0]
    assert sorted(epoch_zero) == sorted(holding)
    owner = ds.order.layout.shard_partition
    assert all(owner[u.shard] == u.partition for u in uses)


# -- samples, collation, projection, transforms, filters --------------------------------------


def test_collation_stacks_equal_shapes_pads_others_and_lists_strings():
    samples = [{"a": np.array([1, 2], np.uint16), "s": "x", "n": 1}, {"a": np.array([3], np.uint16), "s": "y", "n": 2}]
    batch, copied = collate_samples(samples, ["a", "s", "n"], pad=True, pad_value=0)
    assert batch["a"].tolist() == [[1, 2], [3, 0]] and batch["a_lengths"].tolist() == [2, 1]
    assert batch["s"] == ["x", "y"] and batch["n"].tolist() == [1, 2]
    assert copied == 6
    unpadded, _ = collate_samples(samples, ["a"], pad=False)
    assert isinstance(unpadded["a"], list)


def test_columns_projection_reads_only_the_selected_columns(packed):
    ds = TieredDataset(packed, BatchSpec(batch_size=4, columns=["id", "text"]), OrderSpec(partitions=PARTITIONS))
    carried = next(iter(ds))
    assert set(carried.data) == {"id", "text", "mask"}
    assert ds._open().dataset.columns == ["id", "text"]
    reader = tierflow.open_dataset(packed)
    assert carried.data["text"] == [reader[i]["text"] for i in carried.meta.sample_ids.tolist()]


def _keep(sample):
    return sample["id"] % 3 != 0


def _noise(sample, rng):
    return {**sample, "noise": rng.integers(0, 1 << 30)}


def test_filtered_samples_leave_their_batch_and_are_counted_and_transforms_see_each_sample(packed):
    loader = Loader(
        TieredDataset(
            packed,
            BatchSpec(batch_size=6, columns=["id"], transform=_noise, filter=_keep),
            OrderSpec(partitions=PARTITIONS),
        ),
        return_meta=True,
    )
    batches = take(loader, 12)
    assert all(all(i % 3 for i in b["id"].tolist()) for b, _ in batches)
    assert all(b["id"].tolist() == meta.sample_ids.tolist() and len(b["noise"]) == len(b["id"]) for b, meta in batches)
    filtered = sum(meta.stats["filtered"] for _, meta in batches)
    assert filtered > 0 and loader.state_dict()["filtered"] == filtered


def test_eval_mode_reads_every_sample_once_with_a_masked_last_batch(packed):
    n = len(tierflow.open_dataset(packed))
    world = 3
    seen = []
    steps = set()
    for rank in range(world):
        ds = TieredDataset(
            packed,
            BatchSpec(batch_size=64, columns=["id"]),
            OrderSpec(partitions=PARTITIONS),
            eval=True,
            world=WorldPosition(0, 1, rank, world),
        )
        batches = list(DataLoader(ds, batch_size=None))  # a plain DataLoader passes the carried batches on
        steps.add(len(batches))
        for b in batches:
            assert len(b.data["id"]) == 64
            seen.extend(b.meta.sample_ids[b.data["mask"]].tolist())
    assert len(steps) == 1
    assert sorted(seen) == list(range(n))


# -- buckets ---------------------------------------------------------------------------------


def test_bucket_shapes_are_bounded_multiples():
    shapes = bucket_shapes(3000, 64, 6)
    assert len(shapes) <= 6 and all(s % 64 == 0 for s in shapes) and shapes[-1] == 3008
    assert bucket_shapes(200, 64, 8).tolist() == [64, 128, 192, 256]


def test_bucketing_reduces_padding_against_random_batches_within_the_shape_bound(packed):
    def waste(group):
        batcher = LengthBuckets(max_length=2560, pad_to_multiple_of=64, max_shapes=6, group=group)
        ds = TieredDataset(
            packed, BatchSpec(batch_size=16, batcher=batcher), OrderSpec(partitions=PARTITIONS), max_batches=160
        )
        real = padded = 0
        shapes = set()
        for b in ds:
            real += b.meta.stats["real_tokens"]
            padded += b.meta.stats["padded_tokens"]
            shapes.add(b.data["input_ids"].shape[1])
            assert b.data["input_ids"].shape[0] == 16
        assert shapes <= set(batcher.shapes.tolist()) and len(batcher.shapes) <= 6
        return padded / real

    bucketed, random_batches = waste(16), waste(1)
    assert bucketed < 0.5 * random_batches, (bucketed, random_batches)  # padded tokens per real token


def test_a_cursor_inside_a_group_resumes_only_under_its_arrangement(packed):
    loader = Loader(
        TieredDataset(
            packed,
            BatchSpec(batch_size=4, batcher=LengthBuckets(max_length=2560, group=4)),
            OrderSpec(partitions=PARTITIONS),
        )
    )
    take(loader, 6)
    state = loader.state_dict()
    assert state["cursor"]["skip"] == 2
    other_world = TieredDataset(
        packed,
        BatchSpec(batch_size=4, batcher=LengthBuckets(max_length=2560, group=4)),
        OrderSpec(partitions=PARTITIONS),
        world=WorldPosition(0, 1, 0, 2),
    )
    with pytest.raises(CursorError, match="group"):
        other_world.load_state_dict(state)


# -- cursor, Loader, resume ------------------------------------------------------------------


def test_loader_continues_after_load_state_dict_and_after_a_break(packed):
    loader = Loader(
        TieredDataset(packed, BatchSpec(batch_size=8, seq_len=64), OrderSpec(partitions=PARTITIONS)), return_meta=True
    )
    full = take(
        Loader(
            TieredDataset(packed, BatchSpec(batch_size=8, seq_len=64), OrderSpec(partitions=PARTITIONS)),
            return_meta=True,
        ),
        9,
    )
    head = take(loader, 3)
    middle = take(loader, 3)  # a new `for` continues after the last consumed batch
    saved = loader.state_dict()
    take(loader, 2)
    loader.load_state_dict(saved)
    tail = take(loader, 3)
    assert ids_of(full) == ids_of(head + middle + tail)


def test_cursor_is_identical_on_every_rank_and_resumes_a_smaller_world(packed):
    """4 ranks of one node, then 2: the node's batch sequence continues exactly."""

    def rank_ds(rank, ranks, resume=None):
        return TieredDataset(
            packed,
            BatchSpec(batch_size=8, seq_len=64),
            OrderSpec(partitions=PARTITIONS),
            resume=resume,
            world=WorldPosition(0, 1, rank, ranks),
        )

    single = ids_of(take(rank_ds(0, 1), 4 * 5 + 2 * 6))
    four = [take(rank_ds(r, 4), 5) for r in range(4)]
    cursors = {json.dumps(batches[-1].meta.cursor.to_dict(), sort_keys=True) for batches in four}
    assert len(cursors) == 1
    state = four[0][-1].meta.cursor
    two = [take(rank_ds(r, 2, resume=state), 6) for r in range(2)]
    node_sequence = [four[j % 4][j // 4] for j in range(20)] + [two[j % 2][j // 2] for j in range(12)]
    assert ids_of(node_sequence) == single


def test_loader_on_cpu_yields_the_same_batches_as_the_dataloader(packed):
    def make():
        return TieredDataset(
            packed, BatchSpec(batch_size=8, seq_len=64), OrderSpec(partitions=PARTITIONS), max_batches=10
        )

    plain = list(DataLoader(make(), batch_size=None))
    fed = list(Loader(make(), device="cpu", return_meta=True))
    assert len(plain) == len(fed) == 10
    for a, (b, meta) in zip(plain, fed):
        for key in ("input_ids", "labels", "position_ids", "cu_seqlens", "mask"):
            assert np.array_equal(np.asarray(a.data[key]), b[key].numpy())
        assert a.meta.cursor == meta.cursor
    assert plain[0].data["input_ids"].dtype == np.uint16  # the wire format stays narrow
    narrow = next(iter(Loader(make(), device="cpu", dtype=None)))
    assert narrow["input_ids"].dtype == torch.uint16


def test_loader_refuses_dataloaders_that_would_break_exactness(packed):
    ds = TieredDataset(packed, BatchSpec(batch_size=8, seq_len=64), OrderSpec(partitions=PARTITIONS))
    with pytest.raises(ValueError, match="batch_size=None"):
        Loader(DataLoader(ds, batch_size=2))
    with pytest.raises(ValueError, match="in_order=False"):
        Loader(DataLoader(ds, batch_size=None, num_workers=2, in_order=False))


def test_loader_detects_batches_out_of_order(packed):
    class Swapped(DataLoader):
        def __iter__(self):
            it = super().__iter__()
            a, b = next(it), next(it)
            yield b
            yield a

    ds = TieredDataset(packed, BatchSpec(batch_size=8, seq_len=64), OrderSpec(partitions=PARTITIONS), max_batches=4)
    with pytest.raises(BatchOrderError):
        list(Loader(Swapped(ds, batch_size=None)))


def test_loader_is_torchdata_stateful(packed):
    from torchdata.stateful_dataloader import Stateful

    loader = Loader(TieredDataset(packed, BatchSpec(batch_size=8, seq_len=64), OrderSpec(partitions=PARTITIONS)))
    assert isinstance(loader, Stateful)


def test_cursor_from_another_dataset_is_refused(packed):
    ds = TieredDataset(packed, BatchSpec(batch_size=8, seq_len=64), OrderSpec(partitions=PARTITIONS))
    cursor = next(iter(ds)).meta.cursor
    for saved in (cursor, cursor.to_dict()):
        with pytest.raises(CursorError, match="'windows:64' samples .* reads 'windows:32'"):
            TieredDataset(packed, BatchSpec(batch_size=8, seq_len=32), OrderSpec(partitions=PARTITIONS), resume=saved)


# -- the worker boundary, cursors per batch, shard reuse --------------------------------------


@pytest.mark.parametrize("shared_memory_bytes", [1 << 30, 0], ids=["in-message", "shared-memory"])
def test_a_worker_batch_unpickles_into_tensors_with_one_token_storage_and_its_meta(shared_memory_bytes):
    import pickle

    from torch.utils.data._utils.collate import default_convert

    from tierflow.loader._collate import CarriedBatch

    tokens = np.arange(4 * 33, dtype=np.uint16).reshape(4, 33)
    batch = {
        "input_ids": tokens[:, :-1],
        "labels": tokens[:, 1:],
        "position_ids": np.ones((4, 32), np.int32),
        "every_other": np.arange(10)[::2],
        "mask": np.array([True, True, False, True]),
        "max_seqlen": 32,
        "half": torch.ones(3, dtype=torch.bfloat16),
        "text": ["a", "b"],
    }
    meta = {"stands in for": "a BatchMeta", "sample_ids": np.arange(4)}
    sent = default_convert(CarriedBatch(dict(batch), meta, shared_memory_bytes=shared_memory_bytes))
    assert isinstance(sent, CarriedBatch)  # DataLoader's conversion leaves it to cross as one message
    received = pickle.loads(pickle.dumps(sent))
    assert type(received) is CarriedBatch and type(received.data) is dict
    assert list(received.data) == list(batch)
    for name, value in default_convert(batch).items():
        if isinstance(value, torch.Tensor):
            assert received.data[name].dtype == value.dtype and torch.equal(received.data[name], value), name
        else:
            assert received.data[name] == value, name
    tensors = received.data
    assert tensors["input_ids"].untyped_storage().data_ptr() == tensors["labels"].untyped_storage().data_ptr()
    assert received.meta["stands in for"] == "a BatchMeta" and received.meta["sample_ids"].tolist() == [0, 1, 2, 3]


def test_batches_from_workers_equal_batches_built_in_process(packed):
    def batches(workers):
        ds = TieredDataset(packed, BatchSpec(batch_size=4, seq_len=48), OrderSpec(partitions=PARTITIONS), max_batches=6)
        return list(DataLoader(ds, batch_size=None, num_workers=workers))

    for inline, remote in zip(batches(0), batches(2), strict=True):
        assert list(remote.data) == list(inline.data)
        for name, value in inline.data.items():
            if isinstance(value, np.ndarray):
                assert torch.equal(remote.data[name], torch.as_tensor(value)), name
            else:
                assert remote.data[name] == value, name
        assert remote.meta.cursor == inline.meta.cursor and remote.meta.index == inline.meta.index
        assert remote.meta.sample_ids.tolist() == inline.meta.sample_ids.tolist()


def test_workers_cover_every_batch_once_in_order():
    from tierflow.loader.plan import _WorkerView

    for workers in (1, 2, 3):
        owned = []
        for w in range(workers):
            view = _WorkerView(None, 0, w, workers, None)  # type: ignore[arg-type]
            mine = list(itertools.takewhile(lambda n: n < 40, view.own_batches()))
            assert all(view.owns(n) and n % workers == w for n in mine) and mine == sorted(mine)
            assert [n for n in range(40) if view.owns(n)] == mine
            owned += mine
        assert sorted(owned) == list(range(40)), workers


def _reference_cursor_after(order, base, index, *, batch_size, num_nodes, ranks_per_node):
    """The cursor after batch `index` from a fresh stream (its seek path), node by node."""
    from tierflow.order.stream import NodeStream

    epochs, offsets = list(base.epochs), list(base.offsets)
    for node in range(num_nodes):
        stream = NodeStream(order, base, node=node, num_nodes=num_nodes, batch_size=batch_size)
        picks = (index + 1) * ranks_per_node
        if stream.edges is not None:  # the epoch-major edge: each lane's clock, its positions from the cursor's
            positions = {}
            for lane, (epoch, offset) in enumerate(stream.edges.clocks_after(picks)):
                walked = stream.edges.walk_index(lane, epoch, offset)
                positions.update(stream.lanes[lane].advance(stream._bases[lane], walked))
        else:
            counts = stream.schedule.counts_after(picks)
            positions = {p: eo for lane, count in zip(stream._count_at, counts) for p, eo in lane.before(count).items()}
        for p, (e, o) in positions.items():
            epochs[p], offsets[p] = e, o
    return order.cursor(epochs, offsets)


@pytest.mark.parametrize("remainder", ["carry", "drop", "pad"])
@pytest.mark.parametrize("partitions,num_nodes,ranks_per_node", [(16, 1, 1), (16, 4, 2), (8, 2, 3)])
def test_rank_stream_cursor_after_walked_forward_equals_the_closed_form(
    remainder, partitions, num_nodes, ranks_per_node
):
    from tierflow.order import RankStream, SampleOrder

    counts = np.random.default_rng(partitions + num_nodes).integers(0, 90, 60).tolist()
    order = SampleOrder(counts, dataset_id="cursor-spec", seed=5, partitions=partitions, lanes=3, remainder=remainder)
    node, rank = num_nodes - 1, ranks_per_node - 1
    start = RankStream(
        order, order.start(), batch_size=4, node=node, num_nodes=num_nodes, rank=rank, ranks_per_node=ranks_per_node
    ).cursor_after(22)
    for base in (order.start(), start):
        stream = RankStream(
            order, base, batch_size=4, node=node, num_nodes=num_nodes, rank=rank, ranks_per_node=ranks_per_node
        )
        for index in [*range(40), 517, 4099]:
            assert stream.cursor_after(index) == _reference_cursor_after(
                order, base, index, batch_size=4, num_nodes=num_nodes, ranks_per_node=ranks_per_node
            )


@pytest.fixture(scope="module")
def many_shards(tmp_path_factory) -> dict[str, str]:
    """The same small documents packed into a dozen-odd shards, zstd at rest and uncompressed."""
    root = tmp_path_factory.mktemp("many_shards")
    with open(root / "docs.jsonl", "w") as f:
        for i in range(6000):
            f.write(json.dumps({"id": i, "text": f"document {i} " * 40}) + "\n")
    out = {}
    for compression in ("zstd", "none"):
        out[compression] = str(root / compression)
        tierflow.pack(
            [root / "docs.jsonl"], out[compression], workers=1, target_shard_bytes=256 << 10, compression=compression
        )
    return out


@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_directory_source_opens_each_shard_once_however_often_the_order_revisits_it(many_shards, compression):
    from tierflow.format.reader import DirectoryBlocks, ShardReader

    dataset = tierflow.open_dataset(many_shards[compression])
    assert isinstance(dataset.source, ShardReader) and isinstance(dataset.source.blocks, DirectoryBlocks)
    shards = len(dataset.manifest.shards)
    assert shards > 8  # more than the old LRU of 8 shards held
    for _ in range(3):
        for s in range(shards):
            dataset.shard(s)
    assert dataset.source.opens == shards


def test_directory_source_bounds_decoded_shards_by_bytes_and_still_serves_every_row(many_shards):
    from tierflow.format.dataset import Dataset
    from tierflow.format.reader import DirectoryBlocks, ShardReader

    root = many_shards["zstd"]
    manifest = tierflow.Manifest.load(root)
    source = ShardReader(DirectoryBlocks(root), max_decoded_bytes=1)
    bounded = Dataset(manifest, source, location=root)
    every_seventh = list(range(0, len(bounded), 7))
    for _ in range(2):
        assert [bounded[i]["id"] for i in every_seventh] == every_seventh
    assert len(source.cache) == 1  # decoded blocks held, bounded by bytes across shards
    starts = np.cumsum([0] + [b.rows for s in manifest.shards for b in s.blocks])
    touched = sum(1 for a, b in zip(starts[:-1], starts[1:]) if -(-a // 7) * 7 < b)
    assert source.blocks_read == 2 * touched  # evicted blocks are read, verified and decoded again


def test_a_reading_process_holds_the_decoded_blocks_of_its_windows_not_of_the_dataset(many_shards):
    """The decoded-block cache of each reading process is bounded by what its order reads at once
    (one window per lane), not by a 1 GiB default that let every process hold the whole dataset;
    an epoch still decodes each block about once."""
    root = many_shards["zstd"]
    ds = TieredDataset(root, BatchSpec(batch_size=16), OrderSpec(seed=3, window_shards=2, lanes=1, group_bytes=0))
    manifest = ds.manifest
    decoded = sum(s.decoded_bytes for s in manifest.shards)
    assert ds.working_set.reading == 2 and ds.decoded_bound() < decoded / 3
    seen, peak = 0, 0
    for batch in ds:
        cache = ds._open().dataset.source.cache
        assert cache.max_bytes == ds.decoded_bound()
        peak = max(peak, cache.bytes)
        seen += len(batch.meta.sample_ids)
        if seen >= ds.num_order_samples:
            break
    assert 0 < peak <= ds.decoded_bound()
    blocks = sum(len(s.blocks) for s in manifest.shards)
    assert ds._open().dataset.source.blocks_read <= 1.1 * blocks


def _widest_default(monkeypatch):
    """The default breadth as wide as 16 lanes x windows of 4 over a small dataset (it reads at most a
    quarter of the node's shards at once otherwise: order/working_set.py), as these tests were written."""
    from tierflow.order import working_set

    monkeypatch.setattr(working_set, "READING_SHARE", 1)


def test_with_block_groups_a_reading_process_holds_a_group_per_lane_and_decodes_each_block_about_once(
    many_shards, monkeypatch
):
    _widest_default(monkeypatch)
    root = many_shards["zstd"]
    wide = TieredDataset(root, BatchSpec(batch_size=16), OrderSpec(seed=3, group_bytes=0))
    ds = TieredDataset(root, BatchSpec(batch_size=16), OrderSpec(seed=3, group_bytes=1 << 16))
    decoded = sum(s.decoded_bytes for s in ds.manifest.shards)
    # 13 shards, fewer than one window per lane reads at once: either way a process may hold them all,
    # and never more (a bound of windows x the mean shard came to 2.5x the dataset)
    assert ds.decoded_bound() <= wide.decoded_bound() == decoded
    seen, peak = 0, 0
    for batch in ds:
        peak = max(peak, ds._open().dataset.source.cache.bytes)
        seen += len(batch.meta.sample_ids)
        if seen >= ds.num_order_samples:
            break
    assert 0 < peak <= ds.decoded_bound()
    blocks = sum(len(s.blocks) for s in ds.manifest.shards)
    assert ds._open().dataset.source.blocks_read <= 1.1 * blocks


def test_a_narrowed_first_epoch_holds_fewer_decoded_blocks_and_widens_with_the_next_epoch(many_shards, monkeypatch):
    """Epoch 0 reads its lanes a group at a time (order.first_epoch), so a reading process holds that
    epoch's blocks, not the widest epoch's; the bound widens at the first batch of epoch 1, and epoch 0
    still decodes each block about once."""
    _widest_default(monkeypatch)
    ds = TieredDataset(many_shards["zstd"], BatchSpec(batch_size=16), OrderSpec(seed=3, group_bytes=1 << 16))
    assert ds.order.first_epoch is not None
    narrow, wide = ds.decoded_bound(0), ds.decoded_bound()
    assert 0 < narrow < wide
    source = ds._open().dataset.source
    seen, peak, epochs = 0, 0, []
    for batch in ds:
        epoch = batch.meta.epoch
        assert source.cache.max_bytes == (narrow if epoch == 0 else wide)
        if epoch == 0:
            peak = max(peak, source.cache.bytes)
            read_in_epoch_0 = source.blocks_read
        elif epochs[-1] == 0:
            cursor = ds.stream().cursor(batch.meta.index).to_dict()  # after the first batch of epoch 1
        epochs.append(epoch)
        seen += len(batch.meta.sample_ids)
        if seen >= 2 * ds.num_order_samples:
            break
    assert epochs[0] == 0 and epochs[-1] == 1
    assert 0 < peak <= narrow
    blocks = sum(len(s.blocks) for s in ds.manifest.shards)
    assert read_in_epoch_0 <= 1.1 * blocks
    resumed = TieredDataset(
        many_shards["zstd"], BatchSpec(batch_size=16), OrderSpec(seed=3, group_bytes=1 << 16), resume=cursor
    )
    first = next(iter(resumed))
    assert first.meta.epoch == 1 and resumed._open().dataset.source.cache.max_bytes == wide


def test_epoch_0s_bound_counts_mean_shards_and_the_two_largest_not_the_largest_shards(tmp_path):
    """A few shards far larger than the rest (long documents) no longer count as if each of epoch 0's
    lanes read one like them: the bound is that many mean shards plus room for the two largest, and
    epoch 0 still decodes each block about once (with room for the largest alone it read 3x the blocks)."""
    from tierflow.loader.dataset import shard_column
    from tierflow.order.working_set import working_set_bytes

    rng = np.random.default_rng(5)
    with open(tmp_path / "docs.jsonl", "w") as f:
        for i in range(4000):
            n = 1_500_000 if i % 1000 == 500 else int(rng.integers(1500, 3500))
            f.write(json.dumps({"id": i, "text": "ab" * (n // 2)}) + "\n")
    tierflow.pack(
        [tmp_path / "docs.jsonl"], tmp_path / "ds", tokenizer="bytes", workers=1, target_shard_bytes=256 << 10
    )
    ds = TieredDataset(tmp_path / "ds", BatchSpec(batch_size=8, seq_len=2048), OrderSpec(seed=3))
    assert ds.order.first_epoch is not None
    sizes = shard_column(ds.manifest, "decoded_bytes")
    shards = min(ds.working_set.lanes, 2 * ds.order.first_epoch[0]) * ds.order.first_epoch[1]
    assert np.max(sizes) > 5 * np.mean(sizes)
    assert (
        ds.decoded_bound(0) <= shards * np.mean(sizes) + working_set_bytes(1, sizes) < working_set_bytes(shards, sizes)
    )
    source = ds._open().dataset.source
    for batch in ds:
        if batch.meta.epoch > 0:
            break
        assert source.cache.bytes <= ds.decoded_bound(0)
        read_in_epoch_0 = source.blocks_read
    assert read_in_epoch_0 <= 1.1 * sum(len(s.blocks) for s in ds.manifest.shards)


# -- token budget ----------------------------------------------------------------------------


def budget_ds(packed, resume=None, max_tokens=1024, rank=0, ranks=1, **kw):
    return TieredDataset(
        packed,
        BatchSpec(batch_size=16, batcher=TokenBudget(max_tokens, **kw)),
        OrderSpec(partitions=PARTITIONS),
        resume=resume,
        world=WorldPosition(0, 1, rank, ranks),
    )


def test_token_budget_batches_hold_whole_samples_within_the_budget(packed):
    ds = tierflow.open_dataset(packed)
    batches = take(budget_ds(packed), 40)
    fills = []
    for carried in batches:
        batch = carried.data
        cu = batch["cu_seqlens"]
        assert cu[0] == 0 and cu[-1] == 1024 and batch["input_ids"].shape == (1, 1024)
        real = int(batch["lengths"].sum())
        assert real <= 1024
        fills.append(real / 1024)
        for k, sample in enumerate(carried.meta.sample_ids.tolist()):
            begin, end = int(cu[k]), int(cu[k + 1])
            tokens = ds[sample]["tokens"][:1024]
            assert np.array_equal(batch["input_ids"][0, begin:end], tokens)
            assert np.array_equal(batch["labels"][0, begin : end - 1], tokens[1:])
            assert batch["labels"][0, end - 1] == -100
            assert np.array_equal(batch["position_ids"][0, begin:end], np.arange(end - begin))
        assert (batch["labels"][0, real:] == -100).all()
    assert np.median(fills) > 0.9  # first-fit from the buffer packs tightly


@pytest.mark.slow
def test_token_budget_reads_each_sample_once_per_epoch_on_every_rank_split(packed):
    samples = len(tierflow.open_dataset(packed))
    for ranks in (1, 2):
        seen = []
        for rank in range(ranks):
            for batch in take(budget_ds(packed, max_tokens=4096, rank=rank, ranks=ranks), 400 // ranks):
                seen += list(zip(batch.meta.epochs.tolist(), batch.meta.sample_ids.tolist()))
        assert len(seen) == len(set(seen))  # nothing twice
        assert {i for e, i in seen if e == 0} == set(range(samples))  # epoch 0 complete


def test_token_budget_cursor_resumes_only_its_own_rank(packed):
    state = take(budget_ds(packed, rank=1, ranks=2), 3)[-1].meta.cursor.to_dict()
    assert state["pending"]["ids"]  # the buffer is carried, not dropped
    with pytest.raises(CursorError, match="rank 1"):
        budget_ds(packed, resume=state, rank=0, ranks=2)
    with pytest.raises(CursorError, match="pending"):
        TieredDataset(
            packed,
            BatchSpec(batch_size=16),
            OrderSpec(partitions=PARTITIONS),
            resume=state,
            world=WorldPosition(0, 1, 1, 2),
        )
    torn = {**state, "pending": {"ids": state["pending"]["ids"] + [10**9], "epochs": state["pending"]["epochs"] + [0]}}
    with pytest.raises(CursorError, match="pending samples are not"):
        budget_ds(packed, resume=torn, rank=1, ranks=2)


def test_budget_planner_takes_the_oldest_first_and_fills_gaps_first_fit():
    planner = TokenBudget(10, lookahead=1).planner()
    planner.add(np.arange(6), np.zeros(6, np.int64), np.array([6, 5, 3, 1, 12, 2]))
    assert planner.take()[0].tolist() == [0, 2, 3]  # 6 + 3 + 1; 5 does not fit after 6
    assert planner.take()[0].tolist() == [1, 5]  # the oldest (5) leads, 2 fills
    assert planner.take()[0].tolist() == [4]  # 12 truncated to the budget
    assert planner.ids.size == 0


# -- epochs one `for` at a time --------------------------------------------------------------


@pytest.mark.slow
def test_epoch_end_ends_each_for_at_the_epoch_edge_and_skips_nothing(packed):
    loader = Loader(budget_ds(packed, max_tokens=8192), epoch_end="rank", return_meta=True)
    endless = take(Loader(budget_ds(packed, max_tokens=8192), endless=True, return_meta=True), 10**6 // 8192 * 2)
    first, second = list(loader), list(loader)
    assert {m.epoch for _, m in first} == {0} and {m.epoch for _, m in second} == {1}
    assert ids_of(first + second) == ids_of(endless[: len(first) + len(second)])

    def of_epoch(batches, epoch):
        return sorted(i for _, m in batches for e, i in zip(m.epochs.tolist(), m.sample_ids.tolist()) if e == epoch)

    # partitions reach their epoch ends at different steps, so the edge batch may hold epoch-1 samples too
    assert of_epoch(first, 0) == list(range(len(tierflow.open_dataset(packed)))) and not of_epoch(second, 0)


def test_a_seek_elsewhere_reads_the_group_sought_not_the_one_last_sorted(packed):
    def make():
        return TieredDataset(
            packed,
            BatchSpec(batch_size=4, batcher=LengthBuckets(max_length=2560, group=4)),
            OrderSpec(partitions=PARTITIONS),
        )

    full = take(Loader(make(), return_meta=True), 14)
    state = Loader(make())
    take(state, 10)
    loader = Loader(make(), return_meta=True)
    take(loader, 1)  # sorts the first group of its own stream
    loader.load_state_dict(state.state_dict())
    assert ids_of(take(loader, 4)) == ids_of(full[10:])


def test_the_loop_gets_only_its_tensors_and_the_meta_when_it_asks(packed):
    def make():
        return TieredDataset(packed, BatchSpec(batch_size=8, seq_len=64), OrderSpec(partitions=PARTITIONS))

    with Loader(make()) as loader:
        batch = next(iter(loader))
        assert set(batch) == {"input_ids", "labels", "position_ids", "cu_seqlens", "max_seqlen", "mask"}
        meta = loader.last_meta
        assert meta.index == 0 and meta.epoch == 0 and meta.sample_ids.size == 8
        assert meta.cursor.to_dict() == loader.state_dict()["cursor"]
    assert loader._feed is None  # leaving the block closed it
    with Loader(make(), return_meta=True) as loader:
        pairs = take(loader, 2)
    assert [m.index for _, m in pairs] == [0, 1] and pairs[1][1] is loader.last_meta
    assert torch.equal(pairs[0][0]["input_ids"], batch["input_ids"])


@pytest.mark.parametrize("dtype", [torch.int64, None], ids=["int64 ids", "wire ids"])
def test_token_batches_reach_the_loop_identical_and_in_the_same_dtypes_at_0_and_2_workers(packed, dtype):
    # position_ids (int32, values below L) cross the worker boundary as uint16 and are widened back:
    # the loop gets int32 at 2 workers as at 0, and the same values, batch for batch
    def handed(workers):
        ds = TieredDataset(
            packed, BatchSpec(batch_size=4, seq_len=512), OrderSpec(partitions=PARTITIONS), max_batches=6
        )
        with Loader(ds, num_workers=workers, dtype=dtype) as loader:
            return [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in b.items()} for b in loader]

    inline, remote = handed(0), handed(2)
    assert len(inline) == len(remote) == 6
    assert any(b["cu_seqlens"].numel() > 5 for b in inline)  # documents end inside windows: real segments
    for a, b in zip(inline, remote):
        assert list(a) == list(b)
        for name, value in a.items():
            if isinstance(value, torch.Tensor):
                assert b[name].dtype == value.dtype and torch.equal(b[name], value), name
            else:
                assert b[name] == value, name
        assert a["position_ids"].dtype == torch.int32 and a["cu_seqlens"].dtype == torch.int32
        assert a["input_ids"].dtype == (dtype or torch.uint16)


def test_integer_arrays_travel_narrow_and_arrive_in_their_own_dtype_and_values():
    import pickle

    from tierflow.loader._collate import NARROW_MIN_ELEMENTS, CarriedBatch, wire_dtype

    n = NARROW_MIN_ELEMENTS
    batch = {
        "positions": np.arange(4 * n, dtype=np.int32) % 65536,  # fits uint16
        "signed": np.arange(n, dtype=np.int64) - 3,  # fits int16
        "wide": np.arange(n, dtype=np.int64) << 33,  # fits nothing narrower
        "tiny": np.arange(10, dtype=np.int32),  # too small to be checked
        "strided": (np.arange(4 * n, dtype=np.int32) % 200)[::2],  # a view: its whole buffer travels as it is
        "unsigned": np.full(n, 2**32 - 1, dtype=np.uint64),
    }
    assert wire_dtype(batch["positions"]) == np.uint16 and wire_dtype(batch["signed"]) == np.int16
    assert wire_dtype(batch["wide"]) is None and wire_dtype(batch["tiny"]) is None
    message = pickle.dumps(CarriedBatch(dict(batch), None))
    narrow = 4 * n * 2 + n * 2 + n * 8 + 40 + 4 * n * 4 + n * 4  # uint16, int16, as is, as is, its buffer, uint32
    assert narrow < len(message) < narrow + 2048
    received = pickle.loads(message).data
    for name, value in batch.items():
        assert received[name].dtype == torch.from_numpy(np.ascontiguousarray(value)).dtype, name
        assert received[name].numpy().tolist() == value.tolist(), name
    received["positions"][0] = 7  # the loop's tensors are writable
    assert int(received["positions"][0]) == 7
