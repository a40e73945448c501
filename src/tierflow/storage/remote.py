"""Sources: where at-rest shards and manifests live (L4, or an L3 reached over the network).

A source is a URL prefix: a local directory (a path or file://), s3:// on any S3-compatible
endpoint (through obstore, chosen by measurement: see benchmarks/sources.py), or any other
fsspec URL (gs, az, http, hdfs, ...: an untested pass-through to fsspec). Every source retries
transient failures (5xx, throttling, resets, timeouts, bodies shorter than promised) with
exponential backoff and full jitter, charges the bytes it moves to the node's bandwidth
budget, and counts requests, retries and bytes. Clients are created lazily in each process
and again after a fork, since none of them survive one.
"""

from __future__ import annotations

import os
import random
import re
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable
from urllib.parse import urlsplit

from tierflow.telemetry.metrics import MetricsRegistry
from tierflow.storage.budget import BandwidthBudget, Priority
from tierflow.errors import SourceError, SourceNotFound
from tierflow.format.regular import open_regular, read_regular

CHUNK_BYTES = 1 << 20
"""Download and upload granularity: the unit charged to the budget and held in memory."""

MULTIPART_BYTES = 8 << 20
"""Uploads larger than this go in parts (S3 multipart), streamed from the file."""

_T = TypeVar("_T")
_obstore_runtime_pid: int | None = None  # the process whose obstore (tokio) runtime has started
_CLIENT_ERROR = re.compile(r"status code: (4\d\d)")
_RETRYABLE_CLIENT_STATUSES = {"408", "429"}


@runtime_checkable
class Source(Protocol):
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


