"""The manifest's numbers against the shard bytes, for `tierflow verify`.

The shard hashes say the bytes are the packed ones; they say nothing about the manifest's counts
(rows and tokens per block, the token dtype), which a damaged or hostile manifest may get wrong
with every hash intact. Each block is decoded exactly as a reader would decode it (the same
checks, `LazyShardTable`), so what verify passes, a reader serves.
"""

from __future__ import annotations

from pathlib import Path

from tierflow.errors import TierflowError
from tierflow.format.blocks import open_blocks
from tierflow.format.manifest import Manifest
from tierflow.format.shard import ShardInfo
from tierflow.format.table import LazyShardTable


def audit_shard(path: str | Path, info: ShardInfo, manifest: Manifest) -> list[str]:
    """Every count of `info` the shard file at `path` disagrees with, as sentences naming the shard
    and block (call it on a file whose hashes verified: it decodes every block)."""
    try:
        table = LazyShardTable(info.name, open_blocks(path, info), manifest.schema)
        if manifest.token_column is not None:
            table.expect_tokens(manifest.token_column, manifest.token_dtype, [b.tokens for b in info.blocks])
    except (TierflowError, OSError) as e:
        return [f"shard {info.name}: {e}"]
    problems = []
    for b in range(table.num_blocks):
        try:
            table.block(b)
        except (TierflowError, OSError) as e:
            problems.append(str(e))
    if manifest.token_column is not None and not problems and all(b.tokens is None for b in info.blocks):
        got = sum(int(offsets[-1] - offsets[0]) for offsets, _ in
                  (table.list_parts(b, manifest.token_column) for b in range(table.num_blocks)))
        if got != info.tokens:
            problems.append(f"shard {info.name}: holds {got} tokens, the manifest says {info.tokens}")
    return problems


def audit_manifest(root: str | Path, manifest: Manifest) -> list[str]:
    """`audit_shard` over every shard of a local dataset."""
    root = Path(root)
    return [p for info in manifest.shards for p in audit_shard(root / info.name, info, manifest)]
