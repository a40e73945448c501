"""A tiny LightningModule over a tierflow Loader from `train_dataloader()` (docs/frameworks.md).

argv[1]: JSON {"data", "out", "epochs" | "max_steps", "workers", "devices", "save_at": [steps],
"ckpt_dir", "resume": .ckpt path or null, "endless", "max_tokens", "world": [rank, world] (one process
reading that rank's batches)}; each rank writes out.<rank>.json.
"""

import json
import os
import sys

import lightning as L
import torch

from harness import BATCH, SEQ, VOCAB, Recorder
from tierflow.integrations.lightning import LoaderStateCallback
from tierflow.loader import BatchSpec, Loader, TieredDataset, WorldPosition


class TinyLM(L.LightningModule):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.emb = torch.nn.Embedding(VOCAB, 16)
        self.head = torch.nn.Linear(16, VOCAB)
        self.record = Recorder()

    def train_dataloader(self):
        shape = {"max_tokens": self.cfg["max_tokens"]} if self.cfg.get("max_tokens") else {"seq_len": SEQ}
        if self.cfg.get("world"):  # [rank, world]: one process reading rank `rank`'s batches
            shape["world"] = WorldPosition(0, 1, *self.cfg["world"])
        world = shape.pop("world", None)
        dataset = TieredDataset(self.cfg["data"], BatchSpec(batch_size=BATCH, **shape), world=world)
        return Loader(dataset, num_workers=self.cfg.get("workers", 0), endless=self.cfg.get("endless", False))

    def training_step(self, batch, batch_idx):
        ids = batch["input_ids"]
        self.record.step(self.current_epoch, ids, self.trainer.train_dataloader)
        logits = self.head(self.emb(ids))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class SaveAt(L.Callback):
    """Saves the .ckpt after the steps in `at` (what ModelCheckpoint(every_n_train_steps) does)."""

    def __init__(self, at, folder):
        self.at, self.folder = set(at), folder

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step in self.at:
            trainer.save_checkpoint(os.path.join(self.folder, f"step-{trainer.global_step}.ckpt"))


def main():
    cfg = json.loads(sys.argv[1])
    model = TinyLM(cfg)
    devices = cfg.get("devices", 1)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        max_epochs=cfg.get("epochs", -1) if "epochs" in cfg else None,
        max_steps=cfg.get("max_steps", -1),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[SaveAt(cfg.get("save_at", ()), cfg.get("ckpt_dir", ".")), LoaderStateCallback()],
    )
    trainer.fit(model, ckpt_path=cfg.get("resume"))
    model.record.dump(f"{cfg['out']}.{trainer.global_rank}.json", world=trainer.world_size)


if __name__ == "__main__":
    main()
