"""The order's partition layout stored with version-3 metadata (issue 38), so a rank's start is not
O(shards).

The default order deals the shards to P canonical partitions by longest-processing-time over every
shard (order/layout.py): ~0.2 s at a million shards, in every rank and worker, plus sha256 digests
of the per-shard columns for the cursor's config. Pack and `tierflow upgrade` compute it once, for
the order a dataset gets when nothing is chosen (rows as samples, the default partition count), and
write it as a third table beside the header's entry:

- `metadata-layout-<xxh3-128>.arrow`, one row a shard: `partition` (the shard's partition),
  `by_partition` (the shards sorted by partition, ascending within one: partition p's shards are
  rows starts[p]:starts[p+1]) and `member_samples` (the samples of the shard `by_partition` lists in
  that row: a partition's counts lie together, as its shards do);
- the header's `layout` entry: the table's file, size, rows and column hashes (as the other two),
  `partitions`, `starts` (P + 1 row numbers), `sizes` (each partition's samples), `nonempty` (the
  shards holding a sample), `digest` (the layout's, `PartitionLayout.digest`) and `decoded` (the group
  order's digest of the decoded sizes).

Reading it is paid as the other tables are: each chunk of a column hashed once when a row of it is
first used, `partition` range-checked. A partition's rows are checked (in range, ascending, adding
up to its size) the first time the order reads that partition, and a window's shards (theirs: each
shard's partition, its count against the shard table's) the first time the order reads that window,
so a rank touches the rows of the partitions and windows it reads, never a whole column. `sizes`
must add up to the dataset's samples (at open). A table written before `member_samples` (two
columns, no `nonempty`) reads as before, its counts gathered from the shard table. A dataset
without the entry (written before it, or with no non-empty shard) computes its layout as before; an
order of other counts (token windows) or another partition count computes its own. `tierflow verify` recomputes the layout and
compares every part of it.
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import numpy as np
import pyarrow as pa

from tierflow.errors import ManifestError
from tierflow.format.shard import MAX_COUNT

LAYOUT_SCHEMA = pa.schema([("partition", pa.uint16()), ("by_partition", pa.int64()), ("member_samples", pa.int64())])
LAYOUT_SCHEMA_BEFORE_MEMBERS = pa.schema([LAYOUT_SCHEMA.field(0), LAYOUT_SCHEMA.field(1)])
"""The layout table as written before `member_samples`."""
LAYOUT_COLUMNS = ("samples", "decoded_bytes", "largest_rows")
"""The shard-table columns the layout is made from (`layout_columns`)."""
TABLE_PREFIX = "metadata-"
TABLE_SUFFIX = ".arrow"
MOST_PARTITIONS = 64
"""The most partitions the default order has (`default_partitions`)."""


def is_count(v: Any) -> bool:
    return type(v) is int and 0 <= v < MAX_COUNT


def ordered_counts(values: list, falling: bool = False) -> bool:
    """Whether a header's list holds counts in order (rising, or with `falling` falling), checked in C
    rather than a Python step an element (a million-shard header lists hundreds): ints only, sorted,
    its lowest and highest counts, so every one is."""
    if not set(map(type, values)) <= {int} or values != sorted(values, reverse=falling):
        return False
    return not values or (is_count(values[0]) and is_count(values[-1]))


def check_table_entry(entry: Any, table: str, schema: pa.Schema, fail: Callable[[str], Exception]) -> None:
    if not isinstance(entry, dict):
        raise fail(f'"{table}" is not an object')
    name = entry.get("file")
    if (
        not isinstance(name, str)
        or not name.startswith(f"{TABLE_PREFIX}{table}-")
        or not name.endswith(TABLE_SUFFIX)
        or "/" in name
        or "\\" in name
        or ".." in name
    ):
        raise fail(
            f"{table}.file {name!r:.80} is not a metadata table inside the dataset (paths, '..' and URLs are refused)"
        )
    if not is_count(entry.get("rows")) or not is_count(entry.get("size")):
        raise fail(f"{table}.rows or {table}.size is not a count")
    hashes = entry.get("columns")
    if (
        not isinstance(hashes, dict)
        or set(hashes) != set(schema.names)
        or not all(isinstance(v, str) for v in hashes.values())
    ):
        raise fail(f"{table}.columns does not list a hash for each of {schema.names}")
    chunks = entry.get("chunks")
    if chunks is None:  # written before chunks: one hash a column
        return
    step = chunks.get("rows") if isinstance(chunks, dict) else None
    if type(step) is not int or not 0 < step < MAX_COUNT:
        raise fail(f"{table}.chunks.rows is not a positive count")
    count = -(-entry["rows"] // step)
    hashes = chunks.get("columns")
    if (
        not isinstance(hashes, dict)
        or set(hashes) != set(schema.names)
        or not all(isinstance(v, list) and len(v) == count and set(map(type, v)) <= {str} for v in hashes.values())
    ):
        raise fail(f"{table}.chunks.columns does not list {count} chunk hashes for each of {schema.names}")


def check_chunk_starts(entry: dict, names: Sequence[str], fail: Callable[[str], Exception]) -> None:
    """The shard table's running sums at each chunk's first row: from 0, never falling (a chunk's
    rows are checked against them when it is first used)."""
    chunks = entry.get("chunks")
    if chunks is None:
        return
    starts = chunks.get("starts")
    count = len(chunks["columns"][names[0]]) if names else 0
    if not isinstance(starts, dict) or set(starts) != set(names):
        raise fail(f"shards.chunks.starts does not list the running sums {list(names)}")
    for name, values in starts.items():
        if (
            not isinstance(values, list)
            or len(values) != count
            or not ordered_counts(values)
            or (values and values[0] != 0)
        ):
            raise fail(f"shards.chunks.starts.{name} is not {count} running sums rising from 0")


def layout_schema(entry: Any) -> pa.Schema:
    """The schema of the layout table a header's entry describes: its column hashes name its columns."""
    hashes = entry.get("columns") if isinstance(entry, dict) else None
    before = isinstance(hashes, dict) and set(hashes) == set(LAYOUT_SCHEMA_BEFORE_MEMBERS.names)
    return LAYOUT_SCHEMA_BEFORE_MEMBERS if before else LAYOUT_SCHEMA