class RetryingSource:
    """The retrying, budgeted, counted half every source shares; subclasses move the bytes."""

    scheme = "?"

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
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"source {url}: timeout must be positive, got {timeout!r}")
        self.url = url
        self.budget = budget
        self.retry_policy = retry_policy or RetryPolicy(retries=retries)
        self.timeout = timeout
        self.registry = registry
        self.chunk_bytes = chunk_bytes

    # the Source protocol

    def read_bytes(self, name: str, *, priority: Priority = "high") -> bytes:
        key = check_name(self.url, name)

        def attempt() -> bytes:
            data = self._get(key)
            self._charge(len(data), priority, "in")
            return data

        return self._retrying("get", name, attempt)

    def size(self, name: str) -> int:
        key = check_name(self.url, name)
        return self._retrying("head", name, lambda: self._head(key))

    def read_range(self, name: str, offset: int, length: int, *, priority: Priority = "high") -> bytes:
        key = check_name(self.url, name)
        if offset < 0 or length < 0:
            raise ValueError(f"{join_url(self.url, name)}: bad range offset={offset} length={length}")
        if length == 0:
            return b""

        def attempt() -> bytes:
            data = self._get_range(key, offset, length)
            if len(data) != length:
                raise TruncatedBody(f"range [{offset}, {offset + length}) returned {len(data)} bytes")
            self._charge(length, priority, "in")
            return data

        return self._retrying("get_range", name, attempt)

    def download(
        self,
        name: str,
        dst: str | Path,
        expected_size: int | None = None,
        *,
        priority: Priority = "high",
    ) -> int:
        """Stream the object to `dst` chunk by chunk; a retry resumes where the last attempt stopped.

        A size other than `expected_size` fails at once (the manifest and the store disagree).
        """
        key = check_name(self.url, name)
        progress = {"written": 0, "size": expected_size}
        with open(dst, "wb") as out:

            def attempt() -> int:
                total, chunks = self._stream(key, progress["written"])
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
                            out.write(chunk)
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

            return self._retrying("download", name, attempt)

    def upload(self, src: str | Path, name: str, *, priority: Priority = "low") -> None:
        """Upload a local file; large files stream in parts, each charged to the budget."""
        key = check_name(self.url, name)
        src = Path(src)
        size = src.stat().st_size

        def chunks() -> Iterator[bytes]:
            with open(src, "rb") as file:
                while block := file.read(self.chunk_bytes):
                    self._charge(len(block), priority, "out")
                    yield block

        self._retrying("put", name, lambda: self._put(key, src, size, chunks))

    def list(self, prefix: str = "") -> list[str]:
        """Names of every object under the source that start with `prefix`, sorted."""
        return self._retrying("list", prefix, lambda: sorted(n for n in self._list(prefix) if n.startswith(prefix)))

    # the retry loop

    def _retrying(self, op: str, name: str, attempt: Callable[[], _T]) -> _T:
        policy = self.retry_policy
        tries = 0
        while True:
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
            except Exception as exc:  # noqa: BLE001 - classified below, re-raised as SourceError
                if isinstance(exc, FileNotFoundError):
                    self._count("tierflow_source_failures_total", op, "operations that failed for good")
                    raise SourceNotFound(self.url, name, "no such object") from exc
                if not self._transient(exc) or tries > policy.retries:
                    self._count("tierflow_source_failures_total", op, "operations that failed for good")
                    raise SourceError(self.url, name, f"{op} failed: {_describe(exc)}", tries) from exc
                self._count("tierflow_source_retries_total", op, "attempts retried after a transient failure")
                time.sleep(policy.delay(tries - 1))
                continue
            if self.registry is not None:
                self.registry.histogram(
                    "tierflow_source_request_seconds", {"scheme": self.scheme, "op": op},
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
                "tierflow_source_bytes_total", {"scheme": self.scheme, "direction": direction},
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

    def _list(self, prefix: str) -> list[str]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


class LocalSource(RetryingSource):
    """A directory (a local disk, or a POSIX mount of a shared file system)."""

    scheme = "file"

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

    def _list(self, prefix: str) -> list[str]:
        start = self.root / prefix.rpartition("/")[0] if "/" in prefix else self.root
        names = []
        for directory, _, files in os.walk(start):
            for file in files:
                names.append(os.path.relpath(os.path.join(directory, file), self.root).replace(os.sep, "/"))
        return names

    def _transient(self, exc: BaseException) -> bool:
        if isinstance(exc, (PermissionError, IsADirectoryError, NotADirectoryError)):
            return False
        return isinstance(exc, OSError)  # EIO, ESTALE: what a network mount says when it hiccups


class S3Source(RetryingSource):
    """s3:// on AWS or any S3-compatible endpoint, through obstore (Rust, object_store).

    obstore's own retries are off: this class retries, so every retry is counted and a resumed
    download continues from its last byte. Credentials come from the AWS_* variables, else
    from boto3's chain (config files, SSO, instance roles) when boto3 is installed.

    obstore's runtime does not survive fork: a child forked after its parent used obstore
    hangs on its first request. Such a child (a DataLoader worker, typically) goes through
    s3fs instead, with a warning; a child forked before any obstore use keeps obstore.
    """

    scheme = "s3"

    def __init__(self, url: str, *, endpoint_url: str | None = None, **options: Any) -> None:
        super().__init__(url, **options)
        parts = urlsplit(url)
        if parts.scheme != "s3" or not parts.netloc:
            raise ValueError(f"{url!r} is not an s3://bucket[/prefix] URL")
        self.bucket = parts.netloc
        self.prefix = parts.path.strip("/")
        self.endpoint_url = (
            endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        )
        self._store: Any = None
        self._store_pid = -1
        self._fallback: FsspecSource | None = None
        self._fallback_pid = -1

    @property
    def store(self) -> Any:
        """This process's obstore client, made on first use and again in a forked child."""
        global _obstore_runtime_pid
        if self._store is None or self._store_pid != os.getpid():
            self._store = self._make_store()
            self._store_pid = os.getpid()
        _obstore_runtime_pid = os.getpid()
        return self._store

    def _forked_fallback(self) -> FsspecSource | None:
        """The s3fs twin of this source when obstore's runtime died in a fork, else None."""
        pid = os.getpid()
        if _obstore_runtime_pid is None or _obstore_runtime_pid == pid:
            return None
        if self._fallback is None or self._fallback_pid != pid:
            warnings.warn(
                f"{self.url}: process {pid} was forked after its parent used obstore, whose runtime does "
                "not survive fork; this process reads through s3fs (start workers with 'spawn' or "
                "'forkserver', or before the first remote read, to keep obstore)",
                stacklevel=4,
            )
            storage: dict[str, Any] = {"endpoint_url": self.endpoint_url} if self.endpoint_url else {}
            # botocore's own timeouts, as obstore has them: without, a peer that never answers
            # holds the reader for ever (our retries need an error to act on)
            storage["config_kwargs"] = {"connect_timeout": self.timeout, "read_timeout": self.timeout,
                                        "retries": {"max_attempts": 1}}
            self._fallback = FsspecSource(
                self.url, storage_options=storage, budget=self.budget, timeout=self.timeout,
                registry=self.registry, retry_policy=self.retry_policy, chunk_bytes=self.chunk_bytes,
            )
            self._fallback_pid = pid
        return self._fallback

    def _make_store(self) -> Any:
        from obstore.store import S3Store

        seconds = timedelta(seconds=self.timeout)
        client_options: dict[str, Any] = {
            "connect_timeout": seconds,
            "read_timeout": seconds,
            "timeout": timedelta(days=1),  # a whole-request limit would cut off large, slow downloads
        }
        options: dict[str, Any] = {}
        if self.endpoint_url:
            options["endpoint"] = self.endpoint_url
            if os.environ.get("AWS_ENDPOINT_URL_S3"):  # obstore would prefer it to `endpoint`
                options["aws_endpoint_url_s3"] = self.endpoint_url
            options["virtual_hosted_style_request"] = False
            client_options["allow_http"] = self.endpoint_url.startswith("http://")
        if not os.environ.get("AWS_REGION") and not os.environ.get("AWS_DEFAULT_REGION"):
            options["region"] = _boto3_region() or "us-east-1"
        provider = None if os.environ.get("AWS_ACCESS_KEY_ID") else _boto3_credentials()
        return S3Store(
            self.bucket,
            prefix=self.prefix or None,
            client_options=client_options,
            retry_config={"max_retries": 0, "retry_timeout": timedelta(seconds=self.timeout)},
            credential_provider=provider,
            **options,
        )

    def _head(self, key: str) -> int:
        if (fallback := self._forked_fallback()) is not None:
            return fallback._head(key)
        import obstore

        return int(obstore.head(self.store, key)["size"])

    def _get(self, key: str) -> bytes:
        if (fallback := self._forked_fallback()) is not None:
            return fallback._get(key)
        import obstore

        result = obstore.get(self.store, key)
        data = bytes(result.bytes())
        if len(data) != result.meta["size"]:
            raise TruncatedBody(f"body of {len(data)} bytes, object is {result.meta['size']}")
        return data

    def _get_range(self, key: str, offset: int, length: int) -> bytes:
        if (fallback := self._forked_fallback()) is not None:
            return fallback._get_range(key, offset, length)
        import obstore

        return bytes(obstore.get_range(self.store, key, start=offset, length=length))

    def _stream(self, key: str, offset: int) -> tuple[int, Iterator[Any]]:
        if (fallback := self._forked_fallback()) is not None:
            return fallback._stream(key, offset)
        import obstore

        options = {"range": {"offset": offset}} if offset else None
        result = obstore.get(self.store, key, options=options)  # type: ignore[arg-type]
        return int(result.meta["size"]), iter(result.stream(min_chunk_size=self.chunk_bytes))

    def _put(self, key: str, src: Path, size: int, chunks: Callable[[], Iterator[bytes]]) -> None:
        if (fallback := self._forked_fallback()) is not None:
            return fallback._put(key, src, size, chunks)
        import obstore

        if size <= MULTIPART_BYTES:
            obstore.put(self.store, key, b"".join(chunks()), use_multipart=False)
        else:
            obstore.put(self.store, key, chunks(), use_multipart=True, chunk_size=MULTIPART_BYTES, max_concurrency=4)

    def _list(self, prefix: str) -> list[str]:
        if (fallback := self._forked_fallback()) is not None:
            return fallback._list(prefix)
        import obstore

        directory = prefix.rpartition("/")[0] or None
        return [meta["path"] for batch in obstore.list(self.store, directory, chunk_size=1000) for meta in batch]

    def _transient(self, exc: BaseException) -> bool:
        from obstore.exceptions import GenericError

        if (fallback := self._forked_fallback()) is not None:
            return fallback._transient(exc)
        if super()._transient(exc):
            return True
        if not isinstance(exc, GenericError):
            return False
        status = _CLIENT_ERROR.search(str(exc))
        return status is None or status.group(1) in _RETRYABLE_CLIENT_STATUSES


class FsspecSource(RetryingSource):
    """Any fsspec URL (gs://, az://, http://, hdfs://, ...). Untested pass-through: fsspec and its
    backends do the I/O, this class adds the budget, the counting and its own retries."""

    def __init__(self, url: str, *, storage_options: dict[str, Any] | None = None, **options: Any) -> None:
        super().__init__(url, **options)
        self.scheme = urlsplit(url).scheme or "file"
        self.storage_options = dict(storage_options or {})
        self._fs: Any = None
        self._root = ""
        self._fs_pid = -1

    @property
    def fs(self) -> Any:
        """This process's filesystem object, made on first use and again in a forked child."""
        if self._fs is None or self._fs_pid != os.getpid():
            import fsspec.core

            self._fs, self._root = fsspec.core.url_to_fs(self.url, skip_instance_cache=True, **self.storage_options)
            self._root = self._root.rstrip("/")
            self._fs_pid = os.getpid()
        return self._fs

    def _path(self, key: str) -> str:
        self.fs  # resolves the root
        return f"{self._root}/{key}" if self._root else key

    def _head(self, key: str) -> int:
        return int(self.fs.size(self._path(key)))

    def _get(self, key: str) -> bytes:
        return bytes(self.fs.cat_file(self._path(key)))

    def _get_range(self, key: str, offset: int, length: int) -> bytes:
        return bytes(self.fs.cat_file(self._path(key), start=offset, end=offset + length))

    def _stream(self, key: str, offset: int) -> tuple[int, Iterator[bytes]]:
        read_size = max(self.chunk_bytes, MULTIPART_BYTES)
        file = self.fs.open(self._path(key), "rb", block_size=read_size, cache_type="none")
        size = int(file.size)
        file.seek(offset)

        def chunks() -> Iterator[bytes]:
            with file:
                while block := file.read(read_size):
                    yield block

        return size, chunks()

    def _put(self, key: str, src: Path, size: int, chunks: Callable[[], Iterator[bytes]]) -> None:
        with self.fs.open(self._path(key), "wb") as out:
            for block in chunks():
                out.write(block)

    def _list(self, prefix: str) -> list[str]:
        directory = prefix.rpartition("/")[0]
        start = f"{self._root}/{directory}".rstrip("/") if self._root else directory
        root = f"{self._root}/" if self._root else ""
        try:
            found = self.fs.find(start)
        except FileNotFoundError:
            return []
        return [path[len(root):] if path.startswith(root) else path for path in found]

    def _transient(self, exc: BaseException) -> bool:
        if super()._transient(exc):
            return True
        if isinstance(exc, (PermissionError, ValueError, KeyError, TypeError)):
            return False
        markers = ("Timeout", "Connection", "Throttl", "SlowDown", "IncompleteRead", "ResponseStreaming", "ServerError")
        text = f"{type(exc).__name__} {exc}"
        return any(marker in text for marker in markers) or re.search(r"\b5\d\d\b", text) is not None


def open_source(
    url: str,
    *,
    endpoint_url: str | None = None,
    budget: BandwidthBudget | None = None,
    retries: int = 5,
    timeout: float = 30.0,
    registry: MetricsRegistry | None = None,
    backend: str | None = None,
    storage_options: dict[str, Any] | None = None,
) -> RetryingSource:
    """The source for `url`: a path or file:// -> LocalSource, s3:// -> S3Source (obstore;
    `backend="fsspec"` for s3fs instead), anything else -> FsspecSource."""
    options: dict[str, Any] = {"budget": budget, "retries": retries, "timeout": timeout, "registry": registry}
    scheme = urlsplit(url).scheme if "://" in url else ""
    if scheme in ("", "file"):
        return LocalSource(urlsplit(url).path if scheme else url, **options)
    if scheme == "s3" and backend in (None, "obstore"):
        return S3Source(url, endpoint_url=endpoint_url, **options)
    if backend not in (None, "fsspec", "obstore"):
        raise ValueError(f"source {url}: unknown backend {backend!r} (obstore or fsspec)")
    storage = dict(storage_options or {})
    if scheme == "s3" and endpoint_url:
        storage.setdefault("endpoint_url", endpoint_url)
    return FsspecSource(url, storage_options=storage, **options)


def upload_dataset(local_dir: str | Path, url: str, *, priority: Priority = "low", **options: Any) -> int:
    """Publish a packed dataset: shards first, manifest last, so readers never see a manifest
    whose shards are missing. Shards already present with the right size are skipped (their
    names are their content). Returns the number of shards uploaded."""
    from tierflow.format.manifest import MANIFEST_NAME, Manifest

    local_dir = Path(local_dir)
    manifest = Manifest.load(local_dir)
    missing = [s.name for s in manifest.shards if not (local_dir / s.name).is_file()]
    if missing:
        raise FileNotFoundError(f"{local_dir}: manifest lists {len(missing)} shards not in the directory, e.g. {missing[0]}")
    source = open_source(url, **options)
    present = set(source.list("shard-"))
    uploaded = sum(upload_shard(source, local_dir / s.name, s.name, s.bytes, present, priority=priority)
                   for s in manifest.shards)
    source.upload(local_dir / MANIFEST_NAME, MANIFEST_NAME, priority=priority)
    return uploaded


def upload_shard(source: RetryingSource, path: Path, name: str, nbytes: int, present: set[str], *,
                 priority: Priority = "low") -> bool:
    """Upload one shard unless `present` (names listed at the source) has it at its size: a shard's
    name is its content, so an unfinished earlier upload's shards are kept, not sent again."""
    if name in present and source.size(name) == nbytes:
        return False
    source.upload(path, name, priority=priority)
    return True


def _describe(exc: BaseException) -> str:
    text = str(exc).split("\n\nDebug source:", 1)[0].strip()
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__


def _boto3_credentials() -> Any:
    """boto3's credential chain for obstore, or None when boto3 is absent or finds nothing."""
    try:
        import boto3
        from obstore.auth.boto3 import Boto3CredentialProvider
    except ImportError:
        return None
    session = boto3.Session()
    if session.get_credentials() is None:
        return None
    return Boto3CredentialProvider(session)


def _boto3_region() -> str | None:
    try:
        import boto3
    except ImportError:
        return None
    return boto3.Session().region_name
