"""`open_loader`: the whole data path of DESIGN.md in one call, for the first batch in two lines.

    loader = tierflow.open_loader("s3://bucket/packed", tiers=["L2=/nvme/tf:30%"], batch_size=8, seq_len=2048)
    for batch in loader: ...

It builds, in DESIGN.md's order, the tier stack over the source, the dataset (its working set
sized to the top tier), the stager, and the Loader, and starts staging at once, so the first
shards arrive while the model loads. A local path with no tiers reads the files directly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from collections.abc import Sequence

import torch

from tierflow._bootstrap import refuse_while_bootstrapping
from tierflow.loader.dataset import TieredDataset
from tierflow.loader.loader import Loader
from tierflow.loader.mixture import MixedDataset
from tierflow.loader.spec import specs_from
from tierflow.loader.topology import node_index, placed_by_cache
from tierflow.telemetry.eventlog import EventLog
from tierflow.telemetry.loader_metrics import LoaderTelemetry
from tierflow.telemetry.metrics import MetricsRegistry
from tierflow.tiers import TierConfig, build_stack
from tierflow.tiers.stager import Stager

_LOADER_OPTIONS = (
    "persistent_workers",
    "prefetch_factor",
    "multiprocessing_context",
    "depth",
    "widen",
    "background",
    "telemetry",
    "epoch_end",
    "endless",
    "group",
    "dtype",
    "return_meta",
)


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
    node_affinity: bool = True,
    events: str | Path | None = None,
    **options: Any,
) -> Loader:
    """A started Loader over the dataset at `url` (a local path or s3://, with `tiers` as
    TierConfigs or `"NAME=PATH[:CAPACITY[:POLICY[:FORM]]]"` strings, capacities like "50GB", "30%"
    (of the dataset's bytes at rest) or "30%disk"; the form `auto` by default: at rest unless the tier
    holds the whole decoded dataset; a `{node}` in a path becomes this node's index, see loader.topology.node_index), or over
    several URLs mixed by `weights` (each read through its own stack over the same tiers, on
    demand: no stager). Other keywords go to the dataset's BatchSpec (batcher, columns, transform,
    filter, collate), its OrderSpec (seed, partitions, shuffle, group_bytes, ...), the dataset (eval,
    world, max_batches, allow_mismatch) or to Loader (depth, widen, dtype, epoch_end, endless, ...);
    `resume` is a `loader.state_dict()` to continue from. `events` is a path for the run's event log
    (one JSON line per batch, per stager transfer and per second's metrics; `tierflow top PATH`
    follows it live, `tierflow report PATH` draws it), closed with the Loader.

    In a job of several nodes with tiers (torch.distributed initialised, every rank calling
    open_loader), each node reads the partitions its top tier already holds the most of
    (`node_affinity`, loader.topology.placed_by_cache: one all-gather of the nodes' inventories),
    so a restart onto another order of nodes finds its caches warm; with cold caches, or
    `node_affinity=False`, node n reads logical node n's partitions."""
    refuse_while_bootstrapping("tierflow.open_loader")
    loader_options = {k: options.pop(k) for k in _LOADER_OPTIONS if k in options}
    urls = [url] if isinstance(url, (str, Path)) else list(url)
    direct = all(_is_local(u) for u in urls) and not tiers and bandwidth is None
    world = options.get("world")
    node = world.node if world is not None else node_index()
    stacks = (
        []
        if direct
        else [build_stack(str(u), tiers, endpoint_url=endpoint_url, bandwidth=bandwidth, node=node) for u in urls]
    )
    sources: list[Any] = urls if direct else [stack.dataset() for stack in stacks]
    options.update(batch_size=batch_size, seq_len=seq_len, max_tokens=max_tokens)
    batching, order = specs_from(options)  # what is left goes to the dataset
    if events is not None:
        if "telemetry" in loader_options:
            raise ValueError("events= logs the telemetry open_loader makes: pass events= or telemetry=, not both")
        registry = stacks[0].registry if len(stacks) == 1 else MetricsRegistry()
        log = EventLog(events, registry, name=f"open_loader {', '.join(map(str, urls))}", batch_size=batch_size)
        loader_options["telemetry"] = LoaderTelemetry(registry, events=log, owns_events=True)
    stager = None
    dataset: TieredDataset | MixedDataset
    if isinstance(url, (str, Path)):
        if weights is not None:
            raise ValueError("weights= mixes several datasets: pass a list of URLs")
        dataset = TieredDataset(sources[0], batching, order, **options)
        pending = ((resume or {}).get("cursor") or {}).get("pending") is not None  # a rank's own stream
        if stacks and node_affinity and world is None and not pending:
            _place_by_cache(dataset, stacks[0])
        telemetry = loader_options.get("telemetry")
        event_log = getattr(telemetry, "events", None)  # the event log gets the stager's transfers too
        stager = Stager(dataset, stacks[0], events=event_log) if stacks else None
    else:
        if options.pop("eval", False):
            raise ValueError("eval reads one dataset once in stored order: evaluate each dataset on its own")
        dataset = MixedDataset(sources, batching, order, weights=weights, **options)
    if len(stacks) == 1 and loader_options.get("telemetry", True) is True:
        # one registry for the loader's figures and the stack's (the stager exports it): the workers'
        # tier and cache counters, included as they ship them, reach both
        loader_options["telemetry"] = LoaderTelemetry(stacks[0].registry)
    loader = Loader(dataset, device=device, num_workers=num_workers, stager=stager, **loader_options)
    if resume is not None:
        loader.load_state_dict(resume)
    loader.start_prefetch()
    return loader


def _place_by_cache(dataset: TieredDataset, stack: Any) -> None:
    """This node reads the partitions its top tier holds the most of (the nodes' inventories
    all-gathered over the default process group); nothing to do on one node or without tiers."""
    import torch.distributed as dist

    world = dataset.world
    if (
        world.num_nodes < 2
        or not stack.tiers
        or dataset.eval
        or not (dist.is_available() and dist.is_initialized())
        or dist.get_world_size() != world.world_size
    ):
        return
    from tierflow.format.metadata import shard_column
    from tierflow.format.metadata_index import ShardKeys
    from tierflow.format.shard import Form

    top = stack.tiers[0]
    by_key = ShardKeys(dataset.manifest)  # mapped: a sorted checksum column, no object per shard
    held = [s for key in top.index.keys() for s in by_key.get(key, ())] if world.local_rank == 0 else None
    layout = dataset.order.layout
    owned = [
        [int(s) for p in layout.node_partitions(logical, world.num_nodes) for s in layout.partition_shards[p]]
        for logical in range(world.num_nodes)
    ]

    def gather(obj: Any) -> list[Any]:
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out

    sizes = shard_column(dataset.manifest, "decoded_bytes" if top.form == Form.DECODED else "bytes").tolist()
    dataset.world = placed_by_cache(world, held, owned, sizes, gather)


def _is_local(url: str | Path) -> bool:
    text = str(url)
    return isinstance(url, Path) or "://" not in text


__all__ = ["open_loader"]
