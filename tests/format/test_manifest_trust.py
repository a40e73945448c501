"""Defect 1 of issue 18: the manifest's numbers are checked, by its own checksum and against the shard bytes.

A flipped byte in a field name, or token counts moved between blocks (sums kept), used to load and
serve wrong windows while `tierflow verify` passed. Now a checksummed manifest that was changed is a
ManifestError; a manifest without a checksum (written before it existed, or edited by hand and
stripped of it) still loads, and every count it gives is checked against the shard's bytes when a
block is first opened, and by `verify`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import tierflow
from tierflow.commands.cli import main
from tierflow.errors import ManifestError, ShardCorruptError, TierflowError
from tierflow.format.manifest import MANIFEST_NAME, Manifest

from hostile import listed

CHECKSUM_KEY = "manifest_checksum"


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("trust")
    src = root / "docs.jsonl"
    with open(src, "w") as f:
        for i in range(6000):
            f.write(json.dumps({"id": i, "text": f"doc {i} " + "y" * (i % 90)}) + "\n")
    out = root / "ds"
    tierflow.pack([src], out, tokenizer="bytes", workers=1, target_shard_bytes=256 << 10, block_bytes=32 << 10)
    return out


@pytest.fixture
def tokens_ds(packed: Path, tmp_path: Path) -> Path:
    """A copy of the module's pack of its own: tests edit its manifest."""
    return Path(shutil.copytree(packed, tmp_path / "ds"))


def edit(root: Path, change, keep_checksum: bool = False) -> dict:
    """Apply `change` to the manifest's JSON; without `keep_checksum` the checksum goes too (a legacy
    manifest, or a hostile one whose author dropped it)."""
    path = root / MANIFEST_NAME
    d = listed(json.loads(path.read_text()))
    change(d)
    if not keep_checksum:
        d.pop(CHECKSUM_KEY, None)
    path.write_text(json.dumps(d))
    return d


def read_all_tokens(root: Path) -> np.ndarray:
    ds = tierflow.open_dataset(root)
    return ds.tokens(0, ds.num_tokens)


def test_a_packed_manifest_carries_its_checksum_and_loads(tokens_ds):
    d = json.loads((tokens_ds / MANIFEST_NAME).read_text())
    assert len(d[CHECKSUM_KEY]) == 32
    assert Manifest.load(tokens_ds).checksummed


def test_a_flipped_byte_in_a_field_name_fails_the_checksum(tokens_ds):
    path = tokens_ds / MANIFEST_NAME
    raw = path.read_text()
    assert '"tokens": ' in raw
    path.write_text(raw.replace('"tokens": ', '"tokenz": ', 1))
    with pytest.raises(ManifestError, match="checksum"):
        Manifest.load(tokens_ds)


def test_any_edited_number_fails_the_checksum(tokens_ds):
    def change(d):
        d["eos_id"] = 3

    edit(tokens_ds, change, keep_checksum=True)
    with pytest.raises(ManifestError, match="checksum"):
        Manifest.load(tokens_ds)


def test_a_manifest_without_checksum_still_loads_with_the_same_id(tokens_ds):
    before = Manifest.load(tokens_ds)
    edit(tokens_ds, lambda d: None)
    after = Manifest.load(tokens_ds)
    assert not after.checksummed and after.dataset_id == before.dataset_id
    assert read_all_tokens(tokens_ds).size == before.num_tokens


def test_a_zeroed_shard_token_count_is_refused(tokens_ds):
    def change(d):
        d["shards"][1]["tokens"] = 0  # what a flipped byte in the key name did (the default is 0)

    edit(tokens_ds, change)
    with pytest.raises(TierflowError, match="tokens"):
        read_all_tokens(tokens_ds)


def test_a_renamed_shard_token_key_is_refused(tokens_ds):
    def change(d):
        d["shards"][1]["tokenz"] = d["shards"][1].pop("tokens")

    edit(tokens_ds, change)
    with pytest.raises(TierflowError, match="tokens"):
        read_all_tokens(tokens_ds)


def test_token_counts_moved_between_blocks_are_caught_before_a_token_is_served(tokens_ds):
    def change(d):
        counts = d["shards"][0]["blocks"]["tokens"]
        assert len(counts) >= 2
        counts[0] += 7
        counts[1] -= 7  # the shard's sum is kept

    edit(tokens_ds, change)
    ds = tierflow.open_dataset(tokens_ds)
    with pytest.raises(ShardCorruptError, match=r"block 0 .*tokens"):
        ds.tokens(0, 10)


