"""`plan`: what a run will fetch per epoch through its tiers, predicted from its own order.

For a capacity of the top tier, the dataset's own working set (the same at every capacity), this node's
window uses over the epochs (the order is known), replayed against the tier's policy and the
staging area (tiers/forecast.py), beside the optimum with the same room. A curve over capacities
says how much cache buys what.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from collections.abc import Sequence

import numpy as np

from tierflow.format.metadata import shard_column
from tierflow.format.shard import Form
from tierflow.loader.dataset import TieredDataset
from tierflow.order import ShardUse, future_shard_uses
from tierflow.order.working_set import WorkingSet, working_set_bytes
from tierflow.tiers.forecast import EpochBytes, optimum, replay


@dataclass(frozen=True)
class CachePlan:
    """Predicted and optimal bytes per epoch for one top-tier capacity (in its form's bytes)."""

    capacity: int
    staging: int
    working_set: WorkingSet
    predicted: list[EpochBytes]
    optimum: list[EpochBytes]
    """Belady's MIN with bypass with the same room: the tier and the staging area (RAM)."""
    tier_optimum: list[EpochBytes] | None = None
    """Belady's MIN with bypass over the tier's capacity alone (whole shards in its form)."""

    @property
    def warm_ratio(self) -> float:
        """Predicted bytes per warm epoch against the dataset (the mean of epochs after the first)."""
        return _warm(self.predicted)

    @property
    def warm_optimum(self) -> float:
        return _warm(self.optimum)


def _warm(per_epoch: list[EpochBytes]) -> float:
    warm = per_epoch[1:] or per_epoch
    return sum(e.ratio for e in warm) / len(warm)


SAMPLE_ABOVE = 16_384
"""A node reading more shards than this is forecast from a sample of them (`choose_sample`)."""
SAMPLE_SPARSE = 100
"""...and reading at least this many times its working set's shards (the staging area is scaled with it)."""
SAMPLE_SHARDS = 4_096
"""About how many shards the sample keeps: the replays cost ~10 us per use, each shard is used once an
epoch, and the plan replays the uses 12 times and runs the optimum 24 times."""


@dataclass(frozen=True)
class Sample:
    """The shards a forecast of a huge dataset replays: whole partitions (evenly spaced among the node's;
    the order walks only those), thinned by a hash of the shard index. Capacities and the staging
    area are scaled to the sample's share of the node's bytes, the bytes fetched back up by it
    (spatial sampling, as in SHARDS, Waldspurger et al., FAST '15): a reshuffled order gives every
    shard the same chance of each reuse distance. The error is a shard or two of the sample's room
    (each 1/4,096 of what the node reads, at the default size) and the sampling noise; at 10^5 shards
    the sample's figures matched the full replay's to the second decimal at every capacity."""

    partitions: frozenset[int]
    mask: np.ndarray
    """shard index -> in the sample"""
    node: np.ndarray
    """the node's shard indices (of its partitions)"""

    @property
    def shards(self) -> int:
        return int(self.mask.sum())

    def share(self, sizes: np.ndarray) -> float:
        """The sample's share of the node's bytes in `sizes`."""
        whole = float(sizes[self.node].sum())
        return float(sizes[self.mask].sum()) / whole if whole else 1.0

    def describe(self) -> str:
        return (
            f"forecast from a sample of {self.shards:,} of the node's {len(self.node):,} shards "
            f"({len(self.partitions)} partitions, thinned by shard hash; capacities and the staging area "
            f"scaled to its share, fetches scaled back up)"
        )


def choose_sample(
    dataset: TieredDataset,
    working_set: WorkingSet | None = None,
    target: int = SAMPLE_SHARDS,
    above: int = SAMPLE_ABOVE,
    sparse: int = SAMPLE_SPARSE,
) -> Sample | None:
    """The sample a forecast replays, or None (every shard) where the node reads at most `above` shards
    or fewer than `sparse` times its working set's: the staging area is scaled with the sample, and
    under a few shards of room its hits are lost, so it must be a small share of what the node reads
    (at most ~1/`sparse` of the bytes an epoch fetches)."""
    world = dataset.world
    chosen_set = working_set or dataset.working_set
    layout = dataset.order_with(chosen_set).layout
    parts = layout.node_partitions(world.node, world.num_nodes)
    node = np.concatenate([layout.partition_shards[p] for p in parts]).astype(np.int64)
    if len(node) <= max(above, sparse * chosen_set.shards):
        return None
    k = min(len(parts), max(1, math.ceil(len(parts) * 4 * target / len(node))))
    chosen = [parts[i * len(parts) // k] for i in range(k)]
    members = np.concatenate([layout.partition_shards[p] for p in chosen]).astype(np.int64)
    rate = min(1.0, target / max(1, len(members)))
    spread = (members * 2654435761) % (1 << 32)  # Knuth's multiplicative hash: a fixed, even thinning
    kept = members[spread < rate * (1 << 32)]
    mask = np.zeros(layout.num_shards, dtype=bool)
    mask[kept] = True
    return Sample(frozenset(chosen), mask, node)


def node_uses(
    dataset: TieredDataset, working_set: WorkingSet, epochs: int, sample: Sample | None = None
) -> list[ShardUse]:
    """This node's shard uses over `epochs` epochs read through `working_set` (its lanes and windows;
    not its bytes): the same for every capacity and form, so a curve computes them once. `sample`:
    only its shards' uses."""
    world = dataset.world
    order = dataset.order_with(working_set)
    node_samples = order.layout.node_samples(world.node, world.num_nodes)
    batch = dataset.batch_size * dataset.batcher.batches_per_group
    uses = future_shard_uses(
        order,
        order.start(),
        node=world.node,
        num_nodes=world.num_nodes,
        batch_size=batch,
        horizon=epochs * node_samples + batch,
        partitions=None if sample is None else sample.partitions,
    )
    if sample is None:
        return uses
    mask = sample.mask
    return [use for use in uses if mask[use.shard]]


def plan_cache(
    dataset: TieredDataset,
    capacity: int,
    *,
    epochs: int = 3,
    policy: str = "auto",
    form: Form = Form.DECODED,
    working_set: WorkingSet | None = None,
    uses: list[ShardUse] | None = None,
    sample: Sample | None = None,
) -> CachePlan:
    """The plan at `capacity` bytes of the top tier storing `form`; the working set is the dataset's
    own (its order does not depend on the tier: order/working_set.py) unless given. `uses`: its
    `node_uses`, when already made (of `sample`'s shards where one is given: `choose_sample`)."""
    rest_column = shard_column(dataset.manifest, "bytes")  # columns: no object per shard
    tier_column = shard_column(dataset.manifest, "decoded_bytes") if form == Form.DECODED else rest_column
    rest_sizes, tier_sizes = rest_column.tolist(), tier_column.tolist()
    chosen = working_set or dataset.working_set
    chosen = replace(chosen, bytes=working_set_bytes(chosen.shards, tier_sizes))  # in the tier's form
    uses = uses if uses is not None else node_uses(dataset, chosen, epochs, sample)
    staging = chosen.bytes
    room, aside, up = capacity, staging, 1.0
    if sample is not None:  # the sample's share of the room; its bytes fetched scaled back up
        share = sample.share(np.asarray(tier_column))
        room, aside = int(capacity * share), int(staging * share)
        up = 1.0 / max(sample.share(np.asarray(rest_column)), 1e-12)

    def scaled(per_epoch: list[EpochBytes]) -> list[EpochBytes]:
        return per_epoch if up == 1.0 else [replace(e, fetched=round(e.fetched * up)) for e in per_epoch]

    return CachePlan(
        capacity,
        staging,
        chosen,
        scaled(replay(uses, tier_sizes, rest_sizes, room, aside, epochs, policy)),
        scaled(optimum(uses, tier_sizes, rest_sizes, room + aside, epochs)),
        scaled(optimum(uses, tier_sizes, rest_sizes, room, epochs)),
    )


def capacity_curve(
    dataset: TieredDataset,
    fractions: Sequence[float],
    *,
    epochs: int = 3,
    form: Form = Form.DECODED,
    policy: str = "auto",
    uses: list[ShardUse] | None = None,
    sample: Sample | None = None,
) -> list[CachePlan]:
    """Plans at capacities that are `fractions` of the dataset's bytes at rest (the user's yardstick:
    what was uploaded), the tier storing `form`; the node's uses made once (`node_uses`) unless given."""
    total = int(shard_column(dataset.manifest, "bytes").sum())
    uses = uses if uses is not None else node_uses(dataset, dataset.working_set, epochs, sample)
    return [
        plan_cache(dataset, int(f * total), epochs=epochs, form=form, policy=policy, uses=uses, sample=sample)
        for f in fractions
    ]


def auto_form(dataset: TieredDataset, capacity: int) -> Form:
    """The form an `auto` tier of `capacity` bytes takes (tiers/config.py): decoded where it holds the
    whole decoded dataset, else at rest."""
    decoded = int(shard_column(dataset.manifest, "decoded_bytes").sum())
    return Form.DECODED if capacity >= decoded else Form.AT_REST


CURVE = (0.05, 0.1, 0.2, 0.3, 0.45, 0.6, 0.75, 0.9, 1.0, 1.2)


def recommended(curve: Sequence[CachePlan], dataset_bytes: int, warm_share: float = 0.05) -> str:
    """The smallest capacity on the curve whose warm epochs fetch at most `warm_share` of the dataset
    (`dataset_bytes`: at rest, the yardstick capacities are stated against)."""
    for point in curve:
        if point.warm_ratio <= warm_share:
            return (
                f"recommended: {point.capacity / 1e6:.1f} MB ({point.capacity / dataset_bytes:.0%} of the "
                f"dataset at rest) fetches {point.warm_ratio:.0%} of it per warm epoch"
            )
    return (
        f"no capacity up to {curve[-1].capacity / 1e6:.1f} MB ({curve[-1].capacity / dataset_bytes:.0%} of the "
        f"dataset at rest) brings warm epochs under {warm_share:.0%} of the dataset"
    )
