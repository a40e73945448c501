"""Replayable image augmentations, planned before the decode and applied in one resample.

Each step (RandomResizedCrop, CenterCrop, ResizeToBucket, HorizontalFlip) only *plans*: given
the image's size (from the packed `<image>_width/_height` columns, else its header) it moves a
crop box and an output size, drawing every random choice from the per-sample `rng` the loader
passes to `transform(sample, rng)` (seeded from seed, epoch and sample id), so a resumed run, or
one with another worker count, crops and flips exactly as before. `ImagePipeline` then decodes
once at the smallest JPEG scale the box allows and resizes the box to the output in one pass.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from typing import Any, Protocol
from collections.abc import Sequence

import numpy as np

from tierflow.transforms.decode import ImageDecodeError, decode, resolve_decoder, size_of, to_array
from tierflow.transforms.resized import ResizedImages

KEY_COLUMNS = ("__key__", "key", "path", "url")
BUCKET_KEY = "__bucket__"
"""A sample's (height, width) bucket, set by the AspectBuckets batcher for ResizeToBucket."""


@dataclass(frozen=True)
class Geometry:
    """Where the output comes from: a box in source pixels (x0, y0, x1, y1), its output size, a flip."""

    box: tuple[float, float, float, float]
    out: tuple[int, int]
    flip: bool = False

    @classmethod
    def full(cls, width: int, height: int) -> Geometry:
        return cls((0.0, 0.0, float(width), float(height)), (int(width), int(height)))

    def crop(self, x: float, y: float, w: float, h: float, out: tuple[int, int]) -> Geometry:
        """Crop (x, y, w, h) of the current output image, resized to `out`."""
        x0, y0, x1, y1 = self.box
        sx, sy = (x1 - x0) / self.out[0], (y1 - y0) / self.out[1]
        if self.flip:  # the current image is mirrored: its x runs from the box's right edge
            x = self.out[0] - x - w
        return Geometry((x0 + x * sx, y0 + y * sy, x0 + (x + w) * sx, y0 + (y + h) * sy), out, self.flip)


class Step(Protocol):
    def __call__(self, geometry: Geometry, rng: np.random.Generator, sample: dict, /) -> Geometry: ...


def _pair(size: int | Sequence[int]) -> tuple[int, int]:
    """(width, height) of a size given as one int or (height, width), torchvision's order."""
    if isinstance(size, int):
        return size, size
    return int(size[1]), int(size[0])


