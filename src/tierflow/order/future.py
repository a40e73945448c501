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

from collections.abc import Container
from typing import NamedTuple

from tierflow.order.cursor import OrderCursor
from tierflow.order.order import SampleOrder
from tierflow.order.remainder import Remainder
from tierflow.order.stream import NodeStream


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
    partitions: Container[int] | None = None,
) -> list[ShardUse]:
    """Shard intervals of every window the node starts reading before position `horizon`,
    sorted by first_use then shard. `partitions`: only those partitions' windows (a sample, for a
    forecast of a huge dataset: the rest are stepped over a span at a time)."""
    stream = NodeStream(order, cursor, node=node, num_nodes=num_nodes, batch_size=batch_size)
    picks = -(-horizon // batch_size)
    edges = stream.edges  # epoch-major: picks from each sample's lane clock, no lane batch counts
    counts = stream.schedule.counts_after(picks) if edges is None else [picks] * len(stream.lanes)
    uses: list[ShardUse] = []
    for lane_index, (lane, batches) in enumerate(zip(stream.lanes, stream.batches)):
        if counts[lane_index] == 0:
            continue
        carry = batches.remainder is Remainder.CARRY
        read = 0  # carry: samples read from the cursor
        lane_epoch, lane_offset = (0, 0) if carry else (batches.epoch, batches.done)
        spans = lane.spans(stream.positions_before(lane_index, 0))
        done = False
        while not done:
            span = next(spans)
            if not carry and span.epoch != lane_epoch:
                lane_epoch, lane_offset = span.epoch, 0
            if partitions is not None and span.partition not in partitions:
                at = read if carry or edges is not None else lane_offset
                if edges is not None:
                    done = edges.pick_of(lane_index, *edges.clock_of(lane_index, at)) >= picks
                elif carry:
                    done = at // batch_size >= counts[lane_index]
                else:
                    done = _batch_range(batches, lane_epoch, at, at)[0] >= counts[lane_index]
                read += span.stop - span.start
                lane_offset += span.stop - span.start
                continue
            windows = order.windows(span.partition, span.epoch)
            window = windows.window_of(span.start)
            while window < windows.num_windows and windows.window_start(window) < span.stop:
                start = max(windows.window_start(window), span.start)
                stop = min(windows.window_start(window + 1), span.stop)
                if edges is not None:  # the node batches reading the window's first and last samples
                    first = edges.pick_of(lane_index, *edges.clock_of(lane_index, read + start - span.start))
                    last = edges.pick_of(lane_index, *edges.clock_of(lane_index, read + stop - 1 - span.start))
                    if first >= picks:
                        done = True
                        break
                    for shard, count in zip(windows.window_shards(window).tolist(), windows.window_counts(window)):
                        if count:
                            uses.append(
                                ShardUse(
                                    shard,
                                    first * batch_size,
                                    last * batch_size + batch_size - 1,
                                    span.epoch,
                                    span.partition,
                                )
                            )
                    window += 1
                    continue
                if carry:
                    first, last = (
                        (read + start - span.start) // batch_size,
                        (read + stop - 1 - span.start) // batch_size,
                    )
                else:
                    first, last = _batch_range(
                        batches, lane_epoch, lane_offset + start - span.start, lane_offset + stop - 1 - span.start
                    )
                if first >= counts[lane_index]:
                    done = True
                    break
                if first >= 0:
                    first_use = stream.schedule.pick_of(lane_index, first) * batch_size
                    last_use = stream.schedule.pick_of(lane_index, last) * batch_size + batch_size - 1
                    for shard, count in zip(windows.window_shards(window).tolist(), windows.window_counts(window)):
                        if count:
                            uses.append(ShardUse(shard, first_use, last_use, span.epoch, span.partition))
                window += 1
            read += span.stop - span.start
            lane_offset += span.stop - span.start
    uses.sort(key=lambda use: (use.first_use, use.shard))
    return uses


def _batch_range(batches, epoch: int, first_offset: int, last_offset: int) -> tuple[int, int]:
    """Lane batches reading lane-epoch offsets first..last (drop: a dropped tail reads nothing,
    (-1, -1) when all of it is dropped)."""
    geometry = batches.geometry
    end = geometry.read_end(batches.epoch, batches.done, epoch)
    if first_offset >= end:
        return -1, -1
    first = geometry.batch_index(batches.epoch, batches.done, epoch, first_offset)
    last = geometry.batch_index(batches.epoch, batches.done, epoch, min(last_offset, end - 1))
    return first, last
