"""Lookups over a manifest's shards that use the mapped version-3 tables when there are some: where a
sample or a token lives (`MappedIndex`), whether a file name is a shard of the dataset (`ShardNames`),
which shards hold an entry key (`ShardKeys`); none makes an object per shard. And whether a
directory's version-3 metadata is the dataset there (`current_metadata`)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from tierflow.errors import ShardCorruptError
from tierflow.format.manifest import MANIFEST_NAME, Manifest
from tierflow.format.metadata import CHECKSUM_HALVES, TABLE_SUFFIX, MappedManifest, has_metadata, load_metadata
from tierflow.format.shard import SHARD_PREFIX, SHARD_SUFFIX


class MappedIndex:
    """`DatasetIndex` over mapped metadata: where a sample or a token lives, from the shard table's
    running sums (sample_start, token_start) and, inside a shard, its own blocks' counts, made the
    first time that shard is looked up. Opening costs nothing per shard; a lookup costs one
    searchsorted over the shards and one over the blocks of each shard it lands in."""

    def __init__(
        self, manifest: MappedManifest, read_block_tokens: Callable[[int], Sequence[int]] | None = None
    ) -> None:
        self.manifest = manifest
        self.tables = manifest.tables
        self._read_block_tokens = read_block_tokens
        self._rows: dict[int, np.ndarray] = {}
        self._tokens: dict[int, np.ndarray] = {}
        self._token_rows: dict[int, np.ndarray] = {}
        self._sample_block_rows: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()
        self._sample_starts: np.ndarray | None = None
        self._token_starts: np.ndarray | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        return (MappedIndex, (self.manifest, self._read_block_tokens))

    @property
    def first_block(self) -> np.ndarray:
        """Shard s's first row of the block table (a global block number), length shards."""
        return self.tables.column("first_block")

    @property
    def sample_starts(self) -> np.ndarray:
        """[sample_start..., num_samples], length shards + 1 (made on first use: 8 bytes a shard)."""
        if self._sample_starts is None:
            self._sample_starts = np.append(self.tables.column("sample_start"), self.num_samples)
        return self._sample_starts

    @property
    def token_starts(self) -> np.ndarray:
        if self._token_starts is None:
            self._token_starts = np.append(self.tables.column("token_start"), self.num_tokens)
        return self._token_starts

    @property
    def num_samples(self) -> int:
        return int(self.tables.totals["samples"])

    @property
    def num_tokens(self) -> int:
        return int(self.tables.totals["tokens"])

    def _block_rows(self, s: int) -> np.ndarray:
        found = self._rows.get(s)
        if found is None:
            rows = self.tables.block_list(s).rows
            found = np.zeros(rows.size + 1, dtype=np.int64)
            np.cumsum(rows, out=found[1:])
            self._rows[s] = found
        return found

    def _block_tokens(self, s: int) -> np.ndarray:
        found = self._tokens.get(s)
        if found is not None:
            return found
        blocks = self.tables.block_list(s)
        expected = int(self.tables.value("tokens", s))
        counts = blocks.tokens
        if counts is None:
            if self._read_block_tokens is None:
                raise ValueError(
                    f"shard {self.tables.name(s)}: its blocks' token counts are not in the metadata "
                    f"and this index has no way to read them"
                )
            counts = np.asarray(self._read_block_tokens(s), dtype=np.int64)
            if counts.size != len(blocks) or int(counts.sum()) != expected:
                raise ShardCorruptError(
                    f"shard {self.tables.name(s)}: its blocks hold {int(counts.sum())} tokens in "
                    f"{counts.size} blocks, the metadata says {expected} in {len(blocks)}"
                )
        found = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=found[1:])
        with self._lock:
            self._tokens[s] = found
        return found

    def locate_samples(self, ids: np.ndarray):
        from tierflow.format.index import SamplePlaces

        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and int(ids.min()) >= 0 and int(ids.max()) < self.num_samples:
            shard = self.tables.shards_at("sample_start", ids)
            # one searchsorted over the blocks of the shards hit (contiguous id ranges, in order)
            parts = [self._sample_rows(s) for s in sorted(set(shard.tolist()))]
            rows = parts[0] if len(parts) == 1 else np.concatenate(parts)
            at = rows[:, 3].searchsorted(ids, side="right")
            return SamplePlaces(rows[at, 0], rows[at, 1], ids - rows[at, 2])
        starts = self.tables.column("sample_start")
        shard = starts.searchsorted(ids, side="right") - 1
        block = np.empty_like(ids)
        row = np.empty_like(ids)
        for s in np.unique(shard).tolist():
            here = shard == s
            local = ids[here] - int(starts[s])
            cum = self._block_rows(s)
            b = cum.searchsorted(local, side="right") - 1
            block[here], row[here] = b, local - cum[b]
        return SamplePlaces(shard, block, row)

    def _sample_rows(self, s: int) -> np.ndarray:
        """Shard s's blocks as rows (shard, block, first sample id, end sample id), made once per
        shard from its checked row counts (`_block_rows`)."""
        found = self._sample_block_rows.get(s)
        if found is None:
            cum = self._block_rows(s)
            first = int(self.tables.value("sample_start", s))
            found = np.empty((len(cum) - 1, 4), dtype=np.int64)
            found[:, 0], found[:, 1] = s, np.arange(len(cum) - 1)
            found[:, 2], found[:, 3] = first + cum[:-1], first + cum[1:]
            with self._lock:
                self._sample_block_rows[s] = found
        return found

    def locate_sample(self, i: int) -> tuple[int, int, int]:
        places = self.locate_samples(np.array([i]))
        return int(places.shard[0]), int(places.block[0]), int(places.row[0])

    def _block_rows_of_tokens(self, s: int) -> np.ndarray:
        """Shard s's blocks as rows (shard, block, first token, end token), global token numbers,
        made once per shard from its checked token counts (`_block_tokens`)."""
        found = self._token_rows.get(s)
        if found is None:
            cum = self._block_tokens(s)
            first = int(self.tables.value("token_start", s))
            found = np.empty((max(len(cum) - 1, 1), 4), dtype=np.int64)
            found[:, 0] = s
            if len(cum) > 1:
                found[:, 1] = np.arange(len(cum) - 1)
                found[:, 2], found[:, 3] = first + cum[:-1], first + cum[1:]
            else:  # no blocks: the clamped lookup's row (block 0, first = end = the shard's start)
                found[:, 1], found[:, 2], found[:, 3] = 0, first, first
            with self._lock:
                self._token_rows[s] = found
        return found

    def token_blocks(self, positions: np.ndarray) -> np.ndarray:
        """Per position, (shard, block, the block's first token, its end token), int64 (n, 4); a
        position past either end clamps to the first or last block. One searchsorted over the
        shards, then one over the blocks of the shards hit (their rows made once per shard)."""
        positions = np.asarray(positions, dtype=np.int64)
        if self.tables.num_shards == 0 or positions.size == 0:
            return np.empty((positions.size, 4), dtype=np.int64)
        if int(positions.min()) >= 0 and int(positions.max()) < self.num_tokens:
            found = self.tables.shards_at("token_start", positions)
        else:  # past either end: the first or last block, as the whole column sorts them
            found = self.tables.column("token_start").searchsorted(positions, side="right") - 1
        shards = sorted(set(found.tolist()))
        if shards[0] < 0:
            shards = sorted({0, *shards[1:]})
        parts = [self._block_rows_of_tokens(s) for s in shards]
        rows = parts[0] if len(parts) == 1 else np.concatenate(parts)
        # the shards hit are contiguous token ranges in order, so their blocks' ends are sorted
        return rows.take(rows[:, 3].searchsorted(positions, side="right"), axis=0, mode="clip")

    def locate_tokens(self, positions: np.ndarray):
        from tierflow.format.index import TokenPlaces

        positions = np.asarray(positions, dtype=np.int64)
        rows = self.token_blocks(positions)
        return TokenPlaces(rows[:, 0], rows[:, 1], positions - rows[:, 2], rows[:, 3] - positions)

    def locate_token(self, t: int) -> tuple[int, int, int, int]:
        shard, block, first, end = self.token_blocks(np.array([t]))[0].tolist()
        return shard, block, t - first, end - t


