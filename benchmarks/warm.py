"""A warm L1 for the loader benchmarks: a real decoded tier (tmpfs when there is one) holding every
shard before the first round, so a benchmark measures the loader reading through the tiers as a
user's warm epoch does, not staging or verification."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tierflow.loader import TieredDataset
from tierflow.loader.spec import specs_from
from tierflow.tiers import TierConfig, build_stack


def l1_config(path: str | Path) -> TierConfig:
    """The benchmark's L1: under /dev/shm when it exists, else beside the dataset."""
    shm = Path("/dev/shm")
    root = shm / f"tierflow-bench-l1-{os.getpid()}" if shm.is_dir() else Path(path).parent / "l1"
    return TierConfig("L1", str(root), 4 << 30, policy="lru", form="decoded")


def warm_l1(path: str | Path) -> TierConfig:
    """Stage every shard of the dataset at `path` into the L1; returns its config."""
    config = l1_config(path)
    warmed, declined = build_stack(str(path), [config]).warm()
    if declined:
        raise RuntimeError(f"the benchmark L1 declined {declined} of {warmed + declined} shards")
    return config


def warm_dataset(path: str | Path, l1: TierConfig, **options: Any) -> TieredDataset:
    """A TieredDataset reading `path` through the warmed L1."""
    batching, order = specs_from(options)
    return TieredDataset(build_stack(str(path), [l1]).dataset(), batching, order, **options)


def remove_l1(l1: TierConfig) -> None:
    import shutil

    shutil.rmtree(l1.path, ignore_errors=True)
