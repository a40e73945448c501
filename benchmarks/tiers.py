"""Benchmark of the tier stack: warm reads per tier form, cold staging from a throttled S3, CPU per GB.

It decides whether L1 (decoded shards on tmpfs) is on by default: only if it reads faster than
"L2 decoded + page cache" on this machine. Everything runs in one process on a dataset this
script packs itself (synthetic text, byte tokens, zstd shards of ~12 MB decoded), each
measurement in rounds that alternate between the configurations compared:

1. Warm reads: a fresh stack per round reads every sample of a random subset of shards, in a
   random order, through `stack.dataset()`, copying each token array into a batch buffer
   (so every byte is touched). L2 decoded (mapped file on disk, page cache warm), L2 at rest
   (zstd, decoded on open), L1 decoded on /dev/shm above L2, and the plain page cache
   (`open_dataset` on an uncompressed pack) as the bound.
2. Cold staging: moto's S3 behind a `ProxyProcess` throttled to each rate; 2-4 threads of
   this process call `stack.ensure` on every shard into an empty L2. Achieved rate = at-rest
   bytes / wall time, against the throttle (target >= 90%).
3. CPU-seconds per GB staged: `time.process_time()` of this process over the staging (moto
   and the proxy run in child processes, so their CPU is not counted).

Run: .venv/bin/python benchmarks/tiers.py [--text-mb 130] [--rounds 5] [--throttles 50,100,200,0] [--threads 3]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from collections.abc import Callable

import numpy as np

import tierflow
from tierflow.format.dataset import Dataset
from tierflow.format.reader import ShardReader
from tierflow.storage.datasets import open_dataset
from tierflow.tiers import TierConfig, TierStack, build_stack
from _harness import round_order, s3_rig, spread

MB = 1e6
TIER_CAPACITY = 4 << 30
WINDOW_TOKENS = 1 << 20
L2_DECODED = "L2 decoded (disk, page cache warm)"
L2_AT_REST = "L2 at_rest (zstd, decode on open)"
L1_DECODED = "L1 decoded (/dev/shm) over L2"
PAGE_CACHE = "page cache: open_dataset, no tiers"


# ---------------------------------------------------------------- dataset


def write_corpus(path: Path, text_bytes: int, seed: int = 0) -> int:
    """Zipf-distributed made-up words in documents of log-normal length; returns the document count."""
    rng = np.random.default_rng(seed)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", np.uint8)
    vocab_size = 20_000
    vocab = np.array(
        [bytes(rng.choice(letters, int(rng.integers(2, 11)))).decode() for _ in range(vocab_size)], dtype=object
    )
    weights = 1.0 / np.arange(1, vocab_size + 1) ** 1.1
    words_needed = text_bytes // 6 + 1
    stream = vocab[rng.choice(vocab_size, size=words_needed, p=weights / weights.sum())]
    lengths = (rng.lognormal(6.3, 0.8, size=words_needed // 100 + 1) + 5).astype(np.int64)
    documents = 0
    start = 0
    with open(path, "w") as out:
        for length in lengths:
            if start >= words_needed:
                break
            out.write(json.dumps({"text": " ".join(stream[start : start + length])}) + "\n")
            start += int(length)
            documents += 1
    return documents


def pack_datasets(root: Path, text_mb: int, shard_mb: int) -> tuple[Path, Path]:
    """The same corpus packed twice: zstd shards (what tiers stage) and uncompressed (the bound)."""
    corpus = root / "corpus.jsonl"
    write_corpus(corpus, text_mb << 20)
    packed = {}
    for compression in ("zstd", "none"):
        out = root / f"packed-{compression}"
        tierflow.pack(
            [str(corpus)], out, workers=2, target_shard_bytes=shard_mb << 20, tokenizer="bytes", compression=compression
        )
        packed[compression] = out
    corpus.unlink()
    return packed["zstd"], packed["none"]


# ---------------------------------------------------------------- helpers


def warm_stack(stack: TierStack) -> None:
    manifest = stack.manifest()
    for info in manifest.shards:
        stack.ensure(info).release()


def read_every_sample(dataset: Dataset, order: list[int], buffer: np.ndarray) -> tuple[float, float, int]:
    """(wall s, CPU s, token bytes) to copy the tokens of each sample in `order` into `buffer`."""
    moved = 0
    cpu, wall = time.process_time(), time.perf_counter()
    for index in order:
        tokens = dataset[index]["tokens"]
        buffer[: len(tokens)] = tokens
        moved += tokens.nbytes
    return time.perf_counter() - wall, time.process_time() - cpu, moved


def read_token_windows(dataset: Dataset, windows: list[tuple[int, int]], buffer: np.ndarray) -> tuple[float, int]:
    """(wall s, token bytes) to copy each [start, stop) of the token stream into `buffer`: the
    medium's speed with little Python per byte, as sequence packing reads it."""
    moved = 0
    wall = time.perf_counter()
    for start, stop in windows:
        tokens = dataset.tokens(start, stop)
        buffer[: len(tokens)] = tokens
        moved += tokens.nbytes
    return time.perf_counter() - wall, moved


