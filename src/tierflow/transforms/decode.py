"""Encoded image bytes -> RGB pixels, with the JPEG decoder's own downscaling.

A JPEG can be decoded at 1/2, 1/4 or 1/8 of its size in the DCT domain for a fraction of the
cost of a full decode; a crop that ends at 224 pixels rarely needs the full resolution. The
caller says the smallest size it needs (`min_size`) and gets the cheapest image at least that
big. Decoders: `simplejpeg` (libjpeg-turbo, JPEG only) when installed, Pillow for everything
else and as the fallback; the choice is fixed per process, so pixels are the same in every
worker (benchmarks/images.py --decoders measures them).
"""

from __future__ import annotations

import functools
import io
from typing import Any

import numpy as np

from tierflow.errors import TierflowError

DECODERS = ("simplejpeg", "pillow")


class ImageDecodeError(TierflowError, ValueError):
    """An image that does not decode; the message names its sample (and shard/row when a batcher knows)."""


def available_decoders() -> list[str]:
    """The decoders importable here, fastest first (as measured in benchmarks/images.py)."""
    return list(_importable_decoders())


@functools.cache
def _importable_decoders() -> tuple[str, ...]:
    """Looked up once per process: `decode` asks for every image, and the imports cost ~0.1 ms."""
    found = []
    try:
        import simplejpeg  # noqa: F401

        found.append("simplejpeg")
    except ImportError:
        pass
    try:
        import PIL  # noqa: F401

        found.append("pillow")
    except ImportError:
        pass
    return tuple(found)


def resolve_decoder(name: str = "auto") -> str:
    """`auto` -> the first of `available_decoders()`; a named one must be importable."""
    found = _importable_decoders()
    if name == "auto":
        if not found:
            raise ImportError("decoding images needs Pillow (pip install 'tierflow[images]')")
        return found[0]
    if name not in DECODERS:
        raise ValueError(f"unknown decoder {name!r}; expected one of {DECODERS} or 'auto'")
    if name not in found:
        raise ImportError(f"decoder {name!r} is not installed (pip install 'tierflow[images]')")
    return name


def is_jpeg(data: bytes) -> bool:
    return data[:3] == b"\xff\xd8\xff"


def decode_pil(data: bytes, min_size: tuple[int, int] | None = None) -> Any:
    """A Pillow RGB image, JPEGs decoded at the smallest DCT scale still >= min_size (w, h)."""
    from PIL import Image

    img: Image.Image = Image.open(io.BytesIO(data))
    if min_size is not None and img.format == "JPEG":
        img.draft("RGB", (max(1, int(min_size[0])), max(1, int(min_size[1]))))
    if img.mode != "RGB":
        img = img.convert("RGB")
    else:
        img.load()
    return img


def decode(data: bytes, min_size: tuple[int, int] | None = None, decoder: str = "auto") -> Any:
    """Pixels of `data` as an RGB image object (Pillow) or HWC uint8 array (simplejpeg), at least
    `min_size` (w, h) when downscaled. Raises ImageDecodeError for bytes that do not decode."""
    if data is None:
        raise ImageDecodeError("no image (null)")
    name = resolve_decoder(decoder)
    try:
        if name == "simplejpeg" and is_jpeg(data):
            import simplejpeg

            w, h = (0, 0) if min_size is None else (int(min_size[0]), int(min_size[1]))
            return simplejpeg.decode_jpeg(data, colorspace="RGB", min_width=w, min_height=h)
        return decode_pil(data, min_size)
    except Exception as e:
        raise ImageDecodeError(f"image does not decode ({type(e).__name__}: {e})") from None


def to_array(image: Any) -> np.ndarray:
    """HWC uint8 RGB of a decoded image (a view when it already is one)."""
    return image if isinstance(image, np.ndarray) else np.asarray(image, dtype=np.uint8)


def size_of(image: Any) -> tuple[int, int]:
    """(width, height) of a decoded image."""
    return (image.shape[1], image.shape[0]) if isinstance(image, np.ndarray) else image.size
