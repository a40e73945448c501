"""Planning batches: which samples each output batch holds, and the cursor once it is consumed.

A batcher has two halves. `plan(ctx, stream, state)` walks the rank's order stream from a cursor
and yields one `Selection` per output batch this worker builds (the stream's `ownership`: under
DataLoader worker w of W builds the batches n = w (mod W), the order its in-order round robin takes
them in; the Loader's pool deals them by lane, ownership.py); planning
reads no sample data, at most lengths, so a plan that must see every batch (a token budget) can
run whole in every worker. `build(ctx, selection)` reads and assembles one of them. The stream
is train (`TrainStream` over `RankStream`) or eval (`EvalStream` over `EvalOrder`); a batcher
that maps order batches to output batches by position plans both with `plan_groups`. A batch's
cursor is planned, not computed (`PlannedCursor`): only the last consumed batch's is ever needed.
"""

from __future__ import annotations

import hashlib
import json
import threading
from typing import Any, NamedTuple, Protocol
from collections.abc import Iterator, Mapping

import numpy as np

from tierflow.errors import CursorError
from tierflow.loader.cursor import Arrangement, LoaderCursor, Pending
from tierflow.loader.ownership import Ownership, RoundRobin
from tierflow.order import EvalOrder, MixedCursor, MixedRankStream, OrderCursor, RankStream, Remainder


class OrderBatch(NamedTuple):
    """One order batch: global sample ids, their epochs, False on padding repeats (read-only arrays
    the stream may share between batches); in a mixture the dataset they are ids of; the batch's
    epoch: the mixture's in a mixture, else its oldest real sample's (None: `batch_epoch` of them)."""

    sample_ids: np.ndarray
    epochs: np.ndarray
    mask: np.ndarray
    dataset: int = 0
    epoch: int | None = None
    split: bool = False
    """Whether its samples of later epochs than `epoch` belong to those epochs (the epoch-major edge's
    last batch of an epoch): a group sorted epoch-major (`SortedGroups`) gives each part its own."""


class PlannedCursor:
    """The loader's state once a planned batch is consumed, computed only when asked: order batches
    0..`last` of the stream consumed (-1: none), with the batcher's `skip` or `pending`.

    `resolve()` computes it once (O(partitions)) against the stream that planned it. Only the last
    consumed batch's cursor is ever needed, so planning never pays for it. Pickled (a DataLoader
    worker's batch on its way to the main process) it is resolved first and travels as the
    cursor, unless the stream is `compact`: then it travels as (last, skip, pending, base), a few
    integers and the fingerprint of the stream's start, never the stream, and the receiving
    process resolves it with `resolve(stream)` against a stream from the same start
    (`TieredDataset.resolve_cursor` does)."""

    __slots__ = ("last", "skip", "pending", "_stream", "_base", "_cursor")

    def __init__(self, stream: OrderStream | None, last: int, skip: int = 0, pending: Pending | None = None) -> None:
        self._stream = stream
        self.last = last
        self.skip = skip
        self.pending = pending
        self._base: str | None = None
        self._cursor: LoaderCursor | None = None

    @property
    def resolved(self) -> bool:
        return self._cursor is not None

    @property
    def base(self) -> str:
        """The fingerprint of the start of the stream that planned it (`stream_key`)."""
        if self._base is None:
            assert self._stream is not None
            self._base = stream_key(self._stream)
        return self._base

    def resolve(self, stream: OrderStream | None = None) -> LoaderCursor:
        """The cursor (computed on the first call; any thread may ask). `stream`: where an unpickled
        compact one is resolved, a stream from the same start as the one that planned it."""
        bound = self._stream  # read before the cursor: a resolve elsewhere sets the cursor, then drops the stream
        cursor = self._cursor
        if cursor is not None:
            return cursor
        if bound is None:
            if stream is None:
                raise CursorError(
                    "this batch's cursor travelled unresolved (a compact stream's): resolve it "
                    "against a stream from the same start, e.g. TieredDataset.resolve_cursor"
                )
            if stream_key(stream) != self._base:
                raise CursorError(
                    "this batch was planned from another start than the stream asked to "
                    "resolve its cursor (the dataset was resumed elsewhere since)"
                )
            bound = stream
        cursor = self._cursor = bound.cursor(self.last, skip=self.skip, pending=self.pending)
        self._stream = None  # a resolved cursor holds nothing of the stream
        return cursor

    def bind(self, stream: OrderStream) -> None:
        """Resolve a compact cursor that travelled here against `stream` (from the same start as the
        one that planned it) when it is asked for, in any thread."""
        if self._cursor is None and self._stream is None:
            if stream_key(stream) != self._base:
                raise CursorError(
                    "this batch was planned from another start than the stream it is bound to "
                    "(the dataset was resumed elsewhere since)"
                )
            self._stream = stream

    def __reduce__(self) -> tuple[Any, ...]:
        if self._cursor is None and self._stream is not None and getattr(self._stream, "compact", False):
            return _planned, (self.last, self.skip, self.pending, self.base)
        return _resolved_cursor, (self.resolve(),)

    def __repr__(self) -> str:
        state = "resolved" if self._cursor is not None else "unresolved"
        return f"PlannedCursor(last={self.last}, skip={self.skip}, pending={self.pending is not None}, {state})"


