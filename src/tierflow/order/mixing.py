"""Mixing several datasets by weight with a closed-form, seekable schedule.

Weights are quantised to integers q_d = round(w_d / sum(w) * 2^60) (each >= 1). The datasets
sit at the leaves of a balanced binary tree (index halving). At a tree node whose left and
right subtrees weigh QL and QR (Q = QL + QR) and whose draws so far number g, the left subtree
has received floor((QL * g + phi) / Q) of them, phi = derive_key("mix", seed, lo, hi) mod Q;
draw g goes left exactly when that count steps up between g and g + 1. So the count of dataset
d after g draws is a descent of depth ceil(log2 D), exact integer arithmetic, O(log D), and it
stays within depth of w_d * g. Datasets are endless streams (each has its own epochs), so a small
dataset is up-sampled by repetition with a fresh shuffle per epoch.
The schedule's draw counter is a node's batch count: draw g is node batch g of the mixture.
"""

from __future__ import annotations

from collections.abc import Sequence

from tierflow.order._keys import derive_key

_RESOLUTION = 1 << 60


class MixtureSchedule:
    """Which dataset supplies draw g, and how many draws each dataset has had before g."""

    def __init__(self, weights: Sequence[float], seed: int = 0) -> None:
        if not weights:
            raise ValueError("MixtureSchedule needs at least one weight")
        if any(not w > 0 for w in weights):
            raise ValueError(f"mixture weights must all be positive, got {list(weights)}")
        total = float(sum(weights))
        self.quanta = [max(1, round(w / total * _RESOLUTION)) for w in weights]
        self.seed = seed
        self._splits: dict[tuple[int, int], tuple[int, int, int, int]] = {}
        self._prefix = [0]
        for q in self.quanta:
            self._prefix.append(self._prefix[-1] + q)

    @property
    def num_datasets(self) -> int:
        return len(self.quanta)

    def _split(self, lo: int, hi: int) -> tuple[int, int, int, int]:
        cached = self._splits.get((lo, hi))
        if cached is not None:
            return cached
        mid = (lo + hi) // 2
        left = self._prefix[mid] - self._prefix[lo]
        whole = self._prefix[hi] - self._prefix[lo]
        phase = derive_key("mix", self.seed, lo, hi) % whole
        self._splits[(lo, hi)] = (mid, left, whole, phase)
        return mid, left, whole, phase

    def dataset_of(self, draw: int) -> tuple[int, int]:
        """(dataset, that dataset's own draw index) for mixture draw `draw`."""
        lo, hi, local = 0, self.num_datasets, draw
        while hi - lo > 1:
            mid, left, whole, phase = self._split(lo, hi)
            before = (left * local + phase) // whole
            if (left * (local + 1) + phase) // whole > before:
                hi, local = mid, before
            else:
                lo, local = mid, local - before
        return lo, local

    def counts_after(self, draws: int) -> list[int]:
        """Draws each dataset has received among the first `draws`."""
        counts = [0] * self.num_datasets
        stack = [(0, self.num_datasets, draws)]
        while stack:
            lo, hi, local = stack.pop()
            if hi - lo == 1:
                counts[lo] = local
                continue
            mid, left, whole, phase = self._split(lo, hi)
            to_left = (left * local + phase) // whole
            stack.append((lo, mid, to_left))
            stack.append((mid, hi, local - to_left))
        return counts
