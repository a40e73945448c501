"""Access traces that exercise cache policies: the read patterns of real training jobs.

A trace is a list of requests, each a key read over an interval of logical positions
[start, end] (a point read has start == end). Windowed shuffles read k shards at once,
each over an interval, and those shards are in use together. Keys are shard-like
names; sizes default to one unit per entry, so capacity is counted in entries.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

from tierflow.policies.auto import Lifecycle
from tierflow.policies.oracle import IntervalOracle


@dataclass(frozen=True, eq=False)
class Trace:
    """Requests sorted by start: key ids, [start, end] positions, and a size per key id."""

    name: str
    keys: np.ndarray
    start: np.ndarray
    end: np.ndarray
    sizes: np.ndarray
    epoch_length: float
    lifecycle: Lifecycle = field(default_factory=Lifecycle)
    names: Sequence[str] | None = None

    def __post_init__(self) -> None:
        if not (len(self.keys) == len(self.start) == len(self.end)):
            raise ValueError(f"trace {self.name!r}: keys, start and end differ in length")
        if len(self.start) and np.any(np.diff(self.start) < 0):
            raise ValueError(f"trace {self.name!r}: requests are not sorted by start")
        if np.any(self.end < self.start):
            raise ValueError(f"trace {self.name!r}: a request ends before it starts")

    def __len__(self) -> int:
        return len(self.keys)

    @cached_property
    def key_names(self) -> list[str]:
        if self.names is not None:
            return list(self.names)
        return [f"shard-{index:08x}" for index in range(len(self.sizes))]

    @property
    def windowed(self) -> bool:
        """Whether requests span intervals (in use together) rather than points."""
        return bool(np.any(self.end > self.start))

    @property
    def data_bytes(self) -> int:
        return int(self.sizes[np.unique(self.keys)].sum())

    @cached_property
    def epoch_ends(self) -> np.ndarray:
        """Positions after which an epoch ends (for policies that count epochs)."""
        if not len(self.start):
            return np.empty(0)
        last = float(self.end.max())
        return np.arange(self.epoch_length - 1, last, self.epoch_length, dtype=np.float64)

    def intervals(self) -> Iterator[tuple[str, float, float]]:
        """The loader's future view: (key, first_use, last_use) per request."""
        names = self.key_names
        for key, first, last in zip(self.keys.tolist(), self.start.tolist(), self.end.tolist()):
            yield names[key], first, last

    def oracle(self) -> IntervalOracle:
        return IntervalOracle(self.intervals())


def uniform_reshuffle(
    n_shards: int, epochs: int, *, window: int = 1, samples_per_shard: int = 1, shard_bytes: int = 1, seed: int = 0
) -> Trace:
    """A fresh shard shuffle each epoch; samples interleave inside windows of `window` shards.

    Positions are global sample positions. With window == samples_per_shard == 1 each
    request is a point; otherwise a shard is in use from its first to its last sample.
    """
    rng = np.random.default_rng(seed)
    keys, starts, ends = [], [], []
    position = 0
    for _ in range(epochs):
        order = rng.permutation(n_shards)
        for lo in range(0, n_shards, window):
            group = order[lo : lo + window]
            slots = rng.permutation(len(group) * samples_per_shard).reshape(len(group), samples_per_shard)
            first, last = slots.min(axis=1), slots.max(axis=1)
            by_first = np.argsort(first, kind="stable")
            keys.append(group[by_first])
            starts.append(position + first[by_first])
            ends.append(position + last[by_first])
            position += len(group) * samples_per_shard
    sizes = np.full(n_shards, shard_bytes, dtype=np.int64)
    return Trace(
        name=f"reshuffle(n={n_shards}, epochs={epochs}, window={window})",
        keys=np.concatenate(keys).astype(np.int64),
        start=np.concatenate(starts).astype(np.float64),
        end=np.concatenate(ends).astype(np.float64),
        sizes=sizes,
        epoch_length=float(n_shards * samples_per_shard),
        lifecycle=Lifecycle(passes=epochs, pattern="reshuffle", data_bytes=int(sizes.sum())),
    )


def _points(
    name: str, keys: np.ndarray, n_keys: int, epoch_length: float, lifecycle: Lifecycle, item_bytes: int
) -> Trace:
    positions = np.arange(len(keys), dtype=np.float64)
    return Trace(
        name=name,
        keys=keys.astype(np.int64),
        start=positions,
        end=positions,
        sizes=np.full(n_keys, item_bytes, dtype=np.int64),
        epoch_length=float(epoch_length),
        lifecycle=lifecycle,
    )


