"""The dataset verbs (inspect, verify, gc) and the dataset constructors on every URL build_stack
takes, and gc's refusals: against the loopback S3 server and real directories."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import tierflow
from tierflow.commands.cli import main


def pack_rows(tmp_path: Path, n: int = 3000) -> Path:
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps({"text": f"doc {i} " + "lorem " * (i % 40), "i": i}) + "\n" for i in range(n)))
    out = tmp_path / "ds"
    tierflow.pack([src], out, workers=1, target_shard_bytes=256 << 10, block_bytes=64 << 10)
    return out


# gc refuses what is not a dataset


def test_gc_on_a_folder_that_is_not_a_dataset_refuses_and_writes_nothing(tmp_path, capsys):
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "holiday.jpg").write_bytes(b"\xff\xd8")
    assert main(["gc", str(folder)]) != 0
    err = capsys.readouterr().err
    assert str(folder) in err and "manifest.json" in err
    assert sorted(p.name for p in folder.iterdir()) == ["holiday.jpg"]


def test_gc_on_a_missing_folder_refuses_and_creates_nothing(tmp_path, capsys):
    assert main(["gc", str(tmp_path / "nope")]) != 0
    assert str(tmp_path / "nope") in capsys.readouterr().err
    assert not (tmp_path / "nope").exists()


# every verb and constructor on s3://


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> Path:
    """`pack_rows`, once for the module: the S3 tests only read it (they change their own S3 copy)."""
    return pack_rows(tmp_path_factory.mktemp("rows"))


@pytest.fixture
def s3_ds(rows, s3_server, s3_bucket, s3_proxy):
    from tierflow.storage.remote import upload_dataset

    local = rows
    url = f"s3://{s3_bucket}/data/ds"
    upload_dataset(local, url, endpoint_url=s3_server.endpoint_url)
    s3_proxy.reset_counters()
    return local, url, s3_proxy


def plain(sample: dict) -> dict:
    return {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in sample.items()}


def test_open_dataset_reads_s3_straight_from_the_source_block_by_block(s3_ds):
    local, url, proxy = s3_ds
    ds = tierflow.open_dataset(url, endpoint_url=proxy.url)
    expected = tierflow.open_dataset(local)
    assert len(ds) == len(expected) and ds.location == url
    assert plain(ds[1234]) == plain(expected[1234])
    info = ds.manifest.shards[ds.index.locate_sample(1234)[0]]
    assert proxy.traffic().response_bytes("GET", key="shard-") < info.bytes  # one block, not the shard
    assert [plain(s) for s in ds] == [plain(s) for s in expected]


def test_a_tiered_dataset_takes_an_s3_url(s3_ds):
    from tierflow.loader import TieredDataset, BatchSpec

    local, url, proxy = s3_ds
    remote = TieredDataset(url, BatchSpec(batch_size=8), endpoint_url=proxy.url, max_batches=5)
    here = TieredDataset(str(local), BatchSpec(batch_size=8), max_batches=5)
    assert remote.location == url
    got, want = list(remote), list(here)
    assert [b.meta.sample_ids.tolist() for b in got] == [b.meta.sample_ids.tolist() for b in want]
    assert [b.data["text"] for b in got] == [b.data["text"] for b in want]


def test_inspect_reads_an_s3_dataset(s3_ds, capsys):
    local, url, proxy = s3_ds
    assert main(["inspect", url, "--endpoint-url", proxy.url, "-n", "2"]) == 0
    out = capsys.readouterr().out
    assert url in out and "3,000 samples" in out and "doc 1" in out


def test_verify_streams_every_shard_from_s3_and_names_a_corrupted_block(s3_ds, s3_server, capsys):
    local, url, proxy = s3_ds
    manifest = tierflow.open_dataset(local).manifest
    assert main(["verify", url, "--endpoint-url", proxy.url]) == 0
    assert "all checksums match" in capsys.readouterr().out
    for info in manifest.shards:  # each shard's bytes crossed the network once, to be hashed
        assert proxy.traffic().response_bytes("GET", key=info.name) == info.bytes
    info = manifest.shards[1]
    block = info.blocks[2]
    data = bytearray((local / info.name).read_bytes())
    data[block.offset + block.length // 2] ^= 0xFF
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    s3_server.endpoint.boto3_client().put_object(Bucket=bucket, Key=f"{prefix}/{info.name}", Body=bytes(data))
    assert main(["verify", url, "--endpoint-url", proxy.url]) == 1
    err = capsys.readouterr().err
    assert f"shard {info.name}: block 2" in err and "1 problem(s)" in err


def _objects(s3_server, url: str) -> dict[str, object]:
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    listed = s3_server.endpoint.boto3_client().list_objects_v2(Bucket=bucket, Prefix=prefix + "/")
    return {o["Key"][len(prefix) + 1 :]: o["LastModified"] for o in listed.get("Contents", [])}


def _next_second() -> None:
    """Sleep into the next whole second: S3 keeps modification times to the second (truncated), so
    what is written after this is dated later than what was written before."""
    import time

    time.sleep(1.05 - time.time() % 1)


def test_gc_on_s3_deletes_only_unreferenced_shards_older_than_the_manifest(s3_ds, s3_server, capsys):
    local, url, proxy = s3_ds
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    client = s3_server.endpoint.boto3_client()
    stray = "shard-" + "0" * 32 + ".arrow"
    keep = ["notes.txt", "old/shard-" + "1" * 32 + ".arrow"]  # not a shard name / not directly under the prefix
    for key in keep:
        client.put_object(Bucket=bucket, Key=f"{prefix}/{key}", Body=b"x")
    _next_second()
    client.put_object(Bucket=bucket, Key=f"{prefix}/{stray}", Body=b"junk")
    before = _objects(s3_server, url)
    # written after the manifest: maybe a pack in progress (shards first, manifest last), so kept
    assert main(["gc", url, "--endpoint-url", proxy.url]) == 0
    assert _objects(s3_server, url) == before
    _next_second()
    client.put_object(Bucket=bucket, Key=f"{prefix}/manifest.json", Body=(local / "manifest.json").read_bytes())
    capsys.readouterr()
    assert main(["gc", url, "--endpoint-url", proxy.url]) == 0
    assert "removed 1 unreferenced" in capsys.readouterr().out
    after = _objects(s3_server, url)
    assert stray not in after and set(after) == set(before) - {stray}
    assert len(tierflow.open_dataset(url, endpoint_url=proxy.url)) == 3000


def test_gc_on_an_s3_prefix_that_is_not_a_dataset_refuses_and_writes_nothing(s3_server, s3_bucket, s3_proxy, capsys):
    url = f"s3://{s3_bucket}/not-a-dataset"
    client = s3_server.endpoint.boto3_client()
    client.put_object(Bucket=s3_bucket, Key="not-a-dataset/shard-" + "0" * 32 + ".arrow", Body=b"theirs")
    assert main(["gc", url, "--endpoint-url", s3_proxy.url]) != 0
    err = capsys.readouterr().err
    assert url in err and "manifest.json" in err
    assert list(_objects(s3_server, url)) == ["shard-" + "0" * 32 + ".arrow"]
    assert s3_proxy.traffic().requests(method="PUT") == s3_proxy.traffic().requests(method="DELETE") == 0


def test_file_urls_are_directories_for_every_verb(tmp_path, capsys):
    local = pack_rows(tmp_path)
    url = f"file://{local}"
    assert len(tierflow.open_dataset(url)) == 3000
    assert main(["verify", url]) == 0 and main(["inspect", url, "-n", "1"]) == 0 and main(["gc", url]) == 0
    assert "all checksums match" in capsys.readouterr().out
