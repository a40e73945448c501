"""Runs of batches: the main process builds the batches the plan already holds a run at a time.

Without workers the dataset builds each batch where the loop asks for it. A batcher with
`build_run` (`TokenWindows`) reads a run of consecutive planned batches as one: one index lookup
and one document-end scan for the run instead of one per batch. The plan is already known, so
nothing about the batches changes: the same samples, arrays, cursors and meta, batch for batch.
Runs grow from one batch (the first batch comes as soon as alone) to `RUN_BATCHES`, and end at
an epoch's edge (the next epoch's first batch opens the next run: nothing of an epoch is read
before the loop has taken the last one's, and a narrowed first epoch's bound widens there). A run whose
build fails is built again a batch at a time, so the loop gets every batch before the failing
one and the error at that batch, as without runs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from tierflow.loader._collate import CarriedBatch
from tierflow.loader.batching import SampleContext
from tierflow.loader.plan import Built, Selection
from tierflow.telemetry.attribution import AttributedShards
from tierflow.tiers.stack import TierStack

RUN_BATCHES = 16
"""The most batches built as one run (the run's window buffer: 16 x batch x (L + 1) tokens)."""
STAGED_RUN_BATCHES = 2
"""... through a tier stack: its stager stages from the batch the loop consumed, so a reader running
further ahead asks for entries not staged yet while the tier is full of staged ones in use."""


def longest_run(source: object, batcher: object) -> int:
    """The most batches a run of `batcher` (its `run_batches`, else RUN_BATCHES) reads from `source`
    (a dataset's shard supply, telemetry's wrap seen through)."""
    while isinstance(source, AttributedShards):
        source = source.source
    longest = getattr(batcher, "run_batches", RUN_BATCHES)
    return min(STAGED_RUN_BATCHES, longest) if isinstance(source, TierStack) else longest


def built_in_runs(
    plan: Iterable[Selection],
    build_run: Callable[[Sequence[Selection]], list[Built]],
    built: Callable[[Selection], CarriedBatch],
    carry: Callable[[Selection, Built], CarriedBatch],
    before_run: Callable[[Sequence[Selection]], Any] | None = None,
    longest: int = RUN_BATCHES,
) -> Iterator[CarriedBatch]:
    """The plan's batches, built `build_run` a run of at most `longest` at a time (`built`, one at a
    time, where a run's build fails); `before_run` sees each run before it is built."""
    selections = iter(plan)
    held: list[Selection] = []  # the next epoch's first batch, met at the end of a run
    size = 1
    while True:
        run = held + list(itertools.islice(selections, max(0, size - len(held))))
        held = []
        if not run:
            return
        for cut, selection in enumerate(run[1:], 1):
            if selection.epoch != run[0].epoch:  # a run stays inside one epoch
                run, held = run[:cut], run[cut:]
                break
        size = min(2 * size, longest)
        if before_run is not None:
            before_run(run)
        try:
            made = build_run(run)
        except Exception:
            yield from (built(selection) for selection in run)  # each batch before the failing one, then its error
            continue
        for selection, one in zip(run, made):
            yield carry(selection, one)


def main_process_batches(dataset: Any, ctx: SampleContext, plan: Iterable[Selection]) -> Iterator[CarriedBatch]:
    """A `TieredDataset`'s batches built in this process: in runs where its batcher reads a run as
    one (`build_run`) and no filter, transform or collate runs per sample, else a batch at a time."""
    build_run = getattr(dataset.batcher, "build_run", None)
    if build_run is None or (dataset.filter, dataset.transform, dataset.collate) != (None, None, None):
        return (dataset._built(ctx, selection) for selection in plan)
    return built_in_runs(
        plan,
        lambda run: build_run(ctx, run),
        lambda selection: dataset._built(ctx, selection),
        dataset._carry,
        lambda run: dataset._widen(ctx, run),
        longest_run(ctx.dataset.source, dataset.batcher),
    )
