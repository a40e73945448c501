"""Small packed datasets shared by tests in several folders."""

from __future__ import annotations

import json
from pathlib import Path

import tierflow


def pack_lorem(tmp: Path, docs: int) -> Path:
    """`docs` short JSONL documents ("00042 lorem ipsum ..."), packed with byte tokens into 256 KB
    shards at `tmp/ds`; returns that directory."""
    with open(tmp / "docs.jsonl", "w") as f:
        for i in range(docs):
            f.write(json.dumps({"text": f"{i:05d} " + "lorem ipsum " * (i % 23)}) + "\n")
    tierflow.pack([tmp / "docs.jsonl"], tmp / "ds", tokenizer="bytes", workers=1, target_shard_bytes=256 << 10)
    return tmp / "ds"
