"""Version-3 metadata (format/metadata.py): a header beside mapped Arrow tables, opened not parsed.

The same dataset read through manifest.json and through the mapped tables gives the same samples,
tokens and index answers; damage to the header, either table or a shard's block rows is refused
with a ManifestError naming the dataset and what is wrong; a manifest.json replaced after the header
was written is read as itself; `upgrade` is atomic (a crash leaves the old dataset readable)."""

from __future__ import annotations

import json
import os
import re
import pickle
import shutil
import time
from types import SimpleNamespace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

import tierflow
from tierflow.format.shard import MAX_COUNT
from tierflow.errors import ManifestError
from tierflow.format import metadata as md
from tierflow.format import metadata_index, metadata_verify, metadata_writer
from tierflow.format.dataset import Dataset
from tierflow.format.reader import DirectoryBlocks, ShardReader
from tierflow.format.index import DatasetIndex
from tierflow.format.manifest import MANIFEST_NAME, Manifest
from tierflow.testing.faults import write_corpus

from hostile import rewrite_tables


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("metadata")
    src = write_corpus(root / "a.jsonl", docs=1500, seed=3)
    tierflow.pack([src], root / "out", workers=1, tokenizer="bytes", target_shard_bytes=256 << 10, block_bytes=32 << 10)
    return root / "out"


def copy(packed: Path, tmp_path: Path) -> Path:
    out = tmp_path / "ds"
    shutil.copytree(packed, out)
    return out


def legacy(path: Path) -> Manifest:
    return Manifest.from_bytes((path / MANIFEST_NAME).read_bytes(), str(path))


def header(path: Path) -> dict:
    return json.loads((path / md.METADATA_NAME).read_bytes())


def test_pack_writes_the_tables_and_they_say_what_the_manifest_says(packed: Path) -> None:
    mapped, old = Manifest.load(packed), legacy(packed)
    assert isinstance(mapped, md.MappedManifest) and not isinstance(old, md.MappedManifest)
    assert len(old.shards) > 3 and len(mapped.shards) == len(old.shards)
    assert mapped.dataset_id == old.dataset_id and mapped.num_samples == old.num_samples
    assert mapped.num_tokens == old.num_tokens and mapped.schema == old.schema
    for a, b in zip(old.shards, mapped.shards):
        assert (
            a.name,
            a.samples,
            a.bytes,
            a.decoded_bytes,
            a.tokens,
            a.checksum,
            a.decoded_checksum,
            a.compression,
        ) == (b.name, b.samples, b.bytes, b.decoded_bytes, b.tokens, b.checksum, b.decoded_checksum, b.compression)
        assert list(a.blocks) == list(b.blocks)
    assert metadata_verify.verify_metadata(mapped) == []
    for name in ("samples", "decoded_bytes", "largest_rows"):
        assert md.shard_column(mapped, name).tolist() == md.shard_column(old, name).tolist()


def test_the_mapped_index_answers_as_the_parsed_one(packed: Path) -> None:
    mapped = tierflow.open_dataset(packed)
    assert isinstance(mapped.index, metadata_index.MappedIndex)
    old = Dataset(legacy(packed), ShardReader(DirectoryBlocks(packed)), location=str(packed))
    assert isinstance(old.index, DatasetIndex)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, len(old), 500)
    for a, b in zip(mapped.index.locate_samples(ids), old.index.locate_samples(ids)):
        assert a.tolist() == b.tolist()
    positions = np.concatenate([rng.integers(0, old.num_tokens, 500), old.token_starts[:-1], [old.num_tokens - 1]])
    assert mapped.index.token_blocks(positions).tolist() == old.index.token_blocks(positions).tolist()
    assert mapped.token_starts.tolist() == old.token_starts.tolist()
    assert mapped.sample_starts.tolist() == old.sample_starts.tolist()
    for i in ids[:50].tolist():
        assert mapped.index.locate_sample(i) == old.index.locate_sample(i)
        assert {k: np.asarray(v).tolist() for k, v in mapped[i].items()} == {
            k: np.asarray(v).tolist() for k, v in old[i].items()
        }
    assert mapped.tokens(1000, 40000).tolist() == old.tokens(1000, 40000).tolist()
    again = pickle.loads(pickle.dumps(mapped.manifest))  # a worker maps the same files again
    assert isinstance(again, md.MappedManifest) and len(pickle.dumps(mapped.manifest)) < 1000
    assert metadata_index.MappedIndex(again).locate_sample(77) == mapped.index.locate_sample(77)


