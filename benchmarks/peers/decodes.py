"""Blocks each reading process decodes in one raw epoch: the main process alone, then 2 DataLoader workers.

Each worker keeps its own decoded blocks, and batches go to workers in turn, so a block whose samples
fall in batches of both workers is decoded by both. This counts it: every block load (read, verified,
decoded) is recorded per process id by instrumenting `LazyShardTable._load` in this process before
the workers fork. Reads run.py's packed datasets (make bench-peers ARGS="--only raw" builds them).

    .venv/bin/python benchmarks/peers/decodes.py [--work /tmp/tierflow-peers/full] [--workers 2]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile
import time
from pathlib import Path

import tierflow
from tierflow.format import table
from tierflow.format.shard import block_lists


def instrument(log_dir: Path) -> None:
    load = table.LazyShardTable._load

    def counted(self: table.LazyShardTable, block: int):  # type: ignore[no-untyped-def]
        started = time.process_time()
        slot = load(self, block)
        with open(log_dir / str(os.getpid()), "a") as log:
            log.write(f"{self.name} {block} {time.process_time() - started:.6f}\n")
        return slot

    table.LazyShardTable._load = counted  # type: ignore[method-assign]


def epoch(data: Path, kind: str, workers: int, log_dir: Path) -> dict[int, tuple[int, int, float]]:
    for old in log_dir.iterdir():
        old.unlink()
    shape = {"seq_len": 2048} if kind == "tokens" else {}
    loader = tierflow.open_loader(data, batch_size=8, num_workers=workers, seed=17, **shape)
    for _ in loader:
        pass
    loader.close()
    found = {}
    for log in log_dir.iterdir():
        rows = [line.split() for line in log.read_text().splitlines()]
        found[int(log.name)] = (len(rows), len({(r[0], r[1]) for r in rows}), sum(float(r[2]) for r in rows))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="/tmp/tierflow-peers/full")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        log_dir = Path(tmp)
        instrument(log_dir)
        for kind, name in (("tokens", "tierflow-tokens"), ("text", "tierflow-docs")):
            data = Path(args.work) / "data" / name
            total = sum(
                len(block_lists(s["blocks"])["rows"])
                for s in json.loads((data / "manifest.json").read_text())["shards"]
            )
            for workers in (0, args.workers):
                per = epoch(data, kind, workers, log_dir)
                loads = collections.Counter({pid: n for pid, (n, _, _) in per.items()})
                cpu = sum(c for _, _, c in per.values())
                print(
                    f"{kind:6} {workers} workers: {total} blocks in the dataset; decoded "
                    f"{sum(loads.values())} times in all ({sum(loads.values()) / total:.2f} x), "
                    f"per process {sorted(loads.values(), reverse=True)}, {cpu:.2f} CPU s decoding"
                )


if __name__ == "__main__":
    main()
