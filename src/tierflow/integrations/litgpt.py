"""litgpt: `TierflowDataModule`, a litgpt `DataModule` that Fabric accepts, yielding (B, L+1) tokens.

    litgpt pretrain pythia-14m --data tierflow.integrations.litgpt.TierflowDataModule \
        --data.url s3://bucket/packed --data.tiers '["L2=/nvme/tf:30%"]' ...

(litgpt's CLI instantiates the DataModule from its import path; `litgpt.pretrain.setup(...,
data=TierflowDataModule(...))` from Python trains the same, but litgpt saves each checkpoint's
hyperparameters by re-parsing `sys.argv` as its CLI's.)

litgpt calls `connect(tokenizer, batch_size=micro_batch_size, max_seq_length=block_size)`,
`setup()`, then `train_dataloader()` / `val_dataloader()` and hands both to Fabric's
`setup_dataloaders`, which accepts only a `torch.utils.data.DataLoader`: each is a
`LoaderDataLoader` (tierflow.integrations.dataloader) over a Loader of token windows of
`max_seq_length`, each batch one (B, max_seq_length + 1) int64 tensor (inputs [:, :-1], targets
[:, 1:], as litgpt slices them). Its `state_dict()` is the Loader's, so `fabric.save(path, state)`
with the dataloader in `state` and `fabric.load` resume exactly; each rank reads its own batches
(torch.distributed is up when litgpt calls `setup()`), and nothing wants a DistributedSampler.

The Loader is endless by default (`endless=True`: litgpt counts iterations, not epochs, and its
CycleIterator re-enters an iterator that ends); `endless=False` gives one epoch per pass.
"""

from __future__ import annotations

from typing import Any

from litgpt.data import DataModule

from tierflow.integrations.dataloader import LoaderDataLoader, token_rows
from tierflow.loader.open_loader import open_loader


class TierflowDataModule(DataModule):
    """Pretraining data for litgpt from a packed tierflow dataset (`url`: a path or s3://...;
    tiers, num_workers, seed, and in `options` any other open_loader keyword). `val_url` (default: `url`)
    is read in eval mode, `val_batches` batches of it (None: all)."""

    def __init__(
        self,
        url: str,
        *,
        val_url: str | None = None,
        val_batches: int | None = 8,
        endless: bool = True,
        tiers: list[str] | None = None,
        num_workers: int = 0,
        seed: int = 0,
        options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        options = {"tiers": list(tiers or ()), "num_workers": num_workers, "seed": seed, **(options or {})}
        self.url = url
        self.val_url = val_url if val_url is not None else url
        self.val_batches = val_batches
        self.endless = endless
        self.options = options
        self.batch_size = 1
        self.seq_length: int | None = None
        self.train: LoaderDataLoader | None = None
        self.val: LoaderDataLoader | None = None

    def connect(
        self, tokenizer: Any = None, batch_size: int = 1, max_seq_length: int | None = None, **kwargs: Any
    ) -> None:
        if max_seq_length is None:
            raise ValueError("TierflowDataModule reads token windows: litgpt passes max_seq_length (the block size)")
        self.batch_size = batch_size
        self.seq_length = max_seq_length

    def setup(self, stage: str = "") -> None:
        if self.seq_length is None:
            raise RuntimeError("connect(batch_size=..., max_seq_length=...) before setup()")
        batch_size, seq_len = self.batch_size, self.seq_length
        train = open_loader(self.url, batch_size=batch_size, seq_len=seq_len, endless=self.endless, **self.options)
        val_options = {k: v for k, v in self.options.items() if k not in ("resume",)}
        val = open_loader(
            self.val_url, batch_size=batch_size, seq_len=seq_len, eval=True, max_batches=self.val_batches, **val_options
        )
        self.train = LoaderDataLoader(train, map=token_rows)
        self.val = LoaderDataLoader(val, map=token_rows)

    def train_dataloader(self) -> LoaderDataLoader:
        if self.train is None:
            self.setup()
        assert self.train is not None
        return self.train

    def val_dataloader(self) -> LoaderDataLoader:
        if self.val is None:
            self.setup()
        assert self.val is not None
        return self.val

    def __repr__(self) -> str:
        return f"TierflowDataModule({str(self.url)!r})"


__all__ = ["TierflowDataModule"]
