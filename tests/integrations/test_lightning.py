"""Lightning with the Loader returned by `train_dataloader()`, as is (docs/frameworks.md)."""

from __future__ import annotations

import pytest

from conftest import needs
from harness import check_resumed, check_uninterrupted, load, run

pytestmark = [needs("lightning"), pytest.mark.slow]


@pytest.mark.parametrize("workers", [0, 2])
def test_two_epochs_and_resume_from_its_ckpt(corpus, tmp_path, workers):
    """2 epochs, len() right each; resumed from Lightning's .ckpt at 3 points (one in epoch 2) in
    a new process, each trains exactly the rest of the uninterrupted run."""
    at = [30, 77, 150]  # an epoch is ~108 batches
    if workers:  # the workers' run: the point in the second epoch (CI's time)
        at = at[-1:]
    base = {"data": corpus, "epochs": 2, "workers": workers, "ckpt_dir": str(tmp_path)}
    run("run_lightning.py", {**base, "out": str(tmp_path / "full"), "save_at": at})
    full = load(tmp_path / "full.0.json")
    check_uninterrupted(corpus, [full])
    for step in at:
        run(
            "run_lightning.py",
            {**base, "out": str(tmp_path / f"r{step}"), "resume": str(tmp_path / f"step-{step}.ckpt")},
        )
        check_resumed(full, load(tmp_path / f"r{step}.0.json"), step)


def test_an_epoch_longer_than_the_first_is_trained_whole(corpus, tmp_path):
    """Rank 0 of 2 read by one process: its epochs are 53 then 54 batches (remainders carry over).
    Lightning fixes its epoch's batch limit at the first len(); LoaderStateCallback refreshes it at
    each epoch's start, so the second epoch is not cut; resumed in each epoch, the rest exactly."""
    base = {"data": corpus, "epochs": 2, "world": [0, 2], "ckpt_dir": str(tmp_path)}
    run("run_lightning.py", {**base, "out": str(tmp_path / "full"), "save_at": [30, 80]})
    full = load(tmp_path / "full.0.json")
    assert full["lens"][1] > full["lens"][0], full["lens"]
    check_uninterrupted(corpus, [full], world=2)
    for step in (30, 80):
        run(
            "run_lightning.py",
            {**base, "out": str(tmp_path / f"r{step}"), "resume": str(tmp_path / f"step-{step}.ckpt")},
        )
        check_resumed(full, load(tmp_path / f"r{step}.0.json"), step)


@pytest.mark.slow
def test_ddp_two_gloo_processes(corpus, tmp_path):
    """strategy="ddp", 2 processes on CPU (gloo): 2 epochs, none empty, each (sample, epoch) once,
    and a resume from the .ckpt saved in the second epoch trains the rest exactly on both ranks."""
    base = {"data": corpus, "epochs": 2, "devices": 2, "ckpt_dir": str(tmp_path)}
    run("run_lightning.py", {**base, "out": str(tmp_path / "full"), "save_at": [70]})
    full = [load(tmp_path / f"full.{r}.json") for r in range(2)]
    check_uninterrupted(corpus, full)
    run(
        "run_lightning.py",
        {**base, "out": str(tmp_path / "resumed"), "resume": str(tmp_path / "step-70.ckpt")},
    )
    for rank in range(2):
        check_resumed(full[rank], load(tmp_path / f"resumed.{rank}.json"), 70)


@pytest.mark.slow
def test_ddp_token_budget_resumes_each_rank_from_its_own_state(corpus, tmp_path):
    """A token budget under strategy="ddp": each rank reads its own stream, whose state only it
    has; the .ckpt (written by rank 0) carries every rank's through LoaderStateCallback."""
    base = {"data": corpus, "max_steps": 90, "devices": 2, "ckpt_dir": str(tmp_path), "max_tokens": 16 * 128}
    run("run_lightning.py", {**base, "out": str(tmp_path / "full"), "save_at": [40]})
    full = [load(tmp_path / f"full.{r}.json") for r in range(2)]
    run(
        "run_lightning.py",
        {**base, "out": str(tmp_path / "resumed"), "resume": str(tmp_path / "step-40.ckpt")},
    )
    for rank in range(2):
        check_resumed(full[rank], load(tmp_path / f"resumed.{rank}.json"), 40)


@pytest.mark.parametrize("shape", ["endless", "max_tokens"])
def test_without_len_the_ckpt_holds_the_trained_batch(corpus, tmp_path, shape):
    """A Loader without len() (endless=True, or a token budget) makes Lightning fetch one batch
    ahead; the .ckpt must still resume right after the batch the step trained."""
    cfg = {"data": corpus, "max_steps": 160, "ckpt_dir": str(tmp_path)}  # 160: into the second epoch
    if shape == "max_tokens":
        cfg["max_tokens"] = 16 * 128  # one epoch per `for`, its length unknown until planned
    else:
        cfg["endless"] = True
    run("run_lightning.py", {**cfg, "out": str(tmp_path / "full"), "save_at": [40, 130]})
    full = load(tmp_path / "full.0.json")
    if shape == "endless":
        check_uninterrupted(corpus, [full], epochs=None)
    for step in (40, 130):
        again = [100] if step == 40 else []  # a resumed run's own checkpoints hold the trained batch too
        run(
            "run_lightning.py",
            {**cfg, "out": str(tmp_path / f"r{step}"), "resume": str(tmp_path / f"step-{step}.ckpt"), "save_at": again},
        )
        check_resumed(full, load(tmp_path / f"r{step}.0.json"), step)
    run("run_lightning.py", {**cfg, "out": str(tmp_path / "r100"), "resume": str(tmp_path / "step-100.ckpt")})
    check_resumed(full, load(tmp_path / "r100.0.json"), 100)
