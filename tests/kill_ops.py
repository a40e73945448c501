"""What the kill loop (test_kill_loop.py) runs in its children, and the data they are checked against.

Imported once by the fork server (tierflow.testing.killer), so each child starts with pyarrow,
torch and tierflow loaded; every function here is one operation a child runs until it is
killed or finishes.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import torch  # noqa: F401 - loaded before the fork, for the loader's children

import tierflow
from tierflow.checkpoint import CheckpointStore
from tierflow.tiers import build_stack


def pack(corpus: str, out: str, overwrite: bool = False, workers: int = 1) -> None:
    tierflow.pack(
        [corpus],
        out,
        tokenizer="bytes",
        target_shard_bytes=256 << 10,
        workers=workers,
        overwrite=overwrite,
        seq_len=WINDOW,
    )


WINDOW = 64
"""The window length whose order's layout each pack stores (format/metadata_windows.py)."""


def tier_specs(root: str | Path) -> list[str]:
    """An L1 (decoded) too small for the dataset, so fills evict, over an L2 (at rest) that holds it."""
    return [f"L1={root}/l1:700KB:lru:decoded", f"L2={root}/l2:64MB:lru:at_rest"]


def epoch_digests(l4: str, tiers: list[str]) -> list[str]:
    """One epoch of the loader through the tiers: each batch's bytes, hashed."""
    import xxhash

    loader = tierflow.open_loader(l4, tiers=tiers, batch_size=32, seq_len=128)
    try:
        return [
            xxhash.xxh3_64_hexdigest(
                b"".join(
                    v.numpy().tobytes() if hasattr(v, "numpy") else repr(v).encode() for _, v in sorted(batch.items())
                )
            )
            for batch in loader
        ]
    finally:
        loader.close()


def fill(l4: str, tiers: list[str], how: str) -> None:
    """A cache fill as a user runs it: `tierflow cache warm` or a loader epoch."""
    if how == "warm":
        build_stack(l4, tiers).warm()
    else:
        epoch_digests(l4, tiers)


def step_files(step: int) -> dict[str, bytes]:
    """What the training code writes for a step; a checkpoint of step s must hold exactly these."""
    rng = random.Random(step)
    return {
        "model.bin": rng.randbytes(300_000),
        "opt/state.bin": rng.randbytes(40_000),
        "loader.json": json.dumps({"step": step}).encode(),
    }


def checkpoint(
    dest: str,
    local: str,
    start: int,
    steps: int,
    keep_last: int | None,
    rate: float | None = None,
    budget: str | None = None,
    then_sleep: float = 0.0,
) -> None:
    """Steps start .. start+steps-1 written, committed and uploaded (the real uploader process);
    `rate` (bytes/s, a budget file at `budget`) throttles the uploads; `then_sleep`: seconds to
    wait after the last commit, before waiting for the uploads (a trainer killed there has its
    steps committed and their uploads queued)."""
    from tierflow.storage.budget import BandwidthBudget

    limit = BandwidthBudget(rate, budget, burst=64 << 10, node_rate=None) if rate else None
    with CheckpointStore(dest, local, keep_last=keep_last, budget=limit) as store:
        for step in range(start, start + steps):
            directory = store.begin(step)
            for name, data in step_files(step).items():
                (directory / name).parent.mkdir(parents=True, exist_ok=True)
                (directory / name).write_bytes(data)
            store.commit(step)
        time.sleep(then_sleep)


def whole(path: Path, step: int) -> bool:
    return all((path / name).read_bytes() == data for name, data in step_files(step).items())


def noop(**_: Any) -> None:
    return None
