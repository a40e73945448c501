"""Raw inputs -> units of work -> record batches.

A *unit* is a piece of input fixed by the data alone (a byte range of a JSONL file, a
Parquet row group, a group of small files, a chunk of records), never by the number of
workers, so the packed output is byte-identical whatever the parallelism.
"""

from __future__ import annotations

import fnmatch
import gzip
import io
import itertools
import json
import os
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.json as pajson
import pyarrow.parquet as pq
import zstandard

from tierflow.pack.tokenize import PackInputError

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
COMPRESSED_SUFFIXES = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp", ".tif", ".tiff")
KINDS = ("auto", "jsonl", "parquet", "files", "images")


@dataclass
class Unit:
    """One piece of input a worker turns into record batches."""

    index: int
    kind: str
    path: str
    start: int = 0
    end: int = -1
    members: Sequence[str] = ()
    records: list | None = None
    input_bytes: int = 0


@dataclass
class UnitStats:
    samples: int = 0
    files: int = 0
    kept_as_bytes: int = 0
    skipped_records: int = 0
    filtered: int = 0
    errors: list[str] = field(default_factory=list)

    def merge(self, other: "UnitStats") -> None:
        self.samples += other.samples
        self.files += other.files
        self.kept_as_bytes += other.kept_as_bytes
        self.skipped_records += other.skipped_records
        self.filtered += other.filtered
        self.errors.extend(other.errors[: max(0, 50 - len(self.errors))])


@dataclass
class SourceOptions:
    text_field: str = "text"
    kind: str = "auto"
    include: Sequence[str] = ()
    exclude: Sequence[str] = ()
    on_error: str = "raise"
    chunk_bytes: int = 16 << 20
    files_per_unit: int = 2048
    records_per_unit: int = 1024


# ---------------------------------------------------------------- planning


def _compression(path: str) -> str | None:
    return COMPRESSED_SUFFIXES.get(Path(path).suffix.lower())


def _base_suffix(path: str) -> str:
    p = Path(path)
    if p.suffix.lower() in COMPRESSED_SUFFIXES:
        p = p.with_suffix("")
    return p.suffix.lower()


def source_kind(path: str, options: SourceOptions) -> str:
    if options.kind != "auto":
        return options.kind
    if os.path.isdir(path):
        for i, rel in enumerate(walk_files(path, options)):
            if rel.lower().endswith(IMAGE_SUFFIXES):
                return "images"
            if i >= 1000:
                break
        return "files"
    suffix = _base_suffix(path)
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    if suffix == ".parquet":
        return "parquet"
    raise PackInputError(f"{path}: unknown source type (expected .jsonl[.gz|.zst], .parquet or a directory)")


def walk_files(root: str, options: SourceOptions) -> Iterator[str]:
    """Relative paths of regular files under root, in a sorted, deterministic order."""
    return (rel for rel, _ in walk_file_entries(root, options))


def walk_file_entries(root: str, options: SourceOptions) -> Iterator[tuple[str, os.DirEntry]]:
    """(relative path, directory entry) of regular files under root, in walk_files' order.

    A directory's files come before its subdirectories, each sorted by name; symlinked
    directories are not entered. Entries carry their type and cache their stat, so a tree
    of many small files costs one listing per directory and one stat per file.
    """
    include = _matcher(tuple(options.include)) if options.include else None
    exclude = _matcher(tuple(options.exclude)) if options.exclude else None

    def excluded(rel: str, name: str) -> bool:
        return exclude is not None and bool(exclude(rel) or exclude(name))

    def visit(directory: str, rel_dir: str) -> Iterator[tuple[str, os.DirEntry]]:
        try:
            with os.scandir(directory) as listing:
                entries = list(listing)
        except OSError as e:
            _raise_walk_error(e)
        files, dirs = [], []
        for entry in entries:
            try:
                is_dir = entry.is_dir()
            except OSError:
                is_dir = False
            (dirs if is_dir else files).append(entry)
        for entry in sorted(files, key=lambda e: e.name):
            rel = os.path.join(rel_dir, entry.name)
            if excluded(rel, entry.name):
                continue
            if include is not None and not (include(entry.name) or include(rel)):
                continue
            if entry.is_file():
                yield rel, entry
        for entry in sorted(dirs, key=lambda e: e.name):
            rel = os.path.join(rel_dir, entry.name)
            if excluded(rel, entry.name) or entry.is_symlink():
                continue
            yield from visit(entry.path, rel)

    return visit(root, "")


