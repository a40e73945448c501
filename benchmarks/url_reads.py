"""What `open_loader(s3 url)` without tiers costs the store: shard GETs, bytes and seconds per epoch.

Packs a JSONL corpus (`write_corpus`, `--docs` records: 8,000 make ~4.9 MB of text) with the packer's
defaults or `--shard-bytes`/`--block-bytes`, uploads it to moto behind the loopback proxy (which counts
every request and byte), and reads epochs with `open_loader(url, batch_size=8, seq_len=256)`, no tiers,
no workers. Per round: the first batch's shard GETs and bytes, and the epoch's (first batch included)
GETs, bytes and seconds; the table gives the medians over `--rounds` (each a fresh loader).
Tree-agnostic (only public entry points and the test rig), so it runs against any checkout:
  PYTHONPATH=<tree>/src .venv/bin/python benchmarks/url_reads.py --docs 8000 --shard-bytes 256K --block-bytes 64K
On moto a GET costs ~1 ms; on S3 10-50 ms, so the GET count is the figure that carries over.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path

import tierflow
from tierflow.format.manifest import Manifest
from tierflow.storage.remote import upload_dataset
from tierflow.testing import LoopbackProxy, MotoS3Server
from tierflow.testing.faults import write_corpus
from tierflow.testing.s3server import fake_credentials_env


def size(text: str | None) -> int | None:
    if text is None:
        return None
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=8000)
    parser.add_argument("--shard-bytes", default=None, help="target_shard_bytes (default: the packer's)")
    parser.add_argument("--block-bytes", default=None, help="block_bytes (default: the packer's)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the rounds here")
    args = parser.parse_args()
    logging.getLogger("tierflow.pack").setLevel(logging.ERROR)  # small shards warn
    os.environ.update(fake_credentials_env())
    tmp = Path(tempfile.mkdtemp(prefix="url-reads-"))
    raw = write_corpus(tmp / "raw.jsonl", docs=args.docs, seed=1)
    options = {
        k: v
        for k, v in {"target_shard_bytes": size(args.shard_bytes), "block_bytes": size(args.block_bytes)}.items()
        if v is not None
    }
    tierflow.pack([raw], tmp / "ds", workers=1, tokenizer="bytes", **options)
    shards = sorted((tmp / "ds").glob("shard-*"))
    total = sum(p.stat().st_size for p in shards)
    blocks = sum(len(s.blocks) for s in Manifest.load(tmp / "ds").shards)
    rounds = []
    with MotoS3Server() as server, LoopbackProxy(server.endpoint_url) as proxy:
        url = f"s3://{server.create_bucket()}/ds"
        upload_dataset(tmp / "ds", url, endpoint_url=server.endpoint_url)
        for _ in range(args.rounds):
            proxy.reset_counters()
            with tierflow.open_loader(url, endpoint_url=proxy.url, batch_size=8, seq_len=256) as loader:
                started = time.perf_counter()
                it = iter(loader)
                next(it)
                first = proxy.traffic()
                n = 1 + sum(1 for _ in it)
                seconds = time.perf_counter() - started
            epoch = proxy.traffic()
            rounds.append(
                {
                    "first_gets": first.requests("GET", "shard-"),
                    "first_bytes": first.response_bytes("GET", "shard-"),
                    "gets": epoch.requests("GET", "shard-"),
                    "bytes": epoch.response_bytes("GET", "shard-"),
                    "seconds": seconds,
                    "batches": n,
                }
            )
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    print(
        f"dataset: {len(shards)} shards, {blocks} blocks, {total / 1e6:.2f} MB at rest "
        f"(corpus {raw.stat().st_size / 1e6:.1f} MB, options {options or 'defaults'})"
    )
    print(
        f"first batch: {med['first_gets']:.0f} GETs, {med['first_bytes'] / 1e6:.3f} MB; "
        f"epoch ({med['batches']:.0f} batches): {med['gets']:.0f} GETs, {med['bytes'] / 1e6:.3f} MB, "
        f"{med['seconds']:.2f} s (median of {len(rounds)}; seconds {[round(r['seconds'], 2) for r in rounds]})"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"shards": len(shards), "blocks": blocks, "bytes": total, "options": options, "rounds": rounds},
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
