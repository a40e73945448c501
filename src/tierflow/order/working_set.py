"""How many lanes and how large a window a node reads through: a function of the dataset alone.

The shards a node needs at once are, per lane, the window being read and the next one being
staged: lanes * 2k shards (room for that many of the mean size and one of the largest). The
default breadth depends only on the dataset (its shards' sizes at rest), the world layout
(partitions per node) and what the user sets (`lanes=`, `window_shards=`), never on a tier's
capacity, the free disk or the free memory: the same seed gives the same batches on every node,
with no tier or any tier (docs/order.md). The cache adapts to the order (tiers/stack.py: the
staging area; tiers/stager.py), not the order to the cache.

The widest shuffle (most shards mixed at once, lanes * k; ties to more lanes, whose partitions
differ) within: at most WIDEST_LANES lanes and windows of WIDEST_WINDOW shards; at most
1/READING_SHARE of the node's shards read at once (so an epoch passes through several working
sets and a tier's policy chooses what stays); a working set of at most WORKING_SET_BYTES at rest
(the staging area in host RAM holds what no tier keeps). A tier too small for that breadth to pay
is named with numbers and the `lanes=`/`window_shards=` that fit it (`fitting_working_set`,
`narrowing_advice`); the order is never narrowed behind the user's back.
"""

from __future__ import annotations

import heapq
import threading
import weakref
from dataclasses import dataclass, replace
from functools import partial
from collections.abc import Callable, Sequence

import numpy as np

READING_SHARE = 4
"""The default reads at most 1/READING_SHARE of a node's shards at once: a small dataset is not read
whole at once (every shard in use for the whole epoch leaves a tier's policy nothing to choose and
the staging area holding the dataset in RAM)."""
WORKING_SET_BYTES = 8 << 30
"""The default working set holds at most this many bytes of shards at rest (the staging area in host
RAM holds the working set's shards no tier keeps: 8 GiB is 31 shards of 256 MB, 15 lanes of one-shard
windows)."""
TIER_SHARE = 0.0625
"""`fitting_working_set`'s advice: a working set within this share of a tier (what the cache-sized
orders of before issue 37 read) leaves the rest of it to the entries kept across epochs."""
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


class ShardSizes:
    """A per-shard size column as a start reads it: its length, total and largest few values (a
    version-3 header's summary), the column itself read only when more of the largest are asked for."""

    def __init__(self, count: int, total: int, top: Sequence[int], column: Callable[[], np.ndarray]) -> None:
        self.count, self.total, self.top, self.column = count, total, list(top), column

    def __len__(self) -> int:
        return self.count

    def largest_sum(self, count: int) -> int:
        if count <= len(self.top) or len(self.top) == self.count:
            return sum(self.top[: max(count, 0)])
        return _largest_sum(self.column(), count)


def working_set_shards(lanes: int, window_shards: int) -> int:
    return lanes * 2 * window_shards


def working_set_bytes(shards: int, shard_bytes: Sequence[int]) -> int:
    """Room for any `shards` shards and one more: the `shards + 1` largest. The staging area is this
    big, and it holds one more than the working set at once: the window just left stays pinned
    until the stager lets it go. Sized by the mean instead, one small shard (a dataset's last)
    left the room a fraction of a shard short of three 16 MB shards, so a reader found every entry
    pinned, read its shard from below, and the stager fetched it again (benchmarks/images.py, a
    30% L2: 0.77 of the dataset per warm epoch against the plan's 0.72)."""
    if isinstance(shard_bytes, ShardSizes):
        return shard_bytes.largest_sum(shards + 1)
    if isinstance(shard_bytes, np.ndarray):  # a mapped column: numpy, not a pass in Python
        return _largest_sum(shard_bytes, shards + 1)
    return sum(heapq.nlargest(shards + 1, shard_bytes))


