"""Batchers: how the order's samples become the training loop's batches, in two halves.

A batcher is a small object with one job, and two halves (plan.py): `plan` says which samples
each output batch holds and what the cursor is once it is consumed; `build` reads and assembles
one batch. `Samples` collates dataset rows (dict of columns); `TokenWindows` makes fixed-length
windows over the token stream (the window is the order's sample); `LengthBuckets` sorts a group
of `group` order batches' worth of variable-length samples by length and cuts it into `group`
batches whose padded lengths come from a bounded set of shapes. These three map each order batch
to `batches_per_group` output batches, always the same number, so a batch's position alone
locates it (no look-back, exact resume); `TokenBudget` (budget.py) plans many-to-one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from tierflow.errors import CursorError
from tierflow.format.dataset import Dataset
from tierflow.format.manifest import Manifest
from tierflow.format.metadata_table import ShardRows
from tierflow.format.metadata_windows import WindowCounts
from tierflow.format.reads import TokenReader
from tierflow.loader._collate import collate_columns, collate_samples
from tierflow.loader.cursor import LoaderCursor
from tierflow.loader.plan import Built, OrderStream, Selection, plan_groups
from tierflow.loader.tokens import (
    WindowStarts,
    row_segments,
    run_document_starts,
    run_segments,
    window_counts,
    window_segments,
)
from tierflow.order import sample_rng
from tierflow.telemetry.metrics import MetricsRegistry
from tierflow.transforms.resized import SOURCE_KEY, SampleLocation

Transform = Callable[[dict, np.random.Generator], dict]
Filter = Callable[[dict], bool]
Collate = Callable[[list[dict]], dict]
"""A user's batch assembly: the batch's samples (dicts, after filter/transform) -> the batch dict."""


@dataclass
class SampleContext:
    """Per-process reading state handed to a batcher (built lazily in each DataLoader worker).
    `registry` is what this process's readers and transforms count into: the tier stack's when the
    dataset reads through one, else the context's own (a DataLoader worker ships it to the Loader)."""

    dataset: Dataset
    seed: int
    transform: Transform | None = None
    filter: Filter | None = None
    collate: Collate | None = None
    cache: dict[str, Any] = field(default_factory=dict)
    registry: MetricsRegistry = field(default_factory=MetricsRegistry)
    narrow: bool = False
    """Whether the decoded-block cache is bounded by epoch 0's narrower reading (TieredDataset widens it)."""
    lane_share: int = 1
    """Among how many workers this process's lanes are dealt (`LaneSticky`): it decodes about that
    share of the lanes read at once, and bounds its decoded blocks by them."""
    text_views: bool = False
    """Whether `Samples` gives string columns as memoryviews of their UTF-8 bytes (a worker of the
    Loader's pool, with no filter, transform or collate: its ring carries the bytes as they are and
    the training process makes the strings, so they are not decoded and encoded again in between)."""


def reading_registry(dataset: Dataset) -> MetricsRegistry:
    """The registry a reading context of `dataset` counts into: its tier stack's, else a new one."""
    registry = getattr(dataset.source, "registry", None)
    return registry if isinstance(registry, MetricsRegistry) else MetricsRegistry()


class Batcher(Protocol):
    batches_per_group: int
    """Output batches per order batch (the order batch holds batch_size x this many samples)."""
    runs_transforms: bool
    """Whether the context's filter/transform/collate run (else the dataset refuses them)."""
    plans_eval: bool
    """Whether eval's stored order, one order batch per output batch, can be planned."""

    def tag(self) -> str:
        """Names the order's sample unit: cursors of different units never mix."""

    def columns(self, manifest: Manifest) -> list[str] | None:
        """Columns the batcher reads (projection), None for all."""

    def order_counts(self, dataset: Dataset) -> OrderCounts:
        """Per shard, the number of order samples (rows or windows) it starts."""

    def check_resume(self, cursor: LoaderCursor) -> None:
        """Raise `CursorError` when the cursor's batcher piece (skip, pending) is not one this saves."""

    def plan(self, ctx: SampleContext, stream: OrderStream, state: LoaderCursor | None) -> Iterator[Selection]:
        """This worker's output batches from `state` (None: the start), in order."""

    def build(self, ctx: SampleContext, selection: Selection) -> Built:
        """Read and assemble one planned batch."""


