"""A warm L1 for the loader benchmarks: every shard decoded once beforehand, memory-mapped and
opened once per process, so a benchmark measures the loader, not staging or verification."""

from __future__ import annotations

from pathlib import Path

import tierflow
from tierflow.format.table import ShardTable
from tierflow.format.shard import ShardInfo, decode_shard


class WarmL1Source:
    """A `ShardSource` over the decoded copies `warm_l1` made."""

    def __init__(self, decoded: Path) -> None:
        self.decoded = decoded
        self._open: dict[int, ShardTable] = {}

    def open_shard(self, index: int, info: ShardInfo) -> ShardTable:
        table = self._open.get(index)
        if table is None:
            table = self._open[index] = ShardTable.from_ipc_file(self.decoded / info.name, memory_map=True)
        return table


def warm_l1(path: str | Path) -> Path:
    """Decode every shard of the dataset at `path` into `l1/` beside it; returns that folder."""
    path = Path(path)
    decoded = path.parent / "l1"
    decoded.mkdir(exist_ok=True)
    for info in tierflow.Manifest.load(path).shards:
        decode_shard(path / info.name, decoded / info.name)
    return decoded
