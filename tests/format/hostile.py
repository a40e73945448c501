"""Forging hostile datasets for tests: a shard's bytes changed, and a manifest that vouches for them.

The attacker of issue 18 controls both files, so every hash is recomputed: block xxh3-64s, the
shard's xxh3-128 (and with it its name), the dataset id and the manifest checksum. What is left
to catch the lie is what the reader checks against the bytes themselves.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from collections.abc import Callable
from typing import Any

import xxhash

from tierflow.format._ipcmeta import batch_claims
from tierflow.format.manifest import MANIFEST_NAME, compute_dataset_id, manifest_checksum
from tierflow.format.shard import block_lists

_CONTINUATION = b"\xff\xff\xff\xff"


def record_batch_metadata(data: bytes | bytearray, offset: int, length: int, first: bool) -> tuple[int, int]:
    """(start, size) of the record batch message's flatbuffer inside block bytes [offset, offset+length)."""
    pos = offset + (8 if first else 0)
    while pos < offset + length:
        assert data[pos : pos + 4] == _CONTINUATION
        size = struct.unpack_from("<i", data, pos + 4)[0]
        meta = bytes(data[pos + 8 : pos + 8 + size])
        try:
            batch_claims(meta)
        except ValueError:  # the schema message
            pos += 8 + size
            continue
        return pos + 8, size
    raise AssertionError("no record batch in the block")


def set_rows(data: bytearray, shard: dict, block: int, rows: int) -> None:
    """Make block `block` claim `rows` rows: its batch length and every field node of the old
    length (the top-level columns) are overwritten; so is the manifest's count."""
    blocks = shard["blocks"]
    start, size = record_batch_metadata(data, blocks["offset"][block], blocks["length"][block], block == 0)
    old = struct.pack("<q", blocks["rows"][block])
    meta = bytes(data[start : start + size])
    data[start : start + size] = meta.replace(old, struct.pack("<q", rows))
    shard["samples"] += rows - blocks["rows"][block]
    blocks["rows"][block] = rows


def forge(
    root: Path, shard_index: int, patch: Callable[[bytearray, dict], None], change: Callable[[dict], None] | None = None
) -> dict:
    """Apply `patch(shard bytes, shard entry)` to one shard of the dataset at `root` (same length),
    then `change(manifest)`, and make every hash agree. Returns the new shard entry."""
    path = root / MANIFEST_NAME
    m = listed(json.loads(path.read_text()))
    shard = m["shards"][shard_index]
    old = root / shard["name"]
    data = bytearray(old.read_bytes())
    patch(data, shard)
    blocks = shard["blocks"]
    blocks["checksum"] = [
        xxhash.xxh3_64_hexdigest(bytes(data[o : o + n])) for o, n in zip(blocks["offset"], blocks["length"])
    ]
    shard["checksum"] = xxhash.xxh3_128_hexdigest(bytes(data))
    shard["name"] = f"shard-{shard['checksum']}.arrow"
    old.unlink()
    (root / shard["name"]).write_bytes(bytes(data))
    if change is not None:
        change(m)
    _vouch(path, m)
    return shard


def forge_manifest(root: Path, change: Callable[[dict], None]) -> dict:
    """Apply `change(manifest)` to the dataset at `root` and make its dataset id and checksum agree."""
    path = root / MANIFEST_NAME
    m = listed(json.loads(path.read_text()))
    change(m)
    _vouch(path, m)
    return m


def listed(m: dict) -> dict:
    """Manifest JSON `m` with every shard's blocks as JSON lists (format version 1's form, which
    readers still take), so a test edits a column in place."""
    for shard in m.get("shards", []):
        shard["blocks"] = block_lists(shard["blocks"])
    return m


def _vouch(path: Path, m: dict) -> None:
    """Write manifest `m` to `path` with the id and checksum its (changed) contents would have."""
    m.get("stats", {}).pop("samples", None)
    m["dataset_id"] = compute_dataset_id(m["schema"], m["tokenizer"], [s["checksum"] for s in m["shards"]])
    m["manifest_checksum"] = manifest_checksum(m)
    path.write_text(json.dumps(m))


def _raw_columns(path: Path, d: dict, table: str) -> dict[str, memoryview] | None:
    import pyarrow as pa

    from tierflow.format import metadata_writer

    if d.get(table) is None:
        return None
    batch = pa.ipc.open_file(pa.memory_map(str(path / d[table]["file"]))).get_batch(0)
    return {name: metadata_writer._column_bytes(batch.column(name)) for name in batch.schema.names}


def _running_starts(shards: dict[str, memoryview]) -> dict:
    import numpy as np

    return {name: np.frombuffer(shards[name], dtype="<i8") for name in ("sample_start", "token_start", "first_block")}