def test_upgrade_turns_a_version_2_dataset_into_version_3_keeping_its_id(packed: Path, tmp_path: Path) -> None:
    out = copy(packed, tmp_path)
    for p in out.glob("metadata*"):
        p.unlink()
    before = Manifest.load(out)
    assert not isinstance(before, md.MappedManifest)
    metadata_writer.upgrade(out)
    after = Manifest.load(out)
    assert isinstance(after, md.MappedManifest) and after.dataset_id == before.dataset_id
    assert metadata_verify.verify_metadata(after) == []


def test_a_crash_before_the_header_leaves_the_old_dataset(packed: Path, tmp_path: Path, monkeypatch) -> None:
    out = copy(packed, tmp_path)
    for p in out.glob("metadata*"):
        p.unlink()

    def crash(*args, **kwargs):
        raise OSError("killed")

    monkeypatch.setattr(metadata_writer, "_publish", crash)
    with pytest.raises(OSError):
        metadata_writer.upgrade(out)
    loaded = Manifest.load(out)
    assert not isinstance(loaded, md.MappedManifest) and len(loaded.shards)
    assert not list(out.glob(".tmp-*"))


def test_an_edited_manifest_json_is_read_as_itself_not_shadowed_by_the_header(packed: Path, tmp_path: Path) -> None:
    out = copy(packed, tmp_path)
    d = json.loads((out / MANIFEST_NAME).read_bytes())
    d["shards"][0]["samples"] += 1
    (out / MANIFEST_NAME).write_text(json.dumps(d))
    with pytest.raises(ManifestError, match="manifest_checksum"):
        Manifest.load(out)


def test_an_unfinished_pack_has_no_dataset(packed: Path, tmp_path: Path) -> None:
    out = copy(packed, tmp_path)
    (out / MANIFEST_NAME).unlink()  # the header records the manifest pack was about to publish
    with pytest.raises(ManifestError, match="no manifest"):
        Manifest.load(out)
    assert not metadata_writer.is_published(out)


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _column_offset(path: Path, column: str, row: int) -> int:
    """Where row `row` of `column` lies in the IPC file (its values' bytes found in the file)."""
    with pa.memory_map(str(path)) as f:
        arr = pa.ipc.open_file(f).get_batch(0).column(column)
        width = arr.type.byte_width
        values = arr.buffers()[1].to_pybytes()[: len(arr) * width]
    at = path.read_bytes().find(values)
    assert at >= 0
    return at + row * width


@pytest.mark.parametrize("column", ["samples", "checksum", "first_block", "block_digest"])
def test_a_damaged_shard_table_column_is_refused_naming_the_dataset(packed: Path, tmp_path: Path, column: str) -> None:
    out = copy(packed, tmp_path)
    table = out / header(out)["shards"]["file"]
    _flip(table, _column_offset(table, column, 1))
    manifest = Manifest.load(out)  # O(1): nothing per shard is read at open
    with pytest.raises(ManifestError, match=rf"{out}.*column {column} does not match its hash"):
        manifest.tables.column(column)
    assert re.search(rf"column {column} does not match", metadata_verify.verify_metadata(Manifest.load(out))[0])
    if column == "block_digest":
        return  # checked by readers written before the block chunk table, which reads no digest
    with pytest.raises(ManifestError, match=str(out)):
        ds = tierflow.open_dataset(out)
        [ds[i] for i in range(0, len(ds), 97)]


