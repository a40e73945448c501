"""Where this process sits in the job: node, local rank, from torch.distributed's environment variables.

A node is a group of LOCAL_WORLD_SIZE ranks sharing caches; it owns whole canonical partitions of
the order. Without LOCAL_WORLD_SIZE every rank counts as one node's rank, which is always valid
(the node only decides locality, never which samples a step reads overall). A launcher's node
index (torchrun's GROUP_RANK, Lightning's or Slurm recipes' NODE_RANK) must agree with
RANK // LOCAL_WORLD_SIZE: it names the node's own directories (a `{node}` tier path). Which
partitions a node reads (its logical index) starts as that index and, where the job's nodes have
caches, follows them (`placed_by_cache`): a job restarted onto another order of nodes reads on each
node what that node's cache holds.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any
from collections.abc import Callable, Collection, Mapping, Sequence

from tierflow.errors import TopologyError


@dataclass(frozen=True)
class WorldPosition:
    node: int = 0
    num_nodes: int = 1
    local_rank: int = 0
    ranks_per_node: int = 1

    @property
    def rank(self) -> int:
        return self.node * self.ranks_per_node + self.local_rank

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.ranks_per_node

    @classmethod
    def from_env(
        cls, env: Mapping[str, str] | None = None, process_group: tuple[int, int] | None = None
    ) -> WorldPosition:
        """This process's position: rank and world from torch.distributed when it is initialised
        (`process_group`: its (rank, world size); the environment must agree with it), else from
        RANK and WORLD_SIZE, or with RANK missing from NODE_RANK x LOCAL_WORLD_SIZE + LOCAL_RANK
        (Lightning's launcher); a single process when nothing says otherwise. A rank that nothing
        identifies in a job of several is an error, never every rank reading the same data."""
        env = os.environ if env is None else env
        if process_group is None and env is os.environ:
            process_group = _initialised_group()

        def number(name: str) -> int | None:
            text = env.get(name, "")
            if text == "":
                return None
            try:
                return int(text)
            except ValueError:
                raise TopologyError(f"{name}={text!r} is not an integer") from None

        world, rank, local = number("WORLD_SIZE"), number("RANK"), number("LOCAL_RANK")
        per_node = number("LOCAL_WORLD_SIZE")
        node = next((n for n in (number(name) for name in NODE_VARIABLES) if n is not None), None)
        if process_group is not None:
            group_rank, group_world = process_group
            for name, value, actual in (("RANK", rank, group_rank), ("WORLD_SIZE", world, group_world)):
                if value is not None and value != actual:
                    raise TopologyError(
                        f"{name}={value} disagrees with torch.distributed's {actual} "
                        f"(the default process group is what the job runs)"
                    )
            rank, world = group_rank, group_world
        world = 1 if world is None else world
        if per_node is None:
            if node not in (None, 0) and world > 1:
                raise TopologyError(
                    f"{'NODE_RANK' if env.get('NODE_RANK') else 'GROUP_RANK'}={node} without "
                    f"LOCAL_WORLD_SIZE: set LOCAL_WORLD_SIZE (ranks per node), as torchrun does, "
                    f"so every rank agrees on which ranks share a node"
                )
            per_node = world
        if per_node < 1 or world % per_node:
            raise TopologyError(f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={per_node}")
        if rank is None:
            if world > 1 and local is None:
                raise TopologyError(
                    f"WORLD_SIZE={world} but nothing says which rank this process is: set RANK "
                    f"(or NODE_RANK and LOCAL_RANK), or initialise torch.distributed first"
                )
            rank = (node or 0) * per_node + (local or 0) if world > 1 else 0
        if not 0 <= rank < world:
            raise TopologyError(f"RANK={rank} outside WORLD_SIZE={world}")
        if local is None:
            local = rank % per_node
        if local != rank % per_node:
            raise TopologyError(f"LOCAL_RANK={local} disagrees with RANK={rank} % LOCAL_WORLD_SIZE={per_node}")
        for name in NODE_VARIABLES:
            if env.get(name, "") != "" and world > 1 and int(env[name]) != rank // per_node:
                raise TopologyError(
                    f"{name}={env[name]} disagrees with RANK={rank} // LOCAL_WORLD_SIZE={per_node}: "
                    f"the partitions a node owns follow RANK, so its cache must too"
                )
        return cls(node=rank // per_node, num_nodes=world // per_node, local_rank=local, ranks_per_node=per_node)


def _initialised_group() -> tuple[int, int] | None:
    """(rank, world size) of torch.distributed's default group when it is initialised (torch is
    looked up, not imported: a pack-only process has none)."""
    import sys

    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None) if torch is not None else None
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist.get_rank(), dist.get_world_size()


#: launchers' node index variables, checked against RANK and used where no WORLD_SIZE is set
NODE_VARIABLES = ("GROUP_RANK", "NODE_RANK")


#: what names a job alike in each of its processes: torchrun's run id and the rendezvous address
JOB_VARIABLES = ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT")


def job_identity(env: Mapping[str, str] | None = None) -> str | None:
    """This job's name, the same in each of its processes (its launcher's run id and rendezvous
    address: no two running jobs share one), or None when no launcher's variables say; a node's
    ranks of one job share their staging area by it."""
    env = os.environ if env is None else env
    parts = [env.get(name, "") for name in JOB_VARIABLES]
    return "/".join(parts) if any(parts) else None


def node_index(env: Mapping[str, str] | None = None) -> int:
    """This process's node: GROUP_RANK or NODE_RANK when set (a per-node tool, `tierflow cache warm`,
    runs outside the job's group), else RANK // LOCAL_WORLD_SIZE; what a `{node}` tier path becomes."""
    env = os.environ if env is None else env
    position = WorldPosition.from_env(env)
    for name in NODE_VARIABLES:
        if env.get(name, "") != "":
            return int(env[name])
    return position.node


