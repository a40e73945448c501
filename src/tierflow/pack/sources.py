"""Raw inputs -> units of work -> record batches.

A *unit* is a piece of input fixed by the data alone (a byte range of a JSONL file, a
Parquet row group, a group of small files, a chunk of records), never by the number of
workers, so the packed output is byte-identical whatever the parallelism.
"""

from __future__ import annotations

import gzip
import io
import itertools
import json
import os
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import zstandard

from tierflow.pack import _media as media
from tierflow.pack.tokenize import PackInputError
from tierflow.pack.units import SourceOptions, Unit, UnitStats
from tierflow.pack._tree import (
    COMPRESSED_SUFFIXES,
    KIND_ROLES,
    SKIP_REASONS,
    TreeFile,
    base_suffix,
    classify_tree,
    file_kind,
    single_file,
    tree_kind,
)

KINDS = ("auto", "jsonl", "parquet", "files", "images", "webdataset")


# ---------------------------------------------------------------- planning


def _compression(path: str) -> str | None:
    return COMPRESSED_SUFFIXES.get(Path(path).suffix.lower())


def _is_json_document(path: str) -> bool:
    """A .json file holding one JSON array (read whole) rather than JSON Lines (read in chunks)."""
    if base_suffix(path) != ".json":
        return False
    with _open_text(path) as f:
        head = f.read(4096)
    return head.lstrip()[:1] == b"["


def plan_units(sources: Sequence[Any], options: SourceOptions, stats: UnitStats | None = None) -> Iterator[Unit]:
    """Deterministic units for every source, in order; streams (never lists a whole tree).

    Input files that are not packed (another kind than --kind) and caption sidecars (read
    with their images) are counted into `stats` as planning finds them.
    """
    stats = stats if stats is not None else UnitStats()
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
        if os.path.isdir(path):
            kind = tree_kind(path, options) if options.kind == "auto" else options.kind
            files: Iterable[TreeFile] = classify_tree(path, options)
        else:
            files = [single_file(path, options.kind)]
            kind = file_kind(files[0]) if options.kind == "auto" else options.kind
        if kind not in KIND_ROLES:
            raise PackInputError(f"{path}: unknown source kind {kind!r}; expected one of {KINDS}")
        yield from _plan_files(files, kind, options, counter, stats)


def _plan_files(
    files: Iterable[TreeFile], kind: str, options: SourceOptions, counter, stats: UnitStats
) -> Iterator[Unit]:
    """Units of one source's files packed as `kind`; the files it does not read are counted."""
    group = _FileGroup(kind, options, counter)
    for f in files:
        if kind == "images" and f.is_sidecar:
            stats.sidecars += 1  # read with its image
        elif f.role not in KIND_ROLES[kind]:
            stats.skip_file(SKIP_REASONS[kind], f.path)
        elif kind in ("files", "images"):
            yield from group.add(f)
        elif f.role == "tar":
            yield Unit(next(counter), "webdataset", f.path, members=(f.rel,), input_bytes=f.size)
        elif f.role == "jsonl":
            yield from _plan_jsonl(f.path, options, counter)
        else:
            yield from _plan_parquet(f.path, counter, stats)
    yield from group.flush()


class _FileGroup:
    """Small files of one directory tree, grouped into units of a bounded count and size."""

    def __init__(self, kind: str, options: SourceOptions, counter) -> None:
        self.kind, self.options, self.counter = kind, options, counter
        self.root = ""
        self.members: list[str] = []
        self.sidecars: list[str] = []
        self.nbytes = 0

    def add(self, f: TreeFile) -> Iterator[Unit]:
        self.root = f.root
        self.members.append(f.rel)
        self.sidecars.extend(f.sidecars)
        self.nbytes += f.size + sum(os.path.getsize(os.path.join(f.root, s)) for s in f.sidecars)
        if len(self.members) >= self.options.files_per_unit or self.nbytes >= self.options.chunk_bytes:
            yield from self.flush()

    def flush(self) -> Iterator[Unit]:
        if self.members:
            yield Unit(
                next(self.counter),
                self.kind,
                self.root,
                members=tuple(self.members),
                input_bytes=self.nbytes,
                sidecars=tuple(self.sidecars),
            )
        self.members, self.sidecars, self.nbytes = [], [], 0


def _plan_jsonl(path: str, options: SourceOptions, counter) -> Iterator[Unit]:
    size = os.path.getsize(path)
    if _is_json_document(path):
        yield Unit(next(counter), "json", path, 0, size, input_bytes=size)
        return
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