def _planned(last: int, skip: int, pending: Pending | None, base: str) -> PlannedCursor:
    planned = PlannedCursor(None, last, skip, pending)
    planned._base = base
    return planned


def _resolved_cursor(cursor: LoaderCursor) -> PlannedCursor:
    planned = PlannedCursor(None, -1)
    planned._cursor = cursor
    return planned


def stream_key(stream: OrderStream) -> str:
    """A fingerprint of what a stream's cursors depend on: its start, arrangement and rank (the
    same in every DataLoader worker and in the main process of one iteration)."""
    key = getattr(stream, "_key", None)
    if key is None:
        start = stream.start_state()
        text = json.dumps([start, stream.arrangement.to_dict(), stream.rank], sort_keys=True, default=str)
        key = hashlib.sha256(text.encode()).hexdigest()[:24]
        try:
            stream._key = key  # type: ignore[attr-defined]
        except AttributeError:
            pass
    return key


def resolve_cursor(cursor: LoaderCursor | PlannedCursor, stream: OrderStream | None = None) -> LoaderCursor:
    """The `LoaderCursor` of a planned or already resolved cursor (`PlannedCursor.resolve`)."""
    return cursor if isinstance(cursor, LoaderCursor) else cursor.resolve(stream)


class Selection:
    """Output batch `index` (counted from the cursor the plan started at): the samples it is built
    from, the loader's state once it is consumed (`cursor`, computed on first use from `planned`),
    and the epoch it belongs to. For a batcher that cuts one order batch into several
    (`LengthBuckets`), the samples are the whole order batch's (the same array for each of its
    parts) and `part` says which one this is."""

    __slots__ = ("index", "sample_ids", "epochs", "mask", "planned", "epoch", "part", "dataset")

    def __init__(
        self,
        index: int,
        sample_ids: np.ndarray,
        epochs: np.ndarray,
        mask: np.ndarray,
        planned: LoaderCursor | PlannedCursor,
        epoch: int,
        part: int = 0,
        dataset: int = 0,
    ) -> None:
        self.index = index
        self.sample_ids = sample_ids
        self.epochs = epochs
        self.mask = mask
        self.planned = planned
        self.epoch = epoch
        self.part = part
        self.dataset = dataset

    @property
    def cursor(self) -> LoaderCursor:
        planned = self.planned
        return planned if isinstance(planned, LoaderCursor) else planned.resolve()

    def __repr__(self) -> str:
        return (
            f"Selection(index={self.index}, samples={self.sample_ids.size}, epoch={self.epoch}, "
            f"part={self.part}, dataset={self.dataset})"
        )


