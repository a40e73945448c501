"""Writing version-3 metadata (format/metadata.py describes it): the two tables under their content
names, then the header last, atomically; publishing it beside a manifest.json (pack), upgrading a
version-2 dataset in place or at a URL, and which table files a directory's header names (gc)."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import xxhash

from tierflow.errors import ManifestError
from tierflow.format._atomic import write_atomically
from tierflow.format._regular import read_regular
from tierflow.format.manifest import MANIFEST_NAME, Manifest, max_manifest_bytes, schema_to_json
from tierflow.format.metadata import (
    BLOCK_CHUNK_ROWS,
    BLOCK_CHUNK_SCHEMA,
    BLOCK_SCHEMA,
    CHECKSUM_HALVES,
    CHUNK_ROWS,
    HEADER_CHECKSUM_KEY,
    LEGACY_MANIFEST_SHARDS,
    METADATA_NAME,
    MappedManifest,
    METADATA_VERSION,
    RUNNING_COLUMNS,
    SHARD_SCHEMA,
    TABLE_PREFIX,
    TABLE_SUFFIX,
    block_digest,
    chunk_schema,
    column_digest,
    column_dtype,
    has_metadata,
    header_checksum,
    load_metadata,
    table_entries,
)
from tierflow.format.metadata_header import header_layout_schema
from tierflow.format.metadata_layout import LAYOUT_COLUMNS, LAYOUT_SCHEMA, layout_columns, layout_schema
from tierflow.format.metadata_windows import (
    CHUNK_ROWS as WINDOW_CHUNK_ROWS,
    MOST_LENGTHS,
    WINDOWS_SCHEMA,
    lengths_to_store,
    table_kind,
    window_columns,
)
from tierflow.format.metadata_summary import SUMMARY_COLUMNS, summary_fields
from tierflow.format.shard import COMPRESSIONS, BlockList, ShardInfo


def columns_from_shards(shards: Sequence[ShardInfo]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The shard and block tables' columns for a list of shards (pack, upgrade). ValueError for a
    shard the tables cannot hold (blocks not contiguous from 0, a value beyond its column)."""
    n = len(shards)
    cols: dict[str, np.ndarray] = {
        name: np.zeros(n, dtype=column_dtype(SHARD_SCHEMA.field(name).type)) for name in SHARD_SCHEMA.names
    }
    lengths, rows, sums, tokens = [], [], [], []
    first = 0
    for i, s in enumerate(shards):
        blocks = s.blocks
        if isinstance(blocks, BlockList):
            b_len, b_rows, b_off = blocks.lengths, blocks.rows, blocks.offsets
            b_sum = (
                np.asarray(blocks.checksums, dtype=np.uint64)
                if not isinstance(blocks.checksums, list)
                else np.array([int(c, 16) for c in blocks.checksums], dtype=np.uint64)
            )
            b_tok = blocks.tokens
        else:
            b_len = np.array([b.length for b in blocks], dtype=np.int64)
            b_rows = np.array([b.rows for b in blocks], dtype=np.int64)
            b_off = np.array([b.offset for b in blocks], dtype=np.int64)
            b_sum = np.array([int(b.checksum, 16) for b in blocks], dtype=np.uint64)
            listed = [b.tokens for b in blocks]
            b_tok = None if (not listed or None in listed) else np.array(listed, dtype=np.int64)
        count = len(b_len)
        if count and (int(b_off[0]) != 0 or np.any(b_off[1:] != np.cumsum(b_len)[:-1])):
            raise ValueError(f"shard {s.name}: its blocks are not contiguous from offset 0")
        known = b_tok is not None and count > 0
        t = np.asarray(b_tok, dtype=np.int64) if known else np.zeros(count, dtype=np.int64)
        for name, values in (("length", b_len), ("rows", b_rows), ("tokens", t)):
            if count and (int(np.min(values)) < 0 or int(np.max(values)) >= 1 << 32):
                raise ValueError(f"shard {s.name}: a block's {name} does not fit 32 bits")
        lengths.append(np.asarray(b_len, dtype=np.uint32))
        rows.append(np.asarray(b_rows, dtype=np.uint32))
        sums.append(b_sum)
        tokens.append(t.astype(np.uint32))
        cols["checksum"][i] = np.frombuffer(bytes.fromhex(s.checksum), dtype="V16")[0]
        cols["decoded_checksum"][i] = np.frombuffer(bytes.fromhex(s.decoded_checksum), dtype="V16")[0]
        cols["compression"][i] = COMPRESSIONS.index(s.compression)
        for name in ("samples", "bytes", "decoded_bytes", "tokens"):
            cols[name][i] = getattr(s, name)
        cols["first_block"][i], cols["blocks"][i] = first, count
        cols["largest_rows"][i] = int(np.max(b_rows)) if count else 0
        cols["tokens_known"][i] = int(known)
        cols["block_digest"][i] = block_digest(lengths[-1], rows[-1], sums[-1], tokens[-1])
        first += count
    cols["sample_start"] = _starts(cols["samples"])
    cols["token_start"] = _starts(cols["tokens"])

    def cat(parts: list[np.ndarray], kind: str) -> np.ndarray:
        return np.concatenate(parts).astype(kind) if parts else np.zeros(0, dtype=kind)

    block_columns = {
        "length": cat(lengths, "<u4"),
        "rows": cat(rows, "<u4"),
        "checksum": cat(sums, "<u8"),
        "tokens": cat(tokens, "<u4"),
    }
    return cols, block_columns


