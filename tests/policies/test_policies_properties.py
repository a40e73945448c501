"""Property specifications of the cache policies (hypothesis), against brute-force references.

The references rank by scanning every resident at each decision; the real policies
keep heaps and ordered dicts. Same hit counts on random traces means the fast
bookkeeping (lazy deletion, pin withdrawal, reinstatement) is right.
"""

from __future__ import annotations

import math
from functools import cache

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierflow.policies import Cache, hotscore_key, make_policy, optimum, simulate
from tierflow.policies.traces import Trace, uniform_reshuffle
from tierflow.policies.auto import Lifecycle

POLICIES = ["lru", "hotscore", "clairvoyant", "nochurn", "stream", "auto"]
FEW = settings(max_examples=40, deadline=None)


class _Reference:
    """Brute-force bookkeeping shared by the references: residents, touches, pins."""

    name = "reference"

    def __init__(self) -> None:
        self.touched: dict[str, float] = {}
        self.pins: dict[str, int] = {}
        self.oracle = None
        self.latest = -math.inf

    def set_oracle(self, oracle) -> None:
        self.oracle = oracle

    def admit(self, key, size, now, free_bytes) -> bool:
        self.latest = max(self.latest, now)
        return True

    def admit_read(self, key, size, now, free_bytes) -> bool:
        self.latest = max(self.latest, now)
        return True

    def on_insert(self, key, size, now) -> None:
        self.latest = max(self.latest, now)
        self.touched[key] = now

    def on_access(self, key, now) -> None:
        self.latest = max(self.latest, now)
        self.touched[key] = now

    def on_remove(self, key) -> None:
        assert key not in self.pins
        del self.touched[key]

    def on_epoch_end(self, now) -> None:
        pass

    def pin(self, key) -> None:
        self.pins[key] = self.pins.get(key, 0) + 1

    def unpin(self, key, now=None) -> None:
        self.pins[key] -= 1
        if not self.pins[key]:
            del self.pins[key]
            self.touched[key] = max(self.touched[key], now)
            self.released(key, now)

    def released(self, key, now) -> None:
        pass

    def candidates(self) -> list[str]:
        return [key for key in self.touched if key not in self.pins]

    def __contains__(self, key) -> bool:
        return key in self.touched

    def __len__(self) -> int:
        return len(self.touched)


class ReferenceLRU(_Reference):
    def victim(self, now):
        return min(self.candidates(), key=self.touched.__getitem__, default=None)


class ReferenceStream(_Reference):
    def admit(self, key, size, now, free_bytes):
        return size <= free_bytes

    def victim(self, now):
        return max(self.candidates(), key=self.touched.__getitem__, default=None)


class ReferenceNoChurn(_Reference):
    def __init__(self) -> None:
        super().__init__()
        self.epoch = 0
        self.stamp: dict[str, int] = {}

    def on_epoch_end(self, now):
        self.epoch += 1

    def on_insert(self, key, size, now):
        super().on_insert(key, size, now)
        self.stamp[key] = self.epoch

    def on_access(self, key, now):
        super().on_access(key, now)
        self.stamp[key] = self.epoch

    def released(self, key, now):
        self.stamp[key] = self.epoch

    def _oldest(self):
        return min(self.candidates(), key=self.touched.__getitem__, default=None)

    def admit(self, key, size, now, free_bytes):
        oldest = self._oldest()
        return size <= free_bytes or (oldest is not None and self.stamp[oldest] < self.epoch - 1)

    def admit_read(self, key, size, now, free_bytes):
        return self.admit(key, size, now, free_bytes)

    def victim(self, now):
        oldest = self._oldest()
        if oldest is None or self.stamp[oldest] < self.epoch - 1:
            return oldest
        return max(self.candidates(), key=self.touched.__getitem__)


class ReferenceClairvoyant(_Reference):
    def rank(self, key, now):
        return (-self.oracle.next_use(key, now), key)

    def victim(self, now):
        return min(self.candidates(), key=lambda key: self.rank(key, now), default=None)

    def admit(self, key, size, now, free_bytes):
        wanted = self.oracle.next_use(key, now)
        if wanted == math.inf:
            return False
        if size <= free_bytes:
            return True
        rival = self.victim(now)
        return rival is not None and wanted < -self.rank(rival, now)[0]

    def admit_read(self, key, size, now, free_bytes):
        if size <= free_bytes:
            return True
        wanted = self.oracle.use_after_current(key, now)
        rival = self.victim(now)
        return rival is not None and wanted < -self.rank(rival, now)[0]


class ReferenceHotScore(_Reference):
    def __init__(self, half_life: float) -> None:
        super().__init__()
        self.half_life = half_life
        self.entry: dict[str, tuple[float, float, float]] = {}
        self.history: dict[str, tuple[float, float, float]] = {}

    def rank(self, key):
        freq, last, co = self.entry[key]
        return (hotscore_key(freq, last, co, self.half_life), last, key)

    def co_access(self, key):
        return len(self.pins) - (1 if key in self.pins else 0)

    def victim(self, now):
        return min(self.candidates(), key=self.rank, default=None)

    def admit(self, key, size, now, free_bytes):
        if size <= free_bytes:
            return True
        past, rival = self.history.get(key), self.victim(now)
        if past is not None and rival is not None and (hotscore_key(*past, self.half_life) > self.rank(rival)[0]):
            return True
        self.history[key] = ((past[0] if past else 0.0) + 1.0, now, float(self.co_access(key)))
        return False

    def on_insert(self, key, size, now):
        super().on_insert(key, size, now)
        past = self.history.pop(key, None)
        self.entry[key] = ((past[0] if past else 0.0) + 1.0, now, float(self.co_access(key)))

    def on_access(self, key, now):
        super().on_access(key, now)
        self.entry[key] = (self.entry[key][0] + 1.0, now, float(self.co_access(key)))

    def on_remove(self, key):
        super().on_remove(key)
        self.history[key] = self.entry.pop(key)


