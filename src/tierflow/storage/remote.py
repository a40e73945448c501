"""Sources: where at-rest shards and manifests live (L4, or an L3 reached over the network).

A source is a URL prefix: a local directory (a path or file://), s3:// on any S3-compatible
endpoint (through obstore, chosen by measurement: see benchmarks/sources.py), or any other
fsspec URL (gs, az, http, hdfs, ...: an untested pass-through to fsspec); the last two live in
storage/s3.py and storage/fsspec_store.py. Every source retries
transient failures (5xx, throttling, resets, timeouts, bodies shorter than promised) with
exponential backoff and full jitter, charges the bytes it moves to the node's bandwidth
budget, and counts requests, retries and bytes. Clients are created lazily in each process
and again after a fork, since none of them survive one.
"""

from __future__ import annotations

import builtins
import logging
import os
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable
from urllib.parse import urlsplit

from tierflow.telemetry.metrics import MetricsRegistry
from tierflow.storage.budget import BandwidthBudget, Priority
from tierflow.errors import SourceError, SourceNotFound, SourceTimeout
from tierflow.storage._deadline import Deadline, FetchLimits, GuardedChunks, Stalled, call_within
from tierflow.format._checksum import file_xxh3_128, xxh3_128_hex
from tierflow.format._regular import open_regular, read_regular
from tierflow.format.manifest import MANIFEST_NAME
from tierflow.format.metadata import METADATA_NAME
from tierflow.format.metadata_writer import referenced_tables

CHUNK_BYTES = 1 << 20
"""Download and upload granularity: the unit charged to the budget and held in memory."""

MULTIPART_BYTES = 8 << 20
"""Uploads larger than this go in parts (S3 multipart), streamed from the file."""
LANDED_CHECK_BYTES = 64 << 20
"""`publish` reads back an object of at most this size to tell whether a failed upload landed."""

log = logging.getLogger("tierflow.storage")

_T = TypeVar("_T")


@runtime_checkable
class Store(Protocol):
    """Where at-rest shards and the manifest live. Names are relative to `url` ('manifest.json')."""

    url: str

    def read_bytes(self, name: str) -> bytes: ...

    def size(self, name: str) -> int: ...

    def read_range(self, name: str, offset: int, length: int) -> bytes: ...

    def download(self, name: str, dst: str | Path, expected_size: int | None = None) -> int: ...

    def upload(self, src: str | Path, name: str) -> None: ...

    def list(self, prefix: str = "") -> list[str]: ...


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long to back off: `retries` after the first attempt, full jitter."""

    retries: int = 5
    base_delay: float = 0.05
    max_delay: float = 5.0

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before retry number `attempt` (0-based): uniform in [0, base * 2**attempt]."""
        ceiling = min(self.max_delay, self.base_delay * (2.0**attempt))
        return (rng or random).uniform(0.0, ceiling)


@dataclass(frozen=True)
class ObjectEntry:
    """One object of a listing: its name under the source, size, and last modification (Unix
    seconds, the store's clock; None where the store does not say)."""

    name: str
    size: int
    modified: float | None


class TruncatedBody(IOError):
    """A response body ended before the length it promised: never data, always retried."""


class _DestinationError(Exception):
    """A local write failed (ENOSPC, EIO): the caller's problem, so it is raised as-is, not retried."""


def join_url(url: str, name: str) -> str:
    return f"{url.rstrip('/')}/{name}" if name else url


def check_name(url: str, name: str) -> str:
    """A name must stay inside its source: relative, no '..', no empty segments."""
    parts = name.split("/")
    if not name or name.startswith("/") or "\\" in name or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"source {url}: {name!r} is not a relative object name inside the source")
    return name


