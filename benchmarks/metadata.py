"""Metadata at scale (issue 38): open + first batch, peak RSS and a node's shared PSS, at 10^3-10^6 shards,
for a version-2 manifest (parsed) beside version-3 metadata (a header and mapped Arrow tables).

The datasets are synthetic, made through the project's own writers: a real pack of a few shards of
pack's default geometry (`--shard-bytes`, 256 MB decoded, in blocks of a `--blocks` 64th of it): int64
samples (which pack cuts at its sources' 65,536-row batches: 512 KB blocks, 512 a shard), or byte-token
documents (64 blocks a shard); a shard holds a user's shard's samples and token windows, so a first
batch draws from as many shards as a user's does), then N shard entries that repeat those shards' entries
under fresh names (random checksums; the shard file a run reads is a hard link to the real one, made
the first time a run asks for it: only those exist). The new form is
written by `format.metadata.write_metadata` from columns; the old by `Manifest.save` (old at up to
`--old-max` shards: above 10^5 a manifest is gigabytes). Both carry the same dataset id, so both
read the same order and the same shards.

Each measurement is a fresh interpreter (imports not counted, shown apart): `open`: seconds from
`open_dataset` to `len()`; `open+batch`: to the first batch as the loader gives it
(`Loader(TieredDataset(path, batch_size=256))`, its order, working set and index included), once
in its own process for each of `--seeds` order seeds (whether a first batch reads one block or two is
the seed's luck, not the metadata's cost: the median is over seeds and runs);
`peak RSS`: the peak resident set (VmHWM) less the RSS after `import tierflow`; the tables are
dropped from the page cache first (`drop_cached`). `PSS x8`: 8 processes open the same dataset
and take a batch; with all 8 alive, the sum of their PSS less 8 x one bare interpreter's (imports),
and the PSS of the mapped metadata files alone (version 3).

    PYTHONPATH=src .venv/bin/python benchmarks/metadata.py [--shards 1000,100000,1000000] [--runs 3]
        [--seeds 4] [--blocks 64] [--shard-bytes 256M] [--old-max 100000] [--root /tmp/tierflow-metadata-bench]
        [--keep] [--no-pss] [--pss-old-max 10000] [--paths] [--ratio-rounds 5] [--verify-rounds 6] [--seq-len 2048]

`--paths` times each per-shard path on the version-3 datasets in a fresh interpreter: `order` (the
TieredDataset: layout, working set, index), `inspect`, `verify-metadata` (both tables hashed whole,
every shard's block rows, the dataset id; the shard files themselves are not there to hash),
`gc-names` (the referenced-name set gc tests files against), `stager-keys` (entry key -> shards),
`every-shard-object` (a ShardInfo per shard: what a tool that walks `manifest.shards` pays), `plan`
(`tierflow plan` with an L2 of 30% at rest, 3 epochs, both forms) and `stager-plan` (a Stager made over
an opened dataset and its first plan, the dataset's own cost left out). With `--seq-len`, the paths a stored
window layout changes (`STORED_PATHS`) are timed on that form too.

`--seq-len L`: the shards hold byte-token documents (a `tokenizer="bytes"` pack) and the first batch
(and `--paths`' order and stager plan) reads token windows of L: the order a language model trains on,
whose per-shard counts are each shard's windows of L. Two forms: the layout computed at start (a length
the dataset does not store), and the dataset as `tierflow pack` writes it, which stores the layouts of
2048, 4096 and 8192 (DEFAULT_LENGTHS) and of L; `--verify-rounds` verifies that form.

`--ratio-rounds N` (default 5): open + first batch at the largest shard count against the smallest,
each version-3 form, their children alternating round by round (the target is a ratio: measured side
by side, not from the table's rows, which run one size after the other).

`--verify-rounds N` (on the largest dataset): `verify-metadata` against reading the same table files
whole (8 MB reads, what `cat` does), each in a fresh interpreter, alternating for N rounds, the
tables' pages dropped from the page cache before each (posix_fadvise DONTNEED: a cold read), and
warm (read just before) beside it: is verify at disk speed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _harness import alternating, spread

BATCH = 256
BATCH_WINDOWS = 8
BASE_SHARDS = 4


def parse_count(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6}
    return int(float(text[:-1]) * scale[text[-1]]) if text[-1] in scale else int(text)


# -- building -----------------------------------------------------------------------------------
def build_base(root: Path, blocks: int, shard_bytes: int) -> Path:
    """A real pack of BASE_SHARDS shards of `shard_bytes` decoded, in blocks of at most a `blocks`-th of
    that, uncompressed: int64 `x`, or with `--seq-len` byte-token documents."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    import tierflow

    base = root / "base"
    if (base / "manifest.json").exists():
        return base
    options: dict = {"block_bytes": shard_bytes // blocks, "target_shard_bytes": shard_bytes}
    if seq_len() is None:
        source = root / "x.parquet"
        rows = BASE_SHARDS * shard_bytes // 8
        pq.write_table(pa.table({"x": np.arange(rows, dtype=np.int64)}), source, row_group_size=1 << 20)
    else:
        source = root / "docs.jsonl"
        rng = np.random.default_rng(0)
        letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz ", dtype=np.uint8)
        total = BASE_SHARDS * options["target_shard_bytes"] // 2  # two bytes a uint16 token
        with source.open("w") as out:
            while total > 0:
                text = letters[rng.integers(0, len(letters), size=int(rng.integers(200, 2000)))].tobytes().decode()
                out.write(json.dumps({"text": text}) + "\n")
                total -= len(text) + 1
        options["tokenizer"] = "bytes"
    tierflow.pack([source], base, workers=1, compression="none", overwrite=True, **options)
    source.unlink()
    return base


SEQ_LEN_ENV = "METADATA_BENCH_SEQ_LEN"
"""`--seq-len`, as the measured children see it."""


def seq_len() -> int | None:
    value = os.environ.get(SEQ_LEN_ENV)
    return int(value) if value else None


def batch_spec():
    """The loader's batching: rows, or with `--seq-len` token windows (the order counts each shard's)."""
    from tierflow.loader import BatchSpec

    return BatchSpec(batch_size=BATCH) if seq_len() is None else BatchSpec(batch_size=BATCH_WINDOWS, seq_len=seq_len())


def build(root: Path, base: Path, n: int, old: bool) -> tuple[Path, Path | None]:
    """(new dataset dir, old dataset dir or None) of n shards repeating the base's."""
    import numpy as np

    from tierflow.format import metadata as md
    from tierflow.format import metadata_writer
    from tierflow.format.manifest import Manifest, compute_dataset_id, schema_fields, schema_to_json
    from tierflow.format.shard import ShardInfo

    new_dir, old_dir = root / f"new-{n}", root / f"old-{n}"
    if (new_dir / md.METADATA_NAME).exists() and (not old or (old_dir / "manifest.json").exists()):
        return new_dir, old_dir if old else None
    manifest = Manifest.load(base)
    real = list(manifest.shards)
    rng = np.random.default_rng(n)
    checksums = rng.integers(0, 2**63, size=(n, 2), dtype=np.int64).view("V16").reshape(n)
    pick = np.arange(n) % len(real)
    shard_cols, block_cols = metadata_writer.columns_from_shards(real)
    per = shard_cols["blocks"]
    shards = {
        name: shard_cols[name][pick]
        for name in md.SHARD_SCHEMA.names
        if name not in ("checksum", "sample_start", "token_start", "first_block")
    }
    shards["checksum"] = checksums
    reps, tail = divmod(n, len(real))  # shard i repeats base shard i % K: the block rows tile
    blocks = {
        name: np.concatenate([np.tile(block_cols[name], reps), block_cols[name][: int(per[:tail].sum())]])
        for name in md.BLOCK_SCHEMA.names
    }
    shards["first_block"] = np.concatenate([[0], np.cumsum(shards["blocks"])[:-1]]).astype(np.int64)
    names = [c.tobytes().hex() for c in checksums]
    dataset_id = compute_dataset_id({"fields": schema_fields(manifest.schema)}, manifest.tokenizer, names)
    stats = {"samples": int(shards["samples"].sum()), "tokens": int(shards["tokens"].sum())}
    fields = {
        "dataset_id": dataset_id,
        "schema": schema_to_json(manifest.schema),
        "tokenizer": manifest.tokenizer,
        "token_column": manifest.token_column,
        "token_dtype": manifest.token_dtype,
        "eos_id": manifest.eos_id,
        "stats": stats,
    }
    shutil.rmtree(new_dir, ignore_errors=True)
    new_dir.mkdir(parents=True)
    metadata_writer.write_metadata(new_dir, shard_columns=shards, block_columns=blocks, fields=fields)
    del blocks
    if not old:
        return new_dir, None
    shutil.rmtree(old_dir, ignore_errors=True)
    old_dir.mkdir(parents=True)
    infos = [
        ShardInfo(
            name=f"shard-{name}.arrow",
            samples=real[k].samples,
            bytes=real[k].bytes,
            decoded_bytes=real[k].decoded_bytes,
            checksum=name,
            decoded_checksum=real[k].decoded_checksum,
            compression=real[k].compression,
            tokens=real[k].tokens,
            blocks=real[k].blocks,
        )
        for name, k in zip(names, pick.tolist())
    ]
    Manifest(
        schema=manifest.schema,
        shards=infos,
        tokenizer=manifest.tokenizer,
        token_column=manifest.token_column,
        token_dtype=manifest.token_dtype,
        eos_id=manifest.eos_id,
        stats=stats,
    ).save(old_dir)
    return new_dir, old_dir


def with_windows(new_dir: Path) -> Path:
    """A copy of a token dataset (its files linked) whose header also stores the window layouts
    `tierflow pack` writes by default (DEFAULT_LENGTHS) and that of --seq-len, as `tierflow pack` (or
    `tierflow upgrade --seq-len`) writes them."""
    from tierflow.format import metadata as md
    from tierflow.format.metadata_windows import DEFAULT_LENGTHS
    from tierflow.format.metadata_writer import update_header

    stored = new_dir.with_name(new_dir.name.replace("new-", "packed-"))
    if (stored / md.METADATA_NAME).exists():
        return stored
    shutil.rmtree(stored, ignore_errors=True)
    stored.mkdir()
    for f in new_dir.iterdir():
        if f.name.startswith(md.TABLE_PREFIX) or f.name == md.METADATA_NAME:
            os.link(f, stored / f.name)
    update_header(stored, sorted({seq_len(), *DEFAULT_LENGTHS}))
    return stored


# -- the measured child ---------------------------------------------------------------------------
def vm_hwm() -> int:
    """This process's peak resident set (VmHWM). Not getrusage's ru_maxrss: that survives exec, so a
    child of a parent that just built a million-shard table starts at the parent's size."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child(path: str, wait: bool, seed: int) -> None:
    began = time.perf_counter()
    import psutil

    import tierflow
    from tierflow.loader import Loader, OrderSpec, TieredDataset

    imported = time.perf_counter()
    rss_import = psutil.Process().memory_info().rss
    start = time.perf_counter()
    ds = tierflow.open_dataset(path)
    len(ds)
    opened = time.perf_counter()
    del ds
    start2 = time.perf_counter()
    dataset = TieredDataset(path, batch_spec(), OrderSpec(seed=seed))
    loader = Loader(dataset)
    first = next(iter(loader))
    arrived = time.perf_counter()
    got, want = (len(first["x"]), BATCH) if seq_len() is None else (len(first["input_ids"]), BATCH_WINDOWS)
    if got != want:
        raise RuntimeError(f"first batch has {got} samples")
    peak = vm_hwm()
    print(
        json.dumps(
            {
                "import_s": imported - began,
                "open_s": opened - start,
                "batch_s": arrived - start2,
                "peak_above_import": peak - rss_import,
                "rss_import": rss_import,
            }
        ),
        flush=True,
    )
    if wait:
        sys.stdin.readline()
    loader.close()


PATHS = ("order", "inspect", "verify-metadata", "gc-names", "stager-keys", "every-shard-object", "plan", "stager-plan")
STORED_PATHS = ("order", "verify-metadata", "plan", "stager-plan")
"""The paths a stored window layout changes (timed on that form too, with --seq-len)."""


def path_child(name: str, path: str) -> None:
    """One per-shard path, timed in this fresh interpreter (after imports); prints one JSON line."""
    import contextlib
    import io

    import psutil

    import tierflow
    from tierflow.commands.cli import main as cli
    from tierflow.format import metadata_index, metadata_verify
    from tierflow.format.manifest import Manifest
    from tierflow.loader import TieredDataset

    rss_import = psutil.Process().memory_info().rss
    start = time.perf_counter()
    if name == "order":
        TieredDataset(path, batch_spec())
    elif name == "inspect":
        with contextlib.redirect_stdout(io.StringIO()):
            cli(["inspect", path, "-n", "1"])
    elif name == "verify-metadata":
        problems = metadata_verify.verify_metadata(Manifest.load(path))
        if problems:
            raise RuntimeError(problems[:3])
    elif name == "gc-names":
        names = metadata_index.ShardNames(Manifest.load(path))
        assert f"shard-{'0' * 32}.arrow" not in names
    elif name == "stager-keys":
        metadata_index.ShardKeys(Manifest.load(path)).get("0" * 32)
    elif name == "every-shard-object":
        sum(info.samples for info in Manifest.load(path).shards)
    elif name == "plan":
        with contextlib.redirect_stdout(io.StringIO()):
            cli(["plan", path, "--tier", f"L2={path}-plan-l2:30%", "--batch-size", str(BATCH)])
    elif name == "stager-plan":
        from tierflow.tiers import TierConfig, build_stack
        from tierflow.tiers.stager import Stager

        stack = build_stack(path, [TierConfig.parse(f"L2={path}-plan-l2:30%")])
        dataset = TieredDataset(stack.dataset(), batch_spec())
        start = time.perf_counter()  # the dataset's part is `order`'s: this is the stager's own
        stager = Stager(dataset, stack)
        stager._plan_and_fetch()  # one plan from the start, as a rank's first: threads not started
    took = time.perf_counter() - start
    del tierflow
    peak = vm_hwm()
    print(json.dumps({"s": took, "peak_above_import": peak - rss_import}), flush=True)


def read_child(path: str) -> None:
    """Read every metadata table of the dataset whole, 8 MB at a time (the disk's speed for them)."""
    start = time.perf_counter()
    for p in sorted(Path(path).glob("metadata-*.arrow")):
        with open(p, "rb", buffering=0) as f:
            while f.read(8 << 20):
                pass
    print(json.dumps({"s": time.perf_counter() - start}), flush=True)


def drop_cached(path: Path) -> None:
    """Drop the dataset's table pages from the page cache, so the next read comes from the disk."""
    for p in path.glob("metadata-*.arrow"):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def verify_rounds(path: Path, rounds: int, env: dict) -> None:
    """verify-metadata against a plain read of the same tables, cold and warm, alternating."""
    times: dict[tuple[str, str], list[float]] = {}
    commands = {
        "read the tables": [sys.executable, __file__, "--read-child", str(path)],
        "verify-metadata": [sys.executable, __file__, "--path-child", "verify-metadata", str(path)],
    }
    for _, (name, cache) in alternating(rounds, [(n, c) for n in commands for c in ("cold", "warm")]):
        if cache == "cold":
            drop_cached(path)
        else:
            subprocess.run([sys.executable, __file__, "--read-child", str(path)], check=True, capture_output=True)
        out = subprocess.run(commands[name], capture_output=True, text=True, env=env, check=True, timeout=1800)
        times.setdefault((name, cache), []).append(json.loads(out.stdout.strip().splitlines()[-1])["s"])
    size = sum(p.stat().st_size for p in path.glob("metadata-*.arrow"))
    print(f"\n{path.name}: {size / 1e6:.0f} MB of tables, {rounds} alternating rounds\n")
    print("| | cold | warm |\n|---|---|---|")
    for name in commands:
        print(f"| {name} | {spread(times[(name, 'cold')], '.2f')} s | {spread(times[(name, 'warm')], '.2f')} s |")
    ratio = [v / r for v, r in zip(times[("verify-metadata", "cold")], times[("read the tables", "cold")])]
    print(f"| verify / read, cold, round by round | {spread(ratio, '.2f')} | |")


def ratio_rounds(small: list, large: list, rounds: int, seeds: int, env: dict) -> None:
    """Open + first batch at the largest shard count against the smallest, per version-3 form, their
    children alternating (each seed at each size, in turn) so drift and noise fall on both alike."""
    print("\n| form | open + first batch, smallest | largest | largest / smallest, round by round |")
    print("|---|---|---|---|")
    for (form, a), (_, b) in zip(small[1:], large[1:]):
        times: dict[tuple[Path, int], list[float]] = {}
        for _, (path, seed) in alternating(rounds, [(p, s) for s in range(seeds) for p in (a, b)]):
            times.setdefault((path, seed), []).append(run_child(path, env, seed)["batch_s"])
        per_round = [
            statistics.median(times[(b, s)][r] for s in range(seeds))
            / statistics.median(times[(a, s)][r] for s in range(seeds))
            for r in range(rounds)
        ]
        every = [[t for (p, _), ts in times.items() if p == path for t in ts] for path in (a, b)]
        print(
            f"| {form} | {spread(every[0], '.4f')} s | {spread(every[1], '.4f')} s | {spread(per_round, '.2f')} |",
            flush=True,
        )


def prepare(path: str, base: str, seeds: int) -> None:
    """Link the shard files the first batch of each seed reads (each a real shard of the base under its fresh name)."""
    import tierflow
    from tierflow.format.manifest import Manifest
    from tierflow.loader import Loader, OrderSpec, TieredDataset

    sources = {s.decoded_checksum: s.name for s in Manifest.load(base).shards}
    for seed in range(seeds):
        for _ in range(1000):
            try:
                loader = Loader(TieredDataset(path, batch_spec(), OrderSpec(seed=seed)))
                next(iter(loader))
                loader.close()
                ds = tierflow.open_dataset(path)
                len(ds)
                break
            except Exception as e:
                found = re.search(r"shard-([0-9a-f]{32})\.arrow", str(e))
                if not found:
                    raise
                name = found.group(0)
                manifest = Manifest.load(path)
                info = next(s for s in (manifest.shards[i] for i in _shard_of(manifest, name)))
                os.link(Path(base) / sources[info.decoded_checksum], Path(path) / name)
        else:
            raise RuntimeError("too many shards to link")


def _shard_of(manifest, name: str) -> list[int]:
    from tierflow.format.metadata import MappedManifest

    if isinstance(manifest, MappedManifest):
        import numpy as np

        column = manifest.tables.column("checksum")
        key = np.frombuffer(bytes.fromhex(name[6:38]), dtype="V16")[0]
        return np.flatnonzero(column == key).tolist()
    return [i for i, s in enumerate(manifest.shards) if s.name == name]


def run_child(path: Path, env: dict, seed: int = 0) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(path), "--seed", str(seed)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    if out.returncode:
        raise RuntimeError(f"child failed on {path}:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def pss(pid: int) -> tuple[int, int]:
    """(PSS of the process, PSS of its mapped metadata files), bytes."""
    total = metadata = 0
    current = ""
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if not line[0].isupper() or ":" not in line.split()[0]:
                current = line.split()[-1] if len(line.split()) >= 6 else ""
                continue
            if line.startswith("Pss:"):
                kb = int(line.split()[1]) * 1024
                total += kb
                if "/metadata-" in current:
                    metadata += kb
    return total, metadata


def node_pss(path: Path, env: dict, processes: int = 8) -> tuple[int, int]:
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--child", str(path), "--wait"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(processes)
    ]
    try:
        for p in procs:
            line = p.stdout.readline()
            if not line:
                raise RuntimeError("a PSS child died")
        sums = [pss(p.pid) for p in procs]
    finally:
        for p in procs:
            p.stdin.write("\n")
            p.stdin.flush()
        for p in procs:
            p.wait(timeout=120)
    return sum(s[0] for s in sums), sum(s[1] for s in sums)


def bare_pss(env: dict, processes: int = 8) -> int:
    code = "import sys, tierflow, tierflow.loader, psutil; print('ready', flush=True); sys.stdin.readline()"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        for _ in range(processes)
    ]
    try:
        for p in procs:
            p.stdout.readline()
        return sum(pss(p.pid)[0] for p in procs)
    finally:
        for p in procs:
            p.stdin.write("\n")
            p.stdin.flush()
            p.wait(timeout=60)


def main() -> None:
    from tierflow._sizes import parse_size
    from tierflow.pack.packer import DEFAULT_SHARD_BYTES

    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", default="1000,100000,1000000")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument(
        "--seeds",
        type=int,
        default=4,
        help="order seeds a run's first batch is timed with, each in its own process: which blocks a first "
        "batch reads (one or two) is the seed's luck, not the metadata's cost",
    )
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument(
        "--shard-bytes",
        type=parse_size,
        default=DEFAULT_SHARD_BYTES,
        help="decoded bytes a base shard (pack's default, 256 MB: a shard holds as many samples and "
        "token windows as a user's; 256K is the small geometry of the runs before it)",
    )
    ap.add_argument("--old-max", type=parse_count, default=100_000)
    ap.add_argument("--root", default="/tmp/tierflow-metadata-bench")
    ap.add_argument("--no-pss", action="store_true")
    ap.add_argument(
        "--pss-old-max",
        type=parse_count,
        default=10_000,
        help="8 processes of a parsed manifest only up to this many shards (each holds its own copy)",
    )
    ap.add_argument("--keep", action="store_true")
    ap.add_argument(
        "--seq-len",
        type=int,
        help="byte-token documents, the first batch (and --paths' order) token windows of this length",
    )
    ap.add_argument("--child")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--wait", action="store_true")
    ap.add_argument("--prepare", nargs=2)
    ap.add_argument("--paths", action="store_true", help="also time each per-shard path on the v3 datasets")
    ap.add_argument("--path-child", nargs=2)
    ap.add_argument(
        "--ratio-rounds",
        type=int,
        default=5,
        help="alternating rounds of open + first batch at the largest shard count against the smallest",
    )
    ap.add_argument("--verify-rounds", type=int, default=0, help="verify against a plain read, cold, N rounds")
    ap.add_argument("--read-child")
    args = ap.parse_args()
    if args.read_child:
        return read_child(args.read_child)
    if args.child:
        return child(args.child, args.wait, args.seed)
    if args.prepare:
        return prepare(*args.prepare, args.seeds)
    if args.path_child:
        return path_child(*args.path_child)
    geometry = f"b{args.blocks}-{args.shard_bytes >> 10}k"
    root = Path(args.root) / (geometry if args.seq_len is None else f"{geometry}-tokens")
    root.mkdir(parents=True, exist_ok=True)
    if args.seq_len is not None:  # this process's build_base reads it too
        os.environ[SEQ_LEN_ENV] = str(args.seq_len)
    env = {**os.environ, "TIERFLOW_MAX_MANIFEST_BYTES": str(1 << 40)}
    base = build_base(root, args.blocks, args.shard_bytes)
    counts = [parse_count(c) for c in args.shards.split(",")]
    bare = None if args.no_pss else bare_pss(env)
    print(
        "| shards | form | metadata on disk | open | open + first batch | peak RSS above import | "
        "PSS x8 above bare | PSS x8 of metadata files |"
    )
    print("|---|---|---|---|---|---|---|---|")
    paths: list[str] = []
    built_forms: dict[int, list[tuple[str, Path | None]]] = {}
    for n in counts:
        began = time.perf_counter()
        new_dir, old_dir = build(root, base, n, old=n <= args.old_max)
        forms = [("v2 manifest", old_dir), ("v3 mapped", new_dir)]
        if args.seq_len is not None:
            forms.append(
                (f"v3 + window layouts as pack stores them (of {args.seq_len} among them)", with_windows(new_dir))
            )
        built = time.perf_counter() - began
        built_forms[n] = forms
        for form, path in forms:
            if path is None:
                print(f"| {n:,} | {form} | - | not measured (> --old-max) | | | | |", flush=True)
                continue
            subprocess.run(
                [sys.executable, __file__, "--prepare", str(path), str(base), "--seeds", str(args.seeds)],
                check=True,
                env=env,
                timeout=1800,
            )
            size = sum(p.stat().st_size for p in path.iterdir() if not p.name.startswith("shard-"))
            # pages cached by whole-file reads or writes (the build, verify) sit in large folios, which a
            # mapping then maps whole: evicted first, a run's RSS and PSS are the pages it touches
            drop_cached(path)
            rounds = [run_child(path, env, seed) for _ in range(args.runs) for seed in range(args.seeds)]
            node = ("-", "-")
            if bare is not None and (form != "v2 manifest" or n <= args.pss_old_max):  # 8 parsed copies: GBs
                total, files = node_pss(path, env)
                node = (f"{(total - bare) / 1e6:.0f} MB", f"{files / 1e6:.1f} MB" if files else "-")
            print(
                f"| {n:,} | {form} | {size / 1e6:.1f} MB | {spread([r['open_s'] for r in rounds], '.3f')} s | "
                f"{spread([r['batch_s'] for r in rounds], '.3f')} s | "
                f"{spread([r['peak_above_import'] for r in rounds], '.0f', 1e-6)} MB | {node[0]} | {node[1]} |",
                flush=True,
            )
        print(f"<!-- {n:,} shards built in {built:.1f} s -->", file=sys.stderr, flush=True)
        for form, path in forms[1:] if args.paths else ():
            for name in PATHS if form == "v3 mapped" else STORED_PATHS:
                out = subprocess.run(
                    [sys.executable, __file__, "--path-child", name, str(path)],
                    capture_output=True,
                    text=True,
                    env=env,
                    timeout=1800,
                )
                if out.returncode:
                    paths.append(f"| {n:,} | {form} | {name} | failed: {out.stderr.strip().splitlines()[-1][:100]} | |")
                    continue
                r = json.loads(out.stdout.strip().splitlines()[-1])
                paths.append(f"| {n:,} | {form} | {name} | {r['s']:.3f} s | {r['peak_above_import'] / 1e6:.0f} MB |")
    if paths:
        print("\n| shards | form | path | time | peak RSS above import |\n|---|---|---|---|---|")
        print("\n".join(paths))
    if args.ratio_rounds and len(counts) > 1:
        ratio_rounds(built_forms[min(counts)], built_forms[max(counts)], args.ratio_rounds, args.seeds, env)
    if args.verify_rounds:
        verified = built_forms[max(counts)][-1][1]  # the form pack writes
        assert verified is not None
        verify_rounds(verified, args.verify_rounds, env)
    if not args.keep:
        shutil.rmtree(args.root, ignore_errors=True)


if __name__ == "__main__":
    main()
