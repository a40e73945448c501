"""Loader: what the training loop iterates; remembers the cursor of the last batch it handed over.

`Loader(TieredDataset(...), device="cuda", num_workers=2)` starts its own worker pool (workers.py:
batches through shared-memory rings) and the device feed (L0); `Loader(DataLoader(ds,
batch_size=None, ...))` reads through torch's DataLoader you made. Batches travel as
`CarriedBatch`es (the user's data, its `BatchMeta` beside it); the loop gets only the data, or
(data, meta) with `return_meta=True`, and `last_meta` is the meta of the batch last handed out.
`state_dict()` holds the cursor of the last batch the loop consumed (committed when the loop asks
for the next batch or saves), so it is right however far workers and the feed ran ahead.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import time
import weakref
from collections import deque
from typing import Any, NamedTuple
from collections.abc import Iterator, Mapping

import torch
from torch.utils.data import DataLoader

from tierflow.loader._collate import CarriedBatch
from tierflow.loader._lifetime import bind_workers, raising_lost_workers
from tierflow.loader.cursor import LoaderCursor
from tierflow.loader.mixture import ReadDataset
from tierflow.loader.device_feed import DeviceFeed
from tierflow.loader.device_feed_readahead import FeedIterator
from tierflow.loader.epochs import EpochClock, EpochVote
from tierflow.loader.meta import BatchMeta
from tierflow.loader.plan import PlannedCursor
from tierflow.storage.datasets import local_path
from tierflow.loader.workers import WorkerPool, start_forkserver
from tierflow.telemetry.attribution import production_timer
from tierflow.telemetry.loader_metrics import FLUSH_AT, LoaderTelemetry
from tierflow.tiers.stager import Stager
from tierflow.errors import BatchOrderError, CursorError, TopologyError

STATE_VERSION = 1
Handed = dict[str, Any] | tuple[dict[str, Any], BatchMeta]
"""What the loop gets per batch: its tensors, or (tensors, meta) with `return_meta=True`."""


_NOT_STAGED = object()
_UNCLOSED: weakref.WeakKeyDictionary[Loader, int] = weakref.WeakKeyDictionary()
"""Loaders alive at interpreter exit (by the pid that made them) are closed before the interpreter
tears its modules down (a script's or notebook's global one was collected after, and its stager's
close met `os` as None); a forked child's exit leaves its parent's alone."""


@atexit.register
def _close_at_exit() -> None:
    for loader, pid in list(_UNCLOSED.items()):
        if pid == os.getpid() and hasattr(loader, "_source"):  # made here, and its __init__ finished
            loader.close()


class Loader:
    """Iterate batches on `device`; `state_dict`/`load_state_dict` (torchdata's Stateful protocol).

    Each `for` is one epoch (loader/epochs.py): `len(loader)` is this rank's batches of the whole
    epoch, `remaining` those not yet consumed; a loop may drain the `for` or stop after `len()`
    batches and call `iter()` again. `epoch_end="agree"` stops every rank at the same step (the
    count computed from the order, no collective), "rank" each at its own edge; `endless=True`
    never stops. Token ids (`input_ids`,
    `labels`) reach the loop as `dtype` (int64; None keeps the wire's uint16/int32). Use it as a
    context manager, or call `close()`, to stop the feed and the workers when a loop ends early
    (they also stop when the Loader is collected, and at interpreter exit).
    """

    def __init__(
        self,
        source: ReadDataset | DataLoader,
        device: str | torch.device | None = None,
        *,
        num_workers: int = 0,
        persistent_workers: bool = False,
        prefetch_factor: int | None = None,
        depth: int = 2,
        widen: Mapping[str, torch.dtype] | None = None,
        background: bool | None = None,
        stager: Stager | None = None,
        telemetry: LoaderTelemetry | bool = True,
        epoch_end: str = "agree",
        endless: bool = False,
        group: Any = None,
        dtype: torch.dtype | None = torch.int64,
        multiprocessing_context: str | None = None,
        return_meta: bool = False,
    ) -> None:
        _UNCLOSED[self] = os.getpid()
        if isinstance(source, DataLoader):
            if not isinstance(source.dataset, ReadDataset):
                raise TypeError(f"Loader wraps a DataLoader over a TieredDataset, not {type(source.dataset).__name__}")
            if source.batch_size is not None:
                raise ValueError(
                    f"{source.dataset!r} batches itself: build the DataLoader with batch_size=None "
                    f"(it has batch_size={source.batch_size})"
                )
            if getattr(source, "in_order", True) is False:
                raise ValueError(
                    f"DataLoader over {source.dataset!r} has in_order=False: batches would arrive out "
                    f"of order and the saved cursor would skip or repeat batches"
                )
            self.dataset: ReadDataset = source.dataset
            self._loader_options = _options_of(source)
            self._wraps_dataloader = True
            self._dataloader: DataLoader | WorkerPool | ReadDataset | None = source
        else:
            self.dataset = source
            self._wraps_dataloader = False
            self._loader_options = {
                "num_workers": num_workers,
                "persistent_workers": persistent_workers and num_workers > 0,
            }
            if prefetch_factor is not None:
                self._loader_options["prefetch_factor"] = prefetch_factor
            remote = any(local_path(where) is None for where in source.locations)
            if multiprocessing_context is None and num_workers > 0 and remote:
                multiprocessing_context = "forkserver"  # obstore clients do not survive a fork: see docs/loader.md
            if multiprocessing_context is not None:
                self._loader_options["multiprocessing_context"] = multiprocessing_context
            self._dataloader = None
        if epoch_end not in ("rank", "agree"):
            hint = " (for the endless stream pass endless=True)" if epoch_end is None else ""
            raise ValueError(f"epoch_end is 'agree' (default) or 'rank', not {epoch_end!r}{hint}")
        self.epoch_end = epoch_end
        self.endless = endless
        # eval runs the same number of steps on every rank and ends by itself: no edge to agree on
        self._clock = None if endless or self.dataset.eval else EpochClock.parse(self.dataset.resumed_epoch)
        self._vote = EpochVote(agree=epoch_end == "agree", group=group)
        self._at_edge = False  # the last `for` finished its epoch by count, the feed reading on
        self.lookahead = 0
        """Batches the training loop's framework fetches ahead of its step (Lightning's fetcher on
        a Loader without len(), accelerate's DataLoaderShard: 1): `state_dict()` is then the state
        of the batch the step trained, not of the last one handed out, until the `for` ends
        (tierflow.integrations sets it)."""
        self._before: deque[_Saved] = deque(maxlen=_KEEP_BEFORE)  # the state before each recent hand-out
        self._drained = True  # the last `for` has ended: the framework holds no batch ahead
        self._restart_eval = False
        self._held: CarriedBatch | None = None
        self._feed_iterator: Iterator[CarriedBatch] | None = None
        self._expected = 0
        self.device = device
        self.stager = stager
        self._staged_from: Any = _NOT_STAGED  # the cursor start_prefetch started the running stager from
        self.depth = depth
        self.dtype = dtype
        self.widen = dict(widen or {})
        # A thread takes batches off the workers' queue (or builds them, without workers) while the step
        # runs, so unpacking and the device copy overlap compute (numpy, torch and sleep release the GIL);
        # None: on CUDA always, on the CPU where the loop's first batches show a step to overlap.
        self.background = background
        self.return_meta = return_meta
        self.last_meta: BatchMeta | None = None
        """The meta of the batch last handed to the training loop."""
        self._planned: LoaderCursor | PlannedCursor | None = self.dataset.cursor
        self._filtered = 0
        self._consumed = 0
        self._feed: DeviceFeed | None = None
        self._source: Iterator[Any] | None = None
        self._iterated = False
        # wait in next(), step time, production latency, prefetch depth, stall attribution (docs/observe.md)
        self.telemetry: LoaderTelemetry | None = (
            LoaderTelemetry() if telemetry is True else telemetry if isinstance(telemetry, LoaderTelemetry) else None
        )

    def _make_dataloader(self) -> DataLoader | WorkerPool | ReadDataset:
        options = self._loader_options
        if self._wraps_dataloader:  # rebuilt with the user's options: its workers hold the old position
            return DataLoader(self.dataset, batch_size=None, **options)
        if options["num_workers"] == 0:
            # it batches itself; the device feed turns its arrays into tensors, and with telemetry times
            # each batch's production (`production_timer`)
            return self.dataset
        # the Loader's own workers: batches through shared-memory rings (loader/workers.py)
        return WorkerPool(
            self.dataset,
            options["num_workers"],
            context=options.get("multiprocessing_context"),
            prefetch_factor=options.get("prefetch_factor"),
            hold=self.depth + 2,
            timed=self.telemetry is not None,
        )

    def __iter__(self) -> Iterator[Handed]:
        """Start (or continue) from the last consumed batch; with `epoch_end`, one epoch per `for`."""
        if self._feed_iterator is not None and self._feed is not None and (self._held is not None or self._at_edge):
            if isinstance(self._feed_iterator, FeedIterator):  # the loop may step otherwise now
                self._feed_iterator.choose_again()
            return self._batches(self._feed_iterator)  # the last `for` stopped at an epoch edge
        self._stop_reading()
        self._check_world()
        if self._restart_eval:  # the last `for` ran the whole eval: this one runs it again
            self._cursor, self._restart_eval, self._iterated = None, False, True
        if not self._stager_carries_on():
            self._close_stager()
        if self._dataloader is None or self._iterated:
            self.dataset.load_state_dict(self._cursor)
            self._dataloader = self._make_dataloader()
        self._iterated = True
        timed = None
        if self.telemetry is not None and self._loader_options["num_workers"] == 0:
            for registry in self.dataset.reading_registries():  # batches are built here: count their readers
                self.telemetry.registry.include(registry, registry)
            timed = production_timer(self.dataset)  # the feed times each batch it builds
        bind_workers(
            self._dataloader
        )  # a DataLoader's workers die with this process, SIGKILL too (loader/_lifetime.py)
        source: Iterator[Any] = iter(self._dataloader)  # forks the workers: no stager thread may run across a fork
        self._source = source
        self.start_prefetch()
        received = (
            raising_lost_workers(source, repr(self.dataset))
            if self._wraps_dataloader and self._loader_options["num_workers"]
            else source
        )
        self._feed = DeviceFeed(
            _Started(received),
            device=self.device,
            depth=self.depth,
            widen=self.widen,
            ids=self.dtype,
            background=self.background,
            timed=timed,
            registry=self.telemetry.registry if self.telemetry is not None else None,
        )
        self._feed_iterator = iter(self._feed)
        return self._batches(self._feed_iterator)

    def _check_world(self) -> None:
        """torch.distributed, initialised since the dataset was made, must agree with its world."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
            position = self.dataset.world  # its node may be another's logical index (open_loader's node affinity)
            if world != position.world_size or rank % position.ranks_per_node != position.local_rank:
                raise TopologyError(
                    f"{self.dataset!r} was made for rank {position.rank} of {position.world_size}, "
                    f"but torch.distributed runs rank {rank} of {world}: make the dataset after "
                    f"init_process_group (or pass world=WorldPosition(...))"
                )

    def _epoch_left(self) -> tuple[int, int] | None:
        """(epoch, batches of it this rank has left) from the consumed cursor; None where the count
        is known only once planned (a token budget: `EpochVote` finds the edge)."""
        clock = self._clock
        if clock is None:
            return None
        try:
            return self.dataset.epoch_span(self._cursor, clock.finished, agree=self.epoch_end == "agree")
        except TypeError:
            return None

    def _stream_left(self) -> int | None:
        """Batches `max_batches` still lets the stream being read give (None: no cap)."""
        limit = self.dataset.max_batches
        if limit is None:
            return None
        return limit - (self._expected if self._feed is not None else 0)

    def _batches(self, batches: Iterator[CarriedBatch]) -> Iterator[Handed]:
        telemetry = self.telemetry
        record, pending = telemetry.recorder() if telemetry is not None else (None, ())
        handed: float | None = None  # set only with telemetry on
        clock = self._clock
        self._at_edge = False
        self._drained = False
        counted = self._epoch_left()
        epoch, left = counted if counted is not None else (None, None)
        stream_left = self._stream_left()
        vote = self._vote if clock is not None and counted is None else None
        if vote is not None:
            vote.begin()
        while True:
            asked = time.perf_counter()
            if left == 0 or stream_left == 0:
                if handed is not None:  # the loop's step after the last batch
                    telemetry.on_step(asked - handed)  # type: ignore[union-attr]
                self._drained = True  # nothing handed ahead of the step any more
                return
            if self._held is not None:
                batch, self._held = self._held, None
            else:
                try:
                    batch = next(batches)
                except StopIteration:
                    if handed is not None:
                        telemetry.on_step(asked - handed)  # type: ignore[union-attr]
                    if vote is not None:
                        vote.stop_here(None, clock)  # type: ignore[arg-type]  # ranks still reading must not wait
                    self._restart_eval = self.dataset.eval
                    self._drained = True
                    return
                if batch.meta.index != self._expected:
                    raise BatchOrderError(
                        f"{self.dataset!r}: got batch {batch.meta.index}, expected "
                        f"{self._expected} (DataLoader in_order=False or a sampler reordering "
                        f"batches?)"
                    )
                self._expected += 1
            meta = batch.meta
            if vote is not None and vote.stop_here(meta.epoch, clock):  # type: ignore[arg-type]
                self._held = batch
                if handed is not None:
                    telemetry.on_step(asked - handed)  # type: ignore[union-attr]
                self._drained = True
                return
            if self.lookahead:
                self._before.append(self._saved())
            self._commit(meta)
            if clock is not None:
                clock.done += 1
            if stream_left is not None:
                stream_left -= 1
            if left is not None:
                left -= 1
                if left == 0:  # the epoch's last batch: the next `for`, or `iter()` now, is the next epoch
                    clock.finish(epoch)  # type: ignore[union-attr,arg-type]
                    self._at_edge = True
            if record is not None:  # clock readings: the wait and the step are taken from them in bulk
                last, handed = handed, time.perf_counter()
                ready = batches.ready  # type: ignore[attr-defined]  # an instance attribute: loaded, then called
                record((asked, handed, last, meta.produce_s, meta.fetch, ready()))
                if len(pending) >= FLUSH_AT:
                    telemetry.flush()  # type: ignore[union-attr]
            yield (batch.data, meta) if self.return_meta else batch.data

    @property
    def drop_last(self) -> bool:
        """A Loader is not a DataLoader to rebuild (accelerate's `skip_first_batches` reads this
        first): it resumes by its own state."""
        raise AttributeError(
            "a tierflow Loader is not rebuilt to skip batches: it resumes exactly from its own state "
            "(loader.load_state_dict(state)); under accelerate register it with "
            "accelerator.register_for_checkpointing(tierflow.integrations.accelerate.ranked(loader)) and "
            "load_state() restores it (docs/frameworks.md)"
        )

    def epoch_lengths(self, epochs: int) -> list[int]:
        """This rank's batches in each of the next `epochs` epochs from where the Loader stands (the
        current epoch whole first), from the order alone: what a framework that sizes its schedule
        by len() (max_steps) needs, since carried remainders make epochs differ by a batch or so."""
        clock = self._clock
        if clock is None:
            raise TypeError("an endless or eval Loader has no epochs to count")
        cursor, finished, done = self._cursor, clock.finished, clock.done
        lengths = []
        for _ in range(epochs):
            epoch, left = self.dataset.epoch_span(cursor, finished, agree=self.epoch_end == "agree")
            lengths.append(done + left)
            cursor, finished, done = self.dataset.cursor_after(cursor, left), epoch, 0
        return lengths

    def __len__(self) -> int:
        """This rank's batches of the epoch the next (or current) `for` finishes, the whole of it
        however many are consumed (`remaining`: those left), capped by `max_batches`; with
        epoch_end="agree" under several ranks, the fewest of any rank; eval: its steps.
        Endless or a token budget: TypeError."""
        if self._clock is None and not self.dataset.eval:
            raise TypeError(
                "an endless Loader (endless=True) has no length; drop endless=True for one epoch "
                "per `for`, or count steps yourself"
            )
        if self._clock is None:  # eval: the steps the next `for` runs
            return self.dataset.epoch_length(None if self._restart_eval else self._cursor)
        return self._clock.done + self.remaining

    @property
    def remaining(self) -> int:
        """Batches of the current epoch this rank has not consumed yet (after a resume mid-epoch,
        what its next `for` yields), capped by `max_batches`."""
        counted = self._epoch_left()
        if counted is None:
            if self._clock is None and self.dataset.eval:
                return len(self)
            self.dataset.epoch_span()  # raises the TypeError that says why there is no count
        left = counted[1]  # type: ignore[index]
        stream_left = self._stream_left()
        return max(0, left if stream_left is None else min(left, stream_left))

    @property
    def _cursor(self) -> LoaderCursor | None:
        """The state after the last consumed batch, computed only when asked (saving, seeking)."""
        planned = self._planned
        return planned.resolve() if isinstance(planned, PlannedCursor) else planned

    @_cursor.setter
    def _cursor(self, cursor: LoaderCursor | None) -> None:
        self._planned = cursor

    def _commit(self, meta: BatchMeta) -> None:
        """The loop has this batch now: its cursor is the state to save (resolved when asked)."""
        self.last_meta = meta
        self._planned = meta.planned
        if meta.metrics is not None and self.telemetry is not None:
            self.telemetry.registry.include(("worker", meta.metrics.pid), meta.metrics.snapshot)
        self._filtered += int(meta.stats.get("filtered", 0))
        self._consumed += 1
        if self.stager is not None:
            self.stager.consumed(meta.planned)  # the stager's thread resolves it when it plans

    def close(self) -> None:
        """Stop the feed, the stager and the workers (a loop that breaks early may call it), and end
        the event log `open_loader(events=...)` opened."""
        self._stop_reading()
        self._close_stager()
        if self.telemetry is not None:
            self.telemetry.close()

    def _close_stager(self) -> None:
        if self.stager is not None:
            self.stager.close()
        self._staged_from = _NOT_STAGED

    def _stop_reading(self) -> None:
        self._held = None
        self._expected = 0
        if self._feed is not None:
            self._feed.close()
            self._feed = None
        shutdown = getattr(self._source, "_shutdown_workers", None) or getattr(self._source, "close", None)
        if shutdown is not None:
            shutdown()
        self._source = None

    def _stager_carries_on(self) -> bool:
        """Whether the stager `start_prefetch` started may stage on through the workers' start: it
        stages from where this iteration begins, and no worker is forked from this process (a
        thread running across a fork can leave the child a lock it never gets back). With
        forkserver or spawn workers (any remote dataset's) it keeps the link busy while they start."""
        if not (self.stager is not None and self.stager.running and self._staged_from is self._cursor):
            return False
        if self._loader_options["num_workers"] == 0:
            return True
        context = self._loader_options.get("multiprocessing_context")
        method = context if context is None or isinstance(context, str) else context.get_start_method()
        return (method or multiprocessing.get_start_method(allow_none=True)) in ("forkserver", "spawn")

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        if hasattr(self, "_source"):
            self.close()

    def start_prefetch(self) -> None:
        """Begin staging the cursor's next window (and starting the workers' forkserver) now, so both
        overlap model loading."""
        if self._loader_options["num_workers"] and not self._wraps_dataloader:
            start_forkserver(self._loader_options.get("multiprocessing_context"))
        if self.stager is not None:
            if not self.stager.running:
                self._staged_from = self._cursor
            self.stager.start(self._cursor)

    def _saved(self) -> _Saved:
        clock = self._clock
        return _Saved(self._planned, self._consumed, self._filtered, clock.to_dict() if clock is not None else None)

    def state_dict(self) -> dict[str, Any]:
        """The cursor after the batch the training loop's step has (the last handed out, or with
        `lookahead` k and the `for` still running the one k before it), plus counts; JSON-able."""
        saved = self._saved()
        if self.lookahead and not self._drained and self._before:
            saved = self._before[-min(self.lookahead, len(self._before))]
        planned = saved.planned
        cursor = planned.resolve() if isinstance(planned, PlannedCursor) else planned
        state = {
            "version": STATE_VERSION,
            "cursor": cursor.to_dict() if cursor is not None else None,
            "consumed": saved.consumed,
            "filtered": saved.filtered,
        }
        if saved.clock is not None:
            state["epoch"] = saved.clock
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Seek to a saved state (O(partitions)); the next iteration starts right after it."""
        if state.get("version") != STATE_VERSION:
            raise CursorError(f"Loader state version {state.get('version')!r}; this tierflow reads {STATE_VERSION}")
        self.close()
        self.dataset.load_state_dict(state["cursor"])
        self._cursor = self.dataset.cursor
        self._restart_eval = False
        if self._clock is not None:
            self._clock = EpochClock.parse(state.get("epoch"))
        self._before.clear()
        self._consumed = int(state.get("consumed", 0))
        self._filtered = int(state.get("filtered", 0))
        self._dataloader = None


class _Saved(NamedTuple):
    """What `state_dict` saves, as it stood before a hand-out (`Loader.lookahead`)."""

    planned: LoaderCursor | PlannedCursor | None
    consumed: int
    filtered: int
    clock: dict[str, Any] | None


_KEEP_BEFORE = 8


class _Started:
    """An already started iterator as an iterable, so the Loader can stop its workers itself."""

    def __init__(self, iterator: Iterator[Any]) -> None:
        self._iterator = iterator

    def __iter__(self) -> Iterator[Any]:
        return self._iterator


def _options_of(dataloader: DataLoader) -> dict[str, Any]:
    """The options needed to rebuild a DataLoader after a seek (persistent workers hold old state)."""
    options: dict[str, Any] = {
        "num_workers": dataloader.num_workers,
        "persistent_workers": dataloader.persistent_workers,
        "pin_memory": dataloader.pin_memory,
        "timeout": dataloader.timeout,
        "multiprocessing_context": dataloader.multiprocessing_context,
        "worker_init_fn": dataloader.worker_init_fn,
    }
    if dataloader.num_workers > 0:
        options["prefetch_factor"] = dataloader.prefetch_factor
    return options
