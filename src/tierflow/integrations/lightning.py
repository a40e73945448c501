"""PyTorch Lightning: return the Loader from `train_dataloader()`; nothing else is needed when the
Loader has a length (one epoch per `for`, the default).

Lightning treats the Loader as a stateful iterable (`state_dict` / `load_state_dict`): it saves
the Loader's state in its own `.ckpt` (`loops.fit_loop.state_dict.combined_loader`) and loads it
on `trainer.fit(..., ckpt_path=...)`; it injects no sampler (the Loader is not a DataLoader) and
reads `len()` for the epoch's steps.

A Loader without `len()` (`endless=True`; a token budget while its epochs have no length) makes
Lightning's fetcher hold one batch ahead (`_PrefetchDataFetcher`, `prefetch_batches=1`, to know
the last batch in advance): when the step trains batch k the Loader has already handed batch
k + 1, and a plain `state_dict()` would resume one batch late. `LoaderStateCallback` tells each
Loader of the fit loop how far ahead the fetcher runs (`Loader.lookahead`), so the state saved is
that of the batch the step trained (without the callback a resume skips one batch):

    trainer = L.Trainer(max_steps=..., callbacks=[LoaderStateCallback()])
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from tierflow.loader.loader import Loader


def _loaders(trainer: pl.Trainer) -> list[Any]:
    combined = getattr(trainer.fit_loop, "_combined_loader", None)
    if combined is None:
        return []
    return [dl for dl in combined.flattened if isinstance(getattr(dl, "loader", dl), Loader)]


class LoaderStateCallback(pl.Callback):
    """Sets each tierflow Loader's `lookahead` to the batches Lightning's fetcher holds ahead of
    the step (0 with `len()`, `prefetch_batches` without): when training starts (a resumed run
    included, whose epoch-start hook Lightning skips mid-epoch) and at the start of each epoch,
    each time before the fetcher asks for the batch after the one it prefetched."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.on_train_epoch_start(trainer, pl_module)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
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
                        "length (drop endless=True) or update tierflow")
                continue
            target.lookahead = ahead


__all__ = ["LoaderStateCallback"]
