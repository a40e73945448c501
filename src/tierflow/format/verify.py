"""Verifying a shard's bytes against the manifest: one block by its xxh3-64 (`check_block`), a
whole file or a stream as it passes (`ShardVerifier`: size, every block, the file's xxh3-128)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import xxhash

from tierflow.errors import ShardCorruptError
from tierflow.format._checksum import CHUNK, xxh3_hex
from tierflow.format._regular import open_regular
from tierflow.format.shard import Block, Form, ShardInfo


def block_error(name: str, index: int, block: Block, why: str = "fails its checksum") -> ShardCorruptError:
    return ShardCorruptError(f"shard {name}: block {index} (bytes {block.offset}+{block.length}) {why}")


def check_block(data: bytes | memoryview | pa.Buffer, name: str, index: int, block: Block) -> None:
    """Raise ShardCorruptError (naming shard and block) unless `data` are the block's bytes."""
    if len(data) != block.length or xxh3_hex(data) != block.checksum:
        raise block_error(name, index, block)


def verify_shard(path: str | Path, info: ShardInfo, form: Form = Form.AT_REST) -> list[str]:
    """Every problem with a shard file, as sentences naming the shard and block; empty if sound."""
    path = Path(path)
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        return [f"shard {info.name}: missing ({path})"]
    except ShardCorruptError as e:
        return [f"shard {info.name}: {e}"]
    verifier = ShardVerifier(info, form)
    with open(fd, "rb") as f:
        while chunk := f.read(CHUNK):
            verifier.write(chunk)
    return verifier.problems()


class ShardVerifier:
    """Checks a shard's bytes as they stream past (a file read, a download from a source), so a
    remote shard is verified without being stored: its size, every block's xxh3-64 (at rest) and
    the whole file's xxh3-128. `write` is a file-like sink; `problems()` says what failed.
    `on_block(index, bytes)` sees each block that verified, whole, as it completes (one block held
    at a time: how `verify` checks a remote shard's counts without reading it twice)."""

    def __init__(
        self, info: ShardInfo, form: Form | str = Form.AT_REST, on_block: Callable[[int, bytes], None] | None = None
    ) -> None:
        self._on_block = on_block
        self._held = bytearray()
        self.info = info
        self.form = Form(form)
        self.size = 0
        self._whole = xxhash.xxh3_128()
        self._block = xxhash.xxh3_64()
        blocks = info.blocks if self.form is Form.AT_REST else []
        self._blocks = sorted(enumerate(blocks), key=lambda ib: ib[1].offset)
        self._next = 0  # the first block of _blocks not yet complete
        self._bad: list[int] = []

    def write(self, data: bytes | memoryview) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        self._whole.update(view)
        position = self.size
        while len(view) and self._next < len(self._blocks):
            index, block = self._blocks[self._next]
            if position < block.offset:  # bytes between blocks (the IPC header, the footer)
                skip = min(len(view), block.offset - position)
                view, position = view[skip:], position + skip
                continue
            take = min(len(view), block.offset + block.length - position)
            self._block.update(view[:take])
            if self._on_block is not None:
                self._held += view[:take]
            view, position = view[take:], position + take
            if position == block.offset + block.length:
                if self._block.hexdigest() != block.checksum:
                    self._bad.append(index)
                elif self._on_block is not None:
                    self._on_block(index, bytes(self._held))
                self._held.clear()
                self._block.reset()
                self._next += 1
        self.size += n
        return n

    def problems(self) -> list[str]:
        """What the bytes written so far get wrong, naming the shard and each failing block."""
        info = self.info
        expected_size, expected_sum = info.bytes_in(self.form), info.checksum_in(self.form)
        problems = []
        if self.size != expected_size:
            problems.append(f"shard {info.name}: size {self.size} != {expected_size} in the manifest")
        unfinished = [index for index, _ in self._blocks[self._next :]]  # cut off by a short file
        for i in sorted(self._bad + unfinished):
            block = info.blocks[i]
            problems.append(
                f"shard {info.name}: block {i} (bytes {block.offset}+{block.length}, "
                f"{block.rows} rows) fails its checksum"
            )
        if not problems and self._whole.hexdigest() != expected_sum:
            problems.append(f"shard {info.name}: whole-file checksum mismatch (outside any block)")
        return problems
