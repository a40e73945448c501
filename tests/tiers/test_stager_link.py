"""The stager's transfers share the link only among shards needed at the same position: at a window
edge the next window's shards never start while a shard needed before them is still coming in.

Where the source is the bound, a shard needed later that starts beside the one needed next halves
the rate of both, so the next one arrives late (the cold epoch's tail, issue 17). The source here
is the real local dataset whose downloads the test lets through one at a time, in the order they
began; what it asserts is which downloads were in flight together, counted, not timed."""

from __future__ import annotations

import operator
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import tierflow
from tierflow.loader import TieredDataset, BatchSpec, OrderSpec
from tierflow.tiers import TierConfig, build_stack
from tierflow.tiers.stager import Stager

from corpora import pack_lorem


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """13 shards of 256 KB: two lanes with windows of two shards, each window first used apart."""
    return pack_lorem(tmp_path_factory.mktemp("stager-link"), 12000)


class HeldDownloads:
    """The stack's source, each download held until the test lets it through; records, for each
    download when it began, the others in flight."""

    def __init__(self, source: Any) -> None:
        self.source = source
        self.changed = threading.Condition()
        self.in_flight: list[str] = []  # in the order they began
        self.started: list[tuple[str, tuple[str, ...]]] = []
        self.let_through: set[str] = set()
        self.all_through = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.source, name)

    def __reduce__(self) -> Any:  # a spawned worker reads the source itself, unheld
        return operator.itemgetter(0), ([self.source],)

    def download(self, name: str, dst: Any, expected_size: int | None = None, **options: Any) -> int:
        with self.changed:
            self.started.append((name, tuple(self.in_flight)))
            self.in_flight.append(name)
            self.changed.notify_all()
            self.changed.wait_for(lambda: self.all_through or name in self.let_through)
        try:
            return self.source.download(name, dst, expected_size, **options)
        finally:
            with self.changed:
                self.in_flight.remove(name)
                self.changed.notify_all()


def test_the_next_windows_shards_wait_for_the_shard_needed_before_them(shards, tmp_path) -> None:
    stack = build_stack(str(shards), [TierConfig("L2", str(tmp_path / "l2"), 1 << 30)])
    held = HeldDownloads(stack.source)
    stack.source = held
    dataset = TieredDataset(
        stack.dataset(), BatchSpec(batch_size=8, seq_len=64), OrderSpec(partitions=2, window_shards=2)
    )
    names = [s.name for s in dataset.manifest.shards]
    first_use: dict[str, int] = {}
    for use in dataset.future_shard_uses(None, horizon_batches=4000):
        first_use.setdefault(names[use.shard], use.first_use)
    stager = Stager(dataset, stack, min_batches=4)  # two fetch threads
    stager.start()
    try:
        for _ in range(4):  # let four downloads through, the earliest begun first
            with held.changed:
                assert held.changed.wait_for(lambda: held.in_flight, timeout=10), "the stager fetched nothing"
                # a second fetch thread, free, starts its next shard at once unless it waits its turn
                held.changed.wait_for(lambda: len(held.in_flight) > 1, timeout=0.15)
                gone = held.in_flight[0]
                held.let_through.add(gone)
                held.changed.notify_all()
                held.changed.wait_for(lambda gone=gone: gone not in held.in_flight, timeout=10)
    finally:
        with held.changed:
            held.all_through = True
            held.changed.notify_all()
        stager.close()
    begun = [name for name, _ in held.started]
    assert len({first_use[n] for n in begun}) >= 2, f"the downloads {begun} did not reach a second window"
    overtaken = [(name, [o for o in others if first_use[o] < first_use[name]]) for name, others in held.started]
    assert not [o for o in overtaken if o[1]], f"shards began while shards needed before them came in: {overtaken}"
    # and a window's shards, needed together, still come in together
    assert any(others and all(first_use[o] == first_use[name] for o in others) for name, others in held.started)


