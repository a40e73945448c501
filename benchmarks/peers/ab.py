"""tierflow against tierflow: the raw path's cells (run.py's `raw` child, its PSS sampler) read by two
source trees in alternating rounds, so a change's peak PSS and samples/s are compared side by side.

    .venv-peers/bin/python benchmarks/peers/ab.py --before /work/main/src --after src [--rounds 3]

Run `make bench-peers ARGS="--only raw"` once first: it builds the corpus and the packed datasets
under --work, which this reads. Prints, per cell (tokens / text x main process / 2 workers), the
median (min-max) of each tree's peak PSS summed over the child and its workers, samples/s, and CPU
microseconds per sample of the child and its workers (the epoch after its first batch), which a
loaded machine inflates far less than the wall.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for _path in (HERE.parent, HERE):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from _harness import round_order, spread  # noqa: E402
from run import RAW_CELLS, log, run_child  # noqa: E402

MB = 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the source tree (a src/ folder) measured as 'before'")
    parser.add_argument("--after", required=True, help="the source tree measured as 'after'")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=17)
    parser.add_argument("--work", default="/tmp/tierflow-peers/full", help="run.py's --work/full (its data/)")
    args = parser.parse_args()
    data = Path(args.work) / "data"
    paths = {"tokens": data / "tierflow-tokens", "text": data / "tierflow-docs"}
    missing = [str(p) for p in paths.values() if not (p / "manifest.json").exists()]
    if missing:
        raise SystemExit(f"no packed dataset at {missing}: run make bench-peers ARGS='--only raw' first")
    trees = {"before": str(Path(args.before).resolve()), "after": str(Path(args.after).resolve())}
    envs = {
        name: {**os.environ, "TQDM_DISABLE": "1", "PYTHONPATH": os.pathsep.join([str(HERE), tree])}
        for name, tree in trees.items()
    }
    cells: dict[str, dict[str, list[dict]]] = {f"{k}_w{w}": {t: [] for t in trees} for k, w in RAW_CELLS}
    for r in range(args.rounds):
        for kind, workers in RAW_CELLS:
            for tree in round_order(r, list(trees)):
                res = run_child(
                    "raw",
                    envs[tree],
                    system="tierflow",
                    kind=kind,
                    data=str(paths[kind]),
                    workers=workers,
                    seed=args.seed,
                )
                cells[f"{kind}_w{workers}"][tree].append(res)
                log(
                    f"round {r + 1} {kind:6} {workers} workers {tree:6} peak PSS {res['peak_pss'] / MB:6.0f} MB "
                    f"{res['samples_per_s']:9,.0f} samples/s {cpu_us(res):7.1f} CPU us/sample"
                )
    print(f"\n{args.rounds} alternating rounds; before = {trees['before']}, after = {trees['after']}\n")
    print(
        "| data | mode | peak PSS before (MB) | peak PSS after (MB) | samples/s before (k) | samples/s after (k) "
        "| CPU us/sample before | CPU us/sample after |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for kind, workers in RAW_CELLS:
        runs = cells[f"{kind}_w{workers}"]
        pss = [spread([x["peak_pss"] for x in runs[t]], ".0f", 1 / MB) for t in trees]
        rate = [spread([x["samples_per_s"] for x in runs[t]], ".1f", 1e-3) for t in trees]
        cpu = [spread([cpu_us(x) for x in runs[t]], ".1f") for t in trees]
        mode = "main process" if workers == 0 else f"{workers} workers"
        print(f"| {kind} | {mode} | {pss[0]} | {pss[1]} | {rate[0]} | {rate[1]} | {cpu[0]} | {cpu[1]} |")
    print("\nCPU us/sample: the child and its workers over the epoch.")


def cpu_us(result: dict) -> float:
    """CPU microseconds per sample of the child and its workers (a loaded machine stretches the wall far more)."""
    return result.get("cpu_all_s", result["cpu_s"]) / max(1, result["samples"]) * 1e6


if __name__ == "__main__":
    main()
