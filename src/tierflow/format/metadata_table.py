"""One mapped metadata table (format/metadata.py): an uncompressed Arrow IPC file whose columns are
read-only numpy views of the mapping, hashed and checked a chunk of rows at a time, the first time a
row of the chunk is handed out, so a process pays for the rows it uses, not for the table."""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import xxhash

from tierflow.errors import ManifestError
from tierflow.format.table_locks import HeldTable


def distinct(values: np.ndarray) -> np.ndarray:
    """The sorted distinct values (np.unique imports numpy.ma the first time, ~13 ms of a start)."""
    values = np.sort(values)
    return values[np.concatenate(([True], values[1:] != values[:-1]))] if values.size else values


def column_dtype(kind: pa.DataType) -> Any:
    return np.dtype("V16") if pa.types.is_fixed_size_binary(kind) else np.dtype(kind.to_pandas_dtype())


def column_digest(values: np.ndarray | memoryview | pa.Buffer) -> str:
    if isinstance(values, pa.Buffer):
        return xxhash.xxh3_128_hexdigest(values)
    view = values.data if isinstance(values, np.ndarray) else values
    return xxhash.xxh3_128_hexdigest(view.cast("B"))


class ChunkPlan(NamedTuple):
    """How a table is hashed a chunk at a time: the rows a chunk holds and, per column, each chunk's
    xxh3-128 (16 bytes a chunk) from where they are kept: the chunk table, or a header written
    before it (`inline_plan`)."""

    rows: int
    hashes: Callable[[str], np.ndarray]
    kept_in: str = "the header"


def inline_plan(entry: dict) -> ChunkPlan:
    """The plan a table's header entry holds: its `chunks` as hex lists (as written before the chunk
    table), or, written before chunks, one chunk of every row hashed as the column's whole hash."""
    chunks = entry.get("chunks")
    if chunks is None:
        rows = max(entry["rows"], 1)
        listed = {name: [h] if entry["rows"] else [] for name, h in entry["columns"].items()}
    else:
        rows, listed = chunks["rows"], chunks["columns"]
    decoded: dict[str, np.ndarray] = {}

    def hashes(name: str) -> np.ndarray:
        found = decoded.get(name)
        if found is None:
            found = decoded[name] = np.frombuffer(bytes.fromhex("".join(listed[name])), dtype="V16")
        return found

    return ChunkPlan(rows, hashes)


