"""What a TieredDataset reads, as frozen values, and the one pure function that settles its order.

`BatchSpec` says how samples become batches (the batcher and its shortcuts, the user's transforms);
`OrderSpec` says how the order walks the dataset (seed, partitions, breadth, shuffle, groups).
`settle_order` applies the defaults and, for what the user left unset, a resumed cursor's saved
choices, so a resumed run walks the order it saved; `working_set_for` sizes the breadth from the
dataset alone (never a tier). Both are functions of their arguments only, which is what makes the
same seed give the same batches on every node.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, cast
from collections.abc import Sequence

from tierflow.format.metadata import MappedManifest, shard_column
from tierflow.format.metadata_layout import default_partitions
from tierflow.loader.batching import Batcher, Collate, Filter, Samples, TokenWindows, Transform
from tierflow.loader.budget import TokenBudget
from tierflow.loader.cursor import LoaderCursor
from tierflow.order.groups import GROUP_BYTES, GROUP_SAMPLES
from tierflow.order.working_set import (
    ShardSizes,
    WorkingSet,
    choose_working_set,
    with_first_epoch,
    working_set_bytes,
    working_set_shards,
)

NARROWED: Literal["narrowed"] = "narrowed"
"""A first epoch no cursor decided: narrowed by the default rule (working_set.first_epoch_breadth)."""

FirstEpoch = tuple[int, int] | Literal["narrowed"] | None
"""The first epoch's breadth: (lanes, window shards) as saved, NARROWED by the default rule, None as wide
as later epochs."""


@dataclass(frozen=True)
class BatchSpec:
    """How the order's samples become output batches: `batch_size` samples per batch (with a token
    budget, samples pulled from the stream at a time), batched by one of `seq_len` (token windows),
    `max_tokens` (a token budget) or `batcher`; else `Samples` of `columns`, which alone runs the
    user's `filter`, `transform` and `collate`."""

    batch_size: int
    seq_len: int | None = None
    max_tokens: int | None = None
    batcher: Batcher | None = None
    columns: Sequence[str] | None = None
    transform: Transform | None = None
    filter: Filter | None = None
    collate: Collate | None = None

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if sum(x is not None for x in (self.seq_len, self.max_tokens, self.batcher)) > 1:
            raise ValueError("pass one of seq_len (token windows), max_tokens (token budget) or batcher")

    def make_batcher(self) -> Batcher:
        """The batcher this spec names (a new one per call unless `batcher` was given)."""
        if self.batcher is not None:
            batcher = self.batcher
        elif self.seq_len is not None:
            batcher = cast(Batcher, TokenWindows(self.seq_len))
        elif self.max_tokens is not None:
            batcher = cast(Batcher, TokenBudget(self.max_tokens))
        else:
            batcher = cast(Batcher, Samples(select=list(self.columns) if self.columns is not None else None))
        if not batcher.runs_transforms and (
            self.transform is not None or self.filter is not None or self.collate is not None
        ):
            raise ValueError(f"{type(batcher).__name__} does not run filter/transform/collate (use Samples)")
        return batcher


@dataclass(frozen=True)
class OrderSpec:
    """How the order walks the dataset (docs/order.md). None: the default, or a resumed cursor's.

    `shuffle=False` trains in stored order (one lane per node, the same every epoch). `group_bytes`
    shuffles samples within block groups of about that many decoded bytes (GROUP_BYTES by default),
    so a batch decodes a bounded number of blocks; 0 shuffles each window's samples all together.
    `narrow_first_epoch` (with lanes and window_shards left unset): epoch 0 reads at most 1/16 of the
    node's shards at once, so a cold node streams its first epoch at the link's rate."""

    seed: int = 0
    partitions: int | None = None
    window_shards: int | None = None
    lanes: int | None = None
    remainder: str = "carry"
    shuffle: bool = True
    group_bytes: int | None = None
    narrow_first_epoch: bool = True


@dataclass(frozen=True)
class SettledOrder:
    """An OrderSpec with its defaults applied and a resumed cursor's saved choices over them."""

    seed: int
    partitions: int
    window_shards: int | None
    lanes: int | None
    remainder: str
    shuffle: bool
    group_bytes: int
    group_samples: int
    first_epoch: FirstEpoch
    groups_given: bool
    """The user set group_bytes: a cursor loaded later keeps them."""
    breadth_chosen: bool
    """The breadth is the default's (not given): a cursor loaded later brings its first epoch."""


def settle_order(spec: OrderSpec, saved: LoaderCursor | None, nonempty_shards: int) -> SettledOrder:
    """`spec` with defaults applied; what it leaves unset comes from `saved`'s order config when a
    cursor is resumed, so the order it resumes is the one it saved."""
    partitions = _saved_int(saved, spec.partitions, "partitions")
    window_shards = _saved_int(saved, spec.window_shards, "window_shards")
    lanes = _saved_int(saved, spec.lanes, "lanes")
    breadth_chosen = spec.narrow_first_epoch and window_shards is None and lanes is None
    if not spec.shuffle and lanes is None:
        lanes = 1  # one lane reads the node's contiguous partitions one after another: stored order
    return SettledOrder(
        seed=spec.seed,
        partitions=partitions if partitions is not None else default_partitions(nonempty_shards),
        window_shards=window_shards,
        lanes=lanes,
        remainder=spec.remainder,
        shuffle=spec.shuffle,
        group_bytes=spec.group_bytes
        if spec.group_bytes is not None
        else saved_group(saved, "group_bytes", GROUP_BYTES),
        group_samples=saved_group(saved, "group_samples", GROUP_SAMPLES),
        first_epoch=saved_first_epoch(saved, breadth_chosen),
        groups_given=spec.group_bytes is not None,
        breadth_chosen=breadth_chosen,
    )


