"""Evaluation order: stored order, no shuffle, every sample exactly once, padded with a mask.

The dataset's ids 0..n-1 are cut into ceil(n / B) batches; global rank q of Q (q = node * R +
local rank) takes the contiguous block of batches [q * S, (q + 1) * S) with S = ceil(batches / Q),
so reads stay sequential and every rank runs the same S steps (no collective hangs). The last
real batch is filled by repeating its own ids and batches past the end repeat the last id; the
mask is False on every repeat. Worker w of W builds the rank's steps s = w (mod W).
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Iterator

import numpy as np


@dataclass(frozen=True)
class EvalBatch:
    step: int
    sample_ids: np.ndarray
    mask: np.ndarray


class EvalOrder:
    """Unshuffled, exactly-once order over `num_samples` ids for `world_size` ranks."""

    def __init__(self, num_samples: int, *, batch_size: int, world_size: int = 1) -> None:
        if num_samples < 1 or batch_size < 1 or world_size < 1:
            raise ValueError(
                f"EvalOrder needs positive num_samples, batch_size and world_size; got "
                f"{num_samples}, {batch_size}, {world_size}"
            )
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.world_size = world_size
        self.num_batches = -(-num_samples // batch_size)
        self.steps = -(-self.num_batches // world_size)

    def batch(self, rank: int, step: int) -> EvalBatch:
        if not 0 <= rank < self.world_size or not 0 <= step < self.steps:
            raise IndexError(f"rank {rank} step {step} outside {self.world_size} ranks x {self.steps} steps")
        start = (rank * self.steps + step) * self.batch_size
        stop = min(start + self.batch_size, self.num_samples)
        mask = np.zeros(self.batch_size, dtype=bool)
        if start >= self.num_samples:
            return EvalBatch(step, np.full(self.batch_size, self.num_samples - 1, dtype=np.int64), mask)
        mask[: stop - start] = True
        return EvalBatch(step, np.resize(np.arange(start, stop, dtype=np.int64), self.batch_size), mask)

    def rank_batches(self, rank: int, worker: int = 0, num_workers: int = 1) -> Iterator[EvalBatch]:
        for step in range(worker, self.steps, num_workers):
            yield self.batch(rank, step)
