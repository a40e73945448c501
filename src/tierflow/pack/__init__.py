"""tierflow.pack: raw inputs (JSONL, Parquet, JSON, text and image folders, records) -> shards and a
manifest, on every core, byte-identical whatever the number of workers (docs/format.md)."""

from tierflow.errors import PackInputError
from tierflow.pack.packer import pack
from tierflow.pack.report import PackSummary

__all__ = ["PackInputError", "PackSummary", "pack"]
