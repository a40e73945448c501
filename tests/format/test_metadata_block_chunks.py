"""The block table checked a chunk of rows at a time (format/metadata.py's block chunk table, issue 38).

A shard's first use hashes the chunks of the block table its rows lie in, not a digest of its own
rows, so `verify` checks the whole table at the speed it reads it (no hash a shard); damage in a
chunk is refused when a shard of it is used and by `verify`, naming the rows; a dataset written
before the table (or whose table an older tierflow's gc removed) checks each shard's block_digest as
before, and `upgrade` writes the table; verify's windows of block rows carry a shard across their
edges."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import tierflow
from tierflow.errors import ManifestError
from tierflow.format import metadata as md
from tierflow.format import metadata_verify, metadata_writer
from tierflow.format.manifest import MANIFEST_NAME, Manifest
from tierflow.loader import BatchSpec, TieredDataset
from tierflow.testing.faults import write_corpus

from hostile import rewrite_tables, write_header

ROWS = 8


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """14 shards of ~16 blocks, the block table written in chunks of ROWS rows."""
    root = tmp_path_factory.mktemp("block-chunks")
    src = write_corpus(root / "a.jsonl", docs=3000, seed=3)
    tierflow.pack([src], root / "out", workers=1, tokenizer="bytes", target_shard_bytes=256 << 10, block_bytes=16 << 10)
    forge(root / "out", lambda s, b: None, root / "out")
    return root / "out"


def forge(out: Path, edit, source: Path) -> None:
    """Rewrite the tables through the writer, the block table's chunks of ROWS rows, with
    `edit(shard columns, block columns)` applied and every hash recomputed."""
    rewrite_tables(out, source, edit, block_chunk_rows=ROWS)


def copy(packed: Path, tmp_path: Path) -> Path:
    out = tmp_path / "ds"
    shutil.copytree(packed, out)
    (out / MANIFEST_NAME).unlink()
    return out


def header(out: Path) -> dict:
    return json.loads((out / md.METADATA_NAME).read_bytes())


def before_block_chunks(out: Path) -> dict:
    """The dataset's header as tierflow wrote it before the block chunk table; returns the current one."""
    current = header(out)
    write_header(out, {k: v for k, v in current.items() if k != "block_chunks"})
    return current


def batches(out: Path) -> list[list[int]]:
    return [b.meta.sample_ids.tolist() for _, b in zip(range(6), TieredDataset(out, BatchSpec(batch_size=64)))]


def test_a_shard_checks_only_the_block_chunks_its_rows_lie_in(packed: Path, tmp_path: Path) -> None:
    out = copy(packed, tmp_path)
    tables = md.load_metadata(out).tables
    assert tables.block_chunks is not None and tables.blocks.chunk_rows == ROWS and tables.blocks.chunk_count > 20
    first, count = int(tables.value("first_block", 9)), int(tables.value("blocks", 9))
    shard = tables.shard(9)
    assert len(shard.blocks) == count == len(Manifest.load(packed).shards[9].blocks)
    wanted = np.zeros(tables.blocks.chunk_count, dtype=bool)
    wanted[first // ROWS : (first + count - 1) // ROWS + 1] = True
    for name in md.BLOCK_SCHEMA.names:
        assert tables.blocks._verified[name].tolist() == wanted.tolist(), name
    assert tables.shards._verified.get("block_digest") is None  # the rows are checked, not a digest of them


def test_damage_in_a_block_chunk_is_refused_when_a_shard_of_it_is_used_and_by_verify(
    packed: Path, tmp_path: Path
) -> None:
    out = copy(packed, tmp_path)
    tables = md.load_metadata(out).tables
    row = int(tables.value("first_block", 6)) + 1  # shard 6's second block
    column = tables.blocks.raw("checksum")
    at = column.ctypes.data - tables.blocks._map_base() + row * 8
    path, chunk = tables.blocks.path, row // ROWS
    users = [i for i in range(tables.num_shards) if _rows_of(tables, i) & {chunk}]
    del tables, column
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))
    tables = md.load_metadata(out).tables
    rows = rf"rows {chunk * ROWS}-{chunk * ROWS + ROWS - 1}"
    for i in range(tables.num_shards):
        if i in users:
            with pytest.raises(
                ManifestError,
                match=rf"{out}: metadata-blocks-.*column checksum, {rows}, does not match its hash in the block chunk table",
            ):
                tables.shard(i)
        else:
            assert tables.shard(i).samples > 0  # the other chunks' shards: served
    problems = metadata_verify.verify_metadata(md.load_metadata(out))
    assert (
        len(problems) == 1
        and f"column checksum, {rows}, does not match its hash in the block chunk table" in problems[0]
    )


