"""The stager's planning, as pure functions of plain data, so it is tested and timed without threads.

A plan answers, from the node's future shard uses (positions in node samples counted from the
cursor the plan starts at), what to fetch and in what order, and how long to hold each staged
shard. The lookahead follows Little's law: bytes ahead >= 2 x consumption rate x (p99 fetch
latency + one shard's transfer), at least `min_batches` steps and the next window of every lane,
at most `max_bytes`. Shards are wanted in order of first use; the windows being read now (every
lane's, the first `reading_shards` by first use) are taken whatever the budget; at most
`staging_slots` shards the top tier does not hold go through the staging area per plan. Every shard staged is held to the end of its next use, so a prefetch
never evicts, or is evicted before, an entry needed sooner. The `Stager` executes plans.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Container, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from tierflow.format.manifest import Manifest
from tierflow.order.future import ShardUse
from tierflow.order.working_set import WorkingSet


class NodeRank(Protocol):
    """Where this process sits on its node: only local rank 0 stages by default."""

    @property
    def local_rank(self) -> int: ...


@runtime_checkable
class FutureView(Protocol):
    """What the stager reads of a dataset (a `TieredDataset` satisfies it): nothing else."""

    @property
    def manifest(self) -> Manifest: ...

    @property
    def num_order_samples(self) -> int: ...

    @property
    def working_set(self) -> WorkingSet: ...

    @property
    def world(self) -> NodeRank: ...

    def node_step_samples(self) -> int:
        """Samples the node's ranks consume per step together: the unit of the stager's clock."""
        ...

    def future_shard_uses(self, cursor: Any = None, horizon_batches: int = 64) -> list[ShardUse]:
        """The node's shard uses from `cursor` (opaque: what the loader hands the stager) for the next
        `horizon_batches` steps, positions in node samples from the cursor, sorted by first use."""
        ...


@dataclass(frozen=True)
class NodeShape:
    """What a plan needs to know of the node and its tiers; fixed for a stager's life."""

    shard_bytes: int
    """The largest shard in the top tier's form: the unit of the budget."""
    bytes_per_step: float
    samples_per_step: int
    min_batches: int
    max_bytes: float
    """The most the stager may hold ahead (the tier's room beside the shards being read)."""
    next_windows_bytes: int
    capacity: int
    """The smallest tier's capacity (0: no tier)."""
    dataset_bytes: int
    staging_slots: int
    reading_shards: int = 0
    """Shards the node reads at once (lanes x window shards): the first this many by first use are
    the windows being read now, wanted whatever the budget; the budget is for what comes after.
    0 (only the shards in use at the cursor skip the budget) where the top tier cannot hold the
    working set: staging every lane's window there evicts the warm entries the next windows hit."""


ORACLE_SHARDS = 1 << 14
"""The most shards (of the largest size) the oracle's view covers: twice the tier's capacity up to
this. A plan is made again every few batches, so the view moves with the loop; what it adds past
the fetch horizon is only the order in which a clairvoyant tier evicts entries needed later, and
entries needed beyond it look never needed, as those beyond twice the capacity always did. Without
the bound a first plan over a 30% tier of 10^6 shards walked 60% of the dataset (~30 s, 730 MB)."""


@dataclass(frozen=True)
class Lookahead:
    """How far one plan looks: the bytes it aims ahead and the steps the future view must cover."""

    bytes: float
    horizon_steps: int
    """Steps whose shards the stager fetches."""
    view_steps: int
    """Steps the policy's oracle sees: beyond them every entry looks never needed again, so it
    covers what the tier can hold, twice over."""


@dataclass(frozen=True)
class StagingPlan:
    """One plan: fetch `fetch` in that order; hold each shard in `hold_until` through that position."""

    lookahead: Lookahead
    fetch: tuple[int, ...]
    hold_until: dict[int, int]
    release: tuple[int, ...]
    """Held shards whose last planned use is before the plan's position: unpin them."""
    intervals: tuple[tuple[int, int, int], ...]
    """(shard, first_use, last_use), each shard's uses merged: what the next-use oracle answers from."""


