"""tierflow.format: the open on-disk format (Arrow IPC shards + one JSON manifest) and reading it
by sample or token (docs/format.md). Depends on nothing else of tierflow but errors (and storage,
lazily, to open a URL)."""

from tierflow.errors import ManifestError, ShardCorruptError
from tierflow.format.dataset import Dataset, ShardSupply, open_directory
from tierflow.format.reader import DirectoryBlocks, ShardReader
from tierflow.format.index import DatasetIndex
from tierflow.format.manifest import Manifest
from tierflow.format.shard import Form, ShardInfo
from tierflow.format.verify import verify_shard

__all__ = [
    "Dataset",
    "DatasetIndex",
    "DirectoryBlocks",
    "Form",
    "Manifest",
    "ManifestError",
    "ShardCorruptError",
    "ShardInfo",
    "ShardReader",
    "ShardSupply",
    "open_directory",
    "verify_shard",
]
