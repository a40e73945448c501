"""The resume guarantee as one check anyone can run against their own batcher or dataset.

`assert_resumes_exactly(make_loader, stops, workers)` iterates a reference run; then for each stop
s it consumes s batches from a new Loader, saves its `state_dict()` through JSON, loads it into
another new Loader and consumes the rest. The concatenation must equal the reference bit for bit:
the same keys, dtypes and values, the same samples (meta's sample ids and epochs), the same cursor
after every batch, and the same final state.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Sequence

import numpy as np

if TYPE_CHECKING:
    from tierflow.loader import Loader

Taken = list[tuple[dict[str, Any], Any]]
"""Batches with their `BatchMeta`."""


def take(loader: Loader, count: int) -> Taken:
    """Up to `count` batches of one `for` over `loader`, each with its meta."""
    out: Taken = []
    if count <= 0:
        return out
    for batch in loader:
        assert isinstance(batch, dict), "a Loader opened without return_meta=True: its meta is last_meta"
        assert loader.last_meta is not None
        out.append((batch, loader.last_meta))
        if len(out) == count:
            break
    return out


def _same_value(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.cpu(), b.cpu())
        )
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(a, b) and np.asarray(a).dtype == np.asarray(b).dtype
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):  # e.g. unpadded ragged columns
        return type(a) is type(b) and len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    return bool(a == b)


def assert_same_batches(reference: Taken, got: Taken, context: str = "") -> None:
    """Batch for batch: the same data (keys, dtypes, values) and meta (samples, epoch, cursor, stats)."""
    assert len(got) == len(reference), f"{context}: {len(got)} batches, the reference has {len(reference)}"
    for n, ((want, want_meta), (have, have_meta)) in enumerate(zip(reference, got)):
        where = f"{context}: batch {n}"
        assert list(have) == list(want), f"{where}: keys {list(have)} != {list(want)}"
        for key in want:
            assert _same_value(want[key], have[key]), f"{where}: {key!r} differs"
        assert np.array_equal(want_meta.sample_ids, have_meta.sample_ids), f"{where}: sample ids differ"
        assert np.array_equal(want_meta.epochs, have_meta.epochs), f"{where}: sample epochs differ"
        assert want_meta.epoch == have_meta.epoch, f"{where}: epoch {have_meta.epoch} != {want_meta.epoch}"
        assert want_meta.cursor.to_dict() == have_meta.cursor.to_dict(), f"{where}: cursor differs"
        assert want_meta.stats == have_meta.stats, f"{where}: stats {have_meta.stats} != {want_meta.stats}"


def assert_resumes_exactly(
    make_loader: Callable[[int], Loader], stops: Sequence[int], workers: int = 0, batches: int | None = None
) -> None:
    """Resuming after any of `stops` batches yields exactly the uninterrupted run's batches.

    `make_loader(num_workers)` builds a new dataset and `Loader` from the beginning on each call.
    The reference takes `batches` (default max(stops) + 3), fewer if its stream ends first (eval);
    a resumed run must then end there too.
    """
    total = batches if batches is not None else max(stops) + 3
    reference_loader = make_loader(workers)
    with reference_loader:
        reference = take(reference_loader, total)
        final = reference_loader.state_dict()
    ended = len(reference) < total
    for stop in stops:
        if not 0 < stop < len(reference):
            raise ValueError(f"stop {stop} outside the reference run of {len(reference)} batches")
        with make_loader(workers) as first:
            head = take(first, stop)
            state = json.loads(json.dumps(first.state_dict()))
        with make_loader(workers) as resumed:
            resumed.load_state_dict(state)
            tail = take(resumed, len(reference) - stop + (1 if ended else 0))
            end = resumed.state_dict()
        context = f"resumed after {stop} batches with {workers} workers"
        assert_same_batches(reference, head + tail, context)
        assert end == final, f"{context}: final state {end} != {final}"