def size_lookahead(
    node: NodeShape, consumption_bytes_s: float, fetch_p99_s: float, fetch_mean_s: float, cover_s: float = 0.0
) -> Lookahead:
    """Little's law with a 2x margin, at least `min_batches` steps and the next windows, at most `max_bytes`;
    during a burst (a checkpoint upload expected to last `cover_s`), at least what the loop consumes in it."""
    want = max(
        node.min_batches * node.bytes_per_step,
        2 * consumption_bytes_s * (fetch_p99_s + fetch_mean_s),
        node.next_windows_bytes,
        consumption_bytes_s * cover_s,
    )
    ahead = min(want, node.max_bytes)
    step = max(node.bytes_per_step, 1)
    horizon = max(node.min_batches, math.ceil(ahead / step))
    covered = min(node.capacity, node.dataset_bytes) if node.capacity else node.dataset_bytes
    seen = min(2 * covered, ORACLE_SHARDS * max(node.shard_bytes, 1))  # bounded: see ORACLE_SHARDS
    return Lookahead(ahead, horizon, max(horizon, math.ceil(seen / step)))


def passed(hold_until: dict[int, int], held: Collection[int], position: int) -> list[int]:
    """The held shards whose last planned use is before `position`: evictable again."""
    return [shard for shard in held if hold_until.get(shard, -1) < position]


def merged_spans(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Overlapping or touching [first, last] spans joined, sorted."""
    out: list[tuple[int, int]] = []
    for first, last in sorted(spans):
        if out and first <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], last))
        else:
            out.append((first, last))
    return out


def plan_staging(
    uses: Sequence[ShardUse],
    node: NodeShape,
    *,
    consumption_bytes_s: float = 0.0,
    fetch_p99_s: float = 1.0,
    fetch_mean_s: float = 1.0,
    position: int = 0,
    resident: Container[int] | None = None,
    held: Collection[int] = (),
    in_flight: Collection[int] = (),
    lead: int = 0,
    cover_s: float = 0.0,
) -> StagingPlan:
    """What to stage next from `uses` (the node's future, sorted by first use, covering at least the
    lookahead's `view_steps`).

    `position`: node samples consumed since the cursor `uses` start from; `resident`: the shards
    the top tier holds (None: no tier, nothing goes through the staging area); `held`: shards the
    stager holds pinned; `in_flight`: shards it is fetching. Held and in-flight shards are held to
    the end of their next use even past the horizon, and never fetched again; they still count
    against the budget, which is the bytes ahead, not the bytes still to fetch. `lead`: node
    samples the node's fastest rank is ahead of that cursor (the slowest's): the shards first used
    before it are being read, so they are wanted whatever the budget and held to the end of their
    use, for the slower ranks, and the lookahead starts from it. `cover_s`: seconds of a burst to
    read through (`size_lookahead`).
    """
    ahead = size_lookahead(node, consumption_bytes_s, fetch_p99_s, fetch_mean_s, cover_s)
    limit = ahead.horizon_steps * node.samples_per_step + lead
    staged = set(held) | set(in_flight)
    spans: dict[int, list[tuple[int, int]]] = {}
    wanted: dict[int, None] = {}  # first use order (uses are sorted by first use)
    in_use: set[int] = set()
    until: dict[int, int] = {}
    for use in uses:
        spans.setdefault(use.shard, []).append((use.first_use, use.last_use))
        if use.first_use < limit:
            if use.shard not in wanted and (use.first_use <= lead or len(wanted) < node.reading_shards):
                in_use.add(use.shard)  # the windows being read now (by any rank) are needed, not "ahead"
            wanted.setdefault(use.shard)
        if use.shard not in until and (use.first_use < limit or use.shard in staged):
            until[use.shard] = use.last_use
    release = passed(until, held, position)
    kept = (set(held) - set(release)) | set(in_flight)
    fetch: list[int] = []
    budget = ahead.bytes
    passing = 0  # shards the top tier does not hold go through the staging area: one window ahead
    for shard in wanted:
        if shard not in in_use:
            if budget < node.shard_bytes:
                break
            budget -= node.shard_bytes
            if resident is not None and shard not in resident:
                passing += 1
                if passing > node.staging_slots:
                    break
        if shard not in kept:
            fetch.append(shard)
    intervals = tuple((shard, first, last) for shard, ss in spans.items() for first, last in merged_spans(ss))
    return StagingPlan(ahead, tuple(fetch), until, tuple(release), intervals)


__all__ = [
    "ORACLE_SHARDS",
    "FutureView",
    "Lookahead",
    "NodeRank",
    "NodeShape",
    "StagingPlan",
    "merged_spans",
    "passed",
    "plan_staging",
    "size_lookahead",
]