def checksum_order(checksums: np.ndarray) -> np.ndarray:
    """The shards in the order of their checksums (the `checksum_order` column): with it a reader
    checks that no shard is listed twice, and finds a shard by its key, without sorting."""
    return np.argsort(np.ascontiguousarray(checksums).view(CHECKSUM_HALVES), kind="stable").astype(np.int64)


def _starts(counts: np.ndarray) -> np.ndarray:
    out = np.zeros(counts.size, dtype=np.int64)
    np.cumsum(counts[:-1], out=out[1:])
    return out


def _arrow_column(values: np.ndarray, kind: pa.DataType) -> pa.Array:
    if pa.types.is_fixed_size_binary(kind):
        data = np.ascontiguousarray(values).view(np.uint8)
        return pa.Array.from_buffers(kind, len(values), [None, pa.py_buffer(data)])
    return pa.array(np.ascontiguousarray(values, dtype=column_dtype(kind)), type=kind)


def _write_table(
    directory: Path, kind: str, schema: pa.Schema, columns: dict[str, np.ndarray]
) -> tuple[dict, dict[str, memoryview]]:
    """One table as an uncompressed Arrow IPC file named by its content hash (temp file, fsync,
    rename): its entry for the header (file, rows, size, each column's hash) and its columns' bytes as
    written (what the chunk table hashes)."""
    rows = len(next(iter(columns.values()))) if columns else 0
    arrays = [_arrow_column(columns[name], schema.field(name).type) for name in schema.names]
    batch = pa.RecordBatch.from_arrays(arrays, schema=schema)
    tmp = directory / f".tmp-{os.getpid()}-{threading.get_ident()}-{kind}{TABLE_SUFFIX}"
    digest = xxhash.xxh3_128()
    try:
        with pa.OSFile(str(tmp), "wb") as sink:
            with pa.ipc.new_file(sink, schema) as writer:
                writer.write_batch(batch)
        with open(tmp, "rb") as f:
            while chunk := f.read(8 << 20):
                digest.update(chunk)
            os.fsync(f.fileno())
        name = f"{TABLE_PREFIX}{kind}-{digest.hexdigest()}{TABLE_SUFFIX}"
        os.replace(tmp, directory / name)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    raw = {name: _column_bytes(arr) for name, arr in zip(schema.names, arrays)}
    entry = {
        "file": name,
        "rows": rows,
        "size": (directory / name).stat().st_size,
        "columns": {name: column_digest(data) for name, data in raw.items()},
    }
    return entry, raw


