"""Benchmark of `tierflow pack`: throughput against the library floor, and peak memory against input size.

Throughput (MB/s of input, files/s) on the standard library's *.py tree (site-/dist-packages
excluded) and on a synthetic JSONL made in a temp dir, with and without byte tokenisation,
side by side with the *floor*: the same input read by pyarrow (`pyarrow.json` for JSONL, plain
file reads into a binary column for the tree) and written as Arrow IPC with the same codec
(zstd) by the same number of processes, with no tierflow logic (no shards, no hashing, no
manifest). Target: tierflow >= 0.6x the floor. The machine is shared, so wall-clock
figures swing with other load; CPU seconds per GB (user + system of the whole process tree)
are printed beside them as the steadier measure of the work each engine does. Rounds alternate the order of the runs; the
table gives medians and the spread (min-max).

Peak memory: the summed PSS of the packing process tree (psutil `memory_full_info().pss`,
sampled at 10 Hz) for a JSONL and one 4x larger; target: within 10% of each other. Memory is
bounded by the shards being written (up to 2 x 256 MB of batches), so it is flat only above that.
Every run is a fresh child process, so one run's heap never inflates the next one's figures.
The inputs sit in the page cache (just written), so this measures CPU, not the disk.

`--ray`: the Ray engine (`pack(engine="ray")`, a local cluster of 1 and 2 CPUs started before the
clock) against the local engine with as many processes, on the same JSONL with byte tokens: MB/s,
files/s (units/s: a JSONL is one file of 16 MB units), Ray/local ratio, the driver's peak PSS and
the tree's peak PSS (driver, raylet, workers), and the cluster's start-up time beside it. Ray is
timed cold (the first pack on a fresh cluster: its workers start and import tierflow) and warm
(a second pack on the same cluster, as on a long-lived one).
The 2-worker Ray rate per core is then turned into TB of raw JSONL per hour per 100 cores, with
its assumptions printed beside it (linear scaling over independent units, input at page-cache speed,
byte tokens).

Run: .venv/bin/python benchmarks/pack.py            (JSONL 1 GB; memory 1 GB vs 4 GB; 3 rounds)
     .venv/bin/python benchmarks/pack.py --quick    (JSONL 200 MB; memory 600 MB vs 2.4 GB; 2 rounds)
     .venv/bin/python benchmarks/pack.py --ray --jsonl-mb 200 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import numpy as np
import psutil
import resource
import pyarrow as pa
import pyarrow.json as pajson

from _harness import alternating, spread

STDLIB_EXCLUDE = ("site-packages", "dist-packages", "__pycache__")
CHUNK_BYTES = 16 << 20
FILES_PER_CHUNK = 2048
CODEC = "zstd"
SAMPLE_HZ = 10


# ---------------------------------------------------------------- inputs


def make_jsonl(path: Path, target_bytes: int, seed: int = 0) -> int:
    """A JSONL of documents made of words from a 20k-word vocabulary (zstd ratio ~3x, like prose)."""
    rng = np.random.default_rng(seed)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", np.uint8)
    vocab = [bytes(letters[rng.integers(0, 26, int(n))]) for n in rng.integers(2, 11, 20_000)]
    zipf = np.minimum(rng.zipf(1.2, 4_000_000) - 1, len(vocab) - 1)
    pool = b" ".join(vocab[i] for i in zipf)  # ~25 MB of text; documents are slices of it
    written, doc = 0, 0
    with open(path, "wb", buffering=8 << 20) as f:
        while written < target_bytes:
            lengths = np.clip(rng.lognormal(7.3, 0.9, 4096), 16, 60_000).astype(np.int64)
            starts = rng.integers(0, len(pool) - 60_001, 4096)
            lines = []
            for start, n in zip(starts.tolist(), lengths.tolist()):
                lines.append(
                    b'{"id": %d, "source": "synthetic", "score": %d, "text": "%s"}\n'
                    % (doc, doc % 97, pool[start : start + n])
                )
                doc += 1
            block = b"".join(lines)
            f.write(block)
            written += len(block)
    return written


def stdlib_files() -> tuple[Path, list[str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in STDLIB_EXCLUDE)
        files += [os.path.relpath(os.path.join(dirpath, n), root) for n in sorted(filenames) if n.endswith(".py")]
    return root, files


# ---------------------------------------------------------------- the floor: pyarrow alone


def _floor_jsonl_chunk(path: str, start: int, end: int, out: str) -> int:
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(end - start)
    table = pajson.read_json(
        pa.BufferReader(data), read_options=pajson.ReadOptions(use_threads=False, block_size=len(data) + 1)
    )
    with pa.ipc.new_file(out, table.schema, options=pa.ipc.IpcWriteOptions(compression=CODEC)) as writer:
        writer.write_table(table, max_chunksize=8192)
    return table.num_rows


def _floor_files_chunk(root: str, members: list[str], out: str) -> int:
    data = []
    for rel in members:
        with open(os.path.join(root, rel), "rb") as f:
            data.append(f.read())
    batch = pa.RecordBatch.from_arrays(
        [pa.array(members, pa.string()), pa.array(data, pa.binary())], names=["path", "data"]
    )
    with pa.ipc.new_file(out, batch.schema, options=pa.ipc.IpcWriteOptions(compression=CODEC)) as writer:
        writer.write_batch(batch)
    return batch.num_rows


def _jsonl_ranges(path: str) -> list[tuple[int, int]]:
    size = os.path.getsize(path)
    ranges, start = [], 0
    with open(path, "rb") as f:
        while start < size:
            end = min(start + CHUNK_BYTES, size)
            if end < size:
                f.seek(end)
                f.readline()
                end = f.tell()
            ranges.append((start, end))
            start = end
    return ranges


def run_floor(kind: str, source: str, out: str, workers: int) -> dict:
    os.makedirs(out, exist_ok=True)
    started = time.perf_counter()
    with ProcessPoolExecutor(workers, mp_context=get_context("fork")) as pool:
        if kind == "jsonl":
            jobs = [
                pool.submit(_floor_jsonl_chunk, source, s, e, f"{out}/{i:06d}.arrow")
                for i, (s, e) in enumerate(_jsonl_ranges(source))
            ]
            files = 1
            input_bytes = os.path.getsize(source)
        else:
            root, members = stdlib_files()
            chunks: list[list[str]] = [[]]
            chunk_bytes = 0
            input_bytes = 0
            for rel in members:
                size = os.path.getsize(root / rel)
                if len(chunks[-1]) >= FILES_PER_CHUNK or chunk_bytes >= CHUNK_BYTES:
                    chunks.append([])
                    chunk_bytes = 0
                chunks[-1].append(rel)
                chunk_bytes += size
                input_bytes += size
            jobs = [pool.submit(_floor_files_chunk, str(root), c, f"{out}/{i:06d}.arrow") for i, c in enumerate(chunks)]
            files = len(members)
        samples = sum(j.result() for j in jobs)
    return {"seconds": time.perf_counter() - started, "input_bytes": input_bytes, "files": files, "samples": samples}


def run_tierflow(kind: str, source: str, out: str, workers: int, tokenizer: str | None, engine: str = "local") -> dict:
    from tierflow.pack.packer import pack

    started = time.perf_counter()
    if kind == "jsonl":
        summary = pack([source], out, workers=workers, tokenizer=tokenizer, overwrite=True, engine=engine)
    else:
        summary = pack(
            [source],
            out,
            workers=workers,
            tokenizer=tokenizer,
            include=("*.py",),
            exclude=STDLIB_EXCLUDE,
            overwrite=True,
        )
    seconds = time.perf_counter() - started
    stats = summary.manifest.stats
    return {
        "seconds": seconds,
        "input_bytes": summary.input_bytes,
        "files": stats["files"],
        "samples": stats["samples"],
        "shards": len(summary.manifest.shards),
        "dataset_id": summary.manifest.dataset_id,
    }


def run_ray(source: str, out: str, workers: int, tokenizer: str | None) -> dict:
    """A pack on a local Ray cluster of `workers` CPUs, started (and timed) before the pack's clock:
    the first pack on it (cold: Ray starts its worker processes and they import tierflow) and a
    second one (warm: a long-lived cluster's case)."""
    import ray

    started = time.perf_counter()
    ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False)
    startup = time.perf_counter() - started
    try:
        result = run_tierflow("jsonl", source, out, workers, tokenizer, engine="ray")
        warm = run_tierflow("jsonl", source, out, workers, tokenizer, engine="ray")  # workers up, imports done
    finally:
        ray.shutdown()
    result["startup_seconds"] = startup
    result["warm_seconds"] = warm["seconds"]
    return result