class RetryingStore:
    """The retrying, budgeted, counted half every source shares; subclasses move the bytes."""

    scheme = "?"
    watchdog = True
    """Network sources wait on their peer through a timed thread (FetchLimits); a local one reads directly."""

    def __init__(
        self,
        url: str,
        *,
        budget: BandwidthBudget | None = None,
        retries: int = 5,
        timeout: float = 30.0,
        registry: MetricsRegistry | None = None,
        retry_policy: RetryPolicy | None = None,
        chunk_bytes: int = CHUNK_BYTES,
        limits: FetchLimits | None = None,
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"source {url}: timeout must be positive, got {timeout!r}")
        self.url = url
        self.budget = budget
        self.retry_policy = retry_policy or RetryPolicy(retries=retries)
        self.timeout = timeout
        self.registry = registry
        self.chunk_bytes = chunk_bytes
        self.limits = limits or FetchLimits.from_env()

    # the Store protocol

    def read_bytes(self, name: str, *, priority: Priority = "high") -> bytes:
        key = check_name(self.url, name)
        deadline = Deadline(self.limits.total(None))

        def attempt() -> bytes:
            data = self._within(lambda: self._get(key), deadline, None, name)
            self._charge(len(data), priority, "in")
            return data

        return self._retrying("get", name, attempt, deadline)

    def size(self, name: str) -> int:
        key = check_name(self.url, name)
        deadline = Deadline(self.limits.total(0))
        return self._retrying("head", name, lambda: self._within(lambda: self._head(key), deadline, 0, name), deadline)

    def read_range(self, name: str, offset: int, length: int, *, priority: Priority = "high") -> bytes:
        key = check_name(self.url, name)
        if offset < 0 or length < 0:
            raise ValueError(f"{join_url(self.url, name)}: bad range offset={offset} length={length}")
        if length == 0:
            return b""

        deadline = Deadline(self.limits.total(length))

        def attempt() -> bytes:
            data = self._within(lambda: self._get_range(key, offset, length), deadline, length, name)
            if len(data) != length:
                raise TruncatedBody(f"range [{offset}, {offset + length}) returned {len(data)} bytes")
            self._charge(length, priority, "in")
            return data

        return self._retrying("get_range", name, attempt, deadline)

    def download(
        self, name: str, dst: str | Path, expected_size: int | None = None, *, priority: Priority = "high"
    ) -> int:
        """Stream the object to the file `dst`; see `read_into`."""
        with open(dst, "wb") as out:
            return self.read_into(name, out.write, expected_size, priority=priority)

    def read_into(
        self, name: str, write: Callable[[Any], Any], expected_size: int | None = None, *, priority: Priority = "high"
    ) -> int:
        """Stream the object into `write` chunk by chunk, never holding it whole; a retry resumes
        where the last attempt stopped, so `write` sees every byte once, in order.

        A size other than `expected_size` fails at once (the manifest and the store disagree).
        """
        key = check_name(self.url, name)
        progress: dict[str, Any] = {"written": 0, "size": expected_size}
        deadline = Deadline(self.limits.total(expected_size))

        def attempt() -> int:
            total, chunks = self._within(lambda: self._stream(key, progress["written"]), deadline, 0, name)
            if self.watchdog:
                chunks = GuardedChunks(chunks, self.limits, deadline, self.chunk_bytes, join_url(self.url, name))
            try:
                size = progress["size"]
                if size is None:
                    progress["size"] = size = total
                elif total != size:
                    raise SourceError(self.url, name, f"is {total} bytes, expected {size}")
                for chunk in chunks:
                    written = progress["written"] + len(chunk)
                    if written > size:
                        raise SourceError(self.url, name, f"sent more than its {size} bytes")
                    self._charge(len(chunk), priority, "in")
                    try:
                        write(chunk)
                    except OSError as exc:
                        raise _DestinationError(exc) from exc
                    progress["written"] = written
                if progress["written"] < size:
                    raise TruncatedBody(f"body ended at byte {progress['written']} of {size}")
                return size
            finally:
                close = getattr(chunks, "close", None)
                if close is not None:
                    close()

        return self._retrying("download", name, attempt, deadline)

    def upload(self, src: str | Path, name: str, *, priority: Priority = "low") -> None:
        """Upload a local file; large files stream in parts, each charged to the budget. Bounded
        as a read of its size is: `limits.total(size)` over every attempt and
        `limits.chunk_wait(size)` per attempt, counting only time spent on the peer (not on the
        budget), then SourceTimeout naming the object."""
        key = check_name(self.url, name)
        src = Path(src)
        size = src.stat().st_size
        deadline = Deadline(self.limits.total(size))

        def attempt() -> None:
            held = [0.0]  # seconds this attempt's body waited on the budget
            abandoned = threading.Event()

            def chunks() -> Iterator[bytes]:
                with open(src, "rb") as file:
                    while block := file.read(self.chunk_bytes):
                        if abandoned.is_set():  # an attempt cut by its deadline sends no more
                            raise Stalled(f"{join_url(self.url, name)}: attempt abandoned")
                        started = time.monotonic()
                        self._charge(len(block), priority, "out")
                        held[0] += time.monotonic() - started
                        yield block

            if not self.watchdog:
                return self._put(key, src, size, chunks)
            try:
                return call_within(
                    lambda: self._put(key, src, size, chunks),
                    self.limits.chunk_wait(size),
                    deadline,
                    join_url(self.url, name),
                    held=lambda: held[0],
                )
            finally:
                abandoned.set()

        self._retrying("put", name, attempt, deadline)

    def publish(self, src: str | Path, name: str, *, priority: Priority = "low") -> None:
        """`upload` for an object whose arrival means something (a dataset's manifest: it exists
        from that moment): when the upload fails, the object is looked at (HEAD, then its bytes
        against `src`'s) before failing, since a PUT whose answer was lost may have landed.
        Landed whole, it is a success (logged); otherwise the upload's error is raised."""
        try:
            self.upload(src, name, priority=priority)
        except SourceError as failed:
            if not self._landed(Path(src), name):
                raise
            log.warning(
                "%s: the upload failed (%s), but the object is there with the bytes sent; "
                "it landed, its answer was lost",
                join_url(self.url, name),
                failed.reason or failed,
            )

    def _landed(self, src: Path, name: str) -> bool:
        """Whether the object `name` holds `src`'s bytes (what a lost PUT answer leaves unknown)."""
        try:
            size = src.stat().st_size
            if self.size(name) != size or size > LANDED_CHECK_BYTES:
                return False
            return xxh3_128_hex(self.read_bytes(name)) == file_xxh3_128(src)
        except (SourceError, OSError):
            return False  # not there, or the store cannot be asked either: the upload's error stands

    def list(self, prefix: str = "") -> list[str]:
        """Names of every object under the source that start with `prefix`, sorted."""
        return [entry.name for entry in self.entries(prefix)]

    def entries(self, prefix: str = "") -> builtins.list[ObjectEntry]:
        """Every object under the source whose name starts with `prefix`, with size and age, by name."""

        def attempt() -> builtins.list[ObjectEntry]:
            return sorted((e for e in self._entries(prefix) if e.name.startswith(prefix)), key=lambda e: e.name)

        return self._retrying("list", prefix, attempt)

    def delete(self, name: str) -> None:
        """Remove an object (`tierflow gc`); one already gone is not an error."""
        key = check_name(self.url, name)

        def attempt() -> None:
            try:
                self._delete(key)
            except FileNotFoundError:
                pass

        self._retrying("delete", name, attempt)

    # the retry loop

    def _within(self, fn: Callable[[], _T], deadline: Deadline, nbytes: int | None, name: str) -> _T:
        """fn() (one request to the peer), cut when it takes longer than its size allows or the
        operation's deadline has left; a local source just calls it."""
        if not self.watchdog:
            return fn()
        seconds = deadline.left() if nbytes is None else self.limits.chunk_wait(nbytes)
        return call_within(fn, seconds, deadline, join_url(self.url, name))

    def _retrying(self, op: str, name: str, attempt: Callable[[], _T], deadline: Deadline | None = None) -> _T:
        policy = self.retry_policy
        tries = 0
        last = ""
        while True:
            if deadline is not None and tries and deadline.left() <= 0:
                self._count("tierflow_source_failures_total", op, "operations that failed for good")
                raise SourceTimeout(
                    self.url, name, f"{op} outlived its {deadline.seconds:.3g} s deadline ({last})", tries
                )
            tries += 1
            self._count("tierflow_source_requests_total", op, "requests (attempts) made to a source")
            started = time.perf_counter()
            try:
                result = attempt()
            except _DestinationError as exc:
                raise exc.args[0] from None
            except SourceError:
                self._count("tierflow_source_failures_total", op, "operations that failed for good")
                raise
            except Exception as exc:
                if isinstance(exc, FileNotFoundError):
                    self._count("tierflow_source_failures_total", op, "operations that failed for good")
                    raise SourceNotFound(self.url, name, "no such object") from exc
                if not self._transient(exc) or tries > policy.retries:
                    self._count("tierflow_source_failures_total", op, "operations that failed for good")
                    kind = SourceTimeout if isinstance(exc, Stalled) else SourceError
                    raise kind(self.url, name, f"{op} failed: {_describe(exc)}", tries) from exc
                last = _describe(exc)
                if deadline is not None and deadline.left() <= 0:
                    continue  # no retry past the deadline: the check above raises
                self._count("tierflow_source_retries_total", op, "attempts retried after a transient failure")
                pause = policy.delay(tries - 1)
                if deadline is not None:
                    pause = min(pause, max(0.0, deadline.left()))
                    deadline.spent += pause
                time.sleep(pause)
                continue
            if self.registry is not None:
                self.registry.histogram(
                    "tierflow_source_request_seconds",
                    {"scheme": self.scheme, "op": op},
                    "latency of successful source operations",
                ).observe(time.perf_counter() - started)
            return result

    def _transient(self, exc: BaseException) -> bool:
        return isinstance(exc, (TruncatedBody, TimeoutError, ConnectionError))

    def _charge(self, nbytes: int, priority: Priority, direction: str) -> None:
        if self.budget is not None:
            self.budget.acquire(nbytes, priority)
        if self.registry is not None:
            self.registry.counter(
                "tierflow_source_bytes_total",
                {"scheme": self.scheme, "direction": direction},
                "body bytes moved to (out) or from (in) a source, retries included",
            ).inc(nbytes)

    def _count(self, metric: str, op: str, description: str) -> None:
        if self.registry is not None:
            self.registry.counter(metric, {"scheme": self.scheme, "op": op}, description).inc()

    # what a subclass implements; keys are checked names

    def _head(self, key: str) -> int:
        raise NotImplementedError

    def _get(self, key: str) -> bytes:
        raise NotImplementedError

    def _get_range(self, key: str, offset: int, length: int) -> bytes:
        raise NotImplementedError

    def _stream(self, key: str, offset: int) -> tuple[int, Iterator[Any]]:
        """The object's full size, and its bytes from `offset` on, as buffers."""
        raise NotImplementedError

    def _put(self, key: str, src: Path, size: int, chunks: Callable[[], Iterator[bytes]]) -> None:
        raise NotImplementedError

    def _entries(self, prefix: str) -> builtins.list[ObjectEntry]:
        """Objects in the smallest listing that holds every name starting with `prefix`."""
        raise NotImplementedError

    def _delete(self, key: str) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


