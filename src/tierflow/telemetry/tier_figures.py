"""Per-tier figures from a metrics snapshot: the demand hit ratio, bytes, evictions, occupancy, fetch
latency, and the byte miss ratio of a run's access trace against the offline optimum.

The demand hit ratio (hits / (hits + misses)) says whether a shard was there when asked; the byte
miss ratio against the optimum says how much better any policy could have done with this capacity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from tierflow.telemetry.metrics import Histogram

_COUNTERS = {
    "hits": "tier_hits", "misses": "tier_misses", "bytes_in": "tier_bytes_in", "bytes_out": "tier_bytes_out",
    "promotions": "tier_promotions", "evictions": "tier_evictions",
    "evictions_before_use": "tier_evictions_before_use", "corruptions": "tier_corruptions",
    "enospc_fallbacks": "tier_enospc_fallbacks", "bypass": "tier_bypass",
}


@dataclass(frozen=True)
class TierFigures:
    """One tier's totals over the snapshot's life."""

    tier: str
    hits: int
    misses: int
    bytes_in: int
    bytes_out: int
    promotions: int
    evictions: int
    evictions_before_use: int
    corruptions: int
    enospc_fallbacks: int
    bypass: int
    occupancy_bytes: int
    capacity_bytes: int
    fetch_p50_s: float
    fetch_p90_s: float
    fetch_p99_s: float

    @property
    def demand_hit_ratio(self) -> float:
        asked = self.hits + self.misses
        return self.hits / asked if asked else 0.0


def tier_figures(snapshot: Mapping[str, Any]) -> dict[str, TierFigures]:
    """{tier name: figures} for every tier that recorded anything, summed over job/node/rank labels."""
    totals: dict[str, dict[str, float]] = {}
    for entry in snapshot["counters"]:
        tier = entry["labels"].get("tier")
        for field, name in _COUNTERS.items():
            if entry["name"] == name and tier is not None:
                slot = totals.setdefault(tier, {})
                slot[field] = slot.get(field, 0) + entry["value"]
    gauges: dict[str, dict[str, float]] = {}
    for entry in snapshot["gauges"]:
        tier = entry["labels"].get("tier")
        if tier is not None and entry["name"] in ("tier_occupancy_bytes", "tier_capacity_bytes"):
            slot = gauges.setdefault(tier, {})
            slot[entry["name"]] = max(slot.get(entry["name"], 0), entry["value"])
            totals.setdefault(tier, {})
    latency: dict[str, Histogram] = {}
    for entry in snapshot["histograms"]:
        tier = entry["labels"].get("tier")
        if entry["name"] == "tier_fetch_seconds" and tier is not None and tier not in latency:
            latency[tier] = Histogram.from_snapshot(entry)
    out = {}
    for tier in sorted(totals):
        t, g = totals[tier], gauges.get(tier, {})
        h = latency.get(tier)
        out[tier] = TierFigures(
            tier, *(int(t.get(f, 0)) for f in _COUNTERS),
            occupancy_bytes=int(g.get("tier_occupancy_bytes", 0)), capacity_bytes=int(g.get("tier_capacity_bytes", 0)),
            fetch_p50_s=h.quantile(0.5) if h else 0.0, fetch_p90_s=h.quantile(0.9) if h else 0.0,
            fetch_p99_s=h.quantile(0.99) if h else 0.0,
        )
    return out


@dataclass(frozen=True)
class ByteMissRatio:
    """A tier's byte miss ratio on a run's trace, and the offline optimum's on the same trace."""

    tier: str
    measured: float
    optimum: float
    requested_bytes: int


def byte_miss_vs_optimum(accesses: Sequence[tuple[str, int, int, str]], tier_order: Sequence[str], tier: str,
                         capacity_bytes: int, decoded: bool, fetched: int | None = None) -> ByteMissRatio:
    """`accesses` are (key, at-rest bytes, decoded bytes, serving tier) in order; `tier_order` fastest first.

    An access served by a tier below `tier` (or by the source) missed in it. With a stager, reads
    hit entries it fetched ahead, so pass `fetched` (every byte the tier took in from below,
    demand and prefetch): the measured ratio is then fetched / requested, comparable with the
    optimum, Belady's MIN with bypass (policies.simulator.optimum) at the same capacity.
    """
    from tierflow.policies.simulator import optimum
    from tierflow.policies.traces import from_records

    depth = {name: i for i, name in enumerate(tier_order)}
    mine = depth[tier]
    requested = missed = 0
    records = []
    for position, (key, at_rest, decoded_bytes, served) in enumerate(accesses):
        size = decoded_bytes if decoded else at_rest
        requested += size
        if depth.get(served, len(tier_order)) > mine:
            missed += size
        records.append((key, size, float(position), float(position)))
    if not records:
        return ByteMissRatio(tier, 0.0, 0.0, 0)
    best = optimum(from_records(records, name=f"run at {tier}"), capacity_bytes)
    if fetched is not None:
        missed = fetched
    return ByteMissRatio(tier, missed / requested if requested else 0.0, best.byte_miss_ratio, requested)
