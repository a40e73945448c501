"""Several packed datasets mixed by weight behind one loader: `MixedDataset([a, b], batching, weights=[...])`.

The order is `MixedOrder` (order/mixed.py): node batch g comes from the dataset the closed-form
schedule gives for draw g and is that dataset's own next node batch, so resume is exact and a
world-size change resumes too (elastic). Each dataset keeps its own reading state, working set and
shard supply (its own tier stack, if any); one batcher builds every batch from the context of the
dataset it came from, and `meta.datasets` says which, per sample (sample ids are the dataset's
own). An epoch of a mixture is the datasets' total samples drawn at the weights (a small dataset
repeats within it, a large one is partly read), counted in node draws, so every rank reaches an
edge at the same step.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from tierflow.errors import CursorError
from tierflow.format.dataset import Dataset, ShardSupply
from tierflow.loader.batching import SampleContext
from tierflow.loader._collate import CarriedBatch
from tierflow.loader.budget import TokenBudget
from tierflow.loader.cursor import Arrangement, LoaderCursor, check_arrangement, cursor_after_batches
from tierflow.loader.dataset import DEFAULT_ORDER, Resume, TieredDataset
from tierflow.loader.meta import with_worker_metrics
from tierflow.loader.ownership import RoundRobin
from tierflow.loader.plan import Built, OrderBatch, PlannedCursor, Selection, TrainStream, parsed_cursor
from tierflow.loader.spec import BatchSpec, OrderSpec
from tierflow.loader.topology import WorldPosition
from tierflow.order import MixedCursor, MixedOrder, MixedRankStream, ShardUse
from tierflow.telemetry.metrics import MetricsRegistry


class MixedTrainStream(TrainStream):
    """A rank's mixed order batches: dataset d's own node batches at the schedule's draws (the
    positions and cursors are TrainStream's, over the mixed stream)."""

    _stream: MixedRankStream

    def __init__(
        self,
        stream: MixedRankStream,
        arrangement: Arrangement,
        *,
        rank: int,
        worker: int,
        workers: int,
        limit: int | None,
        samples_per_epoch: int,
        num_nodes: int,
    ) -> None:
        super().__init__(stream, arrangement, rank=rank, worker=worker, workers=workers, limit=limit)
        self._draw_samples = num_nodes * stream.batch_size  # samples the world takes per node draw
        self._epoch_samples = samples_per_epoch

    def epoch_of(self, draw: int) -> int:
        """The mixture epoch of node draw `draw` (counted from the start of the run)."""
        return draw * self._draw_samples // self._epoch_samples

    def draws_through(self, epoch: int) -> int:
        """Node draws (from the start) whose epoch is <= `epoch`."""
        return -(-(epoch + 1) * self._epoch_samples // self._draw_samples)

    def batch(self, group: int) -> OrderBatch:
        stream = self._stream
        pick = group * stream.ranks_per_node + stream.rank
        dataset, micro = stream.node_batch(pick)
        return OrderBatch(micro.sample_ids, micro.epochs, micro.mask, dataset, self.epoch_of(stream.base.draws + pick))


class MixedDataset(IterableDataset):
    """Several datasets mixed by weight (see the module docstring): one `TieredDataset` per entry of
    `datasets`, each built from the same `batching` and `order` specs, drawn by `MixedOrder`.

    Token budgets and eval are per dataset: refused here. Each entry of `datasets` that is an
    opened `Dataset` (e.g. `stack.dataset()`) reads through its own shard supply.
    """

    eval = False
    compact_cursors: bool = False
    """As `TieredDataset.compact_cursors`."""
    _resolver: tuple[LoaderCursor | None, MixedTrainStream] | None = None

    def __init__(
        self,
        datasets: Sequence[str | Path | Dataset],
        batching: BatchSpec,
        order: OrderSpec = DEFAULT_ORDER,
        *,
        weights: Sequence[float] | None = None,
        resume: Resume = None,
        allow_mismatch: bool = False,
        world: WorldPosition | None = None,
        max_batches: int | None = None,
        endpoint_url: str | None = None,
    ) -> None:
        super().__init__()
        if len(datasets) < 1:
            raise ValueError("a mixture needs at least one dataset")
        weights = [1.0] * len(datasets) if weights is None else list(weights)
        if len(weights) != len(datasets):
            raise ValueError(f"{len(datasets)} datasets got {len(weights)} weights")
        if batching.max_tokens is not None or isinstance(batching.batcher, TokenBudget):
            raise ValueError(
                "a token budget packs samples across order batches; mixing datasets takes batchers "
                "that map order batches to batches (Samples, TokenWindows, LengthBuckets)"
            )
        saved = LoaderCursor.parse(resume)
        saved_orders: list[Any] = [None] * len(datasets)
        if saved is not None and isinstance(saved.order, MixedCursor) and len(saved.order.cursors) == len(datasets):
            saved_orders = list(saved.order.cursors)  # each dataset's order built as it was saved
        self.children = [
            TieredDataset(
                d,
                batching,
                order,
                resume=LoaderCursor("train", saved.arrangement, order=o)
                if saved is not None and o is not None
                else None,
                allow_mismatch=True,
                world=world,
                endpoint_url=endpoint_url,
            )
            for d, o in zip(datasets, saved_orders)
        ]
        first = self.children[0]
        self.batcher = first.batcher
        self.batch_size = first.batch_size
        self.world = first.world
        self.seed = first.seed
        self.max_batches = max_batches
        self.allow_mismatch = allow_mismatch
        self.weights = tuple(float(w) for w in weights)
        self.location = first.location
        self.num_order_samples = sum(c.num_order_samples for c in self.children)
        self.working_set = first.working_set
        self.order = MixedOrder([c.order for c in self.children], self.weights, self.seed)
        self._resume: LoaderCursor | None = None
        self.resumed_epoch: Mapping[str, Any] | None = None
        self.load_state_dict(saved)

    # -- state ---------------------------------------------------------------------------
    @property
    def locations(self) -> list[str]:
        return [c.location for c in self.children]

    def arrangement(self) -> Arrangement:
        return Arrangement(
            self.world.num_nodes, self.world.ranks_per_node, self.batch_size, self.batcher.batches_per_group
        )

    @property
    def cursor(self) -> LoaderCursor | None:
        """The cursor iteration starts from (None: the beginning), checked against this mixture."""
        return self._resume

    def state_dict(self) -> dict[str, Any] | None:
        return self._resume.to_dict() if self._resume is not None else None

    def load_state_dict(self, state: Resume) -> None:
        """Resume from a mixed cursor (typed or JSON) or a Loader state_dict; checked now."""
        cursor = parsed_cursor(state, self.location)
        self.resumed_epoch = state.get("epoch") if isinstance(state, Mapping) else None
        if cursor is not None:
            try:
                if cursor.kind != "train":
                    raise CursorError(f"a {cursor.kind!r} cursor cannot resume a train dataset")
                if cursor.order is not None:
                    cursor = dataclasses.replace(
                        cursor, order=self.order.load(cursor.order.to_dict(), allow_mismatch=self.allow_mismatch)
                    )
                self.batcher.check_resume(cursor)
                check_arrangement(cursor, self.arrangement())
            except CursorError as error:
                raise type(error)(f"{self.location}: {error}") from None
        self._resume = cursor

    def node_step_samples(self) -> int:
        return self.batch_size * self.batcher.batches_per_group * self.world.ranks_per_node

    # -- the order -----------------------------------------------------------------------
    def stream(self, worker: int = 0, workers: int = 1) -> MixedTrainStream:
        """This rank's mixed order from the resume cursor, as DataLoader worker `worker` plans it."""
        return self._mixed_stream(self._resume, worker, workers)

    def _mixed_stream(self, cursor: LoaderCursor | None, worker: int = 0, workers: int = 1) -> MixedTrainStream:
        base = cursor.order if cursor is not None and isinstance(cursor.order, MixedCursor) else self.order.start()
        world = self.world
        stream = MixedRankStream(
            self.order,
            base,
            batch_size=self.batch_size * self.batcher.batches_per_group,
            node=world.node,
            num_nodes=world.num_nodes,
            rank=world.local_rank,
            ranks_per_node=world.ranks_per_node,
        )
        return MixedTrainStream(
            stream,
            self.arrangement(),
            rank=world.rank,
            worker=worker,
            workers=workers,
            limit=self.max_batches,
            samples_per_epoch=self.num_order_samples,
            num_nodes=world.num_nodes,
        )

    def resolve_cursor(self, cursor: LoaderCursor | PlannedCursor) -> LoaderCursor:
        """As `TieredDataset.resolve_cursor`, over the mixed stream."""
        if isinstance(cursor, LoaderCursor):
            return cursor
        if cursor.resolved or cursor._stream is not None:
            return cursor.resolve()
        resolver = self._resolver
        if resolver is None or resolver[0] is not self._resume:
            resolver = self._resolver = (self._resume, self.stream())
        return cursor.resolve(resolver[1])

    def epoch_length(self, cursor: Resume = None, after: int | None = None, agree: bool = False) -> int:
        return self.epoch_span(cursor, after, agree)[1]

    def epoch_span(self, cursor: Resume = None, after: int | None = None, agree: bool = False) -> tuple[int, int]:
        """The epoch and batches of this rank from `cursor` through the mixture epoch they finish
        (see `TieredDataset.epoch_span`); every node draws alike, so `agree` takes the last local rank."""
        start = parsed_cursor(cursor, self.location) if cursor is not None else self._resume
        stream = self._mixed_stream(start)
        draws = stream._stream.base.draws
        ranks = self.world.ranks_per_node
        own = self.world.local_rank
        epoch = stream.epoch_of(draws + (0 if agree else own))
        if after is not None:
            epoch = max(epoch, after + 1)
        left = stream.draws_through(epoch) - draws
        rank = ranks - 1 if agree else own
        batches = max(0, -(-(left - rank) // ranks))
        skip = start.skip if start is not None else 0
        return epoch, max(0, batches * self.batcher.batches_per_group - skip)

    def cursor_after(self, cursor: Resume, batches: int) -> LoaderCursor | None:
        """As `TieredDataset.cursor_after`, over the mixed stream."""
        start = parsed_cursor(cursor, self.location) if cursor is not None else None
        if batches <= 0:
            return start
        return cursor_after_batches(self._mixed_stream(start), start, batches, self.batcher.batches_per_group)

    # -- iteration ------------------------------------------------------------------------
    def __iter__(self) -> Iterator[CarriedBatch]:
        info = get_worker_info()
        if info is not None:  # a DataLoader worker
            return self.worker_batches(info.id, info.num_workers, compact=self.compact_cursors)
        contexts = self._contexts()
        plan = self.batcher.plan(contexts[0], self.stream(), self._resume)
        return (self._mixed_carry(s, self.batcher.build(contexts[s.dataset], s)) for s in plan)

    def worker_batches(
        self, worker: int, workers: int, *, compact: bool = False, text_views: bool = False, lag: int | None = None
    ) -> Iterator[CarriedBatch]:
        contexts = self._contexts()
        for ctx in contexts:
            ctx.text_views = text_views
        stream = self.stream(worker, workers)
        stream.compact = compact
        plan = self.batcher.plan(contexts[0], stream, self._resume)
        return with_worker_metrics(
            plan,
            lambda s: self._mixed_carry(s, self.batcher.build(contexts[s.dataset], s)),
            worker,
            [ctx.registry for ctx in contexts],
        )

    def ownership(self, workers: int, lag: int | None = None) -> RoundRobin:
        """In turn: a mixture's batches are dealt as DataLoader takes them, whatever the `lag`."""
        return RoundRobin(workers)

    def _contexts(self) -> list[SampleContext]:
        contexts = [child._open() for child in self.children]
        for child, ctx in zip(self.children, contexts):
            child._bound_decoded(ctx, None)  # the mixture's epochs are not its children's: each reads its widest
        return contexts

    def __getstate__(self) -> dict[str, Any]:
        """For spawn/forkserver workers: the resolver's stream is this process's (the children drop
        their reading contexts themselves)."""
        state = self.__dict__.copy()
        state.update(_resolver=None)
        return state

    def reading_registries(self) -> list[MetricsRegistry]:
        return list({id(r): r for r in (child._open().registry for child in self.children)}.values())

    @staticmethod
    def _mixed_carry(selection: Selection, built: Built) -> CarriedBatch:
        carried = TieredDataset._carry(selection, built)
        carried.meta.datasets = np.full(built.sample_ids.size, selection.dataset, dtype=np.int64)
        return carried

    def wrap_shards(self, wrap: Callable[[ShardSupply], ShardSupply]) -> None:
        for child in self.children:
            child.wrap_shards(wrap)

    def future_shard_uses(self, cursor: Resume = None, horizon_batches: int = 64) -> list[ShardUse]:
        raise TypeError(
            "a Stager plans one dataset's shards; a mixture reads each dataset on demand (every reader "
            "ensures its own shards), so build its Loader without stager="
        )

    def __repr__(self) -> str:
        return (
            f"MixedDataset({self.locations!r}, weights={list(self.weights)}, batch_size="
            f"{self.batch_size}, batcher={self.batcher!r}, world={self.world})"
        )


ReadDataset = TieredDataset | MixedDataset
"""What a Loader iterates: one dataset, or several mixed."""

__all__ = ["MixedDataset", "MixedTrainStream", "ReadDataset"]
