"""Version-3 metadata verified a chunk of rows at a time (format/metadata_table.py, issue 38).

A process hashes and checks the chunks of the shard table holding the shards it uses, not the
table; damage in a chunk is refused when a shard of it is used, and by `verify` at once; a hostile
writer that recomputes every hash is still caught by each chunk's checks against the header's
running sums; a shard listed twice is refused whichever of the two is named; the header's summary
sizes the working set as the columns would; `upgrade` brings a header written before chunks and
summaries up to date, and the dataset reads the same."""

from __future__ import annotations

import json
import re
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

from hostile import inline_chunks, rewrite_tables, write_header

CHUNK = 4


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """14 shards, written with chunks of 4 rows (4 chunks: 4, 4, 4 and 2 shards)."""
    root = tmp_path_factory.mktemp("chunks")
    src = write_corpus(root / "a.jsonl", docs=3000, seed=3)
    tierflow.pack([src], root / "out", workers=1, tokenizer="bytes", target_shard_bytes=256 << 10, block_bytes=16 << 10)
    forge(root / "out", lambda s: None, root / "out")
    return root / "out"


def forge(out: Path, edit, source: Path) -> None:
    """Rewrite the dataset's tables through the writer, chunks of CHUNK rows, with `edit(shard columns)`
    applied: every hash and the header's running sums recomputed from what the edit left."""
    rewrite_tables(out, source, lambda shards, blocks: edit(shards), chunk_rows=CHUNK)


def parsed(packed: Path) -> Manifest:
    return Manifest.from_bytes((packed / MANIFEST_NAME).read_bytes(), str(packed))


def copy(packed: Path, tmp_path: Path) -> Path:
    out = tmp_path / "ds"
    shutil.copytree(packed, out)
    (out / MANIFEST_NAME).unlink()
    return out


def verified(tables: md.MetadataTables, name: str) -> list[bool]:
    return [bool(f) for f in tables.shards._verified.get(name, np.zeros(4, dtype=bool))]


def test_a_process_checks_the_chunks_of_the_shards_it_uses(packed: Path, tmp_path: Path) -> None:
    out = copy(packed, tmp_path)
    tables = md.load_metadata(out).tables
    assert tables.shards.chunk_rows == CHUNK and tables.shards.chunk_count == 4
    shard = tables.shard(9)
    assert shard.samples == parsed(packed).shards[9].samples
    for name in ("bytes", "first_block", "decoded_checksum", "compression"):
        assert verified(tables, name) == [False, False, True, False], name
    dataset = tierflow.open_dataset(out)
    first = dataset[len(dataset) - 1]  # the last sample: the last chunk's shards
    assert first is not None
    assert verified(dataset.manifest.tables, "first_block")[:3] == [False, False, False]


def test_damage_in_a_chunk_is_refused_when_its_shards_are_used_and_by_verify(packed: Path, tmp_path: Path) -> None:
    out = copy(packed, tmp_path)
    tables = md.load_metadata(out).tables
    path, column = tables.shards.path, tables.shards.raw("bytes")
    at = column.ctypes.data - tables.shards._map_base() + 5 * 8  # shard 5's bytes: chunk 1
    del tables
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))
    manifest = md.load_metadata(out)
    manifest.tables.shard(0)
    manifest.tables.shard(13)  # other chunks: served
    with pytest.raises(ManifestError, match=r"column bytes, rows 4-7, does not match its hash in the chunk table"):
        manifest.tables.shard(5)
    with pytest.raises(ManifestError, match="column bytes"):
        manifest.tables.shard(4)  # its chunk's neighbour too, never served
    problems = metadata_verify.verify_metadata(md.load_metadata(out))
    assert len(problems) == 1 and "column bytes, rows 4-7" in problems[0]


def test_running_sums_shifted_at_a_chunk_edge_are_refused_with_every_hash_recomputed(
    packed: Path, tmp_path: Path
) -> None:
    """sample_start raised by one from shard 8 on: within each chunk still the running sum of the
    samples, and the header's starts recomputed from it, but chunk 1's samples no longer add up to the
    step between the header's starts of chunks 1 and 2 (nor the last chunk's to the total)."""
    out = copy(packed, tmp_path)

    def shift(s) -> None:
        s["sample_start"][8:] += 1

    forge(out, shift, packed)
    manifest = md.load_metadata(out)
    manifest.tables.shard(0)
    with pytest.raises(ManifestError, match=r"shards #4-#7: their samples sum to \d+, the chunk table says \d+"):
        manifest.tables.shard(5)
    assert metadata_verify.verify_metadata(md.load_metadata(out))


