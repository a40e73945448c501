"""Image inputs at pack time: header-only metadata, Parquet image columns, WebDataset tars.

Images stay the encoded bytes they arrived as (byte-exact, never re-encoded); what pack adds
is `<column>_width`, `_height`, `_format` and `_nbytes` beside each image column, read from the
header alone (Pillow's lazy open parses markers, never pixels), so filters and aspect-ratio
buckets need no decode. An image whose header cannot be read is counted and skipped, or raises
naming its file, row and key, as `on_error` says.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Iterator, Sequence

import pyarrow as pa

from tierflow.pack.tokenize import PackInputError

if TYPE_CHECKING:
    from tierflow.pack.units import SourceOptions, Unit, UnitStats

INFO_FIELDS = (("width", pa.int32()), ("height", pa.int32()), ("format", pa.string()), ("nbytes", pa.int64()))
"""Columns added beside an image column `c`: c_width, c_height, c_format, c_nbytes."""
IMAGE_EXTENSIONS = frozenset({"jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff"})
PARQUET_IMAGE_NAMES = frozenset({"image", "img", "jpg", "jpeg", "png", "webp", "image_bytes"})
"""Binary Parquet columns packed as images by name (img2dataset writes `jpg`, HF `image`)."""
KEY_COLUMNS = ("__key__", "key", "url", "path", "image_path")
"""Columns that name a row in an error message, first found wins."""
ROWS_PER_BATCH = 256


def has_images(schema: pa.Schema) -> bool:
    """Whether pack put an image column in this schema (one with its `_width`/`_nbytes` beside it)."""
    names = set(schema.names)
    return any(f"{n}_width" in names and f"{n}_nbytes" in names for n in names)


class CorruptImage(ValueError):
    """An image whose header does not parse."""


def probe(data: bytes) -> tuple[int, int, str]:
    """(width, height, format) from the image's header; no pixel is decoded."""
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - the images extra brings it
        raise PackInputError("packing images reads their headers with Pillow: pip install 'tierflow[images]'") from None
    try:
        with Image.open(io.BytesIO(data)) as im:  # lazy: the header only
            return int(im.width), int(im.height), str(im.format)
    except Exception as e:
        raise CorruptImage(f"not a readable image ({type(e).__name__}: {e})") from None


def image_info(
    values: Sequence[bytes | None], where: Callable[[int], str], options: SourceOptions, stats: UnitStats
) -> tuple[list[pa.Array], list[int]]:
    """Info arrays (INFO_FIELDS order) of the rows kept, and the rows kept (a corrupt one is skipped
    or raises, per on_error). A null image is kept, with null info."""
    kept: list[int] = []
    info: list[tuple[int, int, str, int] | tuple[None, None, None, None]] = []
    for i, data in enumerate(values):
        if data is None:
            info.append((None, None, None, None))
        else:
            try:
                info.append((*probe(data), len(data)))
            except CorruptImage as e:
                skip_or_raise(f"{where(i)}: {e}", options, stats)
                continue
        kept.append(i)
    arrays = [pa.array([row[k] for row in info], t) for k, (_, t) in enumerate(INFO_FIELDS)]
    return arrays, kept


def skip_or_raise(message: str, options: SourceOptions, stats: UnitStats, file: str | None = None) -> None:
    """Raise, or count a corrupt image and go on: a record, or with `file` an input file of its own."""
    if options.on_error != "skip":
        raise PackInputError(message + "; pass --on-error skip to count and skip such images")
    stats.corrupt_images += 1
    if file is None:
        stats.skip_record("corrupt image", message)
        return
    stats.skip_file("corrupt image", file)
    if len(stats.errors) < 50:
        stats.errors.append(message)


def with_image_info(
    batch: pa.RecordBatch, columns: Sequence[str], where: Callable[[int], str], options: SourceOptions, stats: UnitStats
) -> pa.RecordBatch:
    """`batch` with the info columns of each image column after it, its corrupt rows skipped."""
    for name in columns:
        values = batch.column(name).to_pylist()
        arrays, kept = image_info(values, where, options, stats)
        if len(kept) < batch.num_rows:
            batch = batch.take(pa.array(kept, pa.int64()))
        names = batch.schema.names
        cols = [batch.column(n) for n in names]
        info_names = [f"{name}_{f}" for f, _ in INFO_FIELDS]
        keep = [k for k, n in enumerate(names) if n not in info_names]  # a stale copy is recomputed
        cols = [cols[k] for k in keep]
        names = [names[k] for k in keep]
        at = names.index(name) + 1
        batch = pa.RecordBatch.from_arrays(cols[:at] + arrays + cols[at:], names=names[:at] + info_names + names[at:])
    return batch


def row_namer(prefix: str, batch: pa.RecordBatch, offset: int = 0) -> Callable[[int], str]:
    """Names row i of `batch` for an error: the prefix, the row number and the row's key."""
    key = next((k for k in KEY_COLUMNS if k in batch.schema.names), None)
    keys = batch.column(key).to_pylist() if key is not None else None

    def where(i: int) -> str:
        return f"{prefix} row {offset + i}" + (f" ({key} {keys[i]!r})" if keys is not None else "")

    return where