def test_each_transfer_is_a_stage_record_in_the_event_log_with_its_shard_and_first_use(shards, tmp_path) -> None:
    """Beside the loop's batch records, the stager's say which shard came in when, for which position."""
    from tierflow.telemetry.eventlog import EventLog, read_events

    stack = build_stack(str(shards), [TierConfig("L2", str(tmp_path / "l2"), 1 << 30)])
    dataset = TieredDataset(
        stack.dataset(), BatchSpec(batch_size=8, seq_len=64), OrderSpec(partitions=2, window_shards=2)
    )
    first_use: dict[int, int] = {}
    for use in dataset.future_shard_uses(None, horizon_batches=4000):
        first_use.setdefault(use.shard, use.first_use)
    events = EventLog(tmp_path / "events.jsonl")
    stager = Stager(dataset, stack, min_batches=4, events=events)
    stager.start()
    try:
        for _ in range(1000):  # until four shards are staged (the plan asks for more)
            if stager.m_fetched.value >= 4:
                break
            time.sleep(0.01)
        assert stager.m_fetched.value >= 4
    finally:
        stager.close()
        events.close()
    records = [e for e in read_events(tmp_path / "events.jsonl") if e["kind"] == "stage"]
    assert len(records) >= 4 and len({r["shard"] for r in records}) == len(records)
    names = [s.name for s in dataset.manifest.shards]
    for r in records:
        assert r["name"] == names[r["shard"]] and r["first_use"] == first_use[r["shard"]]
        assert r["served_by"] == "source" and 0 <= r["began"] <= r["t"]
    # the link is handed on when a shard's bytes are in, before it is admitted (the record's t):
    # transfers begin in the order their shards are needed, records may be written out of it
    by_start = sorted(records, key=lambda r: r["began"])
    assert [r["first_use"] for r in by_start] == sorted(r["first_use"] for r in records), by_start


def test_the_next_shard_takes_the_link_while_the_one_before_is_verified_and_admitted(shards, tmp_path) -> None:
    """A shard whose bytes are in is verified, written and admitted off the link: the next shard's
    download begins meanwhile (held here: the first shard's verification waits for it), so a
    throttled source does not idle between transfers (issue 16's cold epoch)."""
    stack = build_stack(str(shards), [TierConfig("L2", str(tmp_path / "l2"), 1 << 30)])
    held = HeldDownloads(stack.source)
    held.all_through = True
    stack.source = held
    tier = stack.tiers[0]
    verify = tier._verify_fetched
    overlapped: list[bool] = []
    verified: list[Any] = []

    def verify_when_the_next_began(tmp: Any, *args: Any) -> None:
        with held.changed:
            verified.append(tmp)
            first = len(verified) == 1
        if first:  # the first shard in: hold its verification until another download begins
            with held.changed:
                overlapped.append(held.changed.wait_for(lambda: len(held.started) >= 2, timeout=10))
        verify(tmp, *args)

    tier._verify_fetched = verify_when_the_next_began
    dataset = TieredDataset(
        stack.dataset(), BatchSpec(batch_size=8, seq_len=64), OrderSpec(partitions=1, window_shards=1)
    )
    stager = Stager(dataset, stack, min_batches=400)  # a lookahead of several shards
    stager.start()
    try:
        with held.changed:
            assert held.changed.wait_for(lambda: len(held.started) >= 2, timeout=20), "one download only"
    finally:
        stager.close()
    assert overlapped == [True], "the next shard's download waited for the one before to be admitted"
    assert stager.m_errors.value == 0


def epoch_batches(shards: Path) -> int:
    from tierflow.loader import Loader

    with Loader(TieredDataset(shards, BatchSpec(batch_size=8, seq_len=64))) as loader:
        return sum(1 for _ in loader)


