"""The order's layout stored with version-3 metadata (format/metadata_layout.py, issue 38).

Pack and `upgrade` store the default order's partition layout, so a rank's start does not deal every
shard to its partition again; the order read through it is the very order computed without it (same
batches, same cursor config); a dataset written before it reads as before and `upgrade` adds it; a
forged layout (every hash recomputed) is refused with a ManifestError naming the dataset, and one
that is consistent but not the default order's is reported by `verify`."""

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
from tierflow.format.manifest import MANIFEST_NAME
from tierflow.format.metadata_layout import (
    LAYOUT_SCHEMA,
    LAYOUT_SCHEMA_BEFORE_MEMBERS,
    default_partitions,
    layout_columns,
)
from tierflow.format.metadata_table import ShardRows
from tierflow.loader import BatchSpec, TieredDataset
from tierflow.order.layout import PartitionLayout
from tierflow.order.order import SampleOrder
from tierflow.testing.faults import write_corpus

from hostile import assert_same_order, inline_chunks, rechunk


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("layout")
    src = write_corpus(root / "a.jsonl", docs=3000, seed=5)
    tierflow.pack([src], root / "out", workers=1, tokenizer="bytes", target_shard_bytes=256 << 10, block_bytes=32 << 10)
    return root / "out"


def copy(packed: Path, tmp_path: Path, name: str = "ds") -> Path:
    out = tmp_path / name
    shutil.copytree(packed, out)
    return out


def header(path: Path) -> dict:
    return json.loads((path / md.METADATA_NAME).read_bytes())


def write_header(path: Path, d: dict) -> None:
    d = {k: v for k, v in d.items() if k != md.HEADER_CHECKSUM_KEY}
    d[md.HEADER_CHECKSUM_KEY] = md.header_checksum(d)
    (path / md.METADATA_NAME).write_text(json.dumps(d))


def without_layout(path: Path) -> None:
    """The dataset as a version-3 pack of before the stored layout wrote it."""
    d = header(path)
    (path / d.pop("layout")["file"]).unlink()
    write_header(path, inline_chunks(path, d))


def forge_layout(path: Path, edit_columns=None, edit_fields=None) -> None:
    """The layout table and entry rewritten with an edit, every hash recomputed (issue 18's attacker)."""
    d = header(path)
    entry = d["layout"]
    table = md.load_metadata(path).tables.layout
    assert table is not None
    columns = {name: np.array(table.raw(name)) for name in LAYOUT_SCHEMA.names}
    if edit_columns is not None:
        edit_columns(columns, entry)
    fields = {k: entry[k] for k in ("partitions", "starts", "sizes", "digest", "decoded")}
    if edit_fields is not None:
        edit_fields(fields)
    d["layout"] = {**metadata_writer._write_table(path, "layout", LAYOUT_SCHEMA, columns)[0], **fields}
    write_header(path, rechunk(path, d))


def test_pack_stores_the_default_layout_and_the_order_through_it_is_the_computed_one(
    packed: Path, tmp_path: Path
) -> None:
    d = header(packed)
    assert d["layout"]["partitions"] >= 2 and d["layout"]["rows"] == d["shards"]["rows"]
    stored = TieredDataset(packed, BatchSpec(batch_size=16))
    old = copy(packed, tmp_path)
    without_layout(old)
    computed = TieredDataset(old, BatchSpec(batch_size=16))
    assert_same_order(stored, computed)
    for one, other in zip(iter(stored), iter(computed)):
        assert one.meta.sample_ids.tolist() == other.meta.sample_ids.tolist()
        if one.meta.index >= 40:
            break