def _write_chunk_table(
    directory: Path,
    shards: dict[str, memoryview],
    layout: dict[str, memoryview] | None,
    layout_kind: pa.Schema | None,
    starts: dict[str, np.ndarray],
    chunk_rows: int,
) -> dict:
    """The chunk table (format/metadata.py) of the shard table's and the layout's columns as written,
    and its header entry: a reader hashes the chunks of the rows it uses against it."""
    columns: dict[str, np.ndarray] = {}
    for table, raw, schema in (("shards", shards, SHARD_SCHEMA), ("layout", layout, layout_kind)):
        if raw is not None and schema is not None:
            columns.update(_chunk_hashes(table, raw, schema, chunk_rows))
    for name in RUNNING_COLUMNS:
        columns[name] = np.asarray(starts[name], dtype=np.int64)[::chunk_rows]
    entry, _ = _write_table(directory, "chunks", chunk_schema(layout_kind), columns)
    return {**entry, "rows_per_chunk": chunk_rows}


def _write_block_chunk_table(directory: Path, blocks: dict[str, memoryview], chunk_rows: int) -> dict:
    """The block chunk table (format/metadata.py) of the block table's columns as written, and its
    header entry: a shard's first use hashes the chunks its block rows lie in against it."""
    entry, _ = _write_table(
        directory, "block_chunks", BLOCK_CHUNK_SCHEMA, _chunk_hashes("blocks", blocks, BLOCK_SCHEMA, chunk_rows)
    )
    return {**entry, "rows_per_chunk": chunk_rows}


def _chunk_hashes(table: str, raw: dict[str, memoryview], schema: pa.Schema, chunk_rows: int) -> dict[str, np.ndarray]:
    """Each column's xxh3-128 a chunk of `chunk_rows` rows, as the chunk tables hold them."""
    columns = {}
    for name, data in raw.items():
        width = schema.field(name).type.byte_width * chunk_rows
        digests = b"".join(xxhash.xxh3_128_digest(data[at : at + width]) for at in range(0, len(data), width))
        columns[f"{table}.{name}"] = np.frombuffer(digests, dtype="V16")
    return columns


def _column_bytes(arr: pa.Array) -> memoryview:
    width = arr.type.byte_width
    buf = arr.buffers()[1]
    if buf is None:
        return memoryview(b"")
    return memoryview(buf).cast("B")[arr.offset * width : (arr.offset + len(arr)) * width]


def write_metadata(
    directory: str | Path,
    manifest: Manifest | None = None,
    *,
    shard_columns: dict[str, np.ndarray] | None = None,
    block_columns: dict[str, np.ndarray] | None = None,
    fields: dict | None = None,
    manifest_bytes: bytes | None = None,
    chunk_rows: int = CHUNK_ROWS,
    block_chunk_rows: int = BLOCK_CHUNK_ROWS,
    seq_lens: Sequence[int] = (),
) -> Path:
    """Write the version-3 metadata of a dataset directory: both tables, then the header last
    (atomically), so a reader sees the old metadata or the new, whole. From a `manifest` (pack,
    upgrade) or from ready columns (`shard_columns`/`block_columns` as `columns_from_shards` gives
    them, `fields` the header's dataset-wide fields: what a synthetic or converted dataset writes).
    `manifest_bytes`: the manifest.json published beside it (pack, upgrade), recorded by size and
    hash: a reader takes the header only while the manifest beside it is that one, so an edited or
    replaced manifest.json is read (and judged) as itself, never shadowed by an older header.
    `seq_lens`: the window lengths whose token-window layouts to store (metadata_windows.py)."""
    directory = Path(directory)
    if manifest is not None:
        shard_columns, block_columns = columns_from_shards(manifest.shards)
        fields = dataset_fields(manifest)
    assert shard_columns is not None and block_columns is not None and fields is not None
    shard_columns = dict(shard_columns)
    shard_columns["checksum_order"] = checksum_order(np.asarray(shard_columns["checksum"]))
    for name in ("sample_start", "token_start"):
        if name not in shard_columns:
            shard_columns[name] = _starts(np.asarray(shard_columns[name.split("_")[0] + "s"], dtype=np.int64))
    _check_lengths(directory, fields.get("token_column"), (), set(seq_lens))
    shards, shard_raw = _write_table(directory, "shards", SHARD_SCHEMA, shard_columns)
    blocks, block_raw = _write_table(directory, "blocks", BLOCK_SCHEMA, block_columns)
    block_chunks = _write_block_chunk_table(directory, block_raw, block_chunk_rows)
    stored = layout_columns(shard_columns)  # the default order's layout, so a rank's start is not O(shards)
    layout: dict | None = None
    layout_raw: dict[str, memoryview] | None = None
    if stored is not None:
        entry, layout_raw = _write_table(directory, "layout", LAYOUT_SCHEMA, stored[0])
        layout = {**entry, **stored[1]}
    chunks = (  # one chunk needs none: the header's hash of each column is its chunk's
        None
        if shards["rows"] <= chunk_rows
        else _write_chunk_table(
            directory, shard_raw, layout_raw, None if stored is None else LAYOUT_SCHEMA, shard_columns, chunk_rows
        )
    )
    windows = _windows(directory, shard_columns["tokens"], seq_lens, layout)
    totals = {
        key: int(np.asarray(shard_columns[key], dtype=np.int64).sum())
        for key in ("samples", "tokens", "bytes", "decoded_bytes", "blocks")
    }
    header = {
        "format": "tierflow",
        "format_version": METADATA_VERSION,
        **fields,
        "shards": shards,
        "blocks": blocks,
        "totals": totals,
        "summary": summary_fields(shard_columns),
        **({} if layout is None else {"layout": layout}),
        **({} if chunks is None else {"chunks": chunks}),
        **({"windows": windows} if windows else {}),
        "block_chunks": block_chunks,
        "manifest": None
        if manifest_bytes is None
        else {"size": len(manifest_bytes), "xxh3": xxhash.xxh3_128_hexdigest(manifest_bytes)},
    }
    header[HEADER_CHECKSUM_KEY] = header_checksum(header)
    return _publish(directory, METADATA_NAME, header_bytes(header))