def _rows_of(tables: md.MetadataTables, i: int) -> set[int]:
    first, count = int(tables.value("first_block", i)), int(tables.value("blocks", i))
    return set(range(first // ROWS, (first + count - 1) // ROWS + 1)) if count else set()


@pytest.mark.parametrize("window", [ROWS, 3 * ROWS, 5])
def test_verify_carries_a_shard_across_the_edges_of_its_windows(
    packed: Path, tmp_path: Path, window: int, monkeypatch
) -> None:
    """Windows smaller than a shard's rows (a chunk, three chunks; 5 rows before the block chunk table):
    a clean dataset has no problem, and a shard whose rows no longer add up is named, whichever window
    its rows start and end in."""
    monkeypatch.setattr(metadata_verify, "WINDOW_ROWS", window)
    for older in (False, True):
        out = copy(packed, tmp_path / str(older))
        if older:
            before_block_chunks(out)
        assert metadata_verify.verify_metadata(md.load_metadata(out)) == []

        def edit(s, b) -> None:
            last = int(s["first_block"][7] + s["blocks"][7] - 1)  # shard 7's last block: past the first window
            b["rows"][last] += 1

        forge(out, edit, packed)
        if older:
            before_block_chunks(out)
        manifest = md.load_metadata(out)
        tables = manifest.tables
        assert tables.blocks.rows > 4 * window
        problems = metadata_verify.verify_metadata(manifest)
        said = "block_digest" if older else "block rows sum to"  # the digest, made before the edit, is checked first
        assert len(problems) == 1 and tables.name(7) in problems[0] and said in problems[0], problems


def test_a_dataset_written_before_the_block_chunk_table_checks_digests_and_upgrade_writes_the_table(
    packed: Path, tmp_path: Path, monkeypatch
) -> None:
    from tierflow.commands.cli import main as cli

    monkeypatch.setattr(metadata_writer, "BLOCK_CHUNK_ROWS", ROWS)  # upgrade's chunks, as the fixture's

    out = copy(packed, tmp_path)
    want = batches(out)
    current = before_block_chunks(out)
    tables = md.load_metadata(out).tables
    assert tables.block_chunks is None and tables.blocks.chunk_count == 1
    tables.shard(3)
    assert tables.shards._verified["block_digest"].any() and "length" not in tables.blocks._verified
    assert batches(out) == want
    assert metadata_verify.verify_metadata(md.load_metadata(out)) == []
    assert cli(["upgrade", str(out)]) == 0
    assert header(out) == current  # the writer's own header: the table written again, nothing else
    assert md.load_metadata(out).tables.block_chunks is not None and batches(out) == want


def test_a_forged_block_digest_is_refused_where_the_digest_is_what_checks_the_rows(
    packed: Path, tmp_path: Path
) -> None:
    """A block_digest that is not its shard's rows, every hash recomputed: without the block chunk
    table the digest checks the rows, and the shard is refused (and named by verify); with it the
    rows are checked by their chunks' hashes, and the digest is kept only for readers older than it."""
    out = copy(packed, tmp_path)
    forge(out, lambda s, b: s["block_digest"].__setitem__(2, s["block_digest"][2] ^ 1), packed)
    assert metadata_verify.verify_metadata(md.load_metadata(out)) == []
    assert md.load_metadata(out).tables.shard(2).samples > 0
    before_block_chunks(out)
    manifest = md.load_metadata(out)
    tables = manifest.tables
    problems = metadata_verify.verify_metadata(manifest)
    assert (
        len(problems) == 1 and f"shard {tables.name(2)}: its rows of" in problems[0] and "block_digest" in problems[0]
    )
    with pytest.raises(ManifestError, match="block_digest"):
        tables.shard(2)


def test_a_block_chunk_table_removed_by_an_older_gc_checks_digests_and_upgrade_writes_it_again(
    packed: Path, tmp_path: Path, caplog
) -> None:
    from tierflow.commands.cli import main as cli

    out = copy(packed, tmp_path)
    want = batches(out)
    d = header(out)
    (out / d["block_chunks"]["file"]).unlink()
    with caplog.at_level("WARNING", logger="tierflow.format"):
        tables = md.load_metadata(out).tables
    assert f"its block chunk table {d['block_chunks']['file']} is missing" in caplog.text
    assert "block_digest" in caplog.text and tables.block_chunks is None
    assert batches(out) == want
    assert metadata_verify.verify_metadata(md.load_metadata(out)) == []
    assert cli(["upgrade", str(out)]) == 0
    assert (out / d["block_chunks"]["file"]).is_file() and header(out) == d


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            lambda d: d["block_chunks"].__setitem__("rows_per_chunk", 0),
            "block_chunks.rows_per_chunk is not a positive count",
        ),
        (
            lambda d: d["block_chunks"].__setitem__("rows_per_chunk", 7),
            r"block_chunks has \d+ rows, not one a chunk of 7",
        ),
        (
            lambda d: d["block_chunks"]["columns"].pop("blocks.rows"),
            "block_chunks.columns does not list a hash for each",
        ),
        (
            lambda d: d["block_chunks"].__setitem__("file", "../x.arrow"),
            "block_chunks.file '../x.arrow' is not a metadata table",
        ),
        (lambda d: d["block_chunks"].__setitem__("chunks", {"rows": 4}), r"block_chunks.chunks.columns does not list"),
    ],
)
def test_a_header_whose_block_chunk_table_entry_is_wrong_is_refused_at_open(
    packed: Path, tmp_path: Path, edit, match: str
) -> None:
    out = copy(packed, tmp_path)
    d = header(out)
    edit(d)
    write_header(out, d)
    with pytest.raises(ManifestError, match=match):
        md.load_metadata(out)