@pytest.mark.slow
@pytest.mark.parametrize(
    "workers, context",
    [(0, None), pytest.param(1, "forkserver", marks=pytest.mark.slow)],
    ids=["in-process", "forkserver"],
)
def test_a_stager_started_before_the_loop_stages_on_through_the_loops_start(shards, tmp_path, workers, context) -> None:
    """`start_prefetch` (open_loader calls it) begins staging while the model loads; the loop's
    start keeps that stager running where no worker is forked from this process: it used to stop
    it, waiting for the transfer in flight, and start again after the workers, the link idle
    meanwhile (issue 16's cold epoch: ~3 s of a 40 s epoch with forkserver workers)."""
    from tierflow.loader import Loader

    stack = build_stack(str(shards), [TierConfig("L2", str(tmp_path / "l2"), 1 << 30)])
    held = HeldDownloads(stack.source)
    stack.source = held
    dataset = TieredDataset(stack.dataset(), BatchSpec(batch_size=8, seq_len=64))
    stager = Stager(dataset, stack, min_batches=4)
    loader = Loader(dataset, num_workers=workers, stager=stager, multiprocessing_context=context)
    try:
        loader.start_prefetch()
        threads = list(stager._threads)
        with held.changed:
            assert held.changed.wait_for(lambda: held.in_flight, timeout=20), "the stager fetched nothing"
        started = threading.Thread(target=lambda: iter(loader), daemon=True)
        started.start()
        started.join(timeout=60)
        assert not started.is_alive(), "the loop's start waited for the stager's transfer in flight"
        assert stager.running and stager._threads == threads
        with held.changed:
            held.all_through = True
            held.changed.notify_all()
        assert sum(1 for _ in loader) == epoch_batches(shards)
    finally:
        with held.changed:
            held.all_through = True
            held.changed.notify_all()
        loader.close()


@pytest.mark.slow
def test_workers_forked_from_the_loops_process_start_with_the_stager_stopped(shards, tmp_path) -> None:
    """A fork copies the process with its locks as they are: the stager stops before workers are
    forked from the loop's process and starts again after (its threads are new ones)."""
    from tierflow.loader import Loader

    stack = build_stack(str(shards), [TierConfig("L2", str(tmp_path / "l2"), 1 << 30)])
    dataset = TieredDataset(stack.dataset(), BatchSpec(batch_size=8, seq_len=64))
    stager = Stager(dataset, stack, min_batches=4)
    with Loader(dataset, num_workers=1, stager=stager, multiprocessing_context="fork") as loader:
        loader.start_prefetch()
        threads = list(stager._threads)
        batches = iter(loader)
        assert stager.running and not set(stager._threads) & set(threads)
        assert sum(1 for _ in batches) == epoch_batches(shards)


def test_a_dataset_smaller_than_the_widest_working_set_leaves_the_stager_the_tiers_room(
    shards, tmp_path, caplog
) -> None:
    """The working set counts at most the dataset's shards: the widest (16 lanes x windows of 4, 128
    shards) over 13 was counted as 128 of the largest, above any tier of a few shards' room, so the
    stager warned that the tier was too small and kept one shard ahead (issue 16's cold epoch)."""
    caplog.set_level("INFO", logger="tierflow")  # the tier-smaller-than-the-working-set lines are info
    sizes = [s.bytes for s in tierflow.Manifest.load(shards).shards]
    capacity = 4 * sum(sizes)
    stack = build_stack(str(shards), [TierConfig("L2", str(tmp_path / "l2"), capacity, form="at_rest")])
    dataset = TieredDataset(stack.dataset(), BatchSpec(batch_size=8, seq_len=64), OrderSpec(window_shards=4, lanes=16))
    assert dataset.working_set.shards > len(sizes)  # the widest (the default reads a quarter of 13 at once)
    stager = Stager(dataset, stack)
    assert "below the" not in caplog.text and "too small" not in caplog.text and "narrower" not in caplog.text
    assert stager.node.max_bytes == capacity - dataset.working_set.bytes >= 2 * sum(sizes)
