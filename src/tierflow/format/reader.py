"""One reader of a dataset's shards without tiers, whatever holds them.

`ShardReader` opens a shard as its block list and reads a row's block on first use: read,
checked against the block's xxh3-64, decoded (compressed blocks into memory, bounded by
`max_decoded_bytes` across shards; a block that falls out is read, verified and decoded again when
next used). Where the block bytes come from is its `BlockOpener`: `DirectoryBlocks` (a dataset
directory: uncompressed files memory-mapped, compressed ones read block by block) or the object
store's ranged reads (`storage.datasets.StoreBlocks`). So a dataset reads the same way whether it
is opened from a path or a URL; no whole file is read to serve one sample.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Protocol

import pyarrow as pa

from tierflow.format.blocks import BlockBytes, open_blocks
from tierflow.format.shard import ShardInfo
from tierflow.format.table import BlockCache, LazyShardTable, ShardTable


class BlockOpener(Protocol):
    """Where one shard's block bytes come from; picklable (a spawned worker unpickles it)."""

    def __call__(self, info: ShardInfo) -> BlockBytes: ...


class DirectoryBlocks:
    """A dataset directory's shard files: uncompressed ones mapped (a mapping costs address space, not
    memory: the page cache holds the bytes), compressed ones read block by block."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def __call__(self, info: ShardInfo) -> BlockBytes:
        return open_blocks(self.root / info.name, info)

    def __repr__(self) -> str:
        return f"DirectoryBlocks({str(self.root)!r})"


class ShardReader:
    """A `ShardSupply` reading block by block from `blocks`, each block verified on use; thread-safe.

    A shard's table (its block list) is kept once opened; its decoded blocks share one `BlockCache`
    of `max_decoded_bytes`. It pickles as its opener (the tables and decoded blocks are per process).
    """

    def __init__(self, blocks: BlockOpener, schema: pa.Schema | None = None, max_decoded_bytes: int = 1 << 30) -> None:
        self.blocks = blocks
        self.schema = schema
        self.max_decoded_bytes = max_decoded_bytes
        self.cache = BlockCache(max_decoded_bytes)
        self._tables: dict[int, LazyShardTable] = {}
        self._lock = threading.Lock()
        self.opens = 0
        """Shards opened so far (a count that stays at the shard count means no thrash)."""

    @property
    def blocks_read(self) -> int:
        """Blocks read, verified and decoded so far, over every shard."""
        with self._lock:
            tables = list(self._tables.values())
        return sum(t.blocks_loaded for t in tables)

    def open_shard(self, index: int, info: ShardInfo) -> ShardTable:
        table = self._tables.get(index)
        if table is not None:
            return table
        table = LazyShardTable(info.name, self.blocks(info), self.schema, self.cache)
        with self._lock:
            found = self._tables.get(index)
            if found is not None:
                return found
            self.opens += 1
            self._tables[index] = table
        return table

    def __reduce__(self) -> tuple[Any, ...]:
        return (ShardReader, (self.blocks, self.schema, self.max_decoded_bytes))

    def __repr__(self) -> str:
        return f"ShardReader({self.blocks!r})"


__all__ = ["BlockOpener", "DirectoryBlocks", "ShardReader"]
