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


def write_letters(path: Path, docs: int, shortest: int, longest: int, seed: int) -> Path:
    """`docs` JSONL documents {"id": i, "text": random lowercase letters, shortest..longest-1 of them}."""
    import numpy as np

    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for i in range(docs):
            n = int(rng.integers(shortest, longest))
            f.write(
                json.dumps({"id": i, "text": (rng.integers(0, 26, n) + 97).astype(np.uint8).tobytes().decode()}) + "\n"
            )
    return path


def jpeg(w: int, h: int, seed: int) -> bytes:
    """A w x h JPEG of smooth random colour (a coarse field, upsampled)."""
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (max(2, h // 8), max(2, w // 8), 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(coarse).resize((w, h), Image.Resampling.BILINEAR).save(out, format="JPEG", quality=90)
    return out.getvalue()


def pack_pictures(root: Path, count: int = 48, **options) -> Path:
    """`count` JPEGs of 40-160 px a side with "picture i" captions under root/src, packed (one worker,
    `options` to pack) at root/packed; returns that directory."""
    import numpy as np

    src = root / "src"
    src.mkdir()
    rng = np.random.default_rng(0)
    for i in range(count):
        w, h = int(rng.integers(40, 160)), int(rng.integers(40, 160))
        (src / f"{i:03d}.jpg").write_bytes(jpeg(w, h, i))
        (src / f"{i:03d}.txt").write_text(f"picture {i}")
    tierflow.pack([src], root / "packed", workers=1, progress=False, **options)
    return root / "packed"


def pack_with_a_corrupt_jpeg(root: Path, count: int, w: int, h: int) -> Path:
    """`count` w x h JPEGs under root/src, the 7th with a sound header and a truncated body (pack
    accepts it; it fails to decode), packed at root/packed; returns that directory."""
    src = root / "src"
    src.mkdir()
    for i in range(count):
        data = jpeg(w, h, i)
        (src / f"{i:03d}.jpg").write_bytes(data[: len(data) // 2] if i == 7 else data)
    tierflow.pack([src], root / "packed", workers=1, progress=False)
    return root / "packed"
