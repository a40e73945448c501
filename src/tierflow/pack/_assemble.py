"""The parent side of a pack: the ordered batch stream cut into shards, compressed on threads.

Shard contents and order depend only on the batch stream, never on the threads, so a pack
is byte-identical whatever its number of workers.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from collections.abc import Callable

import pyarrow as pa

from tierflow.format.shard import ShardInfo
from tierflow.format.shard_writer import ShardWriter
from tierflow.pack.tokenize import PackInputError

#: shards compressing at once in the parent
SHARDS_IN_FLIGHT = 2
#: batches (blocks) waiting for a shard's writer thread: each pins part of a worker's scratch file
#: (the batches are views into it), so the queue bounds scratch space as well as memory
QUEUED_BATCHES = 2


class _ShardInFlight:
    """One shard written by a thread from a queue of batches.

    zstd releases the GIL, so while one shard is still compressing the next one's batches
    compress on another thread: the parent is no longer capped at one core of compression.
    The queue carries batches, then the shard's token count (close) or None (abort); it is
    bounded, so a writer slower than the workers holds them back instead of letting their
    scratch files pile up. A writer also ends, dropping its shard, once `stopped` is set: a Ctrl-C
    can land between the thread's start and the assembler's note of it, and a writer waiting on a
    queue no one holds would keep the interpreter from exiting.
    """

    def __init__(
        self,
        pool: ThreadPoolExecutor,
        out: Path,
        schema: pa.Schema,
        compression: str,
        level: int | None,
        token_column: str | None,
        stopped: threading.Event,
    ) -> None:
        self.batches: queue.Queue = queue.Queue(QUEUED_BATCHES)
        self.stopped = stopped
        self.mark: Any = None
        """What `on_cut` said when this shard was cut, handed to `on_sealed` once it is written."""
        self.future = pool.submit(self._write, out, schema, compression, level, token_column)

    def put(self, item: pa.RecordBatch | int | None) -> None:
        """Give the writer its next item, waiting for room; the writer's error if it failed."""
        while True:
            try:
                self.batches.put(item, timeout=0.05)
                return
            except queue.Full:
                if self.future.done():
                    self.future.result()
                    raise RuntimeError("a shard writer ended before its shard was closed") from None

    def _write(
        self, out: Path, schema: pa.Schema, compression: str, level: int | None, token_column: str | None
    ) -> ShardInfo | None:
        writer = ShardWriter(out, schema, compression, level, token_column=token_column)
        try:
            while True:
                try:
                    item = self.batches.get(timeout=0.1)
                except queue.Empty:
                    if not self.stopped.is_set():
                        continue
                    item = None
                if isinstance(item, pa.RecordBatch):
                    writer.write(item)
                elif item is None:
                    writer.abort()
                    return None
                else:
                    return writer.close(tokens=item)
        except BaseException:
            writer.abort()
            raise


