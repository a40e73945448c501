"""tierflow: feed large-scale training from a data lake through storage tiers.

The package's folders are the stages of the data path: pack, format, tiers, order,
loader, telemetry.
"""

from tierflow.format.dataset import Dataset, open_dataset
from tierflow.format.manifest import Manifest
from tierflow.pack.packer import pack

__version__ = "0.1.0"
__all__ = ["Dataset", "Manifest", "open_dataset", "pack", "__version__"]
