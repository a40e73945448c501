"""Specification of the device feed on the CPU (the CUDA path runs in benchmarks/device_feed.py)."""

import warnings

import numpy as np
import pytest
import torch

from tierflow.loader.device_feed import DeviceFeed, PinnedRing

MODES = [
    pytest.param({}, id="inline-zero-copy"),
    pytest.param({"background": True}, id="background-zero-copy"),
    pytest.param({"staged": True}, id="inline-staged"),
    pytest.param({"staged": True, "background": True}, id="background-staged"),
    pytest.param({"background": None}, id="automatic"),
]


def token_batches(count: int, rows: int = 4, length: int = 16, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {
            "input_ids": rng.integers(0, 2**16, (rows, length), dtype=np.uint16),
            "cu_seqlens": np.array([0, 5, length * rows], dtype=np.int32),
            "loss_mask": rng.random((rows, length)) < 0.9,
            "pixels": rng.random((rows, 3), dtype=np.float32),
            "big_ids": rng.integers(2**31, 2**32, (rows,), dtype=np.uint32),
            "step": step,
            "source": f"shard-{step}",
        }
        for step in range(count)
    ]


WIDEN = {"input_ids": torch.int64, "cu_seqlens": torch.int64, "big_ids": torch.int64}


def assert_same_batch(fed: dict, source: dict) -> None:
    assert fed.keys() == source.keys()
    for key, value in source.items():
        if isinstance(value, np.ndarray):
            assert isinstance(fed[key], torch.Tensor), key
            expected_dtype = WIDEN.get(key) or torch.from_numpy(value[:0].astype(value.dtype)).dtype
            assert fed[key].dtype == expected_dtype, key
            assert np.array_equal(fed[key].numpy(), value), key
        else:
            assert fed[key] is value, key


@pytest.mark.parametrize("mode", MODES)
def test_feed_yields_the_source_batches_with_widened_ids(mode):
    source = token_batches(12)
    with DeviceFeed(source, "cpu", depth=2, widen=WIDEN, **mode) as feed:
        fed = list(feed)
    assert len(fed) == len(source)
    for fed_batch, source_batch in zip(fed, source):
        assert_same_batch(fed_batch, source_batch)


def test_unsigned_ids_that_are_not_widened_keep_their_dtype_and_values():
    source = [{"ids": np.array([0, 1, 65535], dtype=np.uint16)}]
    [batch] = list(DeviceFeed(source, "cpu"))
    assert batch["ids"].dtype == torch.uint16
    assert batch["ids"].to(torch.int64).tolist() == [0, 1, 65535]


def test_uint16_ids_widen_to_every_exact_type():
    ids = np.array([0, 7, 40000, 65535], dtype=np.uint16)
    for wide in (torch.int32, torch.int64, torch.float32):
        [batch] = list(DeviceFeed([{"ids": ids}], "cpu", widen={"ids": wide}))
        assert batch["ids"].dtype == wide
        assert batch["ids"].tolist() == [0, 7, 40000, 65535]


def test_cpu_batches_view_the_source_arrays_without_copying():
    source = token_batches(3)
    feed = DeviceFeed(source, "cpu", widen={"input_ids": torch.int64})
    for fed, original in zip(feed, source):
        for key in ("cu_seqlens", "loss_mask", "pixels"):
            assert np.shares_memory(fed[key].numpy(), original[key]), key
    stats = feed.stats()
    assert stats.copies == {"contiguous": 0, "ring": 0, "to_device": 0, "widen": 3}
    assert stats.bytes["widen"] == 3 * source[0]["input_ids"].size * 8
    assert stats.batches == 3


def test_staged_batches_own_their_memory():
    source = token_batches(3)
    for fed, original in zip(DeviceFeed(source, "cpu", staged=True), source):
        for key in ("input_ids", "cu_seqlens", "loss_mask", "pixels"):
            assert not np.shares_memory(fed[key].numpy(), original[key]), key


