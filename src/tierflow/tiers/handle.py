"""What the stack hands out: a shard's readable copy (Handle), an open's result, where bytes came from."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from tierflow.format.blocks import BlockBytes, open_blocks
from tierflow.format.reader import BlockOpener
from tierflow.format.shard import Block, Form, ShardInfo
from tierflow.format.table import ShardTable
from tierflow.tiers._lock import Pin

SOURCE = "source"
"""`served_by` of bytes no tier held: fetched from the stack's source."""
MEMORY = "memory"
"""`tier` of a copy no tier took: the source's blocks, read into memory as the reader uses them."""

downloaded: ContextVar[Callable[[], None] | None] = ContextVar("tierflow_downloaded", default=None)


@contextmanager
def on_downloaded(callback: Callable[[], None]) -> Iterator[None]:
    """Call `callback` in this thread as soon as a download from the source has all its bytes,
    before they are verified, decoded and admitted: the stager hands the link to the next shard
    then, so the link does not idle while a shard that has arrived is written into its tier."""
    token = downloaded.set(callback)
    try:
        yield
    finally:
        downloaded.reset(token)


@dataclass
class Handle:
    """A readable copy of a shard: a pinned file in some tier, or the source's blocks read on use.

    `tier` is where this copy lives (a tier's name, "staging" or "memory"); `served_by` is where
    its bytes were found: the fastest tier that held the shard (a miss in L1 filled from L2 is
    served by L2), "staging", or "source" when no tier held it. `fetch_s`: seconds `ensure` took.
    """

    form: Form
    tier: str
    path: Path | None = None
    pin: Pin | None = None
    store_blocks: BlockOpener | None = None  # "memory": the source's ranged block reads
    blocks: list[Block] | None = None  # the decoded form's block list (the at-rest one is the manifest's)
    served_by: str = SOURCE
    fetch_s: float = 0.0

    def release(self) -> None:
        if self.pin is not None:
            self.pin.release()

    def block_bytes(self, info: ShardInfo) -> BlockBytes:
        """Where the table reads this copy's blocks from; the pin lives as long as that does."""
        if self.store_blocks is not None:
            return self.store_blocks(info)
        assert self.path is not None
        return open_blocks(self.path, info, self.form, self.blocks, keepalive=self)


def expected(info: ShardInfo, form: Form) -> tuple[int, str]:
    return info.bytes_in(form), info.checksum_in(form)


class Opened(NamedTuple):
    """A shard table and how this open got it: `served_by` None when it was already open (no fetch)."""

    table: ShardTable
    served_by: str | None
    fetch_s: float
