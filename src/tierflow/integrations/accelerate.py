"""accelerate: register the Loader for checkpointing; keep it out of `prepare`'s DataLoader path.

    accelerator = Accelerator()
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(ranked(loader))
    accelerator.load_state(path)      # on resume: the Loader continues after the last saved batch
    for batch in loader: ...          # each rank reads its own batches
    accelerator.save_state(path)

- `accelerator.prepare(loader)` hands the Loader back as it is (accelerate prepares DataLoaders,
  models, optimizers and schedulers only): it shards itself over the ranks, so nothing is lost,
  but nothing is gained either. Do not `prepare` a `LoaderDataLoader`: accelerate would rebuild
  a DataLoader over the TieredDataset and dispatch rank 0's batches.
- `skip_first_batches` rebuilds a DataLoader from the object and cannot resume a Loader: restore
  its state instead (`load_state`, or `loader.load_state_dict`), which costs O(1).
- accelerate writes registered objects from the main process only. `ranked(loader)` gathers
  every rank's Loader state into that one file and gives each rank its own back on load (one
  all-gather per save); the Loader itself can be registered where every rank's state is the
  same (token windows, fixed batches), not under a token budget (each rank's own stream).
"""

from __future__ import annotations

from typing import Any
from collections.abc import Mapping

import torch.distributed as dist

from tierflow.loader.loader import Loader


class RankedLoaderState:
    """The Loader states of all ranks as one object for `register_for_checkpointing`."""

    def __init__(self, loader: Loader) -> None:
        self.loader = loader

    @staticmethod
    def _world() -> tuple[int, int]:
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    def state_dict(self) -> dict[str, Any]:
        rank, world = self._world()
        mine = self.loader.state_dict()
        states: list[Any] = [mine]
        if world > 1:
            states = [None] * world
            dist.all_gather_object(states, mine)
        return {"ranks": states}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        rank, world = self._world()
        states = state["ranks"]
        if len(states) != world:
            raise ValueError(f"the checkpoint holds the Loader states of {len(states)} ranks, this job has {world}")
        self.loader.load_state_dict(states[rank])


def ranked(loader: Loader) -> RankedLoaderState:
    """What to pass to `accelerator.register_for_checkpointing` for a Loader under several ranks."""
    return RankedLoaderState(loader)


__all__ = ["RankedLoaderState", "ranked"]