def shard_opens(dataset: Dataset) -> int:
    """How many times the reader opened (verified, mapped or decoded) a shard."""
    source = dataset.source
    if isinstance(source, ShardReader):
        return source.opens
    return int(sum(counter.value for counter in source.m_served.values()))


# ---------------------------------------------------------------- 1. warm reads


def warm_reads(zstd_dir: Path, plain_dir: Path, work: Path, shm: Path, rounds: int, subset: int) -> None:
    l2_decoded, l2_at_rest, l1 = work / "L2-decoded", work / "L2-at-rest", shm / "L1"

    def l2_decoded_stack() -> TierStack:
        return build_stack(str(zstd_dir), [TierConfig("L2", str(l2_decoded), TIER_CAPACITY, form="decoded")])

    def l2_at_rest_stack() -> TierStack:
        return build_stack(str(zstd_dir), [TierConfig("L2", str(l2_at_rest), TIER_CAPACITY, form="at_rest")])

    def l1_stack() -> TierStack:
        return build_stack(
            str(zstd_dir),
            [
                TierConfig("L1", str(l1), TIER_CAPACITY, form="decoded"),
                TierConfig("L2", str(l2_decoded), TIER_CAPACITY, form="decoded"),
            ],
        )

    configs: dict[str, Callable[[], Dataset]] = {
        L2_DECODED: lambda: l2_decoded_stack().dataset(),
        L2_AT_REST: lambda: l2_at_rest_stack().dataset(),
        L1_DECODED: lambda: l1_stack().dataset(),
        PAGE_CACHE: lambda: open_dataset(plain_dir),
    }
    for make in (l2_decoded_stack, l2_at_rest_stack, l1_stack):
        warm_stack(make())
    reference = open_dataset(plain_dir)
    for make_dataset in configs.values():  # every file read once: the page cache is warm
        dataset = make_dataset()
        for s in range(len(dataset.manifest.shards)):
            dataset.shard(s)
    starts, token_starts = reference.sample_starts, reference.token_starts
    shards = len(reference.manifest.shards)
    subset = min(subset, shards)
    largest = max(int(s.decoded_bytes) for s in reference.manifest.shards)
    buffer = np.empty(largest, dtype=reference[0]["tokens"].dtype)
    rng = random.Random(1)
    results: dict[str, dict[str, list[float]]] = {
        name: {"gbs": [], "us": [], "cpu_us": [], "opens": [], "window_gbs": [], "open_ms": []} for name in configs
    }
    for round_number in range(rounds):
        chosen = rng.sample(range(shards), subset)
        order = [i for s in chosen for i in range(int(starts[s]), int(starts[s + 1]))]
        rng.shuffle(order)
        windows = [
            (start, min(start + WINDOW_TOKENS, int(token_starts[s + 1])))
            for s in chosen
            for start in range(int(token_starts[s]), int(token_starts[s + 1]), WINDOW_TOKENS)
        ]
        rng.shuffle(windows)
        for name in round_order(round_number, list(configs)):
            r = results[name]
            dataset = configs[name]()
            wall, cpu, moved = read_every_sample(dataset, order, buffer)
            r["gbs"].append(moved / wall / 1e9)
            r["us"].append(wall / len(order) * 1e6)
            r["cpu_us"].append(cpu / len(order) * 1e6)
            r["opens"].append(shard_opens(dataset))
            opened = configs[name]()
            if isinstance(opened.source, TierStack):
                opened.source.max_open = subset
            for s in chosen:
                opened.shard(s)
            wall, window_bytes = read_token_windows(opened, windows, buffer)
            r["window_gbs"].append(window_bytes / wall / 1e9)
            fresh = configs[name]()
            began = time.perf_counter()
            for s in chosen:
                fresh.shard(s)
            r["open_ms"].append((time.perf_counter() - began) / len(chosen) * 1e3)
    bound = results[PAGE_CACHE]
    print(
        f"\n1. Warm reads of {subset} random shards of {shards} per round ({moved / MB:.0f} MB of tokens), "
        f"a fresh stack per pass; median (min-max) of {rounds} alternating rounds"
    )
    print("   per sample: every sample in random order, tokens copied into a batch buffer (opens included)")
    print(
        f"   windows: the same shards' token stream in {WINDOW_TOKENS >> 20}M-token windows, random order, "
        f"shards opened beforehand (the medium alone)"
    )
    print("   ms/open: first access of each shard on a fresh stack (verify, map or decode)")
    print(
        f"{'configuration':<36} {'per sample GB/s':>16} {'us/sample':>17} {'CPU us/sample':>17} {'x page':>6} "
        f"{'opens':>5} {'windows GB/s':>16} {'x page':>6} {'ms/open':>16}"
    )
    for name, r in results.items():
        print(
            f"{name:<36} {spread(r['gbs'], '.2f'):>16} {spread(r['us'], '.1f'):>17} "
            f"{spread(r['cpu_us'], '.1f'):>17} "
            f"{statistics.median(r['gbs']) / statistics.median(bound['gbs']):>6.2f} "
            f"{statistics.median(r['opens']):>5.0f} {spread(r['window_gbs'], '.2f'):>16} "
            f"{statistics.median(r['window_gbs']) / statistics.median(bound['window_gbs']):>6.2f} "
            f"{spread(r['open_ms'], '.1f'):>16}"
        )
    print(f"   (opens: shard opens in the per-sample pass, {subset} = each shard once)")
    l1, l2 = results[L1_DECODED], results[L2_DECODED]
    verdicts = []
    for key, label in (("gbs", "per sample"), ("window_gbs", "windows")):
        ratio = statistics.median(l1[key]) / statistics.median(l2[key])
        beats = min(l1[key]) > max(l2[key])
        verdicts.append(beats)
        print(
            f"L1 / L2 decoded, {label}: {ratio:.2f} (median); {'beats' if beats else 'does not beat'} "
            f"L2 decoded + page cache outside the spread of rounds"
        )
    print(f"-> L1 {'may be on by default' if all(verdicts) else 'stays opt-in'} on this machine")