def test_a_shard_listed_twice_is_refused_whichever_is_named(packed: Path, tmp_path: Path) -> None:
    out = copy(packed, tmp_path)
    forge(out, lambda s: s["checksum"].__setitem__(10, s["checksum"][2]), packed)
    for twice in (2, 10):
        with pytest.raises(ManifestError, match="listed twice"):
            md.load_metadata(out).tables.shard(twice)
    assert md.load_metadata(out).tables.shard(6).samples > 0  # another shard's name is its own
    with pytest.raises(ManifestError, match="listed twice"):
        md.load_metadata(out).tables.checksums()
    problems = metadata_verify.verify_metadata(md.load_metadata(out))
    assert any("listed twice" in p for p in problems)


def test_a_damaged_checksum_order_is_refused_when_a_name_is_looked_up(
    packed: Path, tmp_path: Path, monkeypatch
) -> None:
    """checksum_order that lists shard 3 where shard 4 sorts and 4 where 3 does (its hashes
    recomputed): naming either is refused, not answered from the wrong place; other names are served."""
    out = copy(packed, tmp_path)
    real = metadata_writer.checksum_order
    monkeypatch.setattr(metadata_writer, "checksum_order", lambda c: _swapped(real(c)))
    forge(out, lambda s: None, packed)
    for shard in (3, 4):
        with pytest.raises(ManifestError, match=f"checksum_order does not list shard #{shard}"):
            md.load_metadata(out).tables.name(shard)
    assert md.load_metadata(out).tables.name(5)


def _swapped(order: np.ndarray) -> np.ndarray:
    order = order.copy()
    i, j = int(np.flatnonzero(order == 3)[0]), int(np.flatnonzero(order == 4)[0])
    order[i], order[j] = 4, 3
    return order


def test_lookups_across_chunks_answer_as_the_parsed_manifest(packed: Path, tmp_path: Path) -> None:
    mapped, parsed = tierflow.open_dataset(copy(packed, tmp_path)), tierflow.open_dataset(packed)
    ids = np.arange(len(parsed))
    a, b = mapped.index.locate_samples(ids), parsed.index.locate_samples(ids)
    assert a.shard.tolist() == b.shard.tolist() and a.row.tolist() == b.row.tolist()
    positions = np.arange(0, mapped.manifest.num_tokens, 997)
    assert mapped.index.token_blocks(positions).tolist() == parsed.index.token_blocks(positions).tolist()


def test_the_summary_sizes_the_working_set_as_the_columns_do(packed: Path, tmp_path: Path) -> None:
    out = copy(packed, tmp_path)
    with_summary = TieredDataset(out, BatchSpec(batch_size=16))
    d = json.loads((out / md.METADATA_NAME).read_bytes())
    top = d["summary"]["bytes"]
    assert len(top) == 14 and top == sorted(md.shard_column(with_summary.manifest, "bytes").tolist(), reverse=True)
    del d["summary"]
    write_header(out, d)
    without = TieredDataset(out, BatchSpec(batch_size=16))
    assert without.working_set == with_summary.working_set
    assert without.decoded_bound() == with_summary.decoded_bound()
    assert without.order.config_hash == with_summary.order.config_hash


def test_a_forged_summary_is_named_by_verify(packed: Path, tmp_path: Path) -> None:
    out = copy(packed, tmp_path)
    d = json.loads((out / md.METADATA_NAME).read_bytes())
    d["summary"]["decoded_bytes"][0] += 1
    write_header(out, d)
    problems = metadata_verify.verify_metadata(md.load_metadata(out))
    assert problems == [f"{out}: summary.decoded_bytes is not what the shard table's columns give"]
    d["summary"]["bytes"] = d["summary"]["bytes"][::-1]
    write_header(out, d)
    with pytest.raises(ManifestError, match="summary.bytes is not the 14 largest sizes, falling"):
        md.load_metadata(out)


