"""Token-window layouts stored with the metadata, one per window length (issue 38), so a language
model's order starts in O(1) at a million shards, as the rows order does.

A token-window order (loader/tokens.py) deals the shards by their windows of L tokens, counts that
depend on L: its layout, the counts and the running sums that locate a window are O(shards) to make
(~0.25 s at a million shards, in every rank and worker). `tierflow pack` makes them once for each
L of `DEFAULT_LENGTHS` (or those `--seq-len L` names instead), `tierflow upgrade --seq-len L` adds
one later; each writes:

- `metadata-windows-<L>-<xxh3-128>.arrow`, one row a shard: the layout table's columns
  (metadata_layout.py; `member_samples` holds the windows of the shard `by_partition` lists) and
  `window_start` (shard s's first global window id, in shard order);
- the header's `windows` entry, {"<L>": entry}: the table's file, size, rows and column hashes, its
  chunk hashes (`chunks`: CHUNK_ROWS rows a chunk, and `starts`, window_start at each chunk's first
  row) and the layout fields of the rows order's entry for these counts, and `seq_len`.

It is read as the rows order's layout is (StoredLayout), its counts computed from the shard table's
`tokens` as shards are asked for (`WindowCounts`). A chunk of `window_start` is checked the first time
a row of it is used: from its chunk start, rising by its shards' windows, to the next chunk's start
(the last to the sizes' sum); every chunk checked is the whole column checked. A loader of another L
computes its layout as before. `tierflow verify` recomputes every stored L and compares.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Callable, Iterable

import numpy as np
import pyarrow as pa

from tierflow.errors import ManifestError
from tierflow.format.metadata_layout import (
    LAYOUT_SCHEMA,
    StoredLayout,
    check_layout_entry,
    check_table_entry,
    layout_parts,
    ordered_counts,
)
from tierflow.format.metadata_table import MappedTable, ShardRows

WINDOWS_SCHEMA = pa.schema([*LAYOUT_SCHEMA, pa.field("window_start", pa.int64())])
CHUNK_ROWS = 1 << 12
"""Rows a chunk of a window table holds: 64 chunk hashes a column at a million shards (~11 KB of header a length)."""
MOST_LENGTHS = 8
"""The most window lengths a header stores layouts for."""
DEFAULT_LENGTHS = (2048, 4096, 8192)
"""What a tokenized pack stores when not told (`pack(seq_len=None)`): the context lengths most
pretraining runs use, so their loaders start in O(1) without the user knowing to ask. Each costs ~26
bytes a shard (~26 MB at a million shards) and `verify` one more layout recomputed."""


def lengths_to_store(asked: Iterable[int], stored: Iterable[int] | None, token_column: str | None) -> list[int]:
    """The window lengths an upgrade writes: those asked and those its version-3 header stores; a token
    dataset with no such header yet (`stored` None: version 2) asked for none gets DEFAULT_LENGTHS, as
    `tierflow pack` stores them (a version-3 one keeps what its pack chose)."""
    lengths = [*asked, *(stored or ())]
    return list(DEFAULT_LENGTHS) if not lengths and stored is None and token_column is not None else lengths


def windows_of(tokens: Any, seq_len: int) -> Any:
    """Windows of `seq_len` in shards of `tokens` tokens: each needs L + 1 tokens, consecutive ones share
    one (loader/tokens.py counts with it too)."""
    return np.maximum(0, (np.asarray(tokens, dtype=np.int64) - 1) // seq_len)


def table_kind(seq_len: int) -> str:
    return f"windows-{seq_len}"


def window_columns(
    tokens: np.ndarray, seq_len: int, decoded: str
) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
    """A window table's columns and its entry's layout fields (pack, upgrade); None: no shard holds a window."""
    counts = windows_of(tokens, seq_len)
    parts = layout_parts(counts, decoded)
    if parts is None:
        return None
    columns, fields = parts
    columns["window_start"] = np.concatenate(([0], np.cumsum(counts[:-1]))).astype(np.int64)
    return columns, {**fields, "seq_len": seq_len}


def check_windows_entry(windows: Any, shards: int, fail: Callable[[str], Exception]) -> None:
    """The header's `windows`: {"<L>": a window table's entry}, each checked as the layout's is."""
    if not isinstance(windows, dict) or len(windows) > MOST_LENGTHS:
        raise fail(f'"windows" is not an object of at most {MOST_LENGTHS} window lengths')
    for key, entry in windows.items():
        if not key.isdigit() or str(int(key)) != key or not 0 < int(key) < 1 << 31:
            raise fail(f"windows lists {key!r:.20}, not a window length")
        kind = table_kind(int(key))
        check_table_entry(entry, kind, WINDOWS_SCHEMA, fail)
        if entry.get("seq_len") != int(key):
            raise fail(f"{kind}.seq_len is not {key}")
        sizes = entry.get("sizes")
        total = sum(sizes) if isinstance(sizes, list) and all(type(v) is int for v in sizes) else -1
        check_layout_entry(entry, shards, total, fail)
        chunks = entry.get("chunks")
        starts = chunks.get("starts") if isinstance(chunks, dict) else None
        values = starts.get("window_start") if isinstance(starts, dict) else None
        count = -(-shards // CHUNK_ROWS)
        if (
            chunks is None
            or chunks.get("rows") != CHUNK_ROWS
            or not isinstance(values, list)
            or len(values) != count
            or not ordered_counts(values)
            or (values and (values[0] != 0 or values[-1] > total))
        ):
            raise fail(f"{kind}.chunks does not list the {count} chunks' window starts, rising from 0")


def window_entries(header: dict) -> list[dict]:
    """The window tables' entries of a header, read leniently (gc keeps their files, a node downloads them)."""
    windows = header.get("windows")
    return [e for e in windows.values() if isinstance(e, dict)] if isinstance(windows, dict) else []


class WindowCounts:
    """Each shard's windows of one length, from the shard table's `tokens` as shards are asked for
    (`per_shard`, as ShardRows): what a window order over a stored layout counts with."""

    per_shard = True

    def __init__(self, tokens: ShardRows, seq_len: int) -> None:
        self.tokens, self.seq_len = tokens, seq_len

    def __reduce__(self) -> tuple[Any, ...]:
        return (_counts_of, (self.tokens.manifest, self.seq_len))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, shards: Any) -> Any:
        counts = windows_of(self.tokens[shards], self.seq_len)
        return int(counts) if isinstance(shards, (int, np.integer)) else counts


