"""tierflow.storage: where bytes at rest come from and go to (local paths, s3://, fsspec URLs),
under a node's bandwidth budget. Below both `pack` (which writes) and `tiers` (which read)."""

from tierflow.storage.budget import BandwidthBudget, Priority
from tierflow.storage.datasets import open_dataset
from tierflow.storage.remote import SourceError, SourceNotFound, open_store, upload_dataset

__all__ = [
    "BandwidthBudget",
    "Priority",
    "SourceError",
    "SourceNotFound",
    "open_dataset",
    "open_store",
    "upload_dataset",
]
