"""Image ingest (issue 16): folders, Parquet image columns and WebDataset tars pack every image
byte-exact, with width/height/format/bytes from the header; a corrupt image is counted and
skipped or raises naming its file, row and key."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

import tierflow
from tierflow.pack.tokenize import PackInputError

SMALL = 256 << 10


def encode(w: int, h: int, fmt: str = "JPEG", seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = (np.linspace(0, 255, w)[None, :, None] + rng.integers(0, 60, (h, w, 3))).clip(0, 255)
    out = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(out, format=fmt)
    return out.getvalue()


SIZES = [(64, 48, "JPEG"), (33, 70, "PNG"), (120, 90, "WEBP"), (50, 50, "JPEG"), (200, 20, "PNG")]
CORRUPT = b"\xff\xd8\xff\xe0 this is no jpeg at all"


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def pack(src, out: Path, **kw) -> tierflow.Manifest:
    kw.setdefault("workers", 1)
    return tierflow.pack(src, out, target_shard_bytes=SMALL, **kw).manifest


def image_folder(root: Path) -> dict[str, bytes]:
    root.mkdir(parents=True)
    files = {}
    for i, (w, h, fmt) in enumerate(SIZES):
        name = f"{i:03d}.{fmt.lower().replace('jpeg', 'jpg')}"
        files[name] = encode(w, h, fmt, i)
        (root / name).write_bytes(files[name])
        (root / f"{i:03d}.txt").write_text(f"picture {i}\n")
    return files


def test_an_image_folder_keeps_every_image_byte_exact_with_its_header_metadata(tmp_path):
    files = image_folder(tmp_path / "imgs")
    pack([tmp_path / "imgs"], tmp_path / "out")
    rows = {s["path"]: s for s in tierflow.open_dataset(tmp_path / "out")}
    assert set(rows) == set(files)
    for i, (name, data) in enumerate(sorted(files.items())):
        s = rows[name]
        w, h, fmt = SIZES[i]
        assert digest(s["image"]) == digest(data)
        assert (s["image_width"], s["image_height"], s["image_format"], s["image_nbytes"]) == (w, h, fmt, len(data))
        assert s["caption"] == f"picture {i}"


def test_a_corrupt_image_in_a_folder_raises_naming_the_file_or_is_counted_and_skipped(tmp_path):
    image_folder(tmp_path / "imgs")
    (tmp_path / "imgs" / "002b.jpg").write_bytes(CORRUPT)
    with pytest.raises(PackInputError, match=r"002b\.jpg: not a readable image"):
        pack([tmp_path / "imgs"], tmp_path / "out")
    m = pack([tmp_path / "imgs"], tmp_path / "out", on_error="skip")
    assert m.num_samples == len(SIZES) and m.stats["corrupt_images"] == 1
    assert m.stats["skipped_files"]["corrupt image"]["count"] == 1
    assert "002b.jpg" in m.stats["errors"][0]


def laion_parquet(path: Path, corrupt_at: int | None = None) -> list[bytes]:
    """img2dataset / LAION style: jpg bytes with url and caption columns, two row groups."""
    images = [encode(20 + 7 * i, 30 + 3 * i, "JPEG", i) for i in range(10)]
    if corrupt_at is not None:
        images[corrupt_at] = CORRUPT
    table = pa.table(
        {
            "url": [f"https://example.com/{i}.jpg" for i in range(10)],
            "caption": [f"caption {i}" for i in range(10)],
            "jpg": pa.array(images, pa.binary()),
        }
    )
    pq.write_table(table, path, row_group_size=5)
    return images


def test_parquet_with_an_image_bytes_column_keeps_bytes_urls_and_captions(tmp_path):
    images = laion_parquet(tmp_path / "laion.parquet")
    pack([tmp_path / "laion.parquet"], tmp_path / "out")
    rows = list(tierflow.open_dataset(tmp_path / "out"))
    assert [digest(r["jpg"]) for r in rows] == [digest(b) for b in images]
    assert [r["url"] for r in rows] == [f"https://example.com/{i}.jpg" for i in range(10)]
    assert [(r["jpg_width"], r["jpg_height"], r["jpg_format"]) for r in rows] == [
        (20 + 7 * i, 30 + 3 * i, "JPEG") for i in range(10)
    ]
    assert rows[3]["caption"] == "caption 3"


def test_hugging_face_image_structs_become_bytes_and_path_columns(tmp_path):
    images = [encode(16 + i, 16, "PNG", i) for i in range(4)]
    struct = pa.array(
        [{"bytes": b, "path": f"{i}.png"} for i, b in enumerate(images)],
        pa.struct([("bytes", pa.binary()), ("path", pa.string())]),
    )
    pq.write_table(pa.table({"image": struct, "text": [f"t{i}" for i in range(4)]}), tmp_path / "hf.parquet")
    pack([tmp_path / "hf.parquet"], tmp_path / "out")
    rows = list(tierflow.open_dataset(tmp_path / "out"))
    assert [r["image"] for r in rows] == images
    assert [r["image_path"] for r in rows] == [f"{i}.png" for i in range(4)]
    assert [r["image_width"] for r in rows] == [16, 17, 18, 19]


def test_a_corrupt_parquet_image_names_file_row_group_row_and_url(tmp_path):
    laion_parquet(tmp_path / "laion.parquet", corrupt_at=7)
    with pytest.raises(PackInputError, match=r"laion\.parquet row group 1 row 2 \(url 'https://example\.com/7\.jpg'\)"):
        pack([tmp_path / "laion.parquet"], tmp_path / "out")
    m = pack([tmp_path / "laion.parquet"], tmp_path / "out", on_error="skip")
    assert m.num_samples == 9 and m.stats["corrupt_images"] == 1
    assert [r["url"] for r in tierflow.open_dataset(tmp_path / "out")][7] == "https://example.com/8.jpg"


def webdataset_tar(path: Path, start: int, count: int, corrupt_key: str | None = None) -> dict[str, dict[str, bytes]]:
    """A WebDataset shard: jpg, txt, json and cls members per key, some keys in a subfolder, one
    with a segmentation mask (`seg.png`)."""
    samples: dict[str, dict[str, bytes]] = {}
    with tarfile.open(path, "w") as tar:
        for i in range(start, start + count):
            key = f"{'sub/' if i % 3 == 0 else ''}{i:06d}"
            members = {
                "jpg": encode(30 + i, 20 + i, "JPEG", i),
                "txt": f"a photo {i}".encode(),
                "json": json.dumps({"i": i}).encode(),
                "cls": str(i % 5).encode(),
            }
            if i % 4 == 1:
                members["seg.png"] = encode(30 + i, 20 + i, "PNG", i)
            if key == corrupt_key:
                members["jpg"] = CORRUPT
            samples[key] = members
            for field, data in members.items():
                info = tarfile.TarInfo(f"{key}.{field}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return samples


def test_webdataset_tars_are_repacked_with_their_keys_and_every_member(tmp_path):
    (tmp_path / "wds").mkdir()
    expected = webdataset_tar(tmp_path / "wds" / "shard-000.tar", 0, 12)
    expected.update(webdataset_tar(tmp_path / "wds" / "shard-001.tar", 12, 9))
    m = pack([tmp_path / "wds"], tmp_path / "out")
    assert m.stats["files"] == 2
    rows = list(tierflow.open_dataset(tmp_path / "out"))
    assert [r["__key__"] for r in rows] == list(expected)
    for r in rows:
        fields = {k for k, v in r.items() if isinstance(v, bytes)}
        assert {k: r[k] for k in fields} == expected[r["__key__"]]  # every member, byte-exact, no other
        assert r["__url__"] in ("shard-000.tar", "shard-001.tar")
        assert (r["jpg_width"], r["jpg_height"], r["jpg_format"]) == (
            30 + int(r["__key__"][-6:]),
            20 + int(r["__key__"][-6:]),
            "JPEG",
        )
        assert (r["seg.png_format"] == "PNG") == ("seg.png" in expected[r["__key__"]])


def test_a_corrupt_image_in_a_tar_names_the_tar_and_key(tmp_path):
    webdataset_tar(tmp_path / "a.tar", 0, 6, corrupt_key="000004")
    with pytest.raises(PackInputError, match=r"a\.tar row 4 \(__key__ '000004'\): not a readable image"):
        pack([tmp_path / "a.tar"], tmp_path / "out")
    m = pack([tmp_path / "a.tar"], tmp_path / "out", on_error="skip")
    assert m.num_samples == 5 and m.stats["corrupt_images"] == 1
    assert "000004" not in [r["__key__"] for r in tierflow.open_dataset(tmp_path / "out")]


@pytest.mark.slow
def test_packing_images_is_byte_identical_with_one_and_two_workers(tmp_path):
    image_folder(tmp_path / "imgs")
    a = pack([tmp_path / "imgs"], tmp_path / "one")
    b = pack([tmp_path / "imgs"], tmp_path / "two", workers=2)
    assert a.dataset_id == b.dataset_id


def test_image_shards_default_to_small_blocks_a_chosen_block_size_wins(tmp_path):
    """A worker verifies a sample's whole block before serving it, so a random image read costs its
    block's bytes: image packs default to 1 MB blocks (4 MB for these 256 MB shards otherwise)."""
    rng = np.random.default_rng(0)
    src = tmp_path / "noise"
    src.mkdir()
    for i in range(24):  # ~63 KB each: 1.5 MB in all, one 4 MB block
        out = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (200, 260, 3), dtype=np.uint8)).save(out, format="JPEG", quality=95)
        (src / f"{i:02d}.jpg").write_bytes(out.getvalue())
    largest = max(p.stat().st_size for p in src.iterdir())
    shards = 256 << 20  # one shard, whatever the small-corpus default would cut
    default = tierflow.pack([src], tmp_path / "default", workers=1, target_shard_bytes=shards).manifest
    blocks = [b for s in default.shards for b in s.blocks]
    assert len(blocks) >= 2 and max(b.length for b in blocks) <= (1 << 20) + largest
    chosen = tierflow.pack(
        [src], tmp_path / "chosen", workers=1, block_bytes=8 << 20, target_shard_bytes=shards
    ).manifest
    assert [b.rows for s in chosen.shards for b in s.blocks] == [24]