def test_a_stored_layout_is_the_computed_one_over_many_uneven_shards(tmp_path: Path) -> None:
    """5,000 shards of uneven counts through the writer (the rounds of order/layout.py with ties):
    every partition, size and digest read back equals PartitionLayout's, and the order's config."""
    rng = np.random.default_rng(7)
    n = 5000
    samples = rng.integers(0, 400, size=n).astype(np.int64)
    samples[rng.integers(0, n, size=500)] = 100  # ties
    columns = {
        "samples": samples,
        "decoded_bytes": samples * 37 + rng.integers(0, 9, size=n),
        "largest_rows": np.minimum(samples, 64),
    }
    stored_columns, fields = layout_columns(columns)  # type: ignore[misc]
    computed = PartitionLayout(samples, default_partitions(int((samples > 0).sum())))
    assert fields["partitions"] == 64 and fields["digest"] == computed.digest()
    assert stored_columns["partition"].tolist() == computed.shard_partition.tolist()
    for p in range(64):
        rows = stored_columns["by_partition"][fields["starts"][p] : fields["starts"][p + 1]]
        assert rows.tolist() == computed.partition_shards[p].tolist()
    assert fields["sizes"] == computed.partition_sizes.tolist()


def written_before_layouts(packed: Path, tmp_path: Path) -> Path:
    """A copy of `packed` as a version-3 dataset written before layouts, with no manifest.json."""
    old = copy(packed, tmp_path)
    (old / MANIFEST_NAME).unlink(missing_ok=True)
    d = header(old)
    d["manifest"] = None
    write_header(old, d)
    without_layout(old)
    return old


def test_upgrade_stores_the_layout_of_a_dataset_written_before_it(packed: Path, tmp_path: Path) -> None:
    from tierflow.commands.cli import main as cli

    old = written_before_layouts(packed, tmp_path)
    before = TieredDataset(old, BatchSpec(batch_size=16)).order.config_hash
    assert cli(["upgrade", str(old)]) == 0
    assert header(old)["layout"] == header(packed)["layout"]
    after = TieredDataset(old, BatchSpec(batch_size=16))
    assert after.order.layout._stored is not None and after.order.config_hash == before
    assert metadata_verify.verify_metadata(md.load_metadata(old)) == []
    v2 = copy(packed, tmp_path, "v2")  # a version-2 dataset: upgrade writes the layout with the tables
    for p in v2.glob("metadata*"):
        p.unlink()
    assert cli(["upgrade", str(v2)]) == 0
    assert header(v2)["layout"] == header(packed)["layout"]


