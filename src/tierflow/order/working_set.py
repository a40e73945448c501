"""How many lanes and how large a window a node reads through, chosen from its top tier.

The shards a node needs at once are, per lane, the window being read and the next one being
staged: lanes * 2k shards (room for that many of the mean size and one of the largest). Those the tier does not keep pass through the
stack's staging area in host RAM, so the working set takes at most `SHARE` of the top tier (the
RAM it may use beside it) and `RAM_SHARE` of the memory headroom; within that the widest shuffle wins
(most shards mixed at once, lanes * k; ties to more lanes, whose partitions differ). With no tier,
or one that holds the whole dataset, the widest (remote shards read with no tier are held in
memory, so then RAM_SHARE alone bounds it): up to WIDEST_LANES lanes with windows of 4 shards.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

SHARE = 0.0625
RAM_SHARE = 0.125
FIRST_EPOCH_SHARE = 16
"""The first epoch reads at most 1/FIRST_EPOCH_SHARE of the node's shards at once. On a cold node
the loader runs at full rate only once the shards being read have arrived, and it finishes the
epoch's last windows after the link has gone quiet: both cost about the breadth's share of an
epoch. The widest 16 x 4 over 26 shards needed nearly all of them at once, so the cold epoch took
the download and then the whole epoch's compute (benchmarks/loader.py --bounds: 1.50 x the
step-bound time at twice the needed bandwidth, 0.67 x the throttle at half of it). Read narrower,
what the first batch waits for is the first group's windows, and the epoch's last group ends
with the link; both shrink with the breadth. Later epochs read at the full breadth."""
FIRST_EPOCH_LEAST = 4
"""...and at least this many, so a small dataset's first batches still mix a few shards. Over the
cold benchmark's 25 shards (benchmarks/loader.py --cold), 4 lanes of one-shard windows measured
1.16 x the step-bound time at twice the needed bandwidth (bound 1.08) and 0.94 x the throttle at
half of it; one shard at a time measured 1.13 and 0.98, with each batch drawn from a shard or two."""
WIDEST_WINDOW = 4
WIDEST_LANES = 16
"""More lanes than this read in lock-step, so a position in the epoch is the same rank in every
partition's shard shuffle and the epoch correlates with the stored order (benchmarks/order.py:
|Spearman rho| 0.023 at 64 lanes, 0.006 at 16, on 2,000 shards); 16 x 4 already mixes ~35 shards
into a global batch of 256 samples."""


@dataclass(frozen=True)
class WorkingSet:
    """The order's reading breadth on one node, and the bytes it keeps in use at once."""

    lanes: int
    window_shards: int
    shards: int
    bytes: int
    reason: str
    first_epoch: tuple[int, int] | None = None
    """(lanes read at once, window_shards) of the first epoch when it reads narrower (None: as later)."""

    @property
    def reading(self) -> int:
        """Shards read at once: one window per lane (the rest of the working set is the next one)."""
        return self.lanes * self.window_shards


def working_set_shards(lanes: int, window_shards: int) -> int:
    return lanes * 2 * window_shards


def working_set_bytes(shards: int, shard_bytes: Sequence[int]) -> int:
    """Room for any `shards` shards and one more: the `shards + 1` largest. The staging area is this
    big, and it holds one more than the working set at once: the window just left stays pinned
    until the stager lets it go. Sized by the mean instead, one small shard (a dataset's last)
    left the room a fraction of a shard short of three 16 MB shards, so a reader found every entry
    pinned, read its shard from below, and the stager fetched it again (benchmarks/images.py, a
    30% L2: 0.77 of the dataset per warm epoch against the plan's 0.72)."""
    if isinstance(shard_bytes, np.ndarray):  # a mapped column: a partition, not a pass in Python
        k = min(shards + 1, shard_bytes.size)
        return int(np.partition(shard_bytes, shard_bytes.size - k)[shard_bytes.size - k:].sum()) if k > 0 else 0
    return sum(heapq.nlargest(shards + 1, shard_bytes))


def choose_working_set(shard_bytes: Sequence[int], partitions_per_node: int,
                       capacity_bytes: int | None, memory_bytes: int | None = None) -> WorkingSet:
    """The widest (lanes, window_shards) whose working set fits SHARE of `capacity_bytes` (None: no
    tier) and RAM_SHARE of `memory_bytes` (None: shards are read in place, memory-mapped)."""
    most = min(partitions_per_node, WIDEST_LANES)
    widest_shards = working_set_shards(most, WIDEST_WINDOW)
    widest = WorkingSet(most, WIDEST_WINDOW, widest_shards, working_set_bytes(widest_shards, shard_bytes), "")
    if capacity_bytes is None and memory_bytes is None:
        return _because(widest, "read in place: the widest shuffle")
    if capacity_bytes is not None and capacity_bytes >= sum(shard_bytes) + widest.bytes:
        return _because(widest, "the top tier holds the dataset and the working set")
    if capacity_bytes is None:  # remote shards with no tier are held in memory while read
        room = memory_bytes * RAM_SHARE
        where = f"{RAM_SHARE:.1%} of free memory"
    else:
        room = capacity_bytes * SHARE if memory_bytes is None else min(capacity_bytes * SHARE, memory_bytes * RAM_SHARE)
        where = f"{SHARE:.0%} of the top tier, at most {RAM_SHARE:.1%} of free memory"
    mean = sum(shard_bytes) / max(len(shard_bytes), 1)
    budget = max(0, int((room - max(shard_bytes, default=0)) // max(mean, 1)))
    best: tuple[int, int, int] | None = None
    for k in range(WIDEST_WINDOW, 0, -1):
        lanes = min(most, budget // (2 * k))
        if lanes >= 1 and (best is None or (lanes * k, lanes) > (best[0], best[1])):
            best = (lanes * k, lanes, k)
    if best is None:
        lanes, k = 1, 1
        reason = f"{room / 1e6:.1f} MB ({where}) holds less than one lane of single-shard windows"
    else:
        _, lanes, k = best
        reason = f"{room / 1e6:.1f} MB ({where}) holds {budget} shards"
    shards = working_set_shards(lanes, k)
    return WorkingSet(lanes, k, shards, working_set_bytes(shards, shard_bytes), reason)


def _because(chosen: WorkingSet, reason: str) -> WorkingSet:
    return WorkingSet(chosen.lanes, chosen.window_shards, chosen.shards, chosen.bytes, reason)


def first_epoch_breadth(shards_per_node: int, lanes: int, window_shards: int) -> tuple[int, int] | None:
    """(lanes at once, window_shards) for the first epoch: at most the node's shards / FIRST_EPOCH_SHARE
    read at once, but never fewer than FIRST_EPOCH_LEAST; lanes first (each of its windows is needed
    from its own first batch, so lanes of one-shard windows spread the shards' first uses most);
    None when `lanes x window_shards` is already within that."""
    most = max(FIRST_EPOCH_LEAST, shards_per_node // FIRST_EPOCH_SHARE)
    if lanes * window_shards <= most:
        return None
    at_once = min(lanes, most)
    return at_once, max(1, min(window_shards, most // at_once))


def with_first_epoch(chosen: WorkingSet, shards_per_node: int) -> WorkingSet:
    """`chosen` with its first epoch narrowed to `first_epoch_breadth` (the loader's default)."""
    return replace(chosen, first_epoch=first_epoch_breadth(shards_per_node, chosen.lanes,
                                                                       chosen.window_shards))