class LocalStore(RetryingStore):
    """A directory (a local disk, or a POSIX mount of a shared file system)."""

    scheme = "file"
    watchdog = False

    def __init__(self, root: str | Path, **options: Any) -> None:
        self.root = Path(root).resolve()
        super().__init__(str(self.root), **options)

    def _path(self, key: str) -> Path:
        return self.root / key

    def _head(self, key: str) -> int:
        return self._path(key).stat().st_size

    def _get(self, key: str) -> bytes:
        return read_regular(self._path(key), None, SourceError)  # regular files only: never a FIFO's wait

    def _get_range(self, key: str, offset: int, length: int) -> bytes:
        fd = open_regular(self._path(key), SourceError)
        try:
            return os.pread(fd, length, offset)
        finally:
            os.close(fd)

    def _stream(self, key: str, offset: int) -> tuple[int, Iterator[bytes]]:
        file = open(open_regular(self._path(key), SourceError), "rb")
        size = os.fstat(file.fileno()).st_size
        file.seek(offset)

        def chunks() -> Iterator[bytes]:
            with file:
                while block := file.read(self.chunk_bytes):
                    yield block

        return size, chunks()

    def _put(self, key: str, src: Path, size: int, chunks: Callable[[], Iterator[bytes]]) -> None:
        target = self._path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        temporary = target.with_name(f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}-{target.name}")
        try:
            with open(temporary, "wb") as out:
                for block in chunks():
                    out.write(block)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temporary, target)
        finally:
            temporary.unlink(missing_ok=True)

    def _entries(self, prefix: str) -> builtins.list[ObjectEntry]:
        start = self.root / prefix.rpartition("/")[0] if "/" in prefix else self.root
        found = []
        for directory, _, files in os.walk(start):
            for file in files:
                path = os.path.join(directory, file)
                try:
                    stat = os.stat(path)
                except FileNotFoundError:  # removed while listing
                    continue
                name = os.path.relpath(path, self.root).replace(os.sep, "/")
                found.append(ObjectEntry(name, stat.st_size, stat.st_mtime))
        return found

    def _delete(self, key: str) -> None:
        path = self._path(key)
        path.unlink()
        parent = path.parent  # an object store has no folders: one emptied by a delete goes too
        while parent != self.root and self.root in parent.parents:
            try:
                parent.rmdir()
            except OSError:
                return
            parent = parent.parent

    def _transient(self, exc: BaseException) -> bool:
        if isinstance(exc, (PermissionError, IsADirectoryError, NotADirectoryError)):
            return False
        return isinstance(exc, OSError)  # EIO, ESTALE: what a network mount says when it hiccups


