"""A bad record in a pack is named `FILE:LINE: what is wrong`, or under on_error="skip" counted by
reason in the manifest and left out; never packed as an empty document nor a stray column (issue 39, item 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import tierflow
from tierflow.pack.tokenize import PackInputError

SMALL = 256 << 10


def write_jsonl(path: Path, n: int, bad: dict[int, str]) -> Path:
    """n records {"text": ...}; line k (1-based) of `bad` replaced by its raw JSON."""
    lines = [bad.get(i, json.dumps({"text": f"document {i} " * 4})) for i in range(1, n + 1)]
    path.write_text("\n".join(lines) + "\n")
    return path


def pack(src, out: Path, **kw) -> tierflow.Manifest:
    kw.setdefault("workers", 1)
    return tierflow.pack(src, out, target_shard_bytes=SMALL, **kw).manifest


@pytest.mark.parametrize("tokenizer", ["bytes", None])
def test_a_number_for_text_at_line_1001_is_named_with_its_line_or_skipped_and_counted(tmp_path, tokenizer):
    src = write_jsonl(tmp_path / "b.jsonl", 2000, {1001: '{"text": 42}'})
    with pytest.raises(PackInputError, match=r"b\.jsonl:1001: .*'text'.*number \(42\).*--on-error skip"):
        pack([src], tmp_path / "out", tokenizer=tokenizer)
    m = pack([src], tmp_path / "out2", tokenizer=tokenizer, on_error="skip")
    assert m.num_samples == 1999 and m.stats["skipped_records"] == 1
    ((reason, entry),) = m.stats["skipped_records_by_reason"].items()
    assert entry == {"count": 1, "example": f"{src}:1001"}
    assert reason == ("text not a string" if tokenizer else "mixed types")
    assert m.stats["errors"][0].startswith(f"{src}:1001: ")


def test_a_missing_or_null_text_is_named_or_counted_by_reason_and_adds_no_column(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", 2000, {1001: '{"txt": "oops"}', 1500: '{"text": null}'})
    with pytest.raises(PackInputError, match=r"c\.jsonl:1001: no text field 'text' \(keys: txt\).*--text-field"):
        pack([src], tmp_path / "out", tokenizer="bytes")
    src2 = write_jsonl(tmp_path / "d.jsonl", 2000, {1500: '{"text": null}'})
    with pytest.raises(PackInputError, match=r"d\.jsonl:1500: text field 'text' is null"):
        pack([src2], tmp_path / "out", tokenizer="bytes")
    m = pack([src], tmp_path / "out2", tokenizer="bytes", on_error="skip")
    assert m.num_samples == 1998 and m.stats["skipped_records"] == 2
    assert m.stats["skipped_records_by_reason"] == {
        "no text field": {"count": 1, "example": f"{src}:1001"},
        "null text": {"count": 1, "example": f"{src}:1500"},
    }
    assert [f.name for f in m.schema] == ["tokens"]  # no stray `txt` column
    ds = tierflow.open_dataset(tmp_path / "out2")
    assert min(len(ds[i]["tokens"]) for i in range(len(ds))) > 1  # no end-of-document-only sample


def test_bad_records_in_a_later_chunk_and_gzip_report_their_true_lines(tmp_path):
    import gzip

    src = write_jsonl(tmp_path / "big.jsonl", 5000, {4322: '{"text": null}', 4400: '{"text": [1]}'})
    with pytest.raises(PackInputError, match=r"big\.jsonl:4322: text field 'text' is null"):
        pack([src], tmp_path / "out", tokenizer="bytes", workers=2, chunk_bytes=32 << 10)
    m = pack([src], tmp_path / "out2", tokenizer="bytes", workers=2, chunk_bytes=32 << 10, on_error="skip")
    assert m.num_samples == 4998
    assert {r: v["example"] for r, v in m.stats["skipped_records_by_reason"].items()} == {
        "null text": f"{src}:4322",
        "text not a string": f"{src}:4400",
    }
    gz = tmp_path / "big.jsonl.gz"
    gz.write_bytes(gzip.compress(src.read_bytes()))
    with pytest.raises(PackInputError, match=r"big\.jsonl\.gz:4322: "):
        pack([gz], tmp_path / "out3", tokenizer="bytes", chunk_bytes=32 << 10)


def test_records_and_parquet_without_text_are_counted_not_packed_empty(tmp_path):
    records = [{"text": f"r{i}"} for i in range(10)] + [{"text": None}]
    with pytest.raises(PackInputError, match=r"record 10: text field 'text' is null"):
        pack(iter(records), tmp_path / "out", tokenizer="bytes")
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": ["a", None, "b"]}), path)
    with pytest.raises(PackInputError, match=r"t\.parquet.*record 1 .*no text"):
        pack([path], tmp_path / "out2", tokenizer="bytes")
    m = pack([path], tmp_path / "out3", tokenizer="bytes", on_error="skip")
    assert m.num_samples == 2 and m.stats["skipped_records_by_reason"]["null text"]["count"] == 1


def test_skipped_records_by_reason_through_the_cli(tmp_path, capsys):
    from tierflow.commands.cli import main

    src = write_jsonl(tmp_path / "b.jsonl", 50, {10: '{"text": 42}', 20: "not json"})
    assert (
        main(["pack", str(src), "--out", str(tmp_path / "out"), "--tokenizer", "bytes", "--workers", "1", "--quiet"])
        == 2
    )
    assert "b.jsonl:10: text field 'text' is a number (42)" in capsys.readouterr().err
    assert (
        main(
            [
                "pack",
                str(src),
                "--out",
                str(tmp_path / "out"),
                "--tokenizer",
                "bytes",
                "--workers",
                "1",
                "--on-error",
                "skip",
                "--quiet",
            ]
        )
        == 0
    )
    stats = tierflow.open_dataset(tmp_path / "out").manifest.stats
    assert {r: v["count"] for r, v in stats["skipped_records_by_reason"].items()} == {
        "text not a string": 1,
        "malformed JSON": 1,
    }
