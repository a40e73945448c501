"""`LoaderDataLoader`: a Loader with the face of a `torch.utils.data.DataLoader`.

Some frameworks accept nothing but a `torch.utils.data.DataLoader` (Fabric's
`setup_dataloaders`, which litgpt's pretraining calls). This subclass is one, built over the
Loader's `TieredDataset` with `batch_size=None` (so nothing re-batches or re-samples it: an
iterable dataset gets no `DistributedSampler`), and delegates what matters to the Loader:
`iter()` (one epoch per `for`), `len()`, `state_dict()` / `load_state_dict()`. `map` turns each
batch into what the framework's step expects (litgpt: one (B, L+1) token tensor).

It never starts the DataLoader's own workers: the Loader owns its workers and its feed.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Callable, Iterator, Mapping

from torch.utils.data import DataLoader

from tierflow.loader.loader import Loader


class LoaderDataLoader(DataLoader):
    """A `DataLoader` whose iteration, length and state are those of `loader`, each batch passed
    through `map` (None: as the Loader hands it)."""

    def __init__(self, loader: Loader, map: Callable[[Any], Any] | None = None) -> None:
        super().__init__(loader.dataset, batch_size=None)
        self.__dict__["loader"] = loader
        self.__dict__["map"] = map

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        convert = self.map
        for batch in self.loader:
            yield batch if convert is None else convert(batch)

    def __len__(self) -> int:
        return len(self.loader)

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.loader.load_state_dict(state)

    def close(self) -> None:
        self.loader.close()

    def __getattr__(self, name: str) -> Any:
        # what a DataLoader does not have itself (remaining, last_meta, telemetry, ...) is the Loader's
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.__dict__["loader"], name)


def token_rows(batch: Mapping[str, Any]) -> Any:
    """(B, L+1) token ids from a token-window batch: `input_ids` and the last column of `labels`
    (litgpt's and nanoGPT's convention: the step slices inputs [:, :-1] and targets [:, 1:])."""
    import torch

    ids, labels = batch["input_ids"], batch["labels"]
    return torch.cat([ids, labels[:, -1:]], dim=1)


__all__ = ["LoaderDataLoader", "token_rows"]