def _check_lengths(where: object, token_column: str | None, stored: Iterable[str], wanted: set[int]) -> None:
    """Window lengths a header may store layouts for: of a token dataset, positive, at most MOST_LENGTHS
    together with those it stores (checked before a table is written)."""
    if not wanted:
        return
    if token_column is None:
        raise ValueError(f"{where}: window layouts (seq_len) need a token dataset (packed with a tokenizer)")
    if min(wanted) < 1:
        raise ValueError(f"seq_len must be >= 1, got {min(wanted)}")
    if len(set(stored)) + len(wanted) > MOST_LENGTHS:
        raise ValueError(f"{where}: a dataset stores layouts for at most {MOST_LENGTHS} window lengths")


def _windows(directory: Path, tokens: np.ndarray, seq_lens: Iterable[int], layout: dict | None) -> dict:
    """The `windows` entries of the lengths asked for (checked by `_check_lengths`), their tables written
    (none where no shard holds a window, or there is no layout)."""
    entries = {}
    for seq_len in sorted(set(seq_lens)):
        made = (
            None if layout is None else window_columns(np.asarray(tokens, dtype=np.int64), seq_len, layout["decoded"])
        )
        if made is not None:
            columns, fields = made
            entry, raw = _write_table(directory, table_kind(seq_len), WINDOWS_SCHEMA, columns)
            entries[str(seq_len)] = {**entry, "chunks": window_chunks(columns, raw), **fields}
    return entries


def window_chunks(columns: dict[str, np.ndarray], raw: dict[str, memoryview]) -> dict:
    """A window table entry's `chunks` (format/metadata_windows.py): each column's xxh3-128 a chunk (hex)
    and window_start at each chunk's first row."""
    hashes = _chunk_hashes("windows", raw, WINDOWS_SCHEMA, WINDOW_CHUNK_ROWS)
    return {
        "rows": WINDOW_CHUNK_ROWS,
        "columns": {name: [h.tobytes().hex() for h in hashes[f"windows.{name}"]] for name in raw},
        "starts": {"window_start": [int(v) for v in columns["window_start"][::WINDOW_CHUNK_ROWS]]},
    }


def dataset_fields(manifest: Manifest) -> dict:
    """The header's dataset-wide fields of a manifest (what `write_metadata` takes as `fields`)."""
    return {
        "dataset_id": manifest.dataset_id,
        "schema": schema_to_json(manifest.schema),
        "tokenizer": manifest.tokenizer,
        "token_column": manifest.token_column,
        "token_dtype": manifest.token_dtype,
        "eos_id": manifest.eos_id,
        "stats": manifest.stats,
    }


