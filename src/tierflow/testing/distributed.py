"""Helpers for tests that run ranks as processes: a free loopback port for the rendezvous, and the
stream each rank read, gathered, which is what multi-rank tests compare."""

from __future__ import annotations

import socket
from typing import Any


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (MASTER_PORT for a gloo group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gathered_stream(loader: Any, steps: int) -> list[list[list[list[int]]]]:
    """The sample ids and epochs of the next `steps` batches `loader` hands out, per rank
    (`[ids, epochs]`, each a list per batch), all-gathered over the default process group when
    one is initialised, else this process's alone."""
    import torch
    import torch.distributed as dist

    ids, epochs = [], []
    for step, _ in enumerate(loader):
        ids.append(loader.last_meta.sample_ids.tolist())
        epochs.append(loader.last_meta.epochs.tolist())
        if step + 1 == steps:
            break
    local = torch.tensor([ids, epochs], dtype=torch.int64)
    if not (dist.is_available() and dist.is_initialized()):
        return [local.tolist()]
    gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    return [g.tolist() for g in gathered]
