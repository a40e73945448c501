"""Format version 2: each shard's blocks are one binary table in the manifest (issue 17's start-up).

JSON lists made a manifest's parse and its checksum cost a value per block and column (3,081 blocks at
100M samples in 30 shards: ~60% of the manifest's load, the part of a start that grew with the data).
A table is one string per shard; version 1's lists are still read, and a table is checked as the lists
are, naming the shard.
"""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import tierflow
from tierflow.errors import ManifestError
from tierflow.format.manifest import FORMAT_VERSION, MANIFEST_NAME, Manifest
from tierflow.format.shard import block_lists

from hostile import forge_manifest, listed

ROWS = 160_000


@pytest.fixture(scope="module")
def packs(tmp_path_factory) -> dict[str, Path]:
    """The same rows in 4 shards of 320 KB, cut into 4 KB blocks (~80 a shard) and 1 MB ones (1 a shard)."""
    root = tmp_path_factory.mktemp("tables")
    source = root / "x.parquet"
    pq.write_table(pa.table({"x": np.arange(ROWS, dtype=np.int64)}), source, compression="none")
    out = {}
    for name, block in (("many", 4 << 10), ("few", 1 << 20)):
        tierflow.pack([source], root / name, workers=1, target_shard_bytes=ROWS * 8 // 4, block_bytes=block)
        out[name] = root / name
    return out


def json_values(d: object) -> int:
    """How many JSON values (objects, lists, strings, numbers) `d` holds: what a parse makes."""
    if isinstance(d, dict):
        return 1 + sum(json_values(v) for v in d.values())
    if isinstance(d, list):
        return 1 + sum(json_values(v) for v in d)
    return 1


def test_a_manifests_json_values_do_not_grow_with_its_blocks(packs):
    raw = {name: json.loads((path / MANIFEST_NAME).read_text()) for name, path in packs.items()}
    blocks = {name: sum(len(s.blocks) for s in Manifest.load(path).shards) for name, path in packs.items()}
    assert blocks["many"] >= 10 * blocks["few"], blocks
    assert raw["many"]["format_version"] == FORMAT_VERSION == 2
    assert json_values(raw["many"]) == json_values(raw["few"])
    as_lists = listed(json.loads((packs["many"] / MANIFEST_NAME).read_text()))
    assert json_values(as_lists) > json_values(raw["many"]) + 3 * blocks["many"]  # what version 1 parsed


def test_a_version_1_manifest_of_lists_reads_the_same_blocks(packs, tmp_path):
    old = Path(shutil.copytree(packs["many"], tmp_path / "old"))
    forge_manifest(old, lambda m: m.update(format_version=1))  # lists, as version 1 wrote them
    assert "table" not in json.loads((old / MANIFEST_NAME).read_text())["shards"][0]["blocks"]
    ours, theirs = Manifest.load(packs["many"]), Manifest.load(old)
    assert theirs.format_version == 1 and theirs.dataset_id == ours.dataset_id
    assert [list(s.blocks) for s in theirs.shards] == [list(s.blocks) for s in ours.shards]
    ds = tierflow.open_dataset(old)
    assert [ds[i]["x"] for i in (0, ROWS // 2, ROWS - 1)] == [0, ROWS // 2, ROWS - 1]


def test_a_loaded_version_1_manifest_saves_as_version_2(packs, tmp_path):
    old = Path(shutil.copytree(packs["many"], tmp_path / "old"))
    forge_manifest(old, lambda m: m.update(format_version=1))
    Manifest.load(old).save(old)
    again = json.loads((old / MANIFEST_NAME).read_text())
    assert again["format_version"] == 2 and "table" in again["shards"][0]["blocks"]
    assert Manifest.load(old).dataset_id == Manifest.load(packs["many"]).dataset_id


def test_an_unknown_format_version_is_refused_naming_the_field(packs, tmp_path):
    root = Path(shutil.copytree(packs["few"], tmp_path / "ds"))
    forge_manifest(root, lambda m: m.update(format_version=3))
    with pytest.raises(ManifestError, match=r"unknown format_version 3; this tierflow reads versions 1, 2"):
        Manifest.load(root)


def _with_raw(change):
    """A change to the first shard's raw table bytes (as base64), every column else kept."""

    def apply(blocks: dict) -> None:
        raw = bytearray(base64.b64decode(blocks["table"]))
        change(raw, blocks["count"])
        blocks["table"] = base64.b64encode(bytes(raw)).decode()

    return apply


def _rows_moved_out(raw: bytearray, count: int) -> None:
    at = 4 * count  # the rows column, after the lengths (4 bytes a block)
    raw[at : at + 4] = (int.from_bytes(raw[at : at + 4], "little") + 1).to_bytes(4, "little")


def _length_past_the_file(raw: bytearray, count: int) -> None:
    raw[4:8] = ((1 << 32) - 1).to_bytes(4, "little")  # block 1 runs past the end of the file


TABLE_DAMAGE = {
    "not base64": (lambda b: b.update(table=b["table"][:-4] + "!!!!"), r"blocks.table is not base64"),
    "short": (lambda b: b.update(table=b["table"][:-8]), r"blocks.table holds \d+ bytes, not the \d+ of \d+ blocks"),
    "columns": (lambda b: b.update(columns=["rows", "length", "checksum"]), r"blocks.columns = "),
    "count": (lambda b: b.update(count=-1), r"blocks.count is not a block count"),
    "rows": (_with_raw(_rows_moved_out), r"block rows sum to \d+, not \d+ samples"),
    "length": (_with_raw(_length_past_the_file), r"block at \d+\+4294967295 lies outside the file"),
}


@pytest.mark.parametrize("damage", sorted(TABLE_DAMAGE))
def test_a_damaged_block_table_is_refused_naming_the_shard(packs, tmp_path, damage):
    root = Path(shutil.copytree(packs["many"], tmp_path / "ds"))
    tables = json.loads((root / MANIFEST_NAME).read_text())
    change, message = TABLE_DAMAGE[damage]

    def forge(m: dict) -> None:
        m["shards"] = tables["shards"]  # the tables as packed, the first one damaged
        change(m["shards"][0]["blocks"])

    forge_manifest(root, forge)
    with pytest.raises(ManifestError, match=rf"shard (#0|{tables['shards'][0]['name']})\b.*{message}"):
        Manifest.load(root)


def test_block_lists_of_a_table_are_the_manifests_blocks(packs):
    d = json.loads((packs["many"] / MANIFEST_NAME).read_text())
    for shard, info in zip(d["shards"], Manifest.load(packs["many"]).shards):
        lists = block_lists(shard["blocks"])
        assert lists["offset"][0] == 0 and len(lists["checksum"]) == shard["blocks"]["count"] == len(info.blocks)
        assert [b.checksum for b in info.blocks] == lists["checksum"]
        assert [b.rows for b in info.blocks] == lists["rows"]


def test_a_changed_block_table_fails_the_manifests_checksum(packs, tmp_path):
    root = Path(shutil.copytree(packs["many"], tmp_path / "ds"))
    d = json.loads((root / MANIFEST_NAME).read_text())
    table = d["shards"][0]["blocks"]["table"]
    d["shards"][0]["blocks"]["table"] = table[:8] + ("A" if table[8] != "A" else "B") + table[9:]
    (root / MANIFEST_NAME).write_text(json.dumps(d, indent=3))  # re-indented, as a tool might
    with pytest.raises(ManifestError, match="manifest_checksum .* does not match"):
        Manifest.load(root)
    d["shards"][0]["blocks"]["table"] = table
    (root / MANIFEST_NAME).write_text(json.dumps(d, indent=3))
    assert Manifest.load(root).checksummed


def test_version_1_block_lists_of_the_wrong_type_or_length_are_refused_naming_the_column():
    from tierflow.format.shard import BlockList

    lists = {"offset": [0, 10], "length": [10, 5], "rows": [2, 1], "checksum": ["a" * 16, "b" * 16]}
    assert [b.length for b in BlockList.from_json(lists)] == [10, 5]
    with pytest.raises(TypeError, match="blocks.rows is not a list of int"):
        BlockList.from_json({**lists, "rows": [2, "1"]})
    with pytest.raises(ValueError, match="columns differ in length: offset 2, length 2, rows 1"):
        BlockList.from_json({**lists, "rows": [2]})


def test_blocks_that_are_not_contiguous_from_zero_cannot_become_a_table():
    from tierflow.format.shard import Block, block_table

    with pytest.raises(ValueError, match="not contiguous from offset 0"):
        block_table([Block(8, 10, 2, "a" * 16, None)])
    with pytest.raises(ValueError, match="does not fit"):
        block_table([Block(0, 1 << 33, 2, "a" * 16, None)])


def test_the_checksum_of_a_manifest_without_a_shard_list_is_its_canonical_jsons():
    import xxhash

    from tierflow.format.manifest import manifest_checksum

    body = {"format": "tierflow", "shards": None}
    assert manifest_checksum({**body, "manifest_checksum": "x"}) == xxhash.xxh3_128_hexdigest(
        json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    )