# ---------------------------------------------------------------- 2 + 3. cold staging


def stage_all(stack: TierStack, threads: int) -> None:
    manifest = stack.manifest()

    def ensure(info) -> None:
        stack.ensure(info).release()

    with ThreadPoolExecutor(threads, thread_name_prefix="bench-stage") as pool:
        list(pool.map(ensure, manifest.shards))


def cold_staging(zstd_dir: Path, work: Path, throttles_mb: list[float], rounds: int, threads: int) -> None:
    manifest = open_dataset(zstd_dir).manifest
    at_rest_bytes = sum(s.bytes for s in manifest.shards)
    decoded_bytes = sum(s.decoded_bytes for s in manifest.shards)
    rows = []
    with s3_rig("tierbench") as rig:
        proxy = rig.proxy
        url = rig.upload(zstd_dir, "ds")
        for throttle in throttles_mb:
            proxy.set_bandwidth(throttle * MB if throttle else None)
            measured: dict[str, dict[str, list[float]]] = {
                f: {"rate": [], "cpu": [], "cores": [], "wire": []} for f in ("at_rest", "decoded")
            }
            for round_number in range(rounds):
                for form in round_order(round_number, ["at_rest", "decoded"]):
                    root = work / f"stage-{throttle:g}-{round_number}-{form}"
                    stack = build_stack(
                        url, [TierConfig("L2", str(root), TIER_CAPACITY, form=form)], endpoint_url=proxy.url
                    )
                    stack.manifest()
                    proxy.reset_counters()
                    cpu, wall = time.process_time(), time.perf_counter()
                    stage_all(stack, threads)
                    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
                    wire = proxy.traffic().response_bytes()
                    m = measured[form]
                    m["rate"].append(at_rest_bytes / wall / MB)
                    m["cpu"].append(cpu / (at_rest_bytes / 1e9))
                    m["cores"].append(cpu / wall)
                    m["wire"].append(wire / at_rest_bytes)
                    shutil.rmtree(root)
            rows.append((throttle, measured))
    print(
        f"\n2+3. Cold staging of all {len(manifest.shards)} shards ({at_rest_bytes / MB:.0f} MB at rest, "
        f"{decoded_bytes / MB:.0f} MB decoded) from moto S3 behind a throttled proxy into an empty L2, "
        f"{threads} threads calling stack.ensure; median (min-max) of {rounds} alternating rounds"
    )
    print("   CPU: process CPU time of this process (all its threads) while staging; stored = bytes written to L2")
    print(
        f"{'throttle MB/s':>13} {'L2 form':>8} {'staged MB/s':>20} {'of throttle':>11} {'>=90%':>5} "
        f"{'CPU s/GB fetched':>20} {'CPU s/GB stored':>15} {'CPU cores':>9} {'wire/shards':>11}"
    )
    for throttle, measured in rows:
        for form, m in measured.items():
            stored = at_rest_bytes if form == "at_rest" else decoded_bytes
            per_stored = statistics.median(m["cpu"]) * at_rest_bytes / stored
            if throttle:
                share = statistics.median(m["rate"]) / throttle
                limit, of_limit, verdict = f"{throttle:.0f}", f"{share:.1%}", "met" if share >= 0.9 else "MISS"
            else:
                limit, of_limit, verdict = "none (rig)", "-", "-"
            print(
                f"{limit:>13} {form:>8} {spread(m['rate'], '.1f'):>20} {of_limit:>11} {verdict:>5} "
                f"{spread(m['cpu'], '.2f'):>20} {per_stored:>15.2f} "
                f"{statistics.median(m['cores']):>9.2f} {statistics.median(m['wire']):>11.3f}"
            )