class Built(NamedTuple):
    """What `build` made: the user's arrays, the samples in them (in row order), and counts."""

    data: dict[str, Any]
    sample_ids: np.ndarray
    epochs: np.ndarray
    stats: dict[str, int]


class OrderStream(Protocol):
    """The rank's order batches from a cursor, as one DataLoader worker plans them."""

    arrangement: Arrangement
    rank: int
    worker: int
    workers: int
    limit: int | None
    """Output batches from the cursor (None: endless)."""
    compact: bool
    """Whether its `PlannedCursor`s travel unresolved between processes."""
    ownership: Ownership
    """How the output batches are dealt to the workers (in turn unless the pool sets another)."""

    def owns(self, n: int) -> bool:
        """Whether this worker builds output batch `n`."""

    def own_batches(self) -> Iterator[int]:
        """The output batches this worker builds, in order."""

    def batch(self, group: int) -> OrderBatch:
        """Order batch `group`, counted from the cursor."""

    def cursor(self, last: int, *, skip: int = 0, pending: Pending | None = None) -> LoaderCursor:
        """The state once order batches 0..last are consumed (-1: none), with the batcher's piece."""

    def start_state(self) -> Any:
        """What its cursors depend on besides their arguments, as JSON (`stream_key`)."""


def batch_epoch(epochs: np.ndarray, mask: np.ndarray) -> int:
    """A batch belongs to the oldest epoch among its real samples (a carried-over remainder or a
    token budget's pending samples keep a batch in the epoch they came from)."""
    real = epochs[mask] if mask.any() else epochs
    return int(real.min()) if real.size else 0


class _WorkerView:
    """Who plans: the rank (global), the worker of how many, under which arrangement, and how the
    batches are dealt to the workers (`ownership`: in turn unless the pool sets another). `compact`:
    its planned cursors travel unresolved between processes (`PlannedCursor`)."""

    compact: bool = False

    def owns(self, n: int) -> bool:
        """Whether this worker builds output batch `n`."""
        return self.ownership.owner(n) == self.worker

    def own_batches(self) -> Iterator[int]:
        """The output batches this worker builds, in order (endless: the caller stops at its limit)."""
        return self.ownership.owned(self.worker)

    def __init__(self, arrangement: Arrangement, rank: int, worker: int, workers: int, limit: int | None) -> None:
        self.arrangement = arrangement
        self.rank = rank
        self.worker = worker
        self.workers = workers
        self.limit = limit
        self.ownership: Ownership = RoundRobin(workers)


class TrainStream(_WorkerView):
    """Train order batches of one rank: `RankStream` batches of batch_size x group samples."""

    def __init__(
        self,
        stream: RankStream | MixedRankStream,
        arrangement: Arrangement,
        *,
        rank: int,
        worker: int,
        workers: int,
        limit: int | None,
    ) -> None:
        super().__init__(arrangement, rank, worker, workers, limit)
        self._stream = stream
        self._after: tuple[int, OrderCursor | MixedCursor] = (-1, stream.base)
        self._lock = threading.Lock()

    def batch(self, group: int) -> OrderBatch:
        stream = self._stream
        assert isinstance(stream, RankStream)  # a mixed stream's batches are MixedTrainStream's
        _, ids, epochs, mask, epoch = stream.node_parts(group * stream.ranks_per_node + stream.rank)
        return OrderBatch(ids, epochs, mask, 0, epoch, stream.own.edges is not None)

    @property
    def carries(self) -> bool:
        """Whether an epoch's last batch may be completed with the next epoch's first samples
        (remainder="carry"; drop and pad end each epoch in its own batches)."""
        stream = self._stream
        return isinstance(stream, RankStream) and stream.order.remainder is Remainder.CARRY

    def position(self, last: int) -> OrderCursor | MixedCursor:
        """The order cursor after order batch `last` (the last one asked for is kept: a group's
        parts and a budget's batches ask for the same one again). Thread-safe: planned cursors are
        resolved wherever they are asked for, while the plan goes on reading."""
        if last < 0:
            return self._stream.base
        with self._lock:
            after = self._after
            if after[0] != last:
                after = self._after = (last, self._stream.cursor_after(last))
        return after[1]

    def cursor(self, last: int, *, skip: int = 0, pending: Pending | None = None) -> LoaderCursor:
        return LoaderCursor(
            "train",
            self.arrangement,
            order=self.position(last),
            skip=skip,
            pending=pending,
            rank=self.rank if pending is not None else None,
        )

    def start_state(self) -> Any:
        return ["train", self._stream.base.to_dict()]


