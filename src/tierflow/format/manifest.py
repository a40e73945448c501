"""The manifest: one JSON file that makes a directory of shards a dataset.

It is written last and atomically, so a directory without one holds no dataset. Its
`dataset_id` hashes what the data *is* (schema, tokenizer, shard hashes), not the manifest's
bytes, so two packs of the same data share cache entries; the manifest's own bytes are covered
by `manifest_checksum` (xxh3-128 of its canonical JSON, every field but itself), so a flipped byte
or an edited count is refused. A manifest without one (written before it existed) still loads,
with `checksummed` False: its counts are trusted no more than any other's, since every count is
checked against the shard bytes when a block is first decoded (and by `tierflow verify`).
Untrusted input: `Manifest.load` validates every field a reader relies on and names what is wrong.
"""

from __future__ import annotations

import base64
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa
import xxhash

from tierflow.format._atomic import write_atomically
from tierflow.format._regular import read_regular
from tierflow.format.shard import COMPRESSIONS, MAX_COUNT, SHARD_PREFIX, SHARD_SUFFIX, BlockList, ShardInfo
from tierflow.errors import ManifestError

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 2
"""What pack writes: version 2 stores each shard's blocks as one binary table (`block_table`), version
1 as JSON lists; both are read."""
READ_VERSIONS = (1, 2)
_SHARD_NAME = re.compile(rf"^{SHARD_PREFIX}[0-9a-f]{{32}}{re.escape(SHARD_SUFFIX)}$")
CHECKSUM_KEY = "manifest_checksum"
MAX_MANIFEST_BYTES = 64 << 20
"""A manifest larger than this is refused unread (a hostile one could be any size): 64 MiB lists
~90,000 shards of ~14 blocks (~20 TB at the default shard size) and parses in ~5 s; a 100 MB one
took 13 s and 1.7 GB. TIERFLOW_MAX_MANIFEST_BYTES raises it for a larger dataset."""


def max_manifest_bytes() -> int:
    """The manifest size limit in force (TIERFLOW_MAX_MANIFEST_BYTES, else MAX_MANIFEST_BYTES)."""
    value = os.environ.get("TIERFLOW_MAX_MANIFEST_BYTES", "")
    return int(value) if value.isdigit() else MAX_MANIFEST_BYTES


def check_manifest_size(size: int, where: str) -> None:
    """ManifestError unless a manifest of `size` bytes is within the limit (checked before reading it)."""
    limit = max_manifest_bytes()
    if size > limit:
        raise ManifestError(
            f"{where}: {size} bytes, more than the {limit} a manifest may have "
            f"(TIERFLOW_MAX_MANIFEST_BYTES raises it); refused"
        )


def schema_fields(schema: pa.Schema) -> list[dict]:
    """The readable field list (what `dataset_id` hashes: no IPC serialisation, which took up to 12 ms
    the first time in a process, paid twice before the first batch)."""
    return [{"name": f.name, "type": str(f.type), "nullable": f.nullable} for f in schema]


def schema_to_json(schema: pa.Schema) -> dict:
    """Both a readable field list and the exact Arrow schema (IPC-serialised, base64)."""
    return {"fields": schema_fields(schema), "arrow": base64.b64encode(schema.serialize().to_pybytes()).decode("ascii")}


def schema_from_json(d: dict) -> pa.Schema:
    return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(d["arrow"])))


def compute_dataset_id(schema_json: dict, tokenizer: dict | None, shard_checksums: list[str]) -> str:
    canonical = json.dumps(
        {"schema": schema_json["fields"], "tokenizer": tokenizer, "shards": shard_checksums},
        sort_keys=True,
        separators=(",", ":"),
    )
    return xxhash.xxh3_128_hexdigest(canonical.encode())


