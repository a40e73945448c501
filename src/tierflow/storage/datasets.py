"""Datasets at any URL `build_stack` takes, read straight from their source (no tiers needed).

`tierflow inspect|verify|gc`, `open_dataset` and `TieredDataset` accept s3:// (and any fsspec
URL) as they accept a directory: samples come block by block through ranged reads, each block
verified before use; `verify` hashes every shard as it streams past, storing nothing; `gc`
deletes the shard objects no manifest references, under the same rules as on a directory.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path
from collections.abc import Callable, Sequence
from urllib.parse import urlsplit

import pyarrow as pa
import xxhash

from tierflow.errors import ManifestError, SourceNotFound
from tierflow.format.blocks import BlockBytes
from tierflow.format.dataset import Dataset, open_directory
from tierflow.format.reader import ShardReader
from tierflow.format._audit import StreamedAudit
from tierflow.format.manifest import MANIFEST_NAME, Manifest, check_manifest_size
from tierflow.format.metadata import MAX_HEADER_BYTES, METADATA_NAME, current_metadata, load_metadata, parse_header
from tierflow.format.metadata_index import ShardNames
from tierflow.format.shard import SHARD_PREFIX, SHARD_SUFFIX, ShardInfo
from tierflow.format.verify import ShardVerifier
from tierflow.storage.remote import RetryingStore, join_url, open_store


def local_path(location: str | Path) -> Path | None:
    """The directory a plain path or file:// URL names; None for a remote URL (s3://, gs://...)."""
    text = str(location)
    if "://" not in text:
        return Path(text)
    parts = urlsplit(text)
    return Path(parts.path) if parts.scheme == "file" else None


def metadata_cache_dir() -> Path:
    """Where a node keeps the version-3 metadata of remote datasets (TIERFLOW_METADATA_CACHE, else
    tierflow-metadata-<uid> in the node's temporary directory): the table files are content-named, so
    the node's ranks and workers download each once and map the same files, and a stale one is never
    mistaken for a newer one."""
    configured = os.environ.get("TIERFLOW_METADATA_CACHE")
    if configured:
        return Path(configured)
    return Path(tempfile.gettempdir()) / f"tierflow-metadata-{os.getuid()}"


def read_metadata(source: RetryingStore, cache: Path | None = None) -> Manifest | None:
    """A remote dataset's version-3 metadata, mapped from a node-local copy, or None when it has none
    that is current (no header; or a manifest.json beside it other than the one it recorded: then the
    manifest is read as before). The header is read each time (a few KB); a table is downloaded only
    when the node has no file of its name and size (a temporary name, then a rename), and checked
    column by column on use as a local one is."""
    root = getattr(source, "root", None)
    if isinstance(root, Path):  # a local directory (LocalStore): mapped where it lies, no copy
        return current_metadata(root)
    where = join_url(source.url, METADATA_NAME)
    try:
        size = source.size(METADATA_NAME)
    except SourceNotFound:
        return None
    if size > MAX_HEADER_BYTES:
        raise ManifestError(f"{where}: {size} bytes, more than the {MAX_HEADER_BYTES} a metadata header may have")
    raw = source.read_bytes(METADATA_NAME)
    header = parse_header(raw, where)
    beside = header.get("manifest")
    if beside is not None:
        try:
            if source.size(MANIFEST_NAME) != beside["size"]:
                return None
            digest = xxhash.xxh3_128()
            source.read_into(MANIFEST_NAME, digest.update, expected_size=beside["size"])
        except SourceNotFound:
            return None
        if digest.hexdigest() != beside["xxh3"]:
            return None
    elif _exists(source, MANIFEST_NAME):
        return None
    local = (cache or metadata_cache_dir()) / xxhash.xxh3_64_hexdigest(source.url.encode())
    local.mkdir(parents=True, exist_ok=True)
    for table in ("shards", "blocks"):
        name, expected = header[table]["file"], header[table]["size"]
        path = local / name
        if path.is_file() and path.stat().st_size == expected:
            continue
        tmp = local / f".tmp-{os.getpid()}-{threading.get_ident()}-{name}"
        try:
            source.download(name, tmp, expected_size=expected)
            os.replace(tmp, path)
        except SourceNotFound:
            raise ManifestError(f"{where}: names {name}, which {source.url} does not hold") from None
        finally:
            tmp.unlink(missing_ok=True)
    tmp = local / f".tmp-{os.getpid()}-{threading.get_ident()}-{METADATA_NAME}"
    tmp.write_bytes(raw)
    os.replace(tmp, local / METADATA_NAME)  # this node's copy of the header names the tables it maps
    return load_metadata(local, where=source.url)


def _exists(source: RetryingStore, name: str) -> bool:
    try:
        source.size(name)
    except SourceNotFound:
        return False
    return True


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
    """Delete the shard objects directly under the source that its manifest does not reference
    (`tierflow gc` on a URL); returns their names.

    The rules of gc on a directory: no manifest, no deletion; only shard names at the top are
    candidates, nothing else under the prefix. An object store has no lock a pack could hold,
    so a shard written after the manifest is kept too: it may belong to a pack in progress
    (shards go first, the manifest last), and goes in the first gc after that pack's manifest.
    """
    entries = source.entries()
    times = [e.modified for e in entries if e.name in (MANIFEST_NAME, METADATA_NAME)]  # the last publication
    known = [t for t in times if t is not None]
    written = max(known) if times and len(known) == len(times) else None
    keep = ShardNames(read_manifest(source))  # read after listing: never an older one
    if written is None:  # the store gives no times: nothing can be told apart from a pack in progress
        return []
    victims = [e.name for e in entries
               if "/" not in e.name and e.name.startswith(SHARD_PREFIX) and e.name.endswith(SHARD_SUFFIX)
               and e.name not in keep and e.modified is not None and e.modified < written]
    for name in victims:
        source.delete(name)
    return victims
