"""`tierflow demo --images`: the multimodal path end to end, on photographs this machine has.

1. A corpus of JPEGs cut from the real photographs shipped in installed packages (matplotlib's
   sample photographs; scikit-learn's and scikit-image's when installed): random crops, rescaled
   to a long tail of sizes and re-encoded, each with a caption and the photograph it came from.
2. Pack it (images stay encoded; width/height/format from the headers) and check every image
   byte for byte against its file.
3. The packed folder plays L4 behind a bandwidth throttle with a small L2 above it; epochs of
   decode + RandomResizedCrop + flip in the loader against a simulated step, then the dry run;
   bytes per epoch, the verdict and the report PNG.
4. A tiny CNN learns which photograph a crop came from, fed by the same stack; its loss falls.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from tierflow._console import output_console

SIDE = 48
"""Training resolution of the demo's model."""


def photographs() -> list[tuple[str, Any]]:
    """(name, RGB PIL image) of every real photograph found in installed packages."""
    from PIL import Image

    found: list[tuple[str, Any]] = []
    try:
        import matplotlib

        data = Path(matplotlib.__file__).parent / "mpl-data" / "sample_data"
        for name in ("grace_hopper.jpg", "Minduka_Present_Blue_Pack.png"):
            if (data / name).is_file():
                found.append((Path(name).stem, Image.open(data / name).convert("RGB")))
    except ImportError:
        pass
    try:
        from sklearn.datasets import load_sample_images

        for name, pixels in zip(("china", "flower"), load_sample_images().images):
            found.append((name, Image.fromarray(pixels)))
    except ImportError:
        pass
    try:
        from skimage import data as skdata

        for name in ("astronaut", "coffee", "chelsea", "rocket"):
            found.append((name, Image.fromarray(getattr(skdata, name)()).convert("RGB")))
    except (ImportError, AttributeError):
        pass
    if len(found) < 2:
        raise SystemExit("demo --images: needs at least two sample photographs (pip install matplotlib)")
    return found


def make_corpus(folder: Path, count: int, seed: int = 0) -> tuple[list[str], dict[str, str]]:
    """`count` JPEGs with .json sidecars {caption, label}; returns the labels' names and each file's sha256."""
    from PIL import Image

    photos = photographs()
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    digests = {}
    for i in range(count):
        label = int(rng.integers(len(photos)))
        name, photo = photos[label]
        w, h = photo.size
        frac = rng.uniform(0.35, 1.0)
        cw, ch = max(16, int(w * frac * rng.uniform(0.8, 1.0))), max(16, int(h * frac * rng.uniform(0.8, 1.0)))
        x, y = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
        side = float(np.clip(rng.lognormal(np.log(480), 0.4), 96, 1800))  # a long tail of sizes
        scale = side / max(cw, ch)
        img = photo.crop((x, y, x + cw, y + ch)).resize(
            (max(16, int(cw * scale)), max(16, int(ch * scale))), Image.Resampling.BILINEAR
        )
        out = io.BytesIO()
        img.save(out, format="JPEG", quality=int(rng.integers(75, 95)))
        stem = f"{i:05d}"
        (folder / f"{stem}.jpg").write_bytes(out.getvalue())
        digests[f"{stem}.jpg"] = hashlib.sha256(out.getvalue()).hexdigest()
        caption = f"{name.replace('_', ' ')}: a {cw}x{ch} crop at ({x}, {y}), {img.width}x{img.height}"
        (folder / f"{stem}.json").write_text(json.dumps({"caption": caption, "label": label}))
    return [n for n, _ in photos], digests


