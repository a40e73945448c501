"""Any other fsspec URL (gs://, az://, http://, hdfs://, ...): an untested pass-through to fsspec."""

from __future__ import annotations

import os
import re
from datetime import datetime
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from tierflow.storage.remote import MULTIPART_BYTES, ObjectEntry, RetryingStore


class FsspecStore(RetryingStore):
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

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without its filesystem object: the child makes its own on first use."""
        state = self.__dict__.copy()
        state.update(_fs=None, _fs_pid=-1)
        return state

    def _path(self, key: str) -> str:
        _ = self.fs  # resolves the root
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

    def _entries(self, prefix: str) -> list[ObjectEntry]:
        directory = prefix.rpartition("/")[0]
        start = f"{self._root}/{directory}".rstrip("/") if self._root else directory
        root = f"{self._root}/" if self._root else ""
        try:
            found = self.fs.find(start, detail=True)
        except FileNotFoundError:
            return []
        return [
            ObjectEntry(
                path[len(root) :] if path.startswith(root) else path, int(info.get("size") or 0), _modified(info)
            )
            for path, info in found.items()
        ]

    def _delete(self, key: str) -> None:
        self.fs.rm_file(self._path(key))

    def _transient(self, exc: BaseException) -> bool:
        if super()._transient(exc):
            return True
        if isinstance(exc, (PermissionError, ValueError, KeyError, TypeError)):
            return False
        markers = ("Timeout", "Connection", "Throttl", "SlowDown", "IncompleteRead", "ResponseStreaming", "ServerError")
        text = f"{type(exc).__name__} {exc}"
        return any(marker in text for marker in markers) or re.search(r"\b5\d\d\b", text) is not None


def _modified(info: dict[str, Any]) -> float | None:
    """An fsspec listing's modification time as Unix seconds (backends name and type it their own way)."""
    for field in ("mtime", "LastModified", "last_modified", "updated"):
        value = info.get(field)
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, str):
            try:
                return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return None
