"""The transformers Trainer (TierflowTrainer) over a tierflow Loader, a tiny GPT-2 (docs/frameworks.md).

argv[1]: JSON {"data", "out", "epochs" | "max_steps", "workers", "save_at": [steps], "output_dir",
"resume": checkpoint dir, true or null, "world": [rank, world]}; each rank writes out.<rank>.json. Runs under torchrun too.
"""

import json
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

from harness import BATCH, SEQ, VOCAB, Recorder, leave_process_group
from tierflow.integrations.transformers import TierflowTrainer
from tierflow.loader import BatchSpec, Loader, TieredDataset, WorldPosition


class Record(TrainerCallback):
    """Row fingerprints of the batches the step trains (a model forward pre-hook), len() per epoch."""

    def __init__(self, model, loader):
        self.record, self.loader, self.epoch = Recorder(), loader, 0
        model.register_forward_pre_hook(self.forward, with_kwargs=True)

    def forward(self, module, args, kwargs):
        self.record.step(self.epoch, kwargs["input_ids"], self.loader)
        labels, ids = kwargs["labels"], kwargs["input_ids"]
        assert torch.equal(labels[labels != -100], ids[labels != -100]), "labels are not the input ids (HF shifts them)"

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.epoch = int(state.epoch or 0)  # a resumed run starts inside the checkpoint's epoch


class Arguments(TrainingArguments):
    """transformers 5.3 resumes a multi-process CPU run with torch.load(map_location=args.device),
    which is cpu:<local rank> there and which torch cannot map a CPU tensor to ("don't know how to
    restore data location ... cpu:0"): the CPU has no index."""

    @property
    def device(self):
        device = super().device
        return torch.device("cpu") if device.type == "cpu" else device


class SaveAt(TrainerCallback):
    def __init__(self, at):
        self.at = set(at)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step in self.at:
            control.should_save = True


def main():
    cfg = json.loads(sys.argv[1])
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=1, n_head=2))
    world = (
        {"world": WorldPosition(0, 1, *cfg["world"])} if cfg.get("world") else {}
    )  # one process, that rank's batches
    loader = Loader(
        TieredDataset(cfg["data"], BatchSpec(batch_size=BATCH, seq_len=SEQ), **world),
        num_workers=cfg.get("workers", 0),
        endless=cfg.get("endless", False),
    )
    args = Arguments(
        output_dir=cfg["output_dir"],
        num_train_epochs=cfg.get("epochs", 1),
        max_steps=cfg.get("max_steps", -1),
        per_device_train_batch_size=BATCH,
        save_strategy="no",
        report_to=[],
        logging_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        learning_rate=1e-3,
        save_only_model=False,
    )
    record = Record(model, loader)
    trainer = TierflowTrainer(
        model=model, args=args, train_loader=loader, callbacks=[record, SaveAt(cfg.get("save_at", ()))]
    )
    trainer.train(resume_from_checkpoint=cfg.get("resume"))
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    record.record.dump(f"{cfg['out']}.{rank}.json", global_step=trainer.state.global_step)


if __name__ == "__main__":
    main()
    leave_process_group()  # main's trainer and DDP model freed first (harness.leave_process_group)