def run_images_demo(
    out: str | os.PathLike = "demo-images",
    images: int = 2000,
    bandwidth: float = 20e6,
    epochs: int = 2,
    step_ms: float = 10.0,
    train_steps: int = 120,
    batch_size: int = 32,
    console: Console | None = None,
) -> dict:
    import logging

    from tierflow.commands.bench import format_result, run_bench, simulated_step
    from tierflow.commands.report import write_report
    from tierflow.storage.datasets import open_dataset
    from tierflow.format.shard import Form
    from tierflow.loader import TieredDataset, BatchSpec
    from tierflow.pack.packer import pack
    from tierflow.telemetry import MetricsRegistry
    from tierflow.telemetry.eventlog import EventLog
    from tierflow.tiers import TierConfig, build_stack
    from tierflow.tiers.stager import Stager
    from tierflow.transforms import HorizontalFlip, ImagePipeline, RandomResizedCrop

    logging.getLogger("tierflow.pack").setLevel(logging.ERROR)
    console = console or output_console()
    out = Path(out)
    started = time.perf_counter()
    console.rule("[bold]1. a corpus cut from this machine's sample photographs")
    folder = out / "photos"
    shutil.rmtree(folder, ignore_errors=True)
    names, digests = make_corpus(folder, images)
    sizes = np.array([p.stat().st_size for p in folder.glob("*.jpg")])
    console.print(
        f"{len(sizes):,} JPEGs from {len(names)} photographs ({', '.join(names)}): "
        f"median {np.median(sizes) / 1e3:.0f} KB, p99 {np.percentile(sizes, 99) / 1e3:.0f} KB, "
        f"{sizes.sum() / 1e6:.0f} MB"
    )

    console.rule("[bold]2. pack, and check every image byte for byte")
    dataset_dir = out / "dataset"
    t = time.perf_counter()
    summary = pack([folder], dataset_dir, target_shard_bytes=8 << 20, overwrite=True, progress=False)
    pack_s = time.perf_counter() - t
    ds = open_dataset(dataset_dir, columns=["path", "image"])
    differ = sum(hashlib.sha256(s["image"]).hexdigest() != digests[s["path"]] for s in ds)
    if differ or len(ds) != len(digests):
        raise SystemExit(f"demo --images: {differ} images differ from their files, {len(ds)} of {len(digests)} packed")
    manifest = ds.manifest
    console.print(
        f"{len(ds):,} images -> {len(manifest.shards)} shards in {pack_s:.1f} s; every image equals its "
        f"file (sha256); width/height/format columns from the headers"
    )

    console.rule("[bold]3. decode + RandomResizedCrop + flip through a throttled L4 and a small L2")
    at_rest = sum(s.bytes for s in manifest.shards)
    node = out / "node"
    shutil.rmtree(node, ignore_errors=True)
    l2_capacity = max(at_rest // 3, 3 * max(s.decoded_bytes for s in manifest.shards))
    registry = MetricsRegistry()
    stack = build_stack(
        str(dataset_dir), [TierConfig("L2", str(node / "L2"), l2_capacity)], bandwidth=bandwidth, registry=registry
    )
    pipeline = ImagePipeline([RandomResizedCrop(SIDE, scale=(0.25, 1.0)), HorizontalFlip()], keep=["label"])
    columns = ["image", "image_width", "image_height", "label"]
    bench_ds = TieredDataset(stack.dataset(), BatchSpec(batch_size=batch_size, columns=columns, transform=pipeline))
    console.print(
        f"L4: {dataset_dir} at {bandwidth / 1e6:.0f} MB/s; L2 holds {l2_capacity / 1e6:.0f} of "
        f"{at_rest / 1e6:.0f} MB; step {step_ms:g} ms; batches of {batch_size} images"
    )
    steps_per_epoch = max(1, len(manifest.shards) and manifest.num_samples // batch_size)
    log_path = out / "run.jsonl"
    events = EventLog(
        log_path, registry, name="tierflow demo --images", steps=epochs * steps_per_epoch, step_ms=step_ms
    )
    result = run_bench(
        bench_ds,
        epochs * steps_per_epoch,
        simulated_step(step_ms),
        registry=registry,
        events=events,
        tier_layout=[(t.name, t.capacity, t.form is Form.DECODED) for t in stack.tiers],
        stager=Stager(bench_ds, stack),
        budget=getattr(stack.source, "budget", None),
    )
    console.print(format_result(result, step_ms))
    png, _ = write_report(log_path, out / "report.png")

    console.rule("[bold]4. a tiny CNN learns which photograph each crop came from")
    losses, params, train_s = train_tiny_cnn(stack, pipeline, columns, len(names), train_steps, console)
    stack.close()
    console.rule("[bold]summary")
    lines = [
        f"pack: {len(ds):,} images -> {len(manifest.shards)} shards in {pack_s:.1f} s, byte-exact",
        f"loader: {result.throughput * batch_size:.0f} images/s vs dry run "
        f"{result.dry_run_throughput * batch_size:.0f} (ratio {result.ratio:.2f}); "
        f"bubble rate {result.loader.bubble_rate:.1%}",
        f"verdict: {result.verdict.bound} - {result.verdict.change}",
        f"model: {params:,} parameters, loss {losses[0]:.2f} -> {np.mean(losses[-10:]):.2f} (last 10) in "
        f"{len(losses)} steps ({train_s:.1f} s)",
        f"report: {png}   event log: {log_path}   total {time.perf_counter() - started:.0f} s",
    ]
    for line in lines:
        console.print(line)
    return {
        "ratio": result.ratio,
        "losses": losses,
        "report": str(png),
        "samples": len(ds),
        "input_bytes": summary.input_bytes,
    }


def train_tiny_cnn(
    stack: Any, pipeline: Any, columns: list[str], classes: int, steps: int, console: Console
) -> tuple[list[float], int, float]:
    """A few-thousand-parameter CNN on uint8 NHWC batches, normalised after the loader (the device step)."""
    import torch
    from torch import nn

    from tierflow.commands.demo import train
    from tierflow.loader import Loader, TieredDataset, BatchSpec, OrderSpec
    from tierflow.transforms import normalize

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 32, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, classes),
    )
    ds = TieredDataset(
        stack.dataset(), BatchSpec(batch_size=32, columns=columns, transform=pipeline), OrderSpec(seed=1)
    )

    def loss_of(batch: dict) -> torch.Tensor:
        return nn.functional.cross_entropy(model(normalize(batch["image"])), batch["label"].long())

    return train(model, Loader(ds, endless=True), loss_of, steps, console, every=30)
