"""TieredDataset: an IterableDataset that walks the order and batches inside the dataset.

Each batch carries `tf_cursor`, the JSON state after the training loop has consumed it, so the
state saved is the state of the last batch consumed, however far the workers ran ahead. Use it
with `DataLoader(ds, batch_size=None, num_workers=W)`: worker w builds output batches n = w (mod W),
which is the order DataLoader's in-order round robin hands them out in.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from tierflow.format.dataset import Dataset, ShardSource, open_dataset
from tierflow.format.reads import SampleLengths
from tierflow.format.shard import Form
from tierflow.storage.datasets import load_manifest
from tierflow.loader.collate import TransferBatch
from tierflow.loader.batching import Batcher, Filter, LengthBuckets, SampleContext, Samples, TokenWindows, Transform
from tierflow.loader.budget import TokenBudget
from tierflow.loader.topology import WorldPosition
from tierflow.order import EvalOrder, OrderCursor, RankStream, SampleOrder, ShardUse, future_shard_uses
from tierflow.order.working_set import WorkingSet, choose_working_set, working_set_bytes, working_set_shards
from tierflow.policies.auto import Lifecycle
from tierflow.tiers.tier import memory_headroom
from tierflow._bootstrap import refuse_while_bootstrapping
from tierflow.errors import CursorError

CURSOR_VERSION = 1


def default_partitions(nonempty_shards: int) -> int:
    """64, or the largest power of two the dataset's non-empty shards allow."""
    partitions = 1
    while partitions * 2 <= min(64, nonempty_shards):
        partitions *= 2
    return partitions


METRICS_KEY = "tf_metrics"
METRICS_EVERY = 16
_RESET_IN: set[int] = set()


def batch_epoch(epochs: np.ndarray, mask: np.ndarray) -> int:
    """A batch belongs to the oldest epoch among its real samples (a carried-over remainder or a
    token budget's pending samples keep a batch in the epoch they came from)."""
    real = epochs[mask] if mask.any() else epochs
    return int(real.min()) if real.size else 0


