"""The small things a notebook user hits first in `pack` and `cache` (issue 39, item 6)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tierflow
from tierflow.pack.tokenize import PackInputError

SMALL = 256 << 10


def docs(path: Path, n: int = 200) -> Path:
    path.write_text("".join(json.dumps({"text": f"document {i} " * 8}) + "\n" for i in range(n)))
    return path


def test_a_pack_summary_prints_as_one_short_line(tmp_path):
    summary = tierflow.pack(
        [docs(tmp_path / "a.jsonl", 5000)], tmp_path / "out", workers=1, tokenizer="bytes", target_shard_bytes=SMALL
    )
    text = repr(summary)
    assert len(text) < 300 and "\n" not in text, text
    assert summary.manifest.dataset_id in text and "5,000 samples" in text and "tokens" in text


def test_a_typo_in_an_input_creates_no_output_directory(tmp_path):
    docs(tmp_path / "a.jsonl")
    with pytest.raises(PackInputError, match=r"b\.jsonl: no such file or directory"):
        tierflow.pack([tmp_path / "a.jsonl", tmp_path / "b.jsonl"], tmp_path / "out", workers=1)
    assert not (tmp_path / "out").exists()


def test_a_lambda_fn_with_workers_is_refused_saying_what_to_do(tmp_path):
    src = docs(tmp_path / "a.jsonl")
    with pytest.raises(
        PackInputError,
        match=r"fn=<lambda> cannot be sent to the worker processes.*`def` at the "
        r"top level.*workers=1",
    ) as caught:
        tierflow.pack([src], tmp_path / "out", fn=lambda r: {"text": r["text"].upper()}, workers=2)
    assert caught.value.__cause__ is None
    assert not (tmp_path / "out").exists()
    m = tierflow.pack([src], tmp_path / "out1", fn=lambda r: {"text": r["text"].upper()}, workers=1).manifest
    assert m.num_samples == 200


def test_cache_evict_without_a_dataset_id_asks_for_all(tmp_path, capsys):
    from tierflow.commands.cli import main

    packed = tmp_path / "packed"
    tierflow.pack([docs(tmp_path / "a.jsonl")], packed, workers=1, target_shard_bytes=SMALL)
    tier = ["--tier", f"L2={tmp_path / 'l2'}:64MB"]
    assert main(["cache", "warm", str(packed), *tier]) == 0
    assert main(["cache", "evict", *tier]) == 2
    err = capsys.readouterr().err
    assert "would evict 1 entries of 1 dataset" in err and "--all" in err and "other jobs'" in err
    from tierflow.tiers.tier import Tier

    assert len(Tier(tmp_path / "l2", 64 << 20, configure=False).index.entries()) == 1  # still there
    assert main(["cache", "evict", "--all", *tier]) == 0
    assert "evicted 1 entries" in capsys.readouterr().out


FORK_INTERRUPTED = r"""
import os, signal, sys
import tierflow

sent = []


def interrupt_once():  # a Ctrl-C that lands while the pool forks, where Python ran it in logging's hook
    if not sent:
        sent.append(1)
        signal.raise_signal(signal.SIGINT)


os.register_at_fork(after_in_parent=interrupt_once)
try:
    tierflow.pack([sys.argv[1]], sys.argv[2], workers=2, tokenizer="bytes", target_shard_bytes=256 << 10)
except KeyboardInterrupt:
    print("interrupted")
else:
    print("finished")
"""


@pytest.mark.slow
def test_a_ctrl_c_while_the_pack_forks_its_workers_is_raised_not_lost(tmp_path):
    """A KeyboardInterrupt raised in an at-fork callback is printed as "Exception ignored" and lost:
    the pack ran to its end (exit 0), or, interrupted inside the pool's start, waited for ever on
    workers that were never told to stop."""
    src = docs(tmp_path / "a.jsonl", 20000)
    done = subprocess.run(
        [sys.executable, "-c", FORK_INTERRUPTED, str(src), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.stdout.strip() == "interrupted", done.stdout + done.stderr
    assert "Exception ignored" not in done.stderr, done.stderr
    assert not (tmp_path / "out" / "manifest.json").exists()


@pytest.mark.slow
def test_ctrl_c_during_a_cli_pack_is_one_line_not_a_traceback(tmp_path):
    src = tmp_path / "big.jsonl"
    with open(src, "w") as f:
        for i in range(600_000):  # ~3 s of packing on 2 cores: the Ctrl-C lands well before its end
            f.write(json.dumps({"text": f"document {i} " * 20}) + "\n")
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tierflow",
            "pack",
            str(src),
            "--out",
            str(out),
            "--tokenizer",
            "bytes",
            "--workers",
            "2",
            "--quiet",
            "--shard-size",
            "1MB",
        ],
        start_new_session=True,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    deadline = time.monotonic() + 60
    while not any((out / ".tmp-pack").glob("unit-*")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)  # until a worker has written its first unit: the pack is under way
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: to the pack and its workers
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == (
        "tierflow pack: interrupted; nothing was published: rerun the same command to carry on (the shards it "
        "sealed are kept)"
    )


def test_shard_size_is_the_clis_name_for_target_shard_bytes(tmp_path):
    src = docs(tmp_path / "a.jsonl", 20000)
    by_name = tierflow.pack([src], tmp_path / "a", workers=1, shard_size="256KiB").manifest
    by_bytes = tierflow.pack([src], tmp_path / "b", workers=1, target_shard_bytes=256 << 10).manifest
    assert len(by_name.shards) > 1 and by_name.dataset_id == by_bytes.dataset_id
    with pytest.raises(ValueError, match="not both"):
        tierflow.pack([src], tmp_path / "c", workers=1, shard_size="1MB", target_shard_bytes=1 << 20)


def test_an_aborted_pack_ends_a_shard_writer_the_assembler_lost(tmp_path):
    """A Ctrl-C between a writer thread's start and the assembler's note of it left the thread
    waiting on its queue for ever, and the interpreter waiting on the thread: the pack never exited."""
    import pyarrow as pa

    from tierflow.pack._assemble import ShardAssembler, _ShardInFlight

    assembler = ShardAssembler(tmp_path, SMALL, "zstd", None, None)
    assembler.add(pa.record_batch({"x": pa.array(range(10))}))
    lost = _ShardInFlight(assembler._pool, tmp_path, assembler.schema, "zstd", None, None, assembler._stopped)
    assembler.abort()
    assert lost.future.result(timeout=10) is None
    assert not list(tmp_path.glob("shard-*"))
