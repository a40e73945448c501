"""Micro-benchmark of the shard format: what one random sample costs, read each way the issue names.

One synthetic token dataset (list<uint16> documents, lognormal lengths around 1,000 tokens),
packed by tierflow twice (decoded form: `compression="none"`; at rest: zstd), and written as
Parquet with row groups the size of tierflow's blocks. For random sample indices:
  numpy views     - a slice of the mapped values buffer through cached offsets (the hot path)
  open_dataset    - `tierflow.open_dataset(decoded)[i]` (locate shard, block, then the view)
  pyarrow per-row - `list_array[row]` through pyarrow's scalar API, then to numpy or `.as_py()`
  compressed IPC  - the block holding the sample: verify xxh3, decode (zstd), slice
  Parquet         - read the row group holding the sample, slice
and xxh3-64 / xxh3-128 throughput over a 256 MB buffer. Rounds alternate the order of the
methods; the table gives the median microseconds per sample and the spread (min-max).
Run: .venv/bin/python benchmarks/format.py [--documents 100000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

from tierflow import open_dataset
from tierflow.format.block_decoder import read_block
from tierflow.pack.packer import pack
from _harness import alternating, spread

SHARD_BYTES = 64 << 20  # blocks are 1/64 of it: 1 MB


def make_tokens_parquet(path: Path, documents: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(6.7, 0.8, documents), 1, 32_000).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    values = np.minimum(rng.zipf(1.3, int(offsets[-1])), 50_000).astype(np.uint16)  # skewed, like real ids
    tokens = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values)).cast(pa.list_(pa.uint16()))
    pq.write_table(pa.table({"id": np.arange(documents), "tokens": tokens}), path, row_group_size=8192)


class Readers:
    """Each way of reading sample i's tokens, set up once (the set-up is not what is timed)."""

    def __init__(self, work: Path, source: Path) -> None:
        decoded, compressed = work / "decoded", work / "zstd"
        pack([str(source)], decoded, workers=2, compression="none", target_shard_bytes=SHARD_BYTES)
        pack([str(source)], compressed, workers=2, compression="zstd", target_shard_bytes=SHARD_BYTES)
        self.dataset = open_dataset(decoded, columns=["tokens"])
        self.count = len(self.dataset)
        table = self.dataset.shard(0)  # the first shard's blocks; indices below stay inside it
        self.rows = table.num_rows
        self.views = [table.list_parts(b, "tokens") for b in range(len(table.blocks))]
        self.row_starts = table.row_starts
        # cached offsets: per row, its block and the [start, stop) of its tokens in that block's values
        self.row_block, self.row_start, self.row_stop = [], [], []
        for b, (offsets, _) in enumerate(self.views):
            self.row_block += [b] * (len(offsets) - 1)
            self.row_start += offsets[:-1].tolist()
            self.row_stop += offsets[1:].tolist()
        self.values = [values for _, values in self.views]
        self.arrays = [block.column("tokens") for block in table.blocks]

        zds = open_dataset(compressed)
        self.info = zds.manifest.shards[0]
        self.schema = zds.manifest.schema
        self.at_rest = memoryview((compressed / self.info.name).read_bytes())
        self.block_starts = np.concatenate([[0], np.cumsum([b.rows for b in self.info.blocks])])

        self.parquet_path = work / "blocks.parquet"
        rows_per_group = int(np.median([b.rows for b in self.info.blocks]))
        pq.write_table(
            pa.Table.from_batches(table.blocks), self.parquet_path, row_group_size=rows_per_group, compression="zstd"
        )
        self.parquet = pq.ParquetFile(self.parquet_path)
        self.group_starts = np.concatenate(
            [
                [0],
                np.cumsum(
                    [self.parquet.metadata.row_group(g).num_rows for g in range(self.parquet.metadata.num_row_groups)]
                ),
            ]
        )
        self.block_mb = float(np.median([b.length for b in self.info.blocks])) / 1e6
        self.rows_per_block = rows_per_group

    def numpy_view(self, i: int) -> np.ndarray:
        return self.values[self.row_block[i]][self.row_start[i] : self.row_stop[i]]

    def open_dataset(self, i: int) -> np.ndarray:
        return self.dataset[i]["tokens"]

    def pyarrow_row(self, i: int) -> np.ndarray:
        b = int(np.searchsorted(self.row_starts, i, side="right")) - 1
        return self.arrays[b][i - int(self.row_starts[b])].values.to_numpy(zero_copy_only=True)

    def pyarrow_as_py(self, i: int) -> list:
        b = int(np.searchsorted(self.row_starts, i, side="right")) - 1
        return self.arrays[b][i - int(self.row_starts[b])].as_py()

    def compressed_block(self, i: int) -> np.ndarray:
        b = int(np.searchsorted(self.block_starts, i, side="right")) - 1
        block = self.info.blocks[b]
        decoded = read_block(self.at_rest[block.offset : block.offset + block.length], self.schema, self.info, b)
        column = decoded.column("tokens")
        offsets = column.offsets.to_numpy()
        r = i - int(self.block_starts[b])
        return column.values.to_numpy()[offsets[r] : offsets[r + 1]]

    def parquet_group(self, i: int) -> np.ndarray:
        g = int(np.searchsorted(self.group_starts, i, side="right")) - 1
        column = self.parquet.read_row_group(g, columns=["tokens"]).column(0).combine_chunks()
        r = i - int(self.group_starts[g])
        return column[r].values.to_numpy()


