"""One fault, one warning (issue 39, item 4): a shard whose bytes never verify on S3 used to print
the stager's traceback on every staging attempt (121 of them before the reader's FetchError); now
the stager warns once per cause, counts the repeats, and stages that shard no more."""

from __future__ import annotations

import logging
import time

import pytest

import tierflow
from tierflow.errors import FetchError
from tierflow.format.manifest import Manifest
from tierflow.storage.remote import upload_dataset
from tierflow.testing.faults import write_corpus
from tierflow.tiers.fault_log import FaultLog


@pytest.mark.slow
def test_a_corrupt_shard_on_s3_is_one_warning_and_no_traceback(s3_server, s3_bucket, tmp_path, caplog):
    src = write_corpus(tmp_path / "raw.jsonl", docs=3000, seed=11)
    tierflow.pack(
        [src], tmp_path / "packed", workers=1, target_shard_bytes=256 << 10, tokenizer="bytes", block_bytes=64 << 10
    )
    manifest = Manifest.load(tmp_path / "packed")
    info = manifest.shards[len(manifest.shards) - 2]
    data = bytearray((tmp_path / "packed" / info.name).read_bytes())
    data[info.blocks[1].offset + 10] ^= 0x01  # size kept: only the checksum tells
    (tmp_path / "packed" / info.name).write_bytes(bytes(data))
    url = f"s3://{s3_bucket}/ds"
    upload_dataset(tmp_path / "packed", url, endpoint_url=s3_server.endpoint_url)
    caplog.set_level(logging.WARNING, logger="tierflow")
    loader = tierflow.open_loader(
        url, batch_size=8, seq_len=512, endpoint_url=s3_server.endpoint_url, tiers=[f"L2={tmp_path / 'l2'}:64MB"]
    )
    with pytest.raises(FetchError, match=info.name):
        for _ in loader:
            time.sleep(0.02)  # a training step: the stager, far ahead, would retry the shard meanwhile
    loader.close()
    stager = [r for r in caplog.records if r.name == "tierflow.stager"]
    assert not [r for r in caplog.records if r.exc_info], "no traceback at WARNING"
    firsts = [r for r in stager if "could not stage" in r.getMessage() and "times in all" not in r.getMessage()]
    assert len(firsts) == 1 and info.name in firsts[0].getMessage() and "FetchError" in firsts[0].getMessage()
    assert len(stager) <= 2  # the warning, and at most its count


def test_the_fault_log_warns_once_per_cause_and_counts_the_repeats(caplog):
    faults = FaultLog(logging.getLogger("tierflow.test"))
    caplog.set_level(logging.WARNING, logger="tierflow.test")
    import sqlite3

    for _ in range(58):
        faults.warn("tier L2: an index write failed", sqlite3.OperationalError("database or disk is full"), "going on")
    faults.warn("tier L2: an index write failed", sqlite3.OperationalError("disk I/O error"), "going on")
    faults.close()
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 3 and not [r for r in caplog.records if r.exc_info]
    assert messages[0].startswith(
        "tier L2: an index write failed: OperationalError: database or disk is full; going on"
    )
    assert messages[2] == "tier L2: an index write failed: OperationalError: database or disk is full: 58 times in all"
