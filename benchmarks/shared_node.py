"""Jobs sharing one node's tiers (issue 15, item 4): independent processes, no shared Python state.

Same dataset: two jobs (seeds 1 and 2, 2 epochs each) through one L1 + L2 with room for the
dataset; the node's bytes from S3 against the dataset (1.00 = one fetch per shard for both jobs),
beside the same two jobs each on its own tier directories (what they fetch without sharing).

Different datasets: two jobs on datasets a and b of the same size, one L2 with room for one of
them, 3 epochs each, started together on a cold L2 or with the L2 full of a (a ran alone first).
Per job: its share of the L2 at the end and its last (warm) epoch's bytes from S3 per dataset byte,
beside the bound, one job alone with half the room (what a fair share can give).

Run: .venv/bin/python benchmarks/shared_node.py [--docs 20000] [--rounds 3]

Measured (defaults, 2 cores shared with other sessions; median (min-max) of 3 alternating rounds;
two datasets of 2.6 MB at rest, 26 shards each). Same dataset: node bytes from S3 / dataset 1.00
with shared tiers, 2.00 with tiers of their own (the same before and after the fair share: this
already held). Different datasets, share of the L2 and warm-epoch bytes / dataset:

| case | a share | a warm | b share | b warm |
|---|---|---|---|---|
| both cold, fair share | 0.51 (0.49-0.51) | 0.57 (0.49-0.62) | 0.49 (0.49-0.49) | 0.55 (0.51-0.62) |
| L2 full of a, fair share | 0.49 (0.49-0.49) | 0.51 (0.47-0.54) | 0.49 | 0.55 (0.55-0.58) |
| both cold, before (13571ce) | 0.47 (0.35-0.62) | 0.69 (0.46-0.73) | 0.53 (0.38-0.65) | 0.55 (0.39-0.66) |
| L2 full of a, before (13571ce) | 1.00 | 0.00 | 0.00 | 1.08 (1.08-1.08) |
| bound: a alone, half the room | 0.49 | 0.62 (0.58-0.62) | - | - |

("before": this script with PYTHONPATH at commit 13571ce's src plus tierflow/testing/nodejobs.py.)
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import alternating, s3_rig, spread


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=20000, help="documents per dataset (~26 shards at 20000)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    import tierflow
    from tierflow.testing.nodejobs import JobSpec, pack_letters, run_jobs

    with tempfile.TemporaryDirectory(prefix="tierflow-shared-node-") as tmp, s3_rig("shared-node") as rig:
        root = Path(tmp)
        urls, sizes = [], []
        for name, seed in (("a", 1), ("b", 2)):
            local = pack_letters(root, name, args.docs, seed)
            urls.append(rig.upload(local, name))
            sizes.append(sum(s.bytes for s in tierflow.open_dataset(local).manifest.shards))
        room = sizes[0]
        endpoint = rig.proxy.url

        def fresh(name: str) -> Path:
            where = root / name
            shutil.rmtree(where, ignore_errors=True)
            where.mkdir()
            return where

        def same_shared() -> dict:
            d = fresh("same-shared")
            tiers = [f"L1={d}/shm:1GB:auto", f"L2={d}/nvme:1GB:auto:at_rest"]
            jobs = run_jobs([JobSpec(urls[0], 1, 2), JobSpec(urls[0], 2, 2)], endpoint, tiers, d)
            return {"node": sum(sum(j["fetched"]) for j in jobs) / sizes[0]}

        def same_apart() -> dict:
            d = fresh("same-apart")
            total = 0
            for i in range(2):  # its own directories each; run one after the other, as no sharing is possible
                tiers = [f"L1={d}/shm-{i}:1GB:auto", f"L2={d}/nvme-{i}:1GB:auto:at_rest"]
                total += sum(sum(j["fetched"]) for j in run_jobs([JobSpec(urls[0], i + 1, 2)], endpoint, tiers, d))
            return {"node": total / sizes[0]}

        def different(warm_first: bool) -> dict:
            d = fresh(f"different-{warm_first}")
            tiers = [f"L2={d}/nvme:{room}:auto:at_rest"]
            if warm_first:
                run_jobs([JobSpec(urls[0], 1, 1)], endpoint, tiers, d)
            jobs = run_jobs([JobSpec(urls[0], 1, 3), JobSpec(urls[1], 2, 3)], endpoint, tiers, d)
            out = {}
            for name, job in zip("ab", jobs):
                out[f"{name} share"] = job["resident"][-1]["L2"] / room
                out[f"{name} warm"] = job["fetched"][-1] / job["dataset_bytes"]
            return out

        def alone_half() -> dict:
            d = fresh("alone-half")
            tiers = [f"L2={d}/nvme:{room // 2}:auto:at_rest"]
            job = run_jobs([JobSpec(urls[0], 1, 3)], endpoint, tiers, d)[0]
            return {"a share": job["resident"][-1]["L2"] / room, "a warm": job["fetched"][-1] / job["dataset_bytes"]}

        scenarios = {
            "same: shared tiers": same_shared,
            "same: own tiers each": same_apart,
            "different: both cold": lambda: different(False),
            "different: L2 full of a": lambda: different(True),
            "bound: a alone, half the room": alone_half,
        }
        results: dict[str, list[dict]] = {name: [] for name in scenarios}
        for _, name in alternating(args.rounds, list(scenarios)):
            results[name].append(scenarios[name]())

    print(
        f"two datasets of {sizes[0] / 1e6:.1f} / {sizes[1] / 1e6:.1f} MB at rest; median (min-max) of "
        f"{args.rounds} rounds"
    )
    print(f"\n{'same dataset, 2 jobs x 2 epochs':34} {'node bytes from S3 / dataset':>30}")
    for name in ("same: shared tiers", "same: own tiers each"):
        print(f"{name:34} {spread([r['node'] for r in results[name]], '.2f'):>30}")
    print(
        f"\n{'different datasets, L2 = one dataset':38} {'a share':>16} {'a warm epoch':>16} {'b share':>16} "
        f"{'b warm epoch':>16}"
    )
    for name in ("different: both cold", "different: L2 full of a", "bound: a alone, half the room"):
        cells = [
            spread([r[k] for r in results[name]], ".2f") if k in results[name][0] else "-"
            for k in ("a share", "a warm", "b share", "b warm")
        ]
        print(f"{name:38} " + " ".join(f"{c:>16}" for c in cells))
    print(
        "\nshare: the job's bytes resident in the L2 / the L2's room; warm epoch: its last epoch's bytes from S3 "
        "per byte of its dataset (0 = all hits)"
    )


if __name__ == "__main__":
    main()