# ---------------------------------------------------------------- Parquet


def parquet_image_columns(schema: pa.Schema) -> list[str]:
    """Image columns of a Parquet schema: HF `Image` features, {bytes, path} structs, and binary
    columns with an image name (PARQUET_IMAGE_NAMES)."""
    hf: set[str] = set()
    meta = (schema.metadata or {}).get(b"huggingface")
    if meta:
        try:
            features = json.loads(meta).get("info", {}).get("features", {})
            hf = {n for n, f in features.items() if isinstance(f, dict) and f.get("_type") == "Image"}
        except (ValueError, AttributeError):
            hf = set()
    found = []
    for f in schema:
        if pa.types.is_struct(f.type) and f.type.get_field_index("bytes") >= 0:
            if f.name in hf or {c.name for c in f.type} <= {"bytes", "path"}:
                found.append(f.name)
        elif (pa.types.is_binary(f.type) or pa.types.is_large_binary(f.type)) and (
            f.name in hf or f.name.lower() in PARQUET_IMAGE_NAMES
        ):
            found.append(f.name)
    return found


def flatten_image_structs(batch: pa.RecordBatch, columns: Sequence[str]) -> pa.RecordBatch:
    """HF's {bytes, path} image struct -> a binary `c` (the bytes as they are) and a string `c_path`."""
    names, arrays = [], []
    for name, array in zip(batch.schema.names, batch.columns):
        if name in columns and pa.types.is_struct(array.type):
            names.append(name)
            arrays.append(array.field("bytes").cast(pa.binary()))
            if array.type.get_field_index("path") >= 0:
                names.append(f"{name}_path")
                arrays.append(array.field("path").cast(pa.string()))
        else:
            names.append(name)
            arrays.append(array)
    return pa.RecordBatch.from_arrays(arrays, names=names)


def parquet_images(
    batches: Iterator[pa.RecordBatch], columns: Sequence[str], where: str, options: SourceOptions, stats: UnitStats
) -> Iterator[pa.RecordBatch]:
    """A row group's batches with their image columns flattened and measured."""
    offset = 0
    for batch in batches:
        rows = batch.num_rows
        batch = flatten_image_structs(batch, columns)
        before = stats.corrupt_images
        batch = with_image_info(batch, columns, row_namer(where, batch, offset), options, stats)
        stats.samples -= stats.corrupt_images - before
        offset += rows
        yield batch


# ---------------------------------------------------------------- WebDataset tars


def split_member(name: str) -> tuple[str, str] | None:
    """WebDataset's rule: the key is the member's path up to the first dot of its base name, the
    rest is the field ('a/b.seg.png' -> ('a/b', 'seg.png')); None for a name without one."""
    directory, base = os.path.split(name)
    if "." not in base or base.startswith("."):
        return None
    stem, ext = base.split(".", 1)
    return os.path.join(directory, stem), ext


def read_webdataset(unit: Unit, options: SourceOptions, stats: UnitStats) -> Iterator[pa.RecordBatch]:
    """One tar's samples, read in place (streaming): a row per key with `__key__`, `__url__` (the tar's
    path under its source) and one binary column per member field, byte-exact; image fields get info."""
    url = unit.members[0] if unit.members else os.path.basename(unit.path)
    rows: list[dict[str, Any]] = []
    try:
        with tarfile.open(unit.path, mode="r|*") as tar:
            current: dict[str, Any] | None = None
            for member in tar:
                if not member.isfile():
                    continue
                split = split_member(member.name)
                if split is None:
                    stats.skip_file("tar member without a field extension", f"{unit.path}:{member.name}")
                    continue
                key, field = split
                if current is None or current["__key__"] != key:
                    if current is not None:
                        rows.append(current)
                    current = {"__key__": key, "__url__": url}
                f = tar.extractfile(member)
                current[field] = f.read() if f is not None else b""
                if len(rows) >= ROWS_PER_BATCH:
                    yield _tar_batch(rows, unit.path, options, stats)
                    rows = []
            if current is not None:
                rows.append(current)
    except (tarfile.TarError, OSError, EOFError) as e:
        raise PackInputError(f"{unit.path}: not a readable tar ({type(e).__name__}: {e})") from None
    stats.files += 1
    if rows:
        yield _tar_batch(rows, unit.path, options, stats)


def _tar_batch(rows: list[dict[str, Any]], path: str, options: SourceOptions, stats: UnitStats) -> pa.RecordBatch:
    names: dict[str, None] = {}
    for row in rows:
        names.update(dict.fromkeys(row))
    arrays = [
        pa.array([r.get(n) for r in rows], pa.string() if n in ("__key__", "__url__") else pa.binary()) for n in names
    ]
    batch = pa.RecordBatch.from_arrays(arrays, names=list(names))
    images = [n for n in names if n.rsplit(".", 1)[-1].lower() in IMAGE_EXTENSIONS]
    before = stats.corrupt_images
    batch = with_image_info(batch, images, row_namer(path, batch, stats.samples), options, stats)
    stats.samples += len(rows) - (stats.corrupt_images - before)
    return batch
