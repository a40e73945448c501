"""tierflow: feed large-scale training from a data lake through storage tiers.

The package's folders are the stages of the data path: pack, format, tiers, order,
loader, telemetry.
"""

from tierflow.errors import TierflowError
from tierflow.format.dataset import Dataset
from tierflow.format.manifest import Manifest
from tierflow.pack.packer import pack
from tierflow.storage.datasets import open_dataset
from tierflow.tiers.config import TierConfig

__version__ = "0.1.0"


def __getattr__(name: str):
    """The loader's names import torch; they load on first use so `pack` and the CLI start fast."""
    if name in ("BatchSpec", "Loader", "MixedDataset", "OrderSpec", "TieredDataset", "open_loader"):
        from tierflow import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'tierflow' has no attribute {name!r}")


__all__ = [
    "BatchSpec",
    "Dataset",
    "Loader",
    "Manifest",
    "MixedDataset",
    "OrderSpec",
    "TierConfig",
    "TieredDataset",
    "TierflowError",
    "open_dataset",
    "open_loader",
    "pack",
    "__version__",
]
