"""How many of a rank's batches hold samples of two epochs at each epoch edge (issue 39 item 1).

The order seen by positional batchers (Samples, TokenWindows, images' batchers): each rank batch
is one node micro-batch of the interleave. Counts, per configuration, the batches per rank and edge
that mix two epochs and the samples they carry over the edge (real samples, mask True).

`--loader` then runs a Loader for `--epochs` fors over the issue's corpora (4,000 documents of
varied length, 300 images in a few shards, packed in a temporary directory) under every batcher
(token windows, a token budget, length buckets, aspect buckets) and counts, per `for`, its
batches (and what len() said before it), those that mix two epochs, and those holding samples of
another epoch than the `for`'s.

    PYTHONPATH=src python benchmarks/epoch_edges.py [--epochs 3] [--loader]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from tierflow.order import RankStream, SampleOrder


def edge_counts(
    counts: list[int], *, lanes: int, remainder: str, ranks: int, batch_size: int, partitions: int, epochs: int
) -> tuple[int, int]:
    """(most mixed batches of one rank at one edge, most samples over one edge of one rank)."""
    order = SampleOrder(
        counts, dataset_id="edges", seed=3, partitions=partitions, window_shards=2, lanes=lanes, remainder=remainder
    )
    worst_batches = worst_samples = 0
    for rank in range(ranks):
        stream = RankStream(order, order.start(), batch_size=batch_size, rank=rank, ranks_per_node=ranks)
        mixed = [0] * epochs
        carried = [0] * epochs
        index = 0
        while True:
            batch = stream.batch(index)
            real = batch.epochs[batch.mask]
            low = int(real.min())
            if low >= epochs:
                break
            if int(real.max()) != low:
                mixed[low] += 1
                carried[low] += int((real != low).sum())
            index += 1
        worst_batches = max(worst_batches, max(mixed))
        worst_samples = max(worst_samples, max(carried))
    return worst_batches, worst_samples


def pack_docs(root: Path) -> Path:
    """4,000 documents of lognormal length (median ~1.8 K tokens), byte tokens, ~30 shards."""
    import tierflow

    rng = np.random.default_rng(3)
    lines = []
    for i in range(4000):
        n = min(int(rng.lognormal(7.5, 0.9)) + 5, 30000)
        lines.append(json.dumps({"id": i, "text": (rng.integers(0, 26, n) + 97).astype(np.uint8).tobytes().decode()}))
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    tierflow.pack([root / "docs.jsonl"], root / "docs", tokenizer="bytes", workers=1, target_shard_bytes=256 << 10)
    return root / "docs"


def pack_images(root: Path) -> Path:
    """300 noisy JPEGs of 60-240 px a side with captions, a few shards."""
    from PIL import Image

    import tierflow

    folder = root / "images"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(300):
        w, h = int(rng.integers(60, 240)), int(rng.integers(60, 240))
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(folder / f"{i:03d}.jpg", quality=70)
        (folder / f"{i:03d}.txt").write_text(f"picture {i}")
    tierflow.pack([folder], root / "pictures", workers=1, progress=False, target_shard_bytes=256 << 10)
    return root / "pictures"


def loader_fors(path: Path, spec, lanes: int, remainder: str, epochs: int) -> list[tuple[int, str, int, int]]:
    """Per `for`: (batches, len() before it or '-', batches mixing epochs, batches of another epoch)."""
    from tierflow.loader import Loader, OrderSpec, TieredDataset

    loader = Loader(TieredDataset(str(path), spec, OrderSpec(lanes=lanes, remainder=remainder)), return_meta=True)
    out = []
    for epoch in range(epochs):
        try:
            said = str(len(loader))
        except TypeError:
            said = "-"
        sets = [set(np.asarray(meta.epochs).tolist()) for _, meta in loader]
        out.append((len(sets), said, sum(len(s) > 1 for s in sets), sum(s != {epoch} for s in sets)))
    return out


def loader_table(epochs: int) -> None:
    from tierflow.loader import AspectBuckets, BatchSpec, LengthBuckets

    with tempfile.TemporaryDirectory() as tmp:
        docs, pictures = pack_docs(Path(tmp)), pack_images(Path(tmp))
        runs = {
            "windows (B 8, L 512)": (docs, BatchSpec(batch_size=8, seq_len=512)),
            "budget (B 8, 16384 tokens)": (docs, BatchSpec(batch_size=8, max_tokens=16384)),
            "budget (B 8, 4096 tokens)": (docs, BatchSpec(batch_size=8, max_tokens=4096)),
            "length buckets (B 6, group 8)": (
                docs,
                BatchSpec(batch_size=6, batcher=LengthBuckets(max_length=8192, column="tokens")),
            ),
            "aspect buckets (B 16, group 4)": (
                pictures,
                BatchSpec(batch_size=16, batcher=AspectBuckets(group=4, select=["caption"])),
            ),
        }
        print()
        print("batcher | lanes | remainder | per for: batches (len() said) | mixed | batches of another epoch")
        for name, (path, spec) in runs.items():
            for lanes in (1, 4):
                for remainder in ("carry", "drop"):
                    try:
                        fors = loader_fors(path, spec, lanes, remainder, epochs)
                    except ValueError as error:  # drop with partitions smaller than an order batch
                        print(f"{name} | {lanes} | {remainder} | refused: {error}")
                        continue
                    print(
                        f"{name} | {lanes} | {remainder} | "
                        + " ".join(f"{n} ({said})" for n, said, _, _ in fors)
                        + " | "
                        + " ".join(str(m) for _, _, m, _ in fors)
                        + " | "
                        + " ".join(str(o) for _, _, _, o in fors)
                    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--loader", action="store_true", help="also count per `for` over a Loader (packs corpora)")
    args = parser.parse_args()
    datasets = {
        "300 images (6 shards x 50)": [50] * 6,
        "300 images (20 shards x 15)": [15] * 20,
        "64 shards of 5-40": [int(c) for c in np.random.default_rng(5).integers(5, 41, size=64)],
    }
    print("dataset | lanes | remainder | ranks | mixed batches/rank/edge (max) | samples over the edge (max)")
    for name, counts in datasets.items():
        for lanes in (1, 2, 4, 16):
            for remainder in ("carry", "drop", "pad"):
                for ranks in (1, 2):
                    try:
                        batches, samples = edge_counts(
                            counts,
                            lanes=lanes,
                            remainder=remainder,
                            ranks=ranks,
                            batch_size=args.batch_size,
                            partitions=min(16, len(counts)),
                            epochs=args.epochs,
                        )
                    except ValueError as error:  # drop with partitions smaller than a batch
                        print(f"{name} | {lanes} | {remainder} | {ranks} | refused: {error}")
                        continue
                    print(f"{name} | {lanes} | {remainder} | {ranks} | {batches} | {samples}")
    if args.loader:
        loader_table(args.epochs)


if __name__ == "__main__":
    main()
