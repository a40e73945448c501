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
from tierflow.tiers import TierConfig, build_stack
from tierflow.tiers.stager import Stager

_LOADER_OPTIONS = ("persistent_workers", "prefetch_factor", "multiprocessing_context", "depth", "widen",
                   "background", "telemetry", "epoch_end", "endless", "group", "dtype", "return_meta")


def open_loader(
    url: str | Path,
    *,
    batch_size: int,
    seq_len: int | None = None,
    max_tokens: int | None = None,
    tiers: Sequence[TierConfig | str] = (),
    device: str | torch.device | None = None,
    num_workers: int = 0,
    endpoint_url: str | None = None,
    bandwidth: float | None = None,
    resume: dict[str, Any] | None = None,
    **options: Any,
) -> Loader:
    """A started Loader over the dataset at `url` (a local path or s3://, with `tiers` as
    TierConfigs or `"NAME=PATH[:CAPACITY[:POLICY[:FORM]]]"` strings, capacities like "50GB" or
    "30%"). Other keywords go to TieredDataset (seed, columns, transform, filter, eval, ...) or to
    Loader (depth, widen, epoch_end, ...); `resume` is a `loader.state_dict()` to continue from."""
    refuse_while_bootstrapping("tierflow.open_loader")
    loader_options = {k: options.pop(k) for k in _LOADER_OPTIONS if k in options}
    local = _is_local(url)
    if local and not tiers and bandwidth is None:
        dataset = TieredDataset(url, batch_size=batch_size, seq_len=seq_len, max_tokens=max_tokens, **options)
        loader = Loader(dataset, device=device, num_workers=num_workers, **loader_options)
    else:
        stack = build_stack(str(url), tiers, endpoint_url=endpoint_url, bandwidth=bandwidth)
        dataset = TieredDataset(stack.dataset(), batch_size=batch_size, seq_len=seq_len, max_tokens=max_tokens,
                                **options)
        loader = Loader(dataset, device=device, num_workers=num_workers, stager=Stager(dataset, stack),
                        **loader_options)
    if resume is not None:
        loader.load_state_dict(resume)
    loader.start_prefetch()
    return loader


def _is_local(url: str | Path) -> bool:
    text = str(url)
    return isinstance(url, Path) or "://" not in text


__all__ = ["open_loader"]
