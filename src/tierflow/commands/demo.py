"""`tierflow demo`: README's main job, end to end, on data every Python install has.

1. Pack the standard library's own source files (thousands of small files, site-/dist-packages
   excluded) into ~1 MB byte-tokenised shards, and check every sample against its file.
2. Phase 1: that directory plays L4 behind a bandwidth throttle; three epochs of the loader with
   a 5 ms simulated step, L2 capped at a third of the dataset, the stager ahead of the loop; then
   the dry run (the same batches preloaded driving the same step). Bytes fetched per epoch
   (cold, then warm) against the optimum for the same trace, and a verdict.
3. Phase 2: a small byte-level language model trained for ~200 steps through the same loader.
It writes the run's event log and the report PNG next to the dataset.
"""

from __future__ import annotations

import os
import shutil
import sysconfig
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable

import numpy as np
from rich.console import Console

from tierflow._console import folding_table, output_console

from tierflow.storage.datasets import open_dataset
from tierflow.format.shard import Form
from tierflow.format.verify import verify_shard
from tierflow.pack.packer import pack

STDLIB_EXCLUDE = ("site-packages", "dist-packages", "__pycache__", "*.pyc")
INCLUDE = ("*.py",)


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _subset(source: Path, dest: Path, max_files: int) -> Path:
    """The first `max_files` files of the tree, copied: a reduced demo for CI."""
    from tierflow.pack.units import SourceOptions
    from tierflow.pack._tree import walk_files

    shutil.rmtree(dest, ignore_errors=True)
    files = walk_files(str(source), SourceOptions(include=INCLUDE, exclude=STDLIB_EXCLUDE))
    for _, rel in zip(range(max_files), files):
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / rel, dest / rel)
    return dest


def pack_and_check(source: Path, out: Path, shard_bytes: int, console: Console) -> float:
    console.rule("[bold]1. pack the standard library")
    console.print(f"source: {source} (*.py; site-/dist-packages excluded)")
    summary = pack(
        [source],
        out,
        target_shard_bytes=shard_bytes,
        include=INCLUDE,
        exclude=STDLIB_EXCLUDE,
        tokenizer="bytes",
        overwrite=True,
        progress=True,
    )
    ds = open_dataset(out)
    bad = [p for info in ds.manifest.shards for p in verify_shard(out / info.name, info)]
    eos = ds.manifest.eos_id
    assert eos is not None, "the bytes tokenizer ends each document with an eos id"
    mismatched = sum(
        not np.array_equal(
            sample["tokens"], np.append(np.frombuffer((source / sample["path"]).read_bytes(), np.uint8), eos)
        )
        for sample in ds
    )
    if bad or mismatched:
        raise SystemExit(f"demo: {len(bad)} bad shards, {mismatched} samples differ from their files")
    console.print(
        f"verified {len(ds.manifest.shards)} shards; all {len(ds):,} samples equal their files (byte tokens + EOS)"
    )
    return summary.seconds


