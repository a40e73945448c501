"""A small JSONL lake and a shard-bytes snapshot, shared by the Ray and resume pack tests."""

from __future__ import annotations

import json
from pathlib import Path


def lake(tmp: Path, files: int = 3, rows: int = 1500, grow_at: int | None = None) -> list[Path]:
    """JSONL parts; from row `grow_at` on, records carry one more column (the schema grows mid-pack)."""
    paths = []
    for f in range(files):
        p = tmp / f"part-{f}.jsonl"
        with open(p, "w") as out:
            for i in range(rows):
                n = f * rows + i
                record = {"text": f"doc {n} " + "lorem ipsum " * (n % 37), "id": n}
                if grow_at is not None and n >= grow_at:
                    record["lang"] = "la"
                out.write(json.dumps(record) + "\n")
        paths.append(p)
    return paths


def shard_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("shard-*"))}
