"""The rule that interleaves a node's partitions into one stream of micro-batches.

A node always takes its next micro-batch from the partition, among its own, that has delivered
the fewest batches so far; ties go to the lower partition index. From a fresh start this is
round robin in partition order, and because the rule reads only per-partition counts (which
the cursor records) it continues exactly after a resume with any world size. Over all P
partitions it defines the world-independent global order; each node's stream is that order
restricted to its own partitions.

Pick j (0-based) from counts k_i: let C(L) = sum_i max(0, L - k_i) be the number of picks
below level L; pick j is at the level L with C(L) <= j < C(L + 1), and it is the
(j - C(L))-th partition, in index order, among those with k_i <= L. O(P log j) per query.
"""

from __future__ import annotations

import numpy as np


def _picks_below(delivered: np.ndarray, level: int) -> int:
    return int(np.maximum(0, level - delivered).sum())


def _level_of(delivered: np.ndarray, pick: int) -> int:
    low = int(delivered.min())
    high = int(delivered.max()) + pick + 1
    while high - low > 1:
        mid = (low + high) // 2
        if _picks_below(delivered, mid) <= pick:
            low = mid
        else:
            high = mid
    return low


def pick_partition(delivered: np.ndarray, pick: int) -> tuple[int, int]:
    """(index into `delivered` of the partition serving pick number `pick`, how many batches
    that partition delivers before it from here)."""
    level = _level_of(delivered, pick)
    eligible = np.flatnonzero(delivered <= level)
    index = int(eligible[pick - _picks_below(delivered, level)])
    return index, level - int(delivered[index])


def delivered_after(delivered: np.ndarray, picks: int) -> np.ndarray:
    """Per-partition delivered counts after `picks` more picks."""
    delivered = np.asarray(delivered, dtype=np.int64)
    if picks <= 0:
        return delivered.copy()
    level = _level_of(delivered, picks)
    after = np.maximum(delivered, level)
    eligible = np.flatnonzero(delivered <= level)
    after[eligible[: picks - _picks_below(delivered, level)]] += 1
    return after


def pick_of(delivered: np.ndarray, index: int, nth: int) -> int:
    """Pick number at which partition `index` delivers its `nth` (0-based) batch from here."""
    level = int(delivered[index]) + nth
    ahead = int(np.count_nonzero(delivered[:index] <= level))
    return _picks_below(delivered, level) + ahead