def run_demo(
    out: str | os.PathLike = "demo-out",
    max_files: int | None = None,
    shard_bytes: int = 1 << 20,
    step_ms: float = 5.0,
    epochs: int = 3,
    train_steps: int = 200,
    bandwidth: float = 2e6,
    seq_len: int = 1024,
    batch_size: int = 16,
    console: Console | None = None,
) -> dict:
    import logging

    from tierflow.loader import TieredDataset, BatchSpec
    from tierflow.tiers.stager import Stager
    from tierflow.telemetry import MetricsRegistry
    from tierflow.commands.bench import format_result, run_bench, simulated_step
    from tierflow.telemetry.eventlog import EventLog
    from tierflow.telemetry.tier_figures import STACK_SOURCE_BYTES
    from tierflow.commands.report import write_report
    from tierflow.tiers import TierConfig, build_stack

    logging.getLogger("tierflow.pack").setLevel(logging.ERROR)  # the demo's shards are small on purpose
    console = console or output_console()
    out = Path(out)
    started = time.perf_counter()
    source = stdlib_dir()
    if max_files is not None:
        source = _subset(source, out / "source-subset", max_files)
    dataset_dir = out / "dataset"
    pack_s = pack_and_check(source, dataset_dir, shard_bytes, console)

    manifest = open_dataset(dataset_dir).manifest
    decoded = sum(s.decoded_bytes for s in manifest.shards)
    at_rest = sum(s.bytes for s in manifest.shards)
    node = out / "node"
    shutil.rmtree(node, ignore_errors=True)
    # a 30% cache, on the user's yardstick: 30% of the dataset's bytes at rest (at least 4 shards)
    l2_capacity = max(int(0.3 * at_rest), 4 * max(s.bytes for s in manifest.shards))
    registry = MetricsRegistry()
    stack = build_stack(
        str(dataset_dir), [TierConfig("L2", str(node / "L2"), l2_capacity)], bandwidth=bandwidth, registry=registry
    )
    l2 = stack.tiers[0]
    console.rule("[bold]2. three epochs through a throttled L4 and a small L2")
    console.print(
        f"L4: {dataset_dir} at {bandwidth / 1e6:.1f} MB/s; L2: {node / 'L2'} holds "
        f"{l2_capacity / 1e6:.1f} MB, {l2_capacity / at_rest:.0%} of the dataset's {at_rest / 1e6:.1f} MB at "
        f"rest ({decoded / 1e6:.1f} MB decoded), kept {l2.form}; step {step_ms:g} ms; batches of "
        f"{batch_size} x {seq_len + 1} tokens"
    )
    ds = TieredDataset(
        stack.dataset(), BatchSpec(batch_size=batch_size, seq_len=seq_len)
    )  # defaults: the dataset's order
    ws = ds.working_set
    console.print(
        f"order: {ws.lanes} lane(s) x windows of {ws.window_shards} shard(s) ({ws.reason}); "
        f"staging area {stack.staging_bytes / 1e6:.1f} MB of RAM"
    )
    stager = Stager(ds, stack)
    steps_per_epoch = max(1, ds.num_order_samples // (batch_size * ds.world.ranks_per_node))
    source_bytes = registry.counter(STACK_SOURCE_BYTES, {"tier": "source"})
    windows: list[int] = []  # source bytes while each epoch ran
    staged: list[int] = []  # of which the stager's, for any epoch
    mark = [0, 0]

    def on_batch(i: int, batch: dict) -> None:
        if (i + 1) % steps_per_epoch == 0:
            by_stager = sum(stager.source_bytes_by_epoch.values())
            windows.append(int(source_bytes.value) - mark[0])
            staged.append(by_stager - mark[1])
            mark[:] = [int(source_bytes.value), by_stager]

    log_path = out / "run.jsonl"
    events = EventLog(log_path, registry, name="tierflow demo", steps=epochs * steps_per_epoch, step_ms=step_ms)
    result = run_bench(
        ds,
        epochs * steps_per_epoch,
        simulated_step(step_ms),
        registry=registry,
        events=events,
        tier_layout=[(t.name, t.capacity, t.form is Form.DECODED) for t in stack.tiers],
        stager=stager,
        on_batch=on_batch,
        budget=getattr(stack.source, "budget", None),
    )
    stack.close()
    # each epoch's bytes are those that served it: the readers' own fetches while it ran, and the
    # stager's for it whenever they ran (the cold epoch's lookahead into the next is the next one's)
    per_epoch = [w - st + stager.source_bytes_by_epoch.get(e, 0) for e, (w, st) in enumerate(zip(windows, staged))]
    console.print(format_result(result, step_ms))
    table = folding_table("epoch", "bytes from L4 (at rest) for it", "of the dataset")
    for e, nbytes in enumerate(per_epoch):
        table.add_row(f"{e + 1} ({'cold' if e == 0 else 'warm'})", f"{nbytes / 1e6:.2f} MB", f"{nbytes / at_rest:.0%}")
    console.print(table)
    png, _ = write_report(log_path, out / "report.png")

    console.rule("[bold]3. train a byte-level language model through the same loader")
    losses, params, train_s = train_tiny_lm(stack, train_steps, console)
    total = time.perf_counter() - started
    console.rule("[bold]summary")
    l2_figures = result.tiers.get("L2")
    lines = [
        f"pack: {manifest.num_samples:,} files -> {len(manifest.shards)} shards in {pack_s:.1f} s",
        f"loader: {result.throughput:.0f} batches/s vs dry run {result.dry_run_throughput:.0f} "
        f"(ratio {result.ratio:.2f}); bubble rate {result.loader.bubble_rate:.1%}",
    ]
    if l2_figures is not None:
        lines.append(
            f"L2 demand hit ratio {l2_figures.demand_hit_ratio:.1%}"
            + (f"; bytes from L4 {result.bytes_per_epoch.describe()}" if result.bytes_per_epoch is not None else "")
        )
    lines += [
        f"verdict: {result.verdict.bound} - {result.verdict.change}",
        f"model: {params:,} parameters, loss {losses[0]:.2f} -> {losses[-1]:.2f} in {len(losses)} steps "
        f"({train_s:.1f} s)",
        f"report: {png}   event log: {log_path}   total {total:.0f} s",
    ]
    for line in lines:
        console.print(line)
    return {
        "ratio": result.ratio,
        "per_epoch_bytes": per_epoch,
        "losses": losses,
        "report": str(png),
        "samples": manifest.num_samples,
        "shards": len(manifest.shards),
    }


def train_tiny_lm(stack, steps: int, console: Console) -> tuple[list[float], int, float]:
    """A ~0.3M-parameter causal transformer over byte tokens, fed by the same tier stack."""
    import torch
    from torch import nn

    from tierflow.loader import Loader, TieredDataset, BatchSpec, OrderSpec

    torch.manual_seed(0)
    seq_len = 128
    vocab = 257

    class TinyLM(nn.Module):
        def __init__(self, d: int = 96) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            self.pos = nn.Embedding(seq_len, d)
            layer = nn.TransformerEncoderLayer(d, nhead=4, dim_feedforward=2 * d, batch_first=True, dropout=0.0)
            self.blocks = nn.TransformerEncoder(layer, num_layers=2)
            self.head = nn.Linear(d, vocab)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            n = ids.shape[1]
            x = self.embed(ids) + self.pos(torch.arange(n))
            mask = nn.Transformer.generate_square_subsequent_mask(n)
            return self.head(self.blocks(x, mask=mask, is_causal=True))

    model = TinyLM()
    ds = TieredDataset(stack.dataset(), BatchSpec(batch_size=16, seq_len=seq_len), OrderSpec(seed=1))

    def loss_of(batch: dict) -> torch.Tensor:  # ids arrive as int64
        logits = model(batch["input_ids"])
        return nn.functional.cross_entropy(logits.reshape(-1, vocab), batch["labels"].reshape(-1))

    return train(model, Loader(ds, endless=True), loss_of, steps, console, every=50)


def train(
    model: Any, loader: Any, loss_of: Callable[[dict], Any], steps: int, console: Console, every: int
) -> tuple[list[float], int, float]:
    """`steps` AdamW steps of `model` on `loader`'s batches (across epochs): losses, parameters, seconds.

    The step runs on one intra-op thread: on a small CPU-only machine torch's OpenMP threads wait at
    every op's barrier for a core that the loader or any other process holds (20 steps measured at
    0.4-14 s with two threads and 0.7-1.9 s with one, on this 2-core machine under load), and the
    demo is about the data path, not the model's speed."""
    import torch

    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses: list[float] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    started = time.perf_counter()
    try:
        with loader:
            for step, batch in enumerate(loader):
                loss = loss_of(batch)
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
                if step % every == 0 or step + 1 == steps:
                    console.print(f"step {step:4d}  loss {losses[-1]:.3f}")
                if step + 1 == steps:
                    break
    finally:
        torch.set_num_threads(threads)
    return losses, params, time.perf_counter() - started
