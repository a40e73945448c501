"""A small corpus packed at the defaults still gives every partition (and so every rank) shards of its own."""

from __future__ import annotations

import json
from pathlib import Path

import tierflow
from tierflow.loader.spec import default_partitions
from tierflow.pack.packer import DEFAULT_SHARD_BYTES, SMALL_CORPUS_SHARDS, default_shard_bytes


def test_the_default_shard_size_cuts_a_small_corpus_into_several_shards(tmp_path: Path) -> None:
    src = tmp_path / "docs.jsonl"
    with src.open("w") as f:
        for i in range(6_000):
            f.write(json.dumps({"text": f"document {i} " + "lorem ipsum dolor " * 30}) + "\n")
    input_bytes = src.stat().st_size
    assert 3 << 20 < input_bytes < DEFAULT_SHARD_BYTES  # one shard at 256 MB: one rank would hold it all
    summary = tierflow.pack([src], tmp_path / "ds", workers=1)
    shards = summary.manifest.shards
    assert len(shards) >= 3
    assert sum(s.samples for s in shards) == 6_000
    assert default_partitions(len(shards)) >= 2  # the order deals them to more than one rank


def test_the_small_corpus_rule() -> None:
    assert default_shard_bytes(None) == DEFAULT_SHARD_BYTES  # records from an iterable are not counted ahead
    assert default_shard_bytes(100 << 30) == DEFAULT_SHARD_BYTES
    assert default_shard_bytes(56 << 20) == 1 << 20  # 56 MB: 56 shards, not one
    assert default_shard_bytes(640 << 20) == 10 << 20
    assert default_shard_bytes(SMALL_CORPUS_SHARDS * DEFAULT_SHARD_BYTES) == DEFAULT_SHARD_BYTES
