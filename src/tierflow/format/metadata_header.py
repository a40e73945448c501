"""A version-3 dataset's header (`metadata.json`, format/metadata.py): its fields, the schemas of
the tables it names, its checksum and the checks every reader makes of it before mapping a table."""

from __future__ import annotations

import json
from collections.abc import Callable

import pyarrow as pa
import xxhash

from tierflow.errors import ManifestError
from tierflow.format.manifest import _check_fields
from tierflow.format.metadata_windows import check_windows_entry, window_entries
from tierflow.format.metadata_layout import (
    layout_schema,
    check_chunk_starts,
    check_layout_entry,
    check_table_entry,
    is_count,
)
from tierflow.format.metadata_summary import check_summary
from tierflow.format.shard import MAX_COUNT

METADATA_NAME = "metadata.json"
METADATA_VERSION = 3
HEADER_CHECKSUM_KEY = "header_checksum"
MAX_HEADER_BYTES = 16 << 20
"""A header is a few KB (schema, tokenizer, stats); larger is refused unread."""
LEGACY_MANIFEST_SHARDS = 10_000
"""Up to this many shards pack writes manifest.json beside the version-3 metadata."""

SHARD_SCHEMA = pa.schema(
    [
        ("checksum", pa.binary(16)),
        ("decoded_checksum", pa.binary(16)),
        ("compression", pa.uint8()),
        ("samples", pa.int64()),
        ("bytes", pa.int64()),
        ("decoded_bytes", pa.int64()),
        ("tokens", pa.int64()),
        ("sample_start", pa.int64()),
        ("token_start", pa.int64()),
        ("first_block", pa.int64()),
        ("blocks", pa.int64()),
        ("largest_rows", pa.int64()),
        ("tokens_known", pa.uint8()),
        ("block_digest", pa.uint64()),
        ("checksum_order", pa.int64()),
    ]
)
BLOCK_SCHEMA = pa.schema(
    [("length", pa.uint32()), ("rows", pa.uint32()), ("checksum", pa.uint64()), ("tokens", pa.uint32())]
)
RUNNING = {"samples": "sample_start", "tokens": "token_start", "blocks": "first_block"}
"""Each count column and the column of its running sums (the header holds the sums at each chunk's start)."""
RUNNING_COLUMNS = tuple(RUNNING.values())


def chunk_schema(layout: pa.Schema | None) -> pa.Schema:
    """The chunk table's columns: per chunk of the shard table (and of the layout's, the same rows),
    the xxh3-128 of each column's chunk (`shards.<column>`, `layout.<column>`) and the shards' running
    sums at its first row, what a chunk's counts are checked against."""
    hashes = [(f"shards.{name}", pa.binary(16)) for name in SHARD_SCHEMA.names]
    running = [(name, pa.int64()) for name in RUNNING_COLUMNS]
    layout_hashes = [] if layout is None else [(f"layout.{name}", pa.binary(16)) for name in layout.names]
    return pa.schema(hashes + running + layout_hashes)


BLOCK_CHUNK_SCHEMA = pa.schema([(f"blocks.{name}", pa.binary(16)) for name in BLOCK_SCHEMA.names])
"""The block chunk table's columns: per chunk of the block table's rows, the xxh3-128 of each
column's chunk, what a shard's block rows are checked against when it is first used."""


def header_layout_schema(d: dict) -> pa.Schema | None:
    return None if d.get("layout") is None else layout_schema(d["layout"])


def table_keys(d: dict) -> tuple[str, ...]:
    """The header's entries that name a table file (gc keeps them, a node downloads them)."""
    return tuple(
        key for key in ("shards", "blocks", "layout", "chunks", "block_chunks") if isinstance(d.get(key), dict)
    )


def table_entries(d: dict) -> list[dict]:
    """Every entry of the header that names a table file: those of `table_keys` and the window tables'."""
    return [d[key] for key in table_keys(d)] + window_entries(d)


