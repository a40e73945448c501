"""How a partition's stream of micro-batches meets its epoch boundaries.

A partition of n samples is read as epochs 0, 1, 2, ... each a fresh shuffle; a position in
its stream is (epoch, offset). With B samples per micro-batch:
- carry (default): batches run straight across epoch edges; leftovers start the next epoch;
- drop: each epoch yields floor(n / B) full batches and its last n mod B samples are skipped;
- pad: each epoch yields ceil(n / B) batches; the last is filled up by repeating its own real
  samples, flagged False in the mask (no extra shard is read for padding).
Everything here is closed-form arithmetic: advancing k batches is O(1).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Remainder(str, Enum):
    CARRY = "carry"
    DROP = "drop"
    PAD = "pad"


@dataclass(frozen=True)
class Segment:
    """A run of consecutive epoch offsets [start, stop) of one epoch inside a batch."""

    epoch: int
    start: int
    stop: int


@dataclass(frozen=True)
class StreamGeometry:
    """Batch arithmetic of one partition's stream."""

    size: int
    batch_size: int
    remainder: Remainder

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.size < 1:
            raise ValueError("a partition stream needs at least one sample")
        if self.remainder is Remainder.DROP and self.size < self.batch_size:
            raise ValueError(
                f"remainder='drop' with batch_size {self.batch_size} would drop every sample "
                f"of a partition of {self.size} samples"
            )

    def batches_per_epoch_from(self, offset: int) -> int:
        left = self.size - offset
        if self.remainder is Remainder.DROP:
            return left // self.batch_size
        return -(-left // self.batch_size)

    def normalize(self, epoch: int, offset: int) -> tuple[int, int]:
        """The position where the next batch really starts (skipping an exhausted epoch)."""
        if self.remainder is Remainder.CARRY:
            exhausted = offset >= self.size
        else:
            exhausted = self.batches_per_epoch_from(offset) <= 0
        return (epoch + 1, 0) if exhausted else (epoch, offset)

    def advance(self, epoch: int, offset: int, batches: int) -> tuple[int, int]:
        """Position after `batches` more batches."""
        if batches <= 0:
            return epoch, offset
        if self.remainder is Remainder.CARRY:
            return divmod(epoch * self.size + offset + batches * self.batch_size, self.size)
        epoch, offset = self.normalize(epoch, offset)
        first = self.batches_per_epoch_from(offset)
        if batches < first:
            return epoch, offset + batches * self.batch_size
        rest = batches - first
        per_epoch = self.batches_per_epoch_from(0)
        return epoch + 1 + rest // per_epoch, (rest % per_epoch) * self.batch_size

    def segments(self, epoch: int, offset: int) -> list[Segment]:
        """Real samples of the batch starting at (epoch, offset); fewer than B means padding."""
        epoch, offset = self.normalize(epoch, offset)
        if self.remainder is not Remainder.CARRY:
            return [Segment(epoch, offset, min(self.size, offset + self.batch_size))]
        out = []
        wanted = self.batch_size
        while wanted:
            stop = min(self.size, offset + wanted)
            out.append(Segment(epoch, offset, stop))
            wanted -= stop - offset
            epoch, offset = epoch + 1, 0
        return out

    def read_end(self, from_epoch: int, from_offset: int, epoch: int) -> int:
        """End (exclusive) of the offsets of `epoch` that batches starting at
        (from_epoch, from_offset) read; below `size` only when drop skips a tail."""
        if self.remainder is not Remainder.DROP:
            return self.size
        from_epoch, from_offset = self.normalize(from_epoch, from_offset)
        start = from_offset if epoch == from_epoch else 0
        return start + self.batches_per_epoch_from(start) * self.batch_size

    def batch_index(self, from_epoch: int, from_offset: int, epoch: int, offset: int) -> int:
        """Index, counted from (from_epoch, from_offset), of the batch reading (epoch, offset);
        -1 if that sample comes before the start or is dropped."""
        if self.remainder is Remainder.CARRY:
            rel = (epoch - from_epoch) * self.size + offset - from_offset
            return rel // self.batch_size if rel >= 0 else -1
        from_epoch, from_offset = self.normalize(from_epoch, from_offset)
        if epoch < from_epoch or (epoch == from_epoch and offset < from_offset):
            return -1
        if epoch == from_epoch:
            index = (offset - from_offset) // self.batch_size
            return index if index < self.batches_per_epoch_from(from_offset) else -1
        index = offset // self.batch_size
        per_epoch = self.batches_per_epoch_from(0)
        if index >= per_epoch:
            return -1
        return self.batches_per_epoch_from(from_offset) + (epoch - from_epoch - 1) * per_epoch + index
