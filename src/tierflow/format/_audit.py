"""The manifest's numbers against the shard bytes, for `tierflow verify`.

The shard hashes say the bytes are the packed ones; they say nothing about the manifest's counts
(rows and tokens per block, the token dtype), which a damaged or hostile manifest may get wrong
with every hash intact. Each block is decoded exactly as a reader would decode it (the same
checks, `LazyShardTable`), so what verify passes, a reader serves.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from tierflow.errors import ShardCorruptError, TierflowError
from tierflow.format.blocks import BlockBytes, open_blocks
from tierflow.format.manifest import Manifest
from tierflow.format.shard import ShardInfo
from tierflow.format.table import LazyShardTable


def audit_shard(path: str | Path, info: ShardInfo, manifest: Manifest) -> list[str]:
    """Every count of `info` the shard file at `path` disagrees with, as sentences naming the shard
    and block (call it on a file whose hashes verified: it decodes every block)."""
    try:
        blocks = open_blocks(path, info)
    except TierflowError as e:  # its message names the shard
        return [str(e)]
    except OSError as e:
        return [f"shard {info.name}: {e}"]
    return audit_blocks(blocks, info, manifest)


def audit_blocks(blocks: BlockBytes, info: ShardInfo, manifest: Manifest) -> list[str]:
    """`audit_shard` over any block source (a remote shard's ranged reads)."""
    table = LazyShardTable(info.name, blocks, manifest.schema)  # both only note what to check: no read yet
    if manifest.token_column is not None:
        table.expect_tokens(
            manifest.token_column, manifest.token_dtype, [b.tokens for b in info.blocks], manifest.eos_id
        )
    problems = []
    for b in range(table.num_blocks):
        try:
            table.block(b)
        except (TierflowError, OSError) as e:
            problems.append(str(e))
    if manifest.token_column is not None and not problems and all(b.tokens is None for b in info.blocks):
        got = sum(
            int(offsets[-1] - offsets[0])
            for offsets, _ in (table.list_parts(b, manifest.token_column) for b in range(table.num_blocks))
        )
        if got != info.tokens:
            problems.append(f"shard {info.name}: holds {got} tokens, the manifest says {info.tokens}")
    return problems


class StreamedAudit(BlockBytes):
    """Checks a shard's counts block by block as its verified blocks stream past
    (`ShardVerifier(on_block=audit.block)`); `problems` collects what disagrees."""

    def __init__(self, info: ShardInfo, manifest: Manifest) -> None:
        super().__init__(info.blocks, compressed=True, verified=True)
        self.max_decoded = info.decoded_bytes
        self._current: tuple[int, pa.Buffer] | None = None
        self.problems: list[str] = []
        self._table = LazyShardTable(info.name, self, manifest.schema)
        if manifest.token_column is not None:
            self._table.expect_tokens(
                manifest.token_column, manifest.token_dtype, [b.tokens for b in info.blocks], manifest.eos_id
            )

    def read(self, index: int, length: int | None = None) -> pa.Buffer:
        if self._current is None or self._current[0] != index:
            raise ShardCorruptError(f"shard {self._table.name}: block {index} read out of order")
        data = self._current[1]
        return data if length is None or length >= data.size else data.slice(0, length)

    def block(self, index: int, data: bytes) -> None:
        self._current = (index, pa.py_buffer(data))
        try:
            self._table.block(index)
        except (TierflowError, OSError) as e:
            self.problems.append(str(e))
        finally:
            self._table._evict(index)  # one decoded block held at a time


def audit_manifest(root: str | Path, manifest: Manifest) -> list[str]:
    """`audit_shard` over every shard of a local dataset."""
    root = Path(root)
    return [p for info in manifest.shards for p in audit_shard(root / info.name, info, manifest)]
