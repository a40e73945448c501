"""`tierflow demo`: README's main job on data every Python install has, no service needed.

It packs the standard library's own source files (thousands of small files: the small-file
problem tierflow removes), verifies the shards, reads every sample back against the files
on disk, and prints what it measured.
"""

from __future__ import annotations

import os
import sysconfig
import time
from pathlib import Path

from rich.console import Console

from tierflow.format.dataset import open_dataset
from tierflow.format.shard import verify_shard
from tierflow.pack.packer import pack

STDLIB_EXCLUDE = ("site-packages", "dist-packages", "__pycache__", "*.pyc")


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _subset(source: Path, dest: Path, include: tuple[str, ...], max_files: int) -> Path:
    """The first `max_files` files of the tree, copied: a reduced demo for CI."""
    import shutil

    from tierflow.pack.sources import SourceOptions, walk_files

    shutil.rmtree(dest, ignore_errors=True)
    files = walk_files(str(source), SourceOptions(include=include, exclude=STDLIB_EXCLUDE))
    for _, rel in zip(range(max_files), files):
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / rel, dest / rel)
    return dest


def run_demo(out: str | os.PathLike = "demo-out", shard_bytes: int = 1 << 20, max_files: int | None = None,
             console: Console | None = None) -> dict:
    console = console or Console()
    out = Path(out)
    source = stdlib_dir()
    include = ("*.py",)
    console.rule("[bold]tierflow demo: pack")
    console.print(f"source: {source} (*.py, site-/dist-packages excluded)")
    if max_files is not None:
        source = _subset(source, out / "source-subset", include, max_files)
    summary = pack([source], out / "dataset", target_shard_bytes=shard_bytes, include=include,
                   exclude=STDLIB_EXCLUDE, overwrite=True, progress=True)

    console.rule("[bold]read back")
    started = time.perf_counter()
    ds = open_dataset(out / "dataset")
    bad = [p for info in ds.manifest.shards for p in verify_shard(out / "dataset" / info.name, info)]
    mismatched = 0
    for sample in ds:
        on_disk = (source / sample["path"]).read_bytes()
        stored = sample["text"].encode() if sample["text"] is not None else sample.get("text_bytes")
        if stored != on_disk:
            mismatched += 1
    seconds = time.perf_counter() - started
    console.print(f"read {len(ds):,} samples back in {seconds:.2f} s "
                  f"({len(ds) / max(seconds, 1e-9):,.0f} samples/s); "
                  f"{'all checksums match' if not bad else bad}; "
                  f"{'every sample equals its file' if not mismatched else f'{mismatched} samples differ'}")
    if bad or mismatched:
        raise SystemExit(1)
    return {"samples": len(ds), "shards": len(ds.manifest.shards), "pack_seconds": summary.seconds}
