"""A keyed pseudo-random permutation of range(n): a Feistel network with cycle-walking.

The algorithm (pinned by golden vectors in tests/test_order_permutation.py):
- the domain is 2^b with b = bit_length(n - 1), the smallest power of two >= n
  (sizing it from ceil(log2(n)) in float arithmetic is the bug that repeats a record);
- 6 rounds of an alternating unbalanced Feistel network: with x = L * 2^w + R
  (R has w bits, L has b - w bits) a round maps x to R * 2^(b-w) + (L xor F_r(R)),
  F_r(R) = splitmix64(R xor k_r) mod 2^(b-w), k_r = splitmix64(key xor r);
  the first round has w = b // 2 and each round's w is the previous round's b - w;
- cycle-walking: while the result is >= n, apply the network again.
Each round is a bijection of the domain, so the walk returns to range(n) and the map is a
bijection of range(n).
"""

from __future__ import annotations

import numpy as np

from tierflow.order._keys import MASK64, splitmix64, splitmix64_array

ROUNDS = 6
_MAX_SIZE = 1 << 62


class FeistelPermutation:
    """The permutation of range(size) selected by a 64-bit key; evaluated, never stored."""

    def __init__(self, size: int, key: int) -> None:
        if not 0 <= size <= _MAX_SIZE:
            raise ValueError(f"permutation size {size} outside [0, 2^62]")
        self.size = size
        self.key = key & MASK64
        self.bits = max(size - 1, 0).bit_length()
        self._round_keys = [np.uint64(splitmix64(self.key ^ r)) for r in range(ROUNDS)]
        right_width = self.bits // 2
        self._widths = []
        for _ in range(ROUNDS):
            self._widths.append((np.uint64(right_width), np.uint64(self.bits - right_width)))
            right_width = self.bits - right_width

    def _network(self, x: np.ndarray) -> np.ndarray:
        one = np.uint64(1)
        for round_key, (right_width, left_width) in zip(self._round_keys, self._widths):
            right = x & ((one << right_width) - one)
            left = x >> right_width
            mixed = splitmix64_array(right ^ round_key)
            mixed &= (one << left_width) - one
            left ^= mixed
            right <<= left_width
            right |= left
            x = right
        return x

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """Images of `positions` (each in range(size)) as int64."""
        positions = np.asarray(positions)
        if positions.size and (positions.min() < 0 or positions.max() >= self.size):
            raise IndexError(f"positions outside range({self.size}) for {self!r}")
        if self.size <= 1:
            return np.zeros(positions.shape, dtype=np.int64)
        out = self._network(positions.astype(np.uint64))
        limit = np.uint64(self.size)
        pending = np.flatnonzero(out >= limit)
        while pending.size:
            walked = self._network(out[pending])
            out[pending] = walked
            pending = pending[walked >= limit]
        return out.astype(np.int64)

    def at(self, position: int) -> int:
        """Image of one position."""
        return int(self(np.array([position], dtype=np.int64))[0])

    def __repr__(self) -> str:
        return f"FeistelPermutation(size={self.size}, key={self.key:#018x})"


def permute_each(positions: np.ndarray, sizes: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """FeistelPermutation(sizes[i], keys[i]).at(positions[i]) for every i at once (int64): the
    permutations of many small domains (a window's block groups) in one vectorised pass."""
    positions = np.asarray(positions, dtype=np.int64)
    sizes = np.asarray(sizes, dtype=np.int64)
    if positions.size and ((positions < 0).any() or (positions >= sizes).any()):
        raise IndexError("positions outside their permutations' ranges")
    distinct, inverse = np.unique(sizes, return_inverse=True)
    bits = np.array([max(int(s) - 1, 0).bit_length() for s in distinct.tolist()], dtype=np.uint64)[inverse]
    keys = np.asarray(keys, dtype=np.uint64)
    one = np.uint64(1)
    rounds = []
    right_width = bits // np.uint64(2)
    for r in range(ROUNDS):
        left_width = bits - right_width
        rounds.append((splitmix64_array(keys ^ np.uint64(r)), right_width, left_width))
        right_width = left_width

    def network(x: np.ndarray, chosen: slice | np.ndarray) -> np.ndarray:
        for round_keys, right_widths, left_widths in rounds:
            rw, lw = right_widths[chosen], left_widths[chosen]
            right = x & ((one << rw) - one)
            left = x >> rw
            left ^= splitmix64_array(right ^ round_keys[chosen]) & ((one << lw) - one)
            x = (right << lw) | left
        return x

    out = network(positions.astype(np.uint64), slice(None))
    limit = sizes.astype(np.uint64)
    pending = np.flatnonzero(out >= limit)
    while pending.size:  # cycle-walking, each element in its own domain
        walked = network(out[pending], pending)
        out[pending] = walked
        pending = pending[walked >= limit[pending]]
    out[sizes <= 1] = 0
    return out.astype(np.int64)