def test_rows_moved_between_blocks_are_caught_before_a_sample_is_served(tokens_ds):
    def change(d):
        rows = d["shards"][0]["blocks"]["rows"]
        rows[0] += 1
        rows[1] -= 1

    edit(tokens_ds, change)
    ds = tierflow.open_dataset(tokens_ds)
    with pytest.raises(ShardCorruptError, match="block 0 .*rows"):
        ds[0]


def test_a_wrong_token_dtype_is_caught(tokens_ds):
    def change(d):
        d["token_dtype"] = "int64"

    edit(tokens_ds, change)
    ds = tierflow.open_dataset(tokens_ds)
    with pytest.raises(ShardCorruptError, match="token_dtype|int64"):
        ds.tokens(0, 10)


def test_verify_checks_the_manifest_numbers(tokens_ds, capsys):
    assert main(["verify", str(tokens_ds)]) == 0

    def change(d):
        counts = d["shards"][0]["blocks"]["tokens"]
        counts[0] += 7
        counts[1] -= 7

    edit(tokens_ds, change)
    capsys.readouterr()
    assert main(["verify", str(tokens_ds)]) == 1
    err = capsys.readouterr().err
    assert "block 0" in err and "tokens" in err
    assert "no checksum" in err


def test_verify_names_a_checksum_mismatch(tokens_ds, capsys):
    edit(tokens_ds, lambda d: d.update(eos_id=3), keep_checksum=True)
    assert main(["verify", str(tokens_ds)]) != 0
    assert "checksum" in capsys.readouterr().err


@pytest.mark.slow
def test_verify_on_s3_checks_the_manifest_numbers_from_the_bytes_it_streams(tokens_ds, s3_server, s3_bucket, capsys):
    from tierflow.storage.remote import upload_dataset

    def change(d):
        counts = d["shards"][1]["blocks"]["tokens"]
        counts[0] += 3
        counts[1] -= 3

    edit(tokens_ds, change)
    url = f"s3://{s3_bucket}/ds"
    upload_dataset(tokens_ds, url, endpoint_url=s3_server.endpoint_url)
    capsys.readouterr()
    assert main(["verify", url, "--endpoint-url", s3_server.endpoint_url]) == 1
    err = capsys.readouterr().err
    assert "block 0" in err and "tokens" in err and "no checksum" in err


def test_a_legacy_manifest_without_block_token_counts_is_checked_against_the_bytes(tokens_ds, tmp_path):
    """Manifests written before per-block token counts existed: the index reads each shard's block
    counts from its bytes when a token of it is first asked for, and verify sums them; a shard
    total that disagrees is named by both, before a token is served."""
    from tierflow.format._audit import audit_manifest

    def legacy(d):
        for shard in d["shards"]:
            shard["blocks"].pop("tokens")

    edit(tokens_ds, legacy)
    expected = np.concatenate([tierflow.open_dataset(tokens_ds).tokens(0, 10)])
    assert audit_manifest(tokens_ds, Manifest.load(tokens_ds)) == []
    sound = read_all_tokens(tokens_ds)
    assert sound.size == Manifest.load(tokens_ds).stats["tokens"] and (sound[:10] == expected).all()

    def moved(d):  # 5 tokens moved from shard 1's total to shard 0's: the dataset's sum is kept
        d["shards"][0]["tokens"] += 5
        d["shards"][1]["tokens"] -= 5

    d = edit(tokens_ds, moved)
    name = d["shards"][0]["name"]
    problems = audit_manifest(tokens_ds, Manifest.load(tokens_ds))
    assert any(
        p.startswith(f"shard {name}: holds ") and f"the manifest says {d['shards'][0]['tokens']}" in p for p in problems
    ), problems
    with pytest.raises(ShardCorruptError, match=rf"shard {name}: its blocks hold \d+ tokens in \d+ blocks"):
        tierflow.open_dataset(tokens_ds).tokens(0, 10)


def _twice(d):
    d["shards"].append(dict(d["shards"][0]))


def _rows_moved_out(d):
    d["shards"][0]["blocks"]["rows"][0] += 1  # the blocks no longer sum to the shard's samples


def _absurd_rows(d):
    rows = d["shards"][0]["blocks"]["rows"]
    rows[0], rows[1] = -1, rows[1] + rows[0] + 1  # the sum is kept