def test_a_damaged_block_row_is_refused_when_its_shard_is_used(packed: Path, tmp_path: Path) -> None:
    out = copy(packed, tmp_path)
    table = out / header(out)["blocks"]["file"]
    _flip(table, _column_offset(table, "rows", 0))
    ds = tierflow.open_dataset(out)
    assert len(ds) == legacy(out).num_samples
    with pytest.raises(
        ManifestError, match=rf"{out}: metadata-blocks-.*column rows does not match its hash in the block chunk table"
    ):
        ds[0]
    problems = metadata_verify.verify_metadata(Manifest.load(out))
    assert problems and "column rows does not match" in problems[0]


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda h: h.update(totals={**h["totals"], "samples": h["totals"]["samples"] + 1}), "header_checksum"),
        (lambda h: h["shards"].update(file="../../etc/passwd"), "header_checksum"),
    ],
)
def test_an_edited_header_is_refused(packed: Path, tmp_path: Path, edit, match: str) -> None:
    out = copy(packed, tmp_path)
    h = header(out)
    edit(h)
    (out / md.METADATA_NAME).write_text(json.dumps(h))
    with pytest.raises(ManifestError, match=match):
        Manifest.load(out)


def test_a_hostile_header_with_a_valid_checksum_is_still_checked(packed: Path, tmp_path: Path) -> None:
    out = copy(packed, tmp_path)
    for edit, match in [
        (lambda h: h["shards"].update(file="../x.arrow"), "not a metadata table inside"),
        (lambda h: h["shards"].update(size=5), "the header says 5"),
        (lambda h: h["totals"].update(samples=1), "sum to|stats.samples"),
        (lambda h: h["blocks"].update(rows=h["blocks"]["rows"] + 1), "totals.blocks"),
    ]:
        h = header(copy_dir := out)
        edit(h)
        h.pop("manifest")
        h["manifest"] = None
        h[md.HEADER_CHECKSUM_KEY] = md.header_checksum(h)
        target = tmp_path / f"h{abs(hash(match))}"
        shutil.copytree(copy_dir, target)
        (target / MANIFEST_NAME).unlink()
        (target / md.METADATA_NAME).write_text(json.dumps(h))
        with pytest.raises(ManifestError, match=match):
            m = Manifest.load(target)
            m.tables.column("samples")
        shutil.rmtree(target)


def test_gc_keeps_the_tables_the_header_names_and_drops_others(packed: Path, tmp_path: Path) -> None:
    from tierflow.pack.dataset_dir import remove_unreferenced

    out = copy(packed, tmp_path)
    stale = out / f"{md.TABLE_PREFIX}shards-{'0' * 32}{md.TABLE_SUFFIX}"
    stale.write_bytes(b"old")
    removed = remove_unreferenced(out, Manifest.load(out))
    assert stale in removed and not stale.exists()
    assert isinstance(Manifest.load(out), md.MappedManifest)


@pytest.mark.parametrize("chunk_rows", [None, 4])
def test_an_s3_dataset_maps_its_tables_from_a_node_local_copy(
    packed: Path, tmp_path: Path, s3_server, s3_bucket, monkeypatch, chunk_rows: int | None
) -> None:
    """Its tables (and, of more shards than a chunk holds, the chunk table) downloaded once per node,
    read as the local dataset reads, kept by gc."""
    from tierflow.format.metadata_windows import DEFAULT_LENGTHS
    from tierflow.format.metadata_writer import write_metadata
    from tierflow.pack.dataset_dir import remove_unreferenced
    from tierflow.storage.remote import upload_dataset

    monkeypatch.setenv("TIERFLOW_METADATA_CACHE", str(tmp_path / "cache"))
    url = f"s3://{s3_bucket}/ds-{chunk_rows}"
    source = packed
    if chunk_rows is not None:
        source = copy(packed, tmp_path)
        raw = (source / MANIFEST_NAME).read_bytes()
        write_metadata(source, legacy(source), manifest_bytes=raw, chunk_rows=chunk_rows)
        remove_unreferenced(source, Manifest.load(source))
    upload_dataset(source, url, endpoint_url=s3_server.endpoint_url)
    remote = tierflow.open_dataset(url, endpoint_url=s3_server.endpoint_url)
    assert isinstance(remote.manifest, md.MappedManifest)
    local = tierflow.open_dataset(packed)
    assert len(remote) == len(local) and remote.manifest.dataset_id == local.manifest.dataset_id
    for i in (0, 17, len(local) - 1):
        assert {k: np.asarray(v).tolist() for k, v in remote[i].items()} == {
            k: np.asarray(v).tolist() for k, v in local[i].items()
        }
    cached = sorted(p.name.split("-")[1] for p in (tmp_path / "cache").glob("*/metadata-*.arrow"))
    rewritten = ["chunks"]  # from manifest.json, with no window lengths asked
    tables = ["blocks", "block_chunks", "layout", "shards"]
    assert cached == sorted(tables + (["windows"] * len(DEFAULT_LENGTHS) if chunk_rows is None else rewritten))
    assert (remote.manifest.tables.chunks is None) == (chunk_rows is None)
    again = pickle.loads(pickle.dumps(remote.manifest))  # a worker maps the node's copy
    assert again.dataset_id == local.manifest.dataset_id
    from tierflow.storage.datasets import collect_garbage
    from tierflow.storage.remote import open_store

    assert collect_garbage(open_store(url, endpoint_url=s3_server.endpoint_url)) == []