OrderCounts = np.ndarray | ShardRows | WindowCounts
"""Order samples per shard: an int64 array, or per-shard values of a mapped column read as shards are asked for."""


def shard_samples(dataset: Dataset) -> OrderCounts:
    """Order samples per shard for batchers whose sample is a dataset row: over a stored layout the
    column it was made for, read as shards are asked for (ShardRows), so a start reads no whole column."""
    from tierflow.format.metadata import MappedManifest, shard_column

    manifest = dataset.manifest
    stored = manifest.tables.stored_layout() if isinstance(manifest, MappedManifest) else None
    if stored is not None:
        return stored.counts
    return np.asarray(shard_column(manifest, "samples"), dtype=np.int64)  # mapped, read-only: no copy


class ByPosition:
    """Plans output batch n as a part of order batch n // batches_per_group (plan.plan_groups);
    its batcher piece of the cursor is `skip`, the parts of the current group consumed."""

    batches_per_group: int
    plans_eval: ClassVar[bool] = True
    parts_by_epoch: ClassVar[bool] = False
    """Whether part k of an order batch is its k-th slice sorted by epoch first (`SortedGroups`), so
    each part belongs to the epoch of its own samples; else every part to the order batch's."""

    def check_resume(self, cursor: LoaderCursor) -> None:
        if cursor.pending is not None:
            raise CursorError(
                f"a token-budget cursor holds {len(cursor.pending.ids)} pending samples; resume "
                f"it with a TokenBudget batcher, not {self!r}"
            )
        if cursor.skip >= self.batches_per_group:
            raise CursorError(f"cursor skips {cursor.skip} batches of a group of {self.batches_per_group}")

    def plan(self, ctx: SampleContext, stream: OrderStream, state: LoaderCursor | None) -> Iterator[Selection]:
        return plan_groups(stream, state, self.batches_per_group, self.parts_by_epoch)


class SortedGroups(ByPosition):
    """A batcher that sorts a group of `group` order batches by a key of each sample (length,
    aspect ratio) and cuts it into `group` batches: part k of a group is its k-th slice."""

    group: int
    parts_by_epoch: ClassVar[bool] = True

    @property
    def batches_per_group(self) -> int:  # type: ignore[override]
        return self.group

    @property
    def plans_eval(self) -> bool:  # type: ignore[override]
        return self.group == 1

    def tag(self) -> str:
        return "samples"

    def order_counts(self, dataset: Dataset) -> OrderCounts:
        return shard_samples(dataset)

    @staticmethod
    def epoch_major(keys: np.ndarray, epochs: np.ndarray) -> np.ndarray:
        """The group's order by `keys` within each epoch, epochs in turn: a group that straddles an
        epoch edge sorts the older epoch's samples first, so one of its batches, not all `group`,
        holds samples of two epochs (stable: a group within one epoch sorts by `keys` alone), and
        each part belongs to its own samples' epoch: the older epoch's `for` ends at the part
        holding its last samples, the next one's starts after it (`RankStream.epoch_parts`)."""
        return np.lexsort((keys, epochs))

    def part_of(self, order: np.ndarray, selection: Selection) -> np.ndarray:
        """The positions in the group (sorted `order`) that output batch `selection.part` holds."""
        size = selection.sample_ids.size // self.group
        return order[selection.part * size : (selection.part + 1) * size]


def _rows(ctx: SampleContext, ids: np.ndarray, text_views: bool = False) -> list[dict[str, Any]]:
    """`ctx.dataset[i]` of each id, located with one index lookup for the batch; each shard opened
    and each block's getters taken once per batch, not per sample."""
    dataset = ctx.dataset
    ids = np.asarray(ids, dtype=np.int64)
    if not ids.size or int(ids.min()) < 0 or int(ids.max()) >= len(dataset):
        return [dataset[int(i)] for i in ids]  # what a single read says of an id outside the dataset
    shards, blocks, rows = dataset.index.locate_samples(ids)
    return [{name: get(row) for name, get in found} for found, row in _getters(ctx, shards, blocks, rows, text_views)]


