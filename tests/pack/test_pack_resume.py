"""An interrupted pack resumes after its last sealed shard: the rerun packs only the units from
there on and publishes the same dataset id and shard bytes as a pack that was never interrupted.

The local engine's case runs in-process (an interrupt raised by `fn` while a unit is packed); a
SIGKILLed driver of either engine is the same case (tests/pack/test_pack_ray.py kills a Ray one).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import tierflow
from tierflow.format.manifest import MANIFEST_NAME
from tierflow.pack._journal import JOURNAL_NAME

from pack_rig import lake, shard_bytes

OPTS = dict(tokenizer="bytes", target_shard_bytes=256 << 10, chunk_bytes=64 << 10, workers=1)


class InterruptAt:
    """`fn` that is interrupted (as by Ctrl-C) at sample `at` on its first run, and passes rows through."""

    def __init__(self, at: int | None) -> None:
        self.at = at

    def __call__(self, row: dict) -> dict:
        if row["id"] == self.at:
            raise KeyboardInterrupt
        return row


@pytest.mark.parametrize("grow_at", [None, 2600], ids=["one-schema", "schema-grows-after-the-point"])
def test_interrupted_pack_resumes_from_finished_units_and_matches_an_uninterrupted_one(tmp_path, grow_at):
    sources = lake(tmp_path, grow_at=grow_at)
    whole = tierflow.pack(sources, tmp_path / "whole", fn=InterruptAt(None), **OPTS)
    out = tmp_path / "out"
    fn = InterruptAt(3200)
    with pytest.raises(KeyboardInterrupt):
        tierflow.pack(sources, out, fn=fn, **OPTS)
    assert not (out / MANIFEST_NAME).exists()  # an interrupted pack publishes nothing
    assert (out / JOURNAL_NAME).exists()
    fn.at = None
    rerun = tierflow.pack(sources, out, fn=fn, **OPTS)
    total = whole.units_packed
    assert rerun.units_resumed > 0, "the rerun started over"
    assert rerun.units_packed < total and rerun.units_resumed + rerun.units_packed >= total
    assert rerun.manifest.dataset_id == whole.manifest.dataset_id
    assert shard_bytes(out) == shard_bytes(tmp_path / "whole")
    assert (out / MANIFEST_NAME).read_bytes() == (tmp_path / "whole" / MANIFEST_NAME).read_bytes()
    assert not (out / JOURNAL_NAME).exists()


def test_changed_inputs_or_options_start_over(tmp_path):
    sources = lake(tmp_path)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        tierflow.pack(sources, out, fn=InterruptAt(3200), **OPTS)
    changed = dict(OPTS, target_shard_bytes=300 << 10)
    rerun = tierflow.pack(sources, out, fn=InterruptAt(None), **changed)
    assert rerun.units_resumed == 0
    assert shard_bytes(out) == shard_bytes(_fresh(tmp_path, sources, changed))

    with pytest.raises(KeyboardInterrupt):
        tierflow.pack(sources, tmp_path / "again", fn=InterruptAt(3200), **OPTS)
    with open(sources[0], "a") as f:  # an input grew: its units are not the ones journaled
        f.write(json.dumps({"text": "late", "id": 10**6}) + "\n")
    rerun = tierflow.pack(sources, tmp_path / "again", fn=InterruptAt(None), **OPTS)
    assert rerun.units_resumed == 0
    assert shard_bytes(tmp_path / "again") == shard_bytes(_fresh(tmp_path, sources, OPTS))


def _fresh(tmp: Path, sources: list[Path], opts: dict) -> Path:
    fresh = tmp / f"fresh-{len(list(tmp.iterdir()))}"
    tierflow.pack(sources, fresh, fn=InterruptAt(None), **opts)
    return fresh


def test_a_torn_journal_line_is_ignored_and_the_rerun_resumes_before_it(tmp_path):
    sources = lake(tmp_path)
    whole = tierflow.pack(sources, tmp_path / "whole", fn=InterruptAt(None), **OPTS)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        tierflow.pack(sources, out, fn=InterruptAt(3200), **OPTS)
    journal = (out / JOURNAL_NAME).read_bytes()
    (out / JOURNAL_NAME).write_bytes(journal[:-40])  # the kill came while the last line was written
    rerun = tierflow.pack(sources, out, fn=InterruptAt(None), **OPTS)
    assert rerun.units_resumed > 0
    assert shard_bytes(out) == shard_bytes(tmp_path / "whole")
    assert rerun.manifest.dataset_id == whole.manifest.dataset_id


def test_killed_after_the_last_shard_before_the_manifest_the_rerun_packs_nothing_again(tmp_path, monkeypatch):
    from tierflow.pack import packer

    sources = lake(tmp_path, files=1, rows=400)  # one unit: the final shard's cut comes after it is counted
    whole = tierflow.pack(sources, tmp_path / "whole", fn=InterruptAt(None), **OPTS)
    out = tmp_path / "out"

    def interrupted(self, directory):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(packer.Manifest, "save", interrupted)
        with pytest.raises(KeyboardInterrupt):
            tierflow.pack(sources, out, fn=InterruptAt(None), **OPTS)
    rerun = tierflow.pack(sources, out, fn=InterruptAt(None), **OPTS)
    assert (rerun.units_packed, rerun.units_resumed) == (0, whole.units_packed)
    assert rerun.manifest.num_tokens == whole.manifest.num_tokens
    assert (out / MANIFEST_NAME).read_bytes() == (tmp_path / "whole" / MANIFEST_NAME).read_bytes()