class ShardAssembler:
    """Cuts the ordered batch stream into shards of the target size (slicing at row boundaries).

    Each batch goes to its shard's writer thread as it arrives, so compression runs while the
    workers parse the next units, and up to SHARDS_IN_FLIGHT consecutive shards compress at
    once. Shard contents and order depend only on the batch stream, never on the threads.
    `on_shard(path, info)` is told of each sealed shard in order (a remote pack uploads it), and
    may hold the assembler back: one open shard and SHARDS_IN_FLIGHT sealing ones are all it keeps.
    `on_cut()` is asked, as each shard is cut, where the stream stands (the pack's resume
    position); `on_sealed(info, that answer)` is told once the shard is on disk, in order.
    """

    def __init__(
        self,
        out: Path,
        target_bytes: int,
        compression: str,
        level: int | None,
        token_column: str | None,
        on_shard: Callable[[Path, ShardInfo], None] | None = None,
        on_cut: Callable[[], Any] | None = None,
        on_sealed: Callable[[ShardInfo, Any], None] | None = None,
    ) -> None:
        self.out = out
        self.on_shard = on_shard
        self.on_cut = on_cut
        self.on_sealed = on_sealed
        self.rows_appended = 0
        """Rows of the stream taken into shards so far (this run's, not a resumed pack's)."""
        self.target = target_bytes
        self.compression = compression
        self.level = level
        self.token_column = token_column
        self.schema: pa.Schema | None = None
        self.pending_bytes = 0
        self.pending_tokens = 0
        self.shards: list[ShardInfo] = []
        """Finished shards, in order (those still being written join it as they finish)."""
        self.unified: pa.Schema | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._open: _ShardInFlight | None = None
        self._closing: deque[_ShardInFlight] = deque()
        self._stopped = threading.Event()

    def add(self, batch: pa.RecordBatch) -> None:
        batch = self._conform(batch)
        while batch.num_rows:
            room = self.target - self.pending_bytes
            if batch.nbytes <= room:
                self._append(batch)
                return
            rows = min(batch.num_rows, room // max(1, batch.nbytes // batch.num_rows))
            if rows == 0:
                if self._open is not None:
                    self._end_shard()
                    continue
                rows = 1  # one sample larger than the target is a shard of its own
            self._append(batch.slice(0, rows))
            batch = batch.slice(rows)
            self._end_shard()

    def _append(self, batch: pa.RecordBatch) -> None:
        if self._open is None:
            while len(self._closing) >= SHARDS_IN_FLIGHT:
                self._collect_oldest()
            if self._pool is None:
                self._pool = ThreadPoolExecutor(SHARDS_IN_FLIGHT, thread_name_prefix="tierflow-shard")
            self._open = _ShardInFlight(
                self._pool, self.out, self.schema, self.compression, self.level, self.token_column, self._stopped
            )
        self._open.put(batch)
        self.rows_appended += batch.num_rows
        self.pending_bytes += batch.nbytes
        if self.token_column is not None:
            offsets = batch.column(self.token_column).offsets
            self.pending_tokens += offsets[-1].as_py() - offsets[0].as_py()
        while self._closing and self._closing[0].future.done():
            self._collect_oldest()

    def _end_shard(self) -> None:
        if self._open is None:
            return
        if self.on_cut is not None:
            self._open.mark = self.on_cut()
        self._open.put(self.pending_tokens)
        self._closing.append(self._open)
        self._open = None
        self.pending_bytes = self.pending_tokens = 0

    def _collect_oldest(self, sealed: bool = True) -> None:
        flight = self._closing.popleft()
        info = flight.future.result()
        if info is not None:
            self.shards.append(info)
            if sealed and self.on_shard is not None:
                self.on_shard(self.out / info.name, info)
            if sealed and self.on_sealed is not None:
                self.on_sealed(info, flight.mark)

    def resume(self, shards: list[ShardInfo], schema: pa.Schema) -> None:
        """Carry on after `shards`, sealed by an earlier run whose stream had `schema` at their end."""
        self.shards = list(shards)
        self.schema = self.unified = schema

    def _conform(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        if self.schema is None:
            self.schema = self.unified = batch.schema
            return batch
        if batch.schema.equals(self.schema):
            return batch
        if set(batch.schema.names) <= set(self.schema.names):
            try:
                arrays = []
                for f in self.schema:
                    idx = batch.schema.get_field_index(f.name)
                    col = batch.column(idx) if idx >= 0 else pa.nulls(batch.num_rows, f.type)
                    arrays.append(col if col.type == f.type else col.cast(f.type, safe=True))
                return pa.RecordBatch.from_arrays(arrays, schema=self.schema)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
                pass
        # a new column or a wider type: the schema grows, so the shard being built ends here
        self._end_shard()
        try:
            self.unified = pa.unify_schemas([self.unified, batch.schema], promote_options="permissive")
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
            raise PackInputError(_incompatible(self.unified, batch.schema, e)) from None
        self.schema = self.unified
        return self._conform(batch)

    def flush(self) -> None:
        """End the shard being assembled and wait until every shard is written."""
        self._end_shard()
        while self._closing:
            self._collect_oldest()
        self._shutdown()

    def abort(self) -> None:
        """Drop the shard being assembled; shards that finished meanwhile join `shards` for the caller."""
        self._stopped.set()
        if self._open is not None:
            try:
                self._open.put(None)
            except Exception:
                pass
            self._closing.append(self._open)
            self._open = None
        while self._closing:
            try:
                self._collect_oldest(sealed=False)
            except Exception:
                pass
        self._shutdown()

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


def _incompatible(before: pa.Schema, now: pa.Schema, error: Exception) -> str:
    """Which columns changed type, so the message says what to fix rather than Arrow's merge error."""
    changed = [
        f"column {f.name!r} is {f.type} here but {before.field(f.name).type} earlier in the input"
        for f in now
        if f.name in before.names and before.field(f.name).type != f.type
    ]
    return "; ".join(changed) or f"columns of incompatible types across the input ({error})"