def header_checksum(d: dict) -> str:
    body = {k: v for k, v in d.items() if k != HEADER_CHECKSUM_KEY}
    return xxhash.xxh3_128_hexdigest(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def parse_header(raw: bytes, where: str) -> dict:
    """The header's fields, checked: JSON, format and version, its checksum, the types of every
    field a reader uses. ManifestError naming `where` otherwise."""

    def fail(msg: str) -> ManifestError:
        return ManifestError(f"{where}: {msg}")

    if len(raw) > MAX_HEADER_BYTES:
        raise fail(f"{len(raw)} bytes, more than the {MAX_HEADER_BYTES} a metadata header may have; refused")
    try:
        d = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise fail(f"not valid JSON ({e})") from None
    except RecursionError:
        raise fail("JSON nested too deeply to be a metadata header") from None
    if not isinstance(d, dict) or d.get("format") != "tierflow":
        raise fail('not a tierflow metadata header (missing "format": "tierflow")')
    if d.get("format_version") != METADATA_VERSION or type(d.get("format_version")) is not int:
        raise fail(
            f"unknown format_version {d.get('format_version')!r:.40}; this header reader reads "
            f"version {METADATA_VERSION}"
        )
    try:
        recorded = d.get(HEADER_CHECKSUM_KEY)
        if not isinstance(recorded, str) or recorded != header_checksum(d):
            raise fail(
                f"{HEADER_CHECKSUM_KEY} {recorded!r:.40} does not match the header's contents "
                f"(damaged or edited; run `tierflow upgrade` again, or restore it)"
            )
    except (ValueError, TypeError, OverflowError, RecursionError) as e:
        raise fail(f"the header does not serialise ({type(e).__name__}: {e})") from None
    _check_fields(d, fail)
    if not isinstance(d.get("dataset_id"), str):
        raise fail("dataset_id is missing")
    for table in table_keys(d) if isinstance(d.get("chunks"), dict) else ():
        if table != "chunks" and "chunks" in d[table]:
            raise fail(f"{table}.chunks is listed beside the chunk table")
    for table, schema in (("shards", SHARD_SCHEMA), ("blocks", BLOCK_SCHEMA)):
        check_table_entry(d.get(table), table, schema, fail)
    check_chunk_starts(d["shards"], RUNNING_COLUMNS, fail)
    if d.get("layout") is not None:  # the order's stored layout (metadata_layout.py); absent before it
        check_table_entry(d["layout"], "layout", layout_schema(d["layout"]), fail)
    if d.get("chunks") is not None:
        _check_chunk_table(d, "chunks", chunk_schema(header_layout_schema(d)), "shards", fail)
    if d.get("block_chunks") is not None:
        _check_chunk_table(d, "block_chunks", BLOCK_CHUNK_SCHEMA, "blocks", fail)
    beside = d.get("manifest")
    if beside is not None and not (
        isinstance(beside, dict) and is_count(beside.get("size")) and isinstance(beside.get("xxh3"), str)
    ):
        raise fail('"manifest" is not null or the size and hash of the manifest.json beside it')
    totals = d.get("totals")
    if not isinstance(totals, dict) or not all(
        is_count(totals.get(k)) for k in ("samples", "tokens", "bytes", "decoded_bytes", "blocks")
    ):
        raise fail("totals are not counts of samples, tokens, bytes, decoded_bytes and blocks")
    if totals["blocks"] != d["blocks"]["rows"]:
        raise fail(f"totals.blocks = {totals['blocks']}, but the block table has {d['blocks']['rows']} rows")
    for key, total in (("samples", totals["samples"]), ("tokens", totals["tokens"])):
        stats = d.get("stats") or {}
        if type(stats.get(key)) is int and stats[key] != total:
            raise fail(f"stats.{key} = {stats[key]}, but the shards' {key} sum to {total}")
    check_summary(d.get("summary"), d["shards"]["rows"], fail)
    if d.get("layout") is not None:
        check_layout_entry(d["layout"], d["shards"]["rows"], totals["samples"], fail)
    if d.get("windows") is not None:  # token-window layouts (metadata_windows.py); absent before them
        check_windows_entry(d["windows"], d["shards"]["rows"], fail)
    return d


def _check_chunk_table(d: dict, key: str, schema: pa.Schema, table: str, fail: Callable[[str], Exception]) -> None:
    """A chunk table's entry (`chunks`: of the shard and layout tables, written since chunk hashes left
    the header; `block_chunks`: of the block table): its columns those of the tables it covers, a row
    a chunk of `rows_per_chunk` rows of `table`."""
    entry = d[key]
    check_table_entry(entry, key, schema, fail)
    if "chunks" in entry:
        raise fail(f"{key} lists chunks of its own")
    step = entry.get("rows_per_chunk")
    if type(step) is not int or not 0 < step < MAX_COUNT:
        raise fail(f"{key}.rows_per_chunk is not a positive count")
    if entry["rows"] != -(-d[table]["rows"] // step):
        raise fail(
            f"{key} has {entry['rows']} rows, not one a chunk of {step} of the {d[table]['rows']} rows of {table}"
        )
