"""torchtitan's dataloader protocol with its DCP CheckpointManager: TierflowDataLoader per
data-parallel rank, a tiny model, gloo ranks under torchrun.

argv[1]: JSON {"data", "out", "steps", "workers", "save_at": [steps], "ckpt_dir", "resume": step or null};
each rank writes out.<rank>.json.
"""

import json
import sys

import torch
import torch.distributed as dist
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
from torchtitan.components.optimizer.optimizer import OptimizersContainer, default_adamw

from harness import BATCH, SEQ, VOCAB, Recorder
from tierflow.integrations.torchtitan import TierflowDataLoader


class TrainState:
    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state):
        self.step = int(state["step"])


def main():
    cfg = json.loads(sys.argv[1])
    dist.init_process_group("gloo")
    dp_rank, dp_world = dist.get_rank(), dist.get_world_size()  # pure data parallelism: the dp mesh is the world
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, VOCAB))
    optimizers = OptimizersContainer(default_adamw(lr=1e-3), model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=cfg["steps"])
    dataloader = TierflowDataLoader(
        cfg["data"],
        dp_rank=dp_rank,
        dp_world_size=dp_world,
        batch_size=BATCH,
        seq_len=SEQ,
        num_workers=cfg.get("workers", 0),
    )
    assert isinstance(dataloader, BaseDataLoader)
    train_state = TrainState()
    checkpoint = CheckpointManager(
        CheckpointManager.Config(
            enable=True, folder="checkpoint", interval=1, keep_latest_k=0, last_save_model_only=False
        ),
        dataloader=dataloader,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": train_state},
        sd_adapter=None,
        base_folder=cfg["ckpt_dir"],
    )
    if cfg.get("resume") is not None:
        assert checkpoint.load(step=cfg["resume"])
        assert train_state.step == cfg["resume"]
    record = Recorder()
    save_at = set(cfg.get("save_at", ()))
    batches = iter(dataloader)
    while train_state.step < cfg["steps"]:
        inputs, labels = next(batches)
        record.step(0, inputs["input"])
        loss = torch.nn.functional.cross_entropy(model(inputs["input"]).flatten(0, 1), labels.flatten())
        loss.backward()
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        train_state.step += 1
        if train_state.step in save_at:
            checkpoint.save(train_state.step)
    checkpoint.close()
    dataloader.close()
    record.dump(f"{cfg['out']}.{dp_rank}.json")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
