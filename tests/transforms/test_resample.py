"""The pipeline's one resample: torch's uint8 kernel by default, Pillow's as the alternative."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from tierflow.transforms import HorizontalFlip, ImagePipeline, RandomResizedCrop
from tierflow.transforms.augment import _resample, resolve_resampler


def smooth(rng: np.random.Generator, w: int, h: int) -> np.ndarray:
    """A photograph-like image: a coarse random field, bicubically enlarged."""
    coarse = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
    return np.asarray(Image.fromarray(coarse).resize((w, h), Image.Resampling.BICUBIC))


def cases(count: int):
    rng = np.random.default_rng(0)
    for _ in range(count):
        h, w = int(rng.integers(20, 300)), int(rng.integers(20, 300))
        x0, y0 = int(rng.integers(0, w - 1)), int(rng.integers(0, h - 1))
        x1, y1 = int(rng.integers(x0 + 1, w + 1)), int(rng.integers(y0 + 1, h + 1))
        out = (int(rng.integers(4, 120)), int(rng.integers(4, 120)))
        yield smooth(rng, w, h), (x0, y0, x1, y1), out, bool(rng.random() < 0.5)


def test_torch_and_pillow_resample_a_box_to_nearly_the_same_pixels():
    """A level or so apart on average; the most where a box of one or a few pixels is stretched far."""
    apart = []
    for img, box, out, flip in cases(60):
        a, b = _resample(img, box, out, flip, "torch"), _resample(img, box, out, flip, "pillow")
        assert a.dtype == np.uint8 and a.shape == b.shape == (out[1], out[0], 3) and a.flags.c_contiguous
        apart.append(np.abs(a.astype(np.int16) - b).mean())
    assert max(apart) < 2.5 and np.mean(apart) < 0.5


def test_the_torch_resample_mirrors_exactly_and_keeps_a_box_of_the_output_size_as_it_is():
    for img, box, out, _ in cases(30):
        plain, mirrored = _resample(img, box, out, False, "torch"), _resample(img, box, out, True, "torch")
        assert np.array_equal(mirrored, plain[:, ::-1])
    img = smooth(np.random.default_rng(1), 90, 70)
    assert np.array_equal(_resample(img, (10, 5, 42, 37), (32, 32), False, "torch"), img[5:37, 10:42])
    pil = Image.fromarray(img)  # a Pillow image (the Pillow decoder's) is cut to the box the same way
    assert np.array_equal(
        _resample(pil, (10.2, 4.8, 70.4, 60.0), (24, 24), True, "torch"),
        _resample(img, (10.2, 4.8, 70.4, 60.0), (24, 24), True, "torch"),
    )


def test_the_resampler_is_fixed_when_the_pipeline_is_made():
    assert resolve_resampler() == "torch" and ImagePipeline().resampler == "torch"
    assert ImagePipeline(resampler="pillow").resampler == "pillow"
    with pytest.raises(ValueError, match="unknown resampler 'cubic'"):
        ImagePipeline(resampler="cubic")
    sample = {"image": _jpeg(smooth(np.random.default_rng(2), 200, 150)), "image_width": 200, "image_height": 150}
    threads = torch.get_num_threads()
    for name in ("torch", "pillow"):
        pipeline = ImagePipeline([RandomResizedCrop(64), HorizontalFlip()], resampler=name)
        a, b = pipeline(sample, np.random.default_rng(5)), pipeline(sample, np.random.default_rng(5))
        assert a["image"].shape == (64, 64, 3) and np.array_equal(a["image"], b["image"])
    assert torch.get_num_threads() == threads  # one image resamples on one thread; the process keeps its setting


def _jpeg(pixels: np.ndarray) -> bytes:
    import io

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
    return buf.getvalue()
