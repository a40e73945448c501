"""A tier's counters, gauges and histogram, registered apart from the tier that mixes them in."""

from __future__ import annotations

from tierflow.telemetry import Counter, MetricsRegistry


class TierMetrics:
    """`Tier`'s metrics, labelled with the tier's name: what it counts as it serves, fills and evicts."""

    name: str

    def _metrics(self, registry: MetricsRegistry | None) -> None:
        self.registry = registry or MetricsRegistry()
        labels = {"tier": self.name}
        r = self.registry

        def count(what: str, description: str = "") -> Counter:
            return r.counter(f"tierflow_tier_{what}_total", labels, description)

        self.m_hits = count("hits", "entry found in this tier")
        self.m_misses = count("misses", "a reader's entry fetched from below (demand miss)")
        self.m_prefetches = count("prefetches", "entries fetched ahead of need by the stager")
        self.m_bytes_in = count("in_bytes", "bytes written into this tier")
        self.m_bytes_out = count("out_bytes", "bytes served from this tier")
        self.m_promotions = count("promotions", "entries admitted from a lower tier")
        self.m_evictions = count("evictions")
        self.m_evicted_unused = count("evictions_before_use", "prefetched, evicted before any read")
        self.m_corruptions = count("corruptions", "entries that failed verification")
        self.m_enospc = count("enospc_fallbacks", "served from below: no space")
        self.m_write_errors = count(
            "write_error_fallbacks", "served from below: the tier's device failed a write (EIO, read-only)"
        )
        self.m_index_unwritable = count(
            "index_unwritable", "index writes failed (filesystem full or failing); served from below"
        )
        self.m_bypass = count("bypass", "served from below: the policy declined")
        self.m_in_use = count("full_in_use", "served from below: every resident entry in use")
        self.m_prefetch_no_room = count("prefetch_no_room", "prefetches dropped: every resident entry in use")
        self.m_takeovers = count("lock_takeovers", "fetch lock timed out; fetched anyway")
        self.m_unavailable = count(
            "unavailable_fallbacks",
            "served from below: the tier's directory vanished or was replaced, or its index broke, under this process",
        )
        self.m_latency = r.histogram("tierflow_tier_fetch_seconds", labels, "time to fill a miss")
        self.m_occupancy = r.gauge("tierflow_tier_occupancy_bytes", labels, aggregate="max")
        self.m_capacity = r.gauge("tierflow_tier_capacity_bytes", labels, aggregate="max")
