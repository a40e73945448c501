"""Reads of a resident tier entry failing (EIO from the tier's device), with FailNth.

An L2 filled by one epoch serves the next: with the N-th read of its entries failing once, or
every read from the N-th on (a device that died), for N = 1, 2, ... every epoch yields the golden
batches; the entry that could not be read is dropped (quarantined), read from the tier below,
and whatever the L2 still indexes is whole. Faults under `entries/` only: a cache device
failing reads of the files it holds, its index and temporaries still working. (A whole-file
check of a hit hashes a memory map, whose failed read is a SIGBUS FailNth cannot raise.)
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path
from typing import Any

import pytest

import tierflow
from tierflow.format.manifest import Manifest
from tierflow.testing.faults import Trial, fail_each, tier_problems, write_corpus

FORMS = ["at_rest", "decoded"]


def batch_digest(batch: dict[str, Any]) -> list[bytes]:
    return [v.numpy().tobytes() if hasattr(v, "numpy") else repr(v).encode() for _, v in sorted(batch.items())]


class ReadRig:
    """`template/`: the packed dataset (`l4`) and an L2 of `form` filled by one epoch; each trial
    copies it to `run/`."""

    def __init__(self, root: Path, form: str) -> None:
        self.root, self.form = root, form
        self.template, self.run_dir = root / "template", root / "run"
        raw = write_corpus(root / "docs.jsonl", docs=700, seed=7)
        tierflow.pack([raw], self.template / "l4", tokenizer="bytes", target_shard_bytes=256 << 10, workers=1)
        self.manifest = Manifest.load(self.template / "l4")
        assert len(self.manifest.shards) >= 3
        self.golden = self.epoch(self.template)
        assert len(list((self.template / "l2" / "entries").iterdir())) == len(self.manifest.shards)

    def tiers(self, where: Path) -> list[str]:
        return [f"L2={where}/l2:64MB:lru:{self.form}"]

    def reset(self) -> None:
        shutil.rmtree(self.run_dir, ignore_errors=True)
        shutil.copytree(self.template, self.run_dir)

    def epoch(self, where: Path | None = None) -> list[list[bytes]]:
        where = where or self.run_dir
        loader = tierflow.open_loader(str(where / "l4"), tiers=self.tiers(where), batch_size=32, seq_len=128)
        try:
            return [batch_digest(b) for b in loader]
        finally:
            loader.close()

    def check(self, trial: Trial, persistent: bool) -> None:
        where = f"N={trial.n} ({trial.fault})"
        assert trial.error is None, f"{where}: a failed read of an L2 entry reached the reader: {trial.error!r}"
        assert trial.result == self.golden, f"{where}: not the golden batches"
        if persistent and trial.fault is not None:  # the entry was dropped, not served again
            key = Path(trial.fault.path).name.removesuffix(".arrow")
            assert any(p.name.startswith(key) for p in (self.run_dir / "l2" / "quarantine").iterdir()), where
        problems = tier_problems(self.run_dir / "l2", self.manifest, form=self.form)
        assert not problems, f"{where}: {problems}"


@pytest.fixture(scope="module", params=FORMS)
def rig(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ReadRig:
    return ReadRig(tmp_path_factory.mktemp(f"read-faults-{request.param}"), request.param)


@pytest.mark.slow
@pytest.mark.parametrize("persistent", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["once", "from-n-on"])
def test_an_l2_entry_that_cannot_be_read_during_an_epoch_is_dropped_and_read_from_below(
    rig: ReadRig, persistent: bool
) -> None:
    roots = [rig.run_dir / "l2" / "entries"]
    run = fail_each(
        rig.epoch,
        lambda t: rig.check(t, persistent),
        roots,
        ops=("read",),
        error=errno.EIO,
        persistent=persistent,
        reset=rig.reset,
    )
    assert len(run.trials) >= 1 + len(rig.manifest.shards)  # at least one read of each entry failed


def test_an_entry_unreadable_in_every_copy_is_a_typed_error_naming_shard_and_block(rig: ReadRig) -> None:
    """The L2's entries and the staging area both fail every read (the source does not): the copy
    fetched again from below fails too, and the reader gets ShardCorruptError, not an OSError."""
    from tierflow.errors import ShardCorruptError
    from tierflow.testing.faults import FailNth
    from tierflow.tiers.stack import staging_root

    rig.reset()
    with FailNth(1, [rig.run_dir / "l2" / "entries", staging_root()], ops=("read",), persistent=True) as faults:
        with pytest.raises(
            ShardCorruptError,
            match=r"shard shard-\w+\.arrow: block \d+ cannot be read from the copy "
            r"fetched again either",
        ) as e:
            rig.epoch()
    assert faults.fired is not None and isinstance(e.value.__cause__, OSError)