def _without_chunks(d: dict) -> dict:
    d = {k: v for k, v in d.items() if k != "chunks"}
    for table in ("shards", "layout"):
        if d.get(table) is not None:
            d[table] = {k: v for k, v in d[table].items() if k != "chunks"}
    return d


def rechunk(path: Path, d: dict) -> dict:
    """The header `d` of the version-3 dataset at `path` with its chunk table rewritten over the shard
    and layout tables it now names (unverified, as they lie): what a forger who rewrote a table writes
    next, so only the checks on the values are left to catch it. A header of one chunk has none."""
    from tierflow.format import metadata_writer
    from tierflow.format.metadata_header import header_layout_schema

    if d.get("chunks") is None:  # one chunk: the header's hash of each column is its chunk's
        return d
    shards = _raw_columns(path, d, "shards")
    assert shards is not None
    schema = header_layout_schema(d)
    rows = d["chunks"]["rows_per_chunk"]
    chunks = metadata_writer._write_chunk_table(
        path, shards, _raw_columns(path, d, "layout"), schema, _running_starts(shards), rows
    )
    return {**_without_chunks(d), "chunks": chunks}


def inline_chunks(path: Path, d: dict, rows: int = 1 << 16) -> dict:
    """The header `d` as tierflow wrote it before the chunk table: each chunk's hash in the shard and
    layout entries (hex lists), the running sums at each chunk's first row in the shards' entry, and
    no block chunk table."""
    import xxhash

    d = {k: v for k, v in _without_chunks(d).items() if k != "block_chunks"}
    for table in ("shards", "layout"):
        raw = _raw_columns(path, d, table)
        if raw is None:
            continue
        hashes = {}
        for name, data in raw.items():
            width = max(data.nbytes // max(d[table]["rows"], 1), 1) * rows
            hashes[name] = [xxhash.xxh3_128_hexdigest(data[at : at + width]) for at in range(0, len(data), width)]
        d[table] = {**d[table], "chunks": {"rows": rows, "columns": hashes}}
    shards = _raw_columns(path, d, "shards")
    assert shards is not None
    starts = {name: [int(v) for v in values[::rows]] for name, values in _running_starts(shards).items()}
    d["shards"]["chunks"]["starts"] = starts
    return d


def rewrite_tables(out: Path, source: Path, edit: Callable[[dict, dict], None], **rows: int) -> None:
    """Rewrite the tables of the dataset at `out` through the writer, from the manifest.json at
    `source`, with `edit(shard columns, block columns)` applied and every hash (and running sum)
    recomputed from what the edit left; `rows`: the writer's chunk sizes (`chunk_rows`,
    `block_chunk_rows`)."""
    from tierflow.format import metadata_writer
    from tierflow.format.manifest import Manifest

    m = Manifest.from_bytes((source / MANIFEST_NAME).read_bytes(), str(source))
    shards, blocks = metadata_writer.columns_from_shards(m.shards)
    edit(shards, blocks)
    fields = {**metadata_writer.dataset_fields(m), "stats": {}}
    metadata_writer.write_metadata(out, shard_columns=shards, block_columns=blocks, fields=fields, **rows)


def write_header(out: Path, d: dict) -> None:
    """Write header `d` into the dataset at `out` with the checksum its contents would have."""
    from tierflow.format import metadata as md
    from tierflow.format import metadata_writer

    d.pop(md.HEADER_CHECKSUM_KEY, None)
    d[md.HEADER_CHECKSUM_KEY] = md.header_checksum(d)
    (out / md.METADATA_NAME).write_bytes(metadata_writer.header_bytes(d))


def read_header(out: Path) -> dict:
    from tierflow.format import metadata as md

    return json.loads((out / md.METADATA_NAME).read_bytes())


def copy_dataset(source: Path, tmp_path: Path, name: str = "ds") -> Path:
    import shutil

    out = tmp_path / name
    shutil.copytree(source, out)
    return out


def assert_same_order(stored: Any, computed: Any) -> None:
    """Two TieredDatasets of one dataset, one read through its stored layout and one computing it, read
    the same order: the same config and cursor hash, partitions and the shards' future uses."""
    assert stored.order.layout._stored is not None and computed.order.layout._stored is None
    assert stored.order.config == computed.order.config and stored.order.config_hash == computed.order.config_hash
    a, b = stored.order.layout, computed.order.layout
    assert a.partition_sizes.tolist() == b.partition_sizes.tolist()
    for p in range(a.partitions):
        assert a.partition_shards[p].tolist() == b.partition_shards[p].tolist()
    assert stored.future_shard_uses(horizon_batches=200) == computed.future_shard_uses(horizon_batches=200)