class ReusedBufferSource:
    """A batcher that refills one array for every batch, as a batch buffer does."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __iter__(self):
        buffer = np.zeros((2, 8), dtype=np.int32)
        for step in range(self.count):
            buffer[...] = step
            yield {"tokens": buffer}


@pytest.mark.parametrize("background", [False, True])
def test_ring_reuse_never_changes_batches_already_yielded(background):
    feed = DeviceFeed(ReusedBufferSource(20), "cpu", depth=2, staged=True, background=background)
    held = list(feed)
    assert [int(b["tokens"].unique().item()) for b in held] == list(range(20))
    assert feed.stats().ring_allocations == feed.depth + 1


def test_zero_copy_cpu_batches_alias_a_source_that_reuses_its_buffer():
    held = list(DeviceFeed(ReusedBufferSource(3), "cpu"))
    assert all(int(b["tokens"].unique().item()) == 2 for b in held)


def test_ring_reuses_a_slot_buffer_and_regrows_it_for_a_larger_shape():
    ring = PinnedRing(slots=2, pin=False)
    small = torch.arange(10, dtype=torch.int32)
    first = ring.stage(0, "ids", small)
    pointer = ring.buffer(0, "ids").data_ptr()
    ring.stage(0, "ids", small + 1)
    assert ring.buffer(0, "ids").data_ptr() == pointer
    assert first.tolist() == (small + 1).tolist()
    large = torch.arange(10_000, dtype=torch.int64).reshape(100, 100)
    staged = ring.stage(0, "ids", large)
    assert staged.shape == (100, 100) and staged.dtype == torch.int64
    assert torch.equal(staged, large)
    assert ring.allocations == 2


def test_growing_shapes_stay_correct_through_the_ring():
    source = [{"ids": np.full((n, n), n, dtype=np.uint16)} for n in (2, 8, 3, 64, 1, 0)]
    fed = list(DeviceFeed(source, "cpu", staged=True, widen={"ids": torch.int64}))
    for batch, original in zip(fed, source):
        assert batch["ids"].shape == original["ids"].shape
        assert np.array_equal(batch["ids"].numpy(), original["ids"])


def test_non_contiguous_reversed_and_read_only_arrays_arrive_intact():
    base = np.arange(60, dtype=np.int32).reshape(6, 10)
    read_only = base.copy()
    read_only.flags.writeable = False
    source = [
        {"strided": base[:, ::2], "reversed": base[::-1], "read_only": read_only, "big_endian": base.astype(">i4")}
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        [batch] = list(DeviceFeed(source, "cpu"))
    for key, value in source[0].items():
        assert np.array_equal(batch[key].numpy(), value), key


@pytest.mark.parametrize("mode", MODES)
def test_a_carried_batch_comes_out_with_its_data_moved_and_its_meta_untouched(mode):
    from tierflow.loader._collate import CarriedBatch

    source = token_batches(6)
    metas = [object() for _ in source]
    with DeviceFeed([CarriedBatch(dict(b), m) for b, m in zip(source, metas)], "cpu", widen=WIDEN, **mode) as feed:
        fed = list(feed)
    assert [b.meta for b in fed] == metas
    for fed_batch, source_batch in zip(fed, source):
        assert_same_batch(fed_batch.data, source_batch)


def test_length_is_the_source_length():
    assert len(DeviceFeed(token_batches(5), "cpu")) == 5


class FailingSource:
    def __iter__(self):
        yield {"x": np.zeros(2)}
        raise OSError("shard-7 is unreadable")


@pytest.mark.parametrize("background", [False, True])
def test_a_source_error_reaches_the_training_loop(background):
    iterator = iter(DeviceFeed(FailingSource(), "cpu", background=background))
    next(iterator)
    with pytest.raises(OSError, match="shard-7"):
        next(iterator)


def test_breaking_out_early_and_closing_stops_the_reader_thread():
    feed = DeviceFeed(token_batches(50), "cpu", depth=2, background=True)
    iterator = iter(feed)
    next(iterator)
    thread = iterator._thread
    feed.close()
    assert not thread.is_alive()
    assert list(iterator) == []


def test_a_new_pass_starts_from_the_beginning_of_a_reiterable_source():
    feed = DeviceFeed(token_batches(4), "cpu", background=True)
    first = [b["step"] for b in feed]
    second = [b["step"] for b in feed]
    assert first == second == [0, 1, 2, 3]


def test_lossy_widening_is_refused_naming_the_key():
    with pytest.raises(ValueError, match="input_ids"):
        list(DeviceFeed([{"input_ids": np.zeros(3, dtype=np.int64)}], "cpu", widen={"input_ids": torch.int32}))
    with pytest.raises(ValueError, match="big_ids"):
        list(DeviceFeed([{"big_ids": np.zeros(3, dtype=np.uint32)}], "cpu", widen={"big_ids": torch.int32}))


def test_a_batch_that_is_not_a_dict_is_refused():
    with pytest.raises(TypeError, match="list"):
        list(DeviceFeed([[np.zeros(2)]], "cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_asking_for_cuda_without_a_gpu_names_the_device():
    with pytest.raises(ValueError, match="cuda"):
        DeviceFeed([], "cuda")


def test_wait_and_copies_are_recorded_in_the_registry():
    feed = DeviceFeed(token_batches(5), "cpu", staged=True, widen=WIDEN, labels={"rank": 0})
    list(feed)
    stats = feed.stats()
    assert stats.batches == 5
    assert stats.wait_s > 0
    assert stats.copies["ring"] == stats.copies["to_device"] == 5 * 5
    snapshot = feed.registry.snapshot()
    stages = {h["labels"]["stage"] for h in snapshot["histograms"]}
    assert {"device_copy", "train_loop"} <= stages
    ring_bytes = [
        c
        for c in snapshot["counters"]
        if c["name"] == "tierflow_feed_copy_bytes_total" and c["labels"]["stage"] == "ring"
    ]
    assert (
        ring_bytes[0]["value"]
        == stats.bytes["ring"]
        == sum(v.nbytes for b in token_batches(5) for v in b.values() if isinstance(v, np.ndarray))
    )


def window_batches(count: int, rows: int = 4, length: int = 32, seed: int = 1) -> list[dict]:
    """Like TokenWindows: input_ids and labels are views of one (rows, length + 1) uint16 buffer."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        buffer = rng.integers(0, 2**16, (rows, length + 1), dtype=np.uint16)
        out.append({"input_ids": buffer[:, :-1], "labels": buffer[:, 1:], "mask": np.ones(rows, dtype=bool)})
    return out