def _getters(
    ctx: SampleContext, shards: np.ndarray, blocks: np.ndarray, rows: np.ndarray, text_views: bool = False
) -> list[tuple[list[tuple[str, Callable[[int], Any]]], int]]:
    """(the column getters of its block, its row) of each located sample; each shard opened and each
    block's getters taken once per call."""
    dataset = ctx.dataset
    columns = dataset.columns
    tables: dict[int, Any] = {}
    getters: dict[tuple[int, int], list[tuple[str, Callable[[int], Any]]]] = {}
    out = []
    for shard, block, row in zip(shards.tolist(), blocks.tolist(), rows.tolist()):
        found = getters.get((shard, block))
        if found is None:
            table = tables.get(shard)
            if table is None:
                table = tables[shard] = dataset.shard(shard)
            found = getters[(shard, block)] = [(name, table.getter(block, name, text_views)) for name in columns]
        out.append((found, row))
    return out


def _run_columns(ctx: SampleContext, ids: np.ndarray, batch: int) -> dict[str, list[Any]] | None:
    """Each column's values of a run's samples (batches of `batch`), located with one index lookup
    and read a batch at a time (only its shards open, as when it is read alone), column by column (no
    dict per sample); None where an id lies outside the dataset (the run is then built a batch at a
    time, which says so)."""
    dataset = ctx.dataset
    if not ids.size or int(ids.min()) < 0 or int(ids.max()) >= len(dataset):
        return None
    shards, blocks, rows = dataset.index.locate_samples(ids)
    columns: dict[str, list[Any]] = {name: [] for name in dataset.columns}
    for start in range(0, ids.size, batch):
        end = start + batch
        here = _getters(ctx, shards[start:end], blocks[start:end], rows[start:end])
        for k, values in enumerate(columns.values()):
            values.extend([found[k][1](row) for found, row in here])
    return columns


def transformed(ctx: SampleContext, sample: dict[str, Any], sample_id: int, epoch: int) -> Any:
    """The context's transform of one sample with its per-sample rng; a transform that `needs_source`
    (an image cache, keyed by shard and block) is also told where the sample lives."""
    assert ctx.transform is not None
    if getattr(ctx.transform, "needs_source", False):
        shard, block, row = ctx.dataset.index.locate_sample(int(sample_id))
        sample[SOURCE_KEY] = SampleLocation(ctx.dataset, shard, block, row, ctx.registry)
    return ctx.transform(sample, sample_rng(ctx.seed, epoch, sample_id))


