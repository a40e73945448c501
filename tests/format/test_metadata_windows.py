"""Token-window layouts stored with version-3 metadata (format/metadata_windows.py, issue 38).

`pack --seq-len L` and `upgrade --seq-len L` store the layout of the order over windows of L tokens,
so a language model's loader starts without a pass over every shard; the order read through it is
the very order computed without it (same batches, same cursor config); a forged or damaged window
table (every hash recomputed) is refused naming the dataset, and one that is consistent but not the
order's is reported by `verify`; gc keeps it and a node downloads it with the other tables."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest

import tierflow
from tierflow.commands.cli import main as cli
from tierflow.errors import ManifestError
from tierflow.format import metadata as md
from tierflow.format import metadata_verify, metadata_writer
from tierflow.format.metadata_windows import DEFAULT_LENGTHS, WINDOWS_SCHEMA, WindowCounts, table_kind
from tierflow.loader import BatchSpec, Loader, TieredDataset
from tierflow.testing.faults import write_corpus

from hostile import assert_same_order, copy_dataset as copy, read_header as header, write_header

LENGTHS = (64, 128)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("windows") / "a.jsonl", docs=3000, seed=5)


def _pack(corpus: Path, out: Path, **options) -> Path:
    tierflow.pack(
        [corpus], out, workers=1, tokenizer="bytes", target_shard_bytes=256 << 10, block_bytes=32 << 10, **options
    )
    return out


@pytest.fixture(scope="module")
def packed(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _pack(corpus, tmp_path_factory.mktemp("stored") / "out", seq_len=list(LENGTHS))


@pytest.fixture(scope="module")
def plain(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _pack(corpus, tmp_path_factory.mktemp("plain") / "out", seq_len=())


def forge_windows(path: Path, seq_len: int, edit_columns=None, edit_fields=None) -> None:
    """The window table and entry rewritten with an edit, every hash recomputed (issue 18's attacker)."""
    d = header(path)
    entry = d["windows"][str(seq_len)]
    stored = md.load_metadata(path).tables.stored_layout(seq_len)
    assert stored is not None
    columns = {name: np.array(stored.table.raw(name)) for name in WINDOWS_SCHEMA.names}
    if edit_columns is not None:
        edit_columns(columns)
    fields = {k: v for k, v in entry.items() if k not in ("file", "rows", "size", "columns", "chunks")}
    if edit_fields is not None:
        edit_fields(fields)
    written, raw = metadata_writer._write_table(path, table_kind(seq_len), WINDOWS_SCHEMA, columns)
    d["windows"][str(seq_len)] = {**written, "chunks": metadata_writer.window_chunks(columns, raw), **fields}
    write_header(path, d)


def without_manifest(path: Path, tmp_path: Path) -> Path:
    """A copy of `path` as pack leaves a dataset above 10,000 shards: its header and no manifest.json."""
    out = copy(path, tmp_path, "v3")
    (out / "manifest.json").unlink()
    d = header(out)
    d.pop("manifest")
    write_header(out, d)
    return out


def first_batches(dataset: TieredDataset, count: int = 30) -> list[tuple[list[int], bytes]]:
    return [
        (b.meta.sample_ids.tolist(), np.asarray(b.data["input_ids"]).tobytes()) for _, b in zip(range(count), dataset)
    ]


@pytest.mark.parametrize("seq_len", LENGTHS)
def test_the_order_through_a_stored_window_layout_is_the_computed_one(packed: Path, plain: Path, seq_len: int) -> None:
    d = header(packed)
    assert sorted(d["windows"]) == sorted(str(n) for n in LENGTHS) and "windows" not in header(plain)
    assert d["dataset_id"] == header(plain)["dataset_id"]
    stored = TieredDataset(packed, BatchSpec(batch_size=4, seq_len=seq_len))
    computed = TieredDataset(plain, BatchSpec(batch_size=4, seq_len=seq_len))
    assert isinstance(stored._order_args["shard_sample_counts"], WindowCounts)
    assert_same_order(stored, computed)
    assert first_batches(stored) == first_batches(computed)
    spec = BatchSpec(batch_size=4, seq_len=seq_len)
    run = Loader(TieredDataset(plain, spec))
    seen = [b["input_ids"].numpy().tobytes() for _, b in zip(range(7), run)]
    cursor = json.loads(json.dumps(run.state_dict()))[
        "cursor"
    ]  # a computed layout's cursor, resumed over the stored one
    resumed = first_batches(TieredDataset(packed, spec, resume=cursor), 3)
    assert resumed == first_batches(TieredDataset(plain, spec, resume=cursor), 3) and resumed[0][1] not in seen


def test_a_tokenized_pack_stores_the_common_lengths_unless_told(corpus: Path, plain: Path, tmp_path: Path) -> None:
    """No `seq_len`: the layouts of DEFAULT_LENGTHS, read by a loader of 2048 as a stored layout giving
    the computed order; a pack of rows (no tokenizer) stores none, and asking one of it is refused."""
    default = _pack(corpus, tmp_path / "default")
    assert sorted(header(default)["windows"]) == sorted(str(n) for n in DEFAULT_LENGTHS)
    stored = TieredDataset(default, BatchSpec(batch_size=4, seq_len=2048))
    assert isinstance(stored._order_args["shard_sample_counts"], WindowCounts)
    assert first_batches(stored, 5) == first_batches(TieredDataset(plain, BatchSpec(batch_size=4, seq_len=2048)), 5)
    rows = tierflow.pack([corpus], tmp_path / "rows", workers=1, target_shard_bytes=256 << 10)
    assert "windows" not in header(tmp_path / "rows") and rows.manifest.num_samples == 3000
    with pytest.raises(ValueError, match="needs a tokenizer"):
        tierflow.pack([corpus], tmp_path / "no", workers=1, seq_len=2048)


def test_an_unstored_length_and_the_rows_order_are_as_before(packed: Path) -> None:
    other = TieredDataset(packed, BatchSpec(batch_size=4, seq_len=96))
    rows = TieredDataset(packed, BatchSpec(batch_size=16))
    assert other.order.layout._stored is None
    assert rows.order.layout._stored is not None and rows.order.layout._stored.seq_len is None


def test_a_dataset_over_a_stored_window_layout_pickles_for_a_worker(packed: Path) -> None:
    """The counts and the layout travel as the manifest (its directory, mapped again there), not as
    per-shard arrays; the order there is the same."""
    dataset = TieredDataset(packed, BatchSpec(batch_size=4, seq_len=64))
    sent = pickle.dumps(dataset, protocol=5)
    tokens = dataset.manifest.tables.column("tokens")
    assert np.maximum(0, (tokens - 1) // 64).tobytes() not in sent
    again = pickle.loads(sent)
    assert again.order.layout._stored is not None and again.order.layout._stored.seq_len == 64
    assert again.order.config_hash == dataset.order.config_hash
    assert first_batches(again, 3) == first_batches(dataset, 3)


@pytest.mark.slow
def test_workers_read_a_stored_window_layout_as_the_main_process_does(packed: Path) -> None:
    """Two worker processes (each maps the layout again from the pickled dataset) give the main process's batches."""

    def ids(workers: int) -> list[bytes]:
        loader = tierflow.open_loader(packed, batch_size=4, seq_len=64, num_workers=workers, seed=3)
        try:
            return [b["input_ids"].numpy().tobytes() for _, b in zip(range(12), loader)]
        finally:
            loader.close()

    assert ids(2) == ids(0)


def test_inspect_names_the_stored_lengths(packed: Path, plain: Path, capsys) -> None:
    assert cli(["inspect", str(packed)]) == 0
    assert "token-window layouts stored for seq_len 64, 128" in capsys.readouterr().out
    assert cli(["inspect", str(plain)]) == 0
    assert "token-window layouts" not in capsys.readouterr().out


def test_upgrade_adds_window_layouts_and_keeps_them(packed: Path, plain: Path, tmp_path: Path) -> None:
    out = copy(plain, tmp_path)
    assert cli(["upgrade", str(out), "--seq-len", "64"]) == 0  # a manifest.json beside: rewritten from it
    assert header(out)["windows"]["64"] == header(packed)["windows"]["64"]
    assert cli(["upgrade", str(out), "--seq-len", "128"]) == 0
    assert header(out)["windows"] == header(packed)["windows"]
    assert cli(["upgrade", str(out)]) == 0 and header(out)["windows"] == header(packed)["windows"]  # kept
    assert metadata_verify.verify_metadata(md.load_metadata(out)) == []
    v3 = without_manifest(plain, tmp_path)  # no manifest.json: the header brought up to date in place
    assert cli(["upgrade", str(v3), "--seq-len", "64"]) == 0
    assert header(v3)["windows"]["64"] == header(packed)["windows"]["64"]
    before = header(v3)
    assert cli(["upgrade", str(v3), "--seq-len", "64"]) == 0 and header(v3) == before  # up to date
    assert cli(["gc", str(v3)]) == 0
    assert (v3 / before["windows"]["64"]["file"]).exists()
    dataset = TieredDataset(v3, BatchSpec(batch_size=4, seq_len=64))
    assert dataset.order.layout._stored is not None
    assert first_batches(dataset, 3) == first_batches(TieredDataset(plain, BatchSpec(batch_size=4, seq_len=64)), 3)


def version_2(path: Path, tmp_path: Path) -> Path:
    """A copy of `path` as an older tierflow left it: manifest.json and shards, no version-3 metadata."""
    out = copy(path, tmp_path, "v2")
    for table in [out / md.METADATA_NAME, *out.glob(f"{md.TABLE_PREFIX}*")]:
        table.unlink()
    return out


def test_upgrade_gives_a_version_2_token_dataset_the_lengths_pack_stores(
    plain: Path, packed: Path, tmp_path: Path, s3_server, s3_bucket, monkeypatch
) -> None:
    """Asked for none: a version-2 token dataset gets DEFAULT_LENGTHS, as pack would store them; a
    version-3 one keeps what it stores (none where its pack was told none), here and on S3."""
    from tierflow.storage.remote import upload_dataset

    monkeypatch.setenv("TIERFLOW_METADATA_CACHE", str(tmp_path / "cache"))
    endpoint = s3_server.endpoint_url
    old = version_2(plain, tmp_path)
    url, url_packed = f"s3://{s3_bucket}/v2", f"s3://{s3_bucket}/packed"
    upload_dataset(old, url, endpoint_url=endpoint)
    upload_dataset(packed, url_packed, endpoint_url=endpoint)
    assert cli(["upgrade", str(old)]) == 0 and cli(["upgrade", url, "--endpoint-url", endpoint]) == 0
    assert cli(["upgrade", url_packed, "--endpoint-url", endpoint]) == 0
    remote = tierflow.open_dataset(url, endpoint_url=endpoint).manifest.header
    assert sorted(header(old)["windows"]) == sorted(remote["windows"]) == sorted(str(n) for n in DEFAULT_LENGTHS)
    assert (
        tierflow.open_dataset(url_packed, endpoint_url=endpoint).manifest.header["windows"] == header(packed)["windows"]
    )
    assert metadata_verify.verify_metadata(md.load_metadata(old)) == []
    kept = copy(plain, tmp_path, "kept")
    assert cli(["upgrade", str(kept)]) == 0 and "windows" not in header(kept)


def test_window_layouts_need_a_token_dataset(corpus: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs a tokenizer"):
        tierflow.pack([corpus], tmp_path / "rows", workers=1, seq_len=64)
    tierflow.pack([corpus], tmp_path / "rows", workers=1, target_shard_bytes=256 << 10)
    assert cli(["upgrade", str(tmp_path / "rows"), "--seq-len", "64"]) == 2
    with pytest.raises(ValueError, match="need a token dataset"):
        metadata_writer.update_header(tmp_path / "rows", [64])


def _rotate(columns: dict) -> None:
    columns["partition"] = np.roll(columns["partition"], 1)


def _window_start(columns: dict) -> None:
    columns["window_start"][len(columns["window_start"]) // 2] += 1


def _swap_counts(columns: dict) -> None:
    counts = columns["member_samples"]
    i = int(np.flatnonzero(counts[1:] != counts[:-1])[0])
    counts[i], counts[i + 1] = counts[i + 1], counts[i]


@pytest.mark.parametrize(
    "edit_columns, edit_fields, match",
    [
        (_rotate, None, "lists another partition's shard"),
        (_window_start, None, "is not the running sum of the shards' windows of 64"),
        (_swap_counts, None, "gives a shard samples that are not its own|does not hold its size's samples"),
        (None, lambda f: f.update(sizes=[s + 1 for s in f["sizes"]]), "is not the running sum|does not hold its size"),
        (None, lambda f: f.update(seq_len=128), "seq_len is not 64"),
        (None, lambda f: f.update(partitions=65), "not a partition count"),
    ],
)
def test_a_forged_window_layout_is_refused_naming_the_dataset(
    packed: Path, tmp_path: Path, edit_columns, edit_fields, match: str
) -> None:
    out = copy(packed, tmp_path)
    forge_windows(out, 64, edit_columns, edit_fields)
    with pytest.raises(ManifestError, match=match) as raised:
        for _batch in TieredDataset(out, BatchSpec(batch_size=4, seq_len=64)):
            pass
    assert str(out) in str(raised.value)
    assert TieredDataset(packed, BatchSpec(batch_size=4, seq_len=128)).order.layout._stored is not None


def test_verify_reports_a_consistent_window_layout_that_is_not_the_orders(packed: Path, tmp_path: Path) -> None:
    out = copy(packed, tmp_path)
    forge_windows(out, 128, edit_fields=lambda f: f.update(digest="0" * 64))
    problems = metadata_verify.verify_metadata(md.load_metadata(out))
    assert len(problems) == 1 and "128.digest is not the order's" in problems[0]
    assert cli(["verify", str(out)]) != 0


def test_damaged_window_table_bytes_are_refused_when_read(packed: Path, tmp_path: Path) -> None:
    out = copy(packed, tmp_path)
    path = out / header(out)["windows"]["64"]["file"]
    data = bytearray(path.read_bytes())
    stored = md.load_metadata(packed).tables.stored_layout(64)
    assert stored is not None
    at = stored.table.raw("window_start").ctypes.data - stored.table._map.address + 8  # the second shard's
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ManifestError, match="window_start.* does not match its hash") as raised:
        for _batch in TieredDataset(out, BatchSpec(batch_size=4, seq_len=64)):
            pass
    assert str(out) in str(raised.value)
    assert metadata_verify.verify_metadata(md.load_metadata(out))


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda w: w.clear() or w.update(x=1), "not a window length"),
        (lambda w: w.update({"064": w["64"]}), "not a window length"),
        (lambda w: w["64"].update(file="../metadata-windows-64-x.arrow"), "is not a metadata table inside"),
        (lambda w: w["64"]["chunks"]["starts"].update(window_start=[5]), "window starts, rising from 0"),
        (lambda w: w["64"]["chunks"]["starts"].update(window_start=[False]), "window starts, rising from 0"),
        (lambda w: w["64"]["chunks"]["starts"].update(window_start=[0.0]), "window starts, rising from 0"),
        (lambda w: w["64"]["chunks"]["starts"].update(window_start=[0, 0]), "window starts, rising from 0"),
        (lambda w: w["64"].pop("chunks"), "window starts, rising from 0"),
        (lambda w: w.update({str(n): w["64"] for n in range(1, 9)}), "at most 8 window lengths"),
    ],
)
def test_a_hostile_windows_entry_is_refused_at_open(packed: Path, tmp_path: Path, edit, match: str) -> None:
    out = copy(packed, tmp_path)
    d = header(out)
    edit(d["windows"])
    write_header(out, d)
    with pytest.raises(ManifestError, match=match) as raised:
        md.load_metadata(out)
    assert str(out) in str(raised.value)


