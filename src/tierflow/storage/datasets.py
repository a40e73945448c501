"""Datasets at any URL `build_stack` takes, read straight from their source (no tiers needed).

`tierflow inspect|verify|gc`, `open_dataset` and `TieredDataset` accept s3:// (and any fsspec
URL) as they accept a directory: samples come block by block through ranged reads, each block
verified before use; `verify` hashes every shard as it streams past, storing nothing; `gc`
deletes the shard objects no manifest references, under the same rules as on a directory.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from pathlib import Path
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

import pyarrow as pa

from tierflow.errors import ManifestError, ShardCorruptError, SourceNotFound
from tierflow.format.blocks import BlockBytes
from tierflow.format.dataset import Dataset, open_directory
from tierflow.format.reader import ShardReader
from tierflow.format._audit import StreamedAudit
from tierflow.format.manifest import MANIFEST_NAME, Manifest, check_manifest_size
from tierflow.format.metadata import MAX_HEADER_BYTES, METADATA_NAME, TABLE_PREFIX, TABLE_SUFFIX, MappedManifest
from tierflow.format.metadata_writer import (
    header_bytes,
    header_tables,
    updated_header,
    referenced_tables,
    write_metadata,
)
from tierflow.format.metadata_header import parse_header
from tierflow.format.metadata_index import ShardNames
from tierflow.format.metadata_windows import lengths_to_store
from tierflow.format.shard import SHARD_PREFIX, SHARD_SUFFIX, ShardInfo
from tierflow.format.verify import ShardVerifier
from tierflow.storage.metadata_cache import read_metadata
from tierflow.storage.remote import RetryingStore, join_url, open_store


def local_path(location: str | Path) -> Path | None:
    """The directory a plain path or file:// URL names; None for a remote URL (s3://, gs://...)."""
    text = str(location)
    if "://" not in text:
        return Path(text)
    parts = urlsplit(text)
    return Path(parts.path) if parts.scheme == "file" else None


def read_manifest(source: RetryingStore) -> Manifest:
    """The dataset's manifest (version-3 metadata when current, mapped from a node-local copy); a
    prefix without one is refused as a local directory is."""
    mapped = read_metadata(source)
    if mapped is not None:
        return mapped
    return read_manifest_json(source)[1]


def read_manifest_json(source: RetryingStore) -> tuple[bytes, Manifest]:
    """The dataset's manifest.json, its bytes and what they say (checked as any reader checks them)."""
    where = join_url(source.url, MANIFEST_NAME)
    try:
        size = source.size(MANIFEST_NAME)
        check_manifest_size(size, where)  # before a byte is downloaded: a hostile one could be any size
        chunks: list[bytes] = []
        source.read_into(MANIFEST_NAME, chunks.append, expected_size=size)  # and no more than that
    except SourceNotFound:
        raise ManifestError(f"{where}: no manifest; {source.url} holds no finished tierflow dataset") from None
    raw = b"".join(chunks)
    return raw, Manifest.from_bytes(raw, where)


def load_manifest(location: str | Path, endpoint_url: str | None = None) -> Manifest:
    """The manifest of the dataset at a directory or any URL."""
    path = local_path(location)
    if path is not None:
        return Manifest.load(path)
    return read_manifest(open_store(str(location), endpoint_url=endpoint_url))


def open_dataset(
    url: str | Path,
    columns: Sequence[str] | None = None,
    manifest: Manifest | None = None,
    *,
    endpoint_url: str | None = None,
) -> Dataset:
    """A packed dataset for random access by global sample index, at a directory or any URL
    build_stack takes (s3://, with `endpoint_url` for an S3-compatible store; read straight from
    its source, in ranged reads of runs of blocks). `manifest`: its manifest, already loaded."""
    path = local_path(str(url))
    if path is not None:
        return open_directory(path, columns, manifest)
    url = str(url)
    source = open_store(url, endpoint_url=endpoint_url)
    manifest = manifest if manifest is not None else read_manifest(source)
    return Dataset(manifest, ShardReader(StoreBlocks(source), manifest.schema), columns=columns, location=url)