def _largest_sum(values: np.ndarray, count: int) -> int:
    """The sum of the `count` largest of `values`. A read-only column (a mapped one: the working set,
    the staging area and the decoded bound each ask of the same column at a start) keeps its largest
    values sorted the first time, so the next asks cost nothing per shard."""
    count = min(count, values.size)
    if count <= 0:
        return 0
    if not _immutable(values):
        return int(_top(values, count).sum())
    key = id(values)
    with _LARGEST_LOCK:
        found = _LARGEST.get(key)
    if found is None or found[0]() is not values or found[1].size < count:
        top = np.sort(_top(values, count))[::-1]
        found = (weakref.ref(values, partial(_forget, key)), top)
        with _LARGEST_LOCK:
            _LARGEST[key] = found
    return int(found[1][:count].sum())


_LARGEST: dict[int, tuple[weakref.ref, np.ndarray]] = {}
_LARGEST_LOCK = threading.Lock()


def _forget(key: int, _: object) -> None:
    _LARGEST.pop(key, None)


def _immutable(values: np.ndarray) -> bool:
    """Whether nothing can change `values`: read-only views down to a read-only buffer (a mapped
    column's), not an array that could be made writeable again."""
    base: object = values
    while isinstance(base, np.ndarray):
        if base.flags.writeable or base.base is None:
            return False
        base = base.base
    try:
        return memoryview(base).readonly  # type: ignore[arg-type]
    except TypeError:
        return False


def _top(values: np.ndarray, count: int, chunk: int = 1024) -> np.ndarray:
    """The `count` largest of `values` (0 < count <= size), without copying a million shards' column.
    `least`, the count-th largest of the chunks' maxima, is at most the count-th largest value (the
    `count` chunks whose maximum is at least it hold `count` values at least it). A value above it
    lies in the tail or in one of the fewer than `count` chunks whose maximum is above it: when there
    are fewer than `count` such values, the rest of the largest are `least` itself (ties of a column of
    equal sizes cost one pass, not a copy)."""
    whole = values.size // chunk
    if whole > count:
        body = values[: whole * chunk].reshape(whole, chunk)
        maxima = body.max(axis=1)
        least = maxima[np.argpartition(maxima, whole - count)[whole - count]]
        above, tail = body[np.flatnonzero(maxima > least)].ravel(), values[whole * chunk :]
        values = np.concatenate([above[above > least], tail[tail > least]])
        if values.size < count:
            return np.concatenate([values, np.full(count - values.size, least, dtype=values.dtype)])
    return np.partition(values, values.size - count)[values.size - count :]


def total_bytes(shard_bytes: Sequence[int]) -> int:
    """The bytes of all shards: a mapped column summed by numpy, not element by element in Python
    (a million shards: ~50 ms as Python integers, ~1 ms as int64; counts below 2**48 a shard)."""
    if isinstance(shard_bytes, ShardSizes):
        return shard_bytes.total
    if isinstance(shard_bytes, np.ndarray):
        return int(shard_bytes.sum(dtype=np.int64)) if shard_bytes.size else 0
    return sum(shard_bytes)


def mean_bytes(shard_bytes: Sequence[int]) -> float:
    return total_bytes(shard_bytes) / max(len(shard_bytes), 1)


def largest_bytes(shard_bytes: Sequence[int]) -> int:
    if isinstance(shard_bytes, ShardSizes):
        return shard_bytes.top[0] if shard_bytes.top else 0
    if isinstance(shard_bytes, np.ndarray):
        return int(shard_bytes.max()) if shard_bytes.size else 0
    return max(shard_bytes, default=0)


