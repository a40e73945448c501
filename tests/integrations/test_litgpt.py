"""litgpt's data path: TierflowDataModule under Fabric (setup_dataloaders, fabric.save / load)."""

from __future__ import annotations

import pytest

from conftest import needs
from harness import check_resumed, check_uninterrupted, load, run

pytestmark = [needs("litgpt"), pytest.mark.slow]


def check_epochs(run: dict) -> None:
    """The first epoch trained as many batches as len() said at its start; the second started."""
    first = sum(1 for epoch, _ in run["batches"] if epoch == 0)
    assert len(run["lens"]) == 2 and first == run["lens"][0], (first, run["lens"])


@pytest.mark.parametrize("workers", [0, 2])
def test_fabric_epochs_and_resume(corpus, tmp_path, workers):
    """200 iterations (into epoch 2) through litgpt's CycleIterator; resumed from fabric.save at 3
    points (one in epoch 2) in a new process, each trains exactly the rest."""
    at = [30, 77, 150]
    if workers:  # the workers' run: the point in the second epoch (CI's time)
        at = at[-1:]
    base = {"data": corpus, "iters": 200, "workers": workers, "ckpt_dir": str(tmp_path)}
    run("run_litgpt.py", {**base, "out": str(tmp_path / "full"), "save_at": at})
    full = load(tmp_path / "full.0.json")
    check_uninterrupted(corpus, [full], epochs=None)
    check_epochs(full)
    for step in at:
        run("run_litgpt.py", {**base, "out": str(tmp_path / f"r{step}"), "resume": str(tmp_path / f"step-{step}.pth")})
        check_resumed(full, load(tmp_path / f"r{step}.0.json"), step)


@pytest.mark.slow
def test_fabric_ddp_two_processes(corpus, tmp_path):
    """Fabric's ddp with 2 gloo processes: each rank its own batches, every (sample, epoch) once."""
    run(
        "run_litgpt.py",
        {"data": corpus, "iters": 100, "devices": 2, "out": str(tmp_path / "full"), "ckpt_dir": str(tmp_path)},
    )
    full = [load(tmp_path / f"full.{r}.json") for r in range(2)]
    check_uninterrupted(corpus, full, epochs=None)
    for rank in range(2):
        check_epochs(full[rank])


def test_setup_dataloaders_gets_a_dataloader(corpus):
    """Fabric accepts only torch DataLoaders: the DataModule's loaders are, and keep the Loader's
    len() and state."""
    from torch.utils.data import DataLoader

    from tierflow.integrations.litgpt import TierflowDataModule

    data = TierflowDataModule(corpus, endless=False)
    data.connect(batch_size=4, max_seq_length=64)
    data.setup()
    train = data.train_dataloader()
    assert isinstance(train, DataLoader)
    assert len(train) == len(train.loader)
    rows = next(iter(train))
    assert rows.shape == (4, 65)
    assert train.state_dict() == train.loader.state_dict()