READAHEAD_BYTES = 8 << 20
"""The most bytes one ranged read of a shard fetches: a run of consecutive blocks in one GET (a GET
costs ~10-50 ms of latency and a request's price on S3, whatever its size up to a few MiB)."""
MAX_HELD_BYTES = 32 << 20
"""At-rest block bytes that one `StoreBlocks` (a reading process's) holds over all its shards
(`HeldBlocks`): blocks fetched ahead until used, used ones while there is room; past it the used
ones go first, then the oldest fetched ahead (fetched again if used)."""


class StoreBlocks:
    """An object store's shards for a `ShardReader` or a tier stack's copy no tier took, read in
    ranged reads of runs of blocks (`RangeBlocks`: up to `readahead` bytes each); `on_fetched(nbytes,
    seconds)` hears of each read (the stack counts and times them). Blocks fetched ahead of use share
    one bound, `max_held` bytes. It pickles as its store and bounds (clients are made again in the
    process that unpickles it: a spawned worker)."""

    def __init__(
        self,
        store: RetryingStore,
        on_fetched: Callable[[int, float], None] | None = None,
        readahead: int | None = None,
        max_held: int | None = None,
    ) -> None:
        self.store = store
        self.on_fetched = on_fetched
        self.readahead = READAHEAD_BYTES if readahead is None else readahead
        self.held = HeldBlocks(MAX_HELD_BYTES if max_held is None else max_held)

    def __call__(self, info: ShardInfo) -> BlockBytes:
        return RangeBlocks(self.store, info, self.on_fetched, self.readahead, self.held)

    def __reduce__(self) -> tuple[Any, ...]:
        return (StoreBlocks, (self.store, self.on_fetched, self.readahead, self.held.max_bytes))

    def __repr__(self) -> str:
        return f"StoreBlocks({self.store.url!r})"


class HeldBlocks:
    """At-rest block bytes fetched from a store, over every shard of one `StoreBlocks` (a reading
    process's), keyed by shard name and block: at most `max_bytes`. Blocks fetched ahead wait here
    for their first use; used ones stay while there is room (a reader whose decoded-block cache let
    a block go, or that opened the shard again, reads it from here, not the store) and go first:
    the oldest used block, then the oldest unused one (fetched again if read: `dropped` counts them)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.dropped = 0
        """Blocks fetched ahead that went unused (each fetched again if read: bytes over the shard's size)."""
        self._ahead: OrderedDict[tuple[str, int], pa.Buffer] = OrderedDict()
        self._used: OrderedDict[tuple[str, int], pa.Buffer] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, name: str, blocks: dict[int, pa.Buffer], keep: int) -> None:
        """Blocks just fetched, not used yet; then the oldest go while over the bound (not block `keep`
        of `name`, the one being read)."""
        with self._lock:
            for index, data in blocks.items():
                key = (name, index)
                old = self._ahead.pop(key, None) or self._used.pop(key, None)
                self.bytes += data.size - (old.size if old is not None else 0)
                self._ahead[key] = data
            for queue in (self._used, self._ahead):
                while self.bytes > self.max_bytes and queue:
                    key, data = next(iter(queue.items()))
                    if key == (name, keep):
                        if len(queue) == 1:
                            break
                        queue.move_to_end(key)
                        continue
                    del queue[key]
                    self.bytes -= data.size
                    self.dropped += queue is self._ahead

    def get(self, name: str, index: int, use: bool) -> pa.Buffer | None:
        """Block `index` of shard `name` if held; `use`: its reader uses it now (it joins the used ones)."""
        key = (name, index)
        with self._lock:
            data = self._ahead.pop(key, None) if use else self._ahead.get(key)
            if data is not None:
                if use:
                    self._used[key] = data
                return data
            data = self._used.get(key)
            if data is not None:
                self._used.move_to_end(key)
            return data

    def discard(self, name: str, index: int) -> None:
        with self._lock:
            data = self._ahead.pop((name, index), None) or self._used.pop((name, index), None)
            if data is not None:
                self.bytes -= data.size

    def holds(self, name: str, index: int) -> bool:
        key = (name, index)
        return key in self._ahead or key in self._used


