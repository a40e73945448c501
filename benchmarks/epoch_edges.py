"""How many of a rank's batches hold samples of two epochs at each epoch edge (issue 39 item 1).

The order seen by positional batchers (Samples, TokenWindows, images' batchers): each rank batch
is one node micro-batch of the interleave. Counts, per configuration, the batches per rank and edge
that mix two epochs and the samples they carry over the edge (real samples, mask True).

    PYTHONPATH=src python benchmarks/epoch_edges.py [--epochs 3]
"""

from __future__ import annotations

import argparse

import numpy as np

from tierflow.order import RankStream, SampleOrder


def edge_counts(
    counts: list[int], *, lanes: int, remainder: str, ranks: int, batch_size: int, partitions: int, epochs: int
) -> tuple[int, int]:
    """(most mixed batches of one rank at one edge, most samples over one edge of one rank)."""
    order = SampleOrder(
        counts, dataset_id="edges", seed=3, partitions=partitions, window_shards=2, lanes=lanes, remainder=remainder
    )
    worst_batches = worst_samples = 0
    for rank in range(ranks):
        stream = RankStream(order, order.start(), batch_size=batch_size, rank=rank, ranks_per_node=ranks)
        mixed = [0] * epochs
        carried = [0] * epochs
        index = 0
        while True:
            batch = stream.batch(index)
            real = batch.epochs[batch.mask]
            low = int(real.min())
            if low >= epochs:
                break
            if int(real.max()) != low:
                mixed[low] += 1
                carried[low] += int((real != low).sum())
            index += 1
        worst_batches = max(worst_batches, max(mixed))
        worst_samples = max(worst_samples, max(carried))
    return worst_batches, worst_samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    datasets = {
        "300 images (6 shards x 50)": [50] * 6,
        "300 images (20 shards x 15)": [15] * 20,
        "64 shards of 5-40": [int(c) for c in np.random.default_rng(5).integers(5, 41, size=64)],
    }
    print("dataset | lanes | remainder | ranks | mixed batches/rank/edge (max) | samples over the edge (max)")
    for name, counts in datasets.items():
        for lanes in (1, 2, 4, 16):
            for remainder in ("carry", "drop", "pad"):
                for ranks in (1, 2):
                    try:
                        batches, samples = edge_counts(
                            counts,
                            lanes=lanes,
                            remainder=remainder,
                            ranks=ranks,
                            batch_size=args.batch_size,
                            partitions=min(16, len(counts)),
                            epochs=args.epochs,
                        )
                    except ValueError as error:  # drop with partitions smaller than a batch
                        print(f"{name} | {lanes} | {remainder} | {ranks} | refused: {error}")
                        continue
                    print(f"{name} | {lanes} | {remainder} | {ranks} | {batches} | {samples}")


if __name__ == "__main__":
    main()
