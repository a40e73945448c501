"""torchtitan: TierflowDataLoader (its BaseDataLoader protocol) with the DCP CheckpointManager."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import needs
from harness import check_resumed, check_uninterrupted, load, run

pytestmark = [needs("torchtitan"), pytest.mark.skipif(sys.version_info < (3, 11), reason="torchtitan needs 3.11")]


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_dcp_checkpoint_two_dp_ranks(corpus, tmp_path, workers):
    """2 gloo ranks, 130 steps (into the second epoch): each rank its own batches, every (sample,
    epoch) once; resumed by CheckpointManager.load at 3 steps (one in epoch 2), the rest exactly."""
    at = [20, 45, 100]  # ~54 batches a rank an epoch
    if workers:  # the workers' run: the point in the second epoch (CI's time)
        at = at[-1:]
    base = {"data": corpus, "steps": 130, "workers": workers, "ckpt_dir": str(tmp_path)}
    run("run_torchtitan.py", {**base, "out": str(tmp_path / "full"), "save_at": at}, torchrun=2)
    full = [load(tmp_path / f"full.{r}.json") for r in range(2)]
    check_uninterrupted(corpus, full, epochs=None, nodes=True)  # dp ranks: a node each (ranks_per_node=1)
    for step in at:
        run("run_torchtitan.py", {**base, "out": str(tmp_path / f"r{step}"), "resume": step}, torchrun=2)
        for rank in range(2):
            check_resumed(full[rank], load(tmp_path / f"r{step}.{rank}.json"), step)


def test_state_is_per_dp_rank_and_refuses_another_degree(corpus):
    from tierflow.integrations.torchtitan import TierflowDataLoader

    a = TierflowDataLoader(corpus, dp_rank=1, dp_world_size=2, batch_size=4, seq_len=64)
    batches = iter(a)
    inputs, labels = next(batches)
    assert set(inputs) == {"input"} and inputs["input"].shape == labels.shape == (4, 64)
    state = a.state_dict()
    assert set(state) == {"dp_rank_1", "world_size"} and state["world_size"] == 2
    json.loads(state["dp_rank_1"])
    b = TierflowDataLoader(corpus, dp_rank=1, dp_world_size=2, batch_size=4, seq_len=64)
    b.load_state_dict(state)
    assert next(iter(b))[0]["input"].equal(next(batches)[0]["input"])
    c = TierflowDataLoader(corpus, dp_rank=1, dp_world_size=4, batch_size=4, seq_len=64)
    with pytest.raises(KeyError):
        c.load_state_dict({"dp_rank_0": state["dp_rank_1"], "world_size": 2})
    with pytest.raises(ValueError, match="4"):
        c.load_state_dict({"dp_rank_1": state["dp_rank_1"], "world_size": 2})
    for loader in (a, b, c):
        loader.close()


def test_built_from_a_trainer_config(corpus):
    """What torchtitan's Trainer does with `config.dataloader`: build(dp_world_size, dp_rank,
    tokenizer, seq_len, local_batch_size, snapshot_every_n_steps)."""
    from tierflow.integrations.torchtitan import TierflowDataLoader

    config = TierflowDataLoader.Config(dataset_path=corpus)
    loader = config.build(
        dp_world_size=2, dp_rank=0, tokenizer=None, seq_len=64, local_batch_size=4, snapshot_every_n_steps=None
    )
    assert isinstance(loader, TierflowDataLoader) and loader.dp_rank == 0
    inputs, labels = next(iter(loader))
    assert inputs["input"].shape == (4, 64)
    assert loader.loader.dataset.world.world_size == 2
    loader.close()
