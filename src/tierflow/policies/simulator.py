"""Replay a trace against a policy at a capacity, and compute the offline optimum beside it.

Windowed traces are replayed as the tier will see them: a shard-interval is a reader's
entry, so the tier's own admission (policies/admission.py) asks the policy's `admit_read`
whether it is worth keeping; if so it is cached and pinned until its last use (the k shards
of a shuffle window cached together count against capacity), else it is read from below
for its window. Hits are counted per request (a shard-interval or a point read).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

from tierflow.policies.base import CachePolicy
from tierflow.policies.cache import Cache
from tierflow.policies.registry import make_policy
from tierflow.policies.traces import Trace


@dataclass(frozen=True)
class SimResult:
    """What one replay measured."""

    policy: str
    trace: str
    capacity_bytes: int
    requests: int
    hits: int
    requested_bytes: int
    hit_bytes: int
    evictions: int
    note: str = ""

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.requests if self.requests else 0.0

    @property
    def byte_miss_ratio(self) -> float:
        return 1.0 - self.hit_bytes / self.requested_bytes if self.requested_bytes else 0.0


def _schedule(trace: Trace) -> list[tuple[float, int, int]]:
    """(position, 0 = first use / 1 = last use, request) in replay order."""
    n = len(trace)
    times = np.concatenate([trace.start, trace.end])
    kinds = np.concatenate([np.zeros(n, np.int64), np.ones(n, np.int64)])
    requests = np.concatenate([np.arange(n), np.arange(n)])
    order = np.lexsort((requests, kinds, times))
    return list(zip(times[order].tolist(), kinds[order].tolist(), requests[order].tolist()))


def simulate(
    trace: Trace, policy: CachePolicy | str, capacity_bytes: int, *, oracle: bool = True, **policy_options: object
) -> SimResult:
    """Replay `trace` through a `Cache` of `capacity_bytes` driven by `policy`.

    `oracle=True` hands the policy the trace's future (as the loader would); policies
    that do not use one ignore it.
    """
    if isinstance(policy, str):
        policy = make_policy(policy, **policy_options)
    if oracle:
        policy.set_oracle(trace.oracle())
    cache = Cache(policy, capacity_bytes)
    names, sizes = trace.key_names, trace.sizes.tolist()
    keys = trace.keys.tolist()
    boundaries = trace.epoch_ends.tolist() + [math.inf]
    next_boundary = 0
    hits = hit_bytes = requested_bytes = 0
    if trace.windowed:
        events = _schedule(trace)
        required = (trace.end > trace.start).tolist()
        pinned = [False] * len(trace)
    else:
        events = [(t, 0, i) for i, t in enumerate(trace.start.tolist())]
        required = pinned = None
    for now, kind, request in events:
        while boundaries[next_boundary] < now:
            cache.end_epoch(boundaries[next_boundary])
            next_boundary += 1
        key = names[keys[request]]
        if kind == 1:
            if pinned[request]:  # type: ignore[index]
                cache.unpin(key, now)
            continue
        size = sizes[keys[request]]
        must = required is not None and required[request]
        requested_bytes += size
        if cache.access(key, size, now, required=must):
            hits += 1
            hit_bytes += size
        if must and key in cache:
            cache.pin(key)
            pinned[request] = True  # type: ignore[index]
    note = getattr(policy, "describe", lambda: "")()
    return SimResult(
        policy.name, trace.name, capacity_bytes, len(trace), hits, requested_bytes, hit_bytes, cache.evictions, note
    )


def _next_request_start(trace: Trace) -> list[float]:
    """For each request, when its key is requested next (math.inf if never)."""
    following = [math.inf] * len(trace)
    seen: dict[int, float] = {}
    starts = trace.start.tolist()
    keys = trace.keys.tolist()
    for index in range(len(trace) - 1, -1, -1):
        following[index] = seen.get(keys[index], math.inf)
        seen[keys[index]] = starts[index]
    return following


def optimum(trace: Trace, capacity_bytes: int) -> SimResult:
    """The offline optimum: Belady's MIN with bypass on the whole trace, computed directly.

    A windowed interval is cached (and held while in use) only when its next use is sooner than
    the furthest resident's, else read from below for its window, as a tier's `admit_read` allows.
    Exact for equal-sized point reads; with intervals or mixed sizes it is the furthest-next-use
    rule, not a bound.
    """
    following = _next_request_start(trace)
    names, sizes, keys = trace.key_names, trace.sizes.tolist(), trace.keys.tolist()
    resident: dict[int, int] = {}
    ranked: dict[int, tuple[float, str, int]] = {}
    heap: list[tuple[float, str, int]] = []
    in_use: dict[int, int] = {}
    used = hits = hit_bytes = requested = evictions = 0

    def rank(key: int, next_time: float) -> None:
        item = (-next_time, names[key], key)
        ranked[key] = item
        heapq.heappush(heap, item)

    def furthest() -> tuple[float, str, int] | None:
        while heap:
            if ranked.get(heap[0][2]) is heap[0]:
                return heap[0]
            heapq.heappop(heap)
        return None

    events = _schedule(trace) if trace.windowed else [(t, 0, i) for i, t in enumerate(trace.start.tolist())]
    starts, ends = trace.start.tolist(), trace.end.tolist()
    for _now, kind, request in events:
        key = keys[request]
        interval = ends[request] > starts[request]
        if kind == 1:
            if in_use.get(key) == request:
                del in_use[key]
                rank(key, following[request])
            continue
        size = sizes[key]
        requested += size
        if key in resident:
            hits += 1
            hit_bytes += size
        elif size <= capacity_bytes:
            wanted = following[request]
            top = furthest()
            admit = wanted < math.inf and (used + size <= capacity_bytes or (top is not None and wanted < -top[0]))
            while admit and used + size > capacity_bytes:
                top = furthest()
                if top is None:
                    admit = False
                    break
                del resident[top[2]], ranked[top[2]]
                used -= sizes[top[2]]
                evictions += 1
            if admit:
                resident[key] = size
                used += size
        if key in resident:
            if interval:
                ranked.pop(key, None)
                in_use[key] = request
            else:
                rank(key, following[request])
    return SimResult(
        "optimum",
        trace.name,
        capacity_bytes,
        len(trace),
        hits,
        requested,
        hit_bytes,
        evictions,
        "Belady MIN with bypass",
    )