@lru_cache(maxsize=32)
def _matcher(patterns: tuple[str, ...]) -> Callable[[str], Any]:
    """One compiled regex for a set of glob patterns (fnmatch per name per pattern is slow)."""
    return re.compile("|".join(f"(?:{fnmatch.translate(g)})" for g in patterns)).match


def _raise_walk_error(e: OSError) -> None:
    raise PackInputError(f"{e.filename}: cannot list ({e.strerror})")


def plan_units(sources: Sequence[Any], options: SourceOptions) -> Iterator[Unit]:
    """Deterministic units for every source, in order; streams (never lists a whole tree)."""
    counter = itertools.count()
    for source in sources:
        if not isinstance(source, (str, os.PathLike)):
            yield from _plan_records(source, options, counter)
            continue
        path = os.fspath(source)
        if not os.path.exists(path):
            raise PackInputError(f"{path}: no such file or directory")
        if not os.access(path, os.R_OK):
            raise PackInputError(f"{path}: not readable (permission denied)")
        kind = source_kind(path, options)
        if kind == "jsonl":
            yield from _plan_jsonl(path, options, counter)
        elif kind == "parquet":
            try:
                meta = pq.ParquetFile(path).metadata
            except Exception as e:  # noqa: BLE001 - any parquet failure names the file
                raise PackInputError(f"{path}: not a readable Parquet file ({e})") from None
            for rg in range(meta.num_row_groups):
                yield Unit(next(counter), "parquet", path, start=rg,
                           input_bytes=meta.row_group(rg).total_byte_size)
        elif kind in ("files", "images"):
            yield from _plan_tree(path, kind, options, counter)
        else:
            raise PackInputError(f"{path}: unknown source kind {kind!r}; expected one of {KINDS}")


def _plan_jsonl(path: str, options: SourceOptions, counter) -> Iterator[Unit]:
    size = os.path.getsize(path)
    if _compression(path) is not None or size <= options.chunk_bytes:
        yield Unit(next(counter), "jsonl", path, 0, size, input_bytes=size)
        return
    with open(path, "rb") as f:
        start = 0
        while start < size:
            end = min(start + options.chunk_bytes, size)
            if end < size:
                f.seek(end)
                f.readline()
                end = f.tell()
            yield Unit(next(counter), "jsonl", path, start, end, input_bytes=end - start)
            start = end


def _plan_tree(root: str, kind: str, options: SourceOptions, counter) -> Iterator[Unit]:
    members: list[str] = []
    nbytes = 0
    for rel, entry in walk_file_entries(root, options):
        if kind == "images" and not rel.lower().endswith(IMAGE_SUFFIXES):
            continue
        members.append(rel)
        nbytes += entry.stat().st_size
        if len(members) >= options.files_per_unit or nbytes >= options.chunk_bytes:
            yield Unit(next(counter), kind, root, members=tuple(members), input_bytes=nbytes)
            members, nbytes = [], 0
    if members:
        yield Unit(next(counter), kind, root, members=tuple(members), input_bytes=nbytes)


def _plan_records(records: Iterable[Any], options: SourceOptions, counter) -> Iterator[Unit]:
    it = iter(records)
    while True:
        chunk = list(itertools.islice(it, options.records_per_unit))
        if not chunk:
            return
        yield Unit(next(counter), "records", "<iterable>", records=chunk,
                   input_bytes=sum(_approx_size(r) for r in chunk))


