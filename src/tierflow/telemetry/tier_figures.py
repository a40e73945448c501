"""Per-tier figures from a metrics snapshot: the demand hit ratio, bytes, evictions, occupancy, fetch
latency.

The demand hit ratio (hits / (hits + misses)) says whether a shard was there when asked; how many
bytes a run fetched against the optimum is `bench`'s bytes per epoch (loader/plan.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from collections.abc import Mapping

from tierflow.telemetry.metrics import Histogram

TIER_COUNTERS = {
    field: f"tierflow_tier_{field}_total"
    for field in (
        "hits",
        "misses",
        "promotions",
        "evictions",
        "evictions_before_use",
        "corruptions",
        "enospc_fallbacks",
        "bypass",
    )
}
TIER_COUNTERS |= {"bytes_in": "tierflow_tier_in_bytes_total", "bytes_out": "tierflow_tier_out_bytes_total"}
"""TierFigures field -> the counter the tiers record it in (tiers/tier.py)."""
OCCUPANCY = "tierflow_tier_occupancy_bytes"
CAPACITY = "tierflow_tier_capacity_bytes"
FETCH_SECONDS = "tierflow_tier_fetch_seconds"
STACK_SOURCE_BYTES = "tierflow_stack_source_bytes_total"
"""At-rest bytes the tier stack fetched from its source (label tier="source")."""


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
        for field, name in TIER_COUNTERS.items():
            if entry["name"] == name and tier is not None:
                slot = totals.setdefault(tier, {})
                slot[field] = slot.get(field, 0) + entry["value"]
    gauges: dict[str, dict[str, float]] = {}
    for entry in snapshot["gauges"]:
        tier = entry["labels"].get("tier")
        if tier is not None and entry["name"] in (OCCUPANCY, CAPACITY):
            slot = gauges.setdefault(tier, {})
            slot[entry["name"]] = max(slot.get(entry["name"], 0), entry["value"])
            totals.setdefault(tier, {})
    latency: dict[str, Histogram] = {}
    for entry in snapshot["histograms"]:
        tier = entry["labels"].get("tier")
        if entry["name"] == FETCH_SECONDS and tier is not None and tier not in latency:
            latency[tier] = Histogram.from_snapshot(entry)
    out = {}
    for tier in sorted(totals):
        t, g = totals[tier], gauges.get(tier, {})
        h = latency.get(tier)
        out[tier] = TierFigures(
            tier,
            **{f: int(t.get(f, 0)) for f in TIER_COUNTERS},
            occupancy_bytes=int(g.get(OCCUPANCY, 0)),
            capacity_bytes=int(g.get(CAPACITY, 0)),
            fetch_p50_s=h.quantile(0.5) if h else 0.0,
            fetch_p90_s=h.quantile(0.9) if h else 0.0,
            fetch_p99_s=h.quantile(0.99) if h else 0.0,
        )
    return out