def manifest_checksum(d: dict) -> str:
    """xxh3-128 of the manifest's canonical JSON (sorted keys, no spaces), its checksum left out and
    each block table (version 2) standing in as its text's xxh3-128: independent of indentation, so a
    manifest re-formatted by a tool still verifies, and the tables are hashed at xxh3's speed rather
    than escaped character by character (a version 1 manifest has none: its checksum is as before)."""
    body = {k: v for k, v in d.items() if k != CHECKSUM_KEY}
    if isinstance(body.get("shards"), list):
        body["shards"] = [_table_digested(s) for s in body["shards"]]
    return xxhash.xxh3_128_hexdigest(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def _table_digested(shard: Any) -> Any:
    blocks = shard.get("blocks") if isinstance(shard, dict) else None
    if not isinstance(blocks, dict) or not isinstance(blocks.get("table"), str):
        return shard
    return {**shard, "blocks": {**blocks, "table": xxhash.xxh3_128_hexdigest(blocks["table"].encode())}}


_SHARD_COUNTS = ("samples", "bytes", "decoded_bytes", "tokens")
_TOKEN_DTYPES = ("uint8", "uint16", "uint32", "int32", "int64")


def _check_fields(d: dict, fail: Callable[[str], ManifestError]) -> None:
    """The types of the top-level fields readers use as they are (a wrong one would fail later, untyped)."""
    for key, kind in (
        ("tokenizer", dict),
        ("token_column", str),
        ("token_dtype", str),
        ("stats", dict),
        ("dataset_id", str),
    ):
        if d.get(key) is not None and not isinstance(d[key], kind):
            raise fail(f"{key} = {d[key]!r:.80} is not a {kind.__name__}")
    dtype = d.get("token_dtype")
    if dtype is not None and dtype not in _TOKEN_DTYPES:
        raise fail(f"token_dtype {dtype!r:.80} is not one of {_TOKEN_DTYPES}")
    eos = d.get("eos_id")
    if eos is not None and not (type(eos) is int and 0 <= eos < 1 << 32):
        raise fail(f"eos_id = {eos!r:.80} is not a token id")
    said = d["tokenizer"].get("eos_id") if isinstance(d.get("tokenizer"), dict) else None
    if eos is not None and type(said) is int and said != eos:  # the tokenizer's is in the dataset_id
        raise fail(f"eos_id = {eos}, but its tokenizer's eos_id is {said} (edited, or resealed)")


MAX_INT_DIGITS = 40
"""No integer of a manifest has more digits (counts, offsets and ids are below 2**64: 20 digits)."""


class _LongInteger:
    """What the JSON parser makes of an integer literal of more than MAX_INT_DIGITS digits (int()
    of 5,000 digits is a bare ValueError, and would cost quadratic time): found and named below."""

    def __init__(self, text: str) -> None:
        self.digits = len(text.lstrip("-"))


def _long_integer_error(raw: bytes, where: str, error: ValueError) -> ManifestError:
    """The ManifestError for a manifest the JSON parser refused with a bare ValueError (an integer
    of more digits than int() takes), naming the field: parsed again, such integers kept aside."""

    def parse_int(text: str) -> int | _LongInteger:
        return int(text) if len(text) <= MAX_INT_DIGITS else _LongInteger(text)

    try:
        found = _long_integer(json.loads(raw, parse_int=parse_int), "")
    except (ValueError, RecursionError):
        found = None
    if found is None:
        return ManifestError(f"{where}: not valid JSON ({error})")
    return ManifestError(
        f"{where}: field {found[0] or '(the whole document)'} is an integer of {found[1].digits} "
        f"digits; no field of a manifest has more than {MAX_INT_DIGITS}"
    )


def _long_integer(value: Any, path: str) -> tuple[str, _LongInteger] | None:
    """The first over-long integer in a parsed manifest, with its field's path, or None."""
    stack = [(value, path)]
    while stack:
        value, path = stack.pop()
        if isinstance(value, _LongInteger):
            return path, value
        if isinstance(value, dict):
            stack.extend((v, f"{path}.{k}" if path else str(k)) for k, v in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]") for i, v in reversed(list(enumerate(value))))
    return None


def _check_totals(manifest: Manifest, fail: Callable[[str], ManifestError]) -> None:
    """The pack's own totals (stats) against the shards' counts: a shard whose count was zeroed (a
    flipped byte in its key name reads as the default) no longer adds up."""
    stats = manifest.stats
    for key, total in (("samples", manifest.num_samples), ("tokens", manifest.num_tokens)):
        recorded = stats.get(key)
        if type(recorded) is int and recorded != total:
            raise fail(f"stats.{key} = {recorded}, but the shards' {key} sum to {total}")


@dataclass
class Manifest:
    schema: pa.Schema
    shards: Sequence[ShardInfo]
    tokenizer: dict | None = None
    token_column: str | None = None
    token_dtype: str | None = None
    eos_id: int | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    checksummed: bool = True
    """False for a manifest that carried no checksum (older packs): loaded, counts checked on use."""

    @property
    def dataset_id(self) -> str:
        return compute_dataset_id(
            {"fields": schema_fields(self.schema)}, self.tokenizer, [s.checksum for s in self.shards]
        )

    @property
    def num_samples(self) -> int:
        return sum(s.samples for s in self.shards)

    @property
    def num_tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    def to_json(self) -> dict:
        schema_json = schema_to_json(self.schema)
        d = {
            "format": "tierflow",
            "format_version": FORMAT_VERSION,  # the blocks are written as tables, whatever was read
            "dataset_id": self.dataset_id,
            "schema": schema_json,
            "tokenizer": self.tokenizer,
            "token_column": self.token_column,
            "token_dtype": self.token_dtype,
            "eos_id": self.eos_id,
            "shards": [s.to_json() for s in self.shards],
            "stats": self.stats,
        }
        d[CHECKSUM_KEY] = manifest_checksum(d)
        return d

    def save(self, directory: str | Path) -> Path:
        """Atomically publish the manifest: a torn manifest never lies next to the shards."""
        return write_atomically(Path(directory) / MANIFEST_NAME, json.dumps(self.to_json(), indent=1).encode())

    @classmethod
    def load(cls, directory: str | Path) -> Manifest:
        from tierflow.format.metadata_index import current_metadata  # version 3: opened, not parsed

        mapped = current_metadata(directory)
        if mapped is not None:
            return mapped
        path = Path(directory) / MANIFEST_NAME
        try:
            raw = read_regular(path, max_manifest_bytes(), ManifestError)
        except FileNotFoundError:
            raise ManifestError(f"{path}: no manifest; {directory} holds no finished tierflow dataset") from None
        return cls.from_bytes(raw, str(path))

    @classmethod
    def from_bytes(cls, raw: bytes, where: str) -> Manifest:
        check_manifest_size(len(raw), where)
        try:
            d = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ManifestError(f"{where}: not valid JSON ({e})") from None
        except RecursionError:
            raise ManifestError(f"{where}: JSON nested too deeply to be a manifest") from None
        except ValueError as e:  # an integer longer than int() takes (4300 digits): find its field
            raise _long_integer_error(raw, where, e) from None
        return cls.from_json(d, where)

    @classmethod
    def from_json(cls, d: Any, where: str) -> Manifest:
        """The manifest `d` describes, validated; anything wrong is a ManifestError naming `where`
        and the field (untrusted input: no other exception escapes)."""
        at = ["the top level"]
        try:
            return cls._parse(d, where, at)
        except ManifestError:
            raise
        except (RecursionError, OverflowError, ValueError, AttributeError, TypeError, IndexError, KeyError) as e:
            raise ManifestError(f"{where}: {at[0]} is malformed ({type(e).__name__}: {e})") from None

    @classmethod
    def _parse(cls, d: Any, where: str, at: list[str]) -> Manifest:
        """`from_json`'s checks, field by field; `at[0]` names the field being read."""

        def fail(msg: str) -> ManifestError:
            return ManifestError(f"{where}: {msg}")

        if not isinstance(d, dict) or d.get("format") != "tierflow":
            raise fail('not a tierflow manifest (missing "format": "tierflow")')
        version = d.get("format_version")
        if type(version) is not int or version not in READ_VERSIONS:
            raise fail(
                f"unknown format_version {version!r:.40}; this tierflow reads versions "
                f"{', '.join(map(str, READ_VERSIONS))}"
            )
        recorded_sum = d.get(CHECKSUM_KEY)
        if recorded_sum is not None and recorded_sum != manifest_checksum(d):
            raise fail(
                f"{CHECKSUM_KEY} {recorded_sum!r:.40} does not match the manifest's contents "
                f"(damaged or edited; re-pack, or restore the manifest)"
            )
        at[0] = 'field "schema"'
        try:
            schema = schema_from_json(d["schema"])
        except Exception as e:
            raise fail(f"schema does not decode ({e})") from None
        raw_shards = d.get("shards")
        if not isinstance(raw_shards, list):
            raise fail('"shards" is not a list')
        shards = []
        for i, s in enumerate(raw_shards):
            at[0] = f"shard #{i}"
            if not isinstance(s, dict):
                raise fail(f"shard #{i} is not an object")
            for key in _SHARD_COUNTS:
                if type(s.get(key, 0)) is not int:  # not 1.5, "7", true or 1e999
                    raise fail(f"shard #{i}: {key} = {s.get(key)!r} is not an integer")
            try:
                info = ShardInfo.from_json(s)
            except (KeyError, TypeError, ValueError) as e:
                raise fail(f"shard #{i} is malformed ({e})") from None
            if not _SHARD_NAME.match(info.name):
                raise fail(
                    f"shard #{i} name {info.name!r} is not a shard file inside the dataset "
                    f"(paths, '..' and URLs are refused)"
                )
            if info.name != f"{SHARD_PREFIX}{info.checksum}{SHARD_SUFFIX}":
                raise fail(f"shard #{i} name {info.name!r} does not carry its checksum {info.checksum!r}")
            for key in _SHARD_COUNTS:
                value = getattr(info, key)
                if not 0 <= value < MAX_COUNT:
                    raise fail(f"shard {info.name}: {key} = {value} is negative or absurd")
            if info.compression not in COMPRESSIONS:
                raise fail(f"shard {info.name}: unknown compression {info.compression!r}")
            assert isinstance(info.blocks, BlockList)  # from_json keeps a manifest's blocks as columns
            problem = info.blocks.check(info.name, info.bytes, info.samples, info.tokens)
            if problem is not None:
                raise fail(problem)
            shards.append(info)
        at[0] = "the top level"
        names = [s.name for s in shards]
        if len(set(names)) != len(names):
            raise fail("a shard is listed twice")
        _check_fields(d, fail)
        manifest = cls(
            schema=schema,
            shards=shards,
            tokenizer=d.get("tokenizer"),
            token_column=d.get("token_column"),
            token_dtype=d.get("token_dtype"),
            eos_id=d.get("eos_id"),
            stats=d.get("stats") or {},
            format_version=version,
            checksummed=recorded_sum is not None,
        )
        _check_totals(manifest, fail)
        if manifest.token_column is not None and manifest.token_column not in schema.names:
            raise fail(f"token_column {manifest.token_column!r} is not in the schema")
        recorded = d.get("dataset_id")
        if recorded is not None and recorded != manifest.dataset_id:
            raise fail(f"dataset_id {recorded} does not match its schema, tokenizer and shards ({manifest.dataset_id})")
        return manifest
