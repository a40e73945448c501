"""The Hugging Face `Trainer` over a tierflow Loader, exact across `resume_from_checkpoint`.

    from tierflow.integrations.transformers import TierflowTrainer
    trainer = TierflowTrainer(model=model, args=TrainingArguments(...), train_loader=loader)
    trainer.train()                              # or train(resume_from_checkpoint=True / "out/checkpoint-300")

What it does, and why the plain `Trainer` cannot take the Loader:
- `get_train_dataloader()` returns the Loader (through `TrainerLoader`, a `LoaderDataLoader`
  that hands batches in the Hugging Face convention, `hf_batch`). The plain `Trainer` wraps
  `train_dataset` in a `DataLoader(batch_size=per_device_train_batch_size)` and
  `accelerator.prepare`s it: a
  TieredDataset batches itself, and accelerate would dispatch an iterable dataset's batches
  from rank 0 instead of letting each rank read its own.
- `LoaderCheckpointCallback` writes each rank's Loader state into `checkpoint-N/tierflow-loader/`
  on every save; `train(resume_from_checkpoint=...)` loads it before training resumes, so the
  Loader starts right after the last batch the checkpointed step trained (O(1), nothing re-read).
- The Trainer takes every epoch as long as the first `len()` (max_steps = epochs x that); a
  Loader's epochs differ by a batch where remainders carry over, so `TierflowTrainer` sizes
  each epoch, `max_steps` and the resumed position from `Loader.epoch_lengths` (the plan is
  saved with each checkpoint).
- The Trainer still counts the batches it already trained in the resumed epoch and asks
  accelerate's `skip_first_batches` for a loader that skips them (which would rebuild a
  DataLoader from the object: `'Loader' object has no attribute 'drop_last'`). For a
  `TrainerLoader` that skip is the Loader's own resume: the Loader is handed back as it is,
  after checking that it stands exactly that many batches into the epoch.

`hf_batch` is the conversion alone, for a hand-written loop: `labels` are `input_ids` (Hugging
Face causal LMs shift them themselves; tierflow's own `labels` are already the next tokens) with
each document's first token masked -100, so no position learns across a document boundary;
`position_ids`, `cu_seqlens`, `max_seqlen`, `mask` only when asked (`keep=`).
"""

from __future__ import annotations

import json
import math
import os
from functools import partial
from pathlib import Path
from typing import Any
from collections.abc import Iterable, Mapping

import torch
import transformers
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from tierflow.integrations.dataloader import LoaderDataLoader
from tierflow.loader.loader import Loader

IGNORE_INDEX = -100
STATE_FOLDER = "tierflow-loader"
EXTRA_KEYS = ("position_ids", "cu_seqlens", "max_seqlen", "mask")


def hf_batch(batch: Mapping[str, Any], keep: Iterable[str] = ()) -> dict[str, Any]:
    """A token-window batch in the Hugging Face causal-LM convention: `input_ids`, and `labels`
    = `input_ids` with the first token of each document (position id 0) set to -100; the keys
    named in `keep` (position_ids, cu_seqlens, max_seqlen, mask) are passed along as they are."""
    ids = batch["input_ids"]
    labels = ids.clone()
    positions = batch.get("position_ids")
    if positions is not None:
        labels[positions == 0] = IGNORE_INDEX  # column 0 is never a target after the model's shift
    out = {"input_ids": ids, "labels": labels.to(torch.int64)}
    for key in keep:
        if key not in batch:
            raise KeyError(f"keep={key!r}: the batch has {sorted(batch)}; token windows carry {list(EXTRA_KEYS)}")
        out[key] = batch[key]
    return out


class TrainerLoader(LoaderDataLoader):
    """A Loader as the `Trainer` iterates it: a `LoaderDataLoader` that hands `hf_batch` batches
    (`hf=False`: as the Loader hands them), with the Loader's `len()` and state. The Trainer never
    `accelerator.prepare`s what `get_train_dataloader()` returns, so each rank reads its own batches."""

    def __init__(self, loader: Loader, hf: bool = True, keep: Iterable[str] = ()) -> None:
        super().__init__(loader, map=partial(hf_batch, keep=tuple(keep)) if hf else None)


