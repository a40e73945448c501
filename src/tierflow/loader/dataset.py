"""TieredDataset: an IterableDataset that walks the order and batches inside the dataset.

One loop for every batcher and mode: the batcher plans this worker's batches over the rank's
order stream (train or eval) from the resume cursor and builds each (plan.py). Each batch is a
`CarriedBatch`: the user's data, and beside it a `BatchMeta` with the cursor after it, so the
state saved is the state of the last batch consumed, however far the workers ran ahead. Use it with `DataLoader(ds, batch_size=None, num_workers=W)`: worker w
builds output batches n = w (mod W), which is the order DataLoader's in-order round robin hands
them out in.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from tierflow._bootstrap import refuse_while_bootstrapping
from tierflow.errors import CursorError, CursorMismatchError
from tierflow.format.dataset import Dataset, NoShards, ShardSupply
from tierflow.format.metadata import MappedManifest, shard_column
from tierflow.format.metadata_layout import LargestBlocks
from tierflow.format.shard import Form
from tierflow.format.table import BlockCache
from tierflow.loader._collate import CarriedBatch
from tierflow.loader.batching import ByPosition, SampleContext, reading_registry
from tierflow.loader.cursor import Arrangement, LoaderCursor, check_arrangement, cursor_after_batches, mismatch_advice
from tierflow.loader.meta import BatchMeta, with_worker_metrics
from tierflow.loader.ownership import LaneSticky, Ownership, RoundRobin
from tierflow.loader.plan import Built, EvalStream, OrderStream, PlannedCursor, Selection, TrainStream, parsed_cursor
from tierflow.loader.runs import main_process_batches
from tierflow.loader.spec import (
    NARROWED,
    BatchSpec,
    OrderSpec,
    flat_keywords_error,
    saved_first_epoch,
    saved_group,
    shard_sizes,
    settle_order,
    working_set_for,
)
from tierflow.loader.topology import WorldPosition, job_identity
from tierflow.order import EvalOrder, OrderCursor, RankStream, SampleOrder, ShardUse, future_shard_uses
from tierflow.order.groups import GROUP_BYTES, GROUP_SAMPLES, floor_bytes
from tierflow.order.layout import whole_counts
from tierflow.order.working_set import (
    WorkingSet,
    largest_bytes,
    mean_bytes,
    narrowing_advice,
    total_bytes,
    working_set_bytes,
)
from tierflow.policies.auto import Lifecycle
from tierflow.storage.datasets import load_manifest, open_dataset
from tierflow.telemetry.metrics import MetricsRegistry
from tierflow.tiers.stack import TierStack

log = logging.getLogger("tierflow.loader")

Resume = LoaderCursor | Mapping[str, Any] | None
"""What `resume=` and `load_state_dict` take: a cursor, its JSON dict, or a `Loader.state_dict()`."""


DEFAULT_ORDER = OrderSpec()
"""The order of a dataset whose spec sets nothing: seed 0, the defaults, or a resumed cursor's."""