def _approx_size(record: Any) -> int:
    if isinstance(record, dict):
        return sum(len(v) if isinstance(v, (str, bytes)) else 8 for v in record.values())
    return len(record) if isinstance(record, (str, bytes)) else 8


def estimate_input_bytes(sources: Sequence[Any], options: SourceOptions) -> int | None:
    """Total input bytes for the progress bar's ETA; None when a source is an iterable."""
    total = 0
    for source in sources:
        if not isinstance(source, (str, os.PathLike)):
            return None
        path = os.fspath(source)
        if os.path.isdir(path):
            total += sum(entry.stat().st_size for _, entry in walk_file_entries(path, options))
        elif os.path.exists(path):
            total += os.path.getsize(path)
    return total


# ---------------------------------------------------------------- reading units


def rows_to_batch(rows: Sequence[dict], where: str) -> pa.RecordBatch:
    """Columns are the union of keys in order of first appearance; types inferred over all rows."""
    names: dict[str, None] = {}
    for row in rows:
        if not isinstance(row, dict):
            raise PackInputError(f"{where}: a sample must be a dict of columns, got {type(row).__name__}")
        names.update(dict.fromkeys(row))
    arrays = []
    for name in names:
        values = [row.get(name) for row in rows]
        try:
            arrays.append(pa.array(values))
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
            raise PackInputError(f"{where}: column {name!r} has values of mixed types ({e})") from None
    return pa.RecordBatch.from_arrays(arrays, names=list(names)) if names else \
        pa.RecordBatch.from_pydict({})


def read_unit(unit: Unit, options: SourceOptions, stats: UnitStats) -> Iterator[pa.RecordBatch]:
    if unit.kind == "jsonl":
        yield from _read_jsonl(unit, options, stats)
    elif unit.kind == "parquet":
        table = pq.ParquetFile(unit.path).read_row_group(unit.start)
        stats.files += unit.start == 0
        yield from table.to_batches(max_chunksize=65536)
    elif unit.kind == "files":
        yield from _read_files(unit, stats)
    elif unit.kind == "images":
        yield from _read_images(unit, stats)
    elif unit.kind == "records":
        yield rows_to_batch(unit.records, f"records {unit.index * options.records_per_unit}..")
    else:
        raise PackInputError(f"{unit.path}: unknown unit kind {unit.kind!r}")


def _open_text(path: str):
    compression = _compression(path)
    if compression == "gzip":
        return gzip.open(path, "rb")
    if compression == "zstd":
        return zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)
    return open(path, "rb")


def _read_jsonl(unit: Unit, options: SourceOptions, stats: UnitStats) -> Iterator[pa.RecordBatch]:
    stats.files += unit.start == 0
    try:
        if _compression(unit.path) is None:
            with open(unit.path, "rb") as f:
                f.seek(unit.start)
                data = f.read(unit.end - unit.start)
            yield from _parse_jsonl_chunk(data, unit, options, stats)
        else:
            with _open_text(unit.path) as f:
                stream = io.BufferedReader(f, buffer_size=1 << 20) if not hasattr(f, "peek") else f
                first_line = 1
                while True:
                    lines = stream.readlines(options.chunk_bytes)
                    if not lines:
                        break
                    yield from _parse_jsonl_chunk(b"".join(lines), unit, options, stats, first_line)
                    first_line += len(lines)
    except (OSError, EOFError, zstandard.ZstdError) as e:
        raise PackInputError(f"{unit.path}: cannot read ({e})") from None


def _line_number(unit: Unit, offset_in_chunk_lines: int) -> int:
    """1-based line number of a line of a chunk: counts newlines before the chunk (error path only)."""
    before = 0
    with open(unit.path, "rb") as f:
        remaining = unit.start
        while remaining > 0:
            block = f.read(min(8 << 20, remaining))
            before += block.count(b"\n")
            remaining -= len(block)
    return before + offset_in_chunk_lines


