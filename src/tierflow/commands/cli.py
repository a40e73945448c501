"""The `tierflow` command: a thin layer of argument parsing over the library."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any
from collections.abc import Callable

import numpy as np

from tierflow.commands.cache import parse_tiers, run_cache

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {}


def command(name: str):
    def register(f: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        COMMANDS[name] = f
        return f

    return register


def _size(text: str) -> int:
    from tierflow._sizes import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tierflow", description=__doc__)
    from tierflow import __version__

    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument("--version", action="version", version=f"tierflow {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("pack", help="pack raw files into a tierflow dataset")
    p.add_argument("sources", nargs="+", help="JSONL (.gz/.zst), Parquet, a directory of files or images")
    p.add_argument("--out", required=True, help="output dataset directory")
    p.add_argument("--text-field", default="text", help="the record field holding the text to tokenize (text)")
    p.add_argument("--tokenizer", help="'bytes' or PATH/tokenizer.json")
    p.add_argument("--eos-token", help="end-of-document token of a tokenizer.json")
    p.add_argument(
        "--seq-len",
        type=int,
        action="append",
        help="with --tokenizer: store the order's layout for token windows of this length, so a loader "
        "with this seq_len starts without a pass over every shard (repeatable; default: 2048, 4096 and 8192)",
    )
    p.add_argument("--keep-text", action="store_true", help="keep the text column next to the tokens")
    p.add_argument(
        "--shard-size",
        type=_size,
        default=None,
        help="target decoded shard size (256MB; input files under 16GB: their size / 64, at least 1MB)",
    )
    p.add_argument(
        "--compression",
        choices=("zstd", "lz4", "none"),
        default="zstd",
        help="block compression of the shards at rest (zstd)",
    )
    p.add_argument("--workers", type=int, default=None, help="processes (default: every core)")
    p.add_argument(
        "--kind",
        choices=("auto", "jsonl", "parquet", "files", "images", "webdataset"),
        default="auto",
        help="what to pack from a directory: auto decides from every file name and refuses a mix; "
        "jsonl, parquet, images, webdataset (.tar shards) pack that kind and count the other files as "
        "skipped; files packs every file as raw text",
    )
    p.add_argument("--include", action="append", default=[], help="glob of files to take from directories")
    p.add_argument("--exclude", action="append", default=[], help="glob of files or directories to skip")
    p.add_argument(
        "--on-error",
        choices=("raise", "skip"),
        default="raise",
        help="a bad record or file: stop naming it (raise), or count it by reason and go on (skip)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace a finished dataset at --out")
    p.add_argument("--endpoint-url", help="S3-compatible endpoint when --out is s3://")
    p.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    p.add_argument(
        "--engine",
        choices=("local", "ray"),
        default="local",
        help="run the units on this machine's processes (local) or as Ray tasks (ray); same shards",
    )
    p.add_argument(
        "--address",
        help="Ray cluster to join with --engine ray (auto, ray://HOST:10001; "
        "default: $RAY_ADDRESS, else a local cluster)",
    )

    p = sub.add_parser("inspect", help="manifest summary and the first samples")
    p.add_argument("dataset", help="dataset directory or URL (s3://bucket/prefix, file://...)")
    p.add_argument("-n", type=int, default=3, help="samples to show")
    p.add_argument("--endpoint-url", help="S3-compatible endpoint for s3:// URLs")

    p = sub.add_parser("verify", help="check every checksum; exit 1 naming each bad shard and block")
    p.add_argument("dataset", help="dataset directory or URL (a remote shard is hashed as it streams)")
    p.add_argument("--endpoint-url", help="S3-compatible endpoint for s3:// URLs")

    p = sub.add_parser("cache", help="show, warm, evict or clean a node's tiers")
    p.add_argument(
        "action",
        choices=("ls", "warm", "evict", "clean"),
        help="list entries, pre-stage a dataset, evict entries, or remove leftover files",
    )
    p.add_argument("dataset", nargs="?", help="dataset URL (warm) or dataset id (evict)")
    p.add_argument(
        "--all",
        action="store_true",
        dest="all_datasets",
        help="evict every dataset's entries: the tiers are the node's, other jobs' entries included",
    )
    p.add_argument(
        "--tier",
        action="append",
        default=[],
        metavar="NAME=PATH[:CAPACITY[:POLICY[:FORM]]]",
        help="a tier of this node (default: L2 under $TIERFLOW_CACHE or ~/.cache/tierflow)",
    )
    p.add_argument("--endpoint-url", help="S3-compatible endpoint for s3:// URLs")

    p = sub.add_parser("demo", help="end-to-end demo on the standard library's source files")
    p.add_argument("--out", default="demo-out", help="folder for the packed data, event log and report")
    p.add_argument("--max-files", type=int, default=None, help="a reduced run (CI)")
    p.add_argument(
        "--images",
        action="store_true",
        help="the multimodal demo instead: JPEGs cut from sample photographs, packed, decoded and "
        "augmented through a throttled L4 and a small L2, a tiny CNN trained (out: demo-images)",
    )
    p.add_argument("--count", type=int, default=2000, help="with --images: how many JPEGs (2000)")

    p = sub.add_parser(
        "gc", help="remove the shards of a dataset (directory or URL) that its manifest does not reference"
    )
    p.add_argument("dataset", help="dataset directory or URL (on a URL, shards written after the manifest stay)")
    p.add_argument("--endpoint-url", help="S3-compatible endpoint for s3:// URLs")

    p = sub.add_parser(
        "upgrade",
        help="write a dataset's version-3 metadata (mapped shard, block and order-layout tables "
        "beside a small header) in place, from its manifest.json (or, with none, add what version-3 "
        "metadata an older tierflow wrote lacks: the order's layout, the chunk tables, the summary); atomic",
    )
    p.add_argument("dataset", help="dataset directory or URL (the manifest.json stays for older readers)")
    p.add_argument("--endpoint-url", help="S3-compatible endpoint for s3:// URLs")
    p.add_argument(
        "--seq-len",
        type=int,
        action="append",
        default=[],
        help="also store the token-window order's layout for windows of this length, so a loader with "
        "this seq_len starts without a pass over every shard (repeatable; a token dataset's; a version-2 one "
        "given none gets 2048, 4096 and 8192, as pack stores them)",
    )

    p = sub.add_parser("bench", help="the loader driving a step vs the dry run (same batches preloaded)")
    p.add_argument("dataset", help="dataset directory or URL")
    p.add_argument("--steps", type=int, default=100, help="training steps to run")
    p.add_argument("--step-ms", type=float, default=10.0, help="simulated step time")
    p.add_argument("--batch-size", type=int, default=8, help="samples per batch")
    p.add_argument("--seq-len", type=int, default=None, help="token windows of this length (default: samples)")
    p.add_argument("--workers", type=int, default=0, help="DataLoader workers (0: a background thread)")
    p.add_argument(
        "--tier",
        action="append",
        default=[],
        metavar="NAME=PATH[:CAPACITY[:POLICY[:FORM]]]",
        help="a tier of this node (default: none, read the source directly)",
    )
    p.add_argument("--endpoint-url", help="S3-compatible endpoint for s3:// URLs")
    p.add_argument(
        "--bandwidth",
        type=_size,
        default=None,
        help="this job's cap on its fetches, bytes/s (under the node's TIERFLOW_NODE_BANDWIDTH)",
    )
    p.add_argument("--log", help="write the run's JSONL event log here (for report and top)")
    p.add_argument("--prometheus-port", type=int, default=None, help="serve metrics on 127.0.0.1:PORT")

    p = sub.add_parser(
        "plan", help="predict bytes per epoch through the tiers before a run, and the curve of bytes against capacity"
    )
    p.add_argument("dataset", help="dataset directory or URL")
    p.add_argument(
        "--tier",
        action="append",
        default=[],
        metavar="NAME=PATH[:CAPACITY[:POLICY[:FORM]]]",
        help="the node's top tier (default: L2 under $TIERFLOW_CACHE or ~/.cache/tierflow)",
    )
    p.add_argument("--batch-size", type=int, default=8, help="samples per batch")
    p.add_argument("--seq-len", type=int, default=None, help="token windows of this length (default: samples)")
    p.add_argument("--epochs", type=int, default=3, help="epochs to plan over")
    p.add_argument("--endpoint-url", help="S3-compatible endpoint for s3:// URLs")

    p = sub.add_parser("report", help="plot a run's JSONL event log into a PNG")
    p.add_argument("log", help="the run's JSONL event log (bench --log)")
    p.add_argument("--out", default=None, help="PNG path (default: the log's name with .png)")

    p = sub.add_parser("top", help="live view of a running job from its JSONL event log")
    p.add_argument("log", help="the job's JSONL event log")
    p.add_argument("--once", action="store_true", help="print the current state and exit")
    p.add_argument("--refresh", type=float, default=1.0, help="seconds between refreshes")

    from tierflow.commands.ckpt import add_ckpt_parser, run_ckpt

    add_ckpt_parser(sub)
    COMMANDS["ckpt"] = run_ckpt
    return parser


@command("pack")
def _pack(args: argparse.Namespace) -> int:
    from tierflow.pack.packer import pack

    pack(
        args.sources,
        args.out,
        workers=args.workers,
        target_shard_bytes=args.shard_size,
        compression=args.compression,
        tokenizer=args.tokenizer,
        eos_token=args.eos_token,
        text_field=args.text_field,
        keep_text=args.keep_text,
        kind=args.kind,
        include=args.include,
        exclude=args.exclude,
        on_error=args.on_error,
        overwrite=args.overwrite,
        progress=not args.quiet,
        endpoint_url=args.endpoint_url,
        engine=args.engine,
        address=args.address,
        seq_len=args.seq_len,
    )
    return 0


def _short(value: Any, limit: int = 80) -> str:
    if isinstance(value, np.ndarray):
        head = np.array2string(value[:12], separator=",")
        return f"{value.dtype}[{len(value)}] {head}{'…' if len(value) > 12 else ''}"
    if isinstance(value, bytes):
        return f"bytes[{len(value)}] {value[:24]!r}{'…' if len(value) > 24 else ''}"
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


@command("inspect")
def _inspect(args: argparse.Namespace) -> int:
    from tierflow._console import folding_table, output_console

    from tierflow import open_dataset
    from tierflow.format.metadata import shard_column

    ds = open_dataset(args.dataset, endpoint_url=args.endpoint_url)
    m = ds.manifest
    console = output_console()
    at_rest = int(shard_column(m, "bytes").sum())  # a mapped column: no object per shard
    decoded = int(shard_column(m, "decoded_bytes").sum())
    console.print(f"[bold]{args.dataset}[/]  dataset {m.dataset_id}  format v{m.format_version}")
    console.print(
        f"{m.num_samples:,} samples in {len(m.shards)} shards; {at_rest / 1e6:.1f} MB at rest, "
        f"{decoded / 1e6:.1f} MB decoded"
    )
    if m.token_column:
        console.print(f"{m.num_tokens:,} tokens ({m.token_dtype}), tokenizer {m.tokenizer}")
        stored = sorted(int(n) for n in (getattr(m, "header", None) or {}).get("windows") or {})
        if stored:
            console.print("token-window layouts stored for seq_len " + ", ".join(str(n) for n in stored))
    console.print("columns: " + ", ".join(f"{f.name}: {f.type}" for f in m.schema))
    table = folding_table("#", *ds.columns)
    for i in range(min(args.n, len(ds))):
        sample = ds[i]
        table.add_row(str(i), *(_short(sample[c]) for c in ds.columns))
    console.print(table)
    return 0


@command("verify")
def _verify(args: argparse.Namespace) -> int:
    from tierflow.format.manifest import Manifest
    from tierflow.format._audit import audit_manifest
    from tierflow.format.verify import verify_shard
    from tierflow.storage.datasets import local_path, read_manifest, verify_source
    from tierflow.storage.remote import open_store

    from tierflow.format.metadata import MappedManifest
    from tierflow.format.metadata_verify import verify_metadata

    root = local_path(args.dataset)
    if root is not None:
        manifest = Manifest.load(root)
        # version 3: both tables hashed whole, every shard's block rows and the dataset id, streaming
        problems = verify_metadata(manifest) if isinstance(manifest, MappedManifest) else []
        if not problems:  # the shards' entries are sound: now the shards against them
            problems = [p for info in manifest.shards for p in verify_shard(root / info.name, info)]
        if not problems:  # the hashes hold: now the manifest's counts against the bytes
            problems = audit_manifest(root, manifest)
    else:
        source = open_store(args.dataset, endpoint_url=args.endpoint_url)
        manifest = read_manifest(source)
        problems = verify_metadata(manifest) if isinstance(manifest, MappedManifest) else []
        problems = problems or verify_source(source, manifest)
    if not manifest.checksummed:
        print(
            f"{args.dataset}: the manifest has no checksum (packed before tierflow wrote one); its counts "
            f"were checked against the shard bytes instead",
            file=sys.stderr,
        )
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        print(f"{args.dataset}: {len(problems)} problem(s) in {len(manifest.shards)} shards", file=sys.stderr)
        return 1
    print(f"{args.dataset}: {len(manifest.shards)} shards, {manifest.num_samples:,} samples: all checksums match")
    return 0


@command("gc")
def _gc(args: argparse.Namespace) -> int:
    from tierflow.format.manifest import Manifest
    from tierflow.pack.dataset_dir import DatasetLock, remove_unreferenced
    from tierflow.storage.datasets import collect_garbage, local_path
    from tierflow.storage.remote import open_store

    root = local_path(args.dataset)
    if root is None:
        removed_objects = collect_garbage(open_store(args.dataset, endpoint_url=args.endpoint_url))
        print(f"{args.dataset}: removed {len(removed_objects)} unreferenced object(s)")
        return 0
    Manifest.load(root)  # not a dataset (no manifest): refuse before writing the lock into it
    with DatasetLock(root):
        removed = remove_unreferenced(root, Manifest.load(root))  # the manifest a finished pack left
    print(f"{root}: removed {len(removed)} unreferenced file(s)")
    return 0


UPDATED = "metadata brought up to date (the order's layouts, the chunk tables, the summary: what it lacked)"


@command("upgrade")
def _upgrade(args: argparse.Namespace) -> int:
    """Version-3 metadata for a dataset, in place: tables under content-named files, the header last
    (temp file, fsync, rename); a crash before that leaves the dataset as it was."""
    import tempfile

    from tierflow.format.manifest import MANIFEST_NAME
    from tierflow.format.metadata_writer import upgrade
    from tierflow.storage.datasets import upgrade_source
    from tierflow.pack.dataset_dir import DatasetLock
    from tierflow.storage.datasets import local_path
    from tierflow.storage.remote import open_store

    root = local_path(args.dataset)
    if root is None:
        from tierflow.errors import SourceNotFound
        from tierflow.storage.datasets import update_header_source

        source = open_store(args.dataset, endpoint_url=args.endpoint_url)
        with tempfile.TemporaryDirectory(prefix="tierflow-upgrade-") as work:
            try:
                source.size(MANIFEST_NAME)
            except SourceNotFound:  # version 3 already (or nothing): add what an older tierflow left out
                updated = update_header_source(source, work, args.seq_len)
                print(f"{args.dataset}: " + (UPDATED if updated else "up to date, nothing to write"))
                return 0
            where = upgrade_source(source, work, args.seq_len)
    else:
        from tierflow.format.metadata import has_metadata
        from tierflow.format.metadata_writer import update_header

        if not (root / MANIFEST_NAME).is_file():
            if not has_metadata(root):
                print(f"{root}: no manifest.json to upgrade from", file=sys.stderr)
                return 1
            with DatasetLock(root):  # version 3 already: add what an older tierflow left out
                written = update_header(root, args.seq_len)
            print(f"{args.dataset}: " + (UPDATED if written is not None else "up to date, nothing to write"))
            return 0
        with DatasetLock(root):
            where = str(upgrade(root, args.seq_len))
    print(f"{args.dataset}: version-3 metadata written ({where})")
    return 0


@command("cache")
def _cache(args: argparse.Namespace) -> int:
    return run_cache(args)


@command("demo")
def _demo(args: argparse.Namespace) -> int:
    if args.images:
        from tierflow.commands.demo_images import run_images_demo

        run_images_demo(args.out if args.out != "demo-out" else "demo-images", images=args.count)
        return 0
    from tierflow.commands.demo import run_demo

    run_demo(args.out, max_files=args.max_files)
    return 0


@command("bench")
def _bench(args: argparse.Namespace) -> int:
    from tierflow.format.shard import Form
    from tierflow.loader import TieredDataset, BatchSpec
    from tierflow.telemetry import MetricsRegistry
    from tierflow.commands.bench import format_result, run_bench, simulated_step
    from tierflow.telemetry.eventlog import EventLog
    from tierflow.tiers import build_stack

    registry = MetricsRegistry()
    configs = parse_tiers(args.tier) if args.tier else []
    stack = build_stack(
        args.dataset, configs, endpoint_url=args.endpoint_url, bandwidth=args.bandwidth, registry=registry
    )
    dataset = TieredDataset(stack.dataset(), BatchSpec(batch_size=args.batch_size, seq_len=args.seq_len))
    events = (
        EventLog(args.log, registry, name=f"bench {args.dataset}", steps=args.steps, step_ms=args.step_ms)
        if args.log
        else None
    )
    exporter = None
    if args.prometheus_port is not None:
        from tierflow.telemetry.prometheus import PrometheusExporter

        exporter = PrometheusExporter([registry], port=args.prometheus_port).start()
        print(f"metrics at {exporter.url}")
    layout = [(t.name, t.capacity, t.form is Form.DECODED) for t in stack.tiers]
    try:
        from tierflow.tiers.stager import Stager

        stager = Stager(dataset, stack) if stack.tiers else None
        result = run_bench(
            dataset,
            args.steps,
            simulated_step(args.step_ms),
            num_workers=args.workers,
            registry=registry,
            events=events,
            tier_layout=layout,
            stager=stager,
            budget=getattr(stack.source, "budget", None),
        )
    finally:
        if exporter is not None:
            exporter.stop()
    print(format_result(result, args.step_ms))
    return 0


@command("plan")
def _plan(args: argparse.Namespace) -> int:
    from tierflow._console import folding_table, output_console

    from tierflow.loader import TieredDataset, BatchSpec
    from tierflow.commands.plan import CURVE, capacity_curve, choose_sample, node_uses, plan_cache, recommended
    from tierflow.format.shard import Form
    from tierflow.tiers import build_stack

    stack = build_stack(args.dataset, parse_tiers(args.tier), endpoint_url=args.endpoint_url)
    top = stack.tiers[0]
    dataset = TieredDataset(stack.dataset(), BatchSpec(batch_size=args.batch_size, seq_len=args.seq_len))
    from tierflow.format.metadata import shard_column

    shards = dataset.manifest.shards
    at_rest = int(shard_column(dataset.manifest, "bytes").sum())
    decoded = int(shard_column(dataset.manifest, "decoded_bytes").sum())
    sample = choose_sample(dataset)  # a huge dataset: a sample of its shards (said below)
    uses = node_uses(dataset, dataset.working_set, args.epochs, sample)  # one walk of the order for every plan below
    plans = {
        form: plan_cache(
            dataset,
            top.capacity,
            epochs=args.epochs,
            policy=top.policy_name,
            form=form,
            working_set=dataset.working_set,
            uses=uses,
            sample=sample,
        )
        for form in (Form.AT_REST, Form.DECODED)
    }
    plan = plans[top.form]
    console = output_console()
    ws = dataset.working_set
    console.print(
        f"{args.dataset}: {len(shards)} shards, {at_rest / 1e6:.1f} MB at rest, {decoded / 1e6:.1f} MB "
        f"decoded ({decoded / max(at_rest, 1):.1f}x); {top.name} {top.capacity / 1e6:.1f} MB "
        f"({top.capacity / max(at_rest, 1):.0%} of the dataset at rest, {top.capacity / max(decoded, 1):.0%} "
        f"of it decoded), form {top.form}, policy {top.policy_name}"
    )
    console.print(
        f"working set: {ws.lanes} lanes x windows of {ws.window_shards} shards = {ws.shards} shards "
        f"({ws.reason}; the same at any capacity); staging area {plan.staging / 1e6:.1f} MB in "
        f"{top.name}'s form"
    )
    if ws.first_epoch is not None:
        console.print(
            f"first epoch: {ws.first_epoch[0]} lanes at a time x windows of {ws.first_epoch[1]} shards "
            f"(a cold node streams it at the link's rate; narrow_first_epoch=False reads it as wide)"
        )
    mark = {form: " (this tier)" if form is top.form else "" for form in plans}
    table = folding_table(
        "epoch",
        *(f"{form} from below{mark[form]}" for form in plans),
        "of the dataset",
        "optimum (same room)",
        f"optimum ({top.name} alone)",
    )
    for epoch, got in enumerate(plan.predicted):
        table.add_row(
            str(got.epoch + 1),
            *(f"{p.predicted[epoch].fetched / 1e6:.2f} MB ({p.predicted[epoch].ratio:.2f})" for p in plans.values()),
            f"{got.ratio:.2f}",
            f"{plan.optimum[epoch].ratio:.2f}",
            f"{plan.tier_optimum[epoch].ratio:.2f}" if plan.tier_optimum else "-",
        )
    console.print(table)
    console.print(
        "bytes from below per epoch, predicted for each form at this capacity; ratios are of the dataset "
        "at rest (a tier keeps shards at rest unless it holds the whole decoded dataset: docs/tiers.md)"
    )
    if sample is not None:
        console.print(sample.describe())
    curve = capacity_curve(
        dataset, CURVE, epochs=args.epochs, form=top.form, policy=top.policy_name, uses=uses, sample=sample
    )
    table = folding_table(f"{top.name} capacity", "of the dataset at rest", "warm epoch from below", "optimum")
    for point, fraction in zip(curve, CURVE):
        table.add_row(
            f"{point.capacity / 1e6:.1f} MB", f"{fraction:.0%}", f"{point.warm_ratio:.2f}", f"{point.warm_optimum:.2f}"
        )
    console.print(table)
    console.print(recommended(curve, at_rest))
    return 0


@command("report")
def _report(args: argparse.Namespace) -> int:
    from tierflow.commands.report import write_report

    path, _ = write_report(args.log, args.out)
    print(f"wrote {path}")
    return 0


@command("top")
def _top(args: argparse.Namespace) -> int:
    from tierflow.commands.top import run_top

    run_top(args.log, refresh_s=args.refresh, once=args.once)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    from tierflow.format.manifest import ManifestError
    from tierflow.pack.tokenize import PackInputError

    try:
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        if args.verbose:
            raise
        resume = (
            "; nothing was published: rerun the same command to carry on (the shards it sealed are kept)"
            if args.command == "pack"
            else ""
        )
        print(f"tierflow {args.command}: interrupted{resume}", file=sys.stderr)
        return 130
    except (PackInputError, ManifestError, FileNotFoundError, KeyError, ValueError, OSError) as e:
        if args.verbose:
            raise
        print(f"tierflow {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