class TieredDataset(IterableDataset):
    """Batches of a packed dataset in the order's sequence for this rank; endless unless `eval`.

    `data` is a dataset directory, a URL (s3://..., with `endpoint_url`; read straight from the
    source) or an opened `Dataset`; `shard_source_factory()` makes the
    per-process shard source (the tier stack) when given. Nothing that opens files or clients is
    created before iteration, so DataLoader workers build their own after fork. `batch_size` is
    the order's batch: samples per output batch, or with `max_tokens` (a token budget) how many
    samples the rank pulls from its stream at a time.
    """

    def __init__(
        self,
        data: str | Path | Dataset,
        *,
        batch_size: int,
        seq_len: int | None = None,
        max_tokens: int | None = None,
        batcher: Batcher | None = None,
        columns: list[str] | None = None,
        transform: Transform | None = None,
        filter: Filter | None = None,
        seed: int = 0,
        partitions: int | None = None,
        window_shards: int | None = None,
        lanes: int | None = None,
        remainder: str = "carry",
        eval: bool = False,
        resume: dict[str, Any] | None = None,
        allow_mismatch: bool = False,
        world: WorldPosition | None = None,
        max_batches: int | None = None,
        shard_source_factory: Callable[[], ShardSource] | None = None,
        endpoint_url: str | None = None,
    ) -> None:
        refuse_while_bootstrapping("TieredDataset")
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if sum(x is not None for x in (seq_len, max_tokens, batcher)) > 1:
            raise ValueError("pass one of seq_len (token windows), max_tokens (token budget) or batcher")
        if batcher is None:
            batcher = (TokenWindows(seq_len) if seq_len is not None else
                       TokenBudget(max_tokens) if max_tokens is not None else Samples(select=columns))
        if isinstance(batcher, (TokenWindows, TokenBudget)) and (transform is not None or filter is not None):
            raise ValueError(f"{type(batcher).__name__} does not run filter/transform (use Samples)")
        if eval and (batcher.batches_per_group != 1 or isinstance(batcher, TokenBudget)):
            raise ValueError("eval mode reads every sample once in stored order; use a batcher without groups")
        self.batcher = batcher
        self.batch_size = batch_size
        self.transform = transform
        self.filter = filter
        self.eval = eval
        self.max_batches = max_batches
        self.allow_mismatch = allow_mismatch
        self.shard_source_factory = shard_source_factory
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
        index = data if isinstance(data, Dataset) else Dataset(manifest, _NoShards(self.location), location=self.location)
        counts = batcher.order_counts(index)
        self._token_starts = index.token_starts
        self.num_order_samples = int(counts.sum())
        if self.num_order_samples == 0:
            raise ValueError(f"{self.location}: no {batcher.tag()} samples to read")
        self.seed = seed
        partitions, window_shards, lanes = _saved_breadth(resume, partitions, window_shards, lanes)
        if partitions is None:
            partitions = default_partitions(int((counts > 0).sum()))
        self._order_args = {"shard_sample_counts": counts.tolist(), "dataset_id": f"{manifest.dataset_id}/{batcher.tag()}",
                            "seed": seed, "partitions": partitions, "remainder": remainder}
        self.working_set = self._choose_working_set(data, partitions, window_shards, lanes)
        self.order = self.order_with(self.working_set)
        declare = getattr(getattr(data, "source", None), "declare", None)
        if callable(declare):
            sizes = [s.decoded_bytes for s in manifest.shards]
            declare(Lifecycle(pattern="unknown" if eval else "reshuffle", data_bytes=sum(sizes)),
                    self.working_set.bytes, self.working_set.reading)
        self._resume: dict[str, Any] | None = None
        self.load_state_dict(resume)
        self._context: SampleContext | None = None
        self._context_pid = -1

    def order_with(self, working_set: WorkingSet) -> SampleOrder:
        """This dataset's order read through another working set (what `plan` compares)."""
        return SampleOrder(**self._order_args, window_shards=working_set.window_shards, lanes=working_set.lanes)

    def _choose_working_set(self, data: Any, partitions: int, window_shards: int | None,
                            lanes: int | None) -> WorkingSet:
        """Lanes and window size: as given, else sized to the top tier of the stack being read."""
        per_node = max(1, partitions // max(1, self.world.num_nodes))
        source = getattr(data, "source", None)
        tiers = getattr(source, "tiers", None) or []
        top = tiers[0] if tiers else None
        sizes = [s.bytes_in(top.form if top is not None else Form.AT_REST) for s in self.manifest.shards]
        staged = source is not None and hasattr(source, "declare")  # a tier stack: held in RAM unless in a tier
        chosen = choose_working_set(sizes, per_node, top.capacity if top is not None else None,
                                    memory_headroom() if staged else None)
        if window_shards is None and lanes is None:
            return chosen
        lanes = lanes if lanes is not None else (per_node if window_shards is not None else chosen.lanes)
        window_shards = window_shards if window_shards is not None else chosen.window_shards
        shards = working_set_shards(min(lanes, per_node), window_shards)
        return WorkingSet(min(lanes, per_node), window_shards, shards, working_set_bytes(shards, sizes), "as given")

    # -- state ---------------------------------------------------------------------------
    def arrangement(self) -> dict[str, int]:
        return {"num_nodes": self.world.num_nodes, "ranks_per_node": self.world.ranks_per_node,
                "batch_size": self.batch_size, "group": self.batcher.batches_per_group}

    def state_dict(self) -> dict[str, Any] | None:
        """The cursor iteration starts from (None: the beginning); the Loader's state is the one to save."""
        return self._resume

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Resume from a batch's `tf_cursor` or a Loader state_dict; checked now, O(partitions)."""
        if state is not None and "cursor" in state and "kind" not in state:
            state = state["cursor"]
        if state is not None:
            self._check_cursor(state)
        self._resume = state

    def _check_cursor(self, state: dict[str, Any]) -> None:
        if state.get("version") != CURSOR_VERSION:
            raise CursorError(f"{self.location}: loader cursor version {state.get('version')!r}, "
                              f"this tierflow reads {CURSOR_VERSION}")
        kind = "eval" if self.eval else "train"
        if state.get("kind") != kind:
            raise CursorError(f"{self.location}: a {state.get('kind')!r} cursor cannot resume a {kind} dataset")
        if kind == "train":
            self.order.load(state["order"], allow_mismatch=self.allow_mismatch)
        if "pending" in state:
            pending = state["pending"]
            ids = pending.get("ids") if isinstance(pending, dict) else None
            epochs = pending.get("epochs") if isinstance(pending, dict) else None
            samples = sum(s.samples for s in self.manifest.shards)
            if (not isinstance(ids, list) or not isinstance(epochs, list) or len(ids) != len(epochs)
                    or not all(isinstance(i, int) and 0 <= i < samples for i in ids)
                    or not all(isinstance(e, int) and e >= 0 for e in epochs)):
                raise CursorError(f"{self.location}: the cursor's pending samples are not two equal lists of "
                                  f"sample ids in [0, {samples}) and epochs")
            if not isinstance(self.batcher, TokenBudget):
                raise CursorError(f"{self.location}: a token-budget cursor holds {len(ids)} "
                                  f"pending samples; resume it with a TokenBudget batcher, not {self.batcher!r}")
            if state.get("rank") != self.world.rank:
                raise CursorError(f"{self.location}: this token-budget cursor is rank {state.get('rank')}'s "
                                  f"(ranks consume their streams at their own pace); rank {self.world.rank} must "
                                  f"resume from its own saved state")
        if state.get("skip", 0) or kind == "eval" or "pending" in state:
            saved = state.get("arrangement")
            if saved != self.arrangement():
                raise CursorError(
                    f"{self.location}: cursor stopped inside a group of {saved and saved.get('group')} batches "
                    f"(or in eval) under {saved}; resuming it needs the same arrangement, not {self.arrangement()} "
                    f"(change world size or batch size at a group boundary)")

    # -- per-process reading state -------------------------------------------------------
    def _open(self) -> SampleContext:
        if self._context is not None and self._context_pid == os.getpid():
            return self._context
        if self._given is not None:
            given = self._given
            source = self.shard_source_factory() if self.shard_source_factory else given.source
            dataset = Dataset(given.manifest, source, columns=self._columns, location=given.location)
        elif self.shard_source_factory is not None:
            dataset = Dataset(self.manifest, self.shard_source_factory(), columns=self._columns, location=self.location)
        else:
            dataset = open_dataset(self.location, columns=self._columns, manifest=self.manifest,
                                   endpoint_url=self.endpoint_url)
        self._context = SampleContext(dataset, self.seed, self.transform, self.filter)
        self._context_pid = os.getpid()
        return self._context

    def __getstate__(self) -> dict[str, Any]:
        """For spawn/forkserver workers: the reading context is per process, made again there."""
        state = self.__dict__.copy()
        state.update(_context=None, _context_pid=-1)
        return state

    # -- iteration ------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        ctx = self._open()
        batches = self._eval_batches(ctx, worker, workers) if self.eval else self._train_batches(ctx, worker, workers)
        if info is None:
            return batches
        return self._from_worker(batches, worker, getattr(ctx.dataset.source, "registry", None))

    @staticmethod
    def _from_worker(batches: Iterator[dict[str, Any]], worker: int, registry: Any) -> Iterator[dict[str, Any]]:
        """Batches as one transfer each; every METRICS_EVERY batches the worker's metrics (its tier
        counters live in this process) ride along, cumulative, for the Loader to merge."""
        if registry is not None and os.getpid() not in _RESET_IN:
            registry.reset()  # this worker's copy of the parent's totals must not be counted twice
            _RESET_IN.add(os.getpid())
        for n, batch in enumerate(batches):
            if registry is not None and n % METRICS_EVERY == 0:
                batch[METRICS_KEY] = {"worker": worker, "snapshot": registry.snapshot()}
            yield TransferBatch(batch)

    def _stream(self) -> tuple[RankStream, OrderCursor, int]:
        if self._resume is None:
            base, skip = self.order.start(), 0
        else:
            base = self.order.load(self._resume["order"], allow_mismatch=self.allow_mismatch)
            skip = int(self._resume.get("skip", 0))
        stream = RankStream(
            self.order, base, batch_size=self.batch_size * self.batcher.batches_per_group,
            node=self.world.node, num_nodes=self.world.num_nodes,
            rank=self.world.local_rank, ranks_per_node=self.world.ranks_per_node,
        )
        return stream, base, skip

    def _train_batches(self, ctx: SampleContext, worker: int, workers: int) -> Iterator[dict[str, Any]]:
        if isinstance(self.batcher, TokenBudget):
            yield from self._budget_batches(ctx, worker, workers)
            return
        stream, base, skip = self._stream()
        per_group = self.batcher.batches_per_group
        arrangement = self.arrangement()
        cached: tuple[int, Any] | None = None
        n = skip + worker
        while self.max_batches is None or n - skip < self.max_batches:
            group, sub = divmod(n, per_group)
            if cached is None or cached[0] != group:
                cached = (group, stream.batch(group))
            order_batch = cached[1]
            batch = self.batcher.build(ctx, group, order_batch.sample_ids, order_batch.epochs, order_batch.mask, sub)
            if sub + 1 == per_group:
                cursor = {"order": order_batch.cursor, "skip": 0}
            else:
                before = base if group == 0 else stream.cursor_after(group - 1)
                cursor = {"order": before.to_dict(), "skip": sub + 1}
            batch["tf_cursor"] = {"version": CURSOR_VERSION, "kind": "train", **cursor, "arrangement": arrangement}
            batch["tf_index"] = n - skip
            batch["tf_epoch"] = batch_epoch(order_batch.epochs, order_batch.mask)
            yield batch
            n += workers

    def _budget_batches(self, ctx: SampleContext, worker: int, workers: int) -> Iterator[dict[str, Any]]:
        """Every worker plans the rank's whole budget stream (lengths only) and builds batches n = w (mod W)."""
        batcher = self.batcher
        assert isinstance(batcher, TokenBudget)
        stream, base, _ = self._stream()
        planner = batcher.planner(self._resume.get("pending") if self._resume is not None else None)
        lengths = ctx.cache.get("lengths")
        if lengths is None:
            lengths = ctx.cache["lengths"] = SampleLengths(ctx.dataset, batcher.columns(self.manifest)[0])
        if planner.ids.size:
            planner.lengths = np.minimum(lengths(planner.ids), batcher.max_tokens)
        position, pulled = base.to_dict(), 0
        arrangement = self.arrangement()
        n = 0
        while self.max_batches is None or n < self.max_batches:
            while planner.wants_more():
                order_batch = stream.batch(pulled)
                real = order_batch.sample_ids[order_batch.mask]
                planner.add(real, order_batch.epochs[order_batch.mask], lengths(real))
                position, pulled = order_batch.cursor, pulled + 1
            ids, epochs = planner.take()
            if n % workers == worker:
                batch = batcher.build(ctx.dataset, ids, epochs)
                batch["tf_cursor"] = {"version": CURSOR_VERSION, "kind": "train", "order": position, "skip": 0,
                                      "pending": planner.state(), "rank": self.world.rank,
                                      "arrangement": arrangement}
                batch["tf_index"] = n
                batch["tf_epoch"] = batch_epoch(epochs, batch["mask"])
                yield batch
            n += 1

    def _eval_batches(self, ctx: SampleContext, worker: int, workers: int) -> Iterator[dict[str, Any]]:
        order = EvalOrder(self.num_order_samples, batch_size=self.batch_size, world_size=self.world.world_size)
        start = int(self._resume["step"]) + 1 if self._resume is not None else 0
        arrangement = self.arrangement()
        epochs = np.zeros(self.batch_size, dtype=np.int64)
        stop = order.steps if self.max_batches is None else min(order.steps, start + self.max_batches)
        for step in range(start + worker, stop, workers):
            planned = order.batch(self.world.rank, step)
            batch = self.batcher.build(ctx, step, planned.sample_ids, epochs, planned.mask, 0)
            batch["tf_cursor"] = {"version": CURSOR_VERSION, "kind": "eval", "step": step, "arrangement": arrangement}
            batch["tf_index"] = step - start
            batch["tf_epoch"] = 0
            yield batch

    # -- hooks for the stager ------------------------------------------------------------
    def future_shard_uses(self, cursor: dict[str, Any] | None = None, horizon_batches: int = 64) -> list[ShardUse]:
        """This node's shard uses from `cursor` (default: the resume cursor) for the next
        `horizon_batches` steps; positions in node samples (docs/order.md)."""
        state = cursor if cursor is not None else self._resume
        start = self.order.start() if state is None else self.order.load(state["order"], self.allow_mismatch)
        per_step = self.batch_size * self.batcher.batches_per_group
        return future_shard_uses(
            self.order, start, node=self.world.node, num_nodes=self.world.num_nodes,
            batch_size=per_step, horizon=horizon_batches * self.world.ranks_per_node * per_step)

    def wrap_shard_source(self, wrap: Callable[[ShardSource], ShardSource]) -> None:
        """Read this process's shards through `wrap(source)` (telemetry's fetch attribution)."""
        dataset = self._open().dataset
        dataset.source = wrap(dataset.source)

    def node_step_samples(self) -> int:
        """Samples this node's ranks consume per step together (the stager's clock, `FutureView`)."""
        return self.batch_size * self.batcher.batches_per_group * self.world.ranks_per_node

    def start_prefetch(self) -> None:
        """Hook for the stager (not built here): a no-op until the tier stack's stager exists."""

    def __repr__(self) -> str:
        return (f"TieredDataset({self.location!r}, batch_size={self.batch_size}, batcher={self.batcher!r}, "
                f"world={self.world}, eval={self.eval})")


def _saved_breadth(resume: dict[str, Any] | None, partitions: int | None, window_shards: int | None,
                   lanes: int | None) -> tuple[int | None, int | None, int | None]:
    """What a resumed run did not set comes from its cursor, so the order it resumes is the one it saved."""
    state = resume.get("cursor", resume) if isinstance(resume, dict) and "kind" not in resume else resume
    order = state.get("order") if isinstance(state, dict) else None
    config = order.get("config") if isinstance(order, dict) else None
    if not isinstance(config, dict):
        return partitions, window_shards, lanes
    def saved(given: int | None, name: str) -> int | None:
        value = config.get(name)
        return given if given is not None or not isinstance(value, int) else value
    return saved(partitions, "partitions"), saved(window_shards, "window_shards"), saved(lanes, "lanes")


class _NoShards:
    """A shard source for the main process's index-only Dataset: opening a shard there is a bug."""

    def __init__(self, location: str) -> None:
        self.location = location

    def open_shard(self, index: int, info: Any) -> Any:
        raise RuntimeError(f"{self.location}: shard {index} opened in the planning process")


__all__ = ["CursorError", "LengthBuckets", "Samples", "TieredDataset", "TokenBudget", "TokenWindows",
           "default_partitions"]