def per_sample_us(read: Callable[[int], np.ndarray], indices: np.ndarray) -> float:
    started = time.perf_counter()
    for i in indices.tolist():
        read(i)
    return (time.perf_counter() - started) / len(indices) * 1e6


def xxh3_gb_s(buffer: bytes, digest: Callable[[bytes], str], rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        started = time.perf_counter()
        digest(buffer)
        out.append(len(buffer) / 1e9 / (time.perf_counter() - started))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tierflow-formatbench-"))
    try:
        source = work / "tokens.parquet"
        make_tokens_parquet(source, args.documents)
        readers = Readers(work, source)
        methods = [  # (label, reader, samples per round)
            ("numpy views (cached offsets)", readers.numpy_view, 100_000),
            ("tierflow open_dataset ds[i]", readers.open_dataset, 50_000),
            ("pyarrow per-row API, to numpy", readers.pyarrow_row, 20_000),
            ("pyarrow per-row API, as_py()", readers.pyarrow_as_py, 5_000),
            ("compressed IPC, decode block", readers.compressed_block, 200),
            ("Parquet row group", readers.parquet_group, 50),
        ]
        rng = np.random.default_rng(1)
        times: dict[str, list[float]] = {label: [] for label, _, _ in methods}
        for _, (label, read, n) in alternating(args.rounds, methods):
            times[label].append(per_sample_us(read, rng.integers(0, readers.rows, n)))
        buffer = np.random.default_rng(2).integers(0, 256, 256 << 20, dtype=np.uint8).tobytes()
        hashes = {
            "xxh3-64": xxh3_gb_s(buffer, xxhash.xxh3_64_hexdigest, args.rounds),
            "xxh3-128": xxh3_gb_s(buffer, xxhash.xxh3_128_hexdigest, args.rounds),
        }

        base = statistics.median(times[methods[0][0]])
        print(
            f"dataset: {readers.count:,} documents of list<uint16> tokens; random samples within one "
            f"{SHARD_BYTES >> 20} MB shard of {readers.rows:,} rows; blocks / row groups of "
            f"{readers.rows_per_block:,} rows ({readers.block_mb:.2f} MB at rest, {readers.info.compression}, "
            f"{readers.info.decoded_bytes / readers.info.bytes:.2f}x); {args.rounds} rounds"
        )
        print(f"{'read path':32} {'us/sample median (min-max)':>30} {'x numpy views':>14}")
        for label, _, _ in methods:
            values = times[label]
            print(f"{label:32} {spread(values, '.2f'):>30} {statistics.median(values) / base:14.1f}")
        print()
        print(f"{'hash':32} {'GB/s median (min-max)':>30}")
        for label, values in hashes.items():
            print(f"{label:32} {spread(values):>30}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
