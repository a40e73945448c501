"""tierflow.transforms in the loader (issue 16): decode + augment replays exactly on resume and
with any worker count; batches are uint8 NHWC plus captions; aspect buckets give one bounded
shape per batch; a corrupt JPEG is skipped and counted or raises naming shard, row and key."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import tierflow
from tierflow.loader import AspectBuckets, ImageSamples, Loader, TieredDataset, BatchSpec, OrderSpec
from tierflow.testing import assert_resumes_exactly
from tierflow.testing.resume import assert_same_batches, take
from tierflow.transforms import (
    CenterCrop,
    HorizontalFlip,
    ImageDecodeError,
    ImagePipeline,
    RandomResizedCrop,
    ResizeToBucket,
    aspect_buckets,
    available_decoders,
    normalize,
)

from corpora import pack_pictures, pack_with_a_corrupt_jpeg

SIDE = 32
COLUMNS = ["image", "image_width", "image_height", "caption", "path"]


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    return pack_pictures(tmp_path_factory.mktemp("images"), target_shard_bytes=256 << 10)


def pipeline(**kw) -> ImagePipeline:
    return ImagePipeline([RandomResizedCrop(SIDE), HorizontalFlip()], **kw)


PIPELINE = pipeline()


def make(packed: Path, transform=PIPELINE, batcher=None, batch_size: int = 8, epoch_end: str | None = None):
    def make_loader(workers: int) -> Loader:
        ds = TieredDataset(
            packed,
            BatchSpec(batch_size=batch_size, batcher=batcher or ImageSamples(select=COLUMNS), transform=transform),
            OrderSpec(seed=3),
        )
        return Loader(ds, num_workers=workers, **({"endless": True} if epoch_end is None else {"epoch_end": epoch_end}))

    return make_loader


def test_a_pipeline_is_a_pure_function_of_the_sample_and_its_rng(packed):
    sample = tierflow.open_dataset(packed)[5]
    for decoder in available_decoders():
        p = pipeline(decoder=decoder)
        a, b = p(sample, np.random.default_rng(9)), p(sample, np.random.default_rng(9))
        assert a["image"].dtype == np.uint8 and a["image"].shape == (SIDE, SIDE, 3)
        assert np.array_equal(a["image"], b["image"]) and a["caption"] == "picture 5"
    flipped = ImagePipeline([RandomResizedCrop(SIDE), HorizontalFlip(1.0)])(sample, np.random.default_rng(9))
    plain = ImagePipeline([RandomResizedCrop(SIDE), HorizontalFlip(0.0)])(sample, np.random.default_rng(9))
    assert np.array_equal(flipped["image"], plain["image"][:, ::-1])


def test_center_crop_of_the_whole_image_matches_a_plain_resize(packed):
    sample = tierflow.open_dataset(packed)[0]
    w, h = sample["image_width"], sample["image_height"]
    out = ImagePipeline([CenterCrop((h, w))], decoder="pillow")(sample, np.random.default_rng(0))["image"]
    assert np.array_equal(out, np.asarray(Image.open(io.BytesIO(sample["image"])).convert("RGB")))


def test_batches_are_uint8_nhwc_with_captions_and_normalise_on_the_device(packed):
    with make(packed)(0) as loader:
        batch = next(iter(loader))
    assert batch["image"].dtype == torch.uint8 and batch["image"].shape == (8, SIDE, SIDE, 3)
    assert len(batch["caption"]) == 8 and all(c.startswith("picture") for c in batch["caption"])
    x = normalize(batch["image"])
    assert x.dtype == torch.float32 and x.shape == (8, 3, SIDE, SIDE)


def test_captions_come_tokenised_beside_the_text_cut_to_fit_with_eos_kept(packed, tmp_path):
    with make(packed, pipeline(tokenizer="bytes", max_tokens=8))(0) as loader:
        batch = next(iter(loader))
    assert batch["caption_ids"].shape == (8, 8) and batch["caption_length"].shape == (8,)
    for text, ids, length in zip(batch["caption"], batch["caption_ids"].tolist(), batch["caption_length"].tolist()):
        assert length == 8 and ids == [*text.encode()[:7], 256]  # "picture N" is 9 bytes + EOS: cut
    sample = tierflow.open_dataset(packed)[5]
    short = pipeline(tokenizer="bytes", max_tokens=16)(sample, np.random.default_rng(0))
    assert short["caption_ids"].tolist() == [*b"picture 5", 256, 0, 0, 0, 0, 0, 0] and short["caption_length"] == 10

    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({"picture": 0, "5": 1, "</s>": 2, "[UNK]": 3}, unk_token="[UNK]")
    )
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = pipeline(tokenizer=str(tmp_path / "tokenizer.json"), max_tokens=4)(sample, np.random.default_rng(0))
    assert hf["caption_ids"].tolist() == [0, 1, 2, 0] and hf["caption_length"] == 3 and hf["caption"] == "picture 5"
    with pytest.raises(ValueError, match="max_tokens"):
        pipeline(tokenizer="bytes", max_tokens=0)


def test_augmentations_replay_exactly_on_resume(packed):
    assert_resumes_exactly(make(packed), stops=[1, 4], workers=0)


@pytest.mark.slow
def test_augmentations_are_the_same_with_two_workers_and_resume_there(packed):
    with make(packed)(0) as a, make(packed)(2) as b:
        assert_same_batches(take(a, 6), take(b, 6), "0 vs 2 workers")
    assert_resumes_exactly(make(packed), stops=[3], workers=2)


def test_aspect_buckets_give_each_batch_one_shape_from_the_bounded_set(packed):
    buckets = aspect_buckets(area=SIDE * SIDE, multiple=8, max_ratio=2.0, count=5)
    transform = ImagePipeline([ResizeToBucket(buckets), HorizontalFlip()])
    batcher = AspectBuckets(buckets, group=3, select=COLUMNS)
    shapes = set()
    with make(packed, transform, batcher)(0) as loader:
        for batch, meta in take(loader, 12):
            h, w = batch["image"].shape[1:3]
            assert (h, w) in buckets and meta.stats["bucket_height"] == h
            shapes.add((h, w))
    assert len(shapes) > 1
    assert_resumes_exactly(make(packed, transform, batcher), stops=[2, 4], workers=0)


@pytest.fixture(scope="module")
def corrupt(tmp_path_factory) -> Path:
    """A folder whose 7th JPEG has a sound header and a truncated body (pack accepts it)."""
    return pack_with_a_corrupt_jpeg(tmp_path_factory.mktemp("corrupt"), 16, 320, 240)


@pytest.mark.parametrize("decoder", available_decoders())
def test_a_corrupt_jpeg_is_skipped_and_counted_and_the_epoch_goes_on(corrupt, decoder):
    batcher = ImageSamples(select=COLUMNS, on_error="skip")
    with make(corrupt, pipeline(decoder=decoder), batcher=batcher, batch_size=4, epoch_end="rank")(0) as loader:
        sizes, skipped = [], 0
        for batch in loader:
            sizes.append(len(batch["caption"]))
            skipped += loader.last_meta.stats["corrupt"]
    assert skipped == 1 and sum(sizes) == 15 and sorted(sizes) == [3, 4, 4, 4]


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_a_corrupt_jpeg_raises_naming_shard_row_and_path(corrupt, workers):
    with make(corrupt, batch_size=4, epoch_end="rank")(workers) as loader:
        with pytest.raises(ImageDecodeError, match=r"shard 0 \(.*\) block \d+ row 7 .*path '007\.jpg'.*decode"):
            for _ in loader:
                pass


def test_a_decoded_array_cut_to_its_box_resizes_as_the_whole_image_does():
    """The pipeline copies only the crop box (and the filter's reach) of a decoded array into Pillow;
    the pixels are those of resizing the box of the whole image (rounding: at most 1 apart)."""
    from tierflow.transforms.augment import _resample

    rng = np.random.default_rng(0)
    for _ in range(50):
        h, w = int(rng.integers(20, 300)), int(rng.integers(20, 300))
        img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        bw, bh = rng.uniform(1, w), rng.uniform(1, h)
        x, y = rng.uniform(0, w - bw), rng.uniform(0, h - bh)
        out, flip = (int(rng.integers(4, 120)), int(rng.integers(4, 120))), bool(rng.random() < 0.5)
        whole = Image.fromarray(img).resize(out, Image.Resampling.BILINEAR, box=(x, y, x + bw, y + bh))
        expected = np.asarray(whole.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if flip else whole, dtype=np.int16)
        got = _resample(img, (x, y, x + bw, y + bh), out, flip)
        assert got.shape == (out[1], out[0], 3)
        assert np.abs(got.astype(np.int16) - expected).max() <= 1


@pytest.mark.slow
def test_an_image_batch_over_the_shared_memory_size_crosses_from_a_worker_intact():
    """A 64 x 224 x 224 x 3 batch (9.6 MB) travels as one tensor made in shared memory."""
    from torch.utils.data import DataLoader, IterableDataset

    from tierflow.loader._collate import SHARED_MEMORY_BYTES, CarriedBatch

    class Batches(IterableDataset):
        def __iter__(self):
            for i in range(3):
                pixels = np.random.default_rng(i).integers(0, 256, (64, 224, 224, 3), dtype=np.uint8)
                yield CarriedBatch({"image": pixels, "caption": [f"c{i}"] * 64}, {"i": i})

    assert 64 * 224 * 224 * 3 >= SHARED_MEMORY_BYTES
    for i, batch in enumerate(DataLoader(Batches(), batch_size=None, num_workers=1)):
        image = batch.data["image"]
        assert image.is_shared() and batch.meta == {"i": i} and batch.data["caption"] == [f"c{i}"] * 64
        expected = np.random.default_rng(i).integers(0, 256, (64, 224, 224, 3), dtype=np.uint8)
        assert np.array_equal(image.numpy(), expected)
