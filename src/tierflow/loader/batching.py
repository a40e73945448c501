"""Batchers: how the order's samples of one order batch become the training loop's batches.

A batcher is a small object with one job. `Samples` collates dataset rows (dict of columns);
`TokenWindows` makes fixed-length windows over the token stream (the window is the order's
sample); `LengthBuckets` sorts a group of `group` order batches' worth of variable-length samples
by length and cuts it into `group` batches whose padded lengths come from a bounded set of
shapes. A batcher turns one order batch into `batches_per_group` output batches, always the same
number, so a batch's position alone locates it (no look-back, exact resume).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from tierflow.format.dataset import Dataset
from tierflow.format.manifest import Manifest
from tierflow.format.reads import TokenReader
from tierflow.loader.collate import collate_samples
from tierflow.loader.tokens import document_segments, window_counts, window_token_starts
from tierflow.order import sample_rng

Transform = Callable[[dict, np.random.Generator], dict]
Filter = Callable[[dict], bool]


@dataclass
class SampleContext:
    """Per-process reading state handed to a batcher (built lazily in each DataLoader worker)."""

    dataset: Dataset
    seed: int
    transform: Transform | None = None
    filter: Filter | None = None
    cache: dict[str, Any] = field(default_factory=dict)


class Batcher(Protocol):
    batches_per_group: int

    def tag(self) -> str:
        """Names the order's sample unit: cursors of different units never mix."""

    def columns(self, manifest: Manifest) -> list[str] | None:
        """Columns the batcher reads (projection), None for all."""

    def order_counts(self, dataset: Dataset) -> np.ndarray:
        """Per shard, the number of order samples (rows or windows) it starts."""

    def build(self, ctx: SampleContext, group: int, ids: np.ndarray, epochs: np.ndarray, mask: np.ndarray,
              sub: int) -> dict[str, Any]:
        """Output batch `sub` of the order batch `group` (ids, epochs, mask of that order batch)."""


def _rows(ctx: SampleContext, ids: np.ndarray) -> list[dict[str, Any]]:
    return [ctx.dataset[int(i)] for i in ids]


@dataclass
class Samples:
    """Dataset rows as a dict of columns; `transform`/`filter` of the context run per sample."""

    pad: bool = False
    pad_value: int | float = 0
    select: Sequence[str] | None = None
    batches_per_group: int = 1

    def tag(self) -> str:
        return "samples"

    def columns(self, manifest: Manifest) -> list[str] | None:
        return list(self.select) if self.select is not None else None

    def order_counts(self, dataset: Dataset) -> np.ndarray:
        return np.array([s.samples for s in dataset.manifest.shards], dtype=np.int64)

    def build(self, ctx, group, ids, epochs, mask, sub):
        kept_ids, kept_epochs, kept_mask, samples = [], [], [], []
        filtered = 0
        for sample_id, epoch, real, sample in zip(ids.tolist(), epochs.tolist(), mask.tolist(), _rows(ctx, ids)):
            if ctx.filter is not None and not ctx.filter(sample):
                filtered += 1
                continue
            if ctx.transform is not None:
                sample = ctx.transform(sample, sample_rng(ctx.seed, epoch, sample_id))
            samples.append(sample)
            kept_ids.append(sample_id)
            kept_epochs.append(epoch)
            kept_mask.append(real)
        names = list(samples[0].keys()) if samples else list(ctx.dataset.columns)
        batch, copied = collate_samples(samples, names, self.pad, self.pad_value)
        batch["mask"] = np.array(kept_mask, dtype=bool)
        batch["tf_sample_ids"] = np.array(kept_ids, dtype=np.int64)
        batch["tf_epochs"] = np.array(kept_epochs, dtype=np.int64)
        batch["tf_stats"] = {"copied_bytes": copied, "filtered": filtered, "samples": len(samples)}
        return batch


