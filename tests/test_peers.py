"""Smoke test of benchmarks/peers (tierflow vs MosaicML Streaming vs LitData, and WebDataset and the
in-RAM list on the raw path): one round on a few MB.

Runs only where the `bench` extra is installed (`make bench-peers` makes .venv-peers; CI's `.[dev]`
does not have the peers, so this module is skipped there).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

PEERS = Path(__file__).resolve().parents[1] / "benchmarks" / "peers"

pytest.importorskip("litdata")
if importlib.util.find_spec("streaming") is None:
    pytest.importorskip("streaming")
sys.path.insert(0, str(PEERS))
try:
    from compat import guard_torchvision  # the peers' import guard for the CPU-only torch

    guard_torchvision()
finally:
    sys.path.remove(str(PEERS))
pytest.importorskip("streaming")
pytest.importorskip("webdataset")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quick_run_writes_every_measurement(tmp_path: Path) -> None:
    out = tmp_path / "results"
    done = subprocess.run(
        [sys.executable, str(PEERS / "run.py"), "--quick", "--out", str(out), "--work", str(tmp_path / "work")],
        capture_output=True,
        text=True,
        timeout=880,
    )
    assert done.returncode == 0, done.stderr[-4000:] + done.stdout[-2000:]
    results = json.loads((out / "peers.json").read_text())
    systems = ("tierflow", "streaming", "litdata")
    assert results["systems"] == list(systems)
    for s in systems:
        assert len(results["convert"]["seconds"][s]["tokens"]) == 1
        assert results["convert"]["at_rest"][s]["tokens"] > 0
        (warm,) = results["warm"][s]
        assert all(warm[k]["steps_per_s"] > 0 for k in ("w0_s0", "w0_s2", "w2_s0", "w2_s2"))
        (cold,) = results["cold"][s]
        assert cold["bytes"] > 0 and cold["first_s"] > 0
        (epochs,) = results["epochs"][s]
        # a peer's crash under cache pressure (LitData's TokensLoader) is recorded, not a test failure
        crashed = (epochs.get("stopped") or {}).get("crashed")
        assert (epochs["per_epoch"] and all(b > 0 for b in epochs["per_epoch"])) or (s != "tierflow" and crashed)
        for size in results["resume_sizes"]:
            assert results["resume"][s][str(size)][0]["first_s"] > 0
    # every system read about the same number of 2048-token batches per epoch (LitData's TokensLoader
    # drops each chunk's tail shorter than a block: a few batches at these tiny chunks)
    batches = [results["cold"][s][0]["batches"] for s in systems]
    assert max(batches) - min(batches) <= max(2, 0.02 * max(batches)), batches
    # the raw path: every system (the in-RAM bound, the three peers, tierflow) in every cell, one epoch
    raw = results["raw"]
    assert raw["systems"] == ["inram", "litdata", "webdataset", "streaming", "tierflow"]
    assert sorted(raw["cells"]) == ["text_w0", "text_w2", "tokens_w0", "tokens_w2"]
    for key, cell in raw["cells"].items():
        for s in raw["systems"]:
            (res,) = cell[s]
            assert res["samples_per_s"] > 0 and res["peak_pss"] > 0, (key, s, res)
        # the same epoch for every system: tierflow's last batches carry a few samples of the next epoch
        # (remainder="carry"), LitData's TokensLoader drops each chunk's tail
        counts = [cell[s][0]["samples"] for s in raw["systems"]]
        assert max(counts) - min(counts) <= max(64, 0.03 * max(counts)), (key, counts)
    assert raw["webdataset"]["tokens"]["shards"] > 2 and raw["webdataset"]["docs"]["shards"] > 2
    table = (out / "peers.md").read_text()
    assert "| measure |" in table and "Versions:" in table
    assert "## Raw path" in table and "| tokens | 2 workers |" in table and "| text | main process |" in table
    assert (out / "peers.png").stat().st_size > 10_000
    assert (out / "peers-raw.png").stat().st_size > 10_000
