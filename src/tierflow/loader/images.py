"""Batchers for image samples: corrupt images skipped or named by shard and row, and aspect buckets.

`ImageSamples` is `Samples` whose transform may fail on a sample's image (ImageDecodeError):
with on_error="skip" the sample is dropped and counted (`stats["corrupt"]`), the batch shrinks,
and the order and resume stay exact; with "raise" the error names the shard, block, row and the
sample's key, and reaches the training loop typed, never a dead worker pool.

`AspectBuckets` is to images what LengthBuckets is to tokens: a group of `group` order batches
is sorted by the pre-computed aspect ratio (`<image>_width / _height` columns, no decode) and
cut into `group` batches; each batch takes the bucket of its median sample from a bounded set
of shapes, and every sample of it is cropped and resized to that shape (ResizeToBucket reads
it from the sample's `__bucket__`). The same `batches_per_group` for every group, so a batch's
position alone locates it and resume is exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar
from collections.abc import Sequence

import numpy as np

from tierflow.format.manifest import Manifest
from tierflow.loader.batching import SampleContext, Samples, SortedGroups, transformed
from tierflow.loader._collate import collate_samples
from tierflow.loader.plan import Built, Selection
from tierflow.transforms.augment import BUCKET_KEY, aspect_buckets, nearest_bucket
from tierflow.transforms.decode import ImageDecodeError


def where(ctx: SampleContext, sample_id: int) -> str:
    """Shard, block and row of a sample, for an error message."""
    shard, block, row = ctx.dataset.index.locate_sample(int(sample_id))
    name = ctx.dataset.manifest.shards[shard].name
    return f"{ctx.dataset.location or 'dataset'}: shard {shard} ({name}) block {block} row {row} (sample {sample_id})"


def build_samples(
    ctx: SampleContext, selection: Selection, pick: np.ndarray, on_error: str, extra: dict[str, Any] | None = None
) -> Built:
    """Rows `pick` of the selection through filter and transform, collated; corrupt ones per on_error."""
    ids, epochs = selection.sample_ids[pick], selection.epochs[pick]
    kept: list[int] = []
    samples = []
    filtered = corrupt = 0
    for k, (sample_id, epoch) in enumerate(zip(ids.tolist(), epochs.tolist())):
        sample = ctx.dataset[int(sample_id)]
        if extra:
            sample.update(extra)
        if ctx.filter is not None and not ctx.filter(sample):
            filtered += 1
            continue
        if ctx.transform is not None:
            try:
                sample = transformed(ctx, sample, sample_id, epoch)
            except ImageDecodeError as e:
                if on_error != "skip":
                    raise ImageDecodeError(f"{where(ctx, sample_id)}: {e}") from None
                corrupt += 1
                continue
        samples.append(sample)
        kept.append(k)
    names = list(samples[0].keys()) if samples else list(ctx.dataset.columns)
    batch, copied = collate_samples(samples, names)
    keep = np.array(kept, dtype=np.int64)
    batch["mask"] = selection.mask[pick][keep]
    return Built(
        batch,
        ids[keep].astype(np.int64),
        epochs[keep].astype(np.int64),
        {"copied_bytes": copied, "filtered": filtered + corrupt, "corrupt": corrupt, "samples": len(samples)},
    )


def _check_on_error(on_error: str) -> None:
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', not {on_error!r}")


@dataclass
class ImageSamples(Samples):
    """Samples whose undecodable images are skipped and counted, or raised naming shard and row."""

    on_error: str = "raise"

    def __post_init__(self) -> None:
        _check_on_error(self.on_error)

    def build(self, ctx: SampleContext, selection: Selection) -> Built:
        return build_samples(ctx, selection, np.arange(selection.sample_ids.size), self.on_error)


@dataclass
class AspectBuckets(SortedGroups):
    """Image batches of one shape each, from a bounded set of (height, width) `buckets`, chosen from
    the packed width/height columns of `image` (pack computes them; nothing is decoded to choose)."""

    buckets: Sequence[tuple[int, int]] = field(default_factory=aspect_buckets)
    group: int = 8
    image: str = "image"
    select: Sequence[str] | None = None
    on_error: str = "raise"
    runs_transforms: ClassVar[bool] = True

    def __post_init__(self) -> None:
        _check_on_error(self.on_error)
        if self.group < 1 or not self.buckets:
            raise ValueError(f"AspectBuckets needs group >= 1 and a bucket, got {self.group}, {self.buckets}")
        self.buckets = [(int(h), int(w)) for h, w in self.buckets]

    def columns(self, manifest: Manifest) -> list[str] | None:
        size = [f"{self.image}_width", f"{self.image}_height"]
        missing = [c for c in size if c not in manifest.schema.names]
        if missing:
            raise TypeError(
                f"AspectBuckets needs the {missing} columns, which pack writes beside an image column "
                f"{self.image!r} (re-pack with this tierflow, or pass image=)"
            )
        if self.select is None:
            return None
        return list(dict.fromkeys([*self.select, *size]))

    def _sorted_group(self, ctx: SampleContext, ids: np.ndarray, epochs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The group's order by aspect ratio and each sample's bucket, kept while its parts are built."""
        cached = ctx.cache.get("aspect_group")
        if cached is not None and cached[0] is ids:
            return cached[1], cached[2]
        ds = ctx.dataset
        ratios = np.empty(ids.size, dtype=np.float64)
        for k, i in enumerate(ids.tolist()):
            shard, block, row = ds.index.locate_sample(int(i))
            table = ds.shard(shard)
            w = table.getter(block, f"{self.image}_width")(row)
            h = table.getter(block, f"{self.image}_height")(row)
            ratios[k] = math.log(max(w or 1, 1) / max(h or 1, 1))
        order = self.epoch_major(ratios, epochs)
        chosen = np.array([nearest_bucket(math.exp(r), 1.0, self.buckets) for r in ratios], dtype=np.int64)
        ctx.cache["aspect_group"] = (ids, order, chosen)
        return order, chosen

    def build(self, ctx: SampleContext, selection: Selection) -> Built:
        ids = selection.sample_ids
        order, chosen = self._sorted_group(ctx, ids, selection.epochs)
        pick = self.part_of(order, selection)
        bucket = self.buckets[int(chosen[pick[pick.size // 2]])] if pick.size else self.buckets[0]
        built = build_samples(ctx, selection, pick, self.on_error, {BUCKET_KEY: bucket})
        built.stats["bucket_height"], built.stats["bucket_width"] = bucket
        return built