class TieredDataset(IterableDataset):
    """Batches of a packed dataset in the order's sequence for this rank; endless unless `eval`.

    `data` is a dataset directory, a URL (s3://..., with `endpoint_url`; read straight from the
    object store) or an opened `Dataset`; `shards()` makes the per-process shard supply (the tier
    stack) when given. Nothing that opens files or clients is created before iteration, so
    DataLoader workers build their own after fork. `batching` says how samples become batches and
    `order` how the order walks the dataset (loader/spec.py); what `order` leaves unset comes from
    the cursor of a resume or `load_state_dict`. Several datasets mixed by weight: `MixedDataset`
    (mixture.py).
    """

    def __init__(
        self,
        data: str | Path | Dataset,
        batching: BatchSpec | None = None,
        order: OrderSpec = DEFAULT_ORDER,
        *,
        eval: bool = False,
        resume: Resume = None,
        allow_mismatch: bool = False,
        world: WorldPosition | None = None,
        max_batches: int | None = None,
        shards: Callable[[], ShardSupply] | None = None,
        endpoint_url: str | None = None,
        **unknown: Any,
    ) -> None:
        if unknown or not isinstance(batching, BatchSpec):
            raise flat_keywords_error(unknown, batching)
        refuse_while_bootstrapping("TieredDataset")
        super().__init__()
        batcher = batching.make_batcher()
        if eval and not batcher.plans_eval:
            raise ValueError("eval mode reads every sample once in stored order; use a batcher without groups")
        self.batching = batching
        self.batcher = batcher
        self.batch_size = batching.batch_size
        self.transform = batching.transform
        self.filter = batching.filter
        self.collate = batching.collate
        self.eval = eval
        self.max_batches = max_batches
        self.allow_mismatch = allow_mismatch
        self.shards = shards
        self.endpoint_url = endpoint_url
        self.world = world if world is not None else WorldPosition.from_env()
        if isinstance(data, Dataset):
            self._given: Dataset | None = data
            self.location = data.location
            manifest = data.manifest
        else:
            self._given = None
            self.location = str(data)
            manifest = load_manifest(data, endpoint_url)
        self.manifest = manifest
        self._columns = batcher.columns(manifest)
        counts = batcher.order_counts(self._planning_index())
        self.num_order_samples, nonempty = _order_totals(counts, manifest)
        if self.num_order_samples == 0:
            raise ValueError(f"{self.location}: no {batcher.tag()} samples to read")
        self.seed = order.seed
        saved = self._parsed(resume)
        self.settled = settle_order(order, saved, nonempty)
        self._order_args = {
            **self._per_shard_args(counts),
            "dataset_id": f"{manifest.dataset_id}/{batcher.tag()}",
            "seed": order.seed,
            "partitions": self.settled.partitions,
            "remainder": order.remainder,
            "shuffle": order.shuffle,
            "group_bytes": self.settled.group_bytes,
            "group_samples": self.settled.group_samples,
            "block_bytes": _largest_blocks(manifest),
            **_stored_layout(manifest, counts),
        }
        stack = data.source if isinstance(data, Dataset) and isinstance(data.source, TierStack) else None
        self.working_set = self._choose_working_set(stack, nonempty)
        self.order = self.order_with(self.working_set)
        if stack is not None:
            sizes = shard_column(manifest, "decoded_bytes")
            stack.declare(
                Lifecycle(pattern="unknown" if eval else "reshuffle", data_bytes=int(sizes.sum())),
                self.working_set.bytes,
                self.working_set.reading,
                readers=self.world.ranks_per_node,
                job=job_identity(),
            )
        self._resume: LoaderCursor | None = None
        self.load_state_dict(saved)
        self.resumed_epoch = resume.get("epoch") if isinstance(resume, Mapping) else None
        self._context: SampleContext | None = None
        self._context_pid = -1

    def order_with(self, working_set: WorkingSet) -> SampleOrder:
        """This dataset's order read through another working set (what `plan` compares)."""
        return SampleOrder(
            **self._order_args,
            window_shards=working_set.window_shards,
            lanes=working_set.lanes,
            first_epoch=working_set.first_epoch,
        )

    def _choose_working_set(self, stack: TierStack | None, nonempty: int) -> WorkingSet:
        """The settled breadth (spec.working_set_for), its bytes counted in the form the top tier
        stores; a tier too small for it to pay is told so (`narrowing_advice`), never narrowed."""
        per_node = max(1, self.settled.partitions // max(1, self.world.num_nodes))
        top = stack.tiers[0] if stack is not None and stack.tiers else None
        at_rest: Any = shard_sizes(self.manifest, "bytes")
        form = top.form if top is not None else Form.AT_REST
        sizes: Any = shard_sizes(self.manifest, "decoded_bytes") if form == Form.DECODED else at_rest
        node_shards = nonempty // max(1, self.world.num_nodes)
        chosen = working_set_for(self.settled, at_rest, sizes, per_node, node_shards)
        if top is not None and not self.eval:
            advice = narrowing_advice(chosen, sizes, per_node, top.capacity, f"tier {top.name}")
            if advice is not None:  # the cache adapts (the staging area; tiers/stack.py warns where RAM is short)
                log.info("%s: %s", self.location, advice)
        return chosen

    # -- state ---------------------------------------------------------------------------
    def arrangement(self) -> Arrangement:
        return Arrangement(
            self.world.num_nodes, self.world.ranks_per_node, self.batch_size, self.batcher.batches_per_group
        )

    @property
    def cursor(self) -> LoaderCursor | None:
        """The cursor iteration starts from (None: the beginning), checked against this dataset."""
        return self._resume

    def state_dict(self) -> dict[str, Any] | None:
        """`cursor` as JSON; the Loader's state is the one to save (it follows the batches consumed)."""
        return self._resume.to_dict() if self._resume is not None else None

    resumed_epoch: Mapping[str, Any] | None = None
    """A resumed `Loader.state_dict()`'s epoch clock (loader/epochs.py), for the Loader made over it."""

    def load_state_dict(self, state: Resume) -> None:
        """Resume from a cursor (typed or JSON) or a Loader state_dict; checked now, O(partitions)."""
        cursor = self._parsed(state)
        self.resumed_epoch = state.get("epoch") if isinstance(state, Mapping) else None
        if cursor is not None:
            try:
                cursor = self._checked(cursor)
            except CursorError as error:
                raise type(error)(f"{self.location}: {error}") from None
        self._resume = cursor

    def _parsed(self, state: Resume) -> LoaderCursor | None:
        return parsed_cursor(state, self.location)

    def _checked(self, cursor: LoaderCursor) -> LoaderCursor:
        """`cursor` if this dataset can resume it (its order position loaded into this order)."""
        kind = "eval" if self.eval else "train"
        if cursor.kind != kind:
            raise CursorError(f"a {cursor.kind!r} cursor cannot resume a {kind} dataset")
        if cursor.order is not None:
            saved = getattr(cursor.order, "config", {}).get("dataset_id")
            if isinstance(self.order, SampleOrder) and saved != self.order.dataset_id and not self.allow_mismatch:
                raise CursorMismatchError(mismatch_advice(str(saved), self.order.dataset_id))
            if isinstance(self.order, SampleOrder) and self.order.shuffle:
                # the cursor's floor, as at construction, and its group_bytes unless they were chosen
                groups = {"group_samples": saved_group(cursor, "group_samples", GROUP_SAMPLES)}
                if not self.settled.groups_given:
                    groups["group_bytes"] = saved_group(cursor, "group_bytes", GROUP_BYTES)
                if any(self._order_args[key] != value for key, value in groups.items()):
                    self._order_args.update(groups)
                    self.order = self.order_with(self.working_set)
            if isinstance(self.order, SampleOrder) and self.settled.breadth_chosen:
                first = saved_first_epoch(cursor, True)  # breadth not chosen: the cursor's, as at construction
                if first != NARROWED and first != self.order.first_epoch:
                    self.working_set = dataclasses.replace(self.working_set, first_epoch=first)
                    self.order = self.order_with(self.working_set)
            cursor = dataclasses.replace(
                cursor, order=self.order.load(cursor.order.to_dict(), allow_mismatch=self.allow_mismatch)
            )
        self.batcher.check_resume(cursor)
        if cursor.pending is not None:
            self._check_pending(cursor)
        check_arrangement(cursor, self.arrangement())
        return cursor

    def _check_pending(self, cursor: LoaderCursor) -> None:
        """A token budget's pending samples are this dataset's, and this rank's to resume."""
        assert cursor.pending is not None
        samples = self.manifest.num_samples
        if any(not 0 <= i < samples for i in cursor.pending.ids):
            raise CursorError(
                f"the cursor's pending samples are not two equal lists of sample ids in [0, {samples}) and epochs"
            )
        if cursor.rank != self.world.rank:
            raise CursorError(
                f"this token-budget cursor is rank {cursor.rank}'s (ranks consume their "
                f"streams at their own pace); rank {self.world.rank} must resume from its "
                f"own saved state"
            )

    # -- per-process reading state -------------------------------------------------------
    def _open(self) -> SampleContext:
        if self._context is not None and self._context_pid == os.getpid():
            return self._context
        if self._given is not None:
            given = self._given
            supply = self.shards() if self.shards else given.source
            dataset = Dataset(given.manifest, supply, columns=self._columns, location=given.location)
        elif self.shards is not None:
            dataset = Dataset(self.manifest, self.shards(), columns=self._columns, location=self.location)
        else:
            dataset = open_dataset(
                self.location, columns=self._columns, manifest=self.manifest, endpoint_url=self.endpoint_url
            )
        self._context = SampleContext(
            dataset, self.seed, self.transform, self.filter, self.collate, registry=reading_registry(dataset)
        )
        self._bound_decoded(self._context, 0)
        self._context_pid = os.getpid()
        return self._context

    def decoded_bound(self, epoch: int | None = None, share: int = 1) -> int:
        """Decoded bytes of compressed blocks one reading process needs at once: the shards its order
        reads at once (one window per lane), decoded; with block groups, one group per lane and the
        blocks at its edges. Every process holds its own, so a budget of the whole dataset (the
        sources' 1 GiB default) held every block in every DataLoader worker. Epoch 0 of a narrowed
        first epoch (`order.first_epoch`) reads its lanes a group at a time, two groups at a hand-over;
        None: the widest epoch. A worker dealt lanes among `share` workers reads a `share`-th of them,
        and one more (a lane moving to it)."""
        sizes: Any = shard_sizes(self.manifest, "decoded_bytes")
        order = self.order
        lanes, window = _lane_share(self.working_set.lanes, share), self.working_set.window_shards
        windows = working_set_bytes(lanes * window, sizes)
        if epoch == 0 and order.first_epoch is not None:
            lanes, window = (
                _lane_share(min(self.working_set.lanes, 2 * order.first_epoch[0]), share),
                order.first_epoch[1],
            )
            # two groups of lanes count only at a hand-over, and their shards are dealt at random: mean
            # shards, with room for the two largest at once (the largest shards, as wider epochs count,
            # held ~1.5x what epoch 0 of the peers' token corpus reads at once, its largest shard 9x its
            # mean; the largest one alone as the headroom re-decoded blocks where a few shards dwarf the rest)
            shards = lanes * window
            windows = min(
                working_set_bytes(shards, sizes), int(shards * mean_bytes(sizes)) + working_set_bytes(1, sizes)
            )
        if not (order.shuffle and order.group_bytes) or order.block_bytes is None or not len(order.block_bytes):
            return windows
        # a group is never cut smaller than its shard's largest block, nor its floor of samples; the
        # largest shard is the headroom
        block = int(order.block_bytes.mean())
        floor = floor_bytes(order.group_samples, total_bytes(sizes), order.layout.num_samples)
        return min(windows, lanes * (max(order.group_bytes, floor, block) + 2 * block) + largest_bytes(sizes))

    def _bound_decoded(self, ctx: SampleContext, epoch: int | None) -> None:
        """Bound the process's decoded blocks by what `epoch` reads at once: a reading context opens
        at epoch 0's bound and widens at its first batch of a later epoch (`_built`)."""
        cache = getattr(ctx.dataset.source, "cache", None)
        ctx.narrow = epoch == 0 and self.order.first_epoch is not None
        if isinstance(cache, BlockCache):
            bound = self.decoded_bound(epoch, ctx.lane_share)
            cache.max_bytes = min(cache.max_bytes, bound) if epoch == 0 else min(cache.cap, max(cache.max_bytes, bound))

    def __getstate__(self) -> dict[str, Any]:
        """For spawn/forkserver workers: the reading context is made there, and so is an order over
        its stored layout, from the mapped columns (16 MB at 10^6 shards, pages a node shares); a
        layout computed here (token windows) travels, not computed again in each worker."""
        state = self.__dict__.copy()
        state.update(_context=None, _context_pid=-1, _resolver=None)
        if isinstance(self.manifest, MappedManifest) and self.order.layout._stored is not None:
            args = {**self._order_args, "shard_sample_counts": None, "decoded_bytes": None}
            state.update(_order_args=args, order=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self.order is None:
            self._order_args.update(self._per_shard_args(self.batcher.order_counts(self._planning_index())))
            self.order = self.order_with(self.working_set)

    def _per_shard_args(self, counts: Any) -> dict[str, Any]:
        """The order's per-shard arguments: its samples (or windows) and decoded bytes per shard."""
        return {
            "shard_sample_counts": counts
            if getattr(counts, "per_shard", False)
            else np.asarray(counts, dtype=np.int64),
            "decoded_bytes": self.manifest.tables.rows("decoded_bytes")
            if isinstance(self.manifest, MappedManifest)
            else shard_column(self.manifest, "decoded_bytes"),
        }

    def _planning_index(self) -> Dataset:
        """The dataset the order counts its samples in: a given Dataset, else one that opens no shard."""
        given = self._given
        return given if given is not None else Dataset(self.manifest, NoShards(self.location), location=self.location)

    # -- cursors of planned batches ------------------------------------------------------
    compact_cursors: bool = False
    """Batches from DataLoader workers carry their cursors unresolved (`PlannedCursor`: a few
    integers, not the order's position); the process that receives them resolves the one it needs
    with `resolve_cursor`. Off: a worker resolves each batch's cursor as it sends it."""

    _resolver: tuple[LoaderCursor | None, OrderStream] | None = None

    def resolve_cursor(self, cursor: LoaderCursor | PlannedCursor) -> LoaderCursor:
        """The `LoaderCursor` of a batch's `meta.planned`: already resolved, planned in this process,
        or planned by a DataLoader worker of this dataset's current iteration (from its resume
        cursor; a compact one is resolved against a stream of this process from the same start)."""
        if isinstance(cursor, LoaderCursor):
            return cursor
        if cursor.resolved or cursor._stream is not None:
            return cursor.resolve()
        resolver = self._resolver
        if resolver is None or resolver[0] is not self._resume:
            resolver = self._resolver = (self._resume, self.stream())
        return cursor.resolve(resolver[1])

    # -- iteration ------------------------------------------------------------------------
    def __iter__(self) -> Iterator[CarriedBatch]:
        info = get_worker_info()
        if info is not None:  # a DataLoader worker
            return self.worker_batches(info.id, info.num_workers, compact=self.compact_cursors)
        ctx = self._open()
        plan = self.batcher.plan(ctx, self.stream(), self._resume)
        return main_process_batches(self, ctx, plan)  # runs of batches read as one where they can be (runs.py)

    def worker_batches(
        self, worker: int, workers: int, *, compact: bool = False, text_views: bool = False, lag: int | None = None
    ) -> Iterator[CarriedBatch]:
        """The batches worker `worker` of `workers` builds (`ownership(workers, lag)`), its metrics
        riding in their meta (`with_worker_metrics`); `compact`: their cursors travel unresolved;
        `text_views`: string columns as UTF-8 views (`SampleContext.text_views`)."""
        ctx = self._open()
        ctx.text_views = text_views
        stream = self.stream(worker, workers)
        stream.compact = compact
        stream.ownership = self.ownership(workers, lag)
        if isinstance(stream.ownership, LaneSticky):
            ctx.lane_share = workers
            self._bound_decoded(ctx, 0)  # opened at epoch 0's bound, widened as before
        plan = self.batcher.plan(ctx, stream, self._resume)
        return with_worker_metrics(plan, lambda selection: self._built(ctx, selection), worker, [ctx.registry])

    def reading_registries(self) -> list[MetricsRegistry]:
        """What this process's readers and transforms count into (opening its reading context):
        a Loader without workers includes it in its telemetry's registry."""
        return [self._open().registry]

    def _built(self, ctx: SampleContext, selection: Selection) -> CarriedBatch:
        self._widen(ctx, (selection,))
        return self._carry(selection, self.batcher.build(ctx, selection))

    def _widen(self, ctx: SampleContext, selections: Sequence[Selection]) -> None:
        if ctx.narrow and any(selection.epoch for selection in selections):
            self._bound_decoded(ctx, None)

    @staticmethod
    def _carry(selection: Selection, built: Built) -> CarriedBatch:
        meta = BatchMeta(
            selection.planned, selection.index, selection.epoch, built.sample_ids, built.epochs, built.stats
        )
        return CarriedBatch(built.data, meta)

    def stream(self, worker: int = 0, workers: int = 1) -> OrderStream:
        """This rank's order from the resume cursor, as DataLoader worker `worker` of `workers` plans it."""
        arrangement, rank = self.arrangement(), self.world.rank
        if self.eval:
            order = EvalOrder(self.num_order_samples, batch_size=self.batch_size, world_size=self.world.world_size)
            start = self._resume.step + 1 if self._resume is not None and self._resume.step is not None else 0
            return EvalStream(
                order, arrangement, rank=rank, start=start, worker=worker, workers=workers, max_batches=self.max_batches
            )
        return TrainStream(
            self._rank_stream(self._resume),
            arrangement,
            rank=rank,
            worker=worker,
            workers=workers,
            limit=self.max_batches,
        )

    def ownership(self, workers: int, lag: int | None = None) -> Ownership:
        """How this rank's batches are dealt to `workers` workers: in turn (DataLoader's), or with a
        `lag` by the lane each reads (`LaneSticky`, over a stream of its own) where a batch's position
        alone places it (`ByPosition`: not a token budget's, not eval's)."""
        if lag is None or workers < 2 or self.eval or not isinstance(self.batcher, ByPosition):
            return RoundRobin(workers)
        lanes, per_group = self._rank_stream(self._resume), self.batcher.batches_per_group
        skip = self._resume.skip if self._resume is not None else 0
        return LaneSticky(lambda n: lanes.lane_of((skip + n) // per_group), workers, lag)

    def _rank_stream(self, cursor: LoaderCursor | None) -> RankStream:
        """This rank's train order batches (batch_size x group samples) from `cursor`."""
        base = self._order_position(cursor)
        return RankStream(
            self.order,
            base,
            batch_size=self.batch_size * self.batcher.batches_per_group,
            node=self.world.node,
            num_nodes=self.world.num_nodes,
            rank=self.world.local_rank,
            ranks_per_node=self.world.ranks_per_node,
        )

    def epoch_length(self, cursor: Resume = None, after: int | None = None, agree: bool = False) -> int:
        """Output batches of this rank from `cursor` (default: the resume cursor) to the end of the
        epoch they finish; `epoch_span`'s count."""
        return self.epoch_span(cursor, after, agree)[1]

    def epoch_span(self, cursor: Resume = None, after: int | None = None, agree: bool = False) -> tuple[int, int]:
        """(epoch, batches): the epoch a run of this rank's output batches from `cursor` (default:
        the resume cursor) finishes (its first batch's, and past `after`, the epoch last finished)
        and how many of them belong to it or an older one: what one `for` over a `Loader` yields
        before `max_batches`; eval: (0, the steps left). With `agree`, the fewest of any rank, so
        every rank stops at the same step: each rank computes every rank's count from the order,
        no collective. Exact and O(nodes x lanes) for batchers that locate batches by position (a
        sorted group's parts each in their samples' epoch, `RankStream.epoch_parts`); a token
        budget's count depends on lengths it has not planned: TypeError."""
        if not isinstance(self.batcher, ByPosition):
            raise TypeError(
                f"{type(self.batcher).__name__} packs a varying number of samples per batch, so "
                f"an epoch's batch count is known only once it is planned: iterate it (one epoch "
                f"per `for`) or count your own steps with endless=True"
            )
        start = self._parsed(cursor) if cursor is not None else self._resume
        if self.eval:
            steps = EvalOrder(
                self.num_order_samples, batch_size=self.batch_size, world_size=self.world.world_size
            ).steps
            return 0, max(0, steps - (start.step + 1 if start is not None and start.step is not None else 0))
        skip = start.skip if start is not None else 0
        parts = self.batcher.batches_per_group
        if not self.batcher.parts_by_epoch:  # a group's parts all belong to its epoch
            epoch, batches = self._rank_stream(start).epoch_batches(after, agree)
            return epoch, max(0, batches * parts - skip)
        return self._rank_stream(start).epoch_parts(after, agree, parts, skip)

    def cursor_after(self, cursor: Resume, batches: int) -> LoaderCursor | None:
        """The cursor once this rank has consumed `batches` more output batches from `cursor`
        (None: the start), every rank as many (a positional batcher's; the order alone, no I/O)."""
        start = self._parsed(cursor) if cursor is not None else None
        if batches <= 0:
            return start
        saved = self._resume
        self._resume = start
        try:
            stream = self.stream()
        finally:
            self._resume = saved
        return cursor_after_batches(stream, start, batches, self.batcher.batches_per_group)

    # -- hooks for the stager ------------------------------------------------------------
    def future_shard_uses(self, cursor: Resume = None, horizon_batches: int = 64) -> list[ShardUse]:
        """This node's shard uses from `cursor` (default: the resume cursor) for the next
        `horizon_batches` steps; positions in node samples (docs/order.md)."""
        start = self._order_position(self._parsed(cursor) if cursor is not None else self._resume)
        per_step = self.batch_size * self.batcher.batches_per_group
        return future_shard_uses(
            self.order,
            start,
            node=self.world.node,
            num_nodes=self.world.num_nodes,
            batch_size=per_step,
            horizon=horizon_batches * self.world.ranks_per_node * per_step,
        )

    def _order_position(self, cursor: LoaderCursor | None) -> OrderCursor:
        """The order cursor of `cursor` in this order (the start for none, or for eval)."""
        if cursor is None or cursor.order is None:
            return self.order.start()
        if isinstance(cursor.order, OrderCursor) and cursor.order.config_hash == self.order.config_hash:
            return cursor.order
        return self.order.load(cursor.order.to_dict(), self.allow_mismatch)

    def wrap_shards(self, wrap: Callable[[ShardSupply], ShardSupply]) -> None:
        """Read this process's shards through `wrap(supply)` (telemetry's fetch attribution)."""
        dataset = self._open().dataset
        dataset.source = wrap(dataset.source)

    def node_step_samples(self) -> int:
        """Samples this node's ranks consume per step together (the stager's clock, `FutureView`)."""
        return self.batch_size * self.batcher.batches_per_group * self.world.ranks_per_node

    @property
    def locations(self) -> list[str]:
        """Where this dataset's samples come from (a mixture has one per dataset)."""
        return [self.location]

    def __repr__(self) -> str:
        return (
            f"TieredDataset({self.location!r}, batch_size={self.batch_size}, batcher={self.batcher!r}, "
            f"world={self.world}, eval={self.eval})"
        )


def _largest_blocks(manifest: Any) -> Any:
    """Each shard's largest block from the columns; a mapped dataset's made as asked for (LargestBlocks)."""
    if isinstance(manifest, MappedManifest):
        return LargestBlocks.of_mapped(manifest)
    decoded, rows = shard_column(manifest, "decoded_bytes"), shard_column(manifest, "largest_rows")
    return LargestBlocks(decoded, rows, shard_column(manifest, "samples")).whole()


def _order_totals(counts: Any, manifest: Any) -> tuple[int, int]:
    """(order samples, shards holding one): a stored layout's, for the counts it was made for (no
    column read), else summed from the counts."""
    stored = manifest.tables.layout_of(counts) if isinstance(manifest, MappedManifest) else None
    if stored is not None and stored.nonempty is not None:
        return int(stored.sizes.sum()), stored.nonempty
    whole = np.asarray(whole_counts(counts))
    return int(whole.sum()), int((whole > 0).sum())


def _stored_layout(manifest: Any, counts: Any) -> dict[str, Any]:
    """The layout and decoded digest stored with the metadata for an order over these counts: the rows
    (metadata_layout.py), or windows of a stored length (metadata_windows.py)."""
    stored = manifest.tables.layout_of(counts) if isinstance(manifest, MappedManifest) else None
    return {} if stored is None else {"stored_layout": stored, "decoded_digest": stored.decoded}


def _lane_share(lanes: int, share: int) -> int:
    """The lanes one of `share` workers dealt lanes reads at once: its part, and one moving to it."""
    return lanes if share <= 1 else min(lanes, -(-lanes // share) + 1)


__all__ = ["DEFAULT_ORDER", "Resume", "TieredDataset"]
