"""Which worker builds each output batch.

DataLoader takes its workers' batches in turn, so under it worker w builds the batches n = w (mod
W) (`RoundRobin`). The Loader's own pool takes batch n from whichever worker built it, so it deals
the batches by what they read instead (`LaneSticky`): a lane's batches stay with one worker, which
decodes that lane's blocks, while every batch of a lane dealt in turn made each worker decode most
blocks (`benchmarks/peers/ownership.py`, 2 workers: 1.79 decodes a block for the peers' tokens, 1.58
for their documents; by lane with a lag of 8: 1.21 and 1.24). Who builds a batch never changes
what it holds, so the order and the cursors are the same however the batches are dealt.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

KEPT = 4096
"""Owners a `LaneSticky` keeps behind the last one asked for (its callers ask in order)."""


class RoundRobin:
    """Batch n to worker n mod W: the order DataLoader takes its workers' batches in."""

    def __init__(self, workers: int) -> None:
        self.workers = workers

    def owner(self, n: int) -> int:
        return n % self.workers

    def owned(self, worker: int) -> Iterator[int]:
        """The batches `worker` builds, in order (endless)."""
        return itertools.count(worker, self.workers)


class LaneSticky:
    """Each batch to the worker that built its lane's last batch, unless that worker has been dealt
    `lag` batches more than the least dealt one: then the lane moves to the least dealt worker.

    The lag bounds how far apart the workers run (the pool's ring holds a worker's batches until the
    loop reaches them: a lag within its slots keeps both building). `lane_of(n)`: a key of output
    batch n, the same in every process dealing it (the lane its order batch reads first). Deterministic:
    the training process and each worker deal the same batches from the same start alike."""

    def __init__(self, lane_of: Callable[[int], int], workers: int, lag: int) -> None:
        if workers < 1 or lag < 1:
            raise ValueError(f"LaneSticky needs workers >= 1 and lag >= 1, got {workers} and {lag}")
        self.workers = workers
        self.lag = lag
        self._lane_of = lane_of
        self._restart()

    def _restart(self) -> None:
        self._first = 0  # the batch _owners[0] is the owner of
        self._owners: list[int] = []
        self._held: dict[int, int] = {}
        self._dealt = [0] * self.workers

    def owner(self, n: int) -> int:
        if n < self._first:  # asked behind what is kept: deal again from the start
            self._restart()
        while n >= self._first + len(self._owners):
            self._deal()
        return self._owners[n - self._first]

    def owned(self, worker: int) -> Iterator[int]:
        """The batches `worker` builds, in order (endless)."""
        return (n for n in itertools.count() if self.owner(n) == worker)

    def _deal(self) -> None:
        lane = self._lane_of(self._first + len(self._owners))
        dealt = self._dealt
        least = min(dealt)
        worker = self._held.get(lane)
        if worker is None or dealt[worker] >= least + self.lag:
            worker = self._held[lane] = dealt.index(least)
        dealt[worker] += 1
        self._owners.append(worker)
        if len(self._owners) >= 2 * KEPT:
            del self._owners[:KEPT]
            self._first += KEPT


Ownership = RoundRobin | LaneSticky

__all__ = ["LaneSticky", "Ownership", "RoundRobin"]
