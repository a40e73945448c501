"""`tierflow cache ls|warm|evict|clean` and `--tier` parsing, kept apart so cli.py stays a small parser."""

from __future__ import annotations

import argparse
import sys


def parse_tiers(specs: list[str]) -> list:
    """`--tier` values as TierConfigs; none: one L2 under $TIERFLOW_CACHE or ~/.cache/tierflow."""
    import os

    from tierflow.tiers import TierConfig

    if not specs:
        root = os.environ.get("TIERFLOW_CACHE", os.path.expanduser("~/.cache/tierflow"))
        specs = [f"L2={root}/L2:50%disk"]
    return [TierConfig.parse(spec) for spec in specs]


def _confirm_evict_all(tiers: list) -> None:
    """`cache evict` without a dataset id empties tiers every job on the node shares: asked at a
    terminal, refused elsewhere unless --all says so. Tiers with nothing in them need no asking."""
    entries = [r for t in tiers for r in t.index.entries()]
    if not entries:
        return
    datasets = len({r.dataset for r in entries})
    what = f"{len(entries)} entries of {datasets} dataset{'s' * (datasets != 1)} from " + ", ".join(
        f"{t.name} ({t.root})" for t in tiers
    )
    if sys.stdin.isatty():
        answer = input(f"evict {what}? These tiers are the node's: other jobs' entries go too. [y/N] ")
        if answer.strip().lower() in ("y", "yes"):
            return
        raise ValueError("nothing evicted")
    raise ValueError(
        f"without a dataset id this would evict {what}, other jobs' included; pass a dataset id "
        f"(see `tierflow cache ls`) or --all"
    )


def run_cache(args: argparse.Namespace) -> int:
    """`tierflow cache ls|warm|evict|clean`: list, pre-stage, evict or clean the node's tiers."""
    from tierflow._console import folding_table, output_console

    from tierflow.tiers import build_stack

    configs = parse_tiers(args.tier)
    console = output_console()
    if args.action == "warm":
        if not args.dataset:
            raise ValueError("tierflow cache warm DATASET_URL")
        stack = build_stack(args.dataset, configs, endpoint_url=args.endpoint_url)
        manifest = stack.manifest()
        from rich.progress import Progress

        with Progress(transient=True) as progress:
            task = progress.add_task(f"warming {args.dataset}", total=len(manifest.shards))
            warmed, declined = stack.warm(lambda: progress.advance(task))
        console.print(
            f"warmed {warmed} shards of {manifest.dataset_id}"
            + (f"; {declined} did not fit (no tier would take them)" if declined else "")
        )
    tiers = [c.build(configure=False) for c in configs]  # a look: the first job to write decides the config
    if args.action == "evict":
        if not args.dataset and not args.all_datasets:
            _confirm_evict_all(tiers)
        for t in tiers:
            keys = None
            if args.dataset:
                keys = [r.key for r in t.index.entries() if r.dataset == args.dataset]
            console.print(f"{t.name}: evicted {t.evict(keys)} entries")
    if args.action == "clean":
        for t in tiers:
            console.print(f"{t.name}: removed {t.clean()} leftover files")
    if args.action in ("ls", "warm"):
        table = folding_table("tier", "path", "form", "policy", "dataset", "entries", "bytes", "capacity")
        for t in tiers:
            per_dataset: dict[str, list[int]] = {}
            for r in t.index.entries():
                per_dataset.setdefault(r.dataset or "-", []).append(r.size)
            snap = t.snapshot()
            for dataset, sizes in sorted(per_dataset.items()) or [("-", [])]:
                table.add_row(
                    t.name,
                    str(t.root),
                    t.form,
                    t.policy_name,
                    dataset,
                    str(len(sizes)),
                    f"{sum(sizes) / 1e6:.1f} MB",
                    f"{snap['capacity'] / 1e6:.1f} MB",
                )
        console.print(table)
    return 0