def test_a_window_layout_of_an_s3_dataset_is_downloaded_and_added(
    packed: Path, plain: Path, tmp_path: Path, s3_server, s3_bucket, monkeypatch
) -> None:
    from tierflow.storage.remote import upload_dataset

    monkeypatch.setenv("TIERFLOW_METADATA_CACHE", str(tmp_path / "cache"))
    url, endpoint = f"s3://{s3_bucket}/windows", s3_server.endpoint_url
    upload_dataset(plain, url, endpoint_url=endpoint)
    spec = BatchSpec(batch_size=4, seq_len=64)
    before = TieredDataset(url, spec, endpoint_url=endpoint)
    assert before.order.layout._stored is None
    assert cli(["upgrade", url, "--endpoint-url", endpoint, "--seq-len", "64"]) == 0
    after = TieredDataset(url, spec, endpoint_url=endpoint)
    assert after.order.layout._stored is not None and after.order.config_hash == before.order.config_hash
    assert after.manifest.header["windows"]["64"] == header(packed)["windows"]["64"]
    assert first_batches(after, 3) == first_batches(before, 3)
    assert cli(["verify", url, "--endpoint-url", endpoint]) == 0
    v3, url3 = without_manifest(plain, tmp_path), f"s3://{s3_bucket}/v3"  # as pack leaves one above 10,000 shards
    upload_dataset(v3, url3, endpoint_url=endpoint)
    assert cli(["upgrade", url3, "--endpoint-url", endpoint, "--seq-len", "128"]) == 0  # the header brought up to date
    more = TieredDataset(url3, BatchSpec(batch_size=4, seq_len=128), endpoint_url=endpoint)
    assert more.manifest.header["windows"] == {"128": header(packed)["windows"]["128"]}
    assert more.order.layout._stored is not None


