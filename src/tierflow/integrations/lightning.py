"""PyTorch Lightning: return the Loader from `train_dataloader()`, with `LoaderStateCallback`.

Lightning treats the Loader as a stateful iterable (`state_dict` / `load_state_dict`): it saves
the Loader's state in its own `.ckpt` (`loops.fit_loop.state_dict.combined_loader`) and loads it
on `trainer.fit(..., ckpt_path=...)`; it injects no sampler (the Loader is not a DataLoader) and
reads `len()` for the epoch's steps, once: at the first `len()` (before a resumed run's state is
loaded) it fixes `combined_loader.limits` and `fit_loop.max_batches` for every epoch. A Loader's
epochs differ by a batch where remainders carry over (53, 54, 53), so a longer epoch would be
cut and its last batch trained in the next: the callback sets both from `len()` at each epoch's
start (`reload_dataloaders_every_n_epochs=1` calls `train_dataloader()` again, and a new Loader
starts over at epoch 0).

A Loader without `len()` (`endless=True`; a token budget while its epochs have no length) makes
Lightning's fetcher hold one batch ahead (`_PrefetchDataFetcher`, `prefetch_batches=1`, to know
the last batch in advance): when the step trains batch k the Loader has already handed batch
k + 1, and a plain `state_dict()` would resume one batch late. `LoaderStateCallback` tells each
Loader of the fit loop how far ahead the fetcher runs (`Loader.lookahead`), so the state saved is
that of the batch the step trained (without the callback a resume skips one batch):

    trainer = L.Trainer(max_steps=..., callbacks=[LoaderStateCallback()])

Under several ranks Lightning writes the `.ckpt` from rank 0, so every rank would resume from
rank 0's Loader state: right for token windows (every rank's cursor is the node's), wrong for a
token budget (each rank its own stream: the Loader refuses another rank's). The callback also
gathers every rank's states into the `.ckpt` and gives each rank its own back on resume.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.data import sized_len
from lightning.pytorch.trainer.connectors.data_connector import _parse_num_batches
from lightning.pytorch.trainer.states import RunningStage

from tierflow.loader.loader import Loader


RANKS_KEY = "tierflow_loader_states"
"""Where `LoaderStateCallback` keeps every rank's Loader states in a `.ckpt` (one list per rank)."""


def _loader_states(checkpoint: dict[str, Any]) -> Any:
    return checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {}).get("combined_loader")


def _loaders(trainer: pl.Trainer) -> list[Any]:
    combined = getattr(trainer.fit_loop, "_combined_loader", None)
    if combined is None:
        return []
    return [dl for dl in combined.flattened if isinstance(getattr(dl, "loader", dl), Loader)]


def _epoch_limits(trainer: pl.Trainer) -> None:
    """Lightning's batch limit of the epoch about to run, from `len()` now. Lightning fixes it at
    the first `len()` (before a resumed run's state is loaded, too), but a Loader's epochs differ
    by a batch where remainders carry over: a longer epoch would be cut, its last batch spilling
    into the next. Read live: `combined_loader.limits` by the epoch's iterator (made after this
    hook, or in `on_train_start` before it, hence the iterator's too) and `fit_loop.max_batches`
    (`trainer.num_training_batches`) by the epoch loop's end-of-epoch check."""
    loop = trainer.fit_loop
    combined = getattr(loop, "_combined_loader", None)
    if combined is None or not any(isinstance(getattr(dl, "loader", dl), Loader) for dl in combined.flattened):
        return
    limits = []
    for dl in combined.flattened:
        length = sized_len(dl)
        limits.append(
            float("inf")
            if length is None
            else _parse_num_batches(RunningStage.TRAINING, length, trainer.limit_train_batches)
        )
    combined.limits = limits
    if combined._iterator is not None:
        combined._iterator.limits = limits
        length = sized_len(combined)
        loop.max_batches = float("inf") if length is None else length


class LoaderStateCallback(pl.Callback):
    """Sets Lightning's batch limit of each epoch from `len()` at its start (`_epoch_limits`), and
    each tierflow Loader's `lookahead` to the batches Lightning's fetcher holds ahead of
    the step (0 with `len()`, `prefetch_batches` without): when training starts (a resumed run
    included, whose epoch-start hook Lightning skips mid-epoch) and at the start of each epoch,
    each time before the fetcher asks for the batch after the one it prefetched."""

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Every rank's Loader states into the `.ckpt` (Lightning writes rank 0's alone: right for
        token windows, whose cursor every rank shares, not for a token budget's own streams)."""
        states = _loader_states(checkpoint)
        if states is None or trainer.world_size < 2:
            return
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, states)
        checkpoint[RANKS_KEY] = gathered

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """This rank's own Loader states back, before Lightning's fit loop loads them."""
        ranks = checkpoint.get(RANKS_KEY)
        loop = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict")
        if ranks is None or loop is None:
            return
        if len(ranks) != trainer.world_size:
            raise ValueError(
                f"the checkpoint holds the Loader states of {len(ranks)} ranks, this run has {trainer.world_size}"
            )
        loop["combined_loader"] = ranks[trainer.global_rank]

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.on_train_epoch_start(trainer, pl_module)
        # the epoch's iterator exists already (a resumed run: made after the Loader's state was loaded)
        fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
        if fetcher is not None and fetcher.length is not None:
            fetcher.length = sized_len(fetcher.combined_loader)
            fetcher.done = fetcher.length == 0

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _epoch_limits(trainer)
        fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
        ahead = 0
        if fetcher is not None and getattr(fetcher, "length", None) is None:
            ahead = int(getattr(fetcher, "prefetch_batches", 0))
        for loader in _loaders(trainer):
            target = getattr(loader, "loader", loader)
            if not hasattr(target, "lookahead"):
                if ahead:
                    raise RuntimeError(
                        "this tierflow's Loader has no `lookahead`: under Lightning a Loader without len() "
                        "(endless=True) would save the state of the batch after the one trained; give it a "
                        "length (drop endless=True) or update tierflow"
                    )
                continue
            target.lookahead = ahead


__all__ = ["LoaderStateCallback"]
