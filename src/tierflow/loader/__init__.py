"""tierflow.loader: the batches a training loop iterates, resumable, fed to the device (docs/loader.md)."""

from tierflow.loader.batching import LengthBuckets, SampleContext, Samples, TokenWindows, bucket_shapes
from tierflow.loader.budget import TokenBudget
from tierflow.loader.dataset import CursorError, TieredDataset, default_partitions
from tierflow.loader.loader import BatchOrderError, Loader
from tierflow.loader.open_loader import open_loader
from tierflow.loader.topology import WorldPosition

__all__ = [
    "BatchOrderError",
    "CursorError",
    "LengthBuckets",
    "Loader",
    "SampleContext",
    "Samples",
    "TieredDataset",
    "TokenBudget",
    "TokenWindows",
    "WorldPosition",
    "bucket_shapes",
    "default_partitions",
    "open_loader",
]
