"""Superseded version-3 tables are garbage-collected, never while a process reads them: on a
directory a reader holds a shared lock on each table it opened and gc removes only those it can lock
exclusively; on s3 gc removes the tables older than the last publication that the header does not
name. A reader that read a header whose tables gc then removed reads the header again."""

from __future__ import annotations

import gc
import shutil
import time
from pathlib import Path

import pytest

import tierflow
from tierflow.errors import ManifestError
from tierflow.format import metadata as md
from tierflow.format.manifest import Manifest
from tierflow.format.metadata_writer import referenced_tables
from tierflow.pack.dataset_dir import remove_unreferenced
from tierflow.testing.faults import write_corpus


def pack(root: Path, out: Path, seed: int, overwrite: bool = False) -> Path:
    src = write_corpus(root / f"c{seed}.jsonl", docs=600, seed=seed)
    tierflow.pack([src], out, workers=1, tokenizer="bytes", target_shard_bytes=256 << 10, overwrite=overwrite)
    return out


@pytest.fixture(scope="module")
def two_versions(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The same directory packed twice from different corpora: its first and its second state."""
    root = tmp_path_factory.mktemp("gc")
    first = pack(root, root / "ds", seed=1)
    shutil.copytree(first, root / "first")
    pack(root, first, seed=2, overwrite=True)
    return root / "first", first


def tables_of(directory: Path) -> set[str]:
    return {p.name for p in directory.glob(f"{md.TABLE_PREFIX}*{md.TABLE_SUFFIX}")}


def superseded(two_versions: tuple[Path, Path], tmp_path: Path) -> tuple[Path, set[str], set[str]]:
    """A directory in its second state that still holds the first state's tables (as after an
    upgrade or re-pack whose gc found them in use), and both sets of table names."""
    first, second = two_versions
    out = tmp_path / "ds"
    shutil.copytree(second, out)
    old = referenced_tables(first)
    for name in old:
        shutil.copy(first / name, out / name)
    new = referenced_tables(out)
    assert old and new and not old & new
    return out, old, new


def test_gc_removes_superseded_tables_once_no_reader_holds_them(
    two_versions: tuple[Path, Path], tmp_path: Path
) -> None:
    out, old, new = superseded(two_versions, tmp_path)
    (out / md.METADATA_NAME).rename(tmp_path / "new-header")
    shutil.copy(two_versions[0] / md.METADATA_NAME, out / md.METADATA_NAME)
    reader = md.load_metadata(out)  # a process that opened the dataset before the new header
    first_name = reader.shards[0].name
    shutil.copy(tmp_path / "new-header", out / md.METADATA_NAME)
    assert remove_unreferenced(out, Manifest.load(out)) == []  # the reader has them open
    assert old | new <= tables_of(out)
    assert reader.shards[len(reader.shards) - 1].samples > 0 and reader.shards[0].name == first_name
    del reader
    gc.collect()
    removed = remove_unreferenced(out, Manifest.load(out))
    assert {p.name for p in removed} == old and tables_of(out) == new
    assert isinstance(Manifest.load(out), md.MappedManifest)
    assert remove_unreferenced(out, Manifest.load(out)) == []  # the current ones are never removed


def test_a_reader_whose_header_was_superseded_before_it_opened_the_tables_reads_the_new_one(
    two_versions: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out, old, new = superseded(two_versions, tmp_path)
    new_header = (out / md.METADATA_NAME).read_bytes()
    shutil.copy(two_versions[0] / md.METADATA_NAME, out / md.METADATA_NAME)
    opened = md.MetadataTables.__init__
    raced = []

    def publish_and_gc_first(self: md.MetadataTables, directory: Path, header: dict, where: str) -> None:
        if not raced:  # between this reader's read of the old header and its open of the tables
            raced.append(1)
            (out / md.METADATA_NAME).write_bytes(new_header)
            assert {p.name for p in remove_unreferenced(out, None) if p.name in old} == old
        opened(self, directory, header, where)

    monkeypatch.setattr(md.MetadataTables, "__init__", publish_and_gc_first)
    manifest = md.load_metadata(out)
    assert raced and referenced_tables(out) == new
    assert manifest.dataset_id == Manifest.load(two_versions[1]).dataset_id


def test_a_header_naming_a_missing_table_is_still_refused(two_versions: tuple[Path, Path], tmp_path: Path) -> None:
    out = tmp_path / "ds"
    shutil.copytree(two_versions[1], out)
    (out / next(t for t in sorted(referenced_tables(out)) if "chunks" not in t)).unlink()  # chunk tables: below
    with pytest.raises(ManifestError, match="missing"):
        md.load_metadata(out)


def test_s3_gc_removes_tables_the_header_does_not_name_and_keeps_the_current(
    two_versions: tuple[Path, Path], tmp_path: Path, s3_server, s3_bucket, monkeypatch
) -> None:
    from tierflow.storage.datasets import collect_garbage
    from tierflow.storage.remote import open_store, upload_dataset

    monkeypatch.setenv("TIERFLOW_METADATA_CACHE", str(tmp_path / "cache"))
    first, second = two_versions
    url = f"s3://{s3_bucket}/ds"
    upload_dataset(first, url, endpoint_url=s3_server.endpoint_url)
    reader = tierflow.open_dataset(url, endpoint_url=s3_server.endpoint_url)  # maps the node's copy
    source = open_store(url, endpoint_url=s3_server.endpoint_url)
    time.sleep(1.1)  # S3 times are whole seconds: the second publication is later than the first's objects
    upload_dataset(second, url, endpoint_url=s3_server.endpoint_url)
    removed = collect_garbage(source)
    old, new = referenced_tables(first), referenced_tables(second)
    assert old <= set(removed) and not new & set(removed)
    names = {e.name for e in source.entries()}
    assert new <= names and not old & names
    shards = reader.manifest.shards  # the node's copy of the old tables still serves the open reader
    assert shards[len(shards) - 1].samples > 0
    again = tierflow.open_dataset(url, endpoint_url=s3_server.endpoint_url)
    assert again.manifest.dataset_id == Manifest.load(second).dataset_id
    assert collect_garbage(source) == []
