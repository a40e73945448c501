"""Planning batches: which samples each output batch holds, and the cursor once it is consumed.

A batcher has two halves. `plan(ctx, stream, state)` walks the rank's order stream from a cursor
and yields one `Selection` per output batch this DataLoader worker builds (worker w of W builds
batches n = w (mod W), the order DataLoader's in-order round robin hands them out in); planning
reads no sample data, at most lengths, so a plan that must see every batch (a token budget) can
run whole in every worker. `build(ctx, selection)` reads and assembles one of them. The stream
is train (`TrainStream` over `RankStream`) or eval (`EvalStream` over `EvalOrder`); a batcher
that maps order batches to output batches by position plans both with `plan_groups`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple, Protocol

import numpy as np

from tierflow.loader.cursor import Arrangement, LoaderCursor, Pending
from tierflow.order import EvalOrder, MixedCursor, MixedRankStream, OrderCursor, RankStream


class OrderBatch(NamedTuple):
    """One order batch: global sample ids, their epochs, False on padding repeats; in a mixture the
    dataset they are ids of and the mixture's epoch (else the batch's epoch follows its samples')."""

    sample_ids: np.ndarray
    epochs: np.ndarray
    mask: np.ndarray
    dataset: int = 0
    epoch: int | None = None


@dataclass(frozen=True, eq=False)
class Selection:
    """Output batch `index` (counted from the cursor the plan started at): the samples it is built
    from, the loader's state once it is consumed, and the epoch it belongs to. For a batcher that
    cuts one order batch into several (`LengthBuckets`), the samples are the whole order batch's
    (the same array for each of its parts) and `part` says which one this is."""

    index: int
    sample_ids: np.ndarray
    epochs: np.ndarray
    mask: np.ndarray
    cursor: LoaderCursor
    epoch: int
    part: int = 0
    dataset: int = 0


class Built(NamedTuple):
    """What `build` made: the user's arrays, the samples in them (in row order), and counts."""

    data: dict[str, Any]
    sample_ids: np.ndarray
    epochs: np.ndarray
    stats: dict[str, int]


class OrderStream(Protocol):
    """The rank's order batches from a cursor, as one DataLoader worker plans them."""

    rank: int
    worker: int
    workers: int
    limit: int | None
    """Output batches from the cursor (None: endless)."""

    def batch(self, group: int) -> OrderBatch:
        """Order batch `group`, counted from the cursor."""

    def cursor(self, last: int, *, skip: int = 0, pending: Pending | None = None) -> LoaderCursor:
        """The state once order batches 0..last are consumed (-1: none), with the batcher's piece."""


def batch_epoch(epochs: np.ndarray, mask: np.ndarray) -> int:
    """A batch belongs to the oldest epoch among its real samples (a carried-over remainder or a
    token budget's pending samples keep a batch in the epoch they came from)."""
    real = epochs[mask] if mask.any() else epochs
    return int(real.min()) if real.size else 0


class _WorkerView:
    """Who plans: the rank (global), the DataLoader worker of how many, under which arrangement."""

    def __init__(self, arrangement: Arrangement, rank: int, worker: int, workers: int, limit: int | None) -> None:
        self.arrangement = arrangement
        self.rank = rank
        self.worker = worker
        self.workers = workers
        self.limit = limit


class TrainStream(_WorkerView):
    """Train order batches of one rank: `RankStream` batches of batch_size x group samples."""

    def __init__(self, stream: RankStream | MixedRankStream, arrangement: Arrangement, *, rank: int, worker: int,
                 workers: int, limit: int | None) -> None:
        super().__init__(arrangement, rank, worker, workers, limit)
        self._stream = stream
        self._after: tuple[int, OrderCursor | MixedCursor] = (-1, stream.base)

    def batch(self, group: int) -> OrderBatch:
        stream = self._stream
        micro = stream.node_batch(group * stream.ranks_per_node + stream.rank)
        return OrderBatch(micro.sample_ids, micro.epochs, micro.mask)

    def position(self, last: int) -> OrderCursor | MixedCursor:
        """The order cursor after order batch `last` (the last one asked for is kept: a group's
        parts and a budget's batches ask for the same one again)."""
        if last < 0:
            return self._stream.base
        if self._after[0] != last:
            self._after = (last, self._stream.cursor_after(last))
        return self._after[1]

    def cursor(self, last: int, *, skip: int = 0, pending: Pending | None = None) -> LoaderCursor:
        return LoaderCursor("train", self.arrangement, order=self.position(last), skip=skip, pending=pending,
                            rank=self.rank if pending is not None else None)


class EvalStream(_WorkerView):
    """Eval batches of one rank: `EvalOrder` steps after the cursor's, epoch 0 throughout."""

    def __init__(self, order: EvalOrder, arrangement: Arrangement, *, rank: int, start: int, worker: int,
                 workers: int, max_batches: int | None) -> None:
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


def plan_groups(stream: OrderStream, state: LoaderCursor | None, per_group: int) -> Iterator[Selection]:
    """Output batch n is part (skip + n) mod G of order batch (skip + n) // G, G = `per_group`:
    its position alone locates it, so each worker plans only its own batches."""
    skip = state.skip if state is not None else 0
    cached: tuple[int, OrderBatch | None] = (-1, None)
    n = stream.worker
    while stream.limit is None or n < stream.limit:
        group, part = divmod(skip + n, per_group)
        if cached[0] != group:
            cached = (group, stream.batch(group))
        order_batch = cached[1]
        assert order_batch is not None
        done = part + 1 == per_group
        cursor = stream.cursor(group) if done else stream.cursor(group - 1, skip=part + 1)
        epoch = order_batch.epoch if order_batch.epoch is not None else batch_epoch(order_batch.epochs,
                                                                                    order_batch.mask)
        yield Selection(n, order_batch.sample_ids, order_batch.epochs, order_batch.mask, cursor, epoch, part,
                        order_batch.dataset)
        n += stream.workers
