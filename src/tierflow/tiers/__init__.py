"""Storage tiers: shards staged from a source (L4/L3) through local disk (L2) and RAM (L1).

stack = build_stack("s3://bucket/dataset", [
    TierConfig("L1", "/dev/shm/tierflow", capacity=8 << 30, form="decoded"),
    TierConfig("L2", "/nvme/tierflow", capacity="30%", policy="auto"),  # 30% of the dataset at rest
], endpoint_url="http://127.0.0.1:9000")
ds = stack.dataset()          # a tierflow Dataset whose shards come through the tiers
"""

from __future__ import annotations

from dataclasses import replace
from collections.abc import Sequence

from tierflow.format.shard import Form
from tierflow.telemetry import MetricsRegistry
from tierflow.tiers.config import AUTO_FORM, DatasetShare, DiskShare, TierConfig, parse_capacity, parse_size
from tierflow.tiers.handle import Handle, Opened
from tierflow.tiers.stack import TierStack
from tierflow.tiers.tier import EntryHeat, Tier


def build_stack(
    url: str,
    tiers: Sequence[TierConfig | Tier | str] = (),
    *,
    endpoint_url: str | None = None,
    bandwidth: float | None = None,
    registry: MetricsRegistry | None = None,
    node: int | None = None,
) -> TierStack:
    """A tier stack over the dataset at `url` (a local path, s3://, or another fsspec URL).

    `bandwidth` (bytes/s) caps this job's fetches, under the node's budget (TIERFLOW_NODE_BANDWIDTH);
    `node` fills a `{node}` placeholder in tier paths (each node its own L2 directory). A tier whose
    capacity is a share of the dataset (`"30%"`) or whose form is `auto` (the default) is resolved
    against the dataset's manifest, read once here (`TierConfig.resolve`)."""
    from tierflow.storage.budget import BandwidthBudget
    from tierflow.storage.remote import open_store

    registry = registry or MetricsRegistry()
    budget = BandwidthBudget(bandwidth or None, registry=registry)
    source = open_store(url, endpoint_url=endpoint_url, budget=budget, registry=registry)
    configs = [TierConfig.parse(t) if isinstance(t, str) else t for t in tiers]
    manifest = None
    if any(isinstance(c, TierConfig) and not c.resolved for c in configs):
        # a share of the dataset, or a form by what fits: sized against the dataset's bytes at rest
        from tierflow.format.metadata import shard_column
        from tierflow.storage.datasets import read_manifest

        manifest = read_manifest(source)  # its size checked first, as TierStack.manifest() does
        at_rest = int(shard_column(manifest, "bytes").sum())  # mapped columns: no object per shard
        decoded = int(shard_column(manifest, "decoded_bytes").sum())
        resolved: list[TierConfig | Tier] = []
        below_decoded = False  # decoded bytes never move down to a compressed form: auto above one is decoded
        for c in reversed(configs):
            if isinstance(c, TierConfig) and not c.resolved:
                auto = c.form == AUTO_FORM
                c = c.resolve(at_rest, decoded, node)
                if auto and below_decoded:
                    c = replace(c, form=Form.DECODED)
            below_decoded = below_decoded or c.form is Form.DECODED
            resolved.append(c)
        configs = resolved[::-1]
    built = [c if isinstance(c, Tier) else c.build(registry, node) for c in configs]
    return TierStack(source, built, registry=registry, manifest=manifest)


__all__ = [
    "DatasetShare",
    "DiskShare",
    "EntryHeat",
    "Form",
    "Handle",
    "Opened",
    "Tier",
    "TierConfig",
    "TierStack",
    "build_stack",
    "parse_capacity",
    "parse_size",
]
