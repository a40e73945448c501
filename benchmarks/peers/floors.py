"""The least a raw main-process batch can cost here, part by part, beside what issue 17's targets allow.

Issue 17 asks the main process for 2 x LitData's samples/s on tokens and on text, and for 0.5 x
the in-RAM list on tokens. This measures the bare work a batch of the peers' corpus cannot skip
on tierflow's path, each part alone in a tight loop with nothing around it (no order, no checks,
no Arrow, no meta, no telemetry):

- decode: every zstd buffer of every block of the packed dataset decompressed once
  (python-zstandard, one call per buffer, the output freed and its memory reused), over the
  epoch's batches;
- tokens: the batch's 8 windows of 2049 tokens copied out of a decoded block (one numpy slice
  copy per window, as `TokenReader.copy_windows` does), then widened to int64 (what an embedding
  and the loss take: the device feed's default);
- text: the batch's 8 documents made Python `str` from their UTF-8 bytes (what a text batch holds).

The sum is a floor for a batch on this path. Beside it stands the time a batch may take under
each target, from the raw rows of results/peers.json (`make bench-peers ARGS="--only raw"`, the
same machine: run it first): 8 / (2 x LitData's samples/s), and for tokens 8 / (0.5 x the in-RAM
list's). A floor above that budget means no per-batch work left to cut reaches the target on a
compressed at-rest form; only doing less (another codec, narrower dtypes, no str) or doing it on
more cores does. Medians (min-max) of `--rounds` repetitions, in us a batch.

    .venv/bin/python benchmarks/peers/floors.py [--work /tmp/tierflow-peers/full] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import zstandard

import tierflow
from tierflow.format._ipcmeta import batch_claims
from tierflow.format.block_decoder import block_stream
from tierflow.loader import TokenWindows

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _harness import spread

BATCH = 8
SEQ_LEN = 2048
HERE = Path(__file__).resolve().parent


def zstd_frames(dataset: tierflow.Dataset) -> list[tuple[bytes, int]]:
    """(frame, decoded size) of every zstd buffer of every block of a packed dataset."""
    frames = []
    for s, info in enumerate(dataset.manifest.shards):
        table = dataset.shard(s)
        for b in range(len(info.blocks)):
            data = table._source.checked(b, table.name)
            reader = pa.ipc.MessageReader.open_stream(block_stream(data, b))
            for message in reader:
                if message.type != "record batch":
                    continue
                claims = batch_claims(message.metadata.to_pybytes())
                body = memoryview(message.body)
                for offset, length in claims.buffers:
                    if length:
                        size = int.from_bytes(body[offset : offset + 8], "little", signed=True)
                        if size >= 0:
                            frames.append((bytes(body[offset + 8 : offset + length]), size))
    return frames


def decode_floor(frames: list[tuple[bytes, int]], batches: int) -> float:
    context = zstandard.ZstdDecompressor()
    started = time.perf_counter()
    for frame, size in frames:
        context.decompress(frame, max_output_size=size)
    return (time.perf_counter() - started) / batches


def token_floor(values: np.ndarray, batches: int, rng: np.random.Generator) -> float:
    width = SEQ_LEN + 1
    starts = rng.integers(0, values.size - width, size=(batches, BATCH)).tolist()
    started = time.perf_counter()
    for rows in starts:
        out = np.empty((BATCH, width), dtype=values.dtype)
        for row, start in enumerate(rows):
            out[row] = values[start : start + width]
        out.astype(np.int64)
    return (time.perf_counter() - started) / batches


def text_floor(documents: list[bytes], rng: np.random.Generator) -> float:
    order = rng.permutation(len(documents)).tolist()
    views = [memoryview(d) for d in documents]
    batches = len(order) // BATCH
    started = time.perf_counter()
    for k in range(batches):
        [str(views[i], "utf-8") for i in order[k * BATCH : (k + 1) * BATCH]]
    return (time.perf_counter() - started) / batches


def budgets(results: Path) -> dict[str, dict[str, float]]:
    """us a batch each target allows, from the raw rows of the last peers run on this machine."""
    cells = json.loads(results.read_text())["raw"]["cells"]
    out = {}
    for kind in ("tokens", "text"):
        rate = {
            system: statistics.median(r["samples_per_s"] for r in runs)
            for system, runs in cells[f"{kind}_w0"].items()
            if runs
        }
        out[kind] = {
            "2 x LitData": BATCH / (2 * rate["litdata"]) * 1e6,
            "LitData itself": BATCH / rate["litdata"] * 1e6,
        }
        if kind == "tokens":
            out[kind]["0.5 x the in-RAM list"] = BATCH / (0.5 * rate["inram"]) * 1e6
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="/tmp/tierflow-peers/full")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--results", default=str(HERE / "results" / "peers.json"))
    args = parser.parse_args()
    data = Path(args.work) / "data"
    rng = np.random.default_rng(17)

    tokens = tierflow.open_dataset(data / "tierflow-tokens")
    token_batches = int(TokenWindows(SEQ_LEN).order_counts(tokens).sum()) // BATCH
    token_frames = zstd_frames(tokens)
    block_tokens = tokens.shard(0).list_values(0, tokens.token_column)
    docs = tierflow.open_dataset(data / "tierflow-docs")
    text = [row["text"].encode() for row in docs]
    text_batches = len(text) // BATCH
    text_frames = zstd_frames(docs)

    parts: dict[str, dict[str, list[float]]] = {"tokens": {}, "text": {}}
    for _ in range(args.rounds):
        parts["tokens"].setdefault("zstd decode", []).append(decode_floor(token_frames, token_batches))
        parts["tokens"].setdefault("copy 8 windows, widen to int64", []).append(token_floor(block_tokens, 2000, rng))
        parts["text"].setdefault("zstd decode", []).append(decode_floor(text_frames, text_batches))
        parts["text"].setdefault("8 documents to str", []).append(text_floor(text, rng))

    allowed = budgets(Path(args.results))
    print(
        f"Floors of a raw main-process batch of {BATCH} (us, median (min-max) of {args.rounds} rounds), "
        f"beside the us a batch each target allows ({args.results}'s raw rows)\n"
    )
    print("| data | part | floor us/batch |\n|---|---|---|")
    for kind, found in parts.items():
        total = [sum(round_parts) for round_parts in zip(*found.values())]
        for name, seconds in found.items():
            print(f"| {kind} | {name} | {spread([v * 1e6 for v in seconds])} |")
        print(f"| {kind} | **sum: the floor** | {spread([v * 1e6 for v in total])} |")
        for target, budget in allowed[kind].items():
            print(f"| {kind} | allowed by {target} | {budget:.0f} |")


if __name__ == "__main__":
    main()