# ---------------------------------------------------------------- one run in a child, with PSS sampled


def tree_pss(proc: psutil.Process) -> int:
    total = 0
    try:
        members = [proc] + proc.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0
    for p in members:
        try:
            total += p.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


def run_child(spec: dict) -> dict:
    """Run one pack (tierflow or floor) in a fresh process; return its figures and peak tree PSS."""
    proc = subprocess.Popen([sys.executable, __file__, "--child", json.dumps(spec)], stdout=subprocess.PIPE, text=True)
    watched = psutil.Process(proc.pid)
    peak = driver = 0
    done = threading.Event()

    def sample() -> None:
        nonlocal peak, driver
        while not done.wait(1 / SAMPLE_HZ):
            peak = max(peak, tree_pss(watched))
            try:
                driver = max(driver, watched.memory_full_info().pss)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout, _ = proc.communicate()
    done.set()
    sampler.join()
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark child {spec} exited with {proc.returncode}")
    result = json.loads(stdout.strip().splitlines()[-1])
    result["peak_pss"] = peak
    result["driver_pss"] = driver
    return result


def child_main(spec: dict) -> None:
    out = spec["out"]
    shutil.rmtree(out, ignore_errors=True)
    if spec["engine"] == "floor":
        result = run_floor(spec["kind"], spec["source"], out, spec["workers"])
    elif spec["engine"] == "ray":
        result = run_ray(spec["source"], out, spec["workers"], spec["tokenizer"])
    else:
        result = run_tierflow(spec["kind"], spec["source"], out, spec["workers"], spec["tokenizer"])
    used = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    result["cpu_seconds"] = sum(u.ru_utime + u.ru_stime for u in used)  # pool workers are reaped by now
    result["out_bytes"] = sum(p.stat().st_size for p in Path(out).rglob("*") if p.is_file())
    shutil.rmtree(out, ignore_errors=True)
    print(json.dumps(result))


