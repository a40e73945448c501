"""Random access to a packed dataset: a sample is an index lookup and a slice of a mapped buffer.

`open_dataset(path)` gives `len()`, `ds[i]` (a dict of columns; token and other primitive
list columns as numpy views, no copy), iteration, and `ds.tokens(start, stop)` over the
concatenated token stream. Where a sample or a token lives is `ds.index` (index.py); where
shards come from is a `ShardSupply`: without tiers a `ShardReader` (reader.py) of the dataset
directory or the object store; the tier stack supplies decoded, memory-mapped files instead. Either way a shard opens in O(its block list)
and a row costs its block: read, verified (xxh3-64), decoded on first use (docs/format.md,
"Reading and verification").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol
from collections.abc import Iterator, Sequence

import numpy as np

from tierflow.format.manifest import Manifest
from tierflow.format.reader import DirectoryBlocks, ShardReader
from tierflow.format.shard import ShardInfo, block_tokens
from tierflow.format.index import BlockTokenCounts, DatasetIndex
from tierflow.format.table import LazyShardTable, ShardTable


class ShardSupply(Protocol):
    """Supplies the blocks of a shard: the tier stack, or a `ShardReader` (a directory, an object store)."""

    def open_shard(self, index: int, info: ShardInfo) -> ShardTable: ...


class NoShards:
    """The shard supply of an index-only Dataset (a planning process's): opening a shard is a bug."""

    def __init__(self, location: str) -> None:
        self.location = location

    def open_shard(self, index: int, info: ShardInfo) -> ShardTable:
        raise RuntimeError(f"{self.location}: shard {index} opened in the planning process")


class Dataset:
    """A packed dataset opened for reading; thread-safe for concurrent readers.

    Where a sample or a token lives is `index`'s answer (built once, from the manifest); the
    bytes come from `source`, a shard at a time."""

    def __init__(
        self, manifest: Manifest, source: ShardSupply, columns: Sequence[str] | None = None, location: str = ""
    ) -> None:
        self.manifest = manifest
        self.source = source
        self.location = location
        names = manifest.schema.names
        if columns is not None:
            unknown = [c for c in columns if c not in names]
            if unknown:
                raise KeyError(f"{location}: no column(s) {unknown}; the dataset has {names}")
        self.columns = list(columns) if columns is not None else list(names)
        self._token_column = manifest.token_column
        self.index = _index(manifest, _block_token_reader(manifest, source))

    @property
    def sample_starts(self) -> np.ndarray:
        """Where each shard's samples start, length shards + 1."""
        return self.index.sample_starts

    @property
    def token_starts(self) -> np.ndarray:
        """Where each shard's tokens start in the concatenated stream, length shards + 1."""
        return self.index.token_starts

    def __len__(self) -> int:
        return self.index.num_samples

    def __repr__(self) -> str:
        return (
            f"Dataset({self.location!r}, samples={len(self)}, shards={len(self.manifest.shards)}, "
            f"columns={self.columns})"
        )

    def shard(self, s: int) -> ShardTable:
        """Shard `s` as a table; a lazy one checks its blocks' token counts against the manifest's."""
        info = self.manifest.shards[s]
        table = self.source.open_shard(s, info)
        if self._token_column is not None and isinstance(table, LazyShardTable) and table._tokens is None:
            table.expect_tokens(
                self._token_column, self.manifest.token_dtype, block_tokens(info.blocks), self.manifest.eos_id
            )
        return table

    def __getitem__(self, index: int) -> dict[str, Any]:
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"{self.location}: sample {index} out of range [0, {len(self)})")
        shard, block, row = self.index.locate_sample(index)
        table = self.shard(shard)
        return {name: table.getter(block, name)(row) for name in self.columns}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for s in range(len(self.manifest.shards)):
            table = self.shard(s)
            for b in range(table.num_blocks):
                getters = [(name, table.getter(b, name)) for name in self.columns]
                for row in range(table.block_rows(b)):
                    yield {name: get(row) for name, get in getters}

    @property
    def num_tokens(self) -> int:
        return self.index.num_tokens

    @property
    def token_column(self) -> str:
        """The list column holding the token stream (TypeError for a dataset packed without one)."""
        column = self.manifest.token_column
        if column is None:
            raise TypeError(f"{self.location}: not a token dataset (packed without a tokenizer)")
        return column

    def token_pieces(self, start: int, stop: int) -> Iterator[np.ndarray]:
        """Tokens [start, stop) of the concatenated stream as views, one per block they touch."""
        column = self.token_column
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"{self.location}: tokens [{start}, {stop}) outside [0, {self.num_tokens})")
        pos = start
        while pos < stop:
            shard, block, offset, left = self.index.locate_token(pos)
            take = min(stop - pos, left)
            yield self.shard(shard).list_values(block, column)[offset : offset + take]
            pos += take

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the concatenated stream; a view when inside one block."""
        pieces = list(self.token_pieces(start, stop))
        if len(pieces) == 1:
            return pieces[0]
        if not pieces:
            return np.zeros(0, dtype=self.manifest.token_dtype or np.uint16)
        return np.concatenate(pieces)


def _index(manifest: Manifest, read_block_tokens: BlockTokenCounts | None) -> Any:
    """The index of a manifest: over mapped metadata (version 3) nothing is made per shard."""
    from tierflow.format.metadata import MappedManifest
    from tierflow.format.metadata_index import MappedIndex

    if isinstance(manifest, MappedManifest):
        return MappedIndex(manifest, read_block_tokens)
    return DatasetIndex(manifest.shards, read_block_tokens)


def _block_token_reader(manifest: Manifest, source: ShardSupply) -> BlockTokenCounts | None:
    """How the index reads a shard's block token counts from its blocks' offsets (packs that did not
    record them); holds the source, not the dataset, so the two stay free of a reference cycle."""
    return _BlockTokens(manifest, source) if manifest.token_column is not None else None


class _BlockTokens:
    """A callable object, not a closure, so a Dataset pickles for spawn/forkserver workers."""

    def __init__(self, manifest: Manifest, source: ShardSupply) -> None:
        self.manifest = manifest
        self.source = source

    def __call__(self, s: int) -> list[int]:
        column = self.manifest.token_column
        assert column is not None  # made only for a dataset with a token column
        table = self.source.open_shard(s, self.manifest.shards[s])
        return [
            int(offsets[-1] - offsets[0])
            for offsets, _ in (table.list_parts(b, column) for b in range(table.num_blocks))
        ]


def open_directory(path: str | Path, columns: Sequence[str] | None = None, manifest: Manifest | None = None) -> Dataset:
    """Open a packed dataset directory for random access by global sample index (`manifest`: the
    directory's manifest, already loaded). `tierflow.open_dataset` takes URLs as well."""
    manifest = manifest if manifest is not None else Manifest.load(path)
    return Dataset(manifest, ShardReader(DirectoryBlocks(path), manifest.schema), columns=columns, location=str(path))
