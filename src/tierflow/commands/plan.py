"""`plan`: what a run will fetch per epoch through its tiers, predicted from its own order.

For a capacity of the top tier, the dataset's own working set (the same at every capacity), this node's
window uses over the epochs (the order is known), replayed against the tier's policy and the
staging area (tiers/forecast.py), beside the optimum with the same room. A curve over capacities
says how much cache buys what.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

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


def node_uses(dataset: TieredDataset, working_set: WorkingSet, epochs: int) -> list[ShardUse]:
    """This node's shard uses over `epochs` epochs read through `working_set` (its lanes and windows;
    not its bytes): the same for every capacity and form, so a curve computes them once."""
    world = dataset.world
    order = dataset.order_with(working_set)
    node_samples = order.layout.node_samples(world.node, world.num_nodes)
    batch = dataset.batch_size * dataset.batcher.batches_per_group
    return future_shard_uses(order, order.start(), node=world.node, num_nodes=world.num_nodes,
                             batch_size=batch, horizon=epochs * node_samples + batch)


def plan_cache(dataset: TieredDataset, capacity: int, *, epochs: int = 3, policy: str = "auto",
               form: Form = Form.DECODED, working_set: WorkingSet | None = None,
               uses: list[ShardUse] | None = None) -> CachePlan:
    """The plan at `capacity` bytes of the top tier storing `form`; the working set is the dataset's
    own (its order does not depend on the tier: order/working_set.py) unless given. `uses`: its
    `node_uses`, when already made."""
    rest_sizes = shard_column(dataset.manifest, "bytes").tolist()  # columns: no object per shard
    tier_sizes = shard_column(dataset.manifest, "decoded_bytes").tolist() if form == Form.DECODED else rest_sizes
    chosen = working_set or dataset.working_set
    chosen = replace(chosen, bytes=working_set_bytes(chosen.shards, tier_sizes))  # in the tier's form
    uses = uses if uses is not None else node_uses(dataset, chosen, epochs)
    staging = chosen.bytes
    return CachePlan(capacity, staging, chosen, replay(uses, tier_sizes, rest_sizes, capacity, staging, epochs, policy),
                     optimum(uses, tier_sizes, rest_sizes, capacity + staging, epochs),
                     optimum(uses, tier_sizes, rest_sizes, capacity, epochs))


def capacity_curve(dataset: TieredDataset, fractions: Sequence[float], *, epochs: int = 3,
                   form: Form = Form.DECODED, policy: str = "auto", uses: list[ShardUse] | None = None) -> list[CachePlan]:
    """Plans at capacities that are `fractions` of the dataset's bytes at rest (the user's yardstick:
    what was uploaded), the tier storing `form`; the node's uses made once (`node_uses`) unless given."""
    total = int(shard_column(dataset.manifest, "bytes").sum())
    uses = uses if uses is not None else node_uses(dataset, dataset.working_set, epochs)
    return [plan_cache(dataset, int(f * total), epochs=epochs, form=form, policy=policy, uses=uses)
            for f in fractions]


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
            return (f"recommended: {point.capacity / 1e6:.1f} MB ({point.capacity / dataset_bytes:.0%} of the "
                    f"dataset at rest) fetches {point.warm_ratio:.0%} of it per warm epoch")
    return (f"no capacity up to {curve[-1].capacity / 1e6:.1f} MB ({curve[-1].capacity / dataset_bytes:.0%} of the "
            f"dataset at rest) brings warm epochs under {warm_share:.0%} of the dataset")