def test_an_s3_dataset_whose_manifest_was_replaced_reads_the_manifest(
    packed: Path, tmp_path: Path, s3_server, s3_bucket, monkeypatch
) -> None:
    from tierflow.storage.remote import open_store, upload_dataset

    monkeypatch.setenv("TIERFLOW_METADATA_CACHE", str(tmp_path / "cache"))
    url = f"s3://{s3_bucket}/ds2"
    upload_dataset(packed, url, endpoint_url=s3_server.endpoint_url)
    source = open_store(url, endpoint_url=s3_server.endpoint_url)
    d = json.loads((packed / MANIFEST_NAME).read_bytes())
    d["shards"][0]["samples"] += 1
    (tmp_path / "m.json").write_text(json.dumps(d))
    source.upload(tmp_path / "m.json", MANIFEST_NAME)
    with pytest.raises(ManifestError, match="manifest_checksum"):
        tierflow.open_dataset(url, endpoint_url=s3_server.endpoint_url)


def test_the_cli_upgrades_verifies_inspects_and_gcs_a_version_3_dataset(packed: Path, tmp_path: Path, capsys) -> None:
    from tierflow.commands.cli import main

    out = copy(packed, tmp_path)
    for p in out.glob("metadata*"):
        p.unlink()
    assert main(["upgrade", str(out)]) == 0
    assert isinstance(Manifest.load(out), md.MappedManifest)
    assert main(["verify", str(out)]) == 0
    assert main(["inspect", str(out), "-n", "1"]) == 0
    assert "samples in" in capsys.readouterr().out
    assert main(["gc", str(out)]) == 0
    assert (
        isinstance(Manifest.load(out), md.MappedManifest) and metadata_verify.verify_metadata(Manifest.load(out)) == []
    )
    table = out / header(out)["blocks"]["file"]
    _flip(table, _column_offset(table, "checksum", 3))
    assert main(["verify", str(out)]) == 1
    assert "column checksum does not match" in capsys.readouterr().err


def test_the_cli_upgrades_an_s3_dataset(packed: Path, tmp_path: Path, s3_server, s3_bucket, monkeypatch) -> None:
    from tierflow.commands.cli import main
    from tierflow.storage.remote import upload_dataset

    monkeypatch.setenv("TIERFLOW_METADATA_CACHE", str(tmp_path / "cache"))
    out = copy(packed, tmp_path)
    for p in out.glob("metadata*"):
        p.unlink()
    url = f"s3://{s3_bucket}/v2"
    upload_dataset(out, url, endpoint_url=s3_server.endpoint_url)
    assert not isinstance(tierflow.open_dataset(url, endpoint_url=s3_server.endpoint_url).manifest, md.MappedManifest)
    assert main(["upgrade", url, "--endpoint-url", s3_server.endpoint_url]) == 0
    ds = tierflow.open_dataset(url, endpoint_url=s3_server.endpoint_url)
    assert isinstance(ds.manifest, md.MappedManifest) and ds.manifest.dataset_id == legacy(out).dataset_id
    assert main(["verify", url, "--endpoint-url", s3_server.endpoint_url]) == 0


