"""tierflow.transforms: decode and augment images in the loader's workers, replayably (docs/multimodal.md).

    pipeline = ImagePipeline([RandomResizedCrop(224), HorizontalFlip()], image="image", keep=["caption"])
    loader = tierflow.open_loader("packed", batch_size=64, transform=pipeline, num_workers=4)

Batches hold uint8 pixels (N, H, W, 3) and the captions; `normalize` makes floats on the device.
`ImagePipeline(..., cache=ResizedImages("/dev/shm/tf-resized", "4GB"))` crops from a tier of
decoded-and-resized images instead of decoding every time (a small hot dataset; resized.py).
"""

from tierflow.transforms.augment import (
    BUCKET_KEY,
    CenterCrop,
    Geometry,
    HorizontalFlip,
    ImagePipeline,
    RandomResizedCrop,
    ResizeToBucket,
    aspect_buckets,
    nearest_bucket,
    normalize,
)
from tierflow.transforms.decode import ImageDecodeError, available_decoders, decode, resolve_decoder
from tierflow.transforms.resized import ResizedImages

__all__ = [
    "BUCKET_KEY",
    "CenterCrop",
    "Geometry",
    "HorizontalFlip",
    "ImageDecodeError",
    "ImagePipeline",
    "RandomResizedCrop",
    "ResizeToBucket",
    "ResizedImages",
    "aspect_buckets",
    "available_decoders",
    "decode",
    "nearest_bucket",
    "normalize",
    "resolve_decoder",
]