@pytest.mark.parametrize(
    "edit",
    [
        lambda top: top.reverse(),
        lambda top: top.__setitem__(-1, -1),
        lambda top: top.__setitem__(0, float(top[0])),
        lambda top: top.__setitem__(-1, False),
        lambda top: top.__setitem__(0, 1 << 60),
        lambda top: top.__setitem__(3, str(top[3])),
    ],
    ids=["rising", "negative", "a float", "a bool", "absurd", "a string"],
)
def test_a_hostile_summary_is_refused_at_open(packed: Path, tmp_path: Path, edit) -> None:
    out = copy(packed, tmp_path)
    d = json.loads((out / md.METADATA_NAME).read_bytes())
    edit(d["summary"]["bytes"])
    write_header(out, d)
    with pytest.raises(
        ManifestError, match=rf"{re.escape(str(out))}.*summary.bytes is not the 14 largest sizes, falling"
    ):
        md.load_metadata(out)


def test_upgrade_adds_chunks_and_a_summary_to_an_older_header(packed: Path, tmp_path: Path) -> None:
    """A header as tierflow wrote it before chunks and summaries (one hash a column) reads as before,
    each column checked whole; `upgrade` writes its chunk table and summary (the other tables
    untouched) and the dataset reads the same."""
    from tierflow.commands.cli import main as cli

    out = copy(packed, tmp_path)
    metadata_writer.write_metadata(out, parsed(packed))
    current = json.loads((out / md.METADATA_NAME).read_bytes())
    old = inline_chunks(out, current)
    del old["summary"]
    for table in ("shards", "layout"):
        del old[table]["chunks"]
    write_header(out, old)
    before = TieredDataset(out, BatchSpec(batch_size=16))
    assert before.manifest.tables.shards.chunk_rows == 14  # one chunk of every row
    batches = [b.meta.sample_ids.tolist() for _, b in zip(range(4), before)]
    assert cli(["upgrade", str(out)]) == 0
    upgraded = json.loads((out / md.METADATA_NAME).read_bytes())
    assert upgraded == current  # the writer's own header: nothing else changed
    after = TieredDataset(out, BatchSpec(batch_size=16))
    assert after.order.config_hash == before.order.config_hash
    assert [b.meta.sample_ids.tolist() for _, b in zip(range(4), after)] == batches
    assert metadata_verify.verify_metadata(md.load_metadata(out)) == []
    assert cli(["upgrade", str(out)]) == 0 and json.loads((out / md.METADATA_NAME).read_bytes()) == current


def test_a_header_holding_its_chunk_hashes_reads_the_same_and_upgrade_moves_them_to_the_chunk_table(
    packed: Path, tmp_path: Path
) -> None:
    """Chunk hashes as tierflow wrote them into the header before the chunk table (hex lists, the
    running sums beside them): checked a chunk at a time as before, the same batches; `upgrade`
    writes the chunk table and the header the writer writes; damage in such a chunk is refused."""
    from tierflow.commands.cli import main as cli

    out = copy(packed, tmp_path)
    metadata_writer.write_metadata(out, parsed(packed))
    current = json.loads((out / md.METADATA_NAME).read_bytes())
    write_header(out, inline_chunks(out, current, rows=CHUNK))
    before = TieredDataset(out, BatchSpec(batch_size=16))
    tables = before.manifest.tables
    assert tables.chunks is None and tables.shards.chunk_rows == CHUNK and tables.shards.chunk_count == 4
    batches = [b.meta.sample_ids.tolist() for _, b in zip(range(4), before)]
    assert 0 < sum(map(sum, (verified(tables, n) for n in ("samples", "bytes")))) < 8
    assert metadata_verify.verify_metadata(md.load_metadata(out)) == []
    assert cli(["upgrade", str(out)]) == 0
    assert json.loads((out / md.METADATA_NAME).read_bytes()) == current
    after = TieredDataset(out, BatchSpec(batch_size=16))
    assert [b.meta.sample_ids.tolist() for _, b in zip(range(4), after)] == batches