def _counts_of(manifest: Any, seq_len: int) -> WindowCounts:
    stored = manifest.tables.stored_layout(seq_len)
    if stored is None:
        raise ValueError(f"{manifest.where}: its metadata no longer stores the layout of windows of {seq_len}")
    return stored.counts


class StoredWindowStarts:
    """Where global windows start in the token stream (loader/tokens.py `WindowStarts`' answer) from a
    stored `window_start`: a binary search over the mapped column, the rows it lands on checked, then
    each shard's `token_start`; nothing per shard is made."""

    def __init__(self, table: MappedTable, entry: dict, tables: Any) -> None:
        self.table, self.tables = table, tables
        self.seq_len: int = entry["seq_len"]
        self.chunk_starts = entry["chunks"]["starts"]["window_start"]
        self.total = int(sum(entry["sizes"]))

    def check(self, c: int, lo: int, v: np.ndarray) -> str | None:
        """Chunk c of window_start: from the chunk's start, rising by its shards' windows to the next one's."""
        if not v.size:
            return None
        counts = windows_of(self.tables.rows("tokens")[lo : lo + v.size], self.seq_len)
        end = int(self.chunk_starts[c + 1]) if c + 1 < len(self.chunk_starts) else self.total
        rising = int(v[0]) == int(self.chunk_starts[c]) and bool(np.array_equal(v[1:], v[:-1] + counts[:-1]))
        if rising and int(v[-1]) + int(counts[-1]) == end:
            return None
        return f"window_start, rows {lo}-{lo + v.size - 1}, is not the running sum of the shards' windows of {self.seq_len}"

    def starts_of(self, shards: np.ndarray) -> np.ndarray:
        """The first global window id of each of `shards`."""
        return self.table.at("window_start", shards, self.check)

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        """Token starts of int64 window ids (each inside [0, windows))."""
        shard = self.table.search("window_start", ids, self.check)
        starts = self.tables.at("token_start", shard)
        starts += (ids - self.table.raw("window_start")[shard]) * self.seq_len
        return starts


def window_layout(tables: Any, seq_len: int) -> StoredLayout | None:
    """The stored layout of windows of `seq_len` of mapped tables (MetadataTables.stored_layout); None: none stored."""
    windows = tables.header.get("windows") or {}
    entry = windows.get(str(seq_len))
    if entry is None:
        return None
    table = MappedTable(tables.directory, entry, WINDOWS_SCHEMA, tables.where)
    starts = StoredWindowStarts(table, entry, tables)
    stored = StoredLayout(table, entry, WindowCounts(tables.rows("tokens"), seq_len), tables.where, starts.starts_of)
    stored.seq_len = seq_len
    stored.window_starts = starts
    return stored


def verify_windows(tables: Any) -> list[str]:
    """Every problem with a dataset's stored window layouts: their columns against their hashes and
    checks, and each recomputed from the tokens column and compared (`tierflow verify`)."""
    problems: list[str] = []
    windows = tables.header.get("windows") or {}
    if not windows:
        return problems
    layout = tables.header.get("layout")
    for key, entry in windows.items():
        where = f"{tables.where}: {entry['file']}"
        try:
            stored = tables.stored_layout(int(key))
            columns = {
                "partition": stored.shard_partition,
                "window_start": stored.table.column("window_start", stored.window_starts.check),
                **{name: stored.table.column(name) for name in ("by_partition", "member_samples")},
            }
            wanted = window_columns(tables.column("tokens"), int(key), layout["decoded"] if layout else "")
        except ManifestError as e:
            problems.append(str(e))
            continue
        if wanted is None:
            problems.append(f"{where}: no shard holds a window of {key} tokens, yet a layout of them")
            continue
        fields = wanted[1]
        problems += [
            f"{where}: {key}.{name} is not the order's (recomputed from the tokens column)"
            for name in ("partitions", "starts", "sizes", "nonempty", "digest", "decoded", "seq_len")
            if entry.get(name) != fields[name]
        ]
        if not all(np.array_equal(columns[name], wanted[0][name]) for name in WINDOWS_SCHEMA.names):
            problems.append(
                f"{where}: the shards' partitions, windows or window starts are not the order's (recomputed)"
            )
    return problems
