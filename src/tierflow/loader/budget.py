"""Token-budget batches: variable-length samples packed into one row of at most `max_tokens` tokens.

This stage is many-to-one: how many samples a batch takes depends on their lengths, so batches no
longer line up with the order's batches. The rank pulls order batches from its own stream into a
bounded buffer of pending samples and fills each batch first-fit from it, oldest first (the oldest
pending sample always fits an empty batch, so none waits forever). The cursor after a batch is
the order position of the next order batch to pull plus the pending samples' ids and epochs:
resume is exact, and the state is bounded by the buffer. Every DataLoader worker runs the same
plan (it needs only lengths, read from the list offsets) and builds its own batches of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar
from collections.abc import Callable, Iterator

import numpy as np

from tierflow.errors import CursorError
from tierflow.format.dataset import Dataset
from tierflow.format.manifest import Manifest
from tierflow.format.reads import SampleLengths
from tierflow.loader.batching import OrderCounts, SampleContext, list_column, shard_samples
from tierflow.loader.cursor import LoaderCursor, Pending
from tierflow.loader.plan import Built, OrderBatch, OrderStream, Selection, TrainStream, batch_epoch

IGNORE_INDEX = -100


@dataclass
class TokenBudget:
    """Batches of whole samples (documents) with at most `max_tokens` tokens in all.

    A batch is one row padded to `max_tokens` (a fixed shape for torch.compile): `input_ids`
    (1, max_tokens), next-token `labels` int32 with -100 at each sample's last token and on
    padding, `position_ids` restarting per sample, int32 `cu_seqlens` over the samples plus the
    padding as a final segment (so it ends at max_tokens), `max_seqlen`, `lengths`. A sample longer
    than `max_tokens` is truncated to it and counted. The buffer keeps pulling while it holds
    fewer than `lookahead` x max_tokens tokens and fewer than `max_pending` samples. Its piece of
    the cursor is the pending samples and the rank whose stream they came from.
    """

    max_tokens: int
    lookahead: float = 2.0
    max_pending: int = 2048
    pad_id: int = 0
    column: str | None = None
    batches_per_group: ClassVar[int] = 1
    runs_transforms: ClassVar[bool] = False
    plans_eval: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.lookahead < 1 or self.max_pending < 1:
            raise ValueError(
                f"TokenBudget needs lookahead >= 1 and max_pending >= 1, got {self.lookahead} and {self.max_pending}"
            )

    def tag(self) -> str:
        return "samples"

    def columns(self, manifest: Manifest) -> list[str]:
        return [list_column("TokenBudget", self.column, manifest)]

    def order_counts(self, dataset: Dataset) -> OrderCounts:
        return shard_samples(dataset)

    def check_resume(self, cursor: LoaderCursor) -> None:
        if cursor.skip:
            raise CursorError(f"cursor skips {cursor.skip} batches of a group; a token budget has no groups")

    def planner(
        self, pending: Pending | None = None, lengths: Callable[[np.ndarray], np.ndarray] | None = None
    ) -> BudgetPlanner:
        """The pending buffer, holding `pending` (whose lengths `lengths` gives) when resuming."""
        planner = BudgetPlanner(self.max_tokens, int(self.lookahead * self.max_tokens), self.max_pending)
        if pending is not None and pending.ids:
            ids = np.asarray(pending.ids, dtype=np.int64)
            assert lengths is not None
            planner.add(ids, np.asarray(pending.epochs, dtype=np.int64), lengths(ids))
        return planner

    def plan(self, ctx: SampleContext, stream: OrderStream, state: LoaderCursor | None) -> Iterator[Selection]:
        """Every worker plans the rank's whole budget stream (lengths only) and yields its own batches.

        A batch's epoch is the oldest still unconsumed once it is taken (its own samples, those
        pending, the next order batch's: order batches come in epoch order), so an epoch's `for`
        ends only when every sample of it is in a batch, however the lanes reach their epoch ends."""
        lengths = ctx.cache.get("lengths")
        if lengths is None:
            lengths = ctx.cache["lengths"] = SampleLengths(ctx.dataset, self.columns(ctx.dataset.manifest)[0])
        planner = self.planner(state.pending if state is not None else None, lengths)
        carry = isinstance(stream, TrainStream) and stream.carries
        pulled = n = 0
        upcoming = None  # the next order batch, read ahead for its epoch
        while stream.limit is None or n < stream.limit:
            while planner.wants_more():
                order_batch = upcoming if upcoming is not None else stream.batch(pulled)
                upcoming = None
                real = order_batch.sample_ids[order_batch.mask]
                planner.add(real, order_batch.epochs[order_batch.mask], lengths(real))
                pulled += 1
            if upcoming is None:
                upcoming = stream.batch(pulled)
            ids, epochs = planner.take(fill=carry and _first_epoch(upcoming) > planner.oldest_epoch())
            if stream.owns(n):
                mask = np.ones(ids.size, dtype=bool)
                epoch = min(batch_epoch(epochs, mask), planner.oldest_epoch(), _first_epoch(upcoming))
                yield Selection(n, ids, epochs, mask, stream.cursor(pulled - 1, pending=planner.state()), epoch)
            n += 1

    def build(self, ctx: SampleContext, selection: Selection) -> Built:
        dataset, ids = ctx.dataset, selection.sample_ids
        rows = [dataset[int(i)][self.columns(dataset.manifest)[0]] for i in ids]
        dtype = rows[0].dtype if rows else np.dtype(dataset.manifest.token_dtype or np.int32)
        full = np.array([len(r) for r in rows], dtype=np.int64)
        kept = np.minimum(full, self.max_tokens)
        real = int(kept.sum())
        out = np.full((1, self.max_tokens), self.pad_id, dtype=dtype)
        labels = np.full((1, self.max_tokens), IGNORE_INDEX, dtype=np.int32)
        position_ids = np.zeros((1, self.max_tokens), dtype=np.int32)
        at = 0
        for row, n in zip(rows, kept.tolist()):
            out[0, at : at + n] = row[:n]
            labels[0, at : at + n - 1] = out[0, at + 1 : at + n]
            position_ids[0, at : at + n] = np.arange(n, dtype=np.int32)
            at += n
        segments = kept.tolist() + ([self.max_tokens - real] if real < self.max_tokens else [])
        position_ids[0, real:] = np.arange(self.max_tokens - real, dtype=np.int32)
        cu_seqlens = np.concatenate([[0], np.cumsum(segments)]).astype(np.int32)
        data = {
            "input_ids": out,
            "labels": labels,
            "position_ids": position_ids,
            "cu_seqlens": cu_seqlens,
            "max_seqlen": int(max(segments)) if segments else 0,
            "lengths": kept.astype(np.int32),
            "mask": selection.mask,
        }
        return Built(
            data,
            ids.astype(np.int64),
            selection.epochs.astype(np.int64),
            {
                "copied_bytes": real * out.itemsize,
                "filtered": 0,
                "samples": int(ids.size),
                "real_tokens": real,
                "padded_tokens": self.max_tokens,
                "truncated": int((full > self.max_tokens).sum()),
            },
        )


_NONE_PENDING = 2**62


def _first_epoch(order_batch: OrderBatch) -> int:
    """The epoch an order batch starts in (its oldest real sample's)."""
    return order_batch.epoch if order_batch.epoch is not None else batch_epoch(order_batch.epochs, order_batch.mask)


class BudgetPlanner:
    """The pending buffer and the first-fit choice; deterministic in (pending, stream position)."""

    def __init__(self, max_tokens: int, buffer_tokens: int, max_pending: int) -> None:
        self.max_tokens = max_tokens
        self.buffer_tokens = buffer_tokens
        self.max_pending = max_pending
        self.ids = np.zeros(0, dtype=np.int64)
        self.epochs = np.zeros(0, dtype=np.int64)
        self.lengths = np.zeros(0, dtype=np.int64)

    def wants_more(self) -> bool:
        return int(self.lengths.sum()) < self.buffer_tokens and self.ids.size < self.max_pending

    def add(self, ids: np.ndarray, epochs: np.ndarray, lengths: np.ndarray) -> None:
        self.ids = np.concatenate([self.ids, ids.astype(np.int64)])
        self.epochs = np.concatenate([self.epochs, epochs.astype(np.int64)])
        self.lengths = np.concatenate([self.lengths, np.minimum(lengths.astype(np.int64), self.max_tokens)])

    def oldest_epoch(self) -> int:
        """The oldest epoch among the pending samples (a huge number when none is pending)."""
        return int(self.epochs.min()) if self.epochs.size else _NONE_PENDING

    def take(self, fill: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """(ids, epochs) of the next batch, removed from the buffer; first-fit in buffer order among
        the oldest epoch's samples (lanes reach their epoch ends apart, so a lane's next-epoch
        samples can be pulled before another lane's last ones: those go first). Later epochs'
        samples fill a batch only once it holds every one of the oldest epoch's left and `fill`
        (none of that epoch is still to be pulled, remainder="carry"): so the epoch's last batch is
        the only one with two epochs (a fill first-fit over all epochs made two or three)."""
        if self.epochs.size > 1 and bool((self.epochs[1:] < self.epochs[:-1]).any()):
            order = np.argsort(self.epochs, kind="stable")
            self.ids, self.epochs, self.lengths = self.ids[order], self.epochs[order], self.lengths[order]
        lengths = self.lengths
        oldest = int(np.searchsorted(self.epochs, self.epochs[0], side="right")) if lengths.size else 0
        chosen = np.zeros(lengths.size, dtype=bool)
        budget = _first_fit(lengths[:oldest], chosen[:oldest], self.max_tokens)
        if fill and oldest < lengths.size and chosen[:oldest].all():
            _first_fit(lengths[oldest:], chosen[oldest:], budget)
        ids, epochs = self.ids[chosen], self.epochs[chosen]
        keep = ~chosen
        self.ids, self.epochs, self.lengths = self.ids[keep], self.epochs[keep], self.lengths[keep]
        return ids, epochs

    def state(self) -> Pending:
        return Pending(tuple(self.ids.tolist()), tuple(self.epochs.tolist()))


def _first_fit(lengths: np.ndarray, chosen: np.ndarray, budget: int) -> int:
    """Marks in `chosen` (a view) the samples of `lengths` that fit `budget` first-fit in order; the
    budget left."""
    start = 0
    while start < lengths.size and budget > 0:
        # the run of consecutive samples from `start` that fits goes in at once ...
        run = int(np.searchsorted(np.cumsum(lengths[start:]), budget, side="right"))
        chosen[start : start + run] = True
        budget -= int(lengths[start : start + run].sum())
        # ... then the next sample that still fits, skipping those that do not
        later = np.flatnonzero(lengths[start + run :] <= budget) if budget > 0 else np.zeros(0, np.int64)
        if later.size == 0:
            break
        start = start + run + int(later[0])
    return budget