@pytest.mark.parametrize("tensors", [False, True], ids=["numpy", "tensors"])
@pytest.mark.parametrize("mode", MODES)
def test_views_of_one_id_buffer_widen_once_by_value(mode, tensors):
    source = window_batches(6)
    if tensors:  # as batches arrive from a DataLoader worker: tensors viewing one payload
        source = [{key: torch.from_numpy(value) for key, value in batch.items()} for batch in source]
        for batch in source:
            whole = torch.cat([batch["input_ids"], batch["labels"][:, -1:]], dim=1)
            batch["input_ids"], batch["labels"] = whole[:, :-1], whole[:, 1:]
    with DeviceFeed(source, "cpu", depth=2, ids=torch.int64, **mode) as feed:
        fed = list(feed)
        copies = feed.stats().copies["widen"]
    once = not mode.get("staged")  # staged: each key has its own ring slot
    for got, want in zip(fed, source):
        assert got["input_ids"].dtype == got["labels"].dtype == torch.int64
        assert np.array_equal(got["input_ids"].numpy(), np.asarray(want["input_ids"]).astype(np.int64))  # >= 2**15 too
        assert np.array_equal(got["labels"].numpy(), np.asarray(want["labels"]).astype(np.int64))
        assert torch.equal(got["input_ids"][:, 1:], got["labels"][:, :-1])
        if once and tensors:
            assert got["input_ids"].untyped_storage().data_ptr() == got["labels"].untyped_storage().data_ptr()
    assert copies == len(source) * (1 if once else 2)


def test_an_automatic_feed_stays_inline_without_a_step_and_takes_a_thread_with_one():
    import time

    from tierflow.loader.device_feed_readahead import AUTO_DECIDE_AFTER

    source = token_batches(3 * AUTO_DECIDE_AFTER)
    raw = iter(DeviceFeed(source, "cpu"))
    fed = [next(raw)["step"] for _ in range(2 * AUTO_DECIDE_AFTER)]
    assert not raw.background
    stepping = iter(DeviceFeed(source, "cpu"))
    stepped = []
    for batch in stepping:
        stepped.append(batch["step"])
        time.sleep(0.002)
    assert stepping.background
    assert fed == stepped[: len(fed)] and stepped == list(range(len(source)))


def test_an_automatic_feed_is_not_swayed_by_a_fresh_processs_first_slow_batches():
    """A loop with no step spent ~110 us a gap for its first ~15 batches of a fresh process, then
    10-40 us; a median of its first gaps gave it a thread that cost it ~20%."""
    import time

    from tierflow.loader.device_feed_readahead import AUTO_DECIDE_AFTER

    source = token_batches(3 * AUTO_DECIDE_AFTER)
    feed = iter(DeviceFeed(source, "cpu"))
    for n in range(2 * AUTO_DECIDE_AFTER):
        next(feed)
        if n < 16:
            time.sleep(0.0005)
    assert not feed.background


def test_an_automatic_feed_leaves_the_loops_first_slow_gaps_out_of_its_choice():
    import time

    from tierflow.loader.device_feed_readahead import AUTO_DECIDE_AFTER, AUTO_WARMUP_GAPS

    source = token_batches(3 * AUTO_DECIDE_AFTER)
    feed = iter(DeviceFeed(source, "cpu"))
    for n in range(2 * AUTO_DECIDE_AFTER):
        next(feed)
        if n < AUTO_WARMUP_GAPS:
            time.sleep(0.002)  # a loop's first iterations: its first torch calls, its first metrics
    assert not feed.background
