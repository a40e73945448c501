"""Warm restart: record at commit which shards the next batches need, pre-stage them on resume.

A fresh node has an empty L2, so the first steps after a resume would all read from the
source ("performance drops after resume"). At commit the loader's cursor says exactly which
shards its next `batches` batches read (the order is deterministic); that list, in order of
first use, and each tier's resident entries with their hit counts go into the step as
`tierflow-warm-R.json`. `restore_warm` stages that list into the tiers before the first step,
up to the top tier's capacity, so the first steps hit as they did before the stop.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

WARM_FORMAT = "tierflow-warm/1"


def warm_name(rank: int) -> str:
    return f"tierflow-warm-{rank}.json"


def next_shards(dataset: Any, cursor: dict[str, Any] | None, batches: int) -> list[int]:
    """Shard indices the next `batches` batches from `cursor` read, in order of first use."""
    uses = sorted(dataset.future_shard_uses(cursor, horizon_batches=batches), key=lambda u: u.first_use)
    ordered: list[int] = []
    seen: set[int] = set()
    for use in uses:
        if use.shard not in seen:
            seen.add(use.shard)
            ordered.append(use.shard)
    return ordered


def cursor_of(loader: Any) -> dict[str, Any] | None:
    """The order cursor of the loader's last consumed batch, from its plain `state_dict()`."""
    state = loader.state_dict()
    return state.get("cursor") if isinstance(state, dict) and "cursor" in state else loader.dataset.state_dict()


def warm_state(loader: Any, batches: int) -> dict[str, Any]:
    """The JSON written into a step: the loader's state, the next shards, each tier's entries by heat."""
    cursor = cursor_of(loader)
    shards = loader.dataset.manifest.shards
    state: dict[str, Any] = {"format": WARM_FORMAT, "batches": batches, "loader": loader.state_dict(),
                             "next_shards": [shards[i].name for i in next_shards(loader.dataset, cursor, batches)]}
    stager = getattr(loader, "stager", None)
    if stager is not None:
        tiers = {}
        for tier in stager.stack.tiers:
            rows = sorted(tier.index.entries(), key=lambda r: (-r.hits, -r.last_access))
            tiers[tier.name] = [{"key": r.key, "size": r.size, "hits": r.hits} for r in rows]
        state["tiers"] = tiers
    return state


def restore_warm(step_dir: Path, loader: Any, stack: Any = None, batches: int | None = None,
                 rank: int = 0) -> int:
    """Stage the shards recorded in `step_dir` (or, without a record or with `batches`, the ones
    the loader's cursor needs next) through `stack` (default: the loader's stager's); returns
    how many are now in a tier. Stops at the top tier's capacity: staging more would evict the
    first ones."""
    stack = stack if stack is not None else getattr(getattr(loader, "stager", None), "stack", None)
    if stack is None or not stack.tiers:
        return 0
    infos = loader.dataset.manifest.shards
    by_name = {info.name: i for i, info in enumerate(infos)}
    path = Path(step_dir) / warm_name(rank)
    order: list[int] | None = None
    if batches is None and path.is_file():
        recorded = json.loads(path.read_text())
        names = recorded.get("next_shards", [])
        if all(n in by_name for n in names):  # the same dataset: its names are its content
            order = [by_name[n] for n in names]
    if order is None:
        order = next_shards(loader.dataset, cursor_of(loader), batches or 256)
    top = stack.tiers[0]
    room = top.capacity
    staged = 0
    for index in order:
        info = infos[index]
        size = info.decoded_bytes if top.form == "decoded" else info.bytes
        if size > room:
            break
        handle = stack.ensure(info, prefetch=True)
        if handle is None:
            break
        handle.release()
        room -= size
        staged += 1
    return staged
