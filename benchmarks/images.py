"""Images end to end (issue 16): decoders, then decode + RandomResizedCrop(224) through the loader.

    python benchmarks/images.py [--images 3000] [--rounds 3] [--dir /tmp/tierflow-images]

1. Decoders: every installed decoder on the same JPEGs, full decode and DCT-downscaled for a
   224 crop (what the pipeline asks for), images/s, median of alternating rounds (min-max).
2. The corpus packed as tierflow shards and as WebDataset tars (when webdataset installs), then
   decode + RandomResizedCrop(224) + flip at 0 and 2 workers, warm (page cache), images/s.
3. Head-of-line blocking: per-batch build time p50 and p99 (in-process, 0 workers) on the
   long-tailed corpus, and the share of batches over 2x the median.

The corpus: generated JPEGs (smooth fields plus grain, so they compress like photographs) with
log-normal sizes, median about 100 KB and a long tail (a few multi-megapixel ones), each with a
caption sidecar. Generated once under --dir and reused.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tarfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import alternating, round_order, spread  # noqa: E402

BATCH = 64


def make_corpus(root: Path, count: int, seed: int = 0) -> Path:
    """`count` JPEGs with .txt captions under root/images (kept between runs)."""
    from PIL import Image

    folder = root / "images"
    if folder.is_dir() and len(list(folder.glob("*.jpg"))) >= count:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(count):
        side = float(np.clip(rng.lognormal(np.log(640), 0.35), 160, 3000))
        if rng.random() < 0.01:
            side *= 3  # the long tail: a few very large photographs
        aspect = float(np.exp(rng.uniform(np.log(0.6), np.log(1.8))))
        w, h = max(64, int(side * np.sqrt(aspect))), max(64, int(side / np.sqrt(aspect)))
        coarse = rng.integers(0, 256, (max(2, h // 48), max(2, w // 48), 3), dtype=np.uint8)
        img = Image.fromarray(coarse).resize((w, h), Image.Resampling.BICUBIC)
        pixels = np.asarray(img, dtype=np.int16) + rng.integers(-12, 13, (h, w, 3), dtype=np.int16)
        Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(folder / f"{i:06d}.jpg", quality=int(
            rng.integers(80, 95)))
        (folder / f"{i:06d}.txt").write_text(f"generated picture {i}, {w} by {h}")
    return folder


def corpus_sizes(folder: Path) -> str:
    sizes = np.array([p.stat().st_size for p in folder.glob("*.jpg")])
    return (f"{len(sizes)} JPEGs, {sizes.sum() / 1e6:.0f} MB, median {np.median(sizes) / 1e3:.0f} KB, "
            f"p99 {np.percentile(sizes, 99) / 1e3:.0f} KB, max {sizes.max() / 1e6:.1f} MB")


# ---------------------------------------------------------------- 1. decoders


def bench_decoders(folder: Path, rounds: int, limit: int = 300) -> list[tuple[str, str]]:
    """Each image decoded by every case back to back (the order alternating per image), so a drift in
    the machine's load touches every case alike; a round's rate is images / that case's summed time."""
    from tierflow.pack._media import probe
    from tierflow.transforms import available_decoders, decode
    from tierflow.transforms.decode import size_of

    blobs = [p.read_bytes() for p in sorted(folder.glob("*.jpg"))[:limit]]
    dims = [probe(b)[:2] for b in blobs]
    cases = [(name, scaled) for name in available_decoders() for scaled in (False, True)]
    rates: dict[tuple[str, bool], list[float]] = {c: [] for c in cases}
    for r in range(rounds):
        spent = dict.fromkeys(cases, 0.0)
        for k, (data, (w, h)) in enumerate(zip(blobs, dims)):
            for name, scaled in round_order(r + k, cases):
                # a 224 output from the whole image (RandomResizedCrop at scale 1): 224 px of the short side
                need = (max(1, w * 224 // min(w, h)), max(1, h * 224 // min(w, h))) if scaled else None
                start = time.perf_counter()
                size_of(decode(data, need, name))
                spent[(name, scaled)] += time.perf_counter() - start
        for case in cases:
            rates[case].append(len(blobs) / spent[case])
    return [(f"{name}{' (DCT-scaled for 224)' if scaled else ' (full)'}", spread(rates[(name, scaled)], ".0f"))
            for name, scaled in cases]


# ---------------------------------------------------------------- 2. loaders


def pack_tierflow(folder: Path, root: Path) -> Path:
    import tierflow

    out = root / "packed"
    if not (out / "manifest.json").exists():
        tierflow.pack([folder], out, progress=False)
    return out


def write_wds(folder: Path, root: Path, per_shard: int = 1000) -> Path:
    out = root / "wds"
    if out.is_dir() and any(out.glob("*.tar")):
        return out
    out.mkdir(parents=True, exist_ok=True)
    images = sorted(folder.glob("*.jpg"))
    for s in range(0, len(images), per_shard):
        with tarfile.open(out / f"shard-{s // per_shard:05d}.tar", "w") as tar:
            for p in images[s:s + per_shard]:
                tar.add(p, arcname=f"{p.stem}.jpg")
                tar.add(p.with_suffix(".txt"), arcname=f"{p.stem}.txt")
    return out


def tierflow_epoch(packed: Path, workers: int, limit: int) -> tuple[float, list[float]]:
    """images/s over `limit` images (after one warm-up batch) and per-batch wait times."""
    import tierflow
    from tierflow.transforms import HorizontalFlip, ImagePipeline, RandomResizedCrop

    pipeline = ImagePipeline([RandomResizedCrop(224), HorizontalFlip()])
    loader = tierflow.open_loader(packed, batch_size=BATCH, transform=pipeline, num_workers=workers, seed=1,
                                  endless=True, columns=["image", "image_width", "image_height", "caption"])
    return _drain(iter(loader), limit, loader.close)


def wds_epoch(tars: Path, workers: int, limit: int) -> tuple[float, list[float]]:
    import torch
    import webdataset as wds
    from tierflow.transforms import HorizontalFlip, ImagePipeline, RandomResizedCrop

    pipeline = ImagePipeline([RandomResizedCrop(224), HorizontalFlip()])
    rng = np.random.default_rng(1)

    def transform(sample: dict) -> dict:
        return pipeline({"image": sample["jpg"], "caption": sample["txt"]}, rng)

    urls = [str(p) for p in sorted(tars.glob("*.tar"))]
    ds = (wds.WebDataset(urls, shardshuffle=False, empty_check=False, nodesplitter=wds.split_by_node,
                         workersplitter=wds.split_by_worker)
          .shuffle(1000).map(transform).to_tuple("image", "caption").batched(BATCH))
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
    return _drain(iter(loader), limit, lambda: None)


def _drain(batches, limit: int, close) -> tuple[float, list[float]]:
    next(batches)  # warm: workers started, first shards mapped
    waits, seen = [], 0
    start = time.perf_counter()
    while seen < limit:
        t = time.perf_counter()
        try:
            batch = next(batches)
        except StopIteration:
            break
        waits.append(time.perf_counter() - t)
        seen += len(batch["image"] if isinstance(batch, dict) else batch[0])
    rate = seen / (time.perf_counter() - start)
    close()
    return rate, waits


# ---------------------------------------------------------------- 3. head-of-line blocking


def batch_build_times(packed: Path, batches: int) -> list[float]:
    """In-process build time of each batch (decode + RRC of BATCH images)."""
    import tierflow
    from tierflow.transforms import HorizontalFlip, ImagePipeline, RandomResizedCrop

    pipeline = ImagePipeline([RandomResizedCrop(224), HorizontalFlip()])
    loader = tierflow.open_loader(packed, batch_size=BATCH, transform=pipeline, num_workers=0, seed=2,
                                  endless=True, columns=["image", "image_width", "image_height", "caption"])
    times = []
    it = iter(loader)
    next(it)
    for _ in range(batches):
        t = time.perf_counter()
        try:
            next(it)
        except StopIteration:
            break
        times.append(time.perf_counter() - t)
    loader.close()
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "tierflow-images")
    parser.add_argument("--only", choices=("decoders", "loaders", "blocking"), default=None)
    args = parser.parse_args(argv)
    folder = make_corpus(args.dir, args.images)
    print(f"corpus: {corpus_sizes(folder)}")
    if args.only in (None, "decoders"):
        print("\n| decoder | images/s (1 core) |\n|---|---|")
        for name, rate in bench_decoders(folder, args.rounds):
            print(f"| {name} | {rate} |")
    packed = pack_tierflow(folder, args.dir)
    if args.only in (None, "loaders"):
        tars = None
        try:
            import webdataset  # noqa: F401
            tars = write_wds(folder, args.dir)
        except ImportError:
            print("webdataset not installed: tierflow only")
        limit = min(args.images - 2 * BATCH, 1280)
        cases = [("tierflow", w) for w in (0, 2)] + ([("webdataset", w) for w in (0, 2)] if tars else [])
        rates: dict[tuple[str, int], list[float]] = {c: [] for c in cases}
        for _, (name, workers) in alternating(args.rounds, cases):
            run = tierflow_epoch(packed, workers, limit) if name == "tierflow" else wds_epoch(tars, workers, limit)
            rates[(name, workers)].append(run[0])
        print("\n| loader (decode + RandomResizedCrop(224) + flip) | workers | images/s |\n|---|---|---|")
        for name, workers in cases:
            print(f"| {name} | {workers} | {spread(rates[(name, workers)], '.0f')} |")
    if args.only in (None, "blocking"):
        times = batch_build_times(packed, max(10, min(40, args.images // BATCH - 2)))
        p50, p99 = statistics.median(times), float(np.percentile(times, 99))
        slow = sum(t > 2 * p50 for t in times)
        print(f"\nbatch build ({BATCH} images, 0 workers, {len(times)} batches): p50 {p50 * 1e3:.0f} ms, "
              f"p99 {p99 * 1e3:.0f} ms (p99/p50 {p99 / p50:.2f}), {slow} batches over 2x p50")


if __name__ == "__main__":
    main()