def _plan_parquet(path: str, counter, stats: UnitStats) -> Iterator[Unit]:
    """One unit per row group; their input_bytes share out the file's size (what progress counts)."""
    import pyarrow.parquet as pq  # here: it loads pyarrow's filesystems too, ~5 MB every reading process would carry

    try:
        meta = pq.ParquetFile(path).metadata
    except Exception as e:
        raise PackInputError(f"{path}: not a readable Parquet file ({e})") from None
    if meta.num_row_groups == 0:
        stats.files += 1  # an empty file is packed: it has no rows
        return
    weights = list(
        itertools.accumulate(max(1, meta.row_group(rg).total_byte_size) for rg in range(meta.num_row_groups))
    )
    size = os.path.getsize(path)
    ends = [0] + [size * w // weights[-1] for w in weights]  # Python ints: a TB file times its bytes overflows int64
    for rg in range(meta.num_row_groups):
        yield Unit(next(counter), "parquet", path, start=rg, input_bytes=ends[rg + 1] - ends[rg])


def _plan_records(records: Iterable[Any], options: SourceOptions, counter) -> Iterator[Unit]:
    it = iter(records)
    while True:
        chunk = list(itertools.islice(it, options.records_per_unit))
        if not chunk:
            return
        yield Unit(
            next(counter), "records", "<iterable>", records=chunk, input_bytes=sum(_approx_size(r) for r in chunk)
        )


def _approx_size(record: Any) -> int:
    if isinstance(record, dict):
        return sum(len(v) if isinstance(v, (str, bytes)) else 8 for v in record.values())
    return len(record) if isinstance(record, (str, bytes)) else 8


def estimate_input_bytes(sources: Sequence[Any], options: SourceOptions) -> int | None:
    """Bytes of the input files that will be packed (the progress bar's total, so it ends full);
    None when a source is an iterable."""
    if not all(isinstance(s, (str, os.PathLike)) for s in sources):
        return None
    return sum(unit.input_bytes for unit in plan_units(sources, options))


# ---------------------------------------------------------------- reading units


SKIP_HINT = "; pass --on-error skip to count and skip such records"


def _text_problem(row: dict, name: str) -> tuple[str, str] | None:
    """(reason, what is wrong) when a record has no string to tokenise in `name`, else None."""
    if name not in row:
        keys = ", ".join(list(row)[:8]) + (", ..." if len(row) > 8 else "")
        return "no text field", f"no text field {name!r} (keys: {keys or 'none'})"
    value = row[name]
    if value is None:
        return "null text", f"text field {name!r} is null"
    if not isinstance(value, str):
        return "text not a string", f"text field {name!r} is {_kind(value)} ({_short(value)}), expected a string"
    return None


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    names: dict[type, str] = {str: "a string", bytes: "bytes", list: "a list", dict: "an object"}
    return names.get(type(value), type(value).__name__)


def _short(value: Any) -> str:
    text = json.dumps(value, default=repr) if not isinstance(value, bytes) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _bad_record(message: str, reason: str, options: SourceOptions, stats: UnitStats) -> None:
    """Raise `message` (FILE:LINE: what is wrong) with the --on-error hint, or count it by reason."""
    if options.on_error != "skip":
        raise PackInputError(
            message
            + (
                "; pass --text-field to choose the field to tokenise, or --on-error skip to count and skip such records"
                if reason == "no text field"
                else SKIP_HINT
            )
        )
    stats.skip_record(reason, message)


def _mixed_types(rows: Sequence[dict]) -> dict[int, tuple[str, str]]:
    """{row: (column, what is wrong)} for values whose kind differs from the column's usual one
    (the kind most rows hold; numbers are one kind, nulls fit any)."""
    kinds: dict[str, list[str | None]] = {}
    for i, row in enumerate(rows):
        for name, value in row.items() if isinstance(row, dict) else ():
            kinds.setdefault(name, [None] * len(rows))[i] = None if value is None else _kind(value)
    bad: dict[int, tuple[str, str]] = {}
    for name, column in kinds.items():
        counts: dict[str, int] = {}
        for k in column:
            if k is not None:
                counts[k] = counts.get(k, 0) + 1
        if len(counts) < 2:
            continue
        usual = max(counts, key=lambda k: counts[k])  # first seen wins a tie
        for i, k in enumerate(column):
            if k is not None and k != usual and i not in bad:
                bad[i] = (
                    name,
                    f"column {name!r} is {k} ({_short(rows[i][name])}) where the other records "
                    f"hold {usual.split(' ', 1)[1]}s",
                )
    return bad


def records_batch(
    rows: list[dict],
    where: Callable[[int], str],
    label: str,
    options: SourceOptions,
    stats: UnitStats,
    text_checked: bool = False,
) -> pa.RecordBatch | None:
    """The batch of the records that can be packed (None when none can). A record without its text
    (when one is required) or with a value of another kind than its column's is bad input, raised
    as `where(i): what is wrong` or, under on_error="skip", counted by reason and left out."""
    index = list(range(len(rows)))
    if options.require_text and not text_checked:
        index = []
        for i, row in enumerate(rows):
            problem = _text_problem(row, options.text_field) if isinstance(row, dict) else None
            if problem is not None:
                _bad_record(f"{where(i)}: {problem[1]}", problem[0], options, stats)
                continue
            index.append(i)
    kept = [rows[i] for i in index]
    try:
        batch = rows_to_batch(kept, label) if kept else None
    except PackInputError:
        bad = _mixed_types(kept)  # only where Arrow refused: it takes kinds (ints and floats, numpy) we would not
        if not bad:
            raise
        for j in sorted(bad):
            _bad_record(f"{where(index[j])}: {bad[j][1]}", "mixed types", options, stats)
        kept = [row for j, row in enumerate(kept) if j not in bad]
        batch = rows_to_batch(kept, label) if kept else None
    stats.samples += len(kept)
    return batch


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
    return pa.RecordBatch.from_arrays(arrays, names=list(names)) if names else pa.RecordBatch.from_pydict({})


def read_unit(unit: Unit, options: SourceOptions, stats: UnitStats) -> Iterator[pa.RecordBatch]:
    if unit.kind == "jsonl":
        yield from _read_jsonl(unit, options, stats)
    elif unit.kind == "json":
        yield from _read_json_document(unit, options, stats)
    elif unit.kind == "parquet":
        yield from _read_row_group(unit, options, stats)
    elif unit.kind == "files":
        yield from _read_files(unit, stats)
    elif unit.kind == "images":
        yield from _read_images(unit, options, stats)
    elif unit.kind == "webdataset":
        yield from media.read_webdataset(unit, options, stats)
    elif unit.kind == "records":
        assert unit.records is not None, "a records unit carries its records"
        first = unit.index * options.records_per_unit
        batch = records_batch(unit.records, lambda i: f"record {first + i}", f"records {first}..", options, stats)
        if batch is not None:
            yield batch
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


def _read_row_group(unit: Unit, options: SourceOptions, stats: UnitStats) -> Iterator[pa.RecordBatch]:
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(unit.path).read_row_group(unit.start)
    except Exception as e:
        raise PackInputError(f"{unit.path}: cannot read row group {unit.start} ({e})") from None
    stats.files += unit.start == 0
    stats.samples += table.num_rows
    images = media.parquet_image_columns(table.schema)
    if images:  # image bytes stay as they are; their headers give width/height/format columns
        yield from media.parquet_images(
            iter(table.to_batches(max_chunksize=media.ROWS_PER_BATCH)),
            images,
            f"{unit.path} row group {unit.start}",
            options,
            stats,
        )
        return
    yield from table.to_batches(max_chunksize=65536)


def _read_json_document(unit: Unit, options: SourceOptions, stats: UnitStats) -> Iterator[pa.RecordBatch]:
    """A .json file holding an array of objects, read whole (as Hugging Face's json loader does)."""
    try:
        with _open_text(unit.path) as f:
            rows = json.load(f)
        bad = next((i for i, row in enumerate(rows) if not isinstance(row, dict)), None)
        if bad is not None:
            raise ValueError(f"item {bad} is {type(rows[bad]).__name__}, expected a JSON object")
    except (OSError, EOFError, zstandard.ZstdError) as e:
        raise PackInputError(f"{unit.path}: cannot read ({e})") from None
    except (ValueError, UnicodeDecodeError) as e:
        message = f"{unit.path}: malformed JSON array of records ({e})"
        if options.on_error != "skip":
            raise PackInputError(message + "; pass --on-error skip to skip such files") from None
        stats.skip_file("malformed JSON", unit.path)
        stats.errors.append(message)
        return
    stats.files += 1
    for start in range(0, len(rows), options.records_per_unit):
        batch = records_batch(
            rows[start : start + options.records_per_unit], _item_names(unit.path, start), unit.path, options, stats
        )
        if batch is not None:
            yield batch


def _item_names(path: str, first: int) -> Callable[[int], str]:
    """How a batch of a JSON array's items that starts at item `first` names its item i."""
    return lambda i: f"{path}: item {first + i}"


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


def _parse_jsonl_chunk(
    data: bytes, unit: Unit, options: SourceOptions, stats: UnitStats, first_line: int | None = None
) -> Iterator[pa.RecordBatch]:
    if not data or data.isspace():  # isspace stops at the first non-space; strip() would copy
        return
    import pyarrow.json as pajson

    try:
        table = pajson.read_json(
            io.BytesIO(data), read_options=pajson.ReadOptions(use_threads=False, block_size=max(1 << 20, len(data) + 1))
        )
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
        table = None
    if table is not None and not (options.require_text and _text_missing(table, options.text_field)):
        stats.samples += table.num_rows
        yield from table.to_batches()
        return
    # slow path: locate each bad line, then raise with its number or count and skip it
    before: list[int] = []

    def where(i: int) -> str:  # FILE:LINE of the chunk's line i (0-based)
        if first_line is not None:
            return f"{unit.path}:{first_line + i}"
        if not before:
            before.append(_line_number(unit, 0))
        return f"{unit.path}:{before[0] + i + 1}"

    rows, lines = [], []
    for i, line in enumerate(data.split(b"\n")):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError(f"expected a JSON object, got {type(row).__name__}")
        except (ValueError, UnicodeDecodeError) as e:
            message = f"{where(i)}: malformed JSON line ({e})"
            if options.on_error != "skip":
                raise PackInputError(message + "; pass --on-error skip to skip such lines") from None
            stats.skip_record("malformed JSON", message)
            continue
        problem = _text_problem(row, options.text_field) if options.require_text else None
        if problem is not None:  # here, so the first bad line is the one named
            _bad_record(f"{where(i)}: {problem[1]}", problem[0], options, stats)
            continue
        rows.append(row)
        lines.append(i)
    batch = records_batch(rows, lambda j: where(lines[j]), unit.path, options, stats, text_checked=True)
    if batch is not None:
        yield batch


def _text_missing(table: pa.Table, name: str) -> bool:
    """Whether some record of a parsed chunk has no value in `name` (then the slow path names it).
    A column that is missing throughout, or of another type throughout, is the wrong --text-field:
    the tokenizer's check names it with its columns or its type."""
    return name in table.column_names and table.column(name).null_count > 0


def _read_files(unit: Unit, stats: UnitStats) -> Iterator[pa.RecordBatch]:
    paths: list[str] = []
    texts: list[str | None] = []
    raw: list[bytes | None] = []
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
        names=["path", "text", "text_bytes"],
    )