def test_upgrade_stores_the_layout_of_an_s3_dataset_with_no_manifest(
    packed: Path, tmp_path: Path, s3_server, s3_bucket, monkeypatch
) -> None:
    """A dataset at a URL whose version-3 metadata predates layouts and the chunk table, with no
    manifest.json (pack writes none above 10,000 shards): upgrade uploads the layout table and the
    chunk table (here of 4 shards a chunk), then the header; the order is the same."""
    from tierflow.commands.cli import main as cli
    from tierflow.storage.remote import upload_dataset

    monkeypatch.setenv("TIERFLOW_METADATA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(metadata_writer, "CHUNK_ROWS", 4)
    old = written_before_layouts(packed, tmp_path)
    url, endpoint = f"s3://{s3_bucket}/old", s3_server.endpoint_url
    upload_dataset(old, url, endpoint_url=endpoint)
    before = TieredDataset(url, BatchSpec(batch_size=16), endpoint_url=endpoint)
    assert before.order.layout._stored is None
    assert cli(["upgrade", url, "--endpoint-url", endpoint]) == 0
    after = TieredDataset(url, BatchSpec(batch_size=16), endpoint_url=endpoint)
    assert after.manifest.header["layout"] == header(packed)["layout"]
    assert after.manifest.header["chunks"]["rows_per_chunk"] == 4 and after.manifest.tables.chunks is not None
    assert after.order.layout._stored is not None and after.order.config_hash == before.order.config_hash
    assert [b.meta.sample_ids.tolist() for _, b in zip(range(4), after)] == [
        b.meta.sample_ids.tolist() for _, b in zip(range(4), before)
    ]
    assert cli(["verify", url, "--endpoint-url", endpoint]) == 0
    assert cli(["upgrade", url, "--endpoint-url", endpoint]) == 0  # up to date: nothing written
    assert TieredDataset(url, BatchSpec(batch_size=16), endpoint_url=endpoint).manifest.header == after.manifest.header
    from tierflow.storage.remote import open_store

    store = open_store(url, endpoint_url=endpoint)
    chunk_table = after.manifest.header["chunks"]["file"]
    store.delete(chunk_table)  # an older tierflow's gc does not know it
    monkeypatch.setenv("TIERFLOW_METADATA_CACHE", str(tmp_path / "cache2"))
    without = TieredDataset(url, BatchSpec(batch_size=16), endpoint_url=endpoint)
    assert without.manifest.tables.chunks is None
    assert [b.meta.sample_ids.tolist() for _, b in zip(range(4), without)] == [
        b.meta.sample_ids.tolist() for _, b in zip(range(4), before)
    ]
    assert cli(["upgrade", url, "--endpoint-url", endpoint]) == 0  # uploads it again
    assert store.size(chunk_table) > 0
    monkeypatch.setenv("TIERFLOW_METADATA_CACHE", str(tmp_path / "cache3"))
    assert TieredDataset(url, BatchSpec(batch_size=16), endpoint_url=endpoint).manifest.tables.chunks is not None


def _rotate(columns: dict, entry: dict) -> None:
    columns["partition"] = ((columns["partition"].astype(np.int64) + 1) % entry["partitions"]).astype(np.uint16)


def _too_far(columns: dict, entry: dict) -> None:
    columns["partition"][0] = entry["partitions"]


def _shuffle_sizes(fields: dict) -> None:
    sizes = fields["sizes"]
    for i in range(0, len(sizes) - 1, 2):
        sizes[i], sizes[i + 1] = sizes[i] + 1, sizes[i + 1] - 1


def _swap_counts(columns: dict, entry: dict) -> None:
    """Two counts of one partition swapped: its size still adds up; each shard's count is another's."""
    counts = columns["member_samples"]
    for a, z in zip(entry["starts"], entry["starts"][1:]):
        differ = np.flatnonzero(counts[a:z] != counts[a])
        if differ.size:
            i = a + int(differ[0])
            counts[a], counts[i] = counts[i], counts[a]
            return
    raise AssertionError("no partition holds two shards of different counts")


def _unsorted(columns: dict, entry: dict) -> None:
    rows = columns["by_partition"]
    for p in range(entry["partitions"]):
        a, z = entry["starts"][p], entry["starts"][p + 1]
        rows[a:z] = rows[a:z][::-1].copy()
        if z - a < 2:  # a single shard: point it outside the dataset
            rows[a] = len(rows)


@pytest.mark.parametrize(
    "edit_columns, edit_fields, match",
    [
        (_rotate, None, "lists another partition's shard"),
        (_too_far, None, "partition is not below"),
        (None, _shuffle_sizes, "does not hold its size's samples"),
        (_unsorted, None, "does not list shards ascending"),
        (None, lambda f: f.update(sizes=[s + 1 for s in f["sizes"]]), "adding up to the dataset's"),
        (None, lambda f: f.update(starts=f["starts"][::-1]), "do not rise from 0"),
        (None, lambda f: f.update(partitions=65), "not a partition count"),
    ],
)
def test_a_forged_layout_is_refused_naming_the_dataset(
    packed: Path, tmp_path: Path, edit_columns, edit_fields, match: str
) -> None:
    out = copy(packed, tmp_path)
    forge_layout(out, edit_columns, edit_fields)
    with pytest.raises(ManifestError, match=match) as raised:
        for _batch in zip(range(40), TieredDataset(out, BatchSpec(batch_size=16))):
            pass
    assert str(out) in str(raised.value)


def test_a_layout_written_before_member_samples_reads_the_same_and_upgrade_rewrites_it(
    packed: Path, tmp_path: Path
) -> None:
    """A layout table of two columns and no `nonempty` (as tierflow wrote it before a partition's
    counts were stored beside its shards) gives the same order, its counts gathered from the shard
    table; `verify` passes it; `upgrade` writes the current table and header, then nothing more."""
    from tierflow.commands.cli import main as cli

    out = copy(packed, tmp_path)
    d = header(out)
    entry = d["layout"]
    table = md.load_metadata(out).tables.layout
    assert table is not None
    columns = {name: np.array(table.raw(name)) for name in LAYOUT_SCHEMA_BEFORE_MEMBERS.names}
    fields = {k: entry[k] for k in ("partitions", "starts", "sizes", "digest", "decoded")}
    d["layout"] = {**metadata_writer._write_table(out, "layout", LAYOUT_SCHEMA_BEFORE_MEMBERS, columns)[0], **fields}
    write_header(out, inline_chunks(out, d))
    current = TieredDataset(packed, BatchSpec(batch_size=16))
    older = TieredDataset(out, BatchSpec(batch_size=16))
    assert older.order.layout._stored is not None and older.order.config_hash == current.order.config_hash
    assert older.future_shard_uses(horizon_batches=100) == current.future_shard_uses(horizon_batches=100)
    first = [b.meta.sample_ids.tolist() for _, b in zip(range(6), older)]
    assert first == [b.meta.sample_ids.tolist() for _, b in zip(range(6), current)]
    assert metadata_verify.verify_metadata(md.load_metadata(out)) == []
    assert cli(["upgrade", str(out)]) == 0
    assert header(out)["layout"] == header(packed)["layout"]
    upgraded = header(out)
    assert cli(["upgrade", str(out)]) == 0 and header(out) == upgraded


def test_a_count_that_is_not_its_shards_is_refused_when_its_window_is_read(packed: Path, tmp_path: Path) -> None:
    """Two counts of one partition swapped, every hash recomputed: the partition still adds up, so the
    start opens; the epoch stops at the window holding them, before a sample of it is served."""
    out = copy(packed, tmp_path)
    forge_layout(out, _swap_counts)
    dataset = TieredDataset(out, BatchSpec(batch_size=16))
    with pytest.raises(ManifestError, match="gives a shard samples that are not its own") as raised:
        for _batch in dataset:
            pass
    assert str(out) in str(raised.value)
    assert metadata_verify.verify_metadata(md.load_metadata(out))


def test_verify_reports_a_consistent_layout_that_is_not_the_default_orders(packed: Path, tmp_path: Path) -> None:
    out = copy(packed, tmp_path)
    forge_layout(out, edit_fields=lambda f: f.update(digest="0" * 64))
    TieredDataset(out, BatchSpec(batch_size=16))  # opens: the digest only names the order in cursors
    problems = metadata_verify.verify_metadata(md.load_metadata(out))
    assert len(problems) == 1 and "layout.digest is not the default order's" in problems[0]


def test_an_order_of_other_counts_or_partitions_computes_its_own(packed: Path) -> None:
    manifest = md.load_metadata(packed)
    stored = manifest.tables.stored_layout()
    assert stored is not None
    samples = stored.counts  # the column it was made for, read as shards are asked for
    assert isinstance(samples, ShardRows)
    other = SampleOrder(samples[:].copy(), dataset_id="x", partitions=stored.partitions, stored_layout=stored)
    fewer = SampleOrder(samples, dataset_id="x", partitions=stored.partitions // 2, stored_layout=stored)
    same = SampleOrder(samples, dataset_id="x", partitions=stored.partitions, stored_layout=stored)
    assert other.layout._stored is None and fewer.layout._stored is None and same.layout._stored is stored
    assert other.config_hash == same.config_hash and fewer.layout.partitions == stored.partitions // 2


def test_a_dataset_read_through_its_stored_layout_pickles_for_a_worker(packed: Path) -> None:
    """A spawn/forkserver worker gets the dataset pickled: the stored layout travels as its manifest
    (the directory, mapped again there), and the order there is the same."""
    import pickle

    dataset = TieredDataset(packed, BatchSpec(batch_size=16))
    again = pickle.loads(pickle.dumps(dataset))
    stored = again.order.layout._stored
    assert stored is not None and stored.manifest is again.manifest
    assert again.order.config_hash == dataset.order.config_hash
    assert again.future_shard_uses(horizon_batches=100) == dataset.future_shard_uses(horizon_batches=100)


@pytest.mark.parametrize("spec", [BatchSpec(batch_size=16), BatchSpec(batch_size=4, seq_len=64)])
def test_a_pickled_dataset_carries_no_per_shard_array_of_a_stored_layout(packed: Path, spec: BatchSpec) -> None:
    """Over a stored layout (rows) a worker maps the order's per-shard arrays (samples per shard,
    decoded bytes) from the metadata again: they are not in the pickle (16 MB a worker at a million
    shards, a private copy of pages a node's processes share). A layout computed in the parent (token
    windows: ~0.2 s at a million shards) travels instead. Either way the order there is the same."""
    import pickle

    dataset = TieredDataset(packed, spec)
    sent = pickle.dumps(dataset, protocol=5)
    stored = dataset.order.layout._stored is not None
    assert stored == (spec.seq_len is None)
    counts = dataset._order_args["shard_sample_counts"]
    assert isinstance(counts, ShardRows) == stored  # over a stored layout: the mapped column, not an array
    assert (np.asarray(counts[:]).tobytes() in sent) != stored
    assert dataset.manifest.tables.column("decoded_bytes").tobytes() not in sent  # read as shards are asked for
    again = pickle.loads(sent)
    decoded = again._order_args["decoded_bytes"]
    assert isinstance(decoded, ShardRows) and decoded.manifest is again.manifest  # the worker's own mapping
    assert again.order.config_hash == dataset.order.config_hash
    assert again.future_shard_uses(horizon_batches=100) == dataset.future_shard_uses(horizon_batches=100)
    first = [b.meta.sample_ids.tolist() for _, b in zip(range(3), again)]
    assert first == [b.meta.sample_ids.tolist() for _, b in zip(range(3), dataset)]


def test_the_largest_blocks_of_a_mapped_dataset_are_made_for_the_shards_asked_for(packed: Path) -> None:
    """The group order's per-shard floor (`block_bytes`) of a mapped dataset is not a column made whole
    in every process: values for the shards asked for, the same as the whole column's, pickled as the
    manifest; the order's config and its bound the same as from the whole column."""
    import pickle

    from tierflow.format.metadata_layout import LargestBlocks, largest_blocks

    dataset = TieredDataset(packed, BatchSpec(batch_size=16))
    values = dataset.order.block_bytes
    assert isinstance(values, LargestBlocks) and dataset.order.group_bytes > 0
    col = dataset.manifest.shard_column
    whole = largest_blocks(col("decoded_bytes"), col("largest_rows"), col("samples"))
    shards = np.array([3, 0, len(whole) - 1])
    assert values[shards].tolist() == whole[shards].tolist() and len(values) == len(whole)
    assert int(values.mean(chunk=3)) == int(whole.mean())
    again = pickle.loads(pickle.dumps(values))
    assert again.manifest is not None and again[shards].tolist() == whole[shards].tolist()
    plain = SampleOrder(
        col("samples"),
        dataset_id=dataset.order.dataset_id,
        partitions=dataset.order.partitions,
        window_shards=dataset.order.window_shards,
        lanes=dataset.order.lanes,
        group_bytes=dataset.order.group_bytes,
        group_samples=dataset.order.group_samples,
        decoded_bytes=col("decoded_bytes"),
        block_bytes=whole,
        first_epoch=dataset.order.first_epoch,
    )
    assert plain.config_hash == dataset.order.config_hash
    for p in range(plain.partitions):
        a, b = plain.windows(p, 0), dataset.order.windows(p, 0)
        assert a.range_ids(0, a.size).tolist() == b.range_ids(0, b.size).tolist()