def shard_sizes(manifest: Any, name: str) -> Any:
    """A size column ("bytes", "decoded_bytes") as the working set reads it: a version-3 header's
    summary (no column read, format/metadata_summary.py), else the column."""
    summary = manifest.header.get("summary") if isinstance(manifest, MappedManifest) else None
    if summary is None:
        return shard_column(manifest, name)
    count = manifest.tables.num_shards
    return ShardSizes(count, int(manifest.tables.totals[name]), summary[name], lambda: shard_column(manifest, name))


def working_set_for(settled: SettledOrder, at_rest: Any, sizes: Any, per_node: int, node_shards: int) -> WorkingSet:
    """Lanes and window size: as settled, else the dataset's default (order/working_set.py), a function
    of the dataset, the world layout and the spec only. `at_rest` and `sizes` are per-shard byte
    columns (int64 numpy): the shards at rest, and in the form the top tier stores (what the staging
    area and the stager hold), which the working set's bytes count."""
    default = choose_working_set(at_rest, per_node, node_shards=max(1, node_shards))
    lanes, window_shards = settled.lanes, settled.window_shards
    if window_shards is None and lanes is None:
        chosen = dataclasses.replace(default, bytes=working_set_bytes(default.shards, sizes))
        if settled.first_epoch == NARROWED:
            return with_first_epoch(chosen, node_shards)
        return dataclasses.replace(chosen, first_epoch=settled.first_epoch)
    lanes = lanes if lanes is not None else (per_node if window_shards is not None else default.lanes)
    window_shards = window_shards if window_shards is not None else default.window_shards
    shards = working_set_shards(min(lanes, per_node), window_shards)
    first = None if settled.first_epoch == NARROWED else settled.first_epoch  # e.g. shuffle=False's one lane
    return WorkingSet(min(lanes, per_node), window_shards, shards, working_set_bytes(shards, sizes), "as given", first)


def specs_from(options: dict[str, Any]) -> tuple[BatchSpec, OrderSpec]:
    """The BatchSpec and OrderSpec of flat keywords (open_loader's), popped out of `options`, which
    keeps the rest (the dataset's and the Loader's)."""
    batching = {f.name: options.pop(f.name) for f in dataclasses.fields(BatchSpec) if f.name in options}
    order = {f.name: options.pop(f.name) for f in dataclasses.fields(OrderSpec) if f.name in options}
    return BatchSpec(**batching), OrderSpec(**order)


def flat_keywords_error(given: dict[str, Any], batching: Any) -> TypeError:
    """The error for `TieredDataset(path, batch_size=8, seq_len=2048, seed=1)`, the flat keywords it
    took before BatchSpec/OrderSpec: which spec each keyword belongs in, written out."""
    batch = [f.name for f in dataclasses.fields(BatchSpec) if f.name in given]
    order = [f.name for f in dataclasses.fields(OrderSpec) if f.name in given]
    other = [k for k in given if k not in batch and k not in order]
    if other:
        hint = "; several datasets mix in MixedDataset(datasets, batching, weights=...)" if "weights" in other else ""
        return TypeError(f"TieredDataset got unexpected keyword arguments {', '.join(map(repr, other))}{hint}")
    if not batch and isinstance(batching, BatchSpec):
        return TypeError(f"TieredDataset got unexpected keyword arguments {', '.join(map(repr, given))}")
    parts = [f"BatchSpec({', '.join(f'{k}=...' for k in batch)})" if batch else "BatchSpec(batch_size=...)"]
    if order:
        parts.append(f"OrderSpec({', '.join(f'{k}=...' for k in order)})")
    return TypeError(
        f"TieredDataset takes its batching and order as specs: TieredDataset(data, {', '.join(parts)}) "
        f"(tierflow.loader.BatchSpec, OrderSpec); open_loader(url, batch_size=..., seq_len=...) still takes "
        f"them as keywords"
    )


def saved_config(resume: LoaderCursor | None) -> dict[str, Any] | None:
    """The order config a resumed cursor saved (None: no cursor, or one without an order)."""
    return getattr(resume.order, "config", None) if resume is not None else None


def _saved_int(resume: LoaderCursor | None, given: int | None, name: str) -> int | None:
    """`given`, else the cursor's saved value of `name` (None: neither)."""
    value = (saved_config(resume) or {}).get(name)
    return given if given is not None or not isinstance(value, int) else value


def saved_first_epoch(resume: LoaderCursor | None, narrow: bool) -> FirstEpoch:
    """A resumed run's first-epoch breadth as its cursor saved it (None: as wide as later epochs), else
    NARROWED for the default rule, or None when not narrowed."""
    config = saved_config(resume)
    if not config:
        return NARROWED if narrow else None
    saved = config.get("first_epoch")  # anything but two counts: None, so the config check names the field
    if isinstance(saved, list) and len(saved) == 2 and all(type(v) is int and v >= 1 for v in saved):
        return saved[0], saved[1]
    return None


def saved_group(resume: LoaderCursor | None, key: str, default: int) -> int:
    """A resumed cursor's `group_bytes` or `group_samples` (0 in one saved before that existed: the
    full-window shuffle, no floor), else the default."""
    config = saved_config(resume)
    if not config:
        return default
    value = config.get(key, 0)
    return value if isinstance(value, int) else default


__all__ = [
    "NARROWED",
    "BatchSpec",
    "FirstEpoch",
    "OrderSpec",
    "SettledOrder",
    "default_partitions",
    "saved_first_epoch",
    "saved_group",
    "settle_order",
    "specs_from",
    "working_set_for",
]
