"""litgpt's data path under Fabric: TierflowDataModule -> fabric.setup_dataloaders -> (B, L+1)
tensors sliced as litgpt's pretraining slices them, a tiny litgpt GPT, fabric.save/fabric.load.

argv[1]: JSON {"data", "out", "iters", "workers", "save_at": [iters], "ckpt_dir", "resume": path or
null, "devices"}; each rank writes out.<rank>.json.
"""

import json
import os
import sys

import lightning as L
import torch
from litgpt import GPT, Config
from litgpt.utils import CycleIterator, chunked_cross_entropy

from harness import BATCH, SEQ, VOCAB, Recorder
from tierflow.integrations.litgpt import TierflowDataModule


def main():
    cfg = json.loads(sys.argv[1])
    devices = cfg.get("devices", 1)
    fabric = L.Fabric(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto")
    fabric.launch()
    fabric.seed_everything(0)
    config = Config(block_size=SEQ, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=1, n_head=2, n_embd=16)
    model = fabric.setup(GPT(config))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.05))
    data = TierflowDataModule(cfg["data"], endless=cfg.get("endless", False), num_workers=cfg.get("workers", 0))
    data.connect(batch_size=BATCH, max_seq_length=SEQ)
    data.setup()
    train, val = fabric.setup_dataloaders(data.train_dataloader(), data.val_dataloader())
    state = {"model": model, "optimizer": optimizer, "train_dataloader": train, "iter_num": 0, "epoch": 0}
    if cfg.get("resume"):
        fabric.load(cfg["resume"], state)
    record = Recorder()
    iterator = CycleIterator(train)
    iterator.epoch = state["epoch"]
    save_at = set(cfg.get("save_at", ()))
    for rows in iterator:  # litgpt.pretrain.fit's loop
        if state["iter_num"] >= cfg["iters"]:
            break
        assert rows.shape == (BATCH, SEQ + 1), rows.shape
        input_ids, targets = rows[:, :SEQ].long(), rows[:, 1 : SEQ + 1].long()
        record.step(iterator.epoch, input_ids, train)
        loss = chunked_cross_entropy(model(input_ids), targets)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        state["iter_num"] += 1
        state["epoch"] = iterator.epoch
        if state["iter_num"] in save_at:
            fabric.save(os.path.join(cfg["ckpt_dir"], f"step-{state['iter_num']}.pth"), state)
    val_rows = next(iter(val))
    assert val_rows.shape == (BATCH, SEQ + 1)
    record.dump(f"{cfg['out']}.{fabric.global_rank}.json")


if __name__ == "__main__":
    main()
