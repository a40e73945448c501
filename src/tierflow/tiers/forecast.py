"""Bytes per epoch before a run: a node's real order replayed against its tier and staging area.

The order is known, so what a run will fetch from below is too. `replay` walks the node's window
uses (first use first) through the same two places the stack reads from: the top tier with its
policy (a miss is cached only if the tier's own admission, policies/admission.py, takes it as it
takes the stager's prefetch), then the staging area, an LRU in RAM of the working set's size; a
shard neither holds is fetched, at its at-rest size, and charged to the epoch of the use that
needed it. `optimum` is Belady's MIN with bypass on the same uses with the room of both together:
no schedule of fetches with that much room does better, so no live figure should either.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from collections.abc import Sequence

from tierflow.order.future import ShardUse
from tierflow.policies.cache import Cache
from tierflow.policies.lru import LRUPolicy
from tierflow.policies.registry import make_policy


@dataclass(frozen=True)
class EpochBytes:
    """What one epoch fetches from below, at rest, against the dataset at rest."""

    epoch: int
    fetched: int
    dataset: int

    @property
    def ratio(self) -> float:
        return self.fetched / self.dataset if self.dataset else 0.0


def _per_epoch(fetched: dict[int, int], epochs: int, dataset: int) -> list[EpochBytes]:
    return [EpochBytes(e, fetched.get(e, 0), dataset) for e in range(epochs)]


def replay(
    uses: Sequence[ShardUse],
    tier_sizes: Sequence[int],
    rest_sizes: Sequence[int],
    capacity: int,
    staging: int,
    epochs: int,
    policy: str = "nochurn",
) -> list[EpochBytes]:
    """Bytes fetched per epoch by the top tier (`policy`, `capacity` in its form's bytes) with the
    staging area (`staging` bytes) beside it."""
    name = "nochurn" if policy == "auto" else policy
    top = Cache(make_policy(name), capacity)
    aside = Cache(LRUPolicy(), staging)
    fetched: dict[int, int] = {}
    dataset = sum(rest_sizes)
    for use in sorted(uses, key=lambda u: (u.first_use, u.shard)):
        if use.epoch >= epochs:
            continue
        key, size, now = str(use.shard), int(tier_sizes[use.shard]), float(use.first_use)
        if top.access(key, size, now):
            continue
        if key in top:  # admitted on this miss: fetched into the tier
            fetched[use.epoch] = fetched.get(use.epoch, 0) + int(rest_sizes[use.shard])
            continue
        if not aside.access(key, size, now):
            fetched[use.epoch] = fetched.get(use.epoch, 0) + int(rest_sizes[use.shard])
    return _per_epoch(fetched, epochs, dataset)


def optimum(
    uses: Sequence[ShardUse], tier_sizes: Sequence[int], rest_sizes: Sequence[int], capacity: int, epochs: int
) -> list[EpochBytes]:
    """Belady's MIN with bypass over the uses as points (a bypassed shard is read once for its
    window), `capacity` bytes of room; exact for equal sizes, the furthest-next-use rule otherwise."""
    ordered = [u for u in sorted(uses, key=lambda u: (u.first_use, u.shard)) if u.epoch < epochs]
    following = [math.inf] * len(ordered)
    seen: dict[int, float] = {}
    for i in range(len(ordered) - 1, -1, -1):
        following[i] = seen.get(ordered[i].shard, math.inf)
        seen[ordered[i].shard] = float(ordered[i].first_use)
    resident: dict[int, float] = {}
    heap: list[tuple[float, int]] = []
    used = 0
    fetched: dict[int, int] = {}
    for use, upcoming in zip(ordered, following):
        shard, size = use.shard, int(tier_sizes[use.shard])
        if shard in resident:
            resident[shard] = upcoming
            heapq.heappush(heap, (-upcoming, shard))
            continue
        fetched[use.epoch] = fetched.get(use.epoch, 0) + int(rest_sizes[shard])
        if upcoming == math.inf or size > capacity:
            continue
        victims: list[int] = []
        room = capacity - used
        while room < size and heap:
            distance, victim = heap[0]
            if victim not in resident or resident[victim] != -distance:
                heapq.heappop(heap)
                continue
            if -distance <= upcoming:
                break  # everything left is needed sooner than this one: bypass it
            heapq.heappop(heap)
            victims.append(victim)
            room += int(tier_sizes[victim])
        if room < size:
            for victim in victims:  # not worth it after all: keep them
                heapq.heappush(heap, (-resident[victim], victim))
            continue
        for victim in victims:
            used -= int(tier_sizes[victim])
            del resident[victim]
        resident[shard] = upcoming
        used += size
        heapq.heappush(heap, (-upcoming, shard))
    return _per_epoch(fetched, epochs, sum(rest_sizes))