def _rank(args: Any) -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(getattr(args, "process_index", 0))


class LoaderCheckpointCallback(TrainerCallback):
    """Saves the Loader's state (each rank its own file) in `checkpoint-N/tierflow-loader/` on
    every Trainer save; `load(checkpoint_dir)` restores it (TierflowTrainer.train calls it)."""

    def __init__(self, loader: Loader | TrainerLoader) -> None:
        self.loader = loader
        self.counts: dict[str, Any] = {}
        """The run's epoch plan, saved beside the state with the step (TierflowTrainer fills and reads them)."""
        self.restored: dict[str, Any] = {}

    @staticmethod
    def path(checkpoint_dir: str | os.PathLike, rank: int) -> Path:
        return Path(checkpoint_dir) / STATE_FOLDER / f"rank-{rank}.json"

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        path = self.path(folder, _rank(args))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        counts = {**self.counts, "global_step": state.global_step}
        tmp.write_text(json.dumps({"loader": self.loader.state_dict(), "trainer": counts}))
        os.replace(tmp, path)

    def load(self, checkpoint_dir: str | os.PathLike, args: Any) -> None:
        path = self.path(checkpoint_dir, _rank(args))
        if not path.is_file():
            raise FileNotFoundError(
                f"{path}: no tierflow Loader state in {checkpoint_dir} (was it saved by a Trainer with "
                f"LoaderCheckpointCallback / TierflowTrainer?); resuming without it would replay the epoch from its start"
            )
        saved = json.loads(path.read_text())
        self.loader.load_state_dict(saved["loader"])
        self.restored = dict(saved.get("trainer") or {})