@dataclass
class TokenWindows:
    """Windows of L + 1 tokens inside one shard (tokens.py); input_ids/labels are views of one
    (B, L+1) buffer."""

    seq_len: int
    batches_per_group: int = 1

    def tag(self) -> str:
        return f"windows:{self.seq_len}"

    def columns(self, manifest: Manifest) -> list[str] | None:
        if manifest.token_column is None:
            raise TypeError("TokenWindows needs a token dataset (packed with a tokenizer)")
        return [manifest.token_column]

    def order_counts(self, dataset: Dataset) -> np.ndarray:
        return window_counts(dataset.token_starts, self.seq_len)

    def build(self, ctx, group, ids, epochs, mask, sub):
        reader = ctx.cache.get("tokens")
        if reader is None:
            reader = ctx.cache["tokens"] = TokenReader(ctx.dataset)
        length = self.seq_len
        dtype = np.dtype(ctx.dataset.manifest.token_dtype or np.uint16)
        buffer = np.empty((ids.size, length + 1), dtype=dtype)
        pieces_before = reader.pieces
        reader.copy_windows(buffer, window_token_starts(ctx.dataset.token_starts, length, ids.astype(np.int64)))
        inputs = buffer[:, :-1]
        eos = ctx.dataset.manifest.eos_id
        if eos is None:
            cu_seqlens = np.arange(0, (ids.size + 1) * length, length, dtype=np.int32)
            max_seqlen = length
            position_ids = np.broadcast_to(np.arange(length, dtype=np.int32), inputs.shape).copy()
        else:
            cu_seqlens, max_seqlen, position_ids = document_segments(inputs, eos)
        return {
            "input_ids": inputs,
            "labels": buffer[:, 1:],
            "position_ids": position_ids,
            "cu_seqlens": cu_seqlens,
            "max_seqlen": max_seqlen,
            "mask": mask.copy(),
            "tf_sample_ids": ids.astype(np.int64),
            "tf_epochs": epochs.astype(np.int64),
            "tf_stats": {"copied_bytes": buffer.nbytes, "pieces": reader.pieces - pieces_before,
                         "filtered": 0, "samples": int(ids.size)},
        }


def bucket_shapes(max_length: int, pad_to_multiple_of: int, max_shapes: int) -> np.ndarray:
    """At most `max_shapes` padded lengths, multiples of `pad_to_multiple_of`, spaced geometrically."""
    if max_shapes < 1 or pad_to_multiple_of < 1 or max_length < 1:
        raise ValueError(f"bucket shapes need positive sizes, got max_length={max_length}, "
                         f"pad_to_multiple_of={pad_to_multiple_of}, max_shapes={max_shapes}")
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


@dataclass
class LengthBuckets:
    """Variable-length token samples, sorted by length within a group of `group` batches, padded
    to the smallest allowed shape (longer samples are truncated to the largest and counted)."""

    max_length: int
    pad_to_multiple_of: int = 64
    max_shapes: int = 8
    group: int = 8
    pad_id: int = 0
    column: str | None = None

    def __post_init__(self) -> None:
        self.shapes = bucket_shapes(self.max_length, self.pad_to_multiple_of, self.max_shapes)
        if self.group < 1:
            raise ValueError(f"LengthBuckets group must be >= 1, got {self.group}")

    @property
    def batches_per_group(self) -> int:
        return self.group

    def tag(self) -> str:
        return "samples"

    def _column(self, manifest: Manifest) -> str:
        column = self.column or manifest.token_column
        if column is None:
            raise TypeError("LengthBuckets needs a list column (column=...) or a token dataset")
        return column

    def columns(self, manifest: Manifest) -> list[str] | None:
        return [self._column(manifest)]

    def order_counts(self, dataset: Dataset) -> np.ndarray:
        return np.array([s.samples for s in dataset.manifest.shards], dtype=np.int64)

    def shape_for(self, longest: int) -> int:
        index = min(int(np.searchsorted(self.shapes, longest, side="left")), self.shapes.size - 1)
        return int(self.shapes[index])

    def _sorted_group(self, ctx: SampleContext, group: int, ids: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
        cached = ctx.cache.get("bucket_group")
        if cached is not None and cached[0] == group:
            return cached[1], cached[2]
        column = self._column(ctx.dataset.manifest)
        rows = [ctx.dataset[int(i)][column] for i in ids]
        lengths = np.array([len(r) for r in rows], dtype=np.int64)
        order = np.argsort(lengths, kind="stable")
        ctx.cache["bucket_group"] = (group, rows, order)
        return rows, order

    def build(self, ctx, group, ids, epochs, mask, sub):
        if ctx.filter is not None or ctx.transform is not None:
            raise ValueError("LengthBuckets does not run filter/transform (use Samples)")
        rows, order = self._sorted_group(ctx, group, ids)
        size = ids.size // self.group
        pick = order[sub * size:(sub + 1) * size]
        lengths = np.array([len(rows[i]) for i in pick], dtype=np.int64)
        shape = self.shape_for(int(lengths.max()) if lengths.size else 1)
        dtype = np.dtype(ctx.dataset.manifest.token_dtype or np.int32) if self.column is None else rows[0].dtype
        out = np.full((pick.size, shape), self.pad_id, dtype=dtype)
        kept = np.minimum(lengths, shape)
        for row, i in enumerate(pick.tolist()):
            out[row, :kept[row]] = rows[i][:kept[row]]
        real = int(kept.sum())
        return {
            "input_ids": out,
            "lengths": kept.astype(np.int32),
            "mask": mask[pick].copy(),
            "tf_sample_ids": ids[pick].astype(np.int64),
            "tf_epochs": epochs[pick].astype(np.int64),
            "tf_stats": {"copied_bytes": real * out.itemsize, "filtered": 0, "samples": int(pick.size),
                         "real_tokens": real, "padded_tokens": int(out.size),
                         "truncated": int((lengths > shape).sum())},
        }
