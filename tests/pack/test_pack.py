"""`tierflow pack` and the reading API: every source kind round-trips, output is deterministic."""

from __future__ import annotations

import gzip
import io
import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from PIL import Image

import tierflow
from tierflow.format.manifest import ManifestError
from tierflow.pack.tokenize import PackInputError


def write_jsonl(path: Path, rows: list[dict], opener=open) -> Path:
    with opener(path, "wt") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def docs(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"text": "word " * int(rng.integers(0, 200)) + f"#{i}", "id": i, "score": float(i) / 7} for i in range(n)]


def test_jsonl_plain_gz_zst_round_trip_sample_by_sample(tmp_path):
    rows = docs(3000)
    plain = write_jsonl(tmp_path / "a.jsonl", rows[:1000])
    gz = write_jsonl(tmp_path / "b.jsonl.gz", rows[1000:2000], gzip.open)
    with open(tmp_path / "c.jsonl.zst", "wb") as raw:
        with zstandard.ZstdCompressor().stream_writer(raw) as w:
            w.write("".join(json.dumps(r) + "\n" for r in rows[2000:]).encode())
    tierflow.pack(
        [plain, gz, tmp_path / "c.jsonl.zst"],
        tmp_path / "out",
        workers=2,
        target_shard_bytes=256 << 10,
        chunk_bytes=64 << 10,
    )
    ds = tierflow.open_dataset(tmp_path / "out")
    assert len(ds) == len(rows)
    for i in range(len(rows)):
        assert ds[i] == rows[i]
    assert [s for s in ds] == rows


def test_parquet_columns_kept(tmp_path):
    table = pa.table(
        {
            "text": [f"t{i}" for i in range(500)],
            "x": np.arange(500, dtype=np.int32),
            "emb": [np.full(4, i, dtype=np.float32) for i in range(500)],
        }
    )
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=100)
    tierflow.pack([tmp_path / "a.parquet"], tmp_path / "out", workers=1, target_shard_bytes=256 << 10)
    ds = tierflow.open_dataset(tmp_path / "out")
    assert len(ds) == 500
    assert ds[123]["text"] == "t123" and ds[123]["x"] == 123
    np.testing.assert_array_equal(ds[123]["emb"], np.full(4, 123, dtype=np.float32))


def test_directory_of_small_files_keeps_paths_empty_files_and_non_utf8_bytes(tmp_path):
    src = tmp_path / "tree"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("alpha")
    (src / "empty.txt").write_bytes(b"")
    (src / "sub" / "bin.dat").write_bytes(b"\xff\xfe not utf8")
    (src / "sub" / "z.txt").write_text("zulu")
    summary = tierflow.pack([src], tmp_path / "out", workers=1, target_shard_bytes=256 << 10)
    ds = tierflow.open_dataset(tmp_path / "out")
    got = {s["path"]: (s["text"], s["text_bytes"]) for s in ds}
    assert got == {
        "a.txt": ("alpha", None),
        "empty.txt": ("", None),
        "sub/bin.dat": (None, b"\xff\xfe not utf8"),
        "sub/z.txt": ("zulu", None),
    }
    assert summary.manifest.stats["kept_as_bytes"] == 1
    assert summary.manifest.stats["files"] == 4


def test_image_folder_with_txt_and_json_sidecars(tmp_path):
    src = tmp_path / "imgs"
    src.mkdir()
    images = {}
    for i in range(6):
        pixels = np.random.default_rng(i).integers(0, 256, (10, 10, 3), dtype=np.uint8)
        out = io.BytesIO()
        Image.fromarray(pixels).save(out, format="PNG")
        data = out.getvalue()
        images[f"{i}.png"] = data
        (src / f"{i}.png").write_bytes(data)
        if i % 2:
            (src / f"{i}.txt").write_text(f"caption {i}\n")
        else:
            (src / f"{i}.json").write_text(json.dumps({"caption": f"json {i}", "w": i}))
    tierflow.pack([src], tmp_path / "out", workers=2, target_shard_bytes=256 << 10)
    ds = tierflow.open_dataset(tmp_path / "out")
    assert len(ds) == 6
    for s in ds:
        i = int(s["path"].split(".")[0])
        assert s["image"] == images[s["path"]]
        assert s["caption"] == (f"caption {i}" if i % 2 else f"json {i}")
        assert s["w"] == (None if i % 2 else i)


def square(record: dict) -> dict | None:
    if record["x"] % 5 == 0:
        return None
    return {"x": record["x"], "sq": np.full(3, record["x"] ** 2, dtype=np.int64)}


