"""accelerate with a Loader: `prepare` hands it back, `register_for_checkpointing` resumes exactly."""

from __future__ import annotations

import pytest

from conftest import needs
from harness import check_resumed, check_uninterrupted, load, run

pytestmark = [needs("accelerate"), pytest.mark.slow]


@pytest.mark.parametrize("workers", [0, 2])
def test_two_epochs_and_resume_from_save_state(corpus, tmp_path, workers):
    at = [30, 77, 150]
    if workers:  # the workers' run: the point in the second epoch (CI's time)
        at = at[-1:]
    base = {"data": corpus, "epochs": 2, "workers": workers, "ckpt_dir": str(tmp_path)}
    run("run_accelerate.py", {**base, "out": str(tmp_path / "full"), "save_at": at})
    full = load(tmp_path / "full.0.json")
    check_uninterrupted(corpus, [full])
    for step in at:
        run("run_accelerate.py", {**base, "out": str(tmp_path / f"r{step}"), "resume": str(tmp_path / f"step-{step}")})
        check_resumed(full, load(tmp_path / f"r{step}.0.json"), step)


@pytest.mark.slow
def test_two_processes(corpus, tmp_path):
    """torchrun with 2 processes: each rank its own batches, every (sample, epoch) once; a resume
    from save_state in the second epoch gives each rank its own Loader state back."""
    base = {"data": corpus, "epochs": 2, "ckpt_dir": str(tmp_path)}
    run("run_accelerate.py", {**base, "out": str(tmp_path / "full"), "save_at": [70]}, torchrun=2)
    full = [load(tmp_path / f"full.{r}.json") for r in range(2)]
    check_uninterrupted(corpus, full)
    run(
        "run_accelerate.py",
        {**base, "out": str(tmp_path / "resumed"), "resume": str(tmp_path / "step-70")},
        torchrun=2,
    )
    for rank in range(2):
        check_resumed(full[rank], load(tmp_path / f"resumed.{rank}.json"), 70)


def test_skip_first_batches_names_the_supported_path(corpus):
    """accelerate's skip_first_batches rebuilds a DataLoader from the object; for a Loader it must
    fail saying how a Loader resumes, not with a bare AttributeError."""
    from accelerate import skip_first_batches

    from tierflow.loader import Loader, TieredDataset, BatchSpec

    with Loader(TieredDataset(corpus, BatchSpec(batch_size=4, seq_len=64))) as loader:
        with pytest.raises(AttributeError, match="load_state_dict"):
            skip_first_batches(loader, 3)