def test_a_large_dataset_without_the_length_stored_says_how_to_store_it(
    packed: Path, plain: Path, monkeypatch, caplog
) -> None:
    from tierflow.loader import batching

    monkeypatch.setattr(batching, "HINT_SHARDS", 2)
    monkeypatch.setattr(batching, "_HINTED", set())
    with caplog.at_level("WARNING", logger="tierflow.loader"):
        TieredDataset(packed, BatchSpec(batch_size=4, seq_len=64))
        assert not caplog.records
        TieredDataset(plain, BatchSpec(batch_size=4, seq_len=64))
        TieredDataset(plain, BatchSpec(batch_size=4, seq_len=64))
    hints = [r.getMessage() for r in caplog.records]
    assert len(hints) == 1 and f"tierflow upgrade {plain} --seq-len 64" in hints[0]


@pytest.mark.parametrize("spec", [BatchSpec(batch_size=16), BatchSpec(batch_size=4, seq_len=64)])
def test_a_dropped_dataset_unmaps_its_tables_at_once(packed: Path, spec: BatchSpec) -> None:
    """No reference cycle through a stored layout: a dataset dropped frees its manifest and tables
    (their shared locks with them) then, not when the cycle collector next runs, so a pack or gc
    that follows in the same process can remove the tables it replaced."""
    import gc
    import weakref

    dataset = TieredDataset(packed, spec)
    assert dataset.order.layout._stored is not None
    for _, _batch in zip(range(2), dataset):
        pass
    manifest = weakref.ref(dataset.manifest)
    enabled = gc.isenabled()
    gc.disable()
    try:
        del dataset, _batch
        assert manifest() is None
    finally:
        if enabled:
            gc.enable()


@pytest.mark.slow
def test_a_loader_left_in_a_scripts_globals_exits_quietly(packed: Path) -> None:
    """Its tables are freed while the interpreter tears its modules down: nothing is reported ignored."""
    import subprocess
    import sys

    script = (
        "import tierflow\n"
        "from tierflow.format import metadata_table\n"  # a module the script names: torn down before the loader
        f"loader = tierflow.open_loader({str(packed)!r}, batch_size=4, seq_len=64)\n"
        "batch = next(iter(loader))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Exception ignored" not in done.stderr, done.stderr