@dataclass
class Samples(ByPosition):
    """Dataset rows as a dict of columns; `transform`/`filter` of the context run per sample, and
    its `collate`, when given, assembles the batch instead (`mask` is added unless it sets one)."""

    pad: bool = False
    pad_value: int | float = 0
    select: Sequence[str] | None = None
    batches_per_group = 1
    runs_transforms: ClassVar[bool] = True
    run_batches: ClassVar[int] = 4
    """The most batches `build_run` reads as one: a run's values (documents) are held until its
    last batch is handed out, and they can be large."""

    def tag(self) -> str:
        return "samples"

    def columns(self, manifest: Manifest) -> list[str] | None:
        return list(self.select) if self.select is not None else None

    def order_counts(self, dataset: Dataset) -> OrderCounts:
        return shard_samples(dataset)

    def build(self, ctx: SampleContext, selection: Selection) -> Built:
        ids, epochs = selection.sample_ids, selection.epochs
        kept: list[int] = []
        samples = []
        filtered = 0
        views = ctx.text_views and ctx.filter is None and ctx.transform is None and ctx.collate is None
        for k, (sample_id, epoch, sample) in enumerate(zip(ids.tolist(), epochs.tolist(), _rows(ctx, ids, views))):
            if ctx.filter is not None and not ctx.filter(sample):
                filtered += 1
                continue
            if ctx.transform is not None:
                sample = transformed(ctx, sample, sample_id, epoch)
            samples.append(sample)
            kept.append(k)
        keep = np.array(kept, dtype=np.int64)
        if ctx.collate is not None:
            batch = ctx.collate(samples)
            if not isinstance(batch, dict):
                raise TypeError(
                    f"collate {getattr(ctx.collate, '__name__', ctx.collate)!r} returned "
                    f"{type(batch).__name__}; it must return the batch as a dict"
                )
            copied = sum(v.nbytes for v in batch.values() if isinstance(v, np.ndarray))
            batch.setdefault("mask", selection.mask[keep])
        else:
            names = list(samples[0].keys()) if samples else list(ctx.dataset.columns)
            batch, copied = collate_samples(samples, names, self.pad, self.pad_value)
            batch["mask"] = selection.mask[keep]
        return Built(
            batch,
            ids[keep].astype(np.int64),
            epochs[keep].astype(np.int64),
            {"copied_bytes": copied, "filtered": filtered, "samples": len(samples)},
        )

    def build_run(self, ctx: SampleContext, selections: Sequence[Selection]) -> list[Built]:
        """`build` of each of a run of planned batches, the run's rows located with one index
        lookup and read column by column; with a filter, transform or collate, a batch at a time."""
        ids = np.concatenate([selection.sample_ids for selection in selections]).astype(np.int64)
        sizes = {selection.sample_ids.size for selection in selections}
        values = None
        if ctx.filter is None and ctx.transform is None and ctx.collate is None and len(sizes) == 1:
            values = _run_columns(ctx, ids, sizes.pop())
        if values is None:
            return [self.build(ctx, selection) for selection in selections]
        out, start = [], 0
        for selection in selections:
            end = start + selection.sample_ids.size
            rows = {name: column[start:end] for name, column in values.items()}
            batch, copied = collate_columns(rows, self.pad, self.pad_value)
            batch["mask"] = selection.mask.copy()
            stats = {"copied_bytes": copied, "filtered": 0, "samples": end - start}
            out.append(Built(batch, ids[start:end], selection.epochs.astype(np.int64), stats))
            start = end
        return out


@dataclass
class TokenWindows(ByPosition):
    """Windows of L + 1 tokens inside one shard (tokens.py); input_ids/labels are views of one
    (B, L+1) buffer."""

    seq_len: int
    batches_per_group = 1
    runs_transforms: ClassVar[bool] = False

    def tag(self) -> str:
        return f"windows:{self.seq_len}"

    def columns(self, manifest: Manifest) -> list[str] | None:
        if manifest.token_column is None:
            raise TypeError("TokenWindows needs a token dataset (packed with a tokenizer)")
        return [manifest.token_column]

    def order_counts(self, dataset: Dataset) -> OrderCounts:
        """Windows per shard: over a layout stored for this length, computed as shards are asked for."""
        stored = _window_layout(dataset, self.seq_len)
        if stored is not None:
            return stored.counts
        shards = len(dataset.manifest.shards)
        if shards >= HINT_SHARDS and (dataset.location, self.seq_len) not in _HINTED:
            _HINTED.add((dataset.location, self.seq_len))
            log.warning(
                "%s: the order over windows of %d tokens is computed at every start (%d shards: ~0.2 s and "
                "~100 MB a rank and worker at a million); `tierflow upgrade %s --seq-len %d` stores it once",
                dataset.location,
                self.seq_len,
                shards,
                dataset.location,
                self.seq_len,
            )
        return window_counts(dataset.token_starts, self.seq_len)

    def _reading(
        self, ctx: SampleContext
    ) -> tuple[int, TokenReader, Callable[[np.ndarray], np.ndarray], np.dtype, int | None]:
        """(seq_len, reader, window starts, token dtype, eos id) of this context, made once."""
        reading = ctx.cache.get("tokens")
        if reading is None or reading[0] != self.seq_len:
            manifest = ctx.dataset.manifest
            reading = ctx.cache["tokens"] = (
                self.seq_len,
                TokenReader(ctx.dataset),
                _window_starts(ctx.dataset, self.seq_len),
                np.dtype(manifest.token_dtype or np.uint16),
                manifest.eos_id,
            )
        return reading

    def build(self, ctx: SampleContext, selection: Selection) -> Built:
        ids = selection.sample_ids
        _, reader, window_starts, dtype, eos = self._reading(ctx)
        length = self.seq_len
        ids = ids.astype(np.int64)
        buffer = np.empty((ids.size, length + 1), dtype=dtype)
        pieces_before = reader.pieces
        reader.copy_windows(buffer, window_starts(ids))
        segments = _plain_segments(ids.size, length) if eos is None else window_segments(buffer, eos)
        return _window_batch(selection, ids, buffer, segments, reader.pieces - pieces_before)

    def build_run(self, ctx: SampleContext, selections: Sequence[Selection]) -> list[Built]:
        """`build` of each of a run of planned batches, the run read as one: its window starts
        located and its windows copied with one index lookup, their document ends found in one
        scan; each batch's window buffer is its own (a view of the run's memory that owns no other
        batch's rows), so what the loop gets is what `build` gives, array for array."""
        _, reader, window_starts, dtype, eos = self._reading(ctx)
        length, width = self.seq_len, self.seq_len + 1
        sizes = [selection.sample_ids.size for selection in selections]
        if len(set(sizes)) > 1:
            return [self.build(ctx, selection) for selection in selections]
        ids = np.concatenate([selection.sample_ids for selection in selections]).astype(np.int64)
        run = np.empty(ids.size * width, dtype=dtype)
        pieces = np.ones(ids.size, dtype=np.int64)
        # each batch's shards held open while its rows are read, as when it is read alone
        reader.copy_windows(run.reshape(ids.size, width), window_starts(ids), pieces, sizes[0])
        if eos is None:
            segments = [_plain_segments(sizes[0], length) for _ in selections]
        else:
            inner = run_document_starts(run.reshape(ids.size, width), eos)
            segments = run_segments(inner, len(selections), sizes[0], length)
        memory = run.data
        out = []
        row = 0
        for selection, size, batch_segments in zip(selections, sizes, segments):
            buffer = np.frombuffer(memory[row * width : (row + size) * width], dtype=dtype).reshape(size, width)
            out.append(
                _window_batch(
                    selection, ids[row : row + size], buffer, batch_segments, int(pieces[row : row + size].sum())
                )
            )
            row += size
        return out