def default_partitions(nonempty_shards: int) -> int:
    """64, or the largest power of two the dataset's non-empty shards allow."""
    partitions = 1
    while partitions * 2 <= min(MOST_PARTITIONS, nonempty_shards):
        partitions *= 2
    return partitions


def largest_blocks(decoded: np.ndarray, largest_rows: np.ndarray, samples: np.ndarray) -> np.ndarray:
    """Each shard's largest block, decoded, estimated from its columns (the group order's floor)."""
    return decoded * largest_rows // np.maximum(samples, 1)


class LargestBlocks:
    """`largest_blocks` of every shard, computed for the shards asked for (`values[shards]`), so a
    rank does not hold (or make) a million shards' worth it reads a few partitions of; the order
    takes it as its `block_bytes` (order/order.py: anything with `per_shard`)."""

    per_shard = True

    def __init__(self, decoded: np.ndarray, largest_rows: np.ndarray, samples: np.ndarray) -> None:
        self.decoded, self.rows, self.samples = decoded, largest_rows, samples
        self.manifest: Any = None
        self.total: int | None = None

    @classmethod
    def of_mapped(cls, manifest: Any) -> LargestBlocks:
        """Of a MappedManifest's columns, their chunks checked as shards are asked for; the mean from
        the header's summary when it has one. It pickles as the manifest (its directory)."""
        rows = manifest.tables.rows
        values = cls(*(rows(name) for name in ("decoded_bytes", "largest_rows", "samples")))
        values.manifest = manifest
        summary = manifest.header.get("summary")
        values.total = None if summary is None else summary["largest_blocks"]
        return values

    def __reduce__(self) -> tuple[Any, ...]:
        if self.manifest is not None:
            return (LargestBlocks.of_mapped, (self.manifest,))
        return (LargestBlocks, (self.decoded, self.rows, self.samples))

    def __len__(self) -> int:
        return len(self.decoded)

    def __getitem__(self, shards: Any) -> np.ndarray:
        return largest_blocks(self.decoded[shards], self.rows[shards], self.samples[shards])

    def whole(self) -> np.ndarray:
        return self[:]

    def mean(self, chunk: int = 1 << 16) -> float:
        """The mean: the header's sum, else a chunk at a time (exact integer sum; no column-sized array)."""
        n = len(self)
        total = self.total
        if total is None:
            total = sum(int(self[lo : lo + chunk].sum()) for lo in range(0, n, chunk))
        return total / n if n else 0.0