# ---------------------------------------------------------------- the report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="200 MB JSONL, memory at 600 MB vs 2.4 GB, 2 rounds")
    parser.add_argument("--jsonl-mb", type=int, default=None, help="JSONL size for throughput (default 1000)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--tmp", default=None, help="where the temp inputs and outputs go")
    parser.add_argument("--ray", action="store_true", help="the Ray engine against the local one (1 and 2 workers)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_main(json.loads(args.child))
        return
    if args.ray:
        ray_main(args.jsonl_mb or (200 if args.quick else 1000), args.rounds or 3, args.tmp)
        return
    jsonl_mb = args.jsonl_mb or (200 if args.quick else 1000)
    rounds = args.rounds or (2 if args.quick else 3)
    # below two shards (2 x 256 MB in flight) peak memory still grows with the input, so the
    # smaller memory run is never under 600 MB
    memory_mb = (max(jsonl_mb, 600), 4 * max(jsonl_mb, 600))

    work = Path(tempfile.mkdtemp(prefix="tierflow-packbench-", dir=args.tmp))
    try:
        root, members = stdlib_files()
        tree_bytes = sum((root / m).stat().st_size for m in members)
        jsonl = work / "synthetic.jsonl"
        t = time.perf_counter()
        size = make_jsonl(jsonl, jsonl_mb * 1_000_000)
        print(
            f"inputs: stdlib {root} ({len(members):,} *.py files, {tree_bytes / 1e6:.1f} MB); "
            f"synthetic JSONL {size / 1e6:.0f} MB (made in {time.perf_counter() - t:.1f} s); "
            f"{args.workers} processes, codec {CODEC}, {rounds} rounds, {os.cpu_count()} cores"
        )
        cases = []
        for kind, source in (("stdlib", str(root)), ("jsonl", str(jsonl))):
            cases.append((kind, "floor", None, source))
            cases.append((kind, "tierflow", None, source))
            cases.append((kind, "tierflow", "bytes", source))
        results: dict[tuple, list[dict]] = {c[:3]: [] for c in cases}
        for r, (kind, engine, tok, source) in alternating(rounds, cases):
            spec = {
                "engine": engine,
                "kind": "jsonl" if kind == "jsonl" else "tree",
                "source": source,
                "out": str(work / "out"),
                "workers": args.workers,
                "tokenizer": tok,
            }
            res = run_child(spec)
            results[(kind, engine, tok)].append(res)
            print(
                f"  round {r + 1} {kind:6} {engine:8} {tok or '-':5} {res['seconds']:6.2f} s  "
                f"{res['input_bytes'] / 1e6 / res['seconds']:6.1f} MB/s  "
                f"CPU {res['cpu_seconds']:6.2f} s  peak PSS {res['peak_pss'] / 2**20:6.0f} MiB",
                flush=True,
            )

        print()
        print(
            f"{'input':7} {'engine':9} {'tokens':7} {'MB/s median (range)':>22} {'files/s':>10} "
            f"{'x floor':>8} {'CPU s/GB':>9} {'floor CPU/ours':>15} {'out MB':>8} {'peak PSS MiB':>12}"
        )
        verdicts = []
        for kind in ("stdlib", "jsonl"):
            floor_cpu = statistics.median(
                x["cpu_seconds"] / x["input_bytes"] * 1e9 for x in results[(kind, "floor", None)]
            )
            floor_mbs = statistics.median(x["input_bytes"] / 1e6 / x["seconds"] for x in results[(kind, "floor", None)])
            for engine, tok in (("floor", None), ("tierflow", None), ("tierflow", "bytes")):
                runs = results[(kind, engine, tok)]
                mbs = [x["input_bytes"] / 1e6 / x["seconds"] for x in runs]
                files = statistics.median(x["files"] / x["seconds"] for x in runs)
                ratio = statistics.median(mbs) / floor_mbs
                cpu = statistics.median(x["cpu_seconds"] / x["input_bytes"] * 1e9 for x in runs)
                print(
                    f"{kind:7} {engine:9} {tok or '-':7} {spread(mbs):>22} {files:10,.1f} {ratio:8.2f} {cpu:9.2f} {floor_cpu / cpu:15.2f} "
                    f"{statistics.median(x['out_bytes'] for x in runs) / 1e6:8.1f} "
                    f"{max(x['peak_pss'] for x in runs) / 2**20:12.0f}"
                )
                if engine == "tierflow":
                    verdicts.append((f"{kind} {tok or 'no tokens'}", ratio, floor_cpu / cpu))
        print()
        for label, ratio, cpu_ratio in verdicts:
            print(
                f"target tierflow >= 0.6x floor, {label:18}: {ratio:.2f}x wall  {'met' if ratio >= 0.6 else 'MISSED'}"
                f"  ({cpu_ratio:.2f}x by CPU per GB)"
            )

        if not args.skip_memory:
            print()
            jsonl.unlink()
            peaks = []
            for mb in memory_mb:
                path = work / f"memory-{mb}.jsonl"
                make_jsonl(path, mb * 1_000_000, seed=mb)
                res = run_child(
                    {
                        "engine": "tierflow",
                        "kind": "jsonl",
                        "source": str(path),
                        "out": str(work / "out"),
                        "workers": args.workers,
                        "tokenizer": None,
                    }
                )
                path.unlink()
                peaks.append(res["peak_pss"])
                print(
                    f"memory: JSONL {mb:6,} MB  {res['seconds']:6.1f} s  "
                    f"{res['input_bytes'] / 1e6 / res['seconds']:6.1f} MB/s  peak PSS {res['peak_pss'] / 2**20:7.0f} MiB"
                )
            growth = peaks[1] / peaks[0] - 1
            print(
                f"target peak PSS at {memory_mb[1]:,} MB within 10% of {memory_mb[0]:,} MB: "
                f"{growth:+.1%}  {'met' if abs(growth) <= 0.10 else 'MISSED'}"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)


def ray_main(jsonl_mb: int, rounds: int, tmp: str | None) -> None:
    """Ray vs local on one JSONL with byte tokens, 1 and 2 workers, medians of alternating rounds."""
    work = Path(tempfile.mkdtemp(prefix="tierflow-raybench-", dir=tmp))
    try:
        jsonl = work / "synthetic.jsonl"
        size = make_jsonl(jsonl, jsonl_mb * 1_000_000)
        print(f"input: synthetic JSONL {size / 1e6:.0f} MB, byte tokens, {rounds} rounds, {os.cpu_count()} cores")
        cases = [(engine, workers) for workers in (1, 2) for engine in ("local", "ray")]
        results: dict[tuple, list[dict]] = {c: [] for c in cases}
        rows = [(engine, workers) for workers in (1, 2) for engine in ("local", "ray", "ray warm")]
        for r, (engine, workers) in alternating(rounds, cases):
            res = run_child(
                {
                    "engine": "tierflow" if engine == "local" else "ray",
                    "kind": "jsonl",
                    "source": str(jsonl),
                    "out": str(work / "out"),
                    "workers": workers,
                    "tokenizer": "bytes",
                }
            )
            results[(engine, workers)].append(res)
            print(
                f"  round {r + 1} {engine:5} x{workers} {res['seconds']:6.2f} s  "
                f"{res['input_bytes'] / 1e6 / res['seconds']:6.1f} MB/s  peak PSS {res['peak_pss'] / 2**20:6.0f} MiB",
                flush=True,
            )
        ids = {x["dataset_id"] for runs in results.values() for x in runs}
        print()
        print(
            f"{'engine':8} {'workers':>7} {'MB/s median (range)':>22} {'units/s':>8} {'ray/local':>9} "
            f"{'driver PSS MiB':>14} {'tree PSS MiB':>12} {'ray start s':>11}"
        )
        for engine, workers in rows:
            runs = results[(engine.split()[0], workers)]
            key = "warm_seconds" if engine == "ray warm" else "seconds"
            runs = [{**x, "seconds": x[key]} for x in runs]
            mbs = [x["input_bytes"] / 1e6 / x["seconds"] for x in runs]
            base = statistics.median(x["input_bytes"] / 1e6 / x["seconds"] for x in results[("local", workers)])
            units = statistics.median(-(-x["input_bytes"] // CHUNK_BYTES) / x["seconds"] for x in runs)
            start = spread([x.get("startup_seconds") for x in runs], ".2f")
            print(
                f"{engine:8} {workers:7} {spread(mbs):>22} {units:8.2f} {statistics.median(mbs) / base:9.2f} "
                f"{max(x['driver_pss'] for x in runs) / 2**20:14.0f} {max(x['peak_pss'] for x in runs) / 2**20:12.0f} "
                f"{start:>11}"
            )
        print(f"\nsame dataset id in every run: {'yes' if len(ids) == 1 else 'NO: ' + ', '.join(sorted(ids))}")
        for engine in ("ray", "ray warm"):
            key = "warm_seconds" if engine == "ray warm" else "seconds"
            per_core = statistics.median(x["input_bytes"] / x[key] for x in results[("ray", 2)]) / 2
            print(
                f"{engine}: {per_core / 1e6:.1f} MB/s per core at 2 workers = "
                f"{per_core * 100 * 3600 / 1e12:.2f} TB of raw JSONL per hour per 100 cores"
            )
        print(
            "  assuming: units scale linearly across cores and nodes (they are independent and each task "
            "writes its shards to the destination), the input is read at page-cache speed (no storage or "
            "network bound), byte tokens (a BPE tokenizer costs more per byte), and this shared 2-core machine's "
            "per-core rate"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