def _read_images(unit: Unit, options: SourceOptions, stats: UnitStats) -> Iterator[pa.RecordBatch]:
    rows = []
    sidecars = set(unit.sidecars)
    for rel in unit.members:
        full = os.path.join(unit.path, rel)
        try:
            with open(full, "rb") as f:
                row: dict[str, Any] = {"path": rel, "image": f.read()}
        except OSError as e:
            raise PackInputError(f"{full}: cannot read ({e.strerror})") from None
        try:
            info = media.probe(row["image"])
        except media.CorruptImage as e:
            media.skip_or_raise(f"{full}: {e}", options, stats, file=full)  # a file, counted with the skipped files
            continue
        row.update({f"image_{name}": value for (name, _), value in zip(media.INFO_FIELDS, (*info, len(row["image"])))})
        stem = os.path.splitext(rel)[0]
        caption = None
        if stem + ".txt" in sidecars:
            with open(os.path.join(unit.path, stem + ".txt"), "rb") as f:
                caption = f.read().decode("utf-8", "replace").strip()
        if stem + ".json" in sidecars:
            sidecar = os.path.join(unit.path, stem + ".json")
            try:
                with open(sidecar, "rb") as f:
                    meta = json.load(f)
            except ValueError as e:
                raise PackInputError(f"{sidecar}: malformed caption sidecar ({e})") from None
            if not isinstance(meta, dict):
                raise PackInputError(f"{sidecar}: sidecar must be a JSON object")
            row.update({k: v for k, v in meta.items() if k not in row})
        row["caption"] = caption if caption is not None else row.get("caption")
        rows.append(row)
    stats.files += len(rows)
    stats.samples += len(rows)
    if not rows:
        return iter(())
    batch = rows_to_batch(rows, unit.path)
    # image bytes stay opaque binary even when every file happened to be valid UTF-8
    for name, kind in (("image", pa.binary()), *((f"image_{n}", t) for n, t in media.INFO_FIELDS)):
        batch = batch.set_column(batch.schema.get_field_index(name), name, batch.column(name).cast(kind))
    return iter([batch])


def length_histogram(lengths: np.ndarray) -> np.ndarray:
    """Counts per power-of-two bucket: bucket b holds lengths in [2^(b-1), 2^b), bucket 0 is 0."""
    buckets = np.zeros(64, dtype=np.int64)
    if len(lengths):
        b = np.where(lengths > 0, np.floor(np.log2(np.maximum(lengths, 1))).astype(np.int64) + 1, 0)
        np.add.at(buckets, b, 1)
    return buckets
