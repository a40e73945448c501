"""The transformers Trainer over a Loader (TierflowTrainer), Hugging Face labels (docs/frameworks.md)."""

from __future__ import annotations

import pytest
import torch

from conftest import needs
from harness import check_resumed, check_uninterrupted, load, run

pytestmark = [needs("transformers"), pytest.mark.slow]


def test_hf_batch_labels_are_the_input_ids_with_boundaries_masked():
    from tierflow.integrations.transformers import hf_batch

    ids = torch.arange(12).reshape(2, 6)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2], [0, 1, 0, 1, 2, 3]], dtype=torch.int32)
    batch = {
        "input_ids": ids,
        "labels": ids + 1,
        "position_ids": positions,
        "cu_seqlens": torch.tensor([0, 3, 6, 8, 12]),
        "max_seqlen": 4,
        "mask": torch.ones(2, dtype=torch.bool),
    }
    out = hf_batch(batch)
    assert set(out) == {"input_ids", "labels"}
    assert out["labels"].tolist() == [[-100, 1, 2, -100, 4, 5], [-100, 7, -100, 9, 10, 11]]
    assert set(hf_batch(batch, keep=("cu_seqlens", "max_seqlen"))) == {
        "input_ids",
        "labels",
        "cu_seqlens",
        "max_seqlen",
    }
    with pytest.raises(KeyError, match="keep='attention'"):
        hf_batch(batch, keep=("attention",))


def test_trained_model_learns_the_next_token_not_the_one_after(tmp_path):
    """A GPT-2 fed hf_batch batches learns p(t+1 | ..t): its loss on the next token falls below
    its loss on the token after it (tierflow's own labels fed to the model would train t+2)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from corpora import pack_lorem

    from tierflow.integrations.transformers import hf_batch
    from tierflow.loader import Loader, TieredDataset, BatchSpec

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=257, n_positions=64, n_embd=32, n_layer=1, n_head=2))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with Loader(TieredDataset(pack_lorem(tmp_path, 400), BatchSpec(batch_size=16, seq_len=64)), endless=True) as loader:
        for _, batch in zip(range(60), loader):
            loss = model(**hf_batch(batch)).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
        batch = next(iter(loader))
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits
    ce = torch.nn.functional.cross_entropy
    next_token = ce(logits[:, :-1].flatten(0, 1), batch["input_ids"][:, 1:].flatten())
    after_next = ce(logits[:, :-2].flatten(0, 1), batch["input_ids"][:, 2:].flatten())
    assert next_token < after_next - 0.5, (next_token, after_next)


def test_plain_trainer_refuses_a_tiered_dataset_clearly(corpus, tmp_path):
    """`Trainer(train_dataset=TieredDataset)` is not the supported path: the error names it."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from tierflow.loader import TieredDataset, BatchSpec

    model = GPT2LMHeadModel(GPT2Config(vocab_size=257, n_positions=64, n_embd=16, n_layer=1, n_head=2))
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, report_to=[], use_cpu=True, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=TieredDataset(corpus, BatchSpec(batch_size=4, seq_len=64)))
    with pytest.raises(TypeError, match="TierflowTrainer"):
        trainer.train()


@pytest.mark.parametrize("workers", [0, 2])
def test_two_epochs_and_resume_from_checkpoint_n(corpus, tmp_path, workers):
    """2 epochs, len() right each; `train(resume_from_checkpoint=...)` from checkpoint-N at 3 points
    (one in epoch 2) in a new process trains exactly the rest of the uninterrupted run."""
    at = [30, 77, 150]
    if workers:  # the workers' run: the point in the second epoch (CI's time)
        at = at[-1:]
    base = {"data": corpus, "epochs": 2, "workers": workers, "output_dir": str(tmp_path / "out")}
    run("run_trainer.py", {**base, "out": str(tmp_path / "full"), "save_at": at})
    full = load(tmp_path / "full.0.json")
    check_uninterrupted(corpus, [full])
    for step in at:
        run(
            "run_trainer.py",
            {**base, "out": str(tmp_path / f"r{step}"), "resume": str(tmp_path / "out" / f"checkpoint-{step}")},
        )
        resumed = load(tmp_path / f"r{step}.0.json")
        check_resumed(full, resumed, step)
        assert resumed["global_step"] == full["global_step"]


@pytest.mark.parametrize("length", [{"epochs": 2}, {"max_steps": 120}])
def test_an_epoch_longer_than_the_first_is_trained_whole(corpus, tmp_path, length):
    """Rank 0 of 2 read by one process: its epochs are 53, 54, 53 batches. The Trainer sizes every
    epoch and max_steps by the first len(); TierflowTrainer by Loader.epoch_lengths: 2 epochs are
    107 steps, max_steps=120 ends 13 batches into the third; resumed in the second, the rest exactly."""
    base = {"data": corpus, "world": [0, 2], "output_dir": str(tmp_path / "out"), **length}
    run("run_trainer.py", {**base, "out": str(tmp_path / "full"), "save_at": [80]})
    full = load(tmp_path / "full.0.json")
    assert full["global_step"] == (107 if "epochs" in length else 120), full["global_step"]
    check_uninterrupted(corpus, [full], epochs=2, world=2)
    run("run_trainer.py", {**base, "out": str(tmp_path / "r80"), "resume": str(tmp_path / "out" / "checkpoint-80")})
    check_resumed(full, load(tmp_path / "r80.0.json"), 80)


@pytest.mark.slow
def test_torchrun_two_processes(corpus, tmp_path):
    """The Trainer under torchrun with 2 processes: 2 epochs, none empty, each (sample, epoch)
    once across the ranks; resumed from checkpoint-N of the second epoch, the rest exactly."""
    base = {"data": corpus, "epochs": 2, "output_dir": str(tmp_path / "out")}
    run("run_trainer.py", {**base, "out": str(tmp_path / "full"), "save_at": [70]}, torchrun=2)
    full = [load(tmp_path / f"full.{r}.json") for r in range(2)]
    check_uninterrupted(corpus, full)
    run(
        "run_trainer.py",
        {**base, "out": str(tmp_path / "resumed"), "resume": str(tmp_path / "out" / "checkpoint-70")},
        torchrun=2,
    )
    for rank in range(2):
        check_resumed(full[rank], load(tmp_path / f"resumed.{rank}.json"), 70)
