"""Start-up and resume benchmark: time and peak memory to the first batch as the dataset grows.

Issue 6's target: at a fixed shard count, going from 1M to 100M samples grows the time and the
peak RSS to the first batch by at most 10%, from the start and from a mid-epoch cursor. Each
measurement runs in a fresh interpreter, so imports, the page cache of Python modules aside,
and tierflow's in-process caches do not carry over between runs. The datasets (one int64
column `x`) live in a temporary directory under /tmp and are deleted at the end.

Per run the child reports: import seconds (size-independent, shown apart), seconds from
`TieredDataset(...)` to the first batch, RSS after imports, peak RSS (getrusage maxrss), the
resident split at the first batch (anonymous: heap and decoded shards; file: mapped shards,
reclaimable page cache), how many shards the first batch opened and how many of their blocks
it read (each verified, and decoded when compressed, on its own).
Figures are medians of `--runs` runs, spread is min-max. Shard files stay in the page cache
between runs (a warm local start); the cold path belongs to benchmarks/loader.py --cold.
`--group-bytes default,0` measures the loader's default shuffle (block groups) and, beside it in
the same alternating rounds, the full-window shuffle (group_bytes=0). `--before OTHER/src` measures
another checkout's code (e.g. `git archive main src | tar -x -C /tmp/before`) beside this one's, in
the same alternating rounds (rows "before" and "this"), each on datasets its own pack wrote (so each
reads its own manifest format).

    .venv/bin/python benchmarks/startup.py [--sizes 1M,10M,100M] [--runs 3] [--shards 30] [--group-bytes default,0]
        [--before /tmp/before/src]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _harness import spread

BATCH = 256
CURSOR_STEPS = 50
PARQUET_ROW_GROUP = 1 << 20
MIN_SHARD_BYTES = 256 << 10
TARGET_GROWTH = 1.10


def parse_size(text: str) -> int:
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}
    text = text.strip().upper()
    if text[-1] in scale:
        return int(float(text[:-1]) * scale[text[-1]])
    return int(text)


def label(samples: int) -> str:
    return f"{samples // 10**6}M" if samples % 10**6 == 0 else str(samples)


# -- building the datasets --------------------------------------------------------------------
def write_parquet(path: Path, samples: int) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([("x", pa.int64())])
    with pq.ParquetWriter(path, schema, compression="none", use_dictionary=False) as writer:
        for start in range(0, samples, PARQUET_ROW_GROUP):
            stop = min(samples, start + PARQUET_ROW_GROUP)
            column = pa.array(np.arange(start, stop, dtype=np.int64))
            writer.write_table(pa.table({"x": column}, schema=schema), row_group_size=PARQUET_ROW_GROUP)


def build_dataset(root: Path, samples: int, shards: int, compression: str) -> tuple[Path, int, float]:
    """(dataset directory, shard count, build seconds); shards hold 8 bytes per sample decoded."""
    import tierflow

    root.mkdir(parents=True, exist_ok=True)

    shard_bytes = 8 * math.ceil(samples / shards)  # whole rows, so the last shard is the short one
    if shard_bytes < MIN_SHARD_BYTES:
        raise SystemExit(
            f"{label(samples)} samples in {shards} shards is {shard_bytes} B a shard, below the "
            f"packer's 256 KB minimum; use --shards <= {8 * samples // MIN_SHARD_BYTES}"
        )
    began = time.perf_counter()
    parquet = root / f"x-{label(samples)}.parquet"
    write_parquet(parquet, samples)
    out = root / f"ds-{label(samples)}"
    tierflow.pack([parquet], out, workers=2, target_shard_bytes=shard_bytes, compression=compression)
    parquet.unlink()
    count = len(tierflow.Manifest.load(out).shards)
    return out, count, time.perf_counter() - began


def resident_split() -> dict[str, int]:
    """Resident bytes now, anonymous (heap, decoded shards) apart from file-backed (mapped shards)."""
    fields = {"RssAnon:": "rss_anon", "RssFile:": "rss_file"}
    found = {}
    with open("/proc/self/status") as status:
        for line in status:
            words = line.split()
            if words and words[0] in fields:
                found[fields[words[0]]] = int(words[1]) * 1024
    return found


# -- the measured child -----------------------------------------------------------------------
def child(mode: str, path: str, cursor_file: str | None, group: str) -> None:
    """One measurement in this fresh interpreter; prints one JSON line."""
    began = time.perf_counter()
    import psutil

    from tierflow.loader import BatchSpec, Loader, OrderSpec, TieredDataset

    imported = time.perf_counter()
    rss_after_import = psutil.Process().memory_info().rss
    options = {} if group == "default" else {"group_bytes": int(group)}
    if mode == "cursor":
        loader = Loader(TieredDataset(path, BatchSpec(batch_size=BATCH), OrderSpec(**options)), endless=True)
        for step, _ in enumerate(loader):
            if step + 1 == CURSOR_STEPS:
                Path(cursor_file).write_text(json.dumps(loader.state_dict()))
                break
        loader.close()
        print(json.dumps({"steps": CURSOR_STEPS}))
        return
    resume = json.loads(Path(cursor_file).read_text()) if mode == "resume" else None
    start = time.perf_counter()
    dataset = TieredDataset(path, BatchSpec(batch_size=BATCH), OrderSpec(**options), resume=resume)
    constructed = time.perf_counter()
    loader = Loader(dataset)
    first = next(iter(loader))
    arrived = time.perf_counter()
    if len(first["x"]) != BATCH:
        raise RuntimeError(f"{path}: first batch has {len(first['x'])} samples, expected {BATCH}")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    resident = resident_split()
    source = getattr(dataset._open().dataset, "source", None)
    loader.close()
    print(
        json.dumps(
            {
                "import_s": imported - began,
                "dataset_s": constructed - start,
                "first_batch_s": arrived - start,
                "rss_import": rss_after_import,
                "peak_rss": peak,
                "shards_opened": getattr(source, "opens", -1),
                "blocks_read": getattr(source, "blocks_read", -1),
                **resident,
            }
        )
    )


def build_with(src: str | None, root: Path, samples: int, shards: int, compression: str) -> tuple[Path, int, float]:
    """`build_dataset` in a child importing the tierflow of `src` (None: this one's), so each code reads
    the format its own pack writes (a newer format version is refused by an older reader)."""
    command = [
        sys.executable,
        __file__,
        "--build",
        str(samples),
        "--path",
        str(root),
        "--shards",
        str(shards),
        "--compression",
        compression,
    ]
    env = {**os.environ, "PYTHONPATH": src} if src is not None else None
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"building {label(samples)} samples exited {done.returncode}:\n{done.stderr[-4000:]}")
    path, count, seconds = json.loads(done.stdout.strip().splitlines()[-1])
    return Path(path), count, seconds


def run_child(mode: str, path: Path, cursor_file: Path, group: str, src: str | None = None) -> dict:
    """One child's figures; `src`: the tierflow source tree it imports (None: this one's)."""
    command = [
        sys.executable,
        __file__,
        "--child",
        mode,
        "--path",
        str(path),
        "--cursor-file",
        str(cursor_file),
        "--group",
        group,
    ]
    env = {**os.environ, "PYTHONPATH": src} if src is not None else None
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{mode} child on {path} exited {done.returncode}:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- the table --------------------------------------------------------------------------------
def group_label(group: str) -> str:
    return "default" if group == "default" else "window" if group == "0" else f"g={int(group) / 2**20:g}MiB"


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def print_table(
    sizes: list[int],
    shard_counts: dict[int, int],
    groups: list[str],
    codes: list[str],
    results: dict[tuple[str, str, str, int], list[dict]],
) -> None:
    mb = 1 / 2**20
    print()
    print(
        f"batch {BATCH}, resume cursor after {CURSOR_STEPS} steps; median (min-max) of each run set; shuffle: "
        f"default = the loader's (block groups), window = group_bytes=0 (the full-window shuffle)"
    )
    header = (
        f"{'mode':<8}{'shuffle':>10}{'code':>7}{'samples':>9}{'shards':>7}  {'import s':>18}  "
        f"{'dataset() ms':>20}  {'to 1st batch ms':>20}  {'RSS after import MB':>22}  {'peak RSS MB':>22}  "
        f"{'anon/file MB':>13}  {'shards read':>11}  {'blocks read':>11}"
    )
    print(header)
    print("-" * len(header))
    for mode, group, code in ((m, g, c) for m in ("startup", "resume") for g in groups for c in codes):
        for samples in sizes:
            runs = results[(mode, group, code, samples)]
            print(
                f"{mode:<8}{group_label(group):>10}{code:>7}{label(samples):>9}{shard_counts[samples]:>7}  "
                f"{spread([r['import_s'] for r in runs], '.2f', 1):>18}  "
                f"{spread([r['dataset_s'] for r in runs], '.1f', 1e3):>20}  "
                f"{spread([r['first_batch_s'] for r in runs], '.1f', 1e3):>20}  "
                f"{spread([r['rss_import'] for r in runs], '.0f', mb):>22}  "
                f"{spread([r['peak_rss'] for r in runs], '.0f', mb):>22}  "
                f"{statistics.median(r['rss_anon'] for r in runs) * mb:>6.0f}/"
                f"{statistics.median(r['rss_file'] for r in runs) * mb:<6.0f}  "
                f"{statistics.median(r['shards_opened'] for r in runs):>11.0f}  "
                f"{statistics.median(r.get('blocks_read', -1) for r in runs):>11.0f}"
            )
    small, large = sizes[0], sizes[-1]
    print()
    print(f"growth {label(small)} -> {label(large)} samples (ratio of medians; target <= {TARGET_GROWTH:.2f})")
    print(
        f"{'mode':<8}{'shuffle':>10}{'code':>7}{'to 1st batch':>14}{'peak RSS':>10}{'peak - import RSS':>19}  verdict"
    )
    for mode, group, code in ((m, g, c) for m in ("startup", "resume") for g in groups for c in codes):
        small_runs, large_runs = results[(mode, group, code, small)], results[(mode, group, code, large)]
        time_ratio = median_of(large_runs, "first_batch_s") / median_of(small_runs, "first_batch_s")
        rss_ratio = median_of(large_runs, "peak_rss") / median_of(small_runs, "peak_rss")
        added = [
            statistics.median(r["peak_rss"] - r["rss_import"] for r in results[(mode, group, code, s)])
            for s in (small, large)
        ]
        added_ratio = added[1] / added[0] if added[0] > 0 else float("inf")
        met = time_ratio <= TARGET_GROWTH and rss_ratio <= TARGET_GROWTH
        print(
            f"{mode:<8}{group_label(group):>10}{code:>7}{time_ratio:>14.2f}{rss_ratio:>10.2f}{added_ratio:>19.2f}  "
            f"{'met' if met else 'MISSED'}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1M,10M,100M", help="comma-separated sample counts (1M, 10M, ...)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--shards", type=int, default=30, help="fixed shard count (<= 30 so 1M int64 samples fill 256 KB shards)"
    )
    parser.add_argument(
        "--compression",
        default="zstd",
        help="at-rest shard compression for pack ('none' shards are memory-mapped, like a warm L1)",
    )
    parser.add_argument(
        "--group-bytes",
        default="default",
        help="comma-separated TieredDataset group_bytes to compare ('default': not passed; 0: the full-window shuffle)",
    )
    parser.add_argument(
        "--before", default=None, help="another checkout's src/ folder, measured beside this one in the same rounds"
    )
    parser.add_argument("--keep", action="store_true", help="leave the datasets on disk and print where")
    parser.add_argument("--child", choices=["startup", "resume", "cursor"], help=argparse.SUPPRESS)
    parser.add_argument("--build", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--cursor-file", help=argparse.SUPPRESS)
    parser.add_argument("--group", default="default", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.path, args.cursor_file, args.group)
        return
    if args.build:
        path, count, seconds = build_dataset(Path(args.path), args.build, args.shards, args.compression)
        print(json.dumps([str(path), count, seconds]))
        return
    groups = [g.strip() for g in args.group_bytes.split(",")]

    sizes = sorted(parse_size(s) for s in args.sizes.split(","))
    if len(sizes) < 2:
        parser.error("--sizes needs at least two sizes: the figure is the growth from the smallest to the largest")
    root = Path(tempfile.mkdtemp(prefix="tierflow-startup-", dir="/tmp"))
    try:
        sources = {"this": None, **({"before": args.before} if args.before else {})}
        codes = list(sources)[::-1]
        datasets: dict[tuple[str, int], Path] = {}
        shard_counts: dict[int, int] = {}
        for code in codes:
            for samples in sizes:
                datasets[(code, samples)], shard_counts[samples], seconds = build_with(
                    sources[code], root / code, samples, args.shards, args.compression
                )
                print(
                    f"built {label(samples)} samples ({code}): {shard_counts[samples]} shards in {seconds:.1f} s",
                    flush=True,
                )
        if len(set(shard_counts.values())) != 1:
            print(f"warning: shard counts differ across sizes: {shard_counts}", flush=True)
        cursors = {(c, g, s): root / c / f"cursor-{g}-{label(s)}.json" for c in codes for g in groups for s in sizes}
        for (code, group, samples), cursor in cursors.items():
            run_child("cursor", datasets[(code, samples)], cursor, group, sources[code])
        results: dict[tuple[str, str, str, int], list[dict]] = {
            (m, g, c, s): [] for m in ("startup", "resume") for g in groups for c in codes for s in sizes
        }
        for run in range(args.runs):
            # interleaved, so drift on a shared machine spreads over every size, shuffle and code
            for group in groups if run % 2 == 0 else groups[::-1]:
                for samples in sizes if run % 2 == 0 else sizes[::-1]:
                    for code in codes if run % 2 == 0 else codes[::-1]:
                        for mode in ("startup", "resume"):
                            results[(mode, group, code, samples)].append(
                                run_child(
                                    mode,
                                    datasets[(code, samples)],
                                    cursors[(code, group, samples)],
                                    group,
                                    sources[code],
                                )
                            )
            print(f"run {run + 1}/{args.runs} done", flush=True)
        print_table(sizes, shard_counts, groups, codes, results)
    finally:
        if args.keep:
            print(f"datasets kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