def header_bytes(header: dict) -> bytes:
    """A header as its file holds it (its checksum covers the canonical JSON, not these bytes)."""
    return json.dumps(header, indent=1).encode()


def _publish(directory: Path, name: str, data: bytes) -> Path:
    return write_atomically(directory / name, data)


def upgrade(directory: str | Path, seq_lens: Sequence[int] = ()) -> Path:
    """Write the version-3 metadata of the dataset in `directory` from its manifest.json, in place:
    tables under new names, the header last, atomically; manifest.json is kept (older readers). A crash
    leaves the old dataset as it was (at worst, unreferenced table files that gc removes). It keeps the
    window lengths stored and adds `seq_lens` (a version-2 token dataset asked for none gets those pack
    stores: `lengths_to_store`)."""
    directory = Path(directory)
    path = directory / MANIFEST_NAME
    try:
        raw = read_regular(path, max_manifest_bytes(), ManifestError)
    except FileNotFoundError:
        raise ManifestError(f"{path}: no manifest; {directory} holds no finished tierflow dataset") from None
    manifest = Manifest.from_bytes(raw, str(path))  # checked as any reader checks it
    lengths = lengths_to_store(seq_lens, _stored_lengths(directory), manifest.token_column)
    return write_metadata(directory, manifest, manifest_bytes=raw, seq_lens=lengths)


def _stored_lengths(directory: Path) -> list[int] | None:
    """The window lengths the directory's header stores layouts for (kept by an upgrade that rewrites
    it); None: it has no version-3 header yet."""
    if not has_metadata(directory):
        return None
    try:
        return [int(key) for key in (load_metadata(directory).header.get("windows") or {})]
    except ManifestError:
        return []


def update_header(directory: str | Path, seq_lens: Sequence[int] = ()) -> Path | None:
    """Bring the header of a version-3 dataset written by an older tierflow up to this one's, in place
    (`updated_header`): a table it lacks first, then the header, atomically (a crash leaves the dataset
    as it was, at worst with a table gc removes). None: nothing to add."""
    directory = Path(directory)
    header = updated_header(load_metadata(directory), directory, seq_lens)
    return None if header is None else _publish(directory, METADATA_NAME, header_bytes(header))


def updated_header(manifest: MappedManifest, directory: Path, seq_lens: Sequence[int] = ()) -> dict | None:
    """The header of `manifest` with what an older writer left out: the order's layout, or one that
    lists no member_samples (its table written to `directory`, where a remote dataset's upgrade
    uploads it from, before the header), the chunk table (above one chunk of shards; in place of
    chunk hashes held in the header, or again where an older tierflow's gc removed it), the block
    chunk table (likewise), and the summary. Every column is checked as any reader checks it before
    its hashes are rewritten; and the token-window layouts of `seq_lens` it does not store yet.
    None: nothing to add."""
    tables = manifest.tables
    before = {k: v for k, v in manifest.header.items() if k != HEADER_CHECKSUM_KEY}
    header = dict(before)
    layout_raw = None
    if header.get("layout") is None or layout_schema(header["layout"]) != LAYOUT_SCHEMA:  # none, or no member_samples
        stored = layout_columns({name: tables.column(name) for name in LAYOUT_COLUMNS})
        if stored is not None:
            entry, layout_raw = _write_table(directory, "layout", LAYOUT_SCHEMA, stored[0])
            header["layout"] = {**entry, **stored[1]}
    inline = any(header.get(table) is not None and "chunks" in header[table] for table in ("shards", "layout"))
    # it hashes the layout table just replaced, or an older tierflow's gc removed it
    stale = "chunks" in header and (layout_raw is not None or tables.chunks is None)
    step = header["chunks"]["rows_per_chunk"] if "chunks" in header else CHUNK_ROWS
    if inline or stale or ("chunks" not in header and tables.num_shards > step):
        header.pop("chunks", None)
        for table in ("shards", "layout"):
            if header.get(table) is not None:
                header[table] = {k: v for k, v in header[table].items() if k != "chunks"}
        if tables.num_shards > step:
            tables.checksums()  # no shard listed twice
            columns = {name: tables.column(name) for name in SHARD_SCHEMA.names}
            if layout_raw is None and tables.layout is not None:
                layout_raw = _bytes_of({name: tables.layout.column(name) for name in tables.layout.schema.names})
            header["chunks"] = _write_chunk_table(
                directory, _bytes_of(columns), layout_raw, header_layout_schema(header), columns, step
            )
    if "block_chunks" not in header or tables.block_chunks is None:
        # every column hashed whole against the header first, as a reader without the table checks it
        header["block_chunks"] = _write_block_chunk_table(
            directory,
            _bytes_of({name: tables.blocks.column(name) for name in BLOCK_SCHEMA.names}),
            header["block_chunks"]["rows_per_chunk"] if "block_chunks" in header else BLOCK_CHUNK_ROWS,
        )
    if header.get("summary") is None:
        header["summary"] = summary_fields({name: tables.column(name) for name in SUMMARY_COLUMNS})
    windows = header.get("windows") or {}
    wanted = {seq_len for seq_len in seq_lens if str(seq_len) not in windows}
    _check_lengths(manifest.where, header.get("token_column"), windows, wanted)
    added = _windows(directory, tables.column("tokens"), wanted, header.get("layout")) if wanted else {}
    if added:
        header["windows"] = {**windows, **added}
    restored = ("chunks" in before and tables.chunks is None) or (
        "block_chunks" in before and tables.block_chunks is None
    )  # the same table written again
    if header == before and not restored:
        return None
    header[HEADER_CHECKSUM_KEY] = header_checksum(header)
    return header


