"""Benchmark of the cache's central promise: bytes from the object store per epoch, at every L2 size.

A user's setup with defaults only: the standard library's *.py files packed into ~512 KB
byte-token shards, served by moto's S3 behind a metering proxy (each in its own process; GET
bytes are counted where the server answers them), one L2 directory of a given capacity (a share
of the decoded dataset), `TieredDataset(stack.dataset(), batch_size=16, seq_len=512)` with the
stager, `Loader(...)` (one epoch per `for`), three epochs, no step. Per capacity: bytes per epoch
against the dataset at rest, as run (live), as `tierflow plan` predicts it before the run, and
the optimum (Belady's MIN with bypass with the same room: L2 and the staging area); then the
issue's hand-tuned configuration (partitions=2, window_shards=2) beside it, and the default
with 2 DataLoader workers (they share the node's staging area). Epoch n's bytes are those
fetched while the loop consumed epoch n, the stager's lookahead into n + 1 included.

Run: .venv/bin/python benchmarks/cache.py [--fractions 5,10,30,60,90,120] [--quick]
"""

from __future__ import annotations

import argparse
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

from _harness import s3_rig
from tierflow.commands.demo import INCLUDE, STDLIB_EXCLUDE, stdlib_dir
from tierflow.storage.datasets import open_dataset
from tierflow.loader import Loader, TieredDataset
from tierflow.commands.plan import plan_cache
from tierflow.tiers.stager import Stager
from tierflow.pack.packer import pack
from tierflow.testing import ProxyProcess
from tierflow.tiers import TierConfig, build_stack

TARGETS = {0.05: 1.0, 0.10: 0.93, 0.30: 0.75, 0.60: 0.45, 0.90: 0.15}
EPOCHS = 3


def run_epochs(url: str, proxy: ProxyProcess, l2: Path, capacity: int, dataset_bytes: int, workers: int = 0,
               **order: Any) -> tuple[list[float], TieredDataset]:
    """Bytes GET from S3 per epoch / dataset at rest, one `for` per epoch."""
    shutil.rmtree(l2, ignore_errors=True)
    stack = build_stack(url, [TierConfig("L2", str(l2), capacity)], endpoint_url=proxy.url)
    ds = TieredDataset(stack.dataset(), batch_size=16, seq_len=512, **order)
    loader = Loader(ds, stager=Stager(ds, stack), num_workers=workers)
    ratios = []
    for _ in range(EPOCHS):
        proxy.reset_counters()
        for _batch in loader:
            pass
        ratios.append(proxy.traffic().response_bytes(method="GET") / dataset_bytes)
    loader.close()
    stack.close()
    return ratios, ds


def fmt(values: list[float]) -> str:
    return " ".join(f"{v:5.2f}" for v in values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fractions", default="5,10,30,60,90,120", help="L2 capacities, %% of the decoded dataset")
    parser.add_argument("--quick", action="store_true", help="10%% and 30%% only, no tuned or worker rows")
    args = parser.parse_args()
    logging.getLogger("tierflow").setLevel(logging.ERROR)
    fractions = [0.1, 0.3] if args.quick else [int(f) / 100 for f in args.fractions.split(",")]
    with tempfile.TemporaryDirectory() as tmp, s3_rig("cachebench") as rig:
        proxy = rig.proxy
        work = Path(tmp)
        local = work / "dataset"
        pack([stdlib_dir()], local, target_shard_bytes=512 << 10, include=INCLUDE, exclude=STDLIB_EXCLUDE,
             tokenizer="bytes", overwrite=True)
        shards = open_dataset(local).manifest.shards
        at_rest, decoded = sum(s.bytes for s in shards), sum(s.decoded_bytes for s in shards)
        url = rig.upload(local, "stdlib")
        print(f"{len(shards)} shards, {at_rest / 1e6:.1f} MB at rest, {decoded / 1e6:.1f} MB decoded; "
              f"bytes GET from S3 per epoch / dataset at rest, epochs 1-{EPOCHS}; defaults unless named")
        header = (f"{'L2':>5} {'lanes x k':>9} {'staging MB':>10} | {'live (defaults)':>17} | {'predicted':>17} | "
                  f"{'optimum':>17} | {'target warm':>11} | {'hand-tuned':>17} | {'2 workers':>17}")
        print(header)
        print("-" * len(header))
        for fraction in fractions:
            capacity = int(fraction * decoded)
            live, ds = run_epochs(url, proxy, work / "l2", capacity, at_rest)
            plan = plan_cache(ds, capacity, epochs=EPOCHS)
            tuned = workers = "-"
            if not args.quick:
                tuned = fmt(run_epochs(url, proxy, work / "l2", capacity, at_rest, partitions=2, window_shards=2)[0])
                workers = fmt(run_epochs(url, proxy, work / "l2", capacity, at_rest, workers=2)[0])
            target = TARGETS.get(round(fraction, 2))
            warm = max(live[1:])
            verdict = "-" if target is None else f"{target:.2f} {'met' if warm <= target else 'MISS'}"
            print(f"{fraction:>5.0%} {ds.working_set.lanes:>5} x {ds.working_set.window_shards} "
                  f"{plan.staging / 1e6:>10.1f} | {fmt(live):>17} | {fmt([e.ratio for e in plan.predicted]):>17} | "
                  f"{fmt([e.ratio for e in plan.optimum]):>17} | {verdict:>11} | {tuned:>17} | {workers:>17}")


if __name__ == "__main__":
    main()