def assign_nodes(held: Sequence[Collection[int]], owned: Sequence[Collection[int]], sizes: Sequence[int]) -> list[int]:
    """The logical node (whose partitions it reads) of each node of the job, from what each node's
    cache holds: `held[n]` the shards node n's top tier holds, `owned[l]` the shards logical node
    l's partitions own, `sizes` each shard's bytes there. Largest overlap (bytes) first, ties to the
    lower node, then the lower logical node; nodes whose caches hold nothing of a free logical node
    take the free ones in index order, so cold caches keep the launcher's order. A permutation, and
    the same on every rank given the same inventories (what an all-gather gives each)."""
    if len(held) != len(owned):
        raise ValueError(f"{len(held)} nodes' inventories for {len(owned)} logical nodes")
    owner = {shard: logical for logical, shards in enumerate(owned) for shard in shards}
    overlap: list[tuple[int, int, int]] = []
    for node, shards in enumerate(held):
        bytes_by: dict[int, int] = {}
        for shard in shards:
            logical = owner.get(shard)
            if logical is not None:
                bytes_by[logical] = bytes_by.get(logical, 0) + int(sizes[shard])
        overlap += [(-b, node, logical) for logical, b in bytes_by.items() if b > 0]
    assigned: dict[int, int] = {}
    taken: set[int] = set()
    for _, node, logical in sorted(overlap):
        if node not in assigned and logical not in taken:
            assigned[node] = logical
            taken.add(logical)
    free = iter(sorted(set(range(len(owned))) - taken))
    return [assigned[node] if node in assigned else next(free) for node in range(len(held))]


def placed_by_cache(
    world: WorldPosition,
    held: Collection[int] | None,
    owned: Sequence[Collection[int]],
    sizes: Sequence[int],
    gather: Callable[[Any], list[Any]],
) -> WorldPosition:
    """This rank's position with its node's logical index chosen from the caches of the job's
    nodes (`assign_nodes`), so after a restart onto another order of nodes each node reads the
    partitions its cache holds. `held`: what this node's top tier holds (one rank of the node
    gives it, the others None); `gather` all-gathers one object per rank, in rank order (torch's
    `all_gather_object`). The launcher's node index still names the node's own directories."""
    inventories: list[Collection[int]] = [() for _ in range(world.num_nodes)]
    for node, shards in gather((world.node, None if held is None else sorted(held))):
        if shards is not None:
            inventories[node] = shards
    logical = assign_nodes(inventories, owned, sizes)
    return replace(world, node=logical[world.node])