def reference(name: str, trace: Trace):
    if name == "lru":
        return ReferenceLRU()
    if name == "stream":
        return ReferenceStream()
    if name == "nochurn":
        return ReferenceNoChurn()
    if name == "clairvoyant":
        return ReferenceClairvoyant()
    return ReferenceHotScore(half_life=trace.epoch_length)


def _options(name: str, trace: Trace) -> dict:
    if name == "hotscore":
        return {"half_life": trace.epoch_length}
    if name == "auto":
        return {"lifecycle": trace.lifecycle, "half_life": trace.epoch_length}
    return {}


@st.composite
def point_traces(draw, max_keys: int = 6, max_length: int = 40) -> Trace:
    n_keys = draw(st.integers(1, max_keys))
    keys = draw(st.lists(st.integers(0, n_keys - 1), min_size=1, max_size=max_length))
    positions = np.arange(len(keys), dtype=np.float64)
    epoch = draw(st.integers(2, 12))
    return Trace(
        name="random points",
        keys=np.array(keys, dtype=np.int64),
        start=positions,
        end=positions,
        sizes=np.ones(n_keys, dtype=np.int64),
        epoch_length=float(epoch),
        lifecycle=Lifecycle(pattern=draw(st.sampled_from(["reshuffle", "skewed", "unknown"]))),
    )


@st.composite
def windowed_traces(draw) -> Trace:
    return uniform_reshuffle(
        draw(st.integers(2, 9)),
        draw(st.integers(1, 3)),
        window=draw(st.integers(1, 3)),
        samples_per_shard=draw(st.integers(1, 3)),
        seed=draw(st.integers(0, 2**16)),
    )


any_trace = st.one_of(point_traces(), windowed_traces())


@pytest.mark.parametrize("name", ["lru", "hotscore", "clairvoyant", "nochurn", "stream"])
@pytest.mark.parametrize("traces", [point_traces(), windowed_traces()], ids=["points", "windowed"])
def test_every_policy_hits_exactly_as_its_brute_force_reference(name, traces):
    @FEW
    @given(traces, st.integers(1, 6))
    def check(trace, capacity):
        fast = simulate(trace, name, capacity, **_options(name, trace))
        slow = simulate(trace, reference(name, trace), capacity)  # type: ignore[arg-type]
        assert fast.hits == slow.hits

    check()


@FEW
@given(any_trace, st.integers(1, 6))
def test_no_policy_beats_the_optimum_and_clairvoyant_reaches_it(trace, capacity):
    best = optimum(trace, capacity)
    for name in POLICIES:
        assert simulate(trace, name, capacity, **_options(name, trace)).hits <= best.hits, name
        assert simulate(trace, name, capacity, oracle=False, **_options(name, trace)).hits <= best.hits
    assert simulate(trace, "clairvoyant", capacity).hits == best.hits


def _exhaustive_optimum(keys: tuple[int, ...], capacity: int) -> int:
    """Most hits any caching schedule gets (bypass allowed, any victim), by trying all."""

    @cache
    def best(index: int, resident: frozenset[int]) -> int:
        if index == len(keys):
            return 0
        key = keys[index]
        if key in resident:
            return 1 + best(index + 1, resident)
        options = [best(index + 1, resident)]
        if len(resident) < capacity:
            options.append(best(index + 1, resident | {key}))
        for out in resident:
            options.append(best(index + 1, (resident - {out}) | {key}))
        return max(options)

    return best(0, frozenset())


@settings(max_examples=60, deadline=None)
@given(point_traces(max_keys=5, max_length=14), st.integers(1, 3))
def test_the_optimum_equals_an_exhaustive_search_on_tiny_traces(trace, capacity):
    assert optimum(trace, capacity).hits == _exhaustive_optimum(tuple(trace.keys.tolist()), capacity)


operations = st.lists(
    st.tuples(st.sampled_from(["read", "pin", "unpin", "epoch"]), st.integers(0, 7), st.integers(1, 4)),
    min_size=1,
    max_size=60,
)


@FEW
@given(operations, st.integers(1, 10), st.sampled_from(POLICIES))
def test_capacity_is_never_exceeded_and_pinned_entries_are_never_victims(ops, capacity, name):
    policy = make_policy(name, **({"half_life": 5.0} if name in ("hotscore", "auto") else {}))
    cache = Cache(policy, capacity)
    sizes = {f"k{index}": 1 + index % 4 for index in range(8)}
    pins: dict[str, int] = {}
    for now, (op, index, _) in enumerate(ops):
        key = f"k{index}"
        if op == "read":
            cache.access(key, sizes[key], float(now), required=bool(index % 2))
        elif op == "pin" and key in cache:
            cache.pin(key)
            pins[key] = pins.get(key, 0) + 1
        elif op == "unpin" and pins.get(key):
            cache.unpin(key, float(now))
            pins[key] -= 1
            if not pins[key]:
                del pins[key]
        elif op == "epoch":
            cache.end_epoch(float(now))
        assert 0 <= cache.used_bytes <= capacity
        assert cache.used_bytes == sum(cache.size_of(k) for k in sizes if k in cache)
        victim = policy.victim(float(now))
        unpinned = [k for k in sizes if k in cache and k not in pins]
        assert (victim is None) == (not unpinned)
        assert victim is None or victim not in pins
