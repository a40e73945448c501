"""tierflow.loader: the batches a training loop iterates, resumable, fed to the device (docs/loader.md)."""

from tierflow.loader.batching import Batcher, LengthBuckets, SampleContext, Samples, TokenWindows, bucket_shapes
from tierflow.loader.budget import TokenBudget
from tierflow.loader._collate import CarriedBatch
from tierflow.loader.cursor import Arrangement, LoaderCursor, Pending
from tierflow.loader.dataset import CursorError, TieredDataset, default_partitions
from tierflow.loader.images import AspectBuckets, ImageSamples
from tierflow.loader.loader import BatchOrderError, Loader
from tierflow.loader.meta import BatchMeta
from tierflow.loader.plan import Built, OrderStream, Selection
from tierflow.loader.open_loader import open_loader
from tierflow.loader.topology import WorldPosition

__all__ = [
    "Arrangement",
    "AspectBuckets",
    "BatchMeta",
    "BatchOrderError",
    "Batcher",
    "Built",
    "CarriedBatch",
    "CursorError",
    "ImageSamples",
    "LengthBuckets",
    "Loader",
    "LoaderCursor",
    "OrderStream",
    "Pending",
    "SampleContext",
    "Samples",
    "Selection",
    "TieredDataset",
    "TokenBudget",
    "TokenWindows",
    "WorldPosition",
    "bucket_shapes",
    "default_partitions",
    "open_loader",
]