log = logging.getLogger("tierflow.loader")
HINT_SHARDS = 100_000
"""From this many shards, a token-window order with no stored layout says how to store one (once a process)."""
_HINTED: set[tuple[str, int]] = set()


def _window_layout(dataset: Dataset, seq_len: int) -> Any:
    """The layout stored for windows of `seq_len` with a dataset's mapped metadata (format/metadata_windows.py)."""
    from tierflow.format.metadata import MappedManifest

    manifest = dataset.manifest
    return manifest.tables.stored_layout(seq_len) if isinstance(manifest, MappedManifest) else None


def _window_starts(dataset: Dataset, seq_len: int) -> Callable[[np.ndarray], np.ndarray]:
    """Where windows of `seq_len` start: from a stored layout's column, else from every shard's token counts."""
    stored = _window_layout(dataset, seq_len)
    return stored.window_starts if stored is not None else WindowStarts(dataset.token_starts, seq_len)


def _plain_segments(rows: int, length: int) -> tuple[np.ndarray, int, np.ndarray]:
    """The segments of windows that hold no document end: one per row, max_seqlen the window's length."""
    cu_seqlens, _, position_ids = row_segments(rows, length)
    return cu_seqlens, length, position_ids


def _window_batch(
    selection: Selection, ids: np.ndarray, buffer: np.ndarray, segments: tuple[np.ndarray, int, np.ndarray], pieces: int
) -> Built:
    """A token-window batch from its (rows, L + 1) window buffer and its segments (cu_seqlens,
    max_seqlen, position_ids); `pieces`: the slices its rows were copied in."""
    cu_seqlens, max_seqlen, position_ids = segments
    data = {
        "input_ids": buffer[:, :-1],
        "labels": buffer[:, 1:],
        "position_ids": position_ids,
        "cu_seqlens": cu_seqlens,
        "max_seqlen": max_seqlen,
        "mask": selection.mask.copy(),
    }
    stats = {"copied_bytes": buffer.nbytes, "pieces": pieces, "filtered": 0, "samples": int(ids.size)}
    return Built(data, ids, selection.epochs.astype(np.int64), stats)


