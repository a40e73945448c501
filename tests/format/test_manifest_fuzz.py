"""Structured fuzz of the manifest parser: a mutated manifest opens or is a ManifestError, fast.

Mutations replace, delete or rename one field anywhere in a real manifest's JSON tree (with
absurd numbers, wrong types, deep nesting) or damage the raw bytes. Minimal inputs that once
escaped as another exception live in tests/format/corpus/manifest-*.json and are replayed.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tierflow
from tierflow.errors import ManifestError
from tierflow.format.manifest import Manifest

CORPUS = Path(__file__).parent / "corpus"
DEEP = "[" * 100_000 + "]" * 100_000
HOSTILE = [None, True, -1, 0, 2**70, 1.5, "", "x", [], {}, [1, 2], {"a": 1}, "shard-../../etc.arrow"]


@pytest.fixture(scope="module")
def manifest_json(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("fuzz")
    with open(root / "docs.jsonl", "w") as f:
        for i in range(600):
            f.write(json.dumps({"id": i, "text": f"doc {i} " + "z" * (i % 30)}) + "\n")
    tierflow.pack([root / "docs.jsonl"], root / "ds", tokenizer="bytes", workers=1, target_shard_bytes=256 << 10)
    manifest = json.loads((root / "ds" / "manifest.json").read_text())
    manifest.pop("manifest_checksum")  # else every mutation fails the checksum: fuzz the parser behind it
    return manifest


def paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path into a JSON tree (keys and list indices), the root excluded; long lists sampled."""
    found = []
    items = node.items() if isinstance(node, dict) else enumerate(node[:3]) if isinstance(node, list) else ()
    for key, child in items:
        found.append((*prefix, key))
        found.extend(paths(child, (*prefix, key)))
    return found


def mutate(doc: dict, path: tuple, how: str, value: Any) -> str:
    """The manifest text after one mutation at `path`."""
    doc = json.loads(json.dumps(doc))
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    last = path[-1]
    marker = "\u0000deep\u0000"
    if how == "delete":
        del parent[last]
    elif how == "rename" and isinstance(parent, dict):
        parent[f"{last}_"] = parent.pop(last)
    elif how == "deep":
        parent[last] = marker
    elif how == "huge":
        parent[last] = marker + "1e999"
    else:
        parent[last] = value
    text = json.dumps(doc)
    return text.replace(json.dumps(marker + "1e999"), "1e999").replace(json.dumps(marker), DEEP)


def parse_within_a_second(raw: bytes) -> None:
    started = time.perf_counter()
    try:
        Manifest.from_bytes(raw, "fuzz/manifest.json")
    except ManifestError as e:
        assert str(e).startswith("fuzz/manifest.json: "), e
    assert time.perf_counter() - started < 1.0


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_mutated_manifest_opens_or_is_a_manifest_error(manifest_json, data):
    path = data.draw(st.sampled_from(paths(manifest_json)))
    how = data.draw(st.sampled_from(["delete", "rename", "deep", "huge", "value"]))
    value = data.draw(st.sampled_from(HOSTILE))
    parse_within_a_second(mutate(manifest_json, path, how, value).encode())


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_damaged_manifest_bytes_are_a_manifest_error(manifest_json, data):
    raw = bytearray(json.dumps(manifest_json).encode())
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(1, len(raw)))
    parse_within_a_second(bytes(raw[:cut]))


@pytest.mark.parametrize("case", sorted(CORPUS.glob("manifest-*.json")), ids=lambda p: p.name)
def test_corpus_inputs_are_manifest_errors(case):
    with pytest.raises(ManifestError, match=r"^fuzz/manifest.json: "):
        Manifest.from_bytes(case.read_bytes(), "fuzz/manifest.json")