def decoded_digest(decoded: np.ndarray, block_bytes: np.ndarray | None) -> str:
    """The order config's `decoded` entry: a digest of the decoded sizes a group order depends on."""
    sizes = decoded if block_bytes is None else np.concatenate([decoded, block_bytes])
    return hashlib.sha256(np.asarray(sizes).astype("<i8").tobytes()).hexdigest()[:16]


def layout_columns(shard_columns: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
    """The layout table's columns and the header entry's fields for a dataset's shard columns (pack,
    upgrade); None for a dataset with no non-empty shard (or sample counts out of range)."""
    samples = np.asarray(shard_columns["samples"], dtype=np.int64)
    if samples.size == 0 or int(samples.min()) < 0 or int(samples.max()) >= MAX_COUNT:
        return None  # columns a reader refuses (a forged dataset's) have no order to store
    decoded = np.asarray(shard_columns["decoded_bytes"], dtype=np.int64)
    rows = np.asarray(shard_columns["largest_rows"], dtype=np.int64)
    return layout_parts(samples, decoded_digest(decoded, largest_blocks(decoded, rows, samples)))


def layout_parts(counts: np.ndarray, decoded: str) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
    """The default order's layout over per-shard `counts` (samples, or windows of one length) as a
    layout table's columns and its entry's fields; `decoded`: the order's decoded digest. None: no
    shard holds one."""
    from tierflow.order.layout import PartitionLayout

    nonempty = int((counts > 0).sum())
    if nonempty == 0:
        return None
    layout = PartitionLayout(cast(Sequence[int], counts), default_partitions(nonempty))
    by_partition = np.argsort(layout.shard_partition, kind="stable").astype(np.int64)
    starts = np.searchsorted(layout.shard_partition[by_partition], np.arange(layout.partitions + 1))
    fields: dict[str, Any] = {
        "partitions": layout.partitions,
        "starts": [int(s) for s in starts],
        "sizes": [int(s) for s in layout.partition_sizes],
        "nonempty": nonempty,
        "digest": layout.digest(),
        "decoded": decoded,
    }
    columns: dict[str, np.ndarray] = {
        "partition": layout.shard_partition.astype(np.uint16),
        "by_partition": by_partition,
        "member_samples": counts[by_partition],
    }
    return columns, fields


def check_layout_entry(entry: Any, shards: int, samples: int, fail: Callable[[str], Exception]) -> None:
    """The header's `layout` entry's own fields (the table's are checked as the other tables')."""
    if not isinstance(entry, dict):
        raise fail('"layout" is not an object')
    p = entry.get("partitions")
    if type(p) is not int or not 1 <= p <= min(MOST_PARTITIONS, max(shards, 1)):
        raise fail(f"layout.partitions {p!r:.40} is not a partition count of this dataset")
    starts, sizes = entry.get("starts"), entry.get("sizes")
    if (
        not isinstance(starts, list)
        or not isinstance(sizes, list)
        or len(starts) != p + 1
        or len(sizes) != p
        or not set(map(type, starts + sizes)) <= {int}
    ):
        raise fail("layout.starts and layout.sizes are not P + 1 and P integers")
    if starts[0] != 0 or starts[-1] != shards or any(b <= a for a, b in zip(starts, starts[1:])):
        raise fail(f"layout.starts do not rise from 0 to the {shards} shards, a shard or more a partition")
    if any(s <= 0 for s in sizes) or sum(sizes) != samples:
        raise fail(f"layout.sizes are not positive sizes adding up to the dataset's {samples} samples")
    if entry.get("rows") != shards:
        raise fail(f"layout.rows is {entry.get('rows')!r:.20}, not the {shards} shards")
    nonempty = entry.get("nonempty", p)  # absent before member_samples
    if type(nonempty) is not int or not p <= nonempty <= shards:
        raise fail(f"layout.nonempty {nonempty!r:.20} is not a count of non-empty shards, {p} to {shards}")
    for key in ("digest", "decoded"):
        if not isinstance(entry.get(key), str):
            raise fail(f"layout.{key} is not a string")


class StoredLayout:
    """A dataset's stored layout as the order reads it (order/layout.py `PartitionLayout(stored=)`):
    `counts` is the per-shard samples it was made for (the order uses it only for those very counts),
    read as shards are asked for."""

    def __init__(
        self, table: Any, entry: dict, counts: Any, where: str, sample_starts: Callable[[np.ndarray], np.ndarray]
    ) -> None:
        self.table = table
        self.where = where
        self.counts = counts
        self._sample_starts = sample_starts
        self.partitions: int = entry["partitions"]
        self.starts = np.asarray(entry["starts"], dtype=np.int64)
        self.sizes = np.asarray(entry["sizes"], dtype=np.int64)
        self.nonempty: int | None = entry.get("nonempty")
        self.digest: str = entry["digest"]
        self.decoded: str = entry["decoded"]
        self._members: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._stores_counts = "member_samples" in table.hashes  # not in a table written before it
        self._lock = threading.Lock()

    _manifest: Any = None

    @property
    def manifest(self) -> Any:
        """The MappedManifest it was read from: it pickles as that (a DataLoader worker maps it again).
        Held weakly: the manifest keeps its stored layouts."""
        return None if self._manifest is None else self._manifest()

    @manifest.setter
    def manifest(self, manifest: Any) -> None:
        self._manifest = None if manifest is None else weakref.ref(manifest)

    seq_len: int | None = None
    """The window length of a token-window layout (metadata_windows.py); None: the rows order's."""
    window_starts: Any = None
    """A token-window layout's StoredWindowStarts: where its windows start in the token stream."""

    def __reduce__(self) -> tuple[Any, ...]:
        if self.manifest is None:
            raise TypeError(f"{self.where}: a stored layout read without its manifest cannot be pickled")
        return (_stored_layout_of, (self.manifest, self.seq_len))

    @property
    def shard_partition(self) -> np.ndarray:
        return self.table.column("partition", self._check_partition)

    def _check_partition(self, _chunk: int, _first: int, v: np.ndarray) -> str | None:
        return (
            None
            if not v.size or int(v.max()) < self.partitions
            else f"a shard's partition is not below {self.partitions}"
        )

    def members_view(self) -> PartitionMembers:
        return PartitionMembers(self)

    def starts_of(self, shards: np.ndarray) -> np.ndarray:
        """The first global sample id of each of `shards` (the `sample_start` column, its chunks checked)."""
        return self._sample_starts(shards)

    def members(self, partition: int) -> np.ndarray:
        """Partition `partition`'s shards, ascending; checked the first time they are asked for."""
        return self._member_rows(partition)[0]

    def member_counts(self, partition: int) -> np.ndarray:
        """The samples of partition `partition`'s shards, as `members` lists them: rows of the layout
        table beside them (one written before `member_samples`: the shard table's, gathered)."""
        return self._member_rows(partition)[1]

    def _member_rows(self, partition: int) -> tuple[np.ndarray, np.ndarray]:
        found = self._members.get(partition)
        if found is not None:
            return found
        lo, hi = int(self.starts[partition]), int(self.starts[partition + 1])
        rows = self.table.span("by_partition", lo, hi)
        n = len(self.counts)
        if rows.size and (int(rows[0]) < 0 or int(rows[-1]) >= n or not bool(np.all(rows[1:] > rows[:-1]))):
            raise ManifestError(f"{self.where}: the layout's partition {partition} does not list shards ascending")
        if self._stores_counts:
            counts = self.table.span("member_samples", lo, hi, _check_member_samples)
        else:
            counts = np.asarray(self.counts[rows], dtype=np.int64)
        if int(counts.sum()) != int(self.sizes[partition]):
            raise ManifestError(f"{self.where}: the layout's partition {partition} does not hold its size's samples")
        with self._lock:
            self._members[partition] = (rows, counts)
        return rows, counts

    def check_window(self, partition: int, shards: np.ndarray, counts: np.ndarray) -> None:
        """`shards`, read together by the order in `partition`, are that partition's and hold `counts`
        samples each, as the shard table says: checked the first time the order reads them, so a shard
        two partitions list, or a count that is not its shard's, is refused before a sample of it is
        served, and a rank touches the rows of the windows it reads."""
        if not bool(np.all(self.table.at("partition", shards, self._check_partition) == partition)):
            raise ManifestError(f"{self.where}: the layout's partition {partition} lists another partition's shard")
        if self._stores_counts and not np.array_equal(self.counts[shards], counts):
            raise ManifestError(
                f"{self.where}: the layout's partition {partition} gives a shard samples that are not its own"
            )


def _check_member_samples(_chunk: int, _first: int, v: np.ndarray) -> str | None:
    return None if not v.size or int(v.min()) >= 0 else "a member's samples are negative"


def _stored_layout_of(manifest: Any, seq_len: int | None = None) -> StoredLayout:
    stored = manifest.tables.stored_layout(seq_len)
    if stored is None:
        raise ValueError(f"{manifest.where}: its metadata no longer stores the order's layout")
    return stored


class PartitionMembers:
    """`PartitionLayout.partition_shards` of a stored layout: each partition's shards when asked for."""

    def __init__(self, stored: StoredLayout) -> None:
        self.stored = stored

    def __len__(self) -> int:
        return self.stored.partitions

    def __getitem__(self, partition: int) -> np.ndarray:
        if not 0 <= partition < self.stored.partitions:
            raise IndexError(f"partition {partition} out of range [0, {self.stored.partitions})")
        return self.stored.members(partition)

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self.stored.members(p) for p in range(self.stored.partitions))


