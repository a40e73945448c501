"""accelerate over a tierflow Loader: prepare, register_for_checkpointing, save_state/load_state.

argv[1]: JSON {"data", "out", "epochs", "workers", "save_at": [steps], "ckpt_dir", "resume": state dir
or null}; each rank writes out.<rank>.json. Runs under torchrun too.
"""

import json
import os
import sys

import torch
from accelerate import Accelerator

from harness import BATCH, SEQ, VOCAB, Recorder, leave_process_group
from tierflow.integrations.accelerate import ranked
from tierflow.loader import Loader, TieredDataset, BatchSpec


class Progress:
    """The loop's own counters, checkpointed beside the model and the Loader."""

    def __init__(self):
        self.epoch, self.step = 0, 0

    def state_dict(self):
        return {"epoch": self.epoch, "step": self.step}

    def load_state_dict(self, state):
        self.epoch, self.step = state["epoch"], state["step"]


def main():
    cfg = json.loads(sys.argv[1])
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, VOCAB))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = Loader(
        TieredDataset(cfg["data"], BatchSpec(batch_size=BATCH, seq_len=SEQ)), num_workers=cfg.get("workers", 0)
    )
    model, optimizer, prepared = accelerator.prepare(model, optimizer, loader)
    assert prepared is loader  # accelerate hands back what is not a DataLoader: the Loader shards itself
    progress = Progress()
    accelerator.register_for_checkpointing(ranked(loader), progress)
    if cfg.get("resume"):
        accelerator.load_state(cfg["resume"])
    record = Recorder()
    save_at = set(cfg.get("save_at", ()))
    while progress.epoch < cfg["epochs"]:
        for batch in loader:
            record.step(progress.epoch, batch["input_ids"], loader)
            logits = model(batch["input_ids"])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            progress.step += 1
            if progress.step in save_at:
                accelerator.save_state(os.path.join(cfg["ckpt_dir"], f"step-{progress.step}"))
        progress.epoch += 1
    record.dump(f"{cfg['out']}.{accelerator.process_index}.json")
    loader.close()


if __name__ == "__main__":
    main()
    leave_process_group()  # main's trainer and DDP model freed first (harness.leave_process_group)