# ---------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text-mb", type=int, default=130, help="synthetic text to pack (decoded ~2x, uint16)")
    parser.add_argument("--shard-mb", type=int, default=12, help="decoded shard size")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--subset", type=int, default=8, help="shards read per warm-read round")
    parser.add_argument(
        "--throttles",
        default="50,100,200,0",
        help="proxy bandwidths, MB/s; 0 = unthrottled, the rig's own ceiling on this machine",
    )
    parser.add_argument("--threads", type=int, default=3, help="staging threads")
    parser.add_argument("--skip", choices=("reads", "staging"), help="leave one part out")
    args = parser.parse_args()
    logging.getLogger("tierflow").setLevel(logging.ERROR)  # small shards warn at pack time

    began = time.perf_counter()
    shm_base = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else None
    with (
        tempfile.TemporaryDirectory(prefix="tierbench-") as tmp,
        tempfile.TemporaryDirectory(prefix="tierbench-", dir=shm_base) as shm,
    ):
        work = Path(tmp)
        zstd_dir, plain_dir = pack_datasets(work, args.text_mb, args.shard_mb)
        reference = open_dataset(zstd_dir)
        infos = reference.manifest.shards
        print(
            f"dataset: {len(infos)} shards, {len(reference)} samples, {reference.num_tokens / 1e6:.0f} M uint16 "
            f"tokens; {sum(s.decoded_bytes for s in infos) / MB:.0f} MB decoded, "
            f"{sum(s.bytes for s in infos) / MB:.0f} MB zstd; packed in {time.perf_counter() - began:.0f} s; "
            f"L1 on {shm}, L2 on {tmp}; {os.cpu_count()} CPUs"
        )
        if args.skip != "reads":
            warm_reads(zstd_dir, plain_dir, work, Path(shm), args.rounds, args.subset)
        if args.skip != "staging":
            throttles = [float(t) for t in args.throttles.split(",")]
            cold_staging(zstd_dir, work, throttles, args.rounds, args.threads)
    print(f"\ntotal {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
