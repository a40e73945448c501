"""Every error tierflow raises on purpose keeps its type across a DataLoader worker boundary."""

from __future__ import annotations

import importlib
import json
import os
import pickle
import pkgutil
import shutil
from pathlib import Path

import pytest

import tierflow
from tierflow import errors
from tierflow.errors import ShardCorruptError, SourceError, SourceNotFound, TierflowError
from tierflow.format.shard import block_lists


def _all_error_classes() -> list[type]:
    """TierflowError and every subclass defined anywhere in the package (every module imported)."""
    for module in pkgutil.walk_packages(tierflow.__path__, "tierflow."):
        if module.name.endswith("__main__"):
            continue
        try:
            importlib.import_module(module.name)
        except ImportError:  # an optional extra that is not installed
            pass
    found, todo = [], [TierflowError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


@pytest.mark.parametrize("cls", _all_error_classes(), ids=lambda c: c.__name__)
def test_every_error_class_builds_from_one_message_and_pickles_with_its_type(cls):
    rebuilt = cls("Caught it in DataLoader worker process 0.\nOriginal Traceback: shard-ab.arrow")
    assert "shard-ab.arrow" in str(rebuilt)
    again = pickle.loads(pickle.dumps(rebuilt))
    assert type(again) is cls and str(again) == str(rebuilt)


def test_a_source_error_pickles_with_its_fields():
    e = SourceNotFound("s3://b/ds", "shard-1.arrow", "no such object", 3)
    again = pickle.loads(pickle.dumps(e))
    assert type(again) is SourceNotFound and isinstance(again, FileNotFoundError)
    assert (again.url, again.name, again.reason, again.attempts) == ("s3://b/ds", "shard-1.arrow", "no such object", 3)
    assert str(again) == str(e) == "s3://b/ds/shard-1.arrow: no such object after 3 attempts"
    assert str(SourceError("whole message")) == "whole message"


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("typed")
    with open(root / "docs.jsonl", "w") as f:
        for i in range(3000):
            f.write(json.dumps({"id": i, "text": f"document {i} " + "xyz" * (i % 50)}) + "\n")
    out = root / "ds"
    tierflow.pack([root / "docs.jsonl"], out, tokenizer="bytes", workers=1, target_shard_bytes=256 << 10)
    return out


def _loop_error(data: Path, tiers: list, damage) -> BaseException:
    """Run a real DataLoader (2 workers) over a TieredDataset of `data` damaged by `damage(shard)`
    after the dataset was opened; return what the training loop caught."""
    from torch.utils.data import DataLoader

    from tierflow.loader import TieredDataset, BatchSpec, OrderSpec
    from tierflow.tiers import build_stack

    stack = build_stack(str(data), tiers)
    ds = TieredDataset(stack.dataset(), BatchSpec(batch_size=8), OrderSpec(partitions=2))
    for info in stack.manifest().shards:
        damage(data / info.name)
    with pytest.raises(TierflowError) as caught:
        for _ in DataLoader(ds, batch_size=None, num_workers=2):
            pass
    return caught.value


@pytest.mark.slow
def test_a_deleted_shard_reaches_the_loop_as_source_not_found_naming_it(packed, tmp_path):
    from tierflow.tiers import TierConfig

    data = tmp_path / "ds"
    shutil.copytree(packed, data)
    error = _loop_error(data, [TierConfig("L2", str(tmp_path / "l2"), 1 << 30, form="at_rest")], os.unlink)
    assert type(error) is SourceNotFound
    assert "shard-" in str(error) and "no such object" in str(error)


@pytest.mark.slow
def test_a_corrupted_shard_reaches_the_loop_as_shard_corrupt_naming_it(packed, tmp_path):
    def corrupt(path: Path) -> None:
        with open(path, "r+b") as f:
            f.seek(100)
            f.write(b"\xff" * 64)

    data = tmp_path / "ds"
    shutil.copytree(packed, data)
    error = _loop_error(data, [], corrupt)
    assert type(error) is ShardCorruptError
    assert "shard-" in str(error) and "block" in str(error) and "checksum" in str(error)  # reads are per block


def test_errors_module_exports_every_class_it_defines():
    assert {c.__name__ for c in _all_error_classes() if c.__module__ == errors.__name__} <= set(errors.__all__)


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_a_deleted_shard_of_a_dataset_directory_is_source_not_found_naming_it(tmp_path, compression):
    with open(tmp_path / "docs.jsonl", "w") as f:
        for i in range(500):
            f.write(json.dumps({"text": f"doc {i}"}) + "\n")
    tierflow.pack([tmp_path / "docs.jsonl"], tmp_path / "ds", workers=1, compression=compression)
    ds = tierflow.open_dataset(tmp_path / "ds")
    name = ds.manifest.shards[0].name
    (tmp_path / "ds" / name).unlink()
    with pytest.raises(SourceNotFound, match=rf"{tmp_path / 'ds' / name}: no such shard file"):
        ds[0]


def test_a_block_that_verifies_but_does_not_decode_is_shard_corrupt_naming_it(tmp_path):
    from tierflow.format._checksum import xxh3_hex

    with open(tmp_path / "docs.jsonl", "w") as f:
        for i in range(3000):
            f.write(json.dumps({"id": i, "text": f"doc {i} " * 5}) + "\n")
    tierflow.pack([tmp_path / "docs.jsonl"], tmp_path / "ds", workers=1, compression="none", block_bytes=16 << 10)
    manifest_path = tmp_path / "ds" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    shard = manifest["shards"][0]
    blocks = shard["blocks"] = block_lists(shard["blocks"])
    offset, length = blocks["offset"][1], blocks["length"][1]
    path = tmp_path / "ds" / shard["name"]
    data = bytearray(path.read_bytes())
    data[offset + 8 : offset + 16] = b"\x7f" * 8  # the message's flatbuffer: garbage
    path.write_bytes(bytes(data))
    blocks["checksum"][1] = xxh3_hex(bytes(data[offset : offset + length]))  # ...that the manifest vouches for
    manifest.pop("manifest_checksum")  # (its author dropped the manifest's own checksum)
    manifest_path.write_text(json.dumps(manifest))
    ds = tierflow.open_dataset(tmp_path / "ds")
    with pytest.raises(ShardCorruptError, match=rf"shard {shard['name']}: block 1 .* does not decode"):
        ds[blocks["rows"][0]]