class RangeBlocks(BlockBytes):
    """One shard's blocks, fetched in runs: a block not held yet is fetched with the blocks around it
    in one ranged read, up to `readahead` bytes (the shard cut into runs of consecutive blocks of at
    most that many bytes; the run holding the block, less the blocks its reader holds decoded or that
    are held already, or were fetched ahead before). The others wait in `held` until used; each is
    checked against its xxh3-64 when used, as any block. A block is fetched ahead once per open: one
    that was dropped unused (the order reached it after `held`'s bound pushed it out) is fetched
    alone when used, so an open costs at most twice the shard's bytes, and its bytes once while
    `held` has room. The head read of block 0 for the schema is block 0's fetch."""

    def __init__(
        self,
        source: RetryingStore,
        info: ShardInfo,
        on_fetched: Callable[[int, float], None] | None = None,
        readahead: int = READAHEAD_BYTES,
        held: HeldBlocks | None = None,
    ) -> None:
        super().__init__(info.blocks, compressed=info.compression != "none")
        self.source = source
        self.on_fetched = on_fetched
        self.name = info.name
        self.max_decoded = info.decoded_bytes
        self.held = held if held is not None else HeldBlocks(max(readahead, MAX_HELD_BYTES))
        self._runs = _runs([b.length for b in self.blocks], readahead)
        self._ahead = bytearray(len(self.blocks))  # fetched ahead once: never again (a drop costs one refetch)

    def read(self, index: int, length: int | None = None) -> pa.Buffer:
        data = self.held.get(self.name, index, use=length is None)
        if data is None:
            data = self._fetch(index, keep=length is not None)
        return data if length is None or length >= data.size else data.slice(0, length)

    def checked(self, index: int, name: str) -> pa.Buffer:
        try:
            return super().checked(index, name)
        except ShardCorruptError:  # not kept: the next attempt reads the store again
            self.held.discard(self.name, index)
            raise

    def _fetch(self, index: int, keep: bool) -> pa.Buffer:
        """Block `index`, fetched with the blocks of its run that no one holds (one ranged read); the
        others held for their use (and block `index` itself when `keep`: a head read)."""
        start, end = self._runs[index]
        loaded = self.loaded
        ahead, held = self._ahead, self.held
        wanted = [
            j == index or (not ahead[j] and not held.holds(self.name, j) and (loaded is None or loaded[j] is None))
            for j in range(start, end)
        ]
        first = index
        while first > start and wanted[first - 1 - start]:
            first -= 1
        last = index + 1
        while last < end and wanted[last - start]:
            last += 1
        blocks = self.blocks
        offset = blocks[first].offset
        started = time.perf_counter()
        run = self.source.read_range(self.name, offset, blocks[last - 1].offset + blocks[last - 1].length - offset)
        if self.on_fetched is not None:
            self.on_fetched(len(run), time.perf_counter() - started)
        # each block a copy of its own (~1 ms for 8 MiB): a slice would keep the whole run alive while any
        # block of it is held or decoded over it, outside `held`'s count
        parts = {
            j: pa.py_buffer(run[blocks[j].offset - offset : blocks[j].offset - offset + blocks[j].length])
            for j in range(first, last)
        }
        del run
        ahead[first:last] = b"\x01" * (last - first)
        self.held.add(self.name, parts, index)
        return parts[index] if keep else self.held.get(self.name, index, use=True) or parts[index]


def _runs(lengths: list[int], budget: int) -> list[tuple[int, int]]:
    """Per block, the [start, end) of its run: consecutive blocks cut into runs of at most `budget`
    bytes (a block larger than that is a run of its own)."""
    runs: list[tuple[int, int]] = []
    start, size = 0, 0
    for i, length in enumerate(lengths):
        if i > start and size + length > budget:
            runs += [(start, i)] * (i - start)
            start, size = i, 0
        size += length
    runs += [(start, len(lengths))] * (len(lengths) - start)
    return runs


def verify_source(source: RetryingStore, manifest: Manifest) -> list[str]:
    """Every problem with the dataset's shards at the source, each shard hashed as it streams past
    (size, every block, the whole file) and its manifest counts checked against each block as it
    completes (the bytes cross the network once and are not kept), as sentences naming the shard and block; empty if sound."""
    problems = []
    for info in manifest.shards:
        audit = StreamedAudit(info, manifest)
        verifier = ShardVerifier(info, on_block=audit.block)
        try:
            source.read_into(info.name, verifier.write, priority="low")
        except SourceNotFound:
            problems.append(f"shard {info.name}: missing ({join_url(source.url, info.name)})")
            continue
        problems += verifier.problems() or audit.problems  # the counts, from the same bytes
    return problems