def open_store(
    url: str,
    *,
    endpoint_url: str | None = None,
    budget: BandwidthBudget | None = None,
    retries: int = 5,
    timeout: float = 30.0,
    registry: MetricsRegistry | None = None,
    storage_options: dict[str, Any] | None = None,
    limits: FetchLimits | None = None,
) -> RetryingStore:
    """The source for `url`: a path or file:// -> LocalStore, s3:// -> S3Store (obstore, never
    s3fs), anything else -> FsspecStore (`storage_options` go to its filesystem). Without a
    `budget`, the source charges the node's (TIERFLOW_NODE_BANDWIDTH), which no job opts out of."""
    from tierflow.storage.fsspec_store import FsspecStore
    from tierflow.storage.s3 import S3Store

    budget = budget if budget is not None else BandwidthBudget(registry=registry)
    options: dict[str, Any] = {
        "budget": budget,
        "retries": retries,
        "timeout": timeout,
        "registry": registry,
        "limits": limits,
    }
    scheme = urlsplit(url).scheme if "://" in url else ""
    if scheme in ("", "file"):
        return LocalStore(urlsplit(url).path if scheme else url, **options)
    if scheme == "s3":
        return S3Store(url, endpoint_url=endpoint_url, **options)
    return FsspecStore(url, storage_options=storage_options, **options)


