"""What `pack` makes of a directory: every file is packed or counted by reason, never dropped;
wrong-typed columns are named with their file (issue 13, defects 1 and 7)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import tierflow
from tierflow.pack.tokenize import PackInputError

SMALL = 256 << 10


def pack(src, out: Path, **kw) -> tierflow.Manifest:
    kw.setdefault("workers", 1)
    return tierflow.pack(src, out, target_shard_bytes=SMALL, **kw).manifest


def write(path: Path, data: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.write_bytes if isinstance(data, bytes) else path.write_text)(data)
    return path


def png_bytes(i: int, size: tuple[int, int] = (8, 6)) -> bytes:
    """A real (tiny) PNG: pack reads every image's header."""
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(np.full((size[1], size[0], 3), i % 256, np.uint8)).save(out, format="PNG")
    return out.getvalue()


def image_tree(root: Path, images: int = 3, pages: int = 5) -> Path:
    """An image folder with caption sidecars and some HTML pages (like an OS doc tree)."""
    for i in range(images):
        write(root / "img" / f"{i}.png", png_bytes(i))
        write(root / "img" / f"{i}.txt", f"caption {i}")
    for i in range(pages):
        write(root / "pages" / f"p{i}.html", f"<p>page {i}</p>")
    return root


def files_in(root: Path) -> int:
    return sum(1 for p in root.rglob("*") if p.is_file())


def test_an_image_folder_with_other_files_is_refused_naming_kinds_counts_and_examples(tmp_path):
    src = image_tree(tmp_path / "tree")
    with pytest.raises(PackInputError) as caught:
        pack([src], tmp_path / "out")
    message = str(caught.value)
    assert str(src) in message
    assert "3 images" in message and "img/0.png" in message
    assert "5 other files" in message and "pages/p0.html" in message
    assert "--kind" in message and "--exclude" in message
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_the_kind_is_decided_from_the_whole_tree_not_its_first_thousand_files(tmp_path):
    src = tmp_path / "tree"
    for i in range(1001):
        write(src / "a" / f"{i:04d}.md", f"doc {i}")
    write(src / "z" / "late.png", png_bytes(0))
    with pytest.raises(PackInputError, match=r"1 image .*z/late\.png"):
        pack([src], tmp_path / "out")


def test_kind_images_packs_the_images_and_counts_every_other_file_by_reason(tmp_path):
    src = image_tree(tmp_path / "tree")
    m = pack([src], tmp_path / "out", kind="images")
    ds = tierflow.open_dataset(tmp_path / "out")
    assert sorted((s["path"], s["caption"]) for s in ds) == [(f"img/{i}.png", f"caption {i}") for i in range(3)]
    skipped = m.stats["skipped_files"]
    assert skipped == {"not an image": {"count": 5, "example": str(src / "pages" / "p0.html")}}
    assert m.stats["files"] == 3 and m.stats["sidecars"] == 3
    assert m.stats["files"] + m.stats["sidecars"] + 5 == files_in(src)  # every file accounted for


def test_kind_files_packs_every_file_of_a_mixed_folder(tmp_path):
    src = image_tree(tmp_path / "tree")
    m = pack([src], tmp_path / "out", kind="files")
    assert m.num_samples == files_in(src) == m.stats["files"]
    assert not m.stats.get("skipped_files")


def test_a_caption_sidecar_that_is_excluded_is_not_read(tmp_path):
    src = image_tree(tmp_path / "tree", pages=0)
    pack([src], tmp_path / "out", exclude=["*.txt"])
    assert [s["caption"] for s in tierflow.open_dataset(tmp_path / "out")] == [None] * 3


def records(n: int, start: int = 0) -> list[dict]:
    return [{"text": f"doc {i}", "i": i} for i in range(start, start + n)]


def jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def record_tree(root: Path) -> tuple[Path, list[dict]]:
    """JSONL, gzipped JSONL, a JSON array and Parquet in one tree: all records, in walk order."""
    rows = records(40)
    write(root / "a.jsonl", jsonl(rows[:10]))
    write(root / "b.jsonl.gz", gzip.compress(jsonl(rows[10:20]).encode()))
    write(root / "c.json", json.dumps(rows[20:30], indent=2))
    (root / "sub").mkdir()
    pq.write_table(pa.Table.from_pylist(rows[30:]), root / "sub" / "d.parquet")
    return root, rows


