"""Shuffle quality of the block-group shuffle against the full-window one (issue 17's trade-off).

One node reads a synthetic dataset the loader's default way (64 partitions, 16 lanes, windows of 4
shards) as batches of 256: 256 shards of 10,000 samples of 1 KB (10 MB decoded a shard, 1 MB
blocks of 1,000 samples), whose label is clustered: the source file, 500 consecutive samples each
(a dataset packed file after file). Per shuffle, over one epoch:
- blocks/batch, files/batch: distinct 1 MB blocks and source files in a batch of 256 (the
  first is what a batch decodes; each touched block of a compressed shard is decoded whole);
- eff. files: the batch's effective number of source files, B^2 / sum(n_f^2) (n_f samples of file
  f): the batch size a label that is purely per-file is worth, as i.i.d. draws;
- |rho|: |Spearman rho| between epoch position and stored index;
- SGD loss: a linear regression whose inputs shift by source file (x = z + mu_file, y = x.w + noise),
  trained one epoch by SGD (batch 256) in this order; the mean squared error on all samples over
  the noise floor's 1.0, averaged over the epoch's second half (the iterate's noise, which
  correlated batches raise), mean of 3 seeds; the ideal is a uniform permutation.
Rows: the window shuffle (group_bytes=0), block groups of 16, 4 (the default before issue 17's
second start-up pass), 1 MiB and 256 KiB (never less than a block: here one 1 MB block), the
default (256 KiB and at least 1,024 samples: here 1 MiB), and the two bounds, a uniform
permutation of the dataset and the stored order. `--block-samples 250`
cuts 256 KB blocks (the packer's smallest), where the default groups are a quarter of 1 MiB's.

    .venv/bin/python benchmarks/groups.py [--block-samples 1000]
"""

from __future__ import annotations

import argparse

import numpy as np

from tierflow.order import RankStream, SampleOrder
from tierflow.order.groups import GROUP_BYTES, GROUP_SAMPLES

SHARDS = 256
PER_SHARD = 10_000
SAMPLE_BYTES = 1024
BLOCK_SAMPLES = 1000
FILE_SAMPLES = 500
BATCH = 256
SEEDS = (1, 2, 3)
DIM = 8
LR = 0.02


def epoch_ids(group_bytes: int, seed: int, group_samples: int = 0) -> np.ndarray:
    order = SampleOrder(
        [PER_SHARD] * SHARDS,
        dataset_id="quality",
        seed=seed,
        partitions=64,
        window_shards=4,
        lanes=16,
        group_bytes=group_bytes,
        decoded_bytes=[PER_SHARD * SAMPLE_BYTES] * SHARDS,
        block_bytes=[BLOCK_SAMPLES * SAMPLE_BYTES] * SHARDS,
        group_samples=group_samples,
    )
    stream = RankStream(order, order.start(), batch_size=BATCH)
    batches = SHARDS * PER_SHARD // BATCH
    return np.concatenate([stream.node_batch(j).sample_ids for j in range(batches)])


def sgd_excess_loss(ids: np.ndarray, seed: int) -> float:
    """Final MSE over the noise floor (1.0) of one SGD epoch over the samples in order `ids`."""
    rng = np.random.default_rng(seed)
    files = SHARDS * PER_SHARD // FILE_SAMPLES
    shift = rng.normal(0, 2.0, size=(files, DIM))
    z = rng.normal(size=(SHARDS * PER_SHARD, DIM))
    x = z + shift[np.arange(z.shape[0]) // FILE_SAMPLES]
    truth = rng.normal(size=DIM)
    y = x @ truth + rng.normal(size=z.shape[0])
    w = np.zeros(DIM)
    steps = ids.size // BATCH
    losses = []
    for step in range(steps):
        chosen = ids[step * BATCH : (step + 1) * BATCH]
        xb = x[chosen]
        w -= LR * (xb.T @ (xb @ w - y[chosen])) / BATCH
        if step >= steps // 2 and step % 200 == 0:
            losses.append(float(np.mean((x @ w - y) ** 2) - 1.0))
    return float(np.mean(losses))


def quality(ids: np.ndarray, seed: int) -> dict[str, float]:
    usable = ids[: ids.size // BATCH * BATCH].reshape(-1, BATCH)
    blocks = np.mean([np.unique(b // BLOCK_SAMPLES).size for b in usable])
    counts = [np.unique(b // FILE_SAMPLES, return_counts=True)[1] for b in usable]
    files = np.mean([c.size for c in counts])
    effective = np.mean([BATCH**2 / np.sum(c.astype(float) ** 2) for c in counts])
    rho = abs(float(np.corrcoef(np.arange(ids.size), ids)[0, 1]))
    return {"blocks": blocks, "files": files, "effective": effective, "rho": rho, "loss": sgd_excess_loss(ids, seed)}


def main() -> None:
    global BLOCK_SAMPLES
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-samples", type=int, default=BLOCK_SAMPLES, help="samples of 1 KB a block")
    BLOCK_SAMPLES = parser.parse_args().block_samples
    rows: list[tuple[str, object]] = [
        ("window (group_bytes=0)", 0),
        ("groups 16 MiB", 16 << 20),
        ("groups 4 MiB", 4 << 20),
        ("groups 1 MiB", 1 << 20),
        (f"groups {GROUP_BYTES >> 10} KiB", GROUP_BYTES),
        (f"{GROUP_BYTES >> 10} KiB, {GROUP_SAMPLES} samples (default)", (GROUP_BYTES, GROUP_SAMPLES)),
        ("uniform permutation", "uniform"),
        ("stored order", "stored"),
    ]
    print(
        f"{SHARDS} shards x {PER_SHARD:,} samples of {SAMPLE_BYTES} B, blocks of {BLOCK_SAMPLES}, source files of "
        f"{FILE_SAMPLES}; one node, 16 lanes x windows of 4, batch {BATCH}; mean over seeds {SEEDS} (min-max)"
    )
    print(
        f"{'shuffle':<28}{'blocks/batch':>14}{'files/batch':>13}{'eff. files':>12}{'|rho|':>9}{'SGD excess loss':>24}"
    )
    for name, how in rows:
        per_seed = []
        for seed in SEEDS:
            if how == "uniform":
                ids = np.random.default_rng(seed).permutation(SHARDS * PER_SHARD)
            elif how == "stored":
                ids = np.arange(SHARDS * PER_SHARD)
            else:
                ids = epoch_ids(how[0], seed, how[1]) if isinstance(how, tuple) else epoch_ids(int(how), seed)
            per_seed.append(quality(ids, seed))
        mean = {k: float(np.mean([q[k] for q in per_seed])) for k in per_seed[0]}
        losses = [q["loss"] for q in per_seed]
        print(
            f"{name:<28}{mean['blocks']:>14.1f}{mean['files']:>13.1f}{mean['effective']:>12.1f}{mean['rho']:>9.4f}"
            f"{mean['loss']:>10.4f} ({min(losses):.4f}-{max(losses):.4f})"
        )


if __name__ == "__main__":
    main()