class ShardNames:
    """The shard file names a manifest references, as a container (`name in names`): for a mapped
    manifest a sorted copy of the checksum column (16 bytes a shard, no string per shard: gc of a
    million shards in ~16 MB), else a set of the names."""

    def __init__(self, manifest: Manifest) -> None:
        if isinstance(manifest, MappedManifest):
            tables = manifest.tables
            self._sorted: np.ndarray | None = tables.checksums().view(CHECKSUM_HALVES)[tables.column("checksum_order")]
            self._names: set[str] = set()
        else:
            self._sorted = None
            self._names = {s.name for s in manifest.shards}

    def __contains__(self, name: object) -> bool:
        if self._sorted is None:
            return name in self._names
        if not isinstance(name, str) or not (name.startswith("shard-") and name.endswith(TABLE_SUFFIX)):
            return False
        try:
            key = np.frombuffer(bytes.fromhex(name[len("shard-") : -len(TABLE_SUFFIX)]), dtype=CHECKSUM_HALVES)
        except ValueError:
            return False
        if key.size != 1:
            return False
        i = int(self._sorted.searchsorted(key[0]))
        return i < len(self._sorted) and self._sorted[i] == key[0]


class ShardKeys:
    """Entry key (a shard's at-rest checksum) -> the shards that have it, as `.get(key, default)`:
    for a mapped manifest a sorted view of the checksum column (24 bytes a shard, no string per
    shard), else a dict. Equal content may repeat under one key in a repacked dataset."""

    def __init__(self, manifest: Manifest) -> None:
        self._dict: dict[str, list[int]] | None = None
        if isinstance(manifest, MappedManifest):
            tables = manifest.tables
            self._order = tables.column("checksum_order")  # checked: a permutation sorting the keys
            self._sorted = tables.checksums().view(CHECKSUM_HALVES)[self._order]
        else:
            self._dict = {}
            for shard, info in enumerate(manifest.shards):
                self._dict.setdefault(info.key, []).append(shard)

    def get(self, key: str, default: Any = ()) -> Any:
        if self._dict is not None:
            return self._dict.get(key, default)
        try:
            probe = np.frombuffer(bytes.fromhex(key), dtype=CHECKSUM_HALVES)
        except ValueError:
            return default
        if probe.size != 1:
            return default
        lo = int(self._sorted.searchsorted(probe[0], side="left"))
        hi = int(self._sorted.searchsorted(probe[0], side="right"))
        return self._order[lo:hi].tolist() if hi > lo else default


