"""Storage tiers: shards staged from a source (L4/L3) through local disk (L2) and RAM (L1).

    stack = build_stack("s3://bucket/dataset", [
        TierConfig("L1", "/dev/shm/tierflow", capacity=8 << 30, form="decoded"),
        TierConfig("L2", "/nvme/tierflow", capacity=0.8, policy="auto", form="at_rest"),
    ], endpoint_url="http://127.0.0.1:9000")
    ds = stack.dataset()          # a tierflow Dataset whose shards come through the tiers
"""

from __future__ import annotations

from typing import Sequence

from tierflow.format.shard import Form
from tierflow.telemetry import MetricsRegistry
from tierflow.tiers.config import TierConfig, parse_capacity, parse_size
from tierflow.tiers.stack import Handle, Opened, TierStack
from tierflow.tiers.tier import EntryHeat, Tier


def build_stack(url: str, tiers: Sequence[TierConfig | Tier | str] = (), *, endpoint_url: str | None = None,
                bandwidth: float | None = None, registry: MetricsRegistry | None = None,
                node: int | None = None) -> TierStack:
    """A tier stack over the dataset at `url` (a local path, s3://, or another fsspec URL).

    `bandwidth` (bytes/s) caps this job's fetches, under the node's budget (TIERFLOW_NODE_BANDWIDTH);
    `node` fills a `{node}` placeholder in tier paths (each node its own L2 directory)."""
    from tierflow.storage.budget import BandwidthBudget
    from tierflow.storage.remote import open_source

    registry = registry or MetricsRegistry()
    budget = BandwidthBudget(bandwidth or None, registry=registry)
    source = open_source(url, endpoint_url=endpoint_url, budget=budget, registry=registry)
    built = [t if isinstance(t, Tier) else (TierConfig.parse(t) if isinstance(t, str) else t).build(registry, node)
             for t in tiers]
    return TierStack(source, built, registry=registry)


__all__ = ["EntryHeat", "Form", "Handle", "Opened", "Tier", "TierConfig", "TierStack", "build_stack", "parse_capacity",
           "parse_size"]