def bucket_shapes(max_length: int, pad_to_multiple_of: int, max_shapes: int) -> np.ndarray:
    """At most `max_shapes` padded lengths, multiples of `pad_to_multiple_of`, spaced geometrically."""
    if max_shapes < 1 or pad_to_multiple_of < 1 or max_length < 1:
        raise ValueError(
            f"bucket shapes need positive sizes, got max_length={max_length}, "
            f"pad_to_multiple_of={pad_to_multiple_of}, max_shapes={max_shapes}"
        )
    multiple = pad_to_multiple_of
    top = -(-max_length // multiple) * multiple
    every = np.arange(multiple, top + 1, multiple, dtype=np.int64)
    if every.size <= max_shapes:
        return every
    if max_shapes == 1:
        return np.array([top], dtype=np.int64)
    ladder = multiple * (top / multiple) ** (np.arange(max_shapes) / (max_shapes - 1))
    shapes = np.unique(-(-np.ceil(ladder).astype(np.int64) // multiple) * multiple)
    shapes[-1] = top
    return shapes


def list_column(batcher: str, column: str | None, manifest: Manifest) -> str:
    """The list column a length-aware batcher reads: the one named, else the token column."""
    column = column or manifest.token_column
    if column is None:
        raise TypeError(f"{batcher} needs a list column (column=...) or a token dataset")
    return column


@dataclass
class LengthBuckets(SortedGroups):
    """Variable-length token samples, sorted by length within a group of `group` batches, padded
    to the smallest allowed shape (longer samples are truncated to the largest and counted)."""

    max_length: int
    pad_to_multiple_of: int = 64
    max_shapes: int = 8
    group: int = 8
    pad_id: int = 0
    column: str | None = None
    runs_transforms: ClassVar[bool] = False

    def __post_init__(self) -> None:
        self.shapes = bucket_shapes(self.max_length, self.pad_to_multiple_of, self.max_shapes)
        if self.group < 1:
            raise ValueError(f"LengthBuckets group must be >= 1, got {self.group}")

    def columns(self, manifest: Manifest) -> list[str] | None:
        return [list_column("LengthBuckets", self.column, manifest)]

    def shape_for(self, longest: int) -> int:
        index = min(int(np.searchsorted(self.shapes, longest, side="left")), self.shapes.size - 1)
        return int(self.shapes[index])

    def _sorted_group(
        self, ctx: SampleContext, ids: np.ndarray, epochs: np.ndarray
    ) -> tuple[list[np.ndarray], np.ndarray]:
        """The group's rows and their order by length, kept while its parts are built (every part
        of a group is planned with the same `ids` array)."""
        cached = ctx.cache.get("bucket_group")
        if cached is not None and cached[0] is ids:
            return cached[1], cached[2]
        column = list_column("LengthBuckets", self.column, ctx.dataset.manifest)
        rows = [ctx.dataset[int(i)][column] for i in ids]
        lengths = np.array([len(r) for r in rows], dtype=np.int64)
        order = self.epoch_major(lengths, epochs)
        ctx.cache["bucket_group"] = (ids, rows, order)
        return rows, order

    def build(self, ctx: SampleContext, selection: Selection) -> Built:
        ids = selection.sample_ids
        rows, order = self._sorted_group(ctx, ids, selection.epochs)
        pick = self.part_of(order, selection)
        lengths = np.array([len(rows[i]) for i in pick], dtype=np.int64)
        shape = self.shape_for(int(lengths.max()) if lengths.size else 1)
        dtype = np.dtype(ctx.dataset.manifest.token_dtype or np.int32) if self.column is None else rows[0].dtype
        out = np.full((pick.size, shape), self.pad_id, dtype=dtype)
        kept = np.minimum(lengths, shape)
        for row, i in enumerate(pick.tolist()):
            out[row, : kept[row]] = rows[i][: kept[row]]
        real = int(kept.sum())
        data = {"input_ids": out, "lengths": kept.astype(np.int32), "mask": selection.mask[pick]}
        return Built(
            data,
            ids[pick].astype(np.int64),
            selection.epochs[pick].astype(np.int64),
            {
                "copied_bytes": real * out.itemsize,
                "filtered": 0,
                "samples": int(pick.size),
                "real_tokens": real,
                "padded_tokens": int(out.size),
                "truncated": int((lengths > shape).sum()),
            },
        )