@dataclass
class RandomResizedCrop:
    """torchvision's RandomResizedCrop: a random area fraction and aspect ratio, resized to `size`."""

    size: int | Sequence[int]
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)

    def __call__(self, g: Geometry, rng: np.random.Generator, sample: dict) -> Geometry:
        w, h = g.out
        area = w * h
        log_ratio = (math.log(self.ratio[0]), math.log(self.ratio[1]))
        for _ in range(10):
            target = area * rng.uniform(self.scale[0], self.scale[1])
            aspect = math.exp(rng.uniform(*log_ratio))
            cw, ch = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
            if 0 < cw <= w and 0 < ch <= h:
                y, x = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
                return g.crop(x, y, cw, ch, _pair(self.size))
        in_ratio = w / h
        if in_ratio < min(self.ratio):
            cw, ch = w, int(round(w / min(self.ratio)))
        elif in_ratio > max(self.ratio):
            cw, ch = int(round(h * max(self.ratio))), h
        else:
            cw, ch = w, h
        return g.crop((w - cw) // 2, (h - ch) // 2, cw, ch, _pair(self.size))


@dataclass
class CenterCrop:
    """The largest centred box of `size`'s aspect ratio, resized to `size` (evaluation)."""

    size: int | Sequence[int]

    def __call__(self, g: Geometry, rng: np.random.Generator, sample: dict) -> Geometry:
        return _fit(g, _pair(self.size), None)


@dataclass
class HorizontalFlip:
    """Mirror left-right with probability `p` (one draw per sample, always made)."""

    p: float = 0.5

    def __call__(self, g: Geometry, rng: np.random.Generator, sample: dict) -> Geometry:
        return replace(g, flip=g.flip ^ bool(rng.random() < self.p))


def aspect_buckets(
    area: int = 256 * 256, multiple: int = 32, max_ratio: float = 2.0, count: int = 9
) -> list[tuple[int, int]]:
    """A bounded set of (height, width) shapes of about `area` pixels, sides multiples of `multiple`,
    aspect ratios spaced geometrically from 1/max_ratio to max_ratio (one shape per ratio)."""
    if count < 1 or multiple < 1 or area < multiple * multiple or max_ratio < 1:
        raise ValueError(
            f"aspect buckets need count >= 1, area >= multiple^2, max_ratio >= 1; got {count}, "
            f"{area}, {multiple}, {max_ratio}"
        )
    ratios = np.exp(np.linspace(-math.log(max_ratio), math.log(max_ratio), count)) if count > 1 else [1.0]
    shapes = []
    for r in ratios:  # r = width / height
        w = max(multiple, int(round(math.sqrt(area * r) / multiple)) * multiple)
        h = max(multiple, int(round(math.sqrt(area / r) / multiple)) * multiple)
        if (h, w) not in shapes:
            shapes.append((h, w))
    return sorted(shapes, key=lambda s: s[1] / s[0])


def nearest_bucket(width: float, height: float, buckets: Sequence[tuple[int, int]]) -> int:
    """Index of the bucket whose aspect ratio is nearest (in log ratio) to width / height."""
    target = math.log(max(width, 1) / max(height, 1))
    return min(range(len(buckets)), key=lambda i: abs(math.log(buckets[i][1] / buckets[i][0]) - target))


def _fit(g: Geometry, out: tuple[int, int], rng: np.random.Generator | None) -> Geometry:
    """The largest box of out's aspect inside the current image (centred, or at a random offset)."""
    w, h = g.out
    scale = min(w / out[0], h / out[1])
    cw, ch = out[0] * scale, out[1] * scale
    if rng is None:
        x, y = (w - cw) / 2, (h - ch) / 2
    else:
        x, y = rng.uniform(0, w - cw) if w > cw else 0.0, rng.uniform(0, h - ch) if h > ch else 0.0
    return g.crop(x, y, cw, ch, out)


@dataclass
class ResizeToBucket:
    """Crop to the bucket's aspect ratio (random offset with `random_crop`) and resize to it. The
    bucket is the sample's `__bucket__` (set by the AspectBuckets batcher, one per batch), else the
    nearest of `buckets`."""

    buckets: Sequence[tuple[int, int]] = field(default_factory=aspect_buckets)
    random_crop: bool = True

    def __call__(self, g: Geometry, rng: np.random.Generator, sample: dict) -> Geometry:
        bucket = sample.get(BUCKET_KEY)
        if bucket is None:
            bucket = self.buckets[nearest_bucket(g.out[0], g.out[1], self.buckets)]
        h, w = int(bucket[0]), int(bucket[1])
        return _fit(g, (w, h), rng if self.random_crop else None)


def sample_key(sample: dict) -> str:
    """What names a sample in an error: its key, path or URL, when the sample carries one."""
    for k in KEY_COLUMNS:
        if sample.get(k) is not None:
            return f"{k} {sample[k]!r}"
    return "a sample (select a key/path/url column to name it)"


@dataclass
class ImagePipeline:
    """`transform(sample, rng)`: decode `image`, apply `steps`, return uint8 pixels (HWC, or CHW
    with layout="CHW") under `image`, plus the `keep` columns (bytes captions become str).
    Float conversion and normalisation belong on the device (`normalize`). With `cache`, the
    steps crop from the image's cached resized form instead of the original."""

    steps: Sequence[Step] = ()
    image: str = "image"
    keep: Sequence[str] = ("caption",)
    decoder: str = "auto"
    layout: str = "HWC"
    cache: ResizedImages | None = None
    """Serve images from their decoded-and-resized form, kept in a tier (transforms/resized.py, which
    says how it changes the augmentation); None: decode the encoded bytes for every sample."""
    resampler: str = "auto"
    """"torch" (its vectorised uint8 kernel; the box rounded to whole decoded pixels) or "pillow"
    (fractional box); "auto": torch when importable. The pixels differ by a level or two between
    them; each is deterministic, and the choice is fixed when the pipeline is made."""

    tokenizer: str | None = None
    """"bytes" or a tokenizer.json: each `keep` column holding text also comes tokenised, as
    `<column>_ids` (int64, `max_tokens` of them: the caption's ids, EOS last, cut to fit with EOS
    kept, then 0s) and `<column>_length` (its ids before the padding), so a batch stacks them."""
    max_tokens: int = 77
    _tokens: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.layout not in ("HWC", "CHW"):
            raise ValueError(f"layout must be 'HWC' or 'CHW', not {self.layout!r}")
        if self.tokenizer is not None:
            from tierflow.pack.tokenize import make_tokenizer

            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be at least 1, not {self.max_tokens}")
            self._tokens = make_tokenizer(self.tokenizer)
        self.decoder = resolve_decoder(self.decoder)  # fixed here: every worker decodes alike
        self.resampler = resolve_resampler(self.resampler)

    @property
    def needs_source(self) -> bool:
        """Whether batchers should say where each sample lives (SOURCE_KEY): a cache keys on it."""
        return self.cache is not None

    def geometry(self, sample: dict, rng: np.random.Generator) -> tuple[Geometry, int, int]:
        """The planned box, output size and flip, and the source's (width, height), without decoding."""
        width, height = sample.get(f"{self.image}_width"), sample.get(f"{self.image}_height")
        if width is None or height is None:
            from tierflow.pack._media import CorruptImage, probe

            try:
                width, height, _ = probe(sample[self.image])
            except CorruptImage as e:
                raise ImageDecodeError(f"{sample_key(sample)}: {e}") from None
        return self._plan(int(width), int(height), rng, sample), int(width), int(height)

    def _plan(self, width: int, height: int, rng: np.random.Generator, sample: dict) -> Geometry:
        g = Geometry.full(width, height)
        for step in self.steps:
            g = step(g, rng, sample)
        return g

    def pixels(self, sample: dict, rng: np.random.Generator) -> np.ndarray:
        if self.cache is not None:  # the steps plan on the cached resized image (transforms/resized.py)
            try:
                img = self.cache.image(sample, self.image, self.decoder)
            except ImageDecodeError as e:
                raise ImageDecodeError(f"{sample_key(sample)}: {e}") from None
            g = self._plan(img.shape[1], img.shape[0], rng, sample)
            return _resample(img, g.box, g.out, g.flip, self.resampler)
        data = sample.get(self.image)
        if data is None:
            raise ImageDecodeError(f"{sample_key(sample)}: no {self.image!r} (null or not selected)")
        g, width, height = self.geometry(sample, rng)
        x0, y0, x1, y1 = g.box
        need = (math.ceil(width * g.out[0] / max(x1 - x0, 1e-6)), math.ceil(height * g.out[1] / max(y1 - y0, 1e-6)))
        try:
            img = decode(data, need, self.decoder)
        except ImageDecodeError as e:
            raise ImageDecodeError(f"{sample_key(sample)}: {e}") from None
        dw, dh = size_of(img)
        sx, sy = dw / width, dh / height
        return _resample(img, (x0 * sx, y0 * sy, x1 * sx, y1 * sy), g.out, g.flip, self.resampler)

    def __call__(self, sample: dict, rng: np.random.Generator) -> dict[str, Any]:
        pixels = self.pixels(sample, rng)
        if self.layout == "CHW":
            pixels = np.ascontiguousarray(pixels.transpose(2, 0, 1))
        out: dict[str, Any] = {self.image: pixels}
        for k in self.keep:
            value = sample.get(k)
            out[k] = value = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
            if self._tokens is not None and (value is None or isinstance(value, str)):
                out[f"{k}_ids"], out[f"{k}_length"] = self._tokenized(value or "")
        return out

    def _tokenized(self, text: str) -> tuple[np.ndarray, int]:
        import pyarrow as pa

        ids = self._tokens.encode_arrow(pa.array([text]))[1]  # pack's encoding: the ids, EOS last
        if ids.size > self.max_tokens:
            ids = np.append(ids[: self.max_tokens - 1], ids[-1])
        padded = np.zeros(self.max_tokens, dtype=np.int64)
        padded[: ids.size] = ids
        return padded, int(ids.size)


RESAMPLERS = ("torch", "pillow")


@functools.cache
def _torch_importable() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_resampler(name: str = "auto") -> str:
    """`auto` -> torch when importable (its uint8 antialiased bilinear kernel costs ~0.2 ms for a 224
    crop against ~0.75 for Pillow's, copies included: benchmarks/images.py), else Pillow."""
    if name == "auto":
        return "torch" if _torch_importable() else "pillow"
    if name not in RESAMPLERS:
        raise ValueError(f"unknown resampler {name!r}; expected one of {RESAMPLERS} or 'auto'")
    if name == "torch" and not _torch_importable():
        raise ImportError("resampler 'torch' needs torch (pip install torch)")
    return name


def _resample(
    img: Any, box: tuple[float, float, float, float], out: tuple[int, int], flip: bool, resampler: str = "pillow"
) -> np.ndarray:
    """The box of `img` resized to `out` (w, h) in one antialiased bilinear pass, mirrored on `flip`,
    as a contiguous HWC uint8 array."""
    if resampler == "torch":
        return _resample_torch(img, box, out, flip)
    return _resample_pillow(img, box, out, flip)


def _resample_torch(img: Any, box: tuple[float, float, float, float], out: tuple[int, int], flip: bool) -> np.ndarray:
    """torch's antialiased bilinear resize (align_corners=False, as Pillow's) of the box rounded to
    whole pixels: the crop is cut to a contiguous HWC array (rows of memcpy) and viewed as a
    channels-last NCHW tensor, the layout of torch's vectorised uint8 kernel, whose output is
    channels-last too, so it is HWC again without a copy. torch mirrors it (numpy's reversed copy
    of 3-byte pixels costs ~7x more). A box of the output's size is the crop itself, not resampled."""
    import torch
    from torch.nn.functional import interpolate

    w, h = size_of(img)
    x0 = min(max(0, int(round(box[0]))), w - 1)
    y0 = min(max(0, int(round(box[1]))), h - 1)
    x1, y1 = max(x0 + 1, min(w, int(round(box[2])))), max(y0 + 1, min(h, int(round(box[3]))))
    if isinstance(img, np.ndarray):
        crop = np.ascontiguousarray(img[y0:y1, x0:x1])
    else:  # a Pillow image: only the box crosses into numpy
        crop = to_array(img.crop((x0, y0, x1, y1)))
    if not crop.flags.writeable:  # a view of a read-only image (Pillow's): torch wants its own
        crop = crop.copy()
    threads = torch.get_num_threads()
    if threads > 1:  # one image is too small to share: the other threads would spin through the decodes
        torch.set_num_threads(1)
    try:
        hwc = torch.from_numpy(crop)
        if crop.shape[1] != out[0] or crop.shape[0] != out[1]:
            nchw = interpolate(
                hwc[None].permute(0, 3, 1, 2),
                size=(out[1], out[0]),
                mode="bilinear",
                antialias=True,
                align_corners=False,
            )
            hwc = nchw[0].permute(1, 2, 0)
        if flip:
            hwc = hwc.flip(1)
        return np.ascontiguousarray(hwc.numpy())
    finally:
        if threads > 1:
            torch.set_num_threads(threads)


def _resample_pillow(img: Any, box: tuple[float, float, float, float], out: tuple[int, int], flip: bool) -> np.ndarray:
    """Pillow's resize of the (fractional) box. A decoded array is cut to the box and the filter's
    reach around it first, so only those pixels are copied into Pillow (the same output: the
    resampler reads nothing beyond that reach)."""
    from PIL import Image

    if isinstance(img, np.ndarray):
        h, w = img.shape[:2]
        # bilinear support is 1 output pixel, i.e. box/out source pixels (at least 1) on each side
        mx = math.ceil(max((box[2] - box[0]) / out[0], 1.0)) + 1
        my = math.ceil(max((box[3] - box[1]) / out[1], 1.0)) + 1
        x0, y0 = max(0, int(math.floor(box[0])) - mx), max(0, int(math.floor(box[1])) - my)
        x1, y1 = min(w, int(math.ceil(box[2])) + mx), min(h, int(math.ceil(box[3])) + my)
        pil = Image.fromarray(np.ascontiguousarray(img[y0:y1, x0:x1]))
        box = (box[0] - x0, box[1] - y0, box[2] - x0, box[3] - y0)
    else:
        pil = img
    w, h = pil.size
    box = (max(0.0, box[0]), max(0.0, box[1]), min(float(w), box[2]), min(float(h), box[3]))
    resized = pil.resize(out, Image.Resampling.BILINEAR, box=box)
    if flip:
        resized = resized.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return to_array(resized)


def normalize(
    batch: Any,
    mean: Sequence[float] = (0.485, 0.456, 0.406),
    std: Sequence[float] = (0.229, 0.224, 0.225),
    channels_last: bool = True,
) -> Any:
    """The device step: a uint8 (N, H, W, C) tensor -> float32 (N, C, H, W), scaled to [0, 1] and
    normalised; run it on the GPU after the loader's copy (a quarter of the bytes cross the bus)."""
    import torch

    x = batch.permute(0, 3, 1, 2) if channels_last else batch
    x = x.to(torch.float32).div_(255.0)
    m = torch.tensor(mean, dtype=torch.float32, device=x.device).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=torch.float32, device=x.device).view(1, -1, 1, 1)
    return x.sub_(m).div_(s)
