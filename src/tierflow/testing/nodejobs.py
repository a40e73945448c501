"""Independent training jobs on one node, each its own process, reading through the node's tiers.

What the shared-node-cache test and benchmark start: no Python state is shared between the jobs,
only the tier directories (and the node's S3 endpoint, the proxy that counts its traffic). Each
job reports, per epoch, the bytes it fetched from the object store against its dataset's size
(1 - that is its hit ratio) and the bytes of its dataset resident in each tier at the epoch's end.
A job that is done stays alive (a reader of its dataset) until every job is, so each one's figures
are taken while all the jobs hold the node.

Run as `python -m tierflow.testing.nodejobs URL ENDPOINT TIERS_JSON SEED EPOCHS OUT START JOBS`: the
job waits for the file START (so the jobs start together) and exits once JOBS figure files are beside OUT.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Sequence

from tierflow.testing.s3server import S3Endpoint


@dataclass
class JobSpec:
    url: str
    seed: int = 0
    epochs: int = 2


def pack_letters(root: Path, name: str, docs: int, seed: int) -> Path:
    """A token dataset `root/name` of `docs` documents of 30-300 random letters (byte tokens, 256 KB shards)."""
    import numpy as np

    import tierflow

    rng = np.random.default_rng(seed)
    with open(root / f"{name}.jsonl", "w") as f:
        for _ in range(docs):
            n = int(rng.integers(30, 300))
            f.write(json.dumps({"text": (rng.integers(0, 26, n) + 97).astype(np.uint8).tobytes().decode()}) + "\n")
    tierflow.pack([root / f"{name}.jsonl"], root / name, tokenizer="bytes", workers=1, target_shard_bytes=256 << 10)
    return root / name


def run_job(url: str, endpoint: str, tiers: Sequence[str], seed: int, epochs: int, out: Path) -> None:
    """One job: `epochs` epochs through `tiers` with the stager, the figures written to `out` (JSON)."""
    from tierflow.loader import Loader, TieredDataset, BatchSpec, OrderSpec
    from tierflow.tiers import TierConfig, build_stack
    from tierflow.tiers.stager import Stager

    stack = build_stack(url, [TierConfig.parse(t) for t in tiers], endpoint_url=endpoint)
    ds = TieredDataset(stack.dataset(), BatchSpec(batch_size=16, seq_len=512), OrderSpec(seed=seed))
    loader = Loader(ds, stager=Stager(ds, stack), epoch_end="rank")
    dataset_bytes = sum(s.bytes for s in stack.dataset().manifest.shards)
    fetched, resident = [], []
    for _ in range(epochs):
        before = stack.m_source_bytes.value
        for _batch in loader:
            time.sleep(0.001)  # a short step: the stager runs beside the loop
        fetched.append(stack.m_source_bytes.value - before)
        resident.append(
            {t.name: sum(r.size for r in t.index.entries() if r.dataset == stack.dataset_id) for t in stack.tiers}
        )
    loader.close()
    stack.close()
    tmp = out.with_name(".tmp-" + out.name)
    tmp.write_text(json.dumps({"dataset_bytes": dataset_bytes, "fetched": fetched, "resident": resident}))
    tmp.rename(out)


def run_jobs(
    jobs: Sequence[JobSpec], endpoint: str, tiers: Sequence[str], workdir: Path, timeout: float = 300
) -> list[dict]:
    """Start `jobs` as separate processes on the same `tiers`; each one's figures, in order."""
    start = workdir / "start"
    start.unlink(missing_ok=True)
    env = {**os.environ, **S3Endpoint(endpoint).env(), "PYTHONPATH": os.pathsep.join(sys.path)}
    procs, outs = [], []
    for i, job in enumerate(jobs):
        out = workdir / f"job-{i}.json"
        out.unlink(missing_ok=True)
        outs.append(out)
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tierflow.testing.nodejobs",
                    job.url,
                    endpoint,
                    json.dumps(list(tiers)),
                    str(job.seed),
                    str(job.epochs),
                    str(out),
                    str(start),
                    str(len(jobs)),
                ],
                env=env,
            )
        )
    try:
        start.touch()
        for p in procs:
            if p.wait(timeout=timeout) != 0:
                raise RuntimeError(f"a job on {tiers} exited with {p.returncode}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [json.loads(out.read_text()) for out in outs]


def main(argv: Sequence[str]) -> None:
    url, endpoint, tiers, seed, epochs, out, start, jobs = argv
    while not Path(start).exists():
        time.sleep(0.01)
    run_job(url, endpoint, json.loads(tiers), int(seed), int(epochs), Path(out))
    while len(list(Path(out).parent.glob("job-*.json"))) < int(jobs):
        time.sleep(0.05)


if __name__ == "__main__":
    main(sys.argv[1:])