class TierflowTrainer(Trainer):
    """`Trainer` whose training batches come from `train_loader` (a tierflow Loader), in the Hugging
    Face convention unless `hf_labels=False`, with `keep` extra keys; exact across resumes."""

    def __init__(
        self, *args: Any, train_loader: Loader, hf_labels: bool = True, keep: Iterable[str] = (), **kwargs: Any
    ) -> None:
        if kwargs.get("train_dataset") is not None:
            raise ValueError("TierflowTrainer reads train_loader=; pass no train_dataset")
        self.train_loader = TrainerLoader(train_loader, hf=hf_labels, keep=keep)
        self.loader_callback = LoaderCheckpointCallback(self.train_loader)
        kwargs["callbacks"] = list(kwargs.get("callbacks") or []) + [self.loader_callback]
        self.epochs: list[int] | None = None
        """This run's batches per epoch from its start (None without len())."""
        super().__init__(*args, **kwargs)
        _install_skip()

    def get_train_dataloader(self) -> TrainerLoader:
        return self.train_loader

    def set_initial_training_values(self, args: Any, dataloader: Any) -> tuple[Any, ...]:
        """The Trainer's step counts from this run's epochs as they are. The Trainer takes every
        epoch as long as the first len() (max_steps = epochs x that), but a Loader's epochs differ
        by a batch (remainders carry over): it would cut a longer epoch or stop before the last
        batch. The plan (each epoch's batches, `Loader.epoch_lengths`) is saved with each checkpoint:
        a resumed run takes the epochs before its own from it and the rest from the Loader."""
        values = list(super().set_initial_training_values(args, dataloader))
        self.epochs = plan = self._epoch_plan(args)
        if plan:
            updates = [math.ceil(n / args.gradient_accumulation_steps) for n in plan]
            if args.max_steps > 0:
                values[0] = len(plan)
            else:
                whole = int(args.num_train_epochs)
                fraction = args.num_train_epochs - whole
                values[6] = sum(updates[:whole]) + (math.ceil(fraction * updates[whole]) if fraction else 0)
            values[1], values[5] = updates[0], plan[0]
        self.loader_callback.counts = {"epochs": plan}
        return tuple(values)

    def _epoch_plan(self, args: Any) -> list[int] | None:
        """Each epoch's batches from the run's start, as many epochs as `num_train_epochs` or as reach
        `max_steps`; None without len() (then the Trainer counts max_steps in one "epoch", and so
        does the Loader)."""
        loader = self.train_loader.loader
        try:
            len(loader)
        except TypeError:
            return None
        accum = args.gradient_accumulation_steps
        saved = self.loader_callback.restored
        past: list[int] = []
        if saved.get("epochs"):  # resumed: the epochs before the one the Loader stands in
            steps = 0
            for n in saved["epochs"]:
                if steps + math.ceil(n / accum) > saved["global_step"]:
                    break
                past.append(n)
                steps += math.ceil(n / accum)
        if args.max_steps <= 0:
            return past + loader.epoch_lengths(max(0, math.ceil(args.num_train_epochs) - len(past)))
        steps = sum(math.ceil(n / accum) for n in past)
        count = math.ceil(max(0, args.max_steps - steps) / max(1, len(loader) // accum - 1)) + 1
        while True:
            plan, total = list(past), steps
            for n in loader.epoch_lengths(count):
                if total >= args.max_steps:
                    return plan
                plan.append(n)
                total += math.ceil(n / accum)
            if total >= args.max_steps:
                return plan
            count *= 2

    def _init_training_state(
        self,
        max_steps: int,
        num_update_steps_per_epoch: int,
        num_train_epochs: int,
        resume_from_checkpoint: str | None,
        trial: Any,
    ) -> tuple[int, int]:
        """The Trainer's (epochs trained, batches trained in the resumed epoch) from the plan: it
        takes them as global_step // and % the first epoch's steps."""
        epochs, batches = super()._init_training_state(
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
        )
        if resume_from_checkpoint is not None and self.epochs:
            accum = self.args.gradient_accumulation_steps
            left, epochs = self.state.global_step, 0
            while epochs < len(self.epochs) and left >= math.ceil(self.epochs[epochs] / accum):
                left -= math.ceil(self.epochs[epochs] / accum)
                epochs += 1
            batches = 0 if self.args.ignore_data_skip else left * accum
        return epochs, batches

    def _run_epoch(self, *args: Any, **kwargs: Any) -> Any:
        """One epoch with its own length (the Trainer passes the first epoch's to every epoch)."""
        epoch = kwargs["epoch"]
        if self.epochs and epoch < len(self.epochs):
            kwargs["steps_in_epoch"] = self.epochs[epoch]
            kwargs["num_update_steps_per_epoch"] = math.ceil(self.epochs[epoch] / self.args.gradient_accumulation_steps)
        return super()._run_epoch(*args, **kwargs)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        checkpoint: str | None
        if resume_from_checkpoint is True:
            checkpoint = get_last_checkpoint(self.args.output_dir)
            if checkpoint is None:
                raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
        else:
            checkpoint = resume_from_checkpoint or None
        if checkpoint:
            self.loader_callback.load(checkpoint, self.args)
        return super().train(checkpoint, *args, **kwargs)


def _skip_resumed(dataloader: Any, num_batches: int = 0) -> Any:
    """transformers.trainer's `skip_first_batches`: a TrainerLoader already stands where its
    restored state put it; anything else goes to accelerate's."""
    if not isinstance(dataloader, TrainerLoader):
        return _ORIGINAL_SKIP(dataloader, num_batches)
    loader = dataloader.loader
    try:
        done: int | None = len(loader) - loader.remaining
    except (AttributeError, TypeError):  # no count (endless): the state alone says where it stands
        done = None
    if done is not None:
        if done != num_batches:
            raise RuntimeError(
                f"the Trainer resumes {num_batches} batches into the epoch, the tierflow Loader's restored state "
                f"{done}: the checkpoint's trainer_state.json and {STATE_FOLDER}/ come from different saves"
            )
    return dataloader


_ORIGINAL_SKIP: Any = None


def _install_skip() -> None:
    global _ORIGINAL_SKIP
    module = transformers.trainer
    if getattr(module.skip_first_batches, "__wrapped_by_tierflow__", False):
        return
    _ORIGINAL_SKIP = module.skip_first_batches
    _skip_resumed.__wrapped_by_tierflow__ = True  # type: ignore[attr-defined]
    module.skip_first_batches = _skip_resumed


__all__ = ["LoaderCheckpointCallback", "TierflowTrainer", "TrainerLoader", "hf_batch"]
