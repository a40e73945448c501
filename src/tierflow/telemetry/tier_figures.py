"""Per-tier figures from a metrics snapshot: the demand hit ratio, bytes, evictions, occupancy, fetch
latency.

The demand hit ratio (hits / (hits + misses)) says whether a shard was there when asked; how many
bytes a run fetched against the optimum is `bench`'s bytes per epoch (loader/plan.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

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