def _forge(out: Path, edit) -> None:
    """Rewrite the dataset's tables through the writer with `edit(shards, blocks)` applied: every hash
    recomputed, so only the reader's own checks stand between it and the lie (issue 18's attacker)."""
    rewrite_tables(out, out, edit)
    (out / MANIFEST_NAME).unlink()  # the header alone: what a reader reads


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            lambda s, b: b["rows"].__setitem__(int(s["first_block"][2]), b["rows"][int(s["first_block"][2])] + 1),
            "block rows sum to",
        ),
        (lambda s, b: b["length"].__setitem__(int(s["first_block"][2]), 1 << 31), "outside the file"),
        (lambda s, b: s["largest_rows"].__setitem__(2, 1), "largest_rows"),
    ],
)
def test_hostile_tables_with_every_hash_recomputed_are_refused(packed: Path, tmp_path: Path, edit, match) -> None:
    out = copy(packed, tmp_path)
    _forge(out, edit)
    manifest = Manifest.load(out)
    problems = metadata_verify.verify_metadata(manifest)
    assert len(problems) == 1 and re.search(match, problems[0]) and manifest.tables.name(2) in problems[0]
    with pytest.raises(ManifestError, match=match):
        manifest.shards[2]


def test_hostile_shard_columns_with_every_hash_recomputed_are_refused(packed: Path, tmp_path: Path) -> None:
    first = lambda out: tierflow.open_dataset(out)[0]
    for edit, match, use in [
        (lambda s, b: s["samples"].__setitem__(1, -5), "negative or absurd", first),
        (
            lambda s, b: s["checksum"].__setitem__(3, s["checksum"][1]),
            "listed twice",
            lambda out: Manifest.load(out).shards[3],
        ),
        (
            lambda s, b: s["checksum"].__setitem__(3, s["checksum"][1]),
            "listed twice",
            lambda out: Manifest.load(out).shards[1],
        ),
        (lambda s, b: s["compression"].__setitem__(0, 9), "unknown compression", first),
        (lambda s, b: s["sample_start"].__setitem__(2, 0), "running sum", first),
        (lambda s, b: s["first_block"].__setitem__(1, 0), "running sum", first),
    ]:
        out = tmp_path / "ds"
        shutil.rmtree(out, ignore_errors=True)
        out = copy(packed, tmp_path)
        _forge(out, edit)
        with pytest.raises(ManifestError, match=match):
            use(out)


def test_checksums_sharing_their_high_half_are_told_apart_by_their_low_half(packed: Path, tmp_path: Path) -> None:
    """checksum_order's check compares the high halves and only where they tie the low ones: two
    shards whose checksums differ in the last byte alone are two shards; the same checksum twice is
    refused (both through the writer, every hash recomputed)."""

    def near(s, b) -> None:
        raw = bytearray(s["checksum"][1].tobytes())
        raw[-1] ^= 1
        s["checksum"][2] = np.frombuffer(bytes(raw), dtype="V16")[0]

    out = copy(packed, tmp_path)
    _forge(out, near)
    manifest = md.load_metadata(out)
    checksums = manifest.tables.checksums()
    assert checksums[2].tobytes()[:8] == checksums[1].tobytes()[:8] and checksums[2] != checksums[1]
    shutil.rmtree(out)
    out = copy(packed, tmp_path)
    _forge(out, lambda s, b: s["checksum"].__setitem__(2, s["checksum"][1]))
    with pytest.raises(ManifestError, match="listed twice"):
        md.load_metadata(out).tables.checksums()


def test_a_pack_too_large_for_a_manifest_replaces_the_old_one_only_after_its_header(
    packed: Path, tmp_path: Path, monkeypatch
) -> None:
    out = copy(packed, tmp_path)
    old = legacy(out)
    metadata_writer.write_with_manifest(out, old, legacy_max_shards=0)
    assert not (out / MANIFEST_NAME).exists() and metadata_writer.is_published(out)
    assert isinstance(Manifest.load(out), md.MappedManifest)
    out2 = tmp_path / "again"
    shutil.copytree(packed, out2)
    monkeypatch.setattr(Path, "unlink", lambda self, missing_ok=False: (_ for _ in ()).throw(OSError("killed")))
    with pytest.raises(OSError):
        metadata_writer.write_with_manifest(out2, old, legacy_max_shards=0)
    monkeypatch.undo()
    still = Manifest.load(out2)  # the header recording no manifest beside an older manifest.json: the old one
    assert not isinstance(still, md.MappedManifest) and still.dataset_id == old.dataset_id


