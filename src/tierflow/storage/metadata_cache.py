"""The node's copy of remote datasets' version-3 metadata: the tables downloaded once per node and
mapped by every process of it.

The table files are content-named, so a node keeps one directory per dataset URL and a file there
is never mistaken for a newer table. A node's ranks and workers open the dataset at the same
moment: the downloads run under a kernel file lock on that directory (it dies with its holder), so
one process downloads each table (to a temporary name, then a rename) and the others wait, then
map the same file and share its pages. The holder also removes the tables of earlier headers that
no process of the node has open (`remove_if_unused`), so the directory holds what is in use.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import xxhash

from tierflow.errors import ManifestError, SourceNotFound
from tierflow.format.manifest import MANIFEST_NAME, Manifest
from tierflow.format.metadata import (
    MAX_HEADER_BYTES,
    METADATA_NAME,
    TABLE_PREFIX,
    TABLE_SUFFIX,
    load_metadata,
    parse_header,
    table_entries,
)
from tierflow.format.metadata_index import current_metadata
from tierflow.format.table_locks import TableGone, remove_if_unused
from tierflow.storage.remote import RetryingStore, join_url

DOWNLOAD_LOCK = ".download.lock"
"""Held while a process of the node fetches a dataset's tables into its directory; never removed
(removing a lock file another process waits on would let two hold it)."""


def metadata_cache_dir() -> Path:
    """Where a node keeps the version-3 metadata of remote datasets (TIERFLOW_METADATA_CACHE, else
    tierflow-metadata-<uid> in the node's temporary directory)."""
    configured = os.environ.get("TIERFLOW_METADATA_CACHE")
    if configured:
        return Path(configured)
    return Path(tempfile.gettempdir()) / f"tierflow-metadata-{os.getuid()}"


def read_metadata(source: RetryingStore, cache: Path | None = None) -> Manifest | None:
    """A remote dataset's version-3 metadata, mapped from the node's copy, or None when it has none
    that is current (no header; or a manifest.json beside it other than the one it recorded: then the
    manifest is read as before). The header is read each time (a few KB); a table is downloaded only
    when the node has no file of its name and size, and checked column by column on use as a local
    one is. A table gc removed at the source after this header was read (a newer one superseded it)
    makes the header be read again."""
    root = getattr(source, "root", None)
    if isinstance(root, Path):  # a local directory (LocalStore): mapped where it lies, no copy
        return current_metadata(root)
    last = b""
    while True:
        raw = _current_header(source)
        if raw is None:
            return None
        try:
            return _map_from_node(source, raw, cache or metadata_cache_dir())
        except TableGone:
            if raw == last:
                raise
            last = raw


def _current_header(source: RetryingStore) -> bytes | None:
    """The header's bytes when it describes the dataset at the source (see `read_metadata`)."""
    where = join_url(source.url, METADATA_NAME)
    try:
        size = source.size(METADATA_NAME)
    except SourceNotFound:
        return None
    if size > MAX_HEADER_BYTES:
        raise ManifestError(f"{where}: {size} bytes, more than the {MAX_HEADER_BYTES} a metadata header may have")
    raw = source.read_bytes(METADATA_NAME)
    beside = parse_header(raw, where).get("manifest")
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
    return raw


def _map_from_node(source: RetryingStore, raw: bytes, cache: Path) -> Manifest:
    """Under the node's lock on the dataset's directory: fetch the tables the header names that the
    node lacks, write the header there, map it (its shared locks held from then on), and remove the
    tables of earlier headers that no process has open."""
    where = join_url(source.url, METADATA_NAME)
    header = parse_header(raw, where)
    local = cache / xxhash.xxh3_64_hexdigest(source.url.encode())
    local.mkdir(parents=True, exist_ok=True)
    names = {entry["file"]: entry["size"] for entry in table_entries(header)}
    chunk_tables = {header[key]["file"] for key in ("chunks", "block_chunks") if header.get(key) is not None}
    with node_lock(local / DOWNLOAD_LOCK):
        for name, expected in names.items():
            path = local / name
            if path.is_file() and path.stat().st_size == expected:
                continue  # fetched by another process of the node (or an earlier run)
            tmp = local / f".tmp-{os.getpid()}-{threading.get_ident()}-{name}"
            try:
                source.download(name, tmp, expected_size=expected)
                os.replace(tmp, path)
            except SourceNotFound:
                if name in chunk_tables:
                    continue  # an older tierflow's gc removes them: read without them (MetadataTables)
                raise TableGone(f"{where}: names {name}, which {source.url} does not hold") from None
            finally:
                tmp.unlink(missing_ok=True)
        tmp = local / f".tmp-{os.getpid()}-{threading.get_ident()}-{METADATA_NAME}"
        tmp.write_bytes(raw)
        os.replace(tmp, local / METADATA_NAME)  # this node's copy of the header names the tables it maps
        manifest = load_metadata(local, where=source.url)
        for p in local.iterdir():
            if p.name.startswith(TABLE_PREFIX) and p.name.endswith(TABLE_SUFFIX) and p.name not in names:
                remove_if_unused(p)
    return manifest


@contextmanager
def node_lock(path: Path) -> Iterator[None]:
    """An exclusive kernel lock on `path` (made if missing) for the block; waits for the holder."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _exists(source: RetryingStore, name: str) -> bool:
    try:
        source.size(name)
    except SourceNotFound:
        return False
    return True
