"""The future view: which shards a node will read, and between which of its positions.

Unit: the node's sample position counted from the cursor. Node batch j (j = 0, 1, ... in the
node's stream, all its ranks together; rank r reads j = b * R + r) covers positions
[j * B, (j + 1) * B). A window of k shards is the unit of reuse, so every shard of a window gets
the window's interval: first_use is the start of the first node batch that reads the window,
last_use the last position of the last node batch that reads it (inclusive). The interval is
conservative by at most a batch at each end. Epochs follow each other: a shard appears once
per epoch (window) in which it is read. This is what the stager and the clairvoyant policy consume.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from tierflow.order.cursor import OrderCursor
from tierflow.order.interleave import delivered_after, pick_of
from tierflow.order.order import SampleOrder


class ShardUse(NamedTuple):
    shard: int
    first_use: int
    last_use: int
    epoch: int
    partition: int


def future_shard_uses(
    order: SampleOrder,
    cursor: OrderCursor,
    *,
    node: int,
    num_nodes: int,
    batch_size: int,
    horizon: int,
) -> list[ShardUse]:
    """Shard intervals of every window the node starts reading before position `horizon`,
    sorted by first_use then shard."""
    owned = order.layout.node_partitions(node, num_nodes)
    delivered = np.array([cursor.batches[p] for p in owned], dtype=np.int64)
    picks = -(-horizon // batch_size)
    last_batch = delivered_after(delivered, picks) - delivered - 1
    counts = order.layout.shard_sample_counts
    uses: list[ShardUse] = []
    for index, partition in enumerate(owned):
        if last_batch[index] < 0:
            continue
        geometry = order.geometry(partition, batch_size)
        from_epoch, from_offset = geometry.normalize(cursor.epochs[partition], cursor.offsets[partition])
        epoch = from_epoch
        windows = order.windows(partition, epoch)
        window = windows.window_of(from_offset)
        while True:
            if window >= windows.num_windows:
                epoch += 1
                windows, window = order.windows(partition, epoch), 0
                continue
            start = int(windows.window_starts[window])
            stop = min(int(windows.window_starts[window + 1]), geometry.read_end(from_epoch, from_offset, epoch))
            if epoch == from_epoch:
                start = max(start, from_offset)
            if start >= stop:
                if stop < int(windows.window_starts[window + 1]):
                    window = windows.num_windows
                else:
                    window += 1
                continue
            first = geometry.batch_index(from_epoch, from_offset, epoch, start)
            if first > last_batch[index]:
                break
            last = geometry.batch_index(from_epoch, from_offset, epoch, stop - 1)
            first_use = pick_of(delivered, index, first) * batch_size
            last_use = pick_of(delivered, index, last) * batch_size + batch_size - 1
            for shard in windows.window_shards(window).tolist():
                if counts[shard]:
                    uses.append(ShardUse(shard, first_use, last_use, epoch, partition))
            window += 1
    uses.sort(key=lambda use: (use.first_use, use.shard))
    return uses