def zipf(n_items: int, n_accesses: int, alpha: float, *, item_bytes: int = 1, seed: int = 0) -> Trace:
    """Independent reads with probability proportional to 1 / rank**alpha (an epoch = n_items reads)."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, n_items + 1, dtype=np.float64) ** alpha
    popularity = rng.permutation(n_items)
    keys = popularity[rng.choice(n_items, size=n_accesses, p=weights / weights.sum())]
    lifecycle = Lifecycle(passes=None, pattern="skewed", data_bytes=n_items * item_bytes)
    return _points(f"zipf(n={n_items}, alpha={alpha})", keys, n_items, n_items, lifecycle, item_bytes)


def mixture(datasets: Sequence[tuple[int, float]], epochs: int, *, item_bytes: int = 1, seed: int = 0) -> Trace:
    """Mixture up-sampling: dataset d has n_d items, each read `repeats_d` times per epoch
    (fractional repeats read a random part once more), all shuffled together each epoch."""
    rng = np.random.default_rng(seed)
    offsets = np.cumsum([0] + [n for n, _ in datasets])
    blocks = []
    for _ in range(epochs):
        epoch = []
        for (n_items, repeats), offset in zip(datasets, offsets):
            whole = int(repeats)
            ids = np.arange(offset, offset + n_items)
            epoch.extend([ids] * whole)
            extra = int(round((repeats - whole) * n_items))
            if extra:
                epoch.append(rng.choice(ids, size=extra, replace=False))
        flat = np.concatenate(epoch)
        blocks.append(flat[rng.permutation(flat.size)])
    keys = np.concatenate(blocks)
    n_keys = int(offsets[-1])
    lifecycle = Lifecycle(passes=epochs, pattern="skewed", data_bytes=n_keys * item_bytes)
    described = ", ".join(f"{n}x{r:g}" for n, r in datasets)
    return _points(f"mixture({described})", keys, n_keys, blocks[0].size, lifecycle, item_bytes)


def hot_and_scan(hot_items: int, scan_items: int, hot_fraction: float, *, item_bytes: int = 1, seed: int = 0) -> Trace:
    """A hot set read uniformly, interleaved with one-pass scans over cold data.

    Each read is a hot item with probability `hot_fraction`, else the next item of the
    scan; the trace ends when the scan does. Scans come in bursts (runs of cold reads)."""
    rng = np.random.default_rng(seed)
    n_accesses = int(scan_items / (1.0 - hot_fraction))
    is_hot = np.repeat(rng.random(n_accesses // 64 + 1) < hot_fraction, 64)[:n_accesses]
    n_cold = int((~is_hot).sum())
    if n_cold > scan_items:
        is_hot[np.flatnonzero(~is_hot)[scan_items:]] = True
    keys = rng.integers(0, hot_items, size=n_accesses)
    cold = np.flatnonzero(~is_hot)
    keys[cold] = hot_items + np.arange(cold.size)
    lifecycle = Lifecycle(passes=None, pattern="unknown", data_bytes=(hot_items + scan_items) * item_bytes)
    return _points(
        f"hot+scan(hot={hot_items}, scan={scan_items})",
        keys,
        hot_items + scan_items,
        hot_items + scan_items,
        lifecycle,
        item_bytes,
    )


def loop(n_items: int, passes: int, *, item_bytes: int = 1) -> Trace:
    """The same sequential order every pass (a cyclic scan)."""
    keys = np.tile(np.arange(n_items), passes)
    lifecycle = Lifecycle(passes=passes, pattern="reshuffle", data_bytes=n_items * item_bytes)
    return _points(f"loop(n={n_items}, passes={passes})", keys, n_items, n_items, lifecycle, item_bytes)


def from_records(
    records: Iterable[tuple[str, int, float, float]],
    *,
    name: str = "recorded",
    epoch_length: float | None = None,
    lifecycle: Lifecycle | None = None,
) -> Trace:
    """A trace from (key, size, first_use, last_use) records, e.g. recorded from a loader run."""
    rows = sorted(records, key=lambda row: (row[2], row[3]))
    ids: dict[str, int] = {}
    sizes: list[int] = []
    keys = []
    for key, size, _, _ in rows:
        if key not in ids:
            ids[key] = len(ids)
            sizes.append(int(size))
        elif sizes[ids[key]] != int(size):
            raise ValueError(f"trace {name!r}: entry {key!r} has two sizes, {sizes[ids[key]]} and {size}")
        keys.append(ids[key])
    start = np.array([row[2] for row in rows], dtype=np.float64)
    end = np.array([row[3] for row in rows], dtype=np.float64)
    span = float(end.max() + 1) if len(rows) else 1.0
    return Trace(
        name=name,
        keys=np.array(keys, dtype=np.int64),
        start=start,
        end=end,
        sizes=np.array(sizes, dtype=np.int64),
        epoch_length=epoch_length or span,
        lifecycle=lifecycle or Lifecycle(),
        names=list(ids),
    )


def load_jsonl(path: str | Path, **options: object) -> Trace:
    """A recorded trace: one JSON object per line with key, size, first_use and last_use."""
    records = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                records.append((str(row["key"]), int(row["size"]), float(row["first_use"]), float(row["last_use"])))
            except (ValueError, KeyError, TypeError) as error:
                raise ValueError(f"{path}:{number}: not a trace record ({error})") from None
    return from_records(records, name=Path(path).name, **options)  # type: ignore[arg-type]