class EvalStream(_WorkerView):
    """Eval batches of one rank: `EvalOrder` steps after the cursor's, epoch 0 throughout."""

    def __init__(
        self,
        order: EvalOrder,
        arrangement: Arrangement,
        *,
        rank: int,
        start: int,
        worker: int,
        workers: int,
        max_batches: int | None,
    ) -> None:
        left = max(0, order.steps - start)
        super().__init__(arrangement, rank, worker, workers, left if max_batches is None else min(left, max_batches))
        self._order = order
        self.start = start
        self._epochs = np.zeros(order.batch_size, dtype=np.int64)

    def batch(self, group: int) -> OrderBatch:
        planned = self._order.batch(self.rank, self.start + group)
        return OrderBatch(planned.sample_ids, self._epochs, planned.mask)

    def cursor(self, last: int, *, skip: int = 0, pending: Pending | None = None) -> LoaderCursor:
        return LoaderCursor("eval", self.arrangement, step=self.start + last)

    def start_state(self) -> Any:
        return ["eval", self.start, self._order.num_samples, self._order.batch_size, self._order.world_size]


def plan_groups(
    stream: OrderStream, state: LoaderCursor | None, per_group: int, by_epoch: bool = False
) -> Iterator[Selection]:
    """Output batch n is part (skip + n) mod G of order batch (skip + n) // G, G = `per_group`:
    its position alone locates it, so each worker plans only its own batches. `by_epoch`: part k
    holds the k-th slice of the order batch sorted by epoch first, and belongs to its first
    sample's epoch where the order batch is `split`; else every part to the order batch's epoch."""
    skip = state.skip if state is not None else 0
    cached: tuple[int, OrderBatch | None, np.ndarray | None] = (-1, None, None)
    for n in stream.own_batches():
        if stream.limit is not None and n >= stream.limit:
            return
        group, part = divmod(skip + n, per_group)
        if cached[0] != group:
            fresh = stream.batch(group)
            cached = (group, fresh, np.sort(fresh.epochs) if by_epoch and fresh.split else None)
        _, order_batch, sorted_epochs = cached
        assert order_batch is not None
        done = part + 1 == per_group
        cursor = PlannedCursor(stream, group) if done else PlannedCursor(stream, group - 1, part + 1)
        epoch = (
            order_batch.epoch if order_batch.epoch is not None else batch_epoch(order_batch.epochs, order_batch.mask)
        )
        if sorted_epochs is not None:
            epoch = max(epoch, int(sorted_epochs[part * (sorted_epochs.size // per_group)]))
        yield Selection(
            n, order_batch.sample_ids, order_batch.epochs, order_batch.mask, cursor, epoch, part, order_batch.dataset
        )


def parsed_cursor(state: LoaderCursor | PlannedCursor | Mapping[str, Any] | None, location: str) -> LoaderCursor | None:
    """`state` as a typed cursor (a consumed batch's planned one resolved); errors name `location`."""
    if isinstance(state, PlannedCursor):  # a consumed batch's, handed on unresolved (the stager's view)
        return state.resolve()
    try:
        return LoaderCursor.parse(state)
    except CursorError as error:
        raise type(error)(f"{location}: {error}") from None