def test_the_loader_reads_the_same_batches_through_either_form_and_resumes_across_an_upgrade(
    packed: Path, tmp_path: Path
) -> None:
    from tierflow.loader import BatchSpec, Loader, TieredDataset

    v2 = copy(packed, tmp_path)
    for p in v2.glob("metadata*"):
        p.unlink()
    v3 = packed

    def batches(path: Path, n: int, resume=None) -> tuple[list, object]:
        loader = Loader(TieredDataset(str(path), BatchSpec(batch_size=16, seq_len=64), resume=resume), endless=True)
        out = []
        for batch in loader:
            out.append(np.asarray(batch["input_ids"]).tolist())
            if len(out) == n:
                break
        state = loader.state_dict()
        loader.close()
        return out, state

    old, state = batches(v2, 6)
    new, _ = batches(v3, 6)
    assert old == new
    after_old, _ = batches(v2, 3, resume=state)
    after_new, _ = batches(v3, 3, resume=state)  # a cursor saved before the upgrade resumes after it
    assert after_old == after_new


def test_counts_whose_int64_sum_wraps_round_to_the_header_total_are_refused() -> None:
    """Each count is below MAX_COUNT, but 70,000 of them overflow an int64 sum, which wraps to a
    small positive number: a forger would write that number in the header."""
    counts = np.full(70_000, MAX_COUNT - 1, dtype=np.int64)
    wrapped = int(counts.sum(dtype=np.int64))
    assert 0 < wrapped < MAX_COUNT * 70_000  # the wrap this guards against
    tables = SimpleNamespace(num_shards=counts.size, totals={"samples": wrapped})
    assert "absurd" in md.MetadataTables._check(tables, "samples", 0, 0, counts)


def test_a_dataset_dropped_by_its_reader_holds_no_table_open(packed: Path, tmp_path: Path) -> None:
    """Dropping a dataset releases its tables at once, not at Python's next cycle collection: a
    process that read a dataset and then packs over it (its gc) must find the old tables unused."""
    import gc

    out = copy(packed, tmp_path)

    def open_tables() -> list[str]:
        names = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if target.startswith(str(out)) and md.TABLE_PREFIX in target:
                names.append(target)
        return names

    gc.disable()
    try:
        manifest = Manifest.load(out)
        assert manifest.shards[0].samples > 0
        dataset = tierflow.open_dataset(out)
        assert len(dataset[0]) > 0
        assert open_tables()
        del manifest, dataset
        # pyarrow lets go of a mapped file a moment after its last reference (no cycle: gc is off)
        for _ in range(1000):
            if not open_tables():
                break
            time.sleep(0.001)
        assert open_tables() == []
    finally:
        gc.enable()


def test_verify_computes_each_shards_block_digest_and_the_dataset_id_as_defined() -> None:
    """verify's vectorised digests and id agree with `block_digest` and `compute_dataset_id`, for
    uneven block counts (empty shards too) and for more shards than one chunk of names."""
    from tierflow.format.manifest import compute_dataset_id

    rng = np.random.default_rng(5)
    counts = rng.integers(0, 9, size=300)
    total = int(counts.sum())
    blocks = {
        "length": rng.integers(1, 2**32, size=total, dtype=np.uint32),
        "rows": rng.integers(0, 2**32, size=total, dtype=np.uint32),
        "checksum": rng.integers(0, 2**64, size=total, dtype=np.uint64),
        "tokens": rng.integers(0, 2**32, size=total, dtype=np.uint32),
    }
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    got = metadata_verify._shard_digests(blocks, starts, counts)
    want = [
        md.block_digest(*(blocks[k][a : a + n] for k in ("length", "rows", "checksum", "tokens")))
        for a, n in zip(starts, counts)
    ]
    assert got.tolist() == want
    checksums = rng.integers(0, 256, size=(300, 16), dtype=np.uint8).view("V16").reshape(300)
    schema = {"fields": [{"name": "x", "type": "int64"}]}
    names = [c.tobytes().hex() for c in checksums]
    assert metadata_verify.streamed_dataset_id(schema, None, checksums, chunk=64) == compute_dataset_id(
        schema, None, names
    )
