"""Shared by the checkpoint tests: a small token dataset and a batch fingerprint."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch

import tierflow


def make_token_dataset(root: Path, docs: int = 600, seed: int = 7, shard_bytes: int = 256 << 10) -> Path:
    """A JSONL of random words packed with the bytes tokenizer into ~256 KB shards."""
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "tier", "flow", "shard", "cursor", "batch", "node"]
    raw = root / "docs.jsonl"
    with open(raw, "w") as f:
        for i in range(docs):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(20, 200)))
            f.write(json.dumps({"text": f"{i} {text}"}) + "\n")
    out = root / "packed"
    tierflow.pack([raw], out, tokenizer="bytes", target_shard_bytes=shard_bytes, workers=1)
    return out


def inputs(batch: dict[str, Any]) -> torch.Tensor:
    """The model's input tensor of a batch (what an exact resume must reproduce)."""
    for name in ("input_ids", "tokens"):
        if name in batch:
            return batch[name].clone()
    tensors = [v for v in batch.values() if isinstance(v, torch.Tensor)]
    return tensors[0].clone()


def make_letter_dataset(root: Path, docs: int = 12000, seed: int = 1) -> Path:
    """~47 shards of random letters (little compression), for tests that count shard reads."""
    import string

    rng = random.Random(seed)
    raw = root / "letters.jsonl"
    with open(raw, "w") as f:
        for _ in range(docs):
            f.write(json.dumps({"text": "".join(rng.choices(string.ascii_letters, k=rng.randint(100, 900)))}) + "\n")
    out = root / "letters"
    tierflow.pack([raw], out, tokenizer="bytes", target_shard_bytes=256 << 10, workers=1)
    return out
