"""A mapped dataset's shards as a sequence of ShardInfo (format/metadata.py's `MappedManifest.shards`)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, overload

from tierflow.format.shard import ShardInfo

if TYPE_CHECKING:
    from tierflow.format.metadata import MetadataTables


class MappedShards(Sequence[ShardInfo]):
    """The shards of a mapped dataset as a sequence of ShardInfo, each made when asked for (and
    kept); len() is the header's. Iterating makes one per shard: O(shards), for tools, not starts."""

    def __init__(self, tables: MetadataTables) -> None:
        self.tables = tables
        self._made: dict[int, ShardInfo] = {}

    def __len__(self) -> int:
        return self.tables.num_shards

    @overload
    def __getitem__(self, index: int) -> ShardInfo: ...

    @overload
    def __getitem__(self, index: slice) -> list[ShardInfo]: ...

    def __getitem__(self, index: int | slice) -> ShardInfo | list[ShardInfo]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        index = int(index)
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"shard {index} out of range [0, {len(self)})")
        found = self._made.get(index)
        if found is None:
            found = self._made[index] = self.tables.shard(index)
        return found

    def __iter__(self) -> Iterator[ShardInfo]:
        self.tables.checksums()  # every name: the whole order checked once, not a search a shard
        for i in range(len(self)):
            yield self._made.get(i) or self.tables.shard(i, keep=False)  # a pass over every shard stays bounded

    def __repr__(self) -> str:
        return f"MappedShards({len(self)} shards, {len(self._made)} made)"
