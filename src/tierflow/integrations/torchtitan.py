"""torchtitan: `TierflowDataLoader`, a `BaseDataLoader` over a packed tierflow dataset.

    from tierflow.integrations.torchtitan import TierflowDataLoader
    dataloader = TierflowDataLoader("s3://bucket/packed", dp_rank=dp_rank, dp_world_size=dp_degree,
                                    batch_size=local_batch_size, seq_len=seq_len, tiers=["L2=/nvme/tf:30%"])
    # CheckpointManager(dataloader=dataloader, ...) saves and loads it with the model

or, in a torchtitan trainer config, `dataloader=TierflowDataLoader.Config(dataset_path="s3://bucket/packed",
tiers=["L2=/nvme/tf:30%"])`: the trainer's `config.dataloader.build(dp_world_size=..., dp_rank=...,
seq_len=..., local_batch_size=..., tokenizer=...)` makes one per rank (the tokenizer is unused:
the dataset was tokenized when packed).

torchtitan shards data over the data-parallel mesh dimension, not over all ranks (tensor and
pipeline ranks of one replica read the same batches), so the adapter takes the data-parallel
rank and world (`parallel_dims.get_mesh("dp")` or `dp_rank, dp_degree` as torchtitan's own
`build_*_dataloader` get them) and builds the dataset's `WorldPosition` from them:
`ranks_per_node` consecutive DP ranks share a node (its caches), 1 by default (every DP rank
owns whole partitions; correct for any placement). Other keywords go to `open_loader`
(tiers, seed, num_workers, endless, max_tokens, ...); `endless=True` by default, as torchtitan
counts steps.

It yields torchtitan's `(input_dict, labels)`: `({"input": input_ids, ...}, labels)`, with
`keep` naming batch keys to add to the dict (e.g. "position_ids"). `state_dict()` follows
`ParallelAwareDataloader`: `{"dp_rank_<r>": <this rank's Loader state, JSON>, "world_size": W}`,
so DCP stores one entry per DP rank and a resume with another DP degree is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Iterable, Iterator

import torch
from torchtitan.components.dataloader import BaseDataLoader

from tierflow.loader.loader import Loader
from tierflow.loader.open_loader import open_loader
from tierflow.loader.topology import WorldPosition


def dp_world(dp_rank: int, dp_world_size: int, ranks_per_node: int = 1) -> WorldPosition:
    """The WorldPosition of data-parallel rank `dp_rank` of `dp_world_size`."""
    if not 0 <= dp_rank < dp_world_size:
        raise ValueError(f"dp_rank={dp_rank} outside dp_world_size={dp_world_size}")
    if ranks_per_node < 1 or dp_world_size % ranks_per_node:
        raise ValueError(f"dp_world_size={dp_world_size} is not a multiple of ranks_per_node={ranks_per_node}")
    return WorldPosition(
        node=dp_rank // ranks_per_node,
        num_nodes=dp_world_size // ranks_per_node,
        local_rank=dp_rank % ranks_per_node,
        ranks_per_node=ranks_per_node,
    )


class TierflowDataLoader(BaseDataLoader):
    """torchtitan's dataloader protocol over a tierflow Loader of data-parallel rank `dp_rank`."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        """`dataset_path` (or `dataset`): the packed dataset's path or URL; the rest as open_loader's."""

        tiers: list[str] = field(default_factory=list)
        num_workers: int = 0
        seed: int = 0
        ranks_per_node: int = 1
        endless: bool = True

    def __init__(
        self,
        url: str | Path | None = None,
        *,
        dp_rank: int,
        dp_world_size: int,
        batch_size: int | None = None,
        seq_len: int | None = None,
        ranks_per_node: int = 1,
        keep: Iterable[str] = (),
        endless: bool = True,
        loader: Loader | None = None,
        config: TierflowDataLoader.Config | None = None,
        local_batch_size: int | None = None,
        tokenizer: Any = None,
        snapshot_every_n_steps: int | None = None,
        **options: Any,
    ) -> None:
        if config is not None:  # built by a torchtitan trainer: config.dataloader.build(...)
            url = url if url is not None else (config.dataset_path or config.dataset)
            options = {"tiers": list(config.tiers), "num_workers": config.num_workers, "seed": config.seed, **options}
            ranks_per_node, endless = config.ranks_per_node, config.endless
        batch_size = batch_size if batch_size is not None else local_batch_size
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self._rank_id = f"dp_rank_{dp_rank}"
        self.keep = tuple(keep)
        if loader is None:
            if batch_size is None:
                raise ValueError("TierflowDataLoader needs batch_size= (torchtitan passes local_batch_size=)")
            if url is None:
                raise ValueError("TierflowDataLoader needs a dataset url (or loader=)")
            world = dp_world(dp_rank, dp_world_size, ranks_per_node)
            loader = open_loader(url, batch_size=batch_size, seq_len=seq_len, world=world, endless=endless, **options)
        elif loader.dataset.world.world_size != dp_world_size or loader.dataset.world.rank != dp_rank:
            raise ValueError(
                f"loader= reads as rank {loader.dataset.world.rank} of {loader.dataset.world.world_size}, "
                f"not dp rank {dp_rank} of {dp_world_size}"
            )
        self.loader = loader

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        for batch in self.loader:
            if not isinstance(batch, dict):
                raise TypeError("TierflowDataLoader reads a Loader's tensors alone: open it without return_meta=True")
            inputs = {"input": batch["input_ids"]}
            for key in self.keep:
                inputs[key] = batch[key]
            yield inputs, batch["labels"]

    def __len__(self) -> int:
        return len(self.loader)

    def state_dict(self) -> dict[str, Any]:
        return {self._rank_id: json.dumps(self.loader.state_dict()), "world_size": self.dp_world_size}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return  # torchtitan loads an empty dict where it saved none
        if self._rank_id not in state_dict:
            raise KeyError(f"no tierflow Loader state for {self._rank_id} in the checkpoint ({sorted(state_dict)})")
        if int(state_dict["world_size"]) != self.dp_world_size:
            raise ValueError(
                f"the checkpoint was saved with {state_dict['world_size']} data-parallel ranks, this "
                f"job has {self.dp_world_size}: tierflow resumes another world size at a group "
                f"boundary only (docs/loader.md)"
            )
        saved = state_dict[self._rank_id]
        self.loader.load_state_dict(json.loads(saved if isinstance(saved, str) else bytes(saved).decode()))

    def close(self) -> None:
        self.loader.close()


__all__ = ["TierflowDataLoader", "dp_world"]
