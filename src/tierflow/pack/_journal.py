"""A pack's resume journal: which shards are sealed and where in the unit stream the next one starts.

Why: a pack of a large lake runs for hours, and a killed process (OOM, preempted node, a SIGKILLed
driver of either engine) should cost the units after the last sealed shard, not the whole run.
Shard boundaries depend only on the ordered batch stream, so a sealed shard is fixed by a
position, (unit, rows of that unit before the cut): a rerun skips the units before it, skips those
rows of its unit, and carries on with the assembler in the state it had there (the schema; no
open shard). The output is then byte-identical to an uninterrupted pack.

The journal (`<out>/.pack-journal`, JSON lines, appended and fsynced once per sealed shard) holds
a header with the fingerprint of the pack's options, then one line per sealed shard: its
ShardInfo, the position, the schema, and the counts of the units before the position. A rerun
trusts it only if the fingerprint matches, every shard it names is on disk at its size, and the
units planned before the position are the same (kind, path, range, size, mtime: a chained hash).
Otherwise the pack starts over. A torn last line (killed while appending) is ignored. Records
passed as an iterable cannot be replayed, so those packs keep no journal. Only packs into a
local directory resume (an s3:// pack stages in a temporary directory; shards are content-named,
so its rerun skips the uploads it finds).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import marshal
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import pyarrow as pa
import xxhash

from tierflow.format.shard import ShardInfo
from tierflow.pack.units import Unit, UnitStats

JOURNAL_NAME = ".pack-journal"
VERSION = 1
_START = "0" * 32


@dataclass
class PackedSoFar:
    """What the units before a position contributed, besides their shards."""

    stats: UnitStats
    tokens: int = 0
    histogram: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(64, np.int64))
    input_bytes: int = 0
    units: int = 0
    """Units consumed whole."""


@dataclass
class ResumePoint:
    """Where a rerun starts: after `shards`, at row `rows` of unit `unit`."""

    shards: list[ShardInfo]
    unit: int
    rows: int
    units_digest: str
    """Chained hash of the units before `unit`, checked against the rerun's plan."""
    schema: pa.Schema
    so_far: PackedSoFar


def fingerprint(options: dict[str, Any], fn: Callable | None) -> str:
    """The options that shape the shards, hashed; `fn` by its qualified name and bytecode."""
    described = dict(options)
    if fn is not None:
        code = getattr(fn, "__code__", None)
        described["fn"] = [
            getattr(fn, "__module__", ""),
            getattr(fn, "__qualname__", repr(type(fn))),
            xxhash.xxh3_64_hexdigest(marshal.dumps(code)) if code is not None else None,
        ]
    return xxhash.xxh3_128_hexdigest(json.dumps(described, sort_keys=True, default=str).encode())


def _unit_identity(unit: Unit) -> bytes:
    try:
        mtime = os.stat(unit.path).st_mtime_ns
    except OSError:
        mtime = None
    return json.dumps(
        [
            unit.index,
            unit.kind,
            unit.path,
            unit.start,
            unit.end,
            list(unit.members),
            unit.input_bytes,
            list(unit.sidecars),
            mtime,
        ]
    ).encode()


class UnitsDigest:
    """Passes the planned units through, remembering the chained hash of the units before each one."""

    def __init__(self, units: Iterable[Unit]) -> None:
        self._units = units
        self._digest = _START
        self.before: dict[int, str] = {}

    def __iter__(self) -> Iterator[Unit]:
        for unit in self._units:
            self.before[unit.index] = self._digest
            self._digest = xxhash.xxh3_128_hexdigest(self._digest.encode() + _unit_identity(unit))
            yield unit

    def take(self, index: int) -> str:
        """The digest before unit `index` (one past the last: the whole plan's), forgetting those of
        earlier units (never asked again)."""
        digest = self.before.get(index, self._digest)
        for i in [i for i in self.before if i < index]:
            del self.before[i]
        return digest


def digest_before(units: Iterable[Unit], index: int) -> str | None:
    """The chained hash of the planned units before unit `index` (None if the plan has fewer)."""
    digests = UnitsDigest(units)
    count = 0
    for unit in digests:
        if unit.index == index:
            return digests.before[index]
        count += 1
    return digests.take(index) if index == count else None


class PackJournal:
    """Appends sealed shards to `<out>/.pack-journal`; reads back the last consistent resume point."""

    def __init__(self, out: Path, fingerprint: str) -> None:
        self.path = out / JOURNAL_NAME
        self.fingerprint = fingerprint
        self._file: TextIO | None = None

    def last_point(self) -> ResumePoint | None:
        """The last sealed shard's resume point, if the journal is this pack's and its shards are intact."""
        try:
            lines = self.path.read_bytes().split(b"\n")
        except FileNotFoundError:
            return None
        try:
            header = json.loads(lines[0])
        except ValueError:
            return None
        if header != {"journal": VERSION, "fingerprint": self.fingerprint}:
            return None
        entries = []
        for line in lines[1:]:
            try:
                entries.append(json.loads(line))
            except ValueError:
                break  # a line torn by the kill, and nothing after it
        if not entries:
            return None
        try:
            shards = [ShardInfo.from_json(e["shard"]) for e in entries]
            last = entries[-1]
            so_far = PackedSoFar(
                UnitStats(**last["stats"]),
                int(last["tokens"]),
                np.asarray(last["histogram"], np.int64),
                int(last["input_bytes"]),
                int(last["units"]),
            )
            schema = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(last["schema"])))
            point = ResumePoint(shards, int(last["unit"]), int(last["rows"]), str(last["units_digest"]), schema, so_far)
        except (KeyError, TypeError, ValueError, pa.ArrowException):
            return None  # not a journal this version wrote: start over
        for info in shards:
            try:
                if os.stat(self.path.parent / info.name).st_size != info.bytes:
                    return None
            except OSError:
                return None
        return point

    def start(self, point: ResumePoint | None) -> None:
        """Open for appending: after `point`'s entries when resuming, else a fresh journal."""
        if point is None:
            self._rewrite([json.dumps({"journal": VERSION, "fingerprint": self.fingerprint})])
        else:  # drop a torn tail, so appends start on a line of their own
            lines = self.path.read_bytes().split(b"\n")[: len(point.shards) + 1]
            self._rewrite([line.decode() for line in lines])
        self._file = open(self.path, "a")

    def _rewrite(self, lines: list[str]) -> None:
        tmp = self.path.with_name(".tmp-journal")
        tmp.write_text("".join(line + "\n" for line in lines))
        os.replace(tmp, self.path)

    def sealed(
        self, info: ShardInfo, unit: int, rows: int, units_digest: str, schema: pa.Schema, so_far: PackedSoFar
    ) -> None:
        """Record a sealed shard (already renamed into place) and the position after it."""
        assert self._file is not None
        entry = {
            "shard": info.to_json(),
            "unit": unit,
            "rows": rows,
            "units_digest": units_digest,
            "schema": base64.b64encode(schema.serialize().to_pybytes()).decode(),
            "stats": dataclasses.asdict(so_far.stats),
            "tokens": so_far.tokens,
            "histogram": so_far.histogram.tolist(),
            "input_bytes": so_far.input_bytes,
            "units": so_far.units,
        }
        self._file.write(json.dumps(entry) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def remove(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)