def test_a_damaged_chunk_table_is_refused_when_a_chunk_it_vouches_for_is_first_used(
    packed: Path, tmp_path: Path
) -> None:
    """A flipped byte in the chunk table (its hashes in the header unchanged): the first chunk check
    of that column refuses it, naming the chunk table; `verify` names it too."""
    out = copy(packed, tmp_path)
    tables = md.load_metadata(out).tables
    assert tables.chunks is not None
    path, column = tables.chunks.path, tables.chunks.raw("shards.bytes")
    at = column.ctypes.data - tables.chunks._map_base() + 16 + 3  # chunk 1's hash
    del tables
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    manifest = md.load_metadata(out)
    assert manifest.tables.value("samples", 5) > 0  # other columns: served
    with pytest.raises(ManifestError, match=r"metadata-chunks-[0-9a-f]+\.arrow: column shards\.bytes does not match"):
        manifest.tables.value("bytes", 0)
    problems = metadata_verify.verify_metadata(md.load_metadata(out))
    assert len(problems) == 1 and "column shards.bytes does not match" in problems[0]


@pytest.mark.parametrize(
    "column, edit, match",
    [
        ("first_block", lambda v: v.__setitem__(0, 3), "first_block is not 4 running sums rising from 0"),
        ("sample_start", lambda v: v.__setitem__(slice(None), v[::-1].copy()), "sample_start is not 4 running sums"),
        (
            "sample_start",
            lambda v: v.__setitem__(2, v[2] + 1),
            r"shards #4-#7: their samples sum to \d+, the chunk table says",
        ),
    ],
)
def test_forged_running_sums_in_the_chunk_table_are_refused_when_first_used(
    packed: Path, tmp_path: Path, column: str, edit, match
) -> None:
    """The chunk table's running sums edited, its hash in the header recomputed (a forger's): refused
    the first time a chunk is checked against them, naming what is wrong."""
    out = copy(packed, tmp_path)
    d = json.loads((out / md.METADATA_NAME).read_bytes())
    table = md.load_metadata(out).tables.chunks
    assert table is not None
    columns = {name: np.array(table.raw(name)) for name in table.schema.names}
    edit(columns[column])
    entry, _ = metadata_writer._write_table(out, "chunks", table.schema, columns)
    d["chunks"] = {**entry, "rows_per_chunk": CHUNK}
    write_header(out, d)
    with pytest.raises(ManifestError, match=match):
        md.load_metadata(out).tables.shard(5)
    problems = metadata_verify.verify_metadata(md.load_metadata(out))
    assert problems and any(re.search(match, p) for p in problems)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda d: d["chunks"].__setitem__("rows_per_chunk", 0), "chunks.rows_per_chunk is not a positive count"),
        (
            lambda d: d["chunks"].__setitem__("rows_per_chunk", 5),
            "chunks has 4 rows, not one a chunk of 5 of the 14 rows of shards",
        ),
        (lambda d: d["chunks"]["columns"].pop("shards.samples"), "chunks.columns does not list a hash for each"),
        (lambda d: d["chunks"]["columns"].pop("layout.partition"), "chunks.columns does not list a hash for each"),
        (lambda d: d["chunks"].__setitem__("file", "../x.arrow"), "chunks.file '../x.arrow' is not a metadata table"),
        (lambda d: d["shards"].__setitem__("chunks", {"rows": 4}), "shards.chunks is listed beside the chunk table"),
    ],
)
def test_a_header_whose_chunk_table_does_not_describe_its_tables_is_refused_at_open(
    packed: Path, tmp_path: Path, edit, match
) -> None:
    """The header's chunk-table entry, checksum recomputed (a forger's): refused on open, naming the field."""
    out = copy(packed, tmp_path)
    d = json.loads((out / md.METADATA_NAME).read_bytes())
    edit(d)
    write_header(out, d)
    with pytest.raises(ManifestError, match=match):
        md.load_metadata(out)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda d: d["shards"]["chunks"].__setitem__("rows", 0), "shards.chunks.rows is not a positive count"),
        (lambda d: d["shards"]["chunks"]["columns"]["samples"].pop(), "shards.chunks.columns does not list 4"),
        (lambda d: d["layout"]["chunks"]["columns"].pop("partition"), "layout.chunks.columns does not list"),
        (lambda d: d["shards"]["chunks"].pop("starts"), "shards.chunks.starts does not list the running sums"),
        (lambda d: d["shards"]["chunks"]["starts"]["sample_start"].reverse(), "sample_start is not 4 running sums"),
        (lambda d: d["shards"]["chunks"]["starts"]["first_block"].__setitem__(0, 3), "first_block is not 4 running"),
    ],
)
def test_a_header_whose_inline_chunks_do_not_describe_its_tables_is_refused_at_open(
    packed: Path, tmp_path: Path, edit, match
) -> None:
    """The same of a header that holds its chunk hashes (as written before the chunk table)."""
    out = copy(packed, tmp_path)
    d = inline_chunks(out, json.loads((out / md.METADATA_NAME).read_bytes()), rows=CHUNK)
    edit(d)
    write_header(out, d)
    with pytest.raises(ManifestError, match=match):
        md.load_metadata(out)