def choose_working_set(
    shard_bytes: Sequence[int], partitions_per_node: int, *, node_shards: int | None = None
) -> WorkingSet:
    """The default (lanes, window_shards): the widest within WIDEST_LANES x WIDEST_WINDOW, at most
    1/READING_SHARE of `node_shards` (default: all of `shard_bytes`, the node's share of the non-empty
    shards) read at once, and a working set of at most WORKING_SET_BYTES of `shard_bytes` (at rest).
    A function of its arguments only: never of a tier, the free disk or the free memory."""
    node_shards = len(shard_bytes) if node_shards is None else node_shards
    by_share = max(1, node_shards // READING_SHARE)
    by_bytes = max(0, int((WORKING_SET_BYTES - largest_bytes(shard_bytes)) // max(mean_bytes(shard_bytes), 1))) // 2
    reading = max(1, min(by_share, by_bytes))
    lanes, k = _widest(min(partitions_per_node, WIDEST_LANES), reading)
    shards = working_set_shards(lanes, k)
    limit = (
        "the widest"
        if lanes * k == min(partitions_per_node, WIDEST_LANES) * WIDEST_WINDOW
        else f"at most 1/{READING_SHARE} of the node's {node_shards} shards"
        if by_share <= by_bytes
        else f"a working set of at most {WORKING_SET_BYTES / 2**30:.0f} GiB at rest"
    )
    return WorkingSet(
        lanes,
        k,
        shards,
        working_set_bytes(shards, shard_bytes),
        f"the dataset's default: {lanes} x {k} shards read at once, {limit}",
    )


def _widest(most_lanes: int, reading: int) -> tuple[int, int]:
    """(lanes, k) with lanes <= most_lanes, k <= WIDEST_WINDOW, lanes * k <= reading: most shards
    mixed at once, ties to more lanes; (1, 1) at the least."""
    best = (1, 1, 1)
    for k in range(WIDEST_WINDOW, 0, -1):
        lanes = min(most_lanes, reading // k)
        if lanes >= 1 and (lanes * k, lanes) > (best[0], best[1]):
            best = (lanes * k, lanes, k)
    return best[1], best[2]


def fitting_working_set(shard_bytes: Sequence[int], partitions_per_node: int, room_bytes: float) -> WorkingSet:
    """The widest (lanes, window_shards) whose working set (in `shard_bytes`' form) fits `room_bytes`:
    what `narrowing_advice` tells a user whose tier is too small for the default order; never chosen
    for them."""
    budget = max(0, int((room_bytes - largest_bytes(shard_bytes)) // max(mean_bytes(shard_bytes), 1)))
    lanes, k = _widest(min(partitions_per_node, WIDEST_LANES), budget // 2)
    shards = working_set_shards(lanes, k)
    return WorkingSet(
        lanes, k, shards, working_set_bytes(shards, shard_bytes), f"{room_bytes / 1e6:.1f} MB holds {budget} shards"
    )


def narrowing_advice(
    chosen: WorkingSet, shard_bytes: Sequence[int], partitions_per_node: int, capacity: int, tier: str = "the top tier"
) -> str | None:
    """What to tell a user whose `tier` (`capacity` bytes in `shard_bytes`' form) cannot hold the order's
    working set beside what it keeps: the numbers, where the rest goes (the staging area in RAM: every
    epoch still fetches each shard at most once), and the `lanes=`/`window_shards=` whose working set
    takes at most TIER_SHARE of the tier. None where the tier holds the dataset beside the working set,
    or the working set takes at most TIER_SHARE of it. The order is never narrowed for the user."""
    if capacity <= 0 or capacity >= total_bytes(shard_bytes) + chosen.bytes or chosen.bytes <= TIER_SHARE * capacity:
        return None
    fit = fitting_working_set(shard_bytes, partitions_per_node, TIER_SHARE * capacity)
    narrower = (fit.lanes * fit.window_shards, fit.lanes) < (chosen.reading, chosen.lanes)
    option = (
        f"where RAM is short, lanes={fit.lanes}, window_shards={fit.window_shards} keeps the working set "
        f"within {TIER_SHARE:.2%} of the tier ({fit.bytes / 1e6:.1f} MB), at a narrower shuffle (a new "
        f"order: a saved cursor resumes its own)"
        if narrower
        else "no narrower order fits the tier"
    )
    return (
        f"{tier} holds {capacity / 1e6:.1f} MB; the order reads {chosen.lanes} lanes x windows of "
        f"{chosen.window_shards} shards, a working set of {chosen.shards} shards ({chosen.bytes / 1e6:.1f} MB, "
        f"{chosen.bytes / capacity:.0%} of the tier): the tier keeps what its policy chooses across epochs "
        f"and the shards being read that it does not keep pass through the staging area in RAM, so every "
        f"epoch fetches each shard at most once (benchmarks/cache.py: at 5% of the bytes at rest, warm "
        f"epochs fetch 0.5-0.8 of the dataset); {option}"
    )


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
    return replace(chosen, first_epoch=first_epoch_breadth(shards_per_node, chosen.lanes, chosen.window_shards))