class MappedTable:
    """One mapped IPC table: columns as numpy views into the mapping, each chunk of a column (its
    `plan`) hashed the first time a row of it is handed out, and checked by `check` (chunk number,
    first row, the chunk's values) -> a problem or None."""

    def __init__(
        self, directory: Path, entry: dict, schema: pa.Schema, where: str, plan: ChunkPlan | None = None
    ) -> None:
        self.path = directory / entry["file"]
        self.where = f"{where}: {entry['file']}"
        self.rows = entry["rows"]
        self.hashes = entry["columns"]
        self.plan = inline_plan(entry) if plan is None else plan
        self.chunk_rows = self.plan.rows
        self.chunk_count = -(-self.rows // self.chunk_rows)
        self.schema = schema
        held = HeldTable(self.path, self.where)
        fd = held.fd
        size = os.fstat(fd).st_size
        try:
            if size != entry["size"]:
                raise ManifestError(
                    f"{self.where}: {size} bytes, the header says {entry['size']} (damaged or replaced)"
                )
            # Python's mapping, not pa.memory_map: Arrow advises the kernel to read ahead every range it
            # is asked for, the whole body at get_batch (~0.15 ms of a 1.4 GB table already cached)
            self._map = pa.py_buffer(mmap.mmap(fd, size, prot=mmap.PROT_READ))
            reader = pa.ipc.open_file(pa.BufferReader(self._map))
            if reader.num_record_batches != 1:
                raise ValueError(f"{reader.num_record_batches} record batches, not 1")
            batch = reader.get_batch(0)
            if not batch.schema.equals(schema):
                raise ValueError(f"its schema is not the {len(schema)} columns of this format")
            if batch.num_rows != self.rows:
                raise ValueError(f"{batch.num_rows} rows, the header says {self.rows}")
            batch.validate()
        except ManifestError:
            held.close()
            raise
        except Exception as e:
            held.close()
            raise ManifestError(f"{self.where}: not a readable metadata table ({type(e).__name__}: {e})") from None
        self._held = held  # its shared lock keeps gc from removing the table while this process reads it
        self._batch = batch
        self._raw: dict[str, np.ndarray] = {}
        self._verified: dict[str, np.ndarray] = {}  # per column, a flag per chunk
        self._whole: dict[str, np.ndarray] = {}
        self._lock = threading.RLock()  # a chunk's check may use another column of the table

    def raw(self, name: str) -> np.ndarray:
        """The column as a read-only numpy view of the mapping, not yet hashed."""
        found = self._raw.get(name)
        if found is not None:
            return found
        arr = self._batch.column(name)
        if arr.null_count:
            raise ManifestError(f"{self.where}: column {name} has nulls")
        kind = column_dtype(arr.type)
        buf = arr.buffers()[1]
        if buf is None or not self.rows:
            view = np.zeros(0, dtype=kind)
        else:
            view = np.frombuffer(buf, dtype=kind, count=len(arr) + arr.offset)[arr.offset :]
        self._raw[name] = view
        return view

    def read(self, name: str, start: int, stop: int, into: np.ndarray | None = None) -> np.ndarray:
        """Rows [start, stop) of a column read from the file (pread), not through the mapping: a pass
        over a whole table (verify) keeps its memory to a chunk instead of mapping every page. `into`
        (of the column's dtype, at least that many rows): read into it, its first rows returned, so a
        pass reuses its buffers instead of faulting in fresh pages for every read."""
        arr = self._batch.column(name)
        kind = column_dtype(arr.type)
        buf = arr.buffers()[1]
        if buf is None or stop <= start:
            return np.zeros(0, dtype=kind)
        base = self._map_base()
        offset = buf.address - base + (arr.offset + start) * kind.itemsize
        size = (stop - start) * kind.itemsize
        if not 0 <= offset <= offset + size <= os.fstat(self._fd()).st_size:
            raise ManifestError(f"{self.where}: column {name} lies outside the file")
        if into is None:
            into = np.empty(stop - start, dtype=kind)
        assert into.dtype == kind and into.nbytes >= size
        values = into[: stop - start]
        if os.preadv(self._fd(), [values.data.cast("B")], offset) != size:
            raise ManifestError(f"{self.where}: column {name} is cut short")
        return values

    def _map_base(self) -> int:
        return self._map.address

    def _fd(self) -> int:
        return self._held.fd

    def column(self, name: str, check: ChunkCheck | None = None) -> np.ndarray:
        """The whole column, every chunk verified."""
        found = self._whole.get(name)
        if found is not None:
            return found
        values = self.span(name, 0, self.rows, check)
        self._whole[name] = values
        return values

    def span(self, name: str, start: int, stop: int, check: ChunkCheck | None = None) -> np.ndarray:
        """Rows [start, stop) of a column, the chunks they lie in verified."""
        if stop > start:
            self._verify(name, range(start // self.chunk_rows, (stop - 1) // self.chunk_rows + 1), check)
        return self.raw(name)[start:stop]

    def at(self, name: str, rows: np.ndarray, check: ChunkCheck | None = None) -> np.ndarray:
        """The column's values at `rows` (in range), the chunks they lie in verified."""
        rows = np.asarray(rows, dtype=np.int64)
        flags = self._verified.get(name)
        if rows.size and (flags is None or not flags.all()):
            chunks = self.chunk_count
            self._verify(name, range(chunks) if chunks == 1 else distinct(rows // self.chunk_rows).tolist(), check)
        return self.raw(name)[rows]

    def search(self, name: str, positions: np.ndarray, check: ChunkCheck | None = None) -> np.ndarray:
        """The row each of `positions` (in range) lies in by the column's running sums (the last row
        whose value is <= it): a binary search over the mapped column, whose answer is decided by the
        row it lands on and the next; those are verified, so a lookup hashes the chunks it lands in,
        not the column, and a damaged row that decided a landing is refused."""
        row = self.raw(name).searchsorted(positions, side="right") - 1
        if positions.size:
            decided = distinct(np.concatenate([row, row + 1]))
            self.at(name, decided[(decided >= 0) & (decided < self.rows)], check)
        return row

    def value(self, name: str, row: int, check: ChunkCheck | None = None) -> Any:
        flags = self._verified.get(name)
        c = row // self.chunk_rows
        if flags is None or not flags[c]:
            self._verify(name, (c,), check)
        return self.raw(name)[row]

    def _verify(self, name: str, chunks: Iterable[int], check: ChunkCheck | None) -> None:
        flags = self._verified.get(name)
        if flags is not None and all(flags[c] for c in chunks):
            return
        with self._lock:
            flags = self._verified.get(name)
            if flags is None:
                flags = self._verified[name] = np.zeros(self.chunk_count, dtype=bool)
            values, step = self.raw(name), self.chunk_rows
            for c in chunks:
                if flags[c]:
                    continue
                part = values[c * step : (c + 1) * step]
                mismatch = self.hash_mismatch(name, c, part.data.cast("B"))
                if mismatch is not None:
                    raise ManifestError(mismatch)
                problem = check(c, c * step, part) if check is not None else None
                if problem is not None:
                    raise ManifestError(f"{self.where}: {problem}")
                flags[c] = True

    def hash_mismatch(self, name: str, c: int, data: memoryview) -> str | None:
        """Chunk c of a column, its bytes `data` (from the mapping, or read by a pass over the table),
        against its hash where the plan keeps it: the problem naming the file and rows, or None."""
        if xxhash.xxh3_128_digest(data) == self.plan.hashes(name)[c].tobytes():
            return None
        step = self.chunk_rows
        what = (
            f"column {name}"
            if self.chunk_count == 1
            else f"column {name}, rows {c * step}-{min((c + 1) * step, self.rows) - 1},"
        )
        return (
            f"{self.where}: {what} does not match its hash in {self.plan.kept_in} "
            f"(damaged or edited; run `tierflow upgrade` again, or restore it)"
        )


ChunkCheck = Callable[[int, int, np.ndarray], "str | None"]
"""A table's check of one chunk of a column: (chunk number, its first row, its values) -> a problem."""


class ShardRows:
    """A shard-table column indexed by shard (an int, a slice, an array of them), its chunks checked as
    they are read: what the order takes for a per-shard column it reads a few partitions of
    (`per_shard`), instead of the whole column checked at a start."""

    per_shard = True

    def __init__(self, table: MappedTable, name: str, check: ChunkCheck, manifest: Any) -> None:
        self.table, self.name, self.check = table, name, check
        self._manifest = None if manifest is None else weakref.ref(manifest)
        self.count = table.rows

    @property
    def manifest(self) -> Any:
        """The MappedManifest it reads (weakly: a manifest keeps its stored layouts, which hold these)."""
        return None if self._manifest is None else self._manifest()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rows_of, (self.manifest, self.name))  # the manifest pickles as its directory

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, shards: Any) -> Any:
        if isinstance(shards, slice):
            start, stop, step = shards.indices(self.count)
            if step == 1:
                return self.table.span(self.name, start, max(start, stop), self.check)
            shards = np.arange(start, stop, step)
        if isinstance(shards, (int, np.integer)):
            return self.table.value(self.name, int(shards), self.check)
        return self.table.at(self.name, np.asarray(shards, dtype=np.int64), self.check)


def _rows_of(manifest: Any, name: str) -> ShardRows:
    return manifest.tables.rows(name)