def verify_layout(tables: Any) -> list[str]:
    """Every problem with a dataset's stored layout: its columns against their hashes, and the whole
    layout recomputed from the samples column and compared (`tierflow verify`)."""
    entry = tables.header.get("layout")
    if entry is None or tables.layout is None:
        return []
    where = f"{tables.where}: {entry['file']}"
    try:
        stored = tables.stored_layout()
        names = layout_schema(entry).names
        stored_columns = {
            name: stored.shard_partition if name == "partition" else tables.layout.column(name) for name in names
        }
        wanted = layout_columns({name: tables.column(name) for name in LAYOUT_COLUMNS})
    except ManifestError as e:
        return [str(e)]
    if wanted is None:
        return [f"{where}: the dataset has no non-empty shard, yet a layout"]
    columns, fields = wanted
    keys = ("partitions", "starts", "sizes", "digest", "decoded", *(("nonempty",) if "nonempty" in entry else ()))
    problems = [
        f"{where}: layout.{key} is not the default order's (recomputed from the samples column)"
        for key in keys
        if entry.get(key) != fields[key]
    ]
    if not all(np.array_equal(stored_columns[name], columns[name]) for name in names):
        problems.append(f"{where}: the shards' partitions or counts are not the default order's (recomputed)")
    return problems
