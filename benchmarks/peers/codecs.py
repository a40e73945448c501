"""What the at-rest codec costs the raw path: the peers' corpus packed zstd (the default), lz4 and
uncompressed, one main-process epoch of each (open_loader at its defaults otherwise), and the
block decode alone.

Issue 17 asks the main process for 2 x LitData, which reads uncompressed chunks. This separates
what the codec costs from what the rest of a batch costs, so a planner can tell which part of the
gap a faster decoder could close:
- epochs: samples/s after the first batch and the main thread's CPU us a batch (`thread_time`).
  Each codec runs in a fresh child process. Rounds alternate the codecs. Medians (min-max).
- decode: every block of each packing read and verified, then decoded once (`decode_block`: the
  claims checked, decompressed, the arrays built and validated), in GB/s of decoded bytes.

Reads the peers' corpus (make bench-peers ARGS="--only raw" builds it). The lz4 and uncompressed
packings are made once under --work.

    .venv/bin/python benchmarks/peers/codecs.py [--work /tmp/tierflow-peers/full] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _harness import alternating, spread

CODECS = ("zstd", "lz4", "none")
SHAPES = {"tokens": {"seq_len": 2048}, "text": {}}


def packed(work: Path, kind: str, codec: str) -> Path:
    """The corpus packed with `codec` (the peers' own packing for zstd), packed once."""
    if codec == "zstd":
        return work / "data" / ("tierflow-tokens" if kind == "tokens" else "tierflow-docs")
    out = work / "codecs" / f"{kind}-{codec}"
    if not (out / "manifest.json").exists():
        import tierflow

        options = {"tokenizer": "bytes"} if kind == "tokens" else {}
        tierflow.pack(
            [work / "corpus" / "docs"],
            out,
            target_shard_bytes=2 << 20,
            compression=codec,
            workers=2,
            overwrite=True,
            **options,
        )
    return out


def epoch(path: Path, kind: str) -> dict[str, float]:
    """One main-process epoch at the defaults; what the child prints."""
    import tierflow

    loader = tierflow.open_loader(path, batch_size=8, num_workers=0, seed=17, **SHAPES[kind])
    batches = iter(loader)
    next(batches)
    count, started, cpu = 1, time.perf_counter(), time.thread_time()
    for _ in batches:
        count += 1
    wall, cpu = time.perf_counter() - started, time.thread_time() - cpu
    loader.close()
    return {"samples_s": (count - 1) * 8 / wall, "cpu_us": cpu / (count - 1) * 1e6}


def decode(path: Path) -> dict[str, float]:
    """Every block read and verified, then decoded once: GB/s of decoded bytes of the decoding."""
    from tierflow.format.block_decoder import decode_block
    from tierflow.storage.datasets import open_dataset

    dataset = open_dataset(path)
    blocks = []
    for s in range(len(dataset.manifest.shards)):
        table = dataset.shard(s)
        source, schema = table._source, table._shard_schema()
        blocks += [
            (source.checked(b, table.name), schema, table.name, b, source.blocks[b], source.max_decoded)
            for b in range(table.num_blocks)
        ]
    decoded, started = 0, time.perf_counter()
    for block in blocks:
        decoded += decode_block(*block).get_total_buffer_size()
    return {"gb_s": decoded / (time.perf_counter() - started) / 1e9, "blocks": len(blocks)}


def child(args: argparse.Namespace) -> None:
    path = Path(args.child)
    print(json.dumps(decode(path) if args.decode else epoch(path, args.kind)))


def run_child(*argv: str) -> dict[str, float]:
    done = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/tierflow-peers/full"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--kind", default="tokens", help=argparse.SUPPRESS)
    parser.add_argument("--decode", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    paths = {(kind, codec): packed(args.work, kind, codec) for kind in SHAPES for codec in CODECS}
    runs: dict[tuple[str, str], list[dict[str, float]]] = {key: [] for key in paths}
    for _, (kind, codec) in alternating(args.rounds, list(paths)):
        runs[(kind, codec)].append(run_child("--child", str(paths[(kind, codec)]), "--kind", kind))
    print(
        f"one main-process epoch, batch 8, defaults but the codec; {args.rounds} alternating rounds, median (min-max)\n"
    )
    print("| data | codec | at rest MB | samples/s | main-thread CPU us/batch | decode_block GB/s (decoded) |")
    print("|---|---|---|---|---|---|")
    for (kind, codec), path in paths.items():
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6
        speed = run_child("--child", str(path), "--decode")
        print(
            f"| {kind} | {codec} | {size:.1f} | {spread([r['samples_s'] for r in runs[(kind, codec)]], ',.0f')} | "
            f"{spread([r['cpu_us'] for r in runs[(kind, codec)]], '.0f')} | {speed['gb_s']:.2f} |"
        )


if __name__ == "__main__":
    main()
