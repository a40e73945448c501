"""Runs of batches: the main process builds the batches the plan already holds a run at a time.

Without workers the dataset builds each batch where the loop asks for it. A batcher with
`build_run` (`TokenWindows`) reads a run of consecutive planned batches as one: one index lookup
and one document-end scan for the run instead of one per batch. The plan is already known, so
nothing about the batches changes: the same samples, arrays, cursors and meta, batch for batch.
Runs grow from one batch (the first batch comes as soon as alone) to `RUN_BATCHES`. A run whose
build fails is built again a batch at a time, so the loop gets every batch before the failing
one and the error at that batch, as without runs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from tierflow.loader._collate import CarriedBatch
from tierflow.loader.plan import Built, Selection

RUN_BATCHES = 16
"""The most batches built as one run (the run's window buffer: 16 x batch x (L + 1) tokens)."""


def built_in_runs(
    plan: Iterable[Selection],
    build_run: Callable[[Sequence[Selection]], list[Built]],
    built: Callable[[Selection], CarriedBatch],
    carry: Callable[[Selection, Built], CarriedBatch],
    before_run: Callable[[Sequence[Selection]], Any] | None = None,
) -> Iterator[CarriedBatch]:
    """The plan's batches, built `build_run` a run at a time (`built`, one at a time, where a run's
    build fails); `before_run` sees each run before it is built."""
    selections = iter(plan)
    size = 1
    while True:
        run = list(itertools.islice(selections, size))
        if not run:
            return
        size = min(2 * size, RUN_BATCHES)
        if before_run is not None:
            before_run(run)
        try:
            made = build_run(run)
        except Exception:
            yield from (built(selection) for selection in run)  # each batch before the failing one, then its error
            continue
        for selection, one in zip(run, made):
            yield carry(selection, one)
