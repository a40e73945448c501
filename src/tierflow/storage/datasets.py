"""Datasets at any URL `build_stack` takes, read straight from their source (no tiers needed).

`tierflow inspect|verify|gc`, `open_dataset` and `TieredDataset` accept s3:// (and any fsspec
URL) as they accept a directory: samples come block by block through ranged reads, each block
verified before use; `verify` hashes every shard as it streams past, storing nothing; `gc`
deletes the shard objects no manifest references, under the same rules as on a directory.
"""

from __future__ import annotations

import time
from pathlib import Path
from collections.abc import Callable, Sequence
from urllib.parse import urlsplit

import pyarrow as pa

from tierflow.errors import ManifestError, SourceNotFound
from tierflow.format.blocks import BlockBytes
from tierflow.format.dataset import Dataset, open_directory
from tierflow.format.reader import ShardReader
from tierflow.format._audit import StreamedAudit
from tierflow.format.manifest import MANIFEST_NAME, Manifest, check_manifest_size
from tierflow.format.metadata import MAX_HEADER_BYTES, METADATA_NAME, TABLE_PREFIX, TABLE_SUFFIX
from tierflow.format.metadata_writer import header_tables
from tierflow.format.metadata_index import ShardNames
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


def open_dataset(url: str | Path, columns: Sequence[str] | None = None, manifest: Manifest | None = None, *,
                 endpoint_url: str | None = None) -> Dataset:
    """A packed dataset for random access by global sample index, at a directory or any URL
    build_stack takes (s3://, with `endpoint_url` for an S3-compatible store; read straight from
    its source, one ranged read per block). `manifest`: its manifest, already loaded."""
    path = local_path(str(url))
    if path is not None:
        return open_directory(path, columns, manifest)
    url = str(url)
    source = open_store(url, endpoint_url=endpoint_url)
    manifest = manifest if manifest is not None else read_manifest(source)
    return Dataset(manifest, ShardReader(StoreBlocks(source), manifest.schema), columns=columns, location=url)


class StoreBlocks:
    """An object store's shards for a `ShardReader` or a tier stack's copy no tier took: one ranged read
    per block (`RangeBlocks`); `on_fetched(nbytes, seconds)` hears of each (the stack counts and times them).
    It pickles as its store (clients are made again in the process that unpickles it: a spawned worker)."""

    def __init__(self, store: RetryingStore, on_fetched: Callable[[int, float], None] | None = None) -> None:
        self.store = store
        self.on_fetched = on_fetched

    def __call__(self, info: ShardInfo) -> BlockBytes:
        return RangeBlocks(self.store, info, self.on_fetched)

    def __repr__(self) -> str:
        return f"StoreBlocks({self.store.url!r})"


class RangeBlocks(BlockBytes):
    """One shard's blocks, each fetched whole with a ranged read; the last one fetched is kept, since
    opening a shard reads block 0's head for the schema and then block 0 itself."""

    def __init__(self, source: RetryingStore, info: ShardInfo,
                 on_fetched: Callable[[int, float], None] | None = None) -> None:
        super().__init__(info.blocks, compressed=info.compression != "none")
        self.source = source
        self.on_fetched = on_fetched
        self.name = info.name
        self.max_decoded = info.decoded_bytes
        self._last: tuple[int, pa.Buffer] | None = None

    def read(self, index: int, length: int | None = None) -> pa.Buffer:
        last = self._last
        if last is None or last[0] != index:
            block = self.blocks[index]
            started = time.perf_counter()
            last = self._last = (index, pa.py_buffer(self.source.read_range(self.name, block.offset, block.length)))
            if self.on_fetched is not None:
                self.on_fetched(last[1].size, time.perf_counter() - started)
        data = last[1]
        return data if length is None or length >= data.size else data.slice(0, length)


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
    victims = [e.name for e in entries
               if "/" not in e.name and e.modified is not None and e.modified < written
               and ((e.name.startswith(SHARD_PREFIX) and e.name.endswith(SHARD_SUFFIX) and e.name not in keep)
                    or (e.name.startswith(TABLE_PREFIX) and e.name.endswith(TABLE_SUFFIX) and e.name not in tables))]
    for name in victims:
        source.delete(name)
    return victims


def _header_tables(source: RetryingStore) -> set[str]:
    """The tables the source's header names (kept whether or not the header is current), read after
    the listing as the manifest is."""
    try:
        if source.size(METADATA_NAME) > MAX_HEADER_BYTES:
            return set()
        return header_tables(source.read_bytes(METADATA_NAME))
    except SourceNotFound:
        return set()