def test_python_api_with_fn_over_an_iterable_runs_in_workers(tmp_path):
    summary = tierflow.pack(
        ({"x": i} for i in range(3000)), tmp_path / "out", fn=square, workers=2, target_shard_bytes=256 << 10
    )
    ds = tierflow.open_dataset(tmp_path / "out")
    expected = [x for x in range(3000) if x % 5]
    assert len(ds) == len(expected) and summary.manifest.stats["filtered"] == 600
    assert ds[10]["x"] == expected[10]
    np.testing.assert_array_equal(ds[10]["sq"], np.full(3, expected[10] ** 2))


def test_output_is_byte_identical_with_one_and_two_workers(tmp_path):
    rows = docs(4000, seed=1)
    src = write_jsonl(tmp_path / "a.jsonl", rows)
    for workers in (1, 2):
        tierflow.pack(
            [src],
            tmp_path / f"out{workers}",
            workers=workers,
            target_shard_bytes=256 << 10,
            chunk_bytes=100 << 10,
            tokenizer="bytes",
        )
    names1 = sorted(p.name for p in (tmp_path / "out1").iterdir())
    names2 = sorted(p.name for p in (tmp_path / "out2").iterdir())
    assert names1 == names2 and len(names1) > 3
    for name in names1:
        if not name.startswith("."):
            assert (tmp_path / "out1" / name).read_bytes() == (tmp_path / "out2" / name).read_bytes(), name