def test_a_lookup_decided_by_a_damaged_row_is_refused(packed: Path, tmp_path: Path) -> None:
    """sample_start of shard 7 (chunk 1) raised past the dataset: a search for a sample of shard 12
    turns back there and lands on shard 6, a row of the damaged chunk, which is checked and refused;
    a lookup in chunk 0 is served."""
    out = copy(packed, tmp_path)
    tables = md.load_metadata(out).tables
    path, column = tables.shards.path, tables.shards.raw("sample_start")
    at = column.ctypes.data - tables.shards._map_base() + 7 * 8
    target, first = int(column[12]) + 1, int(column[1])
    del tables
    data = bytearray(path.read_bytes())
    data[at : at + 8] = (10**9).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    index = tierflow.open_dataset(out).index
    assert index.locate_samples(np.array([first])).shard.tolist() == [1]
    with pytest.raises(ManifestError, match=r"column sample_start, rows 4-7, does not match its hash"):
        index.locate_samples(np.array([target]))


def test_shard_rows_read_slices_steps_and_single_shards_as_the_column(packed: Path, tmp_path: Path) -> None:
    tables = md.load_metadata(copy(packed, tmp_path)).tables
    rows, whole = tables.rows("decoded_bytes"), md.load_metadata(packed).tables.column("decoded_bytes")
    assert len(rows) == 14 and rows[5] == whole[5]
    assert rows[2:11].tolist() == whole[2:11].tolist() and rows[::3].tolist() == whole[::3].tolist()
    assert rows[[13, 0, 7]].tolist() == whole[[13, 0, 7]].tolist()
    assert verified(tables, "decoded_bytes") == [True, True, True, True]


def test_a_chunk_table_removed_by_an_older_gc_reads_whole_and_upgrade_writes_it_again(
    packed: Path, tmp_path: Path, caplog
) -> None:
    """A tierflow older than the chunk table reads the header but not its `chunks`, and its gc removes
    the table: the dataset still opens (every column checked whole against the header, a warning
    naming the table), reads the same batches, passes verify; `upgrade` writes the table again."""
    from tierflow.commands.cli import main as cli

    out = copy(packed, tmp_path)
    before = [b.meta.sample_ids.tolist() for _, b in zip(range(4), TieredDataset(out, BatchSpec(batch_size=16)))]
    d = json.loads((out / md.METADATA_NAME).read_bytes())
    (out / d["chunks"]["file"]).unlink()
    with caplog.at_level("WARNING", logger="tierflow.format"):
        dataset = TieredDataset(out, BatchSpec(batch_size=16))
    assert f"its chunk table {d['chunks']['file']} is missing" in caplog.text
    tables = dataset.manifest.tables
    assert tables.chunks is None and tables.shards.chunk_rows == 14  # one chunk of every row
    assert [b.meta.sample_ids.tolist() for _, b in zip(range(4), dataset)] == before
    assert metadata_verify.verify_metadata(md.load_metadata(out)) == []
    assert cli(["upgrade", str(out)]) == 0
    assert (out / d["chunks"]["file"]).is_file()
    assert json.loads((out / md.METADATA_NAME).read_bytes()) == d
    assert md.load_metadata(out).tables.chunks is not None


def test_a_missing_shard_table_is_still_refused_with_the_chunk_table_gone(packed: Path, tmp_path: Path) -> None:
    """Both gone (a header superseded, or a damaged dataset): TableGone, so a reader reads the header again."""
    from tierflow.format.table_locks import TableGone

    out = copy(packed, tmp_path)
    d = json.loads((out / md.METADATA_NAME).read_bytes())
    (out / d["chunks"]["file"]).unlink()
    (out / d["shards"]["file"]).unlink()
    with pytest.raises(TableGone, match="metadata-chunks-"):
        md.load_metadata(out)