def upload_dataset(local_dir: str | Path, url: str, *, priority: Priority = "low", **options: Any) -> int:
    """Publish a packed dataset: shards first, manifest last, so readers never see a manifest
    whose shards are missing. Shards already present with the right size are skipped (their
    names are their content). Returns the number of shards uploaded."""
    from tierflow.format.manifest import Manifest

    local_dir = Path(local_dir)
    manifest = Manifest.load(local_dir)
    missing = [s.name for s in manifest.shards if not (local_dir / s.name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{local_dir}: manifest lists {len(missing)} shards not in the directory, e.g. {missing[0]}"
        )
    source = open_store(url, **options)
    present = set(source.list("shard-"))
    uploaded = sum(
        upload_shard(source, local_dir / s.name, s.name, s.bytes, present, priority=priority) for s in manifest.shards
    )
    publish_metadata(source, local_dir, priority=priority)  # tables, header, manifest.json last
    return uploaded


def publish_metadata(source: Any, directory: Path, priority: str = "low") -> None:
    """Upload a dataset's metadata in commit order: the version-3 tables (content-named: never one a
    published header names), the header, then manifest.json when there is one. A reader that finds
    a header whose recorded manifest is not there yet reads no dataset, as before the manifest."""
    names = sorted(referenced_tables(directory)) + [
        n for n in (METADATA_NAME, MANIFEST_NAME) if (directory / n).exists()
    ]
    for name in names[:-1]:
        source.upload(directory / name, name, priority=priority)
    if names:  # the last one commits the dataset: a lost answer to its PUT is looked at before failing
        source.publish(directory / names[-1], names[-1], priority=priority)


def upload_shard(
    source: RetryingStore, path: Path, name: str, nbytes: int, present: set[str], *, priority: Priority = "low"
) -> bool:
    """Upload one shard unless `present` (names listed at the source) has it at its size: a shard's
    name is its content, so an unfinished earlier upload's shards are kept, not sent again."""
    if name in present and source.size(name) == nbytes:
        return False
    source.upload(path, name, priority=priority)
    return True


def _describe(exc: BaseException) -> str:
    text = str(exc).split("\n\nDebug source:", 1)[0].strip()
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__
