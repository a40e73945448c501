"""The shard: one Arrow IPC file, compressed per buffer at rest, content-addressed.

A shard's rows are cut into *blocks*, one Arrow record batch each, and the shard exists in two
forms with the same blocks: *at rest* (zstd/lz4 buffer compression, what L4-L2 hold) and
*decoded* (uncompressed, what a tier memory-maps for zero-copy numpy views). Both forms' sizes
and xxh3-128 hashes are in the manifest, and every block of the at-rest file has its byte range
and xxh3-64, so a ranged read of one block verifies without reading the shard. See docs/format.md.

This module is the data model (what a manifest records of a shard and its blocks); writing is
`shard_writer`, decoding a block `block_decoder`, checking bytes against the model `verify`.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple, overload

import numpy as np

SHARD_PREFIX = "shard-"
SHARD_SUFFIX = ".arrow"
COMPRESSIONS = ("zstd", "lz4", "none")
MAX_COUNT = 1 << 48
"""A manifest's counts (samples, bytes, a block's rows) are below this; anything larger is absurd."""


class Form(StrEnum):
    """How a shard's bytes are held: as packed (`at_rest`, compressed per buffer) or `decoded`
    (uncompressed, memory-mapped for zero-copy views). String-valued, so tier configs, CLI
    arguments and tier index rows keep their spelling."""

    AT_REST = "at_rest"
    DECODED = "decoded"

    @classmethod
    def _missing_(cls, value: object) -> Form:
        raise ValueError(f"form {value!r} is not one of {', '.join(f.value for f in cls)}")


class Block(NamedTuple):
    """One record batch of a shard file (a tuple: a manifest lists thousands, parsed at every start)."""

    offset: int
    length: int
    rows: int
    checksum: str  # xxh3-64 hex of bytes [offset, offset + length) of the file
    tokens: int | None = None  # values of the token column in this block, when the pack recorded them


@dataclass
class ShardInfo:
    """What the manifest records about one shard."""

    name: str
    samples: int
    bytes: int
    decoded_bytes: int
    checksum: str
    decoded_checksum: str
    compression: str
    tokens: int = 0
    blocks: Sequence[Block] = field(default_factory=list)
    """A list of records (pack, a tier's block list) or, loaded from a manifest, a `BlockList`."""

    @property
    def key(self) -> str:
        """The entry key every tier uses for this shard: its at-rest content hash."""
        return self.checksum

    def bytes_in(self, form: Form) -> int:
        """The size of the shard's file in `form`."""
        return self.decoded_bytes if form == Form.DECODED else self.bytes

    def checksum_in(self, form: Form) -> str:
        """The xxh3-128 of the shard's file in `form`."""
        return self.decoded_checksum if form == Form.DECODED else self.checksum

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "samples": self.samples,
            "bytes": self.bytes,
            "decoded_bytes": self.decoded_bytes,
            "checksum": self.checksum,
            "decoded_checksum": self.decoded_checksum,
            "compression": self.compression,
            "tokens": self.tokens,
            "blocks": block_table(self.blocks),
        }

    @classmethod
    def from_json(cls, d: dict) -> ShardInfo:
        """The shard a manifest entry describes; its blocks stay columns (`BlockList`) until used."""
        return cls(
            name=str(d["name"]),
            samples=int(d["samples"]),
            bytes=int(d["bytes"]),
            decoded_bytes=int(d["decoded_bytes"]),
            checksum=str(d["checksum"]),
            decoded_checksum=str(d["decoded_checksum"]),
            compression=str(d["compression"]),
            tokens=int(d.get("tokens", 0)),
            blocks=BlockList.from_json(d["blocks"]),
        )


