"""A live tier and the policy simulator decide alike on the same trace: both run the one admission
controller (policies/admission.py), so what `simulate` and `tierflow plan` score is what a tier does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tierflow.format._checksum import xxh3_128_hex
from tierflow.policies import Cache, make_policy, simulate, traces
from tierflow.policies.traces import Trace
from tierflow.tiers.tier import Tier

POLICIES = ["lru", "hotscore", "clairvoyant", "nochurn", "stream"]
CAPACITY = 1500


def _trace(seed: int = 3, requests: int = 160, keys: int = 14) -> Trace:
    """Point reads of entries of mixed sizes, skewed so some are worth keeping (one epoch)."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(100, 400, keys)
    chosen = rng.zipf(1.4, requests) % keys
    return traces.from_records((f"k{k}", int(sizes[k]), float(i), float(i)) for i, k in enumerate(chosen.tolist()))


def _options(name: str) -> dict[str, float]:
    return {"half_life": 40.0} if name == "hotscore" else {}


def _replay_on_tier(root: Path, trace: Trace, name: str, *, prefetch: bool) -> tuple[int, int, set[str]]:
    """Hits, evictions and the residents at the end of `trace` read through a live tier."""
    now = [0.0]
    tier = Tier(
        root, CAPACITY, policy=name, form="at_rest", ram=False, clock=lambda: now[0], policy_options=_options(name)
    )
    tier.set_oracle(trace.oracle())
    names, sizes = trace.key_names, trace.sizes.tolist()
    for key_id, start in zip(trace.keys.tolist(), trace.start.tolist()):
        now[0] = start
        key, data = names[key_id], bytes(sizes[key_id])
        pin = tier.ensure(key, len(data), xxh3_128_hex(data), lambda tmp, d=data: tmp.write_bytes(d), prefetch=prefetch)
        if pin is not None:
            pin.release()
    return int(tier.m_hits.value), int(tier.m_evictions.value), tier.resident_keys()


@pytest.mark.parametrize("name", POLICIES)
def test_a_tier_scores_what_the_simulator_scores_for_prefetched_entries(tmp_path: Path, name: str) -> None:
    """A prefetch asks the policy's `admit`, as the simulator's point reads do."""
    trace = _trace()
    simulated = simulate(trace, name, CAPACITY, **_options(name))
    hits, evictions, _ = _replay_on_tier(tmp_path / "l2", trace, name, prefetch=True)
    assert simulated.hits > 0 and trace.data_bytes > 2 * CAPACITY  # room must be made, or declined
    assert (hits, evictions) == (simulated.hits, simulated.evictions)


@pytest.mark.parametrize("name", POLICIES)
def test_a_tier_keeps_what_the_cache_model_keeps_for_a_readers_entries(tmp_path: Path, name: str) -> None:
    """A reader's entry asks the policy's `admit_read` in both (nochurn and clairvoyant read from
    below rather than churn)."""
    trace = _trace(seed=5)
    policy = make_policy(name, **_options(name))
    policy.set_oracle(trace.oracle())
    cache = Cache(policy, CAPACITY)
    names, sizes = trace.key_names, trace.sizes.tolist()
    hits = sum(
        cache.access(names[k], sizes[k], t, required=True) for k, t in zip(trace.keys.tolist(), trace.start.tolist())
    )
    live_hits, evictions, residents = _replay_on_tier(tmp_path / "l2", trace, name, prefetch=False)
    assert (live_hits, evictions, residents) == (hits, cache.evictions, {k for k in names if k in cache})
