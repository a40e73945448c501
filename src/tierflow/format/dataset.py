"""Random access to a packed dataset: a sample is an index lookup and a slice of a mapped buffer.

`open_dataset(path)` gives `len()`, `ds[i]` (a dict of columns; token and other primitive
list columns as numpy views, no copy), iteration, and `ds.tokens(start, stop)` over the
concatenated token stream. Where shards come from is a `ShardSource`: by default the dataset
directory itself; the tier stack supplies decoded, memory-mapped files instead. Either way a
shard opens in O(its block list) and a row costs its block: read, verified (xxh3-64), decoded
on first use (docs/format.md, "Reading and verification").
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Iterator, Protocol, Sequence

import numpy as np
import pyarrow as pa

from tierflow.format.blocks import open_blocks
from tierflow.format.manifest import Manifest
from tierflow.format.shard import ShardInfo
from tierflow.format.table import BlockCache, LazyShardTable, ShardTable, _starts


class ShardSource(Protocol):
    """Supplies the blocks of a shard; the tier stack is one, a plain directory another."""

    def open_shard(self, index: int, info: ShardInfo) -> "ShardTable": ...


class DirectorySource:
    """Shards read straight from the dataset directory, block by block, each block verified on use.

    Opening a shard costs its block list (from the manifest); reading a row costs its block:
    read, checked against the block's xxh3-64, decoded. Uncompressed shards are memory-mapped
    and their verified blocks stay (a mapping costs address space, not memory: the page cache
    holds the bytes). Compressed blocks decode into memory, bounded by `max_decoded_bytes`
    across shards; a block that falls out is read, verified and decoded again when next used.
    Wrong bytes are never served, and no whole file is read to serve one sample.
    """

    def __init__(self, root: str | Path, max_decoded_bytes: int = 1 << 30, schema: pa.Schema | None = None) -> None:
        self.root = Path(root)
        self.max_decoded_bytes = max_decoded_bytes
        self.schema = schema
        self.cache = BlockCache(max_decoded_bytes)
        self._tables: dict[int, LazyShardTable] = {}
        self._lock = threading.Lock()
        self.opens = 0
        """Shard files opened so far (a count that stays at the shard count means no thrash)."""

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
        table = LazyShardTable(info.name, open_blocks(self.root / info.name, info), self.schema, self.cache)
        with self._lock:
            found = self._tables.get(index)
            if found is not None:
                return found
            self.opens += 1
            self._tables[index] = table
        return table


class Dataset:
    """A packed dataset opened for reading; thread-safe for concurrent readers."""

    def __init__(self, manifest: Manifest, source: ShardSource, columns: Sequence[str] | None = None,
                 location: str = "") -> None:
        self.manifest = manifest
        self.source = source
        self.location = location
        names = manifest.schema.names
        if columns is not None:
            unknown = [c for c in columns if c not in names]
            if unknown:
                raise KeyError(f"{location}: no column(s) {unknown}; the dataset has {names}")
        self.columns = list(columns) if columns is not None else list(names)
        self.sample_starts = np.concatenate(
            [[0], np.cumsum([s.samples for s in manifest.shards], dtype=np.int64)])
        self.token_starts = np.concatenate(
            [[0], np.cumsum([s.tokens for s in manifest.shards], dtype=np.int64)])
        self._block_token_starts: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return int(self.sample_starts[-1])

    def __repr__(self) -> str:
        return (f"Dataset({self.location!r}, samples={len(self)}, shards={len(self.manifest.shards)}, "
                f"columns={self.columns})")

    def locate(self, index: int) -> tuple[int, int]:
        """Global sample index -> (shard index, row in shard)."""
        if not 0 <= index < len(self):
            raise IndexError(f"{self.location}: sample {index} out of range [0, {len(self)})")
        s = int(np.searchsorted(self.sample_starts, index, side="right")) - 1
        return s, index - int(self.sample_starts[s])

    def shard(self, s: int) -> ShardTable:
        return self.source.open_shard(s, self.manifest.shards[s])

    def __getitem__(self, index: int) -> dict[str, Any]:
        if index < 0:
            index += len(self)
        s, row = self.locate(index)
        return self.shard(s).row(row, self.columns)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for s in range(len(self.manifest.shards)):
            table = self.shard(s)
            for row in range(table.num_rows):
                yield table.row(row, self.columns)

    @property
    def num_tokens(self) -> int:
        return int(self.token_starts[-1])

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the concatenated stream; a view when inside one block."""
        column = self.manifest.token_column
        if column is None:
            raise TypeError(f"{self.location}: not a token dataset (packed without --tokenizer)")
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"{self.location}: tokens [{start}, {stop}) outside [0, {self.num_tokens})")
        pieces = []
        pos = start
        while pos < stop:
            s = int(np.searchsorted(self.token_starts, pos, side="right")) - 1
            table = self.shard(s)
            block_starts = self.block_token_starts(s, table)
            local = pos - int(self.token_starts[s])
            b = int(np.searchsorted(block_starts, local, side="right")) - 1
            offsets, values = table.list_parts(b, column)
            begin = int(offsets[0]) + local - int(block_starts[b])
            take = min(stop - pos, int(block_starts[b + 1]) - local)
            pieces.append(values[begin:begin + take])
            pos += take
        if len(pieces) == 1:
            return pieces[0]
        if not pieces:
            return np.zeros(0, dtype=self.manifest.token_dtype or np.uint16)
        return np.concatenate(pieces)

    def block_token_starts(self, s: int, table: ShardTable | None = None) -> np.ndarray:
        """Token offsets of shard s's blocks within the shard (length blocks + 1).

        From the manifest when the pack recorded per-block token counts (nothing is read);
        otherwise every block's offsets are read once (older packs)."""
        starts = self._block_token_starts.get(s)
        if starts is None:
            info = self.manifest.shards[s]
            counts = [b.tokens for b in info.blocks]
            if not counts or None in counts or sum(counts) != info.tokens or min(counts) < 0:
                column = self.manifest.token_column
                table = table if table is not None else self.shard(s)
                counts = []
                for b in range(table.num_blocks):
                    offsets, _ = table.list_parts(b, column)
                    counts.append(int(offsets[-1] - offsets[0]))
            starts = _starts(counts)
            self._block_token_starts[s] = starts
        return starts


def open_dataset(path: str | Path, columns: Sequence[str] | None = None, manifest: Manifest | None = None) -> Dataset:
    """Open a packed dataset directory for random access by global sample index (`manifest`: the
    directory's manifest, already loaded)."""
    manifest = manifest if manifest is not None else Manifest.load(path)
    return Dataset(manifest, DirectorySource(path, schema=manifest.schema), columns=columns, location=str(path))