class BlockList(Sequence[Block]):
    """A shard's blocks as the manifest lists them: int64 columns (offset, length, rows, tokens) and
    the checksums, a `Block` record made only when one is asked for. A manifest lists every block of
    every shard (3,081 at 100M samples in 30 shards) and a start reads a few of one shard: making
    records for all of them was most of a manifest's parse. The columns are checked whole when the
    manifest loads (`check`), so a record handed out is a validated one."""

    __slots__ = ("offsets", "lengths", "rows", "tokens", "checksums", "_made")

    def __init__(
        self,
        offsets: np.ndarray,
        lengths: np.ndarray,
        rows: np.ndarray,
        checksums: list[str] | np.ndarray,
        tokens: np.ndarray | None = None,
    ) -> None:
        self.offsets, self.lengths, self.rows, self.checksums, self.tokens = offsets, lengths, rows, checksums, tokens
        self._made: list[Block | None] = [None] * len(checksums)

    @classmethod
    def from_json(cls, b: dict) -> BlockList:
        """The columns of a manifest's `blocks` object, a binary table (`block_table`) or, as format
        version 1 wrote them, JSON lists; TypeError/ValueError if one is not a list of its type or they
        differ in length (untrusted JSON: bool, float and huge ints are refused)."""
        if not isinstance(b, dict):
            raise TypeError("blocks is not an object")
        if "table" in b:
            return cls._from_table(b)
        tokens = b.get("tokens")
        columns = {"offset": b["offset"], "length": b["length"], "rows": b["rows"], "checksum": b["checksum"]}
        if tokens is not None:
            columns["tokens"] = tokens
        for name, column in columns.items():
            allowed = {str} if name == "checksum" else {int}
            if not isinstance(column, list) or not set(map(type, column)) <= allowed:
                raise TypeError(f"blocks.{name} is not a list of {'/'.join(t.__name__ for t in allowed)}")
        if len({len(c) for c in columns.values()}) > 1:
            lengths = ", ".join(f"{k} {len(v)}" for k, v in columns.items())
            raise ValueError(f"blocks' columns differ in length: {lengths}")
        try:
            ints = [np.array(columns[k], dtype=np.int64).reshape(-1) for k in ("offset", "length", "rows")]
            counts = np.array(tokens, dtype=np.int64).reshape(-1) if tokens is not None else None
        except OverflowError:
            raise ValueError("a block's offset, length, rows or tokens is beyond 64 bits") from None
        return cls(ints[0], ints[1], ints[2], columns["checksum"], counts)

    @classmethod
    def _from_table(cls, b: dict) -> BlockList:
        """The columns of a `block_table` object: one base64 decode and a view per column, so a
        manifest's parse and checksum cost C passes over ~27 characters a block, not a JSON value per
        block and column (lists of 3,081 blocks were ~60% of a 100M-sample manifest's load)."""
        names, count, table = b.get("columns"), b.get("count"), b.get("table")
        if names not in (list(TABLE_COLUMNS[:3]), list(TABLE_COLUMNS)):
            raise ValueError(
                f"blocks.columns = {names!r:.80} is not {list(TABLE_COLUMNS[:3])}, optionally + ['tokens']"
            )
        if type(count) is not int or not 0 <= count < MAX_COUNT or not isinstance(table, str):
            raise TypeError("blocks.count is not a block count or blocks.table is not a string")
        try:
            raw = binascii.a2b_base64(table, strict_mode=True)
        except binascii.Error as e:
            raise ValueError(f"blocks.table is not base64 ({e})") from None
        size = (20 if len(names) == 4 else 16) * count
        if len(raw) != size:
            raise ValueError(f"blocks.table holds {len(raw)} bytes, not the {size} of {count} blocks")
        lengths_rows = np.frombuffer(raw, "<u4", 2 * count).astype(np.int64)
        lengths, rows = lengths_rows[:count], lengths_rows[count:]
        offsets = np.zeros(count, dtype=np.int64)
        np.cumsum(lengths[:-1], out=offsets[1:])
        checksums = np.frombuffer(raw, "<u8", count, 8 * count)
        tokens = np.frombuffer(raw, "<u4", count, 16 * count).astype(np.int64) if len(names) == 4 else None
        return cls(offsets, lengths, rows, checksums, tokens)

    def check(self, name: str, size: int, samples: int, tokens: int) -> str | None:
        """What is wrong with these blocks of shard `name` (`size` bytes at rest, `samples` rows,
        `tokens` tokens), None when nothing: rows summing to the samples, recorded tokens summing to
        the tokens, then block by block its rows in range, inside the file and after the block before
        it (pack writes them so; `verify` streams them so). Vectorised: O(blocks) in numpy, not Python."""
        rows, offsets, lengths = self.rows, self.offsets, self.lengths
        total = sum(rows.tolist())  # exact, whatever a hostile manifest's numbers add up to
        if total != samples:
            return f"shard {name}: block rows sum to {total}, not {samples} samples"
        if self.tokens is not None and self.tokens.size:
            counted = sum(self.tokens.tolist())
            if int(self.tokens.min()) < 0 or counted != tokens:
                return f"shard {name}: block tokens sum to {counted}, not its {tokens} tokens"
        before = np.concatenate(([0], (offsets + lengths)[:-1]))  # where the block before ends
        bad_rows = (rows < 0) | (rows >= MAX_COUNT)
        # each of offset and length within the size first, so their sum cannot wrap around
        outside = (offsets < 0) | (lengths <= 0) | (offsets > size) | (lengths > size) | (offsets + lengths > size)
        wrong = np.flatnonzero(bad_rows | outside | (offsets < before))
        if not wrong.size:
            return None
        i = int(wrong[0])
        offset, length = int(offsets[i]), int(lengths[i])
        if bad_rows[i]:
            return f"shard {name}: a block of {int(rows[i])} rows is negative or absurd"
        if outside[i]:
            return f"shard {name}: block at {offset}+{length} lies outside the file"
        return f"shard {name}: block at {offset}+{length} overlaps the block before it (ending at {int(before[i])})"

    @property
    def made(self) -> int:
        """Block records made so far (what a start paid for: the blocks it read, not the manifest's)."""
        return sum(b is not None for b in self._made)

    def token_counts(self) -> list[int | None]:
        return self.tokens.tolist() if self.tokens is not None else [None] * len(self)

    def __len__(self) -> int:
        return len(self._made)

    @overload
    def __getitem__(self, index: int) -> Block: ...

    @overload
    def __getitem__(self, index: slice) -> list[Block]: ...

    def __getitem__(self, index: int | slice) -> Block | list[Block]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        found = self._made[index]
        if found is None:
            tokens = int(self.tokens[index]) if self.tokens is not None else None
            checksum = self.checksums[index]
            hexed = checksum if isinstance(checksum, str) else f"{int(checksum):016x}"
            found = self._made[index] = Block(
                int(self.offsets[index]), int(self.lengths[index]), int(self.rows[index]), hexed, tokens
            )
        return found

    def __iter__(self) -> Iterator[Block]:
        return (self[i] for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"BlockList({len(self)} blocks, {self.made} made)"

    def __getstate__(self) -> tuple:
        return self.offsets, self.lengths, self.rows, self.checksums, self.tokens

    def __setstate__(self, state: tuple) -> None:
        self.offsets, self.lengths, self.rows, self.checksums, self.tokens = state
        self._made = [None] * len(self.checksums)


TABLE_COLUMNS = ("length", "rows", "checksum", "tokens")
"""The block table's columns, in order: little-endian uint32, uint32, uint64 (the xxh3-64's value)
and uint32; `tokens` only when every block has its count. The blocks are contiguous from offset 0
(pack writes them so), so their offsets are the lengths' running sum; a block decodes to at most
`block_decoder.BLOCK_DECODED_LIMIT` bytes, so 32 bits hold its length, rows and tokens."""
_TABLE_TYPES = ("<u4", "<u4", "<u8", "<u4")


def block_table(blocks: Sequence[Block]) -> dict:
    """A shard's blocks as the manifest stores them (format version 2): the columns one after another
    (`TABLE_COLUMNS`; the checksum is the xxh3-64's value), in one base64 string. JSON lists cost
    the manifest's parse and checksum a value per block and column; this costs C passes over ~27
    characters a block. ValueError for blocks a table cannot hold: not contiguous from 0, or a value
    that does not fit its column."""
    ends = np.cumsum([0] + [b.length for b in blocks]).tolist()
    if [b.offset for b in blocks] != ends[:-1]:
        raise ValueError("the blocks are not contiguous from offset 0; a block table cannot hold them")
    columns = [
        [b.length for b in blocks],
        [b.rows for b in blocks],
        [int(b.checksum, 16) for b in blocks],
        [b.tokens for b in blocks],
    ]
    if not blocks or any(b.tokens is None for b in blocks):
        columns.pop()
    names = list(TABLE_COLUMNS[: len(columns)])
    try:
        table = b"".join(np.array(values, dtype=kind).tobytes() for values, kind in zip(columns, _TABLE_TYPES))
    except OverflowError:
        raise ValueError(f"a block's {', '.join(names)} does not fit the block table's columns") from None
    return {"columns": names, "count": len(blocks), "table": base64.b64encode(table).decode("ascii")}


def block_lists(blocks: dict) -> dict:
    """A manifest's `blocks` object as format version 1 wrote it (JSON lists), for tools and tests
    that read or edit the columns by hand; readers take either form."""
    if "table" not in blocks:
        return blocks
    listed = BlockList.from_json(blocks)
    lists = {
        "offset": listed.offsets.tolist(),
        "length": listed.lengths.tolist(),
        "rows": listed.rows.tolist(),
        "checksum": [b.checksum for b in listed],
    }
    if listed.tokens is not None:
        lists["tokens"] = listed.tokens.tolist()
    return lists


def block_rows(blocks: Sequence[Block]) -> np.ndarray:
    """Rows of each block (int64), without making a record of each."""
    if isinstance(blocks, BlockList):
        return blocks.rows
    return np.fromiter((b.rows for b in blocks), dtype=np.int64, count=len(blocks))


def block_tokens(blocks: Sequence[Block]) -> list[int | None]:
    """Token count of each block (None where the pack did not record it), without making records."""
    if isinstance(blocks, BlockList):
        return blocks.token_counts()
    return [b.tokens for b in blocks]


def shard_name(checksum: str) -> str:
    return f"{SHARD_PREFIX}{checksum}{SHARD_SUFFIX}"
