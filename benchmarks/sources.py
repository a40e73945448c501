"""Benchmark of s3:// clients: client CPU-seconds per GB and requests, obstore against s3fs.

moto's S3 server and the metering proxy each run in their own process, so the CPU time read
here (time.process_time: every thread of this process, obstore's Rust runtime included) is
the client's alone. For each client: whole-object downloads streamed to a file, and ranged
reads of single 1 MiB blocks; first the bare library, then tierflow's source on top of it
(retries, budget accounting, metrics). moto's own speed is not what is measured; wall MB/s
is printed for context only. The proxy counts the requests each client made.
Run: .venv/bin/python benchmarks/sources.py [--objects 8] [--object-mb 32] [--blocks 128]
(the s3fs rows need s3fs: `pip install s3fs`, or the bench extra; without it, obstore rows only)
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tierflow.telemetry.metrics import MetricsRegistry
from _harness import s3_rig
from tierflow.testing import ProxyProcess, S3Endpoint
from tierflow.storage.budget import BandwidthBudget
from tierflow.storage.fsspec_store import FsspecStore
from tierflow.storage.s3 import S3Store

BLOCK = 1 << 20


def measure(label: str, run: Callable[[], int], proxy: ProxyProcess) -> dict[str, float | str]:
    proxy.reset_counters()
    cpu, wall = time.process_time(), time.perf_counter()
    moved = run()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    requests = proxy.traffic().requests()
    gigabytes = moved / 1e9
    return {
        "label": label,
        "gb": gigabytes,
        "cpu_per_gb": cpu / gigabytes,
        "mb_s": moved / 1e6 / wall,
        "requests": requests,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=8)
    parser.add_argument("--object-mb", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=128, help="ranged 1 MiB reads per client")
    args = parser.parse_args()
    size = args.object_mb << 20
    names = [f"shard-{i:04d}.arrow" for i in range(args.objects)]
    rng = random.Random(0)
    offsets = [(rng.choice(names), rng.randrange(0, size - BLOCK)) for _ in range(args.blocks)]

    with s3_rig("bench") as rig, tempfile.TemporaryDirectory() as tmp:
        proxy, bucket = rig.proxy, rig.bucket
        payload = Path(tmp) / "payload"
        payload.write_bytes(os.urandom(size))
        endpoint = S3Endpoint(proxy.url)
        seeder = endpoint.boto3_client()
        for name in names:
            seeder.upload_file(str(payload), bucket, f"ds/{name}")
        dst = Path(tmp) / "dst"

        import obstore
        from obstore.store import S3Store

        try:  # imported before timing, like obstore
            import s3fs
        except ImportError:
            s3fs = None
            print("s3fs is not installed (it comes with the bench extra, never with s3): obstore rows only")
        store = S3Store(bucket, prefix="ds", **endpoint.obstore_options())
        budget = BandwidthBudget(1e12, path=Path(tmp) / "budget")  # charged, never binding
        ours_obstore = S3Store(f"s3://{bucket}/ds", endpoint_url=proxy.url, budget=budget, registry=MetricsRegistry())
        if s3fs is not None:
            filesystem = s3fs.S3FileSystem(**endpoint.s3fs_storage_options(), skip_instance_cache=True)
            ours_s3fs = FsspecStore(
                f"s3://{bucket}/ds",
                storage_options=endpoint.s3fs_storage_options(),
                budget=budget,
                registry=MetricsRegistry(),
            )

        def obstore_download() -> int:
            moved = 0
            for name in names:
                with open(dst, "wb") as out:
                    for chunk in obstore.get(store, name).stream(min_chunk_size=BLOCK):
                        moved += out.write(chunk)
            return moved

        def s3fs_download() -> int:
            for name in names:
                filesystem.get_file(f"{bucket}/ds/{name}", str(dst))
            return size * len(names)

        def obstore_ranges() -> int:
            return sum(len(obstore.get_range(store, n, start=o, length=BLOCK)) for n, o in offsets)

        def s3fs_ranges() -> int:
            return sum(len(filesystem.cat_file(f"{bucket}/ds/{n}", start=o, end=o + BLOCK)) for n, o in offsets)

        def ours_download(source: S3Store | FsspecStore) -> Callable[[], int]:
            return lambda: sum(source.download(name, dst, expected_size=size) for name in names)

        def ours_ranges(source: S3Store | FsspecStore) -> Callable[[], int]:
            return lambda: sum(len(source.read_range(n, o, BLOCK)) for n, o in offsets)

        runs = [
            ("download  obstore (bare)", obstore_download),
            ("download  tierflow S3Store (obstore)", ours_download(ours_obstore)),
            ("1MiB range obstore (bare)", obstore_ranges),
            ("1MiB range tierflow S3Store (obstore)", ours_ranges(ours_obstore)),
        ]
        obstore_ranges()  # warm: connections, credentials, imports
        if s3fs is not None:
            s3fs_ranges()
            runs += [
                ("download  s3fs (bare, get_file)", s3fs_download),
                ("download  tierflow FsspecStore (s3fs)", ours_download(ours_s3fs)),
                ("1MiB range s3fs (bare, cat_file)", s3fs_ranges),
                ("1MiB range tierflow FsspecStore (s3fs)", ours_ranges(ours_s3fs)),
            ]
        rows = [measure(label, run, proxy) for label, run in runs]

    print(
        f"\n{args.objects} objects x {args.object_mb} MiB downloaded, {args.blocks} ranged 1 MiB reads, "
        "through the loopback proxy; moto and the proxy in other processes\n"
    )
    header = f"{'client / operation':42} {'GB':>6} {'CPU s/GB':>9} {'vs best':>8} {'requests':>9} {'wall MB/s':>10}"
    print(header)
    print("-" * len(header))
    for kind in ("download", "1MiB range"):
        group = [r for r in rows if str(r["label"]).startswith(kind)]
        best = min(float(r["cpu_per_gb"]) for r in group)
        for r in group:
            print(
                f"{r['label']:42} {r['gb']:6.3f} {r['cpu_per_gb']:9.3f} {float(r['cpu_per_gb']) / best:7.2f}x "
                f"{r['requests']:9d} {r['mb_s']:10.0f}"
            )


if __name__ == "__main__":
    main()