def _parse_jsonl_chunk(data: bytes, unit: Unit, options: SourceOptions, stats: UnitStats,
                       first_line: int | None = None) -> Iterator[pa.RecordBatch]:
    if not data or data.isspace():  # isspace stops at the first non-space; strip() would copy
        return
    try:
        table = pajson.read_json(io.BytesIO(data), read_options=pajson.ReadOptions(
            use_threads=False, block_size=max(1 << 20, len(data) + 1)))
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
        table = None
    if table is not None:
        stats.samples += table.num_rows
        yield from table.to_batches()
        return
    # slow path: locate the bad line, then raise with its number or skip it
    rows = []
    for i, line in enumerate(data.split(b"\n")):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError(f"expected a JSON object, got {type(row).__name__}")
        except (ValueError, UnicodeDecodeError) as e:
            lineno = (first_line + i) if first_line is not None else _line_number(unit, i + 1)
            message = f"{unit.path}:{lineno}: malformed JSON line ({e})"
            if options.on_error != "skip":
                raise PackInputError(message + "; pass --on-error skip to skip such lines") from None
            stats.skipped_records += 1
            if len(stats.errors) < 50:
                stats.errors.append(message)
            continue
        rows.append(row)
    if rows:
        stats.samples += len(rows)
        yield rows_to_batch(rows, unit.path)


def _read_files(unit: Unit, stats: UnitStats) -> Iterator[pa.RecordBatch]:
    paths, texts, raw = [], [], []
    for rel in unit.members:
        full = os.path.join(unit.path, rel)
        try:
            with open(full, "rb") as f:
                data = f.read()
        except OSError as e:
            raise PackInputError(f"{full}: cannot read ({e.strerror})") from None
        paths.append(rel)
        try:
            texts.append(data.decode("utf-8"))
            raw.append(None)
        except UnicodeDecodeError:
            texts.append(None)
            raw.append(data)
            stats.kept_as_bytes += 1
    stats.files += len(paths)
    stats.samples += len(paths)
    yield pa.RecordBatch.from_arrays(
        [pa.array(paths, pa.string()), pa.array(texts, pa.string()), pa.array(raw, pa.binary())],
        names=["path", "text", "text_bytes"])


def _read_images(unit: Unit, stats: UnitStats) -> Iterator[pa.RecordBatch]:
    rows = []
    for rel in unit.members:
        full = os.path.join(unit.path, rel)
        try:
            with open(full, "rb") as f:
                row: dict[str, Any] = {"path": rel, "image": f.read()}
        except OSError as e:
            raise PackInputError(f"{full}: cannot read ({e.strerror})") from None
        stem = os.path.splitext(full)[0]
        caption = None
        if os.path.exists(stem + ".txt"):
            with open(stem + ".txt", "rb") as f:
                caption = f.read().decode("utf-8", "replace").strip()
        if os.path.exists(stem + ".json"):
            try:
                with open(stem + ".json", "rb") as f:
                    meta = json.load(f)
            except ValueError as e:
                raise PackInputError(f"{stem}.json: malformed caption sidecar ({e})") from None
            if not isinstance(meta, dict):
                raise PackInputError(f"{stem}.json: sidecar must be a JSON object")
            row.update({k: v for k, v in meta.items() if k not in ("path", "image")})
        row["caption"] = caption if caption is not None else row.get("caption")
        rows.append(row)
    stats.files += len(rows)
    stats.samples += len(rows)
    batch = rows_to_batch(rows, unit.path)
    # image bytes stay opaque binary even when every file happened to be valid UTF-8
    return iter([batch.set_column(batch.schema.get_field_index("image"), "image",
                                  batch.column("image").cast(pa.binary()))])


def length_histogram(lengths: np.ndarray) -> np.ndarray:
    """Counts per power-of-two bucket: bucket b holds lengths in [2^(b-1), 2^b), bucket 0 is 0."""
    buckets = np.zeros(64, dtype=np.int64)
    if len(lengths):
        b = np.where(lengths > 0, np.floor(np.log2(np.maximum(lengths, 1))).astype(np.int64) + 1, 0)
        np.add.at(buckets, b, 1)
    return buckets
