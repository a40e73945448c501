"""Images end to end (issue 16): decoders, loaders side by side, S3, the cached form, head-of-line blocking.

    PYTHONPATH=src /work/main/.venv-peers/bin/python benchmarks/images.py --images 20000 --dir /tmp/tierflow-images-20k
    ... --only loaders|s3|cached-form|hot|blocking|decoders      one section
    ... --before /tmp/before/src --only loaders               tierflow at another checkout against this one
    ... --before /tmp/before/src --only hot                   the same on the hot dataset

(the peers' venv has litdata and webdataset; `git archive COMMIT src | tar -x -C /tmp/before` makes a
before.) Every rate is the median of --rounds alternating rounds (min-max); beside images/s, the CPU
ms per image of the whole process tree (main + DataLoader workers), which a loaded machine changes
far less than it changes images/s.

1. Decoders: every installed decoder on the same JPEGs, full decode and DCT-downscaled for a
   224 crop (what the pipeline asks for), images/s, median of alternating rounds (min-max).
2. Loaders, warm (page cache): the corpus as tierflow shards (pack's defaults), WebDataset tars
   (1000 images each) and LitData chunks (optimize(), 64 MB), each decoded + RandomResizedCrop(224)
   + flip by the same ImagePipeline and decoder (the peers' samples carry no size: their pipeline
   reads it from the JPEG header), at 0 and 2 DataLoader workers; target tierflow >= 1.2 x the
   better peer at 2 workers.
3. From S3 (moto behind the throttling ProxyProcess, tierflow.testing) on the first --s3-images
   images in --s3-shard-mb shards: the cold first epoch at 2 workers through an empty L2 (the default
   order, then the tuned one of TUNED_ORDER beside it), the proxy
   throttled to a quarter of what the warm loop consumes (target >= 0.9 x the throttle); bytes per
   epoch with an L2 of 30% of the dataset, 3 epochs (target <= 0.75 x the dataset per warm epoch).
4. The cached form: per image, an L1 of encoded bytes (decode every time) against one of pixels
   decoded once and resized (short side 256, or full size), for --hot-images images.
5. Head-of-line blocking: per-batch build time p50 and p99 (in-process, 0 workers) on the
   long-tailed corpus, and the share of batches over 2x the median.
6. The hot rows: the first --hot-images images packed alone (pack's default shard size), warm, at
   0 and 2 workers: tierflow's default (decode the encoded bytes every time) first, then the tuned
   row, ImagePipeline(cache=ResizedImages(--cache-dir, short side 256)) filled by one epoch before
   the rounds (each run opens it afresh, as a new job would), and the peers on the same images.
   `--only loaders --resized` adds the same tuned row to section 2 (a cache of the whole corpus).

The corpus: generated JPEGs (smooth fields plus grain, so they compress like photographs) with
log-normal sizes, median about 100 KB and a long tail (a few multi-megapixel ones), each with a
caption sidecar. Generated once under --dir and reused (each image from its own seed, so a larger
--images adds to it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from collections.abc import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import alternating, round_order, spread, tree_cpu_s

BATCH = 64


def make_corpus(root: Path, count: int, seed: int = 0) -> Path:
    """`count` JPEGs with .txt captions under root/images; image i comes from its own seed, so a
    larger --images adds to the corpus already there instead of rewriting it."""
    from PIL import Image

    folder = root / "images"
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        path = folder / f"{i:06d}.jpg"
        if path.exists() and path.with_suffix(".txt").exists():
            continue
        rng = np.random.default_rng([seed, i])
        side = float(np.clip(rng.lognormal(np.log(640), 0.35), 160, 3000))
        if rng.random() < 0.01:
            side *= 3  # the long tail: a few very large photographs
        aspect = float(np.exp(rng.uniform(np.log(0.6), np.log(1.8))))
        w, h = max(64, int(side * np.sqrt(aspect))), max(64, int(side / np.sqrt(aspect)))
        coarse = rng.integers(0, 256, (max(2, h // 48), max(2, w // 48), 3), dtype=np.uint8)
        img = Image.fromarray(coarse).resize((w, h), Image.Resampling.BICUBIC)
        pixels = np.asarray(img, dtype=np.int16) + rng.integers(-12, 13, (h, w, 3), dtype=np.int16)
        tmp = path.with_suffix(".part")
        Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(
            tmp, format="JPEG", quality=int(rng.integers(80, 95))
        )
        path.with_suffix(".txt").write_text(f"generated picture {i}, {w} by {h}")
        tmp.rename(path)
    return folder


def corpus_sizes(folder: Path) -> str:
    sizes = np.array([p.stat().st_size for p in folder.glob("*.jpg")])
    return (
        f"{len(sizes)} JPEGs, {sizes.sum() / 1e6:.0f} MB, median {np.median(sizes) / 1e3:.0f} KB, "
        f"p99 {np.percentile(sizes, 99) / 1e3:.0f} KB, max {sizes.max() / 1e6:.1f} MB"
    )


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
    return [
        (f"{name}{' (DCT-scaled for 224)' if scaled else ' (full)'}", spread(rates[(name, scaled)], ".0f"))
        for name, scaled in cases
    ]


# ---------------------------------------------------------------- 2. loaders


def pack_tierflow(folder: Path, root: Path, name: str = "packed") -> Path:
    import tierflow

    out = root / name
    if not (out / "manifest.json").exists():
        tierflow.pack([folder], out, progress=False)
    return out


def write_wds(folder: Path, root: Path) -> Path:
    """Tars of 1000 images each, or of a tenth of a smaller corpus (so 2 workers each get shards)."""
    out = root / "wds"
    if out.is_dir() and any(out.glob("*.tar")):
        return out
    out.mkdir(parents=True, exist_ok=True)
    images = sorted(folder.glob("*.jpg"))
    per_shard = max(1, min(1000, len(images) // 10))
    for s in range(0, len(images), per_shard):
        with tarfile.open(out / f"shard-{s // per_shard:05d}.tar", "w") as tar:
            for p in images[s : s + per_shard]:
                tar.add(p, arcname=f"{p.stem}.jpg")
                tar.add(p.with_suffix(".txt"), arcname=f"{p.stem}.txt")
    return out


def tierflow_epoch(packed: Path, workers: int, limit: int, cache=None) -> tuple[float, float]:
    """images/s over `limit` images (after one warm-up batch) and CPU ms per image; `cache`: the
    pipeline's ResizedImages (crops from the cached resized form)."""
    import tierflow
    from tierflow.transforms import HorizontalFlip, ImagePipeline, RandomResizedCrop

    pipeline = ImagePipeline([RandomResizedCrop(224), HorizontalFlip()], cache=cache)
    loader = tierflow.open_loader(
        packed,
        batch_size=BATCH,
        transform=pipeline,
        num_workers=workers,
        seed=1,
        endless=True,
        columns=["image", "image_width", "image_height", "caption"],
    )
    return _drain(iter(loader), limit, loader.close)


