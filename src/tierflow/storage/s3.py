"""s3:// sources through obstore (Rust, object_store), on AWS or any S3-compatible endpoint.

Chosen over s3fs by measurement (benchmarks/sources.py): less client CPU per GB, and no
botocore pin that would downgrade a user's boto3.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from tierflow.errors import SourceError, SourceNotFound
from tierflow.storage.remote import MULTIPART_BYTES, ObjectEntry, RetryingStore, TruncatedBody

if TYPE_CHECKING:
    from obstore.store import ClientConfig

_obstore_runtime_pid: int | None = None  # the process whose obstore (tokio) runtime has started
_CLIENT_ERROR = re.compile(r"status code: (4\d\d)")
_RETRYABLE_CLIENT_STATUSES = {"408", "429"}
_STATUS = re.compile(r"status code: (\d{3}[^:]*)")
_XML_CODE = re.compile(r"<Code>([^<]+)</Code>")
_XML_MESSAGE = re.compile(r"<Message>([^<]+)</Message>")
_METADATA_MARKERS = ("169.254.169.254", "/latest/api/token", "/latest/meta-data/")
_CREDENTIAL_CODES = {
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
    "AllAccessDisabled",
}
CREDENTIALS_HINT = (
    "Set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (with AWS_SESSION_TOKEN for temporary ones), or "
    "AWS_PROFILE naming a profile of ~/.aws/config (read through boto3); for an S3-compatible store (MinIO, "
    'Ceph, R2) also its endpoint: endpoint_url=, --endpoint-url or AWS_ENDPOINT_URL_S3. See docs/scale-out.md, "Credentials for s3://"'
)


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= 200 else line[:197] + "..."


class S3Store(RetryingStore):
    """s3:// on AWS or any S3-compatible endpoint, through obstore (Rust, object_store).

    obstore's own retries are off: this class retries, so every retry is counted and a resumed
    download continues from its last byte. Credentials come from the AWS_* variables, else
    from boto3's chain (config files, SSO, instance roles) when boto3 is installed.

    obstore's runtime does not survive fork: a child forked after its parent used obstore
    would hang on its first request, so it gets a SourceError saying what to do instead (a
    child forked before any obstore use keeps obstore). Workers start with forkserver or spawn,
    and this class pickles without its client.
    """

    scheme = "s3"

    def __init__(self, url: str, *, endpoint_url: str | None = None, **options: Any) -> None:
        super().__init__(url, **options)
        parts = urlsplit(url)
        if parts.scheme != "s3" or not parts.netloc:
            raise ValueError(f"{url!r} is not an s3://bucket[/prefix] URL")
        self.bucket = parts.netloc
        self.prefix = parts.path.strip("/")
        self.endpoint_url = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        self._store: Any = None
        self._store_pid = -1

    @property
    def store(self) -> Any:
        """This process's obstore client, made on first use; refused in a child forked after obstore
        ran (its first request would hang for ever)."""
        global _obstore_runtime_pid
        pid = os.getpid()
        if _obstore_runtime_pid not in (None, pid):
            raise SourceError(
                self.url,
                "",
                f"process {pid} was forked after its parent used obstore, whose "
                "runtime does not survive fork; start DataLoader workers with "
                "multiprocessing_context='forkserver' or 'spawn' (tierflow's Loader does for "
                "object stores), or fork before the first remote read",
            )
        if self._store is None or self._store_pid != pid:
            self._store = self._make_store()
            self._store_pid = pid
        _obstore_runtime_pid = pid
        return self._store

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without its client (spawn/forkserver workers): the child makes its own on first use."""
        state = self.__dict__.copy()
        state.update(_store=None, _store_pid=-1)
        return state

    def _make_store(self) -> Any:
        from obstore.store import S3Store as ObstoreS3

        seconds = timedelta(seconds=self.timeout)
        client_options: ClientConfig = {
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
        return ObstoreS3(
            self.bucket,
            prefix=self.prefix or None,
            client_options=client_options,
            retry_config={"max_retries": 0, "retry_timeout": timedelta(seconds=self.timeout)},
            credential_provider=provider,
            **options,
        )

    def _head(self, key: str) -> int:
        import obstore

        return int(obstore.head(self.store, key)["size"])

    def _get(self, key: str) -> bytes:
        import obstore

        result = obstore.get(self.store, key)
        data = bytes(result.bytes())
        if len(data) != result.meta["size"]:
            raise TruncatedBody(f"body of {len(data)} bytes, object is {result.meta['size']}")
        return data

    def _get_range(self, key: str, offset: int, length: int) -> bytes:
        import obstore

        return bytes(obstore.get_range(self.store, key, start=offset, length=length))

    def _stream(self, key: str, offset: int) -> tuple[int, Iterator[Any]]:
        import obstore

        options = {"range": {"offset": offset}} if offset else None
        result = obstore.get(self.store, key, options=options)  # type: ignore[arg-type]
        return int(result.meta["size"]), iter(result.stream(min_chunk_size=self.chunk_bytes))

    def _put(self, key: str, src: Path, size: int, chunks: Callable[[], Iterator[bytes]]) -> None:
        import obstore

        if size <= MULTIPART_BYTES:
            obstore.put(self.store, key, b"".join(chunks()), use_multipart=False)
        else:
            obstore.put(self.store, key, chunks(), use_multipart=True, chunk_size=MULTIPART_BYTES, max_concurrency=4)

    def _entries(self, prefix: str) -> list[ObjectEntry]:
        import obstore

        directory = prefix.rpartition("/")[0] or None
        return [
            ObjectEntry(meta["path"], int(meta["size"]), meta["last_modified"].timestamp())
            for batch in obstore.list(self.store, directory, chunk_size=1000)
            for meta in batch
        ]

    def _delete(self, key: str) -> None:
        import obstore

        obstore.delete(self.store, key)

    def _retrying(self, op: str, name: str, attempt: Callable[[], Any], deadline: Any = None) -> Any:
        """The shared retry loop, its final error said in S3's terms (see `_explain`)."""
        try:
            return super()._retrying(op, name, attempt, deadline)
        except SourceNotFound:
            if self._bucket_missing():  # a 404 on HEAD has no body: NoSuchBucket and NoSuchKey look alike
                raise SourceError(self.url, name, self._no_bucket()) from None
            raise
        except SourceError as e:
            reason = None if e.__cause__ is None else self._explain(e.__cause__)
            if reason is None:
                raise
            raise type(e)(self.url, name, f"{op} failed: {reason}", e.attempts) from e.__cause__

    def _bucket_missing(self) -> bool:
        """Whether the bucket itself does not exist (one listing request, asked once an object was not found)."""
        if getattr(self, "_bucket_seen", False):
            return False
        import obstore

        try:
            next(iter(obstore.list(self.store, None, chunk_size=1)), None)
        except Exception as e:
            return "NoSuchBucket" in str(e)
        self._bucket_seen = True
        return False

    def _no_bucket(self) -> str:
        where = f" at {self.endpoint_url}" if self.endpoint_url else ""
        return (
            f"bucket {self.bucket!r} does not exist{where}; check the bucket's name in the URL "
            f"(s3://BUCKET/prefix) and the endpoint (endpoint_url=, --endpoint-url or AWS_ENDPOINT_URL_S3)"
        )

    def _explain(self, exc: BaseException) -> str | None:
        """What an obstore error means for the user, or None to keep tierflow's generic description:
        S3's XML reduced to its code and message; a missing bucket or missing or refused
        credentials with what to set."""
        text = str(exc)
        if any(marker in text for marker in _METADATA_MARKERS):
            detail = _first_line(text.split(" - ", 1)[-1])
            at = " (169.254.169.254)" if "169.254.169.254" in text else ""
            return (
                f"no S3 credentials found, so the client asked the EC2 instance metadata service{at}, "
                f"which failed ({detail}). " + CREDENTIALS_HINT
            )
        code = _XML_CODE.search(text)
        if code is None:
            return None
        message = _XML_MESSAGE.search(text)
        said = f"{code.group(1)}: {message.group(1).strip().rstrip('.')}" if message else code.group(1)
        status = _STATUS.search(text)
        said = f"{status.group(1).strip()}: {said}" if status else said
        if code.group(1) == "NoSuchBucket":
            return self._no_bucket()
        if code.group(1) in _CREDENTIAL_CODES:
            return f"{said}. The credentials were refused: " + CREDENTIALS_HINT
        return said

    def _transient(self, exc: BaseException) -> bool:
        from obstore.exceptions import GenericError

        if any(marker in str(exc) for marker in _METADATA_MARKERS):
            return False  # no credentials: asking the metadata service again will not find any
        if super()._transient(exc):
            return True
        if not isinstance(exc, GenericError):
            return False
        status = _CLIENT_ERROR.search(str(exc))
        return status is None or status.group(1) in _RETRYABLE_CLIENT_STATUSES


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
