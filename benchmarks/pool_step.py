"""The Loader's worker pool behind a training step: samples/s of a loop that sleeps `--step-ms` per
batch, fed by `open_loader(..., num_workers=W)`, against the dry run (DESIGN.md): the same step
driven by the same batches preloaded in a list. Tokens and text (the peers' packed datasets by
default), alternating rounds, median (min-max) of the ratio; the loader's CPU per batch beside it
(the trainer alone and the trainer with its workers), which on a 2-core machine competes with the
step's own process, and the loop's wait in next() per batch.

    PYTHONPATH=src .venv/bin/python benchmarks/pool_step.py [--work DIR | --tokens DIR --text DIR] [--rounds 3]
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path
from typing import Any


import tierflow
from _harness import round_order, spread, tree_cpu_s

BATCH = 8
SEQ_LEN = 2048


def _loader(path: str, kind: str, workers: int) -> Any:
    shape = {"seq_len": SEQ_LEN} if kind == "tokens" else {}
    return tierflow.open_loader(path, batch_size=BATCH, num_workers=workers, seed=17, endless=True, **shape)


def _stepped(batches: Any, steps: int, step_s: float) -> tuple[float, float, float, float]:
    """(samples/s, trainer CPU s, trainer + workers CPU s, seconds waited in next()) of `steps` steps
    after the first batch."""
    iterator = iter(batches)
    next(iterator)
    clock = time.perf_counter
    start, cpu, cpu_all = clock(), time.process_time(), tree_cpu_s()
    samples, waited = 0, 0.0
    for _ in range(steps):
        asked = clock()
        batch = next(iterator)
        waited += clock() - asked
        time.sleep(step_s)
        samples += len(batch["mask"])
    return samples / (clock() - start), time.process_time() - cpu, tree_cpu_s() - cpu_all, waited


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="/tmp/tierflow-peers/full", help="peers/run.py's --work/full (its data/)")
    parser.add_argument("--tokens", help="a packed token dataset (default: the peers' under --work)")
    parser.add_argument("--text", help="a packed text dataset (default: the peers' under --work)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    data = Path(args.work) / "data"
    args.tokens = args.tokens or str(data / "tierflow-tokens")
    args.text = args.text or str(data / "tierflow-docs")
    step_s = args.step_ms / 1e3
    rows = []
    for kind, path in (("tokens", args.tokens), ("text", args.text)):
        with _loader(path, kind, 0) as loader:  # the dry run's batches: the same ones, in memory
            preloaded = [dict(b) for b in itertools.islice(loader, args.steps + 1)]
        ratios, ours, dry, cpu, cpu_all, waits = [], [], [], [], [], []
        for r in range(args.rounds):
            got: dict[str, float] = {}
            for who in round_order(r, ["tierflow", "dry"]):
                if who == "dry":
                    got[who] = _stepped(preloaded, args.steps, step_s)[0]
                    continue
                with _loader(path, kind, args.workers) as loader:
                    got[who], trainer, tree, waited = _stepped(loader, args.steps, step_s)
                waits.append(waited / args.steps * 1e6)
                cpu.append(trainer / args.steps * 1e6)
                cpu_all.append(tree / args.steps * 1e6)
            ours.append(got["tierflow"])
            dry.append(got["dry"])
            ratios.append(got["tierflow"] / got["dry"])
            print(f"round {r + 1} {kind:6} ratio {ratios[-1]:.3f}", flush=True)
        rows.append((kind, ours, dry, ratios, waits, cpu, cpu_all))
    print(
        f"\n{args.rounds} alternating rounds, {args.steps} steps of {args.step_ms:g} ms, {args.workers} workers, "
        f"batch {BATCH}: median (min-max)\n"
    )
    print(
        "| data | samples/s | dry run samples/s | ratio | in next() us/batch | trainer CPU us/batch "
        "| with workers CPU us/batch |"
    )
    print("|---|---|---|---|---|---|---|")
    for kind, ours, dry, ratios, waits, cpu, cpu_all in rows:
        print(
            f"| {kind} | {spread(ours, '.0f')} | {spread(dry, '.0f')} | {spread(ratios, '.3f')} "
            f"| {spread(waits, '.0f')} | {spread(cpu, '.0f')} | {spread(cpu_all, '.0f')} |"
        )
    print("\nin next(): the loop's wait for each batch, what the loader adds to the step (the rest of a ratio")
    print("below 1 is the step's own overrun: a sleep that wakes late on a loaded machine, in both loops).")


if __name__ == "__main__":
    main()
