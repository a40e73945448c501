"""Random access to a packed dataset: a sample is an index lookup and a slice of a mapped buffer.

`open_dataset(path)` gives `len()`, `ds[i]` (a dict of columns; token and other primitive
list columns as numpy views, no copy), iteration, and `ds.tokens(start, stop)` over the
concatenated token stream. Where shards come from is a `ShardSource`: by default the dataset
directory itself (decoding compressed shards into memory); the tier stack supplies decoded,
memory-mapped files instead.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.types as pat

from tierflow.format.manifest import Manifest
from tierflow.format.shard import ShardCorruptError, ShardInfo, verify_shard


class ShardSource(Protocol):
    """Supplies the record batches of a shard; the tier stack is one, a plain directory another."""

    def open_shard(self, index: int, info: ShardInfo) -> "ShardTable": ...


class ShardTable:
    """One shard's record batches with per-column numpy views cached on first use."""

    def __init__(self, batches: Sequence[pa.RecordBatch], keepalive: Any = None) -> None:
        self.batches = list(batches)
        self._keepalive = keepalive  # the memory map the batches point into
        rows = [b.num_rows for b in self.batches]
        self.row_starts = np.concatenate([[0], np.cumsum(rows, dtype=np.int64)])
        self._columns: dict[tuple[int, str], Callable[[int], Any]] = {}

    @classmethod
    def from_ipc_file(cls, path: str | Path, memory_map: bool = True) -> "ShardTable":
        """Decoded files are memory-mapped (zero copy); compressed ones decode into memory."""
        source = pa.memory_map(str(path)) if memory_map else pa.OSFile(str(path))
        reader = pa.ipc.open_file(source)
        batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
        return cls(batches, keepalive=source)

    @property
    def num_rows(self) -> int:
        return int(self.row_starts[-1])

    def locate(self, row: int) -> tuple[int, int]:
        b = int(np.searchsorted(self.row_starts, row, side="right")) - 1
        return b, row - int(self.row_starts[b])

    def getter(self, batch: int, name: str) -> Callable[[int], Any]:
        key = (batch, name)
        g = self._columns.get(key)
        if g is None:
            rb = self.batches[batch]
            idx = rb.schema.get_field_index(name)
            g = _null_getter if idx < 0 else _column_getter(rb.column(idx))
            self._columns[key] = g
        return g

    def row(self, row: int, names: Sequence[str]) -> dict[str, Any]:
        b, r = self.locate(row)
        return {name: self.getter(b, name)(r) for name in names}

    def list_parts(self, batch: int, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(offsets, values) numpy views of a list column of one batch."""
        arr = self.batches[batch].column(name)
        return _list_offsets(arr), arr.values.to_numpy(zero_copy_only=True)


def _null_getter(_: int) -> None:
    return None


def _list_offsets(arr: pa.Array) -> np.ndarray:
    return arr.offsets.to_numpy(zero_copy_only=True)


def _column_getter(arr: pa.Array) -> Callable[[int], Any]:
    """A fast per-row accessor for one column of one record batch."""
    t = arr.type
    valid = None
    if arr.null_count:
        valid = arr.is_valid().to_numpy(zero_copy_only=False)

    def guarded(f: Callable[[int], Any]) -> Callable[[int], Any]:
        if valid is None:
            return f
        return lambda r: f(r) if valid[r] else None

    if (pat.is_list(t) or pat.is_large_list(t)) and (
            pat.is_integer(t.value_type) or pat.is_floating(t.value_type)) and arr.values.null_count == 0:
        offsets = _list_offsets(arr)
        values = arr.values.to_numpy(zero_copy_only=True)
        return guarded(lambda r: values[offsets[r]:offsets[r + 1]])
    if pat.is_string(t) or pat.is_binary(t) or pat.is_large_string(t) or pat.is_large_binary(t):
        off_type = np.int64 if (pat.is_large_string(t) or pat.is_large_binary(t)) else np.int32
        bufs = arr.buffers()
        offsets = np.frombuffer(bufs[1], dtype=off_type)[arr.offset:arr.offset + len(arr) + 1]
        data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
        if pat.is_string(t) or pat.is_large_string(t):
            return guarded(lambda r: data[offsets[r]:offsets[r + 1]].tobytes().decode("utf-8"))
        return guarded(lambda r: data[offsets[r]:offsets[r + 1]].tobytes())
    if (pat.is_integer(t) or pat.is_floating(t) or pat.is_boolean(t)) and valid is None and not pat.is_boolean(t):
        values = arr.to_numpy(zero_copy_only=True)
        return lambda r: values[r].item()
    return lambda r: arr[r].as_py()


class DirectorySource:
    """Shards read straight from the dataset directory, each verified once per process.

    Uncompressed shards are memory-mapped and stay open (a mapping costs address space, not
    memory: the page cache holds the bytes), so a shuffled order that revisits shards never
    re-verifies them. Compressed shards decode into memory, so those are kept in an LRU bounded
    by `max_decoded_bytes`; one that falls out is decoded again but not re-verified. Verifying a
    shard costs one pass at ~17 GB/s (xxh3), far less than decoding it, so wrong bytes are never
    served even without a tier stack.
    """

    def __init__(self, root: str | Path, max_decoded_bytes: int = 1 << 30) -> None:
        self.root = Path(root)
        self.max_decoded_bytes = max_decoded_bytes
        self._mapped: dict[int, ShardTable] = {}
        self._decoded: OrderedDict[int, tuple[ShardTable, int]] = OrderedDict()
        self._decoded_bytes = 0
        self._verified: set[str] = set()
        self._lock = threading.Lock()
        self.opens = 0
        """Shard files opened so far (a count that stays at the shard count means no thrash)."""

    def open_shard(self, index: int, info: ShardInfo) -> ShardTable:
        with self._lock:
            table = self._mapped.get(index)
            if table is not None:
                return table
            found = self._decoded.get(index)
            if found is not None:
                self._decoded.move_to_end(index)
                return found[0]
        path = self.root / info.name
        if info.name not in self._verified:
            problems = verify_shard(path, info)
            if problems:
                raise ShardCorruptError("; ".join(problems))
        mapped = info.compression == "none"
        table = ShardTable.from_ipc_file(path, memory_map=mapped)
        with self._lock:
            self._verified.add(info.name)
            self.opens += 1
            if mapped:
                return self._mapped.setdefault(index, table)
            if index not in self._decoded:
                size = int(info.decoded_bytes or 0)
                self._decoded[index] = (table, size)
                self._decoded_bytes += size
                while self._decoded_bytes > self.max_decoded_bytes and len(self._decoded) > 1:
                    _, (_, dropped) = self._decoded.popitem(last=False)
                    self._decoded_bytes -= dropped
            return self._decoded[index][0]


class Dataset:
    """A packed dataset opened for reading; thread-safe for concurrent readers."""

    def __init__(self, manifest: Manifest, source: ShardSource, columns: Sequence[str] | None = None,
                 location: str = "") -> None:
        self.manifest = manifest
        self.source = source
        self.location = location
        names = manifest.schema.names
        if columns is not None:
            unknown = [c for c in columns if c not in names]
            if unknown:
                raise KeyError(f"{location}: no column(s) {unknown}; the dataset has {names}")
        self.columns = list(columns) if columns is not None else list(names)
        self.sample_starts = np.concatenate(
            [[0], np.cumsum([s.samples for s in manifest.shards], dtype=np.int64)])
        self.token_starts = np.concatenate(
            [[0], np.cumsum([s.tokens for s in manifest.shards], dtype=np.int64)])
        self._token_batch_starts: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return int(self.sample_starts[-1])

    def __repr__(self) -> str:
        return (f"Dataset({self.location!r}, samples={len(self)}, shards={len(self.manifest.shards)}, "
                f"columns={self.columns})")

    def locate(self, index: int) -> tuple[int, int]:
        """Global sample index -> (shard index, row in shard)."""
        if not 0 <= index < len(self):
            raise IndexError(f"{self.location}: sample {index} out of range [0, {len(self)})")
        s = int(np.searchsorted(self.sample_starts, index, side="right")) - 1
        return s, index - int(self.sample_starts[s])

    def shard(self, s: int) -> ShardTable:
        return self.source.open_shard(s, self.manifest.shards[s])

    def __getitem__(self, index: int) -> dict[str, Any]:
        if index < 0:
            index += len(self)
        s, row = self.locate(index)
        return self.shard(s).row(row, self.columns)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for s in range(len(self.manifest.shards)):
            table = self.shard(s)
            for row in range(table.num_rows):
                yield table.row(row, self.columns)

    @property
    def num_tokens(self) -> int:
        return int(self.token_starts[-1])

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the concatenated stream; a view when inside one block."""
        column = self.manifest.token_column
        if column is None:
            raise TypeError(f"{self.location}: not a token dataset (packed without --tokenizer)")
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"{self.location}: tokens [{start}, {stop}) outside [0, {self.num_tokens})")
        pieces = []
        pos = start
        while pos < stop:
            s = int(np.searchsorted(self.token_starts, pos, side="right")) - 1
            table = self.shard(s)
            batch_starts = self._batch_token_starts(s, table, column)
            local = pos - int(self.token_starts[s])
            b = int(np.searchsorted(batch_starts, local, side="right")) - 1
            offsets, values = table.list_parts(b, column)
            begin = int(offsets[0]) + local - int(batch_starts[b])
            take = min(stop - pos, int(batch_starts[b + 1]) - local)
            pieces.append(values[begin:begin + take])
            pos += take
        if len(pieces) == 1:
            return pieces[0]
        if not pieces:
            return np.zeros(0, dtype=self.manifest.token_dtype or np.uint16)
        return np.concatenate(pieces)

    def _batch_token_starts(self, s: int, table: ShardTable, column: str) -> np.ndarray:
        starts = self._token_batch_starts.get(s)
        if starts is None:
            counts = []
            for b in range(len(table.batches)):
                offsets = _list_offsets(table.batches[b].column(column))
                counts.append(int(offsets[-1] - offsets[0]))
            starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
            self._token_batch_starts[s] = starts
        return starts


def open_dataset(path: str | Path, columns: Sequence[str] | None = None) -> Dataset:
    """Open a packed dataset directory for random access by global sample index."""
    manifest = Manifest.load(path)
    return Dataset(manifest, DirectorySource(path), columns=columns, location=str(path))
