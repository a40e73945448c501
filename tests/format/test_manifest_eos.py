"""A manifest's eos_id is checked against its tokenizer and the data; integers too long to be a
manifest's are a typed error naming the field (issue 36, item 4).

Before: the eos_id of a manifest without its checksum (legacy, or edited and resealed) was
trusted: token windows cut documents at the wrong token (wrong cu_seqlens and position_ids) and
`tierflow verify` passed; a 5000-digit integer in a manifest was a bare ValueError from the JSON
parser.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

import tierflow
from tierflow.commands.cli import main
from tierflow.errors import ManifestError
from tierflow.format.manifest import MANIFEST_NAME, Manifest, manifest_checksum

CHECKSUM_KEY = "manifest_checksum"
WRONG_EOS = ord("o")  # a token the documents hold, just not at their ends


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("eos")
    with open(root / "docs.jsonl", "w") as f:
        for i in range(3000):
            f.write(json.dumps({"text": f"doc {i} " + "lorem ipsum " * (i % 17)}) + "\n")
    tierflow.pack(
        [root / "docs.jsonl"],
        root / "ds",
        tokenizer="bytes",
        workers=1,
        target_shard_bytes=256 << 10,
        block_bytes=32 << 10,
    )
    return root / "ds"


@pytest.fixture
def ds_copy(packed: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(packed, tmp_path / "ds"))


def edit(root: Path, change, reseal: bool) -> None:
    """Change the manifest's JSON and drop its dataset_id (the tokenizer feeds it); `reseal`: write a
    matching checksum, as a tool rewriting manifests would; else drop it (legacy)."""
    path = root / MANIFEST_NAME
    d = json.loads(path.read_text())
    change(d)
    d.pop(CHECKSUM_KEY, None)
    d.pop("dataset_id", None)
    if reseal:
        d[CHECKSUM_KEY] = manifest_checksum(d)
    path.write_text(json.dumps(d))


def wrong_eos(reseal: bool):
    """A wrong eos_id the rest of the manifest cannot contradict: its tokenizer says the same
    (resealed by a tool), or says nothing (a legacy manifest's tokenizer identity has none)."""

    def change(d: dict) -> None:
        d["eos_id"] = WRONG_EOS
        if reseal:
            d["tokenizer"]["eos_id"] = WRONG_EOS
        else:
            del d["tokenizer"]["eos_id"]

    return change


def windows(root: Path) -> list:
    loader = tierflow.open_loader(str(root), batch_size=4, seq_len=64)
    try:
        return [b for b in loader]
    finally:
        loader.close()


@pytest.mark.parametrize("reseal", [False, True], ids=["legacy", "resealed"])
def test_a_wrong_eos_id_is_caught_against_the_data_before_a_window_is_cut(ds_copy, reseal):
    edit(ds_copy, wrong_eos(reseal), reseal)
    assert Manifest.load(ds_copy).checksummed == reseal  # it loads: only the data can tell
    with pytest.raises(ManifestError, match=rf"end with token 256, not the manifest's eos_id {WRONG_EOS}"):
        windows(ds_copy)
    with pytest.raises(ManifestError, match="eos_id"):
        tierflow.open_dataset(ds_copy).tokens(0, 10)


@pytest.mark.parametrize("reseal", [False, True], ids=["legacy", "resealed"])
def test_verify_catches_a_wrong_eos_id(ds_copy, reseal, capsys):
    assert main(["verify", str(ds_copy)]) == 0
    edit(ds_copy, wrong_eos(reseal), reseal)
    capsys.readouterr()
    assert main(["verify", str(ds_copy)]) == 1
    assert f"not the manifest's eos_id {WRONG_EOS}" in capsys.readouterr().err


def test_an_eos_id_other_than_its_tokenizers_is_refused_on_load(ds_copy):
    edit(ds_copy, lambda d: d.update(eos_id=WRONG_EOS), reseal=False)
    with pytest.raises(ManifestError, match=rf"eos_id = {WRONG_EOS}, but its tokenizer's eos_id is 256") as e:
        Manifest.load(ds_copy)
    assert str(ds_copy / MANIFEST_NAME) in str(e.value)


def test_the_right_eos_id_windows_as_before(ds_copy):
    edit(ds_copy, lambda d: None, reseal=False)
    assert len(windows(ds_copy)) > 0


@pytest.mark.parametrize("field", ["eos_id", "shards[0].samples", "stats.samples"])
def test_an_integer_of_5000_digits_is_a_manifest_error_naming_the_field(ds_copy, field):
    path = ds_copy / MANIFEST_NAME
    d = json.loads(path.read_text())
    d.pop(CHECKSUM_KEY)
    marker = "123456789.5"  # a float no manifest holds, replaced by the digits below
    if field == "eos_id":
        d["eos_id"] = float(marker)
    elif field == "stats.samples":
        d["stats"]["samples"] = float(marker)
    else:
        d["shards"][0]["samples"] = float(marker)
    path.write_text(json.dumps(d).replace(marker, "9" * 5000))
    with pytest.raises(
        ManifestError,
        match=rf"field {re.escape(field)} is an integer of "
        rf"5000 digits",
    ) as e:
        Manifest.load(ds_copy)
    assert str(ds_copy / MANIFEST_NAME) in str(e.value)
    with pytest.raises(ManifestError):
        tierflow.open_dataset(ds_copy)
