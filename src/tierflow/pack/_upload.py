"""Pack straight to an object store: each shard leaves the local disk as soon as it is sealed.

A 10 TB pack needs room for a few shards, not 10 TB: at most UPLOADS_IN_FLIGHT shards upload
at once, and a shard sealed while they do waits for the oldest, which holds the packer back.
The manifest goes last, after every shard is in place, so a pack that fails or is killed at
any point publishes nothing a reader would open (its shards are content-named orphans, which
the next pack of the same data finds and does not send again).
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tierflow.format.shard import SHARD_PREFIX, ShardInfo
from tierflow.storage.remote import RetryingStore, publish_metadata, upload_shard

UPLOADS_IN_FLIGHT = 2


class ShardUploader:
    """The packer's `on_shard` hook for a remote `out`: uploads each sealed shard, then deletes it."""

    def __init__(self, source: RetryingStore, in_flight: int = UPLOADS_IN_FLIGHT) -> None:
        self.source = source
        self.in_flight = in_flight
        self.present = set(source.list(SHARD_PREFIX))
        self.uploaded = 0
        self._pool = ThreadPoolExecutor(in_flight, thread_name_prefix="tierflow-upload")
        self._pending: deque[Future[bool]] = deque()

    def __call__(self, path: Path, info: ShardInfo) -> None:
        """Start uploading a sealed shard; waits while `in_flight` uploads are still going."""
        while self._pending and (len(self._pending) >= self.in_flight or self._pending[0].done()):
            self._collect()
        self._pending.append(self._pool.submit(self._upload, path, info))

    def _upload(self, path: Path, info: ShardInfo) -> bool:
        sent = upload_shard(self.source, path, info.name, info.bytes, self.present)
        path.unlink()
        return sent

    def _collect(self) -> None:
        self.uploaded += self._pending.popleft().result()

    def publish(self, directory: Path) -> None:
        """Wait for every shard, then upload the manifest: the dataset exists from this moment. A
        manifest PUT whose answer is lost is checked at the store before the pack fails (`publish`)."""
        while self._pending:
            self._collect()
        publish_metadata(self.source, directory)

    def __enter__(self) -> ShardUploader:
        return self

    def __exit__(self, *exc: Any) -> None:
        """On failure, uploads not started are dropped and those running end; errors are the pack's."""
        for future in self._pending:
            future.cancel()
        self._pool.shutdown(wait=True)