def test_shards_are_within_ten_percent_of_target_except_the_last(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", docs(8000, seed=2))
    target = 256 << 10
    m = tierflow.pack([src], tmp_path / "out", workers=2, target_shard_bytes=target, chunk_bytes=200 << 10).manifest
    sizes = [s.decoded_bytes for s in m.shards]
    assert len(sizes) > 5
    assert all(abs(s - target) <= 0.1 * target for s in sizes[:-1]), sizes


def test_byte_tokenizer_puts_one_eos_after_each_document_and_tokens_straddle_shards(tmp_path):
    rows = docs(2000, seed=3)
    src = write_jsonl(tmp_path / "a.jsonl", rows)
    m = tierflow.pack([src], tmp_path / "out", workers=2, tokenizer="bytes", target_shard_bytes=256 << 10).manifest
    ds = tierflow.open_dataset(tmp_path / "out")
    assert m.token_dtype == "uint16" and m.eos_id == 256 and m.tokenizer["name"] == "bytes"
    stream = np.concatenate([np.append(np.frombuffer(r["text"].encode(), np.uint8), 256) for r in rows])
    assert ds.num_tokens == len(stream) == m.stats["tokens"]
    boundary = int(ds.token_starts[1])
    np.testing.assert_array_equal(ds.tokens(boundary - 50, boundary + 50), stream[boundary - 50 : boundary + 50])
    np.testing.assert_array_equal(ds.tokens(0, len(stream)), stream)
    assert "text" not in ds.columns
    view = ds[0]["tokens"]
    assert view.base is not None  # a view into the shard, not a copy


def test_hf_tokenizer_trained_in_process(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    rows = docs(300, seed=4)
    tok.train_from_iterator(
        [r["text"] for r in rows], trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]", "</s>"])
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    src = write_jsonl(tmp_path / "a.jsonl", rows)
    m = tierflow.pack(
        [src], tmp_path / "out", workers=2, tokenizer=str(tmp_path / "tokenizer.json"), target_shard_bytes=256 << 10
    ).manifest
    ds = tierflow.open_dataset(tmp_path / "out")
    eos = tok.token_to_id("</s>")
    assert m.eos_id == eos and m.token_dtype == "uint16" and m.tokenizer["name"] == "hf:tokenizer.json"
    for i in (0, 17, 299):
        expected = tok.encode(rows[i]["text"], add_special_tokens=False).ids + [eos]
        np.testing.assert_array_equal(ds[i]["tokens"], expected)


def test_malformed_json_line_is_named_or_skipped_and_counted(tmp_path):
    src = tmp_path / "bad.jsonl"
    lines = [json.dumps({"text": f"ok {i}"}) for i in range(50)]
    lines[36] = '{"text": "broken'
    src.write_text("\n".join(lines) + "\n")
    with pytest.raises(PackInputError, match=r"bad\.jsonl:37"):
        tierflow.pack([src], tmp_path / "out", workers=1, target_shard_bytes=256 << 10)
    m = tierflow.pack([src], tmp_path / "out2", workers=1, target_shard_bytes=256 << 10, on_error="skip").manifest
    assert m.num_samples == 49 and m.stats["skipped_records"] == 1
    assert "bad.jsonl:37" in m.stats["errors"][0]


def test_malformed_line_in_a_later_chunk_reports_its_true_line_number(tmp_path):
    src = tmp_path / "big.jsonl"
    lines = [json.dumps({"text": "x" * 50}) for _ in range(5000)]
    lines[4321] = "not json"
    src.write_text("\n".join(lines) + "\n")
    with pytest.raises(PackInputError, match=r"big\.jsonl:4322"):
        tierflow.pack([src], tmp_path / "out", workers=2, target_shard_bytes=256 << 10, chunk_bytes=32 << 10)


def test_empty_and_missing_inputs_are_clear_errors(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(PackInputError, match="no samples"):
        tierflow.pack([tmp_path / "empty.jsonl"], tmp_path / "out", workers=1, target_shard_bytes=256 << 10)
    with pytest.raises(PackInputError, match="nope.jsonl"):
        tierflow.pack([tmp_path / "nope.jsonl"], tmp_path / "out", workers=1, target_shard_bytes=256 << 10)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_finished_dataset_is_refused_without_overwrite_and_gc_removes_strays(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", docs(500))
    tierflow.pack([src], tmp_path / "out", workers=1, target_shard_bytes=256 << 10)
    with pytest.raises(PackInputError, match="--overwrite"):
        tierflow.pack([src], tmp_path / "out", workers=1, target_shard_bytes=256 << 10)
    src2 = write_jsonl(tmp_path / "b.jsonl", docs(400, seed=9))
    tierflow.pack([src2], tmp_path / "out", workers=1, target_shard_bytes=256 << 10, overwrite=True)
    ds = tierflow.open_dataset(tmp_path / "out")
    assert len(ds) == 400
    listed = {s.name for s in ds.manifest.shards}
    on_disk = {p.name for p in (tmp_path / "out").glob("shard-*.arrow")}
    assert on_disk == listed  # the old dataset's shards went away with the new manifest
    stray = tmp_path / "out" / ("shard-" + "0" * 32 + ".arrow")
    stray.write_bytes(b"junk")
    from tierflow.commands.cli import main

    assert main(["gc", str(tmp_path / "out")]) == 0
    assert not stray.exists() and len(tierflow.open_dataset(tmp_path / "out")) == 400


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda m: m["shards"][0].update(name="/etc/passwd"), "not a shard file"),
        (lambda m: m["shards"][0].update(name="../shard-" + "0" * 32 + ".arrow"), "not a shard file"),
        (lambda m: m["shards"][0].update(name="s3://bucket/x.arrow"), "not a shard file"),
        (lambda m: m["shards"][0].update(samples=-5), "negative or absurd|block rows"),
        (lambda m: m["shards"][0].update(bytes=1 << 60), "negative or absurd"),
        (lambda m: m.update(format_version=99), "unknown format_version 99"),
    ],
)
def test_unsafe_or_unknown_manifests_are_rejected_on_open(tmp_path, mutate, message):
    src = write_jsonl(tmp_path / "a.jsonl", docs(200))
    tierflow.pack([src], tmp_path / "out", workers=1, target_shard_bytes=256 << 10)
    path = tmp_path / "out" / "manifest.json"
    m = json.loads(path.read_text())
    mutate(m)
    m.pop("manifest_checksum")  # a hostile manifest's author drops it: each field check must still hold
    path.write_text(json.dumps(m))
    with pytest.raises(ManifestError, match=message):
        tierflow.open_dataset(tmp_path / "out")


def test_dataset_id_depends_on_data_not_manifest_bytes(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", docs(300))
    a = tierflow.pack([src], tmp_path / "a", workers=1, target_shard_bytes=256 << 10).manifest
    b = tierflow.pack([src], tmp_path / "b", workers=2, target_shard_bytes=256 << 10).manifest
    c = tierflow.pack([src], tmp_path / "c", workers=1, target_shard_bytes=256 << 10, tokenizer="bytes").manifest
    assert a.dataset_id == b.dataset_id != c.dataset_id
    assert os.path.exists(tmp_path / "a" / a.shards[0].name)


def test_a_full_disk_is_a_clear_error_and_leaves_no_dataset(tmp_path):
    import subprocess

    mount = tmp_path / "small"
    mount.mkdir()
    if (
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(mount)], capture_output=True).returncode
        != 0
    ):
        if os.environ.get("CI") == "true":
            pytest.fail("cannot mount a tmpfs for the full-disk test, and CI must not skip it")
        pytest.skip("mounting a tmpfs is refused here (needs root)")
    try:
        src = write_jsonl(tmp_path / "a.jsonl", docs(6000, seed=7))  # several MB: cannot fit
        with pytest.raises(PackInputError, match=rf"{mount / 'out'}: no space left"):
            tierflow.pack([src], mount / "out", workers=2, target_shard_bytes=256 << 10, compression="none")
        assert not (mount / "out" / "manifest.json").exists()
        assert not [p for p in (mount / "out").iterdir() if p.name != ".tierflow.lock"]
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
