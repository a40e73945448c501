"""tierflow.loader: the batches a training loop iterates, resumable, fed to the device (docs/loader.md)."""

from tierflow.loader.batching import Batcher, LengthBuckets, SampleContext, Samples, TokenWindows, bucket_shapes
from tierflow.loader.budget import TokenBudget
from tierflow.loader._collate import CarriedBatch
from tierflow.loader.cursor import Arrangement, LoaderCursor, Pending
from tierflow.errors import CursorError
from tierflow.loader.dataset import TieredDataset
from tierflow.loader.mixture import MixedDataset
from tierflow.loader.spec import BatchSpec, OrderSpec, default_partitions
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
    "BatchSpec",
    "Batcher",
    "Built",
    "CarriedBatch",
    "CursorError",
    "ImageSamples",
    "LengthBuckets",
    "Loader",
    "MixedDataset",
    "LoaderCursor",
    "OrderSpec",
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