def _outside(d):
    d["shards"][0]["blocks"]["length"][-1] += d["shards"][0]["bytes"]


def _nested(d):
    """Block 1 said to lie inside block 0: `verify` then named the sound blocks after it as failing."""
    blocks = d["shards"][0]["blocks"]
    blocks["offset"][1], blocks["length"][1] = blocks["offset"][0] + 8, 16


def _out_of_order(d):
    blocks = d["shards"][0]["blocks"]
    for column in blocks.values():
        column[0], column[1] = column[1], column[0]


HOSTILE_FIELDS = {
    "token_dtype": (lambda d: d.update(token_dtype="float64"), r"token_dtype 'float64' is not one of"),
    "a shard listed twice": (_twice, "a shard is listed twice"),
    "block rows": (_rows_moved_out, r"block rows sum to \d+, not \d+ samples"),
    "negative rows": (_absurd_rows, "a block of -1 rows is negative or absurd"),
    "a block outside the file": (_outside, r"block at \d+\+\d+ lies outside the file"),
    "overlapping blocks": (_nested, r"block at \d+\+16 overlaps the block before it"),
    "blocks out of file order": (_out_of_order, r"block at 0\+\d+ overlaps the block before it"),
    "token_column": (lambda d: d.update(token_column="nope"), "token_column 'nope' is not in the schema"),
    "eos_id": (lambda d: d.update(eos_id=-1), "eos_id = -1 is not a token id"),
    "a shard that is not an object": (lambda d: d["shards"].__setitem__(1, 7), "shard #1 is not an object"),
    "a negative count": (lambda d: d["shards"][0].update(tokens=-1), r"tokens = -1 is negative or absurd"),
    "stats": (
        lambda d: d["stats"].update(samples=d["stats"]["samples"] + 1),
        r"stats.samples = \d+, but the shards' samples sum to \d+",
    ),
}


@pytest.mark.parametrize("field", list(HOSTILE_FIELDS))
def test_a_manifest_field_that_cannot_be_true_is_refused_naming_it(tokens_ds, field):
    """Without its checksum (a legacy manifest, or a hostile one whose author dropped it) each
    field is still checked on load against what the others and the files allow."""
    change, message = HOSTILE_FIELDS[field]
    edit(tokens_ds, change)
    with pytest.raises(ManifestError, match=message) as e:
        Manifest.load(tokens_ds)
    assert str(tokens_ds / MANIFEST_NAME) in str(e.value)


def test_a_shard_without_the_token_column_its_manifest_counts_tokens_in_is_refused_naming_the_block(tmp_path):
    """A hostile manifest vouches for a shard of another pack (no token column) and gives its blocks
    token counts: a block said to hold none reads (nothing is claimed of it), the first said to hold
    some is ShardCorruptError naming shard and block, before any token is served."""
    from hostile import forge_manifest

    src = tmp_path / "docs.jsonl"
    with open(src, "w") as f:
        for i in range(400):
            f.write(json.dumps({"id": i, "text": f"doc {i} " + "z" * (i % 50)}) + "\n")
    for name, tokenizer in (("tok", "bytes"), ("plain", None)):
        tierflow.pack([src], tmp_path / name, tokenizer=tokenizer, workers=1, block_bytes=4 << 10)
    plain = listed(json.loads((tmp_path / "plain" / MANIFEST_NAME).read_text()))
    (shard,) = plain["shards"]
    shutil.copy(tmp_path / "plain" / shard["name"], tmp_path / "tok" / shard["name"])

    def swap(m: dict) -> None:
        (ours,) = m["shards"]
        rows = shard["blocks"]["rows"]
        assert len(rows) >= 2 and shard["samples"] == ours["samples"]
        shard["tokens"] = ours["tokens"]
        shard["blocks"]["tokens"] = [0, ours["tokens"]] + [0] * (len(rows) - 2)
        m["shards"] = [shard]

    forge_manifest(tmp_path / "tok", swap)
    ds = tierflow.open_dataset(tmp_path / "tok")
    assert ds[0]["id"] == 0  # block 0: said to hold no tokens, and holds none
    with pytest.raises(
        ShardCorruptError,
        match=rf"shard {shard['name']}: block 1 .*has no tokens column, the "
        rf"manifest says it holds {shard['tokens']} tokens",
    ):
        ds.tokens(0, 10)