def wds_epoch(tars: Path, workers: int, limit: int) -> tuple[float, float]:
    import torch
    import webdataset as wds

    urls = [str(p) for p in sorted(tars.glob("*.tar"))]
    ds = (
        wds.WebDataset(
            urls,
            shardshuffle=False,
            empty_check=False,
            nodesplitter=wds.split_by_node,
            workersplitter=wds.split_by_worker,
        )
        .shuffle(1000)
        .map(_PeerTransform("jpg", "txt"))
        .to_tuple("image", "caption")
        .batched(BATCH)
    )
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
    return _drain(iter(loader), limit, lambda: None)


class _LitDataItem:
    """optimize()'s fn: one image file -> its bytes (LitData's bytes serializer) and its caption."""

    def __call__(self, path: str) -> dict:
        p = Path(path)
        return {"image": p.read_bytes(), "caption": p.with_suffix(".txt").read_text()}


def write_litdata(folder: Path, root: Path) -> Path:
    """LitData chunks by its own writer, `optimize()` with its defaults and chunk_bytes="64MB" (it
    needs a chunk size; its README's figure), in a spawned child: optimize() leaves threads behind,
    and DataLoader workers forked from a process that has them die at exit ("terminate called
    without an active exception", tierflow's and the peers' alike)."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    out = root / "litdata"
    if (out / "index.json").exists():
        return out
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        pool.submit(_optimize, [str(p) for p in sorted(folder.glob("*.jpg"))], str(out)).result()
    return out


def _optimize(inputs: list[str], out: str) -> None:
    from litdata import optimize

    optimize(
        fn=_LitDataItem(),
        inputs=inputs,
        output_dir=out,
        num_workers=1,
        verbose=False,
        mode="overwrite",
        chunk_bytes="64MB",
    )


class _PeerTransform:
    """The same ImagePipeline (decoder, RandomResizedCrop(224), flip) on a peer's sample; the size is
    read from the JPEG header, as the peers store none."""

    def __init__(self, image: str, caption: str) -> None:
        from tierflow.transforms import HorizontalFlip, ImagePipeline, RandomResizedCrop

        self.pipeline = ImagePipeline([RandomResizedCrop(224), HorizontalFlip()])
        self.rng = np.random.default_rng(1)
        self.image, self.caption = image, caption

    def __call__(self, sample: dict) -> dict:
        return self.pipeline({"image": sample[self.image], "caption": sample[self.caption]}, self.rng)


def litdata_epoch(chunks: Path, workers: int, limit: int) -> tuple[float, float]:
    from litdata import StreamingDataLoader, StreamingDataset

    ds = StreamingDataset(str(chunks), shuffle=True, seed=1, transform=_PeerTransform("image", "caption"))
    loader = StreamingDataLoader(ds, batch_size=BATCH, num_workers=workers)
    return _drain(iter(loader), limit, lambda: None)


def _drain(batches, limit: int, close) -> tuple[float, float]:
    """(images/s, CPU ms per image of the whole process tree) over `limit` images after a first batch."""
    next(batches)  # warm: workers started, first shards mapped
    seen = 0
    start, cpu = time.perf_counter(), tree_cpu_s()
    while seen < limit:
        try:
            batch = next(batches)
        except StopIteration:
            break
        seen += len(batch["image"] if isinstance(batch, dict) else batch[0])
    rate, cpu_ms = seen / (time.perf_counter() - start), (tree_cpu_s() - cpu) * 1e3 / seen
    close()
    return rate, cpu_ms


# ---------------------------------------------------------------- 4. from S3: cold epoch, bytes per epoch


def pack_subset(folder: Path, root: Path, count: int, shard_bytes: int) -> Path:
    """The first `count` images (hard links) packed into shards of `shard_bytes`, for the S3 rows."""
    import tierflow

    out = root / f"packed-{count}-{shard_bytes >> 20}mb"
    if (out / "manifest.json").exists():
        return out
    subset = root / f"subset-{count}"
    subset.mkdir(exist_ok=True)
    for p in sorted(folder.glob("*.jpg"))[:count]:
        for f in (p, p.with_suffix(".txt")):
            if not (subset / f.name).exists():
                os.link(f, subset / f.name)
    tierflow.pack([subset], out, progress=False, target_shard_bytes=shard_bytes)
    return out


TUNED_ORDER = {"partitions": 4, "window_shards": 2}
"""The cold row's tuned order (benchmarks/loader.py's): 4 lanes x 2 shards read at a time in every epoch.
The default reads the widest breadth (an L2 that holds the dataset) from epoch 1 on, and epoch 0 a
few shards at a time (working_set.FIRST_EPOCH_SHARE), so both first need shards all through the
epoch; read as wide from epoch 0 (narrow_first_epoch=False) it opened nearly every shard in its
first batches and decoded the rest of the epoch after the last arrived (0.82 x the throttle)."""


def s3_epochs(
    url: str,
    proxy,
    tier_dir: Path,
    capacity: int,
    epochs: int,
    workers: int,
    transform: bool,
    order: dict | None = None,
) -> list[tuple[float, int, float]]:
    """(wall s, bytes the proxy sent, seconds the proxy was sending) of each epoch through one L2 of
    `capacity` (stager on, defaults); the first epoch's wall includes the loader's start."""
    import shutil

    import tierflow
    from loader import SourceActivity
    from tierflow.transforms import HorizontalFlip, ImagePipeline, RandomResizedCrop

    shutil.rmtree(tier_dir, ignore_errors=True)
    options = (
        dict(
            transform=ImagePipeline([RandomResizedCrop(224), HorizontalFlip()]),
            columns=["image", "image_width", "image_height", "caption"],
        )
        if transform
        else dict(columns=["image"])
    )
    out = []
    loader = None
    try:
        for _ in range(epochs):
            proxy.reset_counters()
            with SourceActivity(proxy) as activity:
                started = time.perf_counter()
                if loader is None:
                    loader = tierflow.open_loader(
                        url,
                        tiers=[f"L2={tier_dir}:{capacity}"],
                        endpoint_url=proxy.url,
                        batch_size=BATCH,
                        num_workers=workers,
                        seed=3,
                        **options,
                        **(order or {}),
                    )
                for _batch in loader:
                    pass
                wall = time.perf_counter() - started
            out.append((wall, proxy.traffic().response_bytes("GET"), activity.active_s))
    finally:
        if loader is not None:
            loader.close()
    return out


def l2_alone(shards: list, capacity: int) -> float:
    """Bytes a reshuffled epoch fetches, / the dataset, when an L2 of `capacity` keeps whole shards for
    good (the largest that fit) and nothing else helps: with a few dozen shards this, not 1 - 30%, is
    its floor (the RAM staging area serves a shard again at an epoch edge, so an epoch can go below)."""
    kept = 0
    for size in sorted((s.bytes for s in shards), reverse=True):
        if kept + size <= capacity:
            kept += size
    total = sum(s.bytes for s in shards)
    return (total - kept) / total


def s3_rows(packed: Path, work: Path, warm_rate: float) -> None:
    """Cold first epoch (2 workers, decode + crop) from a proxy throttled to a quarter of what the warm
    loop consumes, against the throttle; then bytes per epoch with an L2 of 30% of the dataset."""
    import tierflow
    from _harness import s3_rig

    shards = tierflow.Manifest.load(packed).shards
    at_rest, decoded = sum(s.bytes for s in shards), sum(s.decoded_bytes for s in shards)
    samples = sum(s.samples for s in shards)
    with s3_rig("images") as rig:
        url = rig.upload(packed, "images")
        consumption = warm_rate * at_rest / samples
        throttle = consumption / 4  # well below the loop: a shared machine's load moves its rate 2-3x
        rig.proxy.set_bandwidth(throttle)
        print(
            f"\nfrom S3 (moto behind the throttling proxy): {len(shards)} shards, {samples} images, "
            f"{at_rest / 1e6:.0f} MB at rest, {decoded / 1e6:.0f} MB decoded"
        )
        for name, order in (("default order", None), (f"tuned order {TUNED_ORDER}", TUNED_ORDER)):
            ((wall, sent, active),) = s3_epochs(url, rig.proxy, work / "l2-cold", 4 * at_rest, 1, 2, True, order)
            achieved = sent / wall
            print(
                f"cold first epoch, {name}, 2 workers, decode + RandomResizedCrop(224), empty L2, throttle "
                f"{throttle / 1e6:.1f} MB/s (a quarter of the warm loop's {consumption / 1e6:.1f} MB/s): {wall:.1f} s, "
                f"{sent / 1e6:.0f} MB sent, achieved {achieved / 1e6:.1f} MB/s = {achieved / throttle:.2f} x throttle "
                f"(target >= 0.9: {'met' if achieved >= 0.9 * throttle else 'MISSED'}); while the source was "
                f"sending ({active:.1f} s of it, sampled every 0.25 s): {sent / active / 1e6:.1f} MB/s = "
                f"{sent / active / throttle:.2f} x throttle"
            )
        rig.proxy.set_bandwidth(None)
        capacity = int(0.3 * decoded)
        epochs = s3_epochs(url, rig.proxy, work / "l2-30", capacity, 3, 0, False)
        ratios = [sent / at_rest for _, sent, _ in epochs]
        warm = max(ratios[1:])
        print(
            f"bytes per epoch / dataset at rest, L2 = 30% of the dataset ({capacity / 1e6:.0f} MB), 0 workers, "
            f"no decode, epochs 1-3: {' '.join(f'{r:.2f}' for r in ratios)}, warm mean "
            f"{statistics.mean(ratios[1:]):.2f}, the L2 alone keeping whole shards {l2_alone(shards, capacity):.2f} "
            f"(target <= 0.75 per warm epoch: {'met' if warm <= 0.75 else 'MISSED'}; "
            f"an epoch's bytes are the proxy's between its edges: a transfer the stager began before an "
            f"edge counts where its bytes flowed, so epochs differ by up to a shard, 0.04, that the mean does not)"
        )


# ---------------------------------------------------------------- 5. the cached form (L1)


def cached_forms(
    folder: Path, count: int, rounds: int, short_sides: tuple[int, ...] = (256, 0)
) -> list[tuple[str, str, str, float]]:
    """Per image, what an L1 of each form costs to serve one decoded + RandomResizedCrop(224) + flip
    sample: the encoded bytes (decode every time, DCT-scaled), or pixels decoded once and resized to
    a short side (0: full size) held as uint8 in RAM (only the crop and resize left). Rows: (form,
    CPU ms per image, images/s on one core, bytes per image in L1). Every image is served by every
    form back to back, the order alternating per image."""
    from tierflow.transforms import HorizontalFlip, ImagePipeline, RandomResizedCrop, decode
    from tierflow.transforms.augment import _resample
    from tierflow.transforms.decode import to_array
    from PIL import Image

    pipeline = ImagePipeline([RandomResizedCrop(224), HorizontalFlip()])
    paths = sorted(folder.glob("*.jpg"))[:count]
    encoded = [p.read_bytes() for p in paths]
    from tierflow.pack._media import probe

    sizes = [probe(b)[:2] for b in encoded]
    forms: dict[str, list] = {"encoded bytes": encoded}
    for side in short_sides:
        arrays = []
        for data, (w, h) in zip(encoded, sizes):
            pixels = to_array(decode(data))
            if side:
                scale = side / min(w, h)
                pixels = to_array(
                    Image.fromarray(pixels).resize(
                        (max(1, round(w * scale)), max(1, round(h * scale))),
                        Image.Resampling.BILINEAR,
                        reducing_gap=None,
                    )
                )
            arrays.append(pixels)
        forms[f"decoded, short side {side}" if side else "decoded, full size"] = arrays
    names = list(forms)
    spent = {n: [] for n in names}
    for r in range(rounds):
        used = dict.fromkeys(names, 0.0)
        for k in range(len(paths)):
            for name in round_order(r + k, names):
                value = forms[name][k]
                rng = np.random.default_rng([r, k])
                start = time.process_time()
                if isinstance(value, bytes):
                    w, h = sizes[k]
                    pipeline({"image": value, "image_width": w, "image_height": h}, rng)
                else:
                    g, _, _ = pipeline.geometry({"image_width": value.shape[1], "image_height": value.shape[0]}, rng)
                    _resample(value, g.box, g.out, g.flip, pipeline.resampler)
                used[name] += time.process_time() - start
        for name in names:
            spent[name].append(used[name] / len(paths))
    rows = []
    for name in names:
        per_image = sum(len(v) if isinstance(v, bytes) else v.nbytes for v in forms[name]) / len(paths)
        rows.append((name, spread(spent[name], ".2f", 1e3), spread([1 / t for t in spent[name]], ".0f"), per_image))
    return rows


# ---------------------------------------------------------------- 3. head-of-line blocking


def batch_build_times(packed: Path, batches: int) -> tuple[list[float], list[float]]:
    """In-process build time of each batch (decode + RRC of BATCH images): wall, and this process's
    CPU (which a loaded machine stretches less: a tail there is the images', not the machine's)."""
    import tierflow
    from tierflow.transforms import HorizontalFlip, ImagePipeline, RandomResizedCrop

    pipeline = ImagePipeline([RandomResizedCrop(224), HorizontalFlip()])
    loader = tierflow.open_loader(
        packed,
        batch_size=BATCH,
        transform=pipeline,
        num_workers=0,
        seed=2,
        endless=True,
        columns=["image", "image_width", "image_height", "caption"],
    )
    times, cpu = [], []
    it = iter(loader)
    next(it)
    for _ in range(batches):
        t, c = time.perf_counter(), time.process_time()
        try:
            next(it)
        except StopIteration:
            break
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    loader.close()
    return times, cpu


PEERS = {"webdataset": (write_wds, wds_epoch), "litdata": (write_litdata, litdata_epoch)}


def loader_rows(
    folder: Path,
    packed: Path,
    args: argparse.Namespace,
    root: Path | None = None,
    tuned: dict[str, Callable] | None = None,
    what: str = "warm",
) -> float:
    """The loaders side by side, alternating; returns tierflow's 2-worker median (for the S3 rows).
    The peers' data goes under `root` (--dir); `tuned` adds tierflow rows with an option, beside the
    default row and after it, and says how each compares with the better peer too."""
    data: dict[str, Path] = {"tierflow": packed}
    epochs: dict[str, Callable] = {"tierflow": tierflow_epoch}
    for name, epoch in (tuned or {}).items():
        data[name], epochs[name] = packed, epoch
    for name, (write, epoch) in PEERS.items():
        try:
            __import__(name)
        except ImportError:
            print(f"{name} not installed: no row")
            continue
        data[name], epochs[name] = write(folder, root or args.dir), epoch
    limit = min(len(list(folder.glob("*.jpg"))) - 2 * BATCH, args.limit)
    cases = [(name, w) for name in data for w in (0, 2)]
    rates: dict[tuple[str, int], list[float]] = {c: [] for c in cases}
    cpu: dict[tuple[str, int], list[float]] = {c: [] for c in cases}
    for _, (name, workers) in alternating(args.rounds, cases):
        rate, ms = epochs[name](data[name], workers, limit)
        rates[(name, workers)].append(rate)
        cpu[(name, workers)].append(ms)
    print(
        f"\n| loader (decode + RandomResizedCrop(224) + flip), {what} | workers | images/s ({limit} images, "
        f"{args.rounds} rounds) | CPU ms per image (all processes) |\n|---|---|---|---|"
    )
    for name, workers in cases:
        print(f"| {name} | {workers} | {spread(rates[(name, workers)], '.0f')} | {spread(cpu[(name, workers)])} |")
    ours = statistics.median(rates[("tierflow", 2)])
    peers = {n: statistics.median(rates[(n, 2)]) for n in data if n in PEERS}
    if peers:
        best = max(peers, key=peers.get)
        for name in ["tierflow", *(tuned or {})]:
            rate = statistics.median(rates[(name, 2)])
            print(
                f"2 workers: {name} / {best} (the better peer) = {rate / peers[best]:.2f} "
                f"(target >= 1.2: {'met' if rate >= 1.2 * peers[best] else 'MISSED'})"
            )
    return ours


def resized_tuned(packed: Path, encoded: int, args: argparse.Namespace, fill_workers: int) -> dict[str, Callable]:
    """The tuned row: ImagePipeline(cache=ResizedImages(--cache-dir, short side 256)), the cache
    emptied and filled by one epoch at `fill_workers` first (reported against the `encoded` bytes);
    each timed run opens it afresh, as a new job would."""
    import shutil

    import tierflow
    from tierflow.transforms import ResizedImages

    samples = sum(s.samples for s in tierflow.Manifest.load(packed).shards)
    shutil.rmtree(args.cache_dir, ignore_errors=True)
    cache = ResizedImages(args.cache_dir, "16GB", short_side=256)
    started = time.perf_counter()
    tierflow_epoch(packed, fill_workers, samples - BATCH, cache)  # every block: the warm rows find them all
    fill = time.perf_counter() - started
    snap = cache.tier.snapshot()
    print(
        f"resized cache (short side 256, {args.cache_dir}) filled by one epoch at {fill_workers} workers in "
        f"{fill:.1f} s: {snap['entries']} entries, {snap['resident_bytes'] / 1e6:.0f} MB "
        f"({snap['resident_bytes'] / encoded:.1f} x the encoded bytes)"
    )
    return {
        "tierflow, resized L1 (tuned)": lambda p, w, n: tierflow_epoch(p, w, n, ResizedImages(args.cache_dir, "16GB"))
    }


def hot_rows(folder: Path, args: argparse.Namespace) -> None:
    """A small hot dataset (the first --hot-images images, packed with pack's default shard size),
    warm: tierflow's default (decode the encoded bytes for every sample) beside the resized tuned
    row, and the peers on the same images."""
    hot = min(args.hot_images, args.images)
    packed = pack_subset(folder, args.dir, hot, 256 << 20)
    subset = args.dir / f"subset-{hot}"
    print(f"\nhot dataset: {corpus_sizes(subset)}")
    tuned = resized_tuned(packed, sum(p.stat().st_size for p in subset.glob("*.jpg")), args, 0)
    loader_rows(subset, packed, args, root=args.dir / f"hot-{hot}", tuned=tuned, what=f"warm, {hot} hot images")


def before_after(before_src: Path, args: argparse.Namespace) -> None:
    """tierflow at `before_src` (another checkout's src/, e.g. `git archive`) against this one, each
    run in a fresh child process, alternating, at 0 and 2 workers; each packs the corpus itself
    (packed-before, packed-after), so a change of pack defaults is measured too. With --only hot,
    on the hot dataset (the first --hot-images images, packed-hot-before, packed-hot-after)."""
    import subprocess

    here = Path(__file__).resolve().parents[1] / "src"
    hot = args.only == "hot"
    if hot:
        pack_subset(args.dir / "images", args.dir, min(args.hot_images, args.images), 256 << 20)  # its folder
    limit = min((min(args.hot_images, args.images) if hot else args.images) - 2 * BATCH, args.limit)
    cases = [(label, w) for label in ("before", "after") for w in (0, 2)]
    rates: dict[tuple[str, int], list[float]] = {c: [] for c in cases}
    cpu: dict[tuple[str, int], list[float]] = {c: [] for c in cases}
    for _, (label, workers) in alternating(args.rounds, cases):
        env = {**os.environ, "PYTHONPATH": str(before_src if label == "before" else here)}
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--dir",
                str(args.dir),
                "--images",
                str(args.images),
                "--hot-images",
                str(args.hot_images),
                "--limit",
                str(limit),
                "--child",
                f"{label}:{workers}{':hot' if hot else ''}",
            ],
            env=env,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        rate, ms = out.split()[-2:]
        rates[(label, workers)].append(float(rate))
        cpu[(label, workers)].append(float(ms))
    what = f"warm, {min(args.hot_images, args.images)} hot images" if hot else "warm"
    print(
        f"\n| tierflow (decode + RandomResizedCrop(224) + flip), {what} | workers | images/s ({limit} images, "
        f"{args.rounds} rounds, child processes) | CPU ms per image (all processes) |\n|---|---|---|---|"
    )
    for label, workers in cases:
        print(
            f"| {label} ({before_src if label == 'before' else here}) | {workers} | "
            f"{spread(rates[(label, workers)], '.0f')} | {spread(cpu[(label, workers)])} |"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "tierflow-images")
    parser.add_argument("--only", choices=("decoders", "loaders", "s3", "cached-form", "hot", "blocking"), default=None)
    parser.add_argument("--hot-images", type=int, default=1000, help="the small hot dataset of the cached-form rows")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=Path("/dev/shm/tierflow-bench-resized"),
        help="the tuned rows' resized cache (a tmpfs: an L1); emptied at the start",
    )
    parser.add_argument(
        "--resized",
        action="store_true",
        help="the loaders section gets the tuned row too (its cache holds the whole corpus)",
    )
    parser.add_argument("--limit", type=int, default=1280, help="images timed per loader run")
    parser.add_argument("--s3-images", type=int, default=3000, help="images of the S3 rows' dataset")
    parser.add_argument(
        "--s3-shard-mb",
        type=int,
        default=8,
        help="its shard size: ~50 shards, so a 30%% L2 keeps ~15 and whole shards cost 0.70-0.71, "
        "where 16 MB (25 shards, 7 kept) cost 0.72 at best and an epoch edge's shard 0.04 more",
    )
    parser.add_argument(
        "--before",
        type=Path,
        default=None,
        help="only tierflow rows: the src/ of another checkout against this one, alternating",
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # LABEL:WORKERS, one run's figures
    args = parser.parse_args(argv)
    if args.child is not None:
        label, workers, *hot = args.child.split(":")
        if hot:
            subset = args.dir / f"subset-{min(args.hot_images, args.images)}"
            packed = pack_tierflow(subset, args.dir, f"packed-hot-{label}")
        else:
            packed = pack_tierflow(args.dir / "images", args.dir, f"packed-{label}")
        print(*tierflow_epoch(packed, int(workers), args.limit))
        return
    folder = make_corpus(args.dir, args.images)
    print(f"corpus: {corpus_sizes(folder)}")
    if args.before is not None:
        before_after(args.before, args)
        return
    if args.only in (None, "decoders"):
        print("\n| decoder | images/s (1 core) |\n|---|---|")
        for name, rate in bench_decoders(folder, args.rounds):
            print(f"| {name} | {rate} |")
    packed = pack_tierflow(folder, args.dir)
    warm_rate = None
    if args.only in (None, "loaders"):
        tuned = None
        if args.resized:
            tuned = resized_tuned(packed, sum(p.stat().st_size for p in folder.glob("*.jpg")), args, 2)
        warm_rate = loader_rows(folder, packed, args, tuned=tuned)
    if args.only in (None, "s3"):
        if warm_rate is None:
            warm_rate = tierflow_epoch(packed, 2, 640)[0]
        subset = pack_subset(folder, args.dir, min(args.s3_images, args.images), args.s3_shard_mb << 20)
        with tempfile.TemporaryDirectory(dir=args.dir) as work:
            s3_rows(subset, Path(work), warm_rate)
    if args.only in (None, "cached-form"):
        hot = min(args.hot_images, args.images)
        rows = cached_forms(folder, hot, args.rounds)
        encoded = rows[0][3]
        print(
            f"\n| L1 form ({hot} hot images, one core) | CPU ms per image | images/s | bytes per image in L1 |"
            f" L1 bytes / encoded |\n|---|---|---|---|---|"
        )
        for name, ms, rate, nbytes in rows:
            print(f"| {name} | {ms} | {rate} | {nbytes / 1e3:.0f} KB | {nbytes / encoded:.1f} |")
    if args.only in (None, "hot"):
        hot_rows(folder, args)
    if args.only in (None, "blocking"):
        walls, cpus = batch_build_times(packed, max(10, min(100, args.images // BATCH - 2)))
        for what, times in (("wall", walls), ("CPU", cpus)):
            p50, p99 = statistics.median(times), float(np.percentile(times, 99))
            slow = sum(t > 2 * p50 for t in times)
            print(
                f"batch build ({BATCH} images, 0 workers, {len(times)} batches), {what}: p50 {p50 * 1e3:.0f} ms, "
                f"p99 {p99 * 1e3:.0f} ms (p99/p50 {p99 / p50:.2f}), {slow} batches over 2x p50"
            )


if __name__ == "__main__":
    main()
