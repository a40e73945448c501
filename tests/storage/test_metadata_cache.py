"""The node's copy of a remote dataset's tables: several processes of a node opening the dataset at
once download each table once (the others wait on the node's lock and map the same file)."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import pytest

import tierflow
from tierflow.format import metadata as md
from tierflow.format.metadata_writer import referenced_tables
from tierflow.testing.faults import write_corpus

PROCESSES = 4


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cache")
    src = write_corpus(root / "a.jsonl", docs=600, seed=5)
    tierflow.pack([src], root / "out", workers=1, tokenizer="bytes", target_shard_bytes=256 << 10)
    return root / "out"


def open_at_once(url: str, endpoint: str, start: Any, results: Any) -> None:
    start.wait()
    dataset = tierflow.open_dataset(url, endpoint_url=endpoint)
    results.put((dataset.manifest.dataset_id, str(dataset.manifest.tables.shards.path)))


@pytest.mark.slow
def test_a_nodes_processes_download_each_table_once(
    packed: Path, tmp_path: Path, s3_proxy, s3_bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tierflow.storage.remote import upload_dataset

    monkeypatch.setenv("TIERFLOW_METADATA_CACHE", str(tmp_path / "cache"))
    url = f"s3://{s3_bucket}/ds"
    upload_dataset(packed, url, endpoint_url=s3_proxy.url)
    s3_proxy.reset_counters()
    context = multiprocessing.get_context("spawn")  # obstore does not survive a fork
    start, results = context.Barrier(PROCESSES), context.Queue()
    workers = [context.Process(target=open_at_once, args=(url, s3_proxy.url, start, results)) for _ in range(PROCESSES)]
    for w in workers:
        w.start()
    opened = [results.get(timeout=120) for _ in workers]
    for w in workers:
        w.join(timeout=60)
        assert w.exitcode == 0
    assert len({dataset_id for dataset_id, _ in opened}) == 1 and len({path for _, path in opened}) == 1
    traffic = s3_proxy.traffic()
    for name in referenced_tables(packed):
        assert traffic.requests("GET", key=name) == 1, name
    assert traffic.requests("GET", key=md.METADATA_NAME) == PROCESSES  # the header is read by each
    cached = list((tmp_path / "cache").glob(f"*/{md.TABLE_PREFIX}*"))
    assert sorted(p.name for p in cached) == sorted(referenced_tables(packed))
    assert not list((tmp_path / "cache").glob("*/.tmp-*"))