def shard_file_name(manifest: Manifest, index: int) -> str:
    """Shard `index`'s file name; from the mapped checksum column when there is one (no ShardInfo made)."""
    if isinstance(manifest, MappedManifest):
        return manifest.tables.name(index)
    return manifest.shards[index].name


def shard_key(manifest: Manifest, index: int) -> str:
    """Shard `index`'s entry key (its at-rest checksum); from the mapped column when there is one."""
    if isinstance(manifest, MappedManifest):
        return manifest.tables.checksum(index).hex()
    return manifest.shards[index].key


def shards_named(manifest: Manifest, names: Sequence[str], keys: ShardKeys | None = None) -> list[int] | None:
    """The index of each shard file name, in order; None when one is not a shard of the dataset. A
    mapped manifest looks each up in its sorted checksums (a version-3 name is its checksum), so the
    cost is the names asked for, not the shards."""
    if not isinstance(manifest, MappedManifest):
        by_name = {info.name: i for i, info in enumerate(manifest.shards)}
        return [by_name[n] for n in names] if all(n in by_name for n in names) else None
    keys = keys if keys is not None else ShardKeys(manifest)
    found = []
    for name in names:
        if not (name.startswith(SHARD_PREFIX) and name.endswith(SHARD_SUFFIX)):
            return None
        shards = keys.get(name[len(SHARD_PREFIX) : -len(SHARD_SUFFIX)])
        if not shards:
            return None
        found.append(shards[-1])
    return found


def current_metadata(directory: str | Path) -> MappedManifest | None:
    """The version-3 metadata of a directory when it describes the dataset there: a header, and
    beside it no manifest.json or the very one the header recorded (size and xxh3-128: the file is
    read, not parsed; pack writes one only while it is small). None: read manifest.json (a version-2
    dataset, an unfinished pack, or a manifest replaced or edited after the header was written)."""
    directory = Path(directory)
    if not has_metadata(directory):
        return None
    manifest = load_metadata(directory)
    beside = manifest.header.get("manifest")
    path = directory / MANIFEST_NAME
    if beside is None:
        return manifest if not path.exists() else None
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        return None
    if size != beside["size"]:
        return None
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return manifest if h.hexdigest() == beside["xxh3"] else None
