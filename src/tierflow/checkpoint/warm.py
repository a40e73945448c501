"""Warm restart: record at commit which shards the next batches need and how hot each tier's
entries are; on resume pre-stage them and give them back their statistics.

A fresh node has an empty L2, so the first steps after a resume would all read from the
source ("performance drops after resume"). At commit the loader's cursor says exactly which
shards its next `batches` batches read (the order is deterministic); that list, in order of
first use, and each tier's resident entries with their policy statistics (`Tier.heat`) and the
tier's clock go into the step as `tierflow-warm-R.json`, with the loop's measured batches per second
(its telemetry) so a resume can ask for "the next N minutes". `restore_warm` stages that list, then
the top tier's other saved entries hottest first, up to its capacity, and restores the saved
statistics into every tier that holds them (`Tier.restore_heat`), their times moved by the time
between the save and the restore. The policies then rank the restored entries as the stopped
process's did, so what they evict after the resume is what an uninterrupted run would have
evicted, and the first steps hit as they did before the stop.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any
from collections.abc import Sequence

if TYPE_CHECKING:  # the uploader process imports this package: it stays without the tiers
    from tierflow.tiers.tier import Tier

WARM_FORMAT = "tierflow-warm/2"
"""/2 adds per tier its clock and each entry's policy statistics; /1 records are still read."""


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


def stack_of(loader: Any, stack: Any = None) -> Any:
    """`stack`, else the loader's stager's stack (None: the loader reads through no tiers)."""
    return stack if stack is not None else getattr(getattr(loader, "stager", None), "stack", None)


def tier_heat(tiers: Sequence[Tier]) -> dict[str, dict[str, Any]]:
    """Each tier's clock now and its resident entries' statistics, hottest first (JSON)."""
    return {tier.name: {"clock": tier.clock(), "entries": [asdict(e) for e in tier.heat()]} for tier in tiers}


def restore_heat(tiers: Sequence[Tier], saved: dict[str, Any]) -> int:
    """Give each tier's resident entries the statistics `tier_heat` saved for the tier of that
    name, rebased from the saved clock to this tier's; returns how many entries took them."""
    from tierflow.tiers.tier import EntryHeat

    restored = 0
    for tier in tiers:
        record = saved.get(tier.name)
        if not isinstance(record, dict) or "clock" not in record:
            continue  # a /1 record (hits only) or a tier the checkpoint did not have
        entries = [
            EntryHeat(str(e["key"]), int(e["size"]), int(e["hits"]), float(e["last_access"]), dict(e["stats"]))
            for e in record["entries"]
        ]
        restored += tier.restore_heat(entries, shift=tier.clock() - float(record["clock"]))
    return restored


def batches_per_second(loader: Any) -> float | None:
    """The loop's rate so far, step and waits together, from the loader's telemetry (None without it)."""
    telemetry = getattr(loader, "telemetry", None)
    if telemetry is None:
        return None
    figures = telemetry.figures()
    seconds = figures.wait_s + figures.step_s + figures.startup_s
    return figures.batches / seconds if figures.batches and seconds > 0 else None


def warm_state(loader: Any, batches: int, stack: Any = None) -> dict[str, Any]:
    """The JSON written into a step: the loader's state, the next shards, each tier's heat, the loop's rate."""
    from tierflow.format.metadata_index import shard_file_name

    cursor = cursor_of(loader)
    manifest = loader.dataset.manifest
    state: dict[str, Any] = {
        "format": WARM_FORMAT,
        "batches": batches,
        "loader": loader.state_dict(),
        "next_shards": [shard_file_name(manifest, i) for i in next_shards(loader.dataset, cursor, batches)],
    }
    rate = batches_per_second(loader)
    if rate is not None:
        state["batches_per_s"] = rate
    stack = stack_of(loader, stack)
    if stack is not None:
        state["tiers"] = tier_heat(stack.tiers)
    return state


def restore_warm(
    step_dir: Path,
    loader: Any,
    stack: Any = None,
    batches: int | None = None,
    rank: int = 0,
    minutes: float | None = None,
) -> int:
    """Stage the shards recorded in `step_dir` (or, without a record or with `batches`, the ones
    the loader's cursor needs next) through `stack` (default: the loader's stager's), then the
    top tier's other saved entries, and restore the saved statistics; returns how many shards
    are now in a tier. Stops at the top tier's capacity: staging more would evict the first ones.
    `minutes`: the batches the stopped loop would have read in that time at its recorded rate."""
    path = Path(step_dir) / warm_name(rank)
    recorded = _recorded(path) if path.is_file() else {}
    if minutes is not None:
        if batches is not None:
            raise ValueError("restore_warm takes batches= or minutes=, not both")
        batches = batches_for(path, recorded, minutes)
    stack = stack_of(loader, stack)
    if stack is None or not stack.tiers:
        return 0
    from tierflow.format.metadata_index import ShardKeys, shards_named

    manifest = loader.dataset.manifest
    infos = manifest.shards
    order: list[int] | None = None
    top = stack.tiers[0]
    names = recorded.get("next_shards", [])
    if batches is None and recorded and isinstance(names, list) and all(isinstance(n, str) for n in names):
        keys = ShardKeys(manifest)
        order = shards_named(manifest, names, keys)  # None: a name not in this dataset (its names are its content)
        if order is not None:
            saved_top = recorded.get("tiers", {}).get(top.name, {})
            resident = saved_top.get("entries", []) if isinstance(saved_top, dict) else []
            chosen = set(order)
            for found in (
                keys.get(e["key"]) for e in resident if isinstance(e, dict) and isinstance(e.get("key"), str)
            ):
                if found and found[-1] not in chosen:
                    chosen.add(found[-1])
                    order.append(found[-1])
    if order is None:
        order = next_shards(loader.dataset, cursor_of(loader), batches or 256)
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
    if recorded.get("tiers"):
        restore_heat(stack.tiers, recorded["tiers"])
    return staged


def batches_for(path: Path, recorded: dict[str, Any], minutes: float) -> int:
    """Batches in `minutes` of the loop at the rate its warm record saved."""
    if not math.isfinite(minutes) or minutes <= 0:
        raise ValueError(f"minutes must be a positive number, not {minutes!r}")
    rate = recorded.get("batches_per_s")
    if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not math.isfinite(rate) or rate <= 0:
        from tierflow.errors import CheckpointError

        raise CheckpointError(
            str(path),
            "records no loop rate (the loader ran with telemetry off, or nothing "
            "was consumed before the commit): pass batches= instead of minutes=",
        )
    return max(1, math.ceil(minutes * 60 * rate))


def _recorded(path: Path) -> dict[str, Any]:
    """A step's warm record; empty for one that is no JSON object (damaged, or written by something
    else): the cursor says what comes next instead."""
    try:
        recorded = json.loads(path.read_bytes())
    except (ValueError, RecursionError):
        return {}
    return recorded if isinstance(recorded, dict) else {}
