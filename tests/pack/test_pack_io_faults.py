"""`tierflow.pack` with its N-th I/O operation failed (tierflow.testing.faults).

A corpus of ~600 KB of JSONL packs (byte tokens, 256 KB shards, one worker: the pack runs in
this process, its shard writer threads included) into a fresh directory, or over a finished
dataset of another corpus with overwrite=True. With the N-th read, write, fsync, rename,
open-for-write or mkdir under the run's directory failing, after every N: the error, if any,
is typed (a TierflowError, or the injected OSError itself naming its file); what
`open_dataset` sees is nothing (fresh) or the previous dataset, whole, or the new one, whole
(`verify`'s checks pass and every sample's hash is the golden one); and the same pack without
faults then succeeds with the golden samples.

The quick set tries one failure point of each kind (`sample_points`: the first and the last
operation on each kind of file) with EIO; the slow set the same with ENOSPC, and from N on;
TIERFLOW_FAULT_POINTS=boundaries or =every tries more (every N: ~830 trials a variant).
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import pytest

import tierflow
from tierflow.errors import ManifestError, TierflowError
from tierflow.format.manifest import Manifest
from tierflow.testing.faults import Trial, fail_each, sample_points, verified_golden as golden, write_corpus


def pack(corpus: Path, out: Path, overwrite: bool = False) -> tierflow.Manifest:
    return tierflow.pack(
        [corpus], out, tokenizer="bytes", target_shard_bytes=256 << 10, workers=1, overwrite=overwrite
    ).manifest


def acceptable(error: BaseException, injected: int) -> bool:
    return isinstance(error, TierflowError) or (
        isinstance(error, OSError) and error.errno == injected and error.filename is not None
    )


class PackRig:
    def __init__(self, root: Path, overwrite: bool) -> None:
        self.root = root
        self.overwrite = overwrite
        self.corpus = write_corpus(root / "new.jsonl", 900, seed=1)
        self.old_corpus = write_corpus(root / "old.jsonl", 500, seed=2)
        self.template = root / "template"
        self.template.mkdir()
        self.run_dir = root / "run"
        if overwrite:
            pack(self.old_corpus, self.template / "ds")
            self.old = golden(self.template / "ds")
        pack(self.corpus, root / "reference")
        self.new = golden(root / "reference")
        assert len(Manifest.load(root / "reference").shards) >= 3

    @property
    def roots(self) -> list[Path]:
        """Where faults are injected: the run's directory and the input file."""
        return [self.run_dir, self.corpus]

    @property
    def out(self) -> Path:
        return self.run_dir / "ds"

    def reset(self) -> None:
        shutil.rmtree(self.run_dir, ignore_errors=True)
        shutil.copytree(self.template, self.run_dir)

    def run(self) -> None:
        pack(self.corpus, self.out, overwrite=self.overwrite)

    def visible(self) -> tuple[str, list[str]] | None:
        try:
            Manifest.load(self.out)
        except ManifestError:
            return None
        return golden(self.out)

    def check(self, trial: Trial, injected: int) -> None:
        where = f"N={trial.n} ({trial.fault})"
        if trial.error is not None:
            assert acceptable(trial.error, injected), f"{where}: untyped {trial.error!r}"
        seen = self.visible()
        if trial.error is None:
            assert seen == self.new, f"{where}: the pack returned but the dataset is not the new one"
        else:
            allowed = [self.new, self.old] if self.overwrite else [self.new, None]
            assert seen in allowed, f"{where}: a partial or wrong dataset is visible"
        # the same pack again, without faults
        if seen != self.new or not self.overwrite:
            pack(self.corpus, self.out, overwrite=self.overwrite or seen is not None)
        assert golden(self.out) == self.new, f"{where}: the rerun did not produce the golden samples"


@pytest.fixture(scope="module")
def rigs(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, PackRig]:
    return {
        overwrite: PackRig(tmp_path_factory.mktemp(f"pack-faults-{overwrite}"), overwrite)
        for overwrite in (False, True)
    }


def _points(rig: PackRig) -> list[int] | None:
    return sample_points(rig.run, rig.roots, reset=rig.reset)


@pytest.mark.slow
@pytest.mark.parametrize("overwrite", [False, True], ids=["fresh", "over-a-dataset"])
def test_a_pack_failing_at_each_kind_of_io_leaves_nothing_or_a_whole_dataset(rigs, overwrite: bool) -> None:
    rig = rigs[overwrite]
    run = fail_each(rig.run, lambda t: rig.check(t, errno.EIO), rig.roots, reset=rig.reset, points=_points(rig))
    assert set(run.by_op()) == {"mkdir", "open_write", "write", "fsync", "rename", "read"}


# EIO once is the quick test above
VARIANTS = [(errno.EIO, True), (errno.ENOSPC, False), (errno.ENOSPC, True)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "injected,persistent", VARIANTS, ids=[f"{errno.errorcode[e]}-{'from-n-on' if p else 'once'}" for e, p in VARIANTS]
)
@pytest.mark.parametrize("overwrite", [False, True], ids=["fresh", "over-a-dataset"])
def test_a_pack_failing_at_every_io_leaves_nothing_or_a_whole_dataset(
    rigs, overwrite: bool, injected: int, persistent: bool
) -> None:
    rig = rigs[overwrite]
    run = fail_each(
        rig.run,
        lambda t: rig.check(t, injected),
        rig.roots,
        error=injected,
        persistent=persistent,
        reset=rig.reset,
        points=_points(rig),
    )
    assert len(run.trials) > 10
