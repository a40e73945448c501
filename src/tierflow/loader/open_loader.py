"""`open_loader`: the whole data path of DESIGN.md in one call, for the first batch in two lines.

    loader = tierflow.open_loader("s3://bucket/packed", tiers=["L2=/nvme/tf:30%"], batch_size=8, seq_len=2048)
    for batch in loader: ...

It builds, in DESIGN.md's order, the tier stack over the source, the dataset (its working set
sized to the top tier), the stager, and the Loader, and starts staging at once, so the first
shards arrive while the model loads. A local path with no tiers reads the files directly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from tierflow._bootstrap import refuse_while_bootstrapping
from tierflow.loader.dataset import TieredDataset
from tierflow.loader.loader import Loader
from tierflow.loader.topology import node_index
from tierflow.tiers import TierConfig, build_stack
from tierflow.tiers.stager import Stager

_LOADER_OPTIONS = ("persistent_workers", "prefetch_factor", "multiprocessing_context", "depth", "widen",
                   "background", "telemetry", "epoch_end", "endless", "group", "dtype", "return_meta")


def open_loader(
    url: str | Path | Sequence[str | Path],
    *,
    batch_size: int,
    seq_len: int | None = None,
    max_tokens: int | None = None,
    tiers: Sequence[TierConfig | str] = (),
    device: str | torch.device | None = None,
    num_workers: int = 0,
    endpoint_url: str | None = None,
    bandwidth: float | None = None,
    weights: Sequence[float] | None = None,
    resume: dict[str, Any] | None = None,
    **options: Any,
) -> Loader:
    """A started Loader over the dataset at `url` (a local path or s3://, with `tiers` as
    TierConfigs or `"NAME=PATH[:CAPACITY[:POLICY[:FORM]]]"` strings, capacities like "50GB" or
    "30%"; a `{node}` in a path becomes this node's index, see loader.topology.node_index), or over
    several URLs mixed by `weights` (each read through its own stack over the same tiers, on
    demand: no stager). Other keywords go to TieredDataset (seed, columns, transform, filter,
    collate, shuffle, eval, ...) or to Loader (depth, widen, dtype, epoch_end, endless, ...);
    `resume` is a `loader.state_dict()` to continue from."""
    refuse_while_bootstrapping("tierflow.open_loader")
    loader_options = {k: options.pop(k) for k in _LOADER_OPTIONS if k in options}
    urls = [url] if isinstance(url, (str, Path)) else list(url)
    direct = all(_is_local(u) for u in urls) and not tiers and bandwidth is None
    world = options.get("world")
    node = world.node if world is not None else node_index()
    stacks = [] if direct else [build_stack(str(u), tiers, endpoint_url=endpoint_url, bandwidth=bandwidth,
                                            node=node) for u in urls]
    sources: list[Any] = urls if direct else [stack.dataset() for stack in stacks]
    shape = {"batch_size": batch_size, "seq_len": seq_len, "max_tokens": max_tokens}
    stager = None
    if isinstance(url, (str, Path)):
        if weights is not None:
            raise ValueError("weights= mixes several datasets: pass a list of URLs")
        dataset = TieredDataset(sources[0], **shape, **options)
        stager = Stager(dataset, stacks[0]) if stacks else None
    else:
        dataset = TieredDataset(datasets=sources, weights=weights, **shape, **options)
    loader = Loader(dataset, device=device, num_workers=num_workers, stager=stager, **loader_options)
    if resume is not None:
        loader.load_state_dict(resume)
    loader.start_prefetch()
    return loader


def _is_local(url: str | Path) -> bool:
    text = str(url)
    return isinstance(url, Path) or "://" not in text


__all__ = ["open_loader"]