def test_a_directory_of_jsonl_json_and_parquet_files_is_read_as_records(tmp_path):
    src, rows = record_tree(tmp_path / "tree")
    m = pack([src], tmp_path / "out")
    assert [s for s in tierflow.open_dataset(tmp_path / "out")] == rows
    assert m.stats["files"] == 4


def test_kind_jsonl_reads_a_directory_and_counts_the_files_it_is_not(tmp_path):
    src, rows = record_tree(tmp_path / "tree")
    write(src / "README.md", "# a dataset")
    m = pack([src], tmp_path / "out", kind="jsonl")
    assert [s for s in tierflow.open_dataset(tmp_path / "out")] == rows[:30]
    assert m.stats["skipped_files"] == {"not JSONL": {"count": 2, "example": str(src / "README.md")}}


def test_records_next_to_other_files_are_refused_by_default(tmp_path):
    src, _ = record_tree(tmp_path / "tree")
    write(src / "README.md", "# a dataset")
    with pytest.raises(PackInputError, match=r"3 JSONL/JSON files .*1 Parquet file .*1 other file .*README\.md"):
        pack([src], tmp_path / "out")


def test_a_directory_of_jsonl_files_is_byte_identical_with_one_and_two_workers(tmp_path):
    src = tmp_path / "tree"
    for k in range(6):
        write(src / f"{k}.jsonl", jsonl(records(400, 400 * k)))
    a = pack([src], tmp_path / "one", chunk_bytes=8 << 10)
    b = pack([src], tmp_path / "two", workers=2, chunk_bytes=8 << 10)
    assert a.dataset_id == b.dataset_id and a.num_samples == 2400


def test_the_progress_total_is_the_bytes_of_the_files_packed(tmp_path):
    from tierflow.pack.sources import estimate_input_bytes
    from tierflow.pack.units import SourceOptions

    tree = image_tree(tmp_path / "tree")
    parquet = tmp_path / "a.parquet"
    pq.write_table(pa.table({"text": [f"row {i} " * 20 for i in range(3000)]}), parquet, row_group_size=500)
    packed = {"images": sum(p.stat().st_size for p in (tree / "img").iterdir()), "auto": parquet.stat().st_size}
    for source, kind in ((tree, "images"), (parquet, "auto")):
        summary = tierflow.pack([source], tmp_path / f"out-{kind}", workers=1, kind=kind, target_shard_bytes=SMALL)
        assert estimate_input_bytes([source], SourceOptions(kind=kind)) == summary.input_bytes == packed[kind]


# wrong-typed columns


def test_a_parquet_text_column_of_ints_names_the_file_the_column_and_the_types(tmp_path):
    path = tmp_path / "ints.parquet"
    pq.write_table(pa.table({"text": np.arange(50)}), path)
    for workers in (1, 2):
        with pytest.raises(PackInputError, match=r"ints\.parquet.*'text'.*int64.*string") as caught:
            pack([path], tmp_path / f"out{workers}", tokenizer="bytes", workers=workers)
        assert caught.value.__cause__ is None


def test_a_wrong_typed_text_field_through_the_cli_is_one_line_naming_file_and_column(tmp_path, capsys):
    from tierflow.commands.cli import main

    path = write(tmp_path / "nested.jsonl", jsonl([{"body": {"a": 1}}] * 5))
    assert (
        main(
            [
                "pack",
                str(path),
                "--out",
                str(tmp_path / "out"),
                "--tokenizer",
                "bytes",
                "--text-field",
                "body",
                "--workers",
                "1",
                "--quiet",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "nested.jsonl" in err and "'body'" in err and "struct" in err


def test_a_column_whose_type_changes_between_files_names_the_file(tmp_path):
    src = tmp_path / "tree"
    src.mkdir()
    pq.write_table(pa.table({"x": ["a", "b"]}), src / "a.parquet")
    pq.write_table(pa.table({"x": [[1], [2]]}), src / "b.parquet")
    with pytest.raises(PackInputError, match=r"b\.parquet.*'x'"):
        pack([src], tmp_path / "out")