def _bytes_of(columns: dict[str, np.ndarray]) -> dict[str, memoryview]:
    return {name: np.ascontiguousarray(v).view(np.uint8).data for name, v in columns.items()}


def write_with_manifest(
    directory: str | Path, manifest: Manifest, legacy_max_shards: int | None = None, seq_lens: Sequence[int] = ()
) -> Path:
    """What pack publishes: the version-3 tables and header, then manifest.json last (version-2
    readers and tools) while the dataset has at most `legacy_max_shards` shards
    (LEGACY_MANIFEST_SHARDS); above that the header alone (a manifest of 10,000 shards is ~30 MB that
    a version-2 reader parses in ~1 s per process)."""
    directory = Path(directory)
    limit = LEGACY_MANIFEST_SHARDS if legacy_max_shards is None else legacy_max_shards
    if len(manifest.shards) > limit:
        # the header first: while an older pack's manifest.json is beside it, readers read that one (a
        # header recording none is current only alone), so a crash before the unlink leaves the old dataset
        path = write_metadata(directory, manifest, seq_lens=seq_lens)
        (directory / MANIFEST_NAME).unlink(missing_ok=True)
        return path
    raw = json.dumps(manifest.to_json(), indent=1).encode()  # the bytes `save` writes
    write_metadata(directory, manifest, manifest_bytes=raw, seq_lens=seq_lens)
    return manifest.save(directory)


def is_published(directory: str | Path) -> bool:
    """Whether a directory holds a finished dataset: a manifest.json, or a header that publishes
    none beside it (pack writes the header before manifest.json: a header that records one whose
    manifest is missing is an unfinished pack)."""
    directory = Path(directory)
    if (directory / MANIFEST_NAME).exists():
        return True
    if not has_metadata(directory):
        return False
    try:
        return json.loads((directory / METADATA_NAME).read_bytes()).get("manifest") is None
    except (ValueError, AttributeError):
        return True  # a damaged header is not for pack to overwrite silently


def referenced_tables(directory: str | Path) -> set[str]:
    """The table files the directory's header names (gc keeps them, whether or not it is current)."""
    try:
        raw = (Path(directory) / METADATA_NAME).read_bytes()  # an I/O error propagates: never gc on a guess
    except FileNotFoundError:
        return set()
    return header_tables(raw)


def header_tables(raw: bytes) -> set[str]:
    """The table files a header's bytes name, read leniently (a damaged header names none)."""
    try:
        d = json.loads(raw)
        return {e["file"] for e in table_entries(d) if isinstance(e.get("file"), str)}
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return set()


def table_files(directory: str | Path) -> Iterable[str]:
    """The metadata table files of the directory (for gc: those its header does not name may go)."""
    return (
        p.name for p in Path(directory).iterdir() if p.name.startswith(TABLE_PREFIX) and p.name.endswith(TABLE_SUFFIX)
    )