def collect_garbage(source: RetryingStore) -> list[str]:
    """Delete the shard objects and metadata tables directly under the source that its manifest and
    header do not reference (`tierflow gc` on a URL); returns their names.

    The rules of gc on a directory: no manifest, no deletion; only shard and table names at the top
    are candidates, nothing else under the prefix. An object store has no lock a pack could hold,
    so an object written after the last publication (manifest or header) is kept too: it may belong
    to a pack or an upgrade in progress (shards and tables go first, the header and manifest last),
    and goes in the first gc after that publication. A reader that read an older header before its
    tables went reads the header again (`read_metadata`); one that mapped them has the node's copy.
    """
    entries = source.entries()
    times = [e.modified for e in entries if e.name in (MANIFEST_NAME, METADATA_NAME)]  # the last publication
    known = [t for t in times if t is not None]
    written = max(known) if times and len(known) == len(times) else None
    keep = ShardNames(read_manifest(source))  # read after listing: never an older one
    tables = _header_tables(source)
    if written is None:  # the store gives no times: nothing can be told apart from a pack in progress
        return []
    victims = [
        e.name
        for e in entries
        if "/" not in e.name
        and e.modified is not None
        and e.modified < written
        and (
            (e.name.startswith(SHARD_PREFIX) and e.name.endswith(SHARD_SUFFIX) and e.name not in keep)
            or (e.name.startswith(TABLE_PREFIX) and e.name.endswith(TABLE_SUFFIX) and e.name not in tables)
        )
    ]
    for name in victims:
        source.delete(name)
    return victims


def _stored_lengths(source: RetryingStore) -> list[int] | None:
    """The window lengths the source's header stores layouts for (kept by an upgrade that rewrites it);
    None: it has no version-3 header yet; none where its header is one no reader takes."""
    try:
        if source.size(METADATA_NAME) > MAX_HEADER_BYTES:
            return []
        header = parse_header(source.read_bytes(METADATA_NAME), f"{source.url}/{METADATA_NAME}")
    except SourceNotFound:
        return None
    except ManifestError:
        return []
    return [int(key) for key in header.get("windows") or {}]


def _header_tables(source: RetryingStore) -> set[str]:
    """The tables the source's header names (kept whether or not the header is current), read after
    the listing as the manifest is."""
    try:
        if source.size(METADATA_NAME) > MAX_HEADER_BYTES:
            return set()
        return header_tables(source.read_bytes(METADATA_NAME))
    except SourceNotFound:
        return set()


def update_header_source(source: Any, workdir: str | Path, seq_lens: Sequence[int] = ()) -> bool:
    """`update_header` for a version-3 dataset at a URL written by an older tierflow (with no
    manifest.json to upgrade from: above LEGACY_MANIFEST_SHARDS pack writes none): its tables mapped
    from the node's copy, a table it lacks written in `workdir` and uploaded, then the header (the
    commit point). False: nothing to add."""
    workdir = Path(workdir)
    manifest = read_metadata(source)
    if not isinstance(manifest, MappedManifest):
        raise ManifestError(f"{source.url}: neither a manifest.json nor version-3 metadata to upgrade")
    header = updated_header(manifest, workdir, seq_lens)
    if header is None:
        return False
    data = header_bytes(header)
    for name in sorted(header_tables(data)):
        if (workdir / name).exists():  # written by updated_header: new, or one the source lost
            source.upload(workdir / name, name)
    (workdir / METADATA_NAME).write_bytes(data)
    source.upload(workdir / METADATA_NAME, METADATA_NAME)
    return True


def upgrade_source(source: Any, workdir: str | Path, seq_lens: Sequence[int] = ()) -> str:
    """`upgrade` for a dataset at a URL: its manifest.json read and checked, the tables and header
    written in `workdir`, uploaded tables first and the header last (the commit point); the manifest
    stays for version-2 readers. Returns the header's URL."""
    workdir = Path(workdir)
    raw, manifest = read_manifest_json(source)
    lengths = lengths_to_store(seq_lens, _stored_lengths(source), manifest.token_column)
    write_metadata(workdir, manifest, manifest_bytes=raw, seq_lens=lengths)
    for name in sorted(referenced_tables(workdir)):
        source.upload(workdir / name, name)
    source.upload(workdir / METADATA_NAME, METADATA_NAME)
    return f"{source.url}/{METADATA_NAME}"
