"""Cache fills with their N-th I/O operation failed (tierflow.testing.faults).

A dataset of 3 shards sits in a local directory (the L4); an L2 (at rest) and an L1 (decoded)
are filled from it by the two paths a user takes: `tierflow cache warm` (`TierStack.warm`) and
one epoch of `open_loader(..., tiers=...)` (num_workers=0, so the stager's threads and the
reader run in this process). With the N-th read, write, fsync, rename, open-for-write or mkdir
under the run's directory (source and tiers) failing, after every N:
- the error, if any, is typed (a TierflowError, or the injected OSError itself, naming a file);
- a fault in a tier's own files never fails the read: tiers are optional, what they cannot
  store is served from below (as tier.py promises for a full disk);
- an epoch that completed yielded the golden batches;
- no tier shows a partial entry: every indexed entry, and every file under entries/, is whole
  (its size and xxh3-128 are the manifest's for the tier's form);
- the same fill without faults then succeeds, with the golden batches, and leaves every shard
  cached (in the L1 or the L2).

The quick set tries one failure point of each kind (`sample_points`) with EIO, once, anywhere;
the slow set ENOSPC, and faults from N on under the tiers only (a cache device dying or
filling) or the source only; TIERFLOW_FAULT_POINTS=boundaries or =every tries more N.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path
from typing import Any

import pytest

import tierflow
from tierflow.errors import TierflowError
from tierflow.format._checksum import file_xxh3_128
from tierflow.format.manifest import Manifest
from tierflow.storage.remote import RetryPolicy
from tierflow.testing.faults import FailNth, Trial, fail_each, sample_points, write_corpus
from tierflow.tiers import Tier, build_stack


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """The source's retries without their sleeps (a persistent fault retries every read)."""
    monkeypatch.setattr(RetryPolicy, "delay", lambda self, attempt, rng=None: 0.0)


def batch_digest(batch: dict[str, Any]) -> list[bytes]:
    return [v.numpy().tobytes() if hasattr(v, "numpy") else repr(v).encode() for _, v in sorted(batch.items())]


class FillRig:
    """`template/l4`: the packed dataset; each trial copies it to `run/` and fills `run/l2`, `run/l1`."""

    TIERS = ["L1={run}/l1:64MB:lru:decoded", "L2={run}/l2:64MB:lru:at_rest"]

    def __init__(self, root: Path) -> None:
        self.root = root
        raw = write_corpus(root / "docs.jsonl", docs=700, seed=5)
        self.template = root / "template"
        tierflow.pack([raw], self.template / "l4", tokenizer="bytes", target_shard_bytes=256 << 10, workers=1)
        self.manifest = Manifest.load(self.template / "l4")
        assert len(self.manifest.shards) >= 3
        self.run_dir = root / "run"
        self.reset()
        self.golden = self.epoch()

    @property
    def tiers(self) -> list[str]:
        return [t.format(run=self.run_dir) for t in self.TIERS]

    def reset(self) -> None:
        shutil.rmtree(self.run_dir, ignore_errors=True)
        shutil.copytree(self.template, self.run_dir)

    def _built(self) -> None:
        """Setup is over: a fault from here on is a fault during the fill."""
        faults = FailNth.current()
        self.setup_ops = faults.calls if faults is not None else 0

    def epoch(self) -> list[list[bytes]]:
        self.setup_ops = 1 << 62
        loader = tierflow.open_loader(str(self.run_dir / "l4"), tiers=self.tiers, batch_size=32, seq_len=128)
        self._built()
        try:
            return [batch_digest(b) for b in loader]
        finally:
            loader.close()

    def warm(self) -> tuple[int, int]:
        self.setup_ops = 1 << 62
        stack = build_stack(str(self.run_dir / "l4"), self.tiers)
        self._built()
        return stack.warm()

    def in_tier(self, trial: Trial) -> bool:
        """The fault hit a tier's files once the tiers were open (a tier that cannot be opened,
        say its directory cannot be made, is an error at open_loader / build_stack)."""
        return (
            trial.fault is not None
            and trial.fault.n > self.setup_ops
            and not trial.fault.path.startswith(str((self.run_dir / "l4").resolve()))
        )

    def check_tiers(self, where: str) -> None:
        """Every entry a tier shows (indexed, or a file under entries/) is whole."""
        for spec in self.tiers:
            name, _, rest = spec.partition("=")
            root = Path(rest.split(":")[0])
            if not root.exists():
                continue
            tier = Tier(root, 64 << 20, name=name)
            form = tier.form
            expected = {s.key: (s.bytes_in(form), s.checksum_in(form)) for s in self.manifest.shards}
            for row in tier.index.entries():
                assert row.key in expected, f"{where}: {name} indexes an unknown entry {row.key}"
                assert (row.size, row.checksum) == expected[row.key], f"{where}: {name} indexes {row.key} wrongly"
                assert tier.path_of(row.key).is_file(), f"{where}: {name} indexes {row.key}, whose file is gone"
            for path in (root / "entries").iterdir():
                key = path.name.removesuffix(".arrow")
                size, checksum = expected[key]
                assert path.stat().st_size == size and file_xxh3_128(path) == checksum, (
                    f"{where}: {name} holds a partial or wrong entry {path.name}"
                )

    def check(self, trial: Trial, injected: int, epoch: bool) -> None:
        where = f"N={trial.n} ({trial.fault})"
        if trial.error is not None:
            ok = isinstance(trial.error, TierflowError) or (
                isinstance(trial.error, OSError) and trial.error.errno == injected
            )
            assert ok, f"{where}: untyped {trial.error!r}"
            assert not self.in_tier(trial), f"{where}: a fault in a tier failed the read: {trial.error!r}"
        elif epoch:
            assert trial.result == self.golden, f"{where}: the epoch's batches are not the golden ones"
        self.check_tiers(where)
        # the same fill without faults
        assert self.epoch() == self.golden, f"{where}: the rerun's batches are not the golden ones"
        self.check_tiers(f"{where}, after the rerun")
        cached = set()
        for spec in self.tiers:
            name, _, rest = spec.partition("=")
            cached |= {r.key for r in Tier(Path(rest.split(":")[0]), 64 << 20, name=name).index.entries()}
        assert cached == {s.key for s in self.manifest.shards}, f"{where}: the rerun did not cache every shard"


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> FillRig:
    return FillRig(tmp_path_factory.mktemp("fill-faults"))


PATHS = {"cache-warm": False, "loader-epoch": True}


def _run(rig: FillRig, path: str):
    return rig.epoch if PATHS[path] else rig.warm


def _roots(rig: FillRig, where: str) -> list[Path]:
    """Where the faults go: the whole run (source and tiers), only the tiers' directories (a
    cache device failing or filling), or only the source."""
    return {"all": [rig.run_dir], "tiers": [rig.run_dir / "l1", rig.run_dir / "l2"], "source": [rig.run_dir / "l4"]}[
        where
    ]


@pytest.mark.slow
@pytest.mark.parametrize("path", ["cache-warm", pytest.param("loader-epoch", marks=pytest.mark.slow)])
def test_a_fill_failing_at_each_kind_of_io_serves_the_golden_batches_or_a_typed_error(rig: FillRig, path: str) -> None:
    run = _run(rig, path)
    points = sample_points(run, [rig.run_dir], reset=rig.reset)
    done = fail_each(run, lambda t: rig.check(t, errno.EIO, PATHS[path]), [rig.run_dir], reset=rig.reset, points=points)
    assert len(done.by_op()) >= 4  # threads move the N-th operation between runs: not always the same kinds


# once: one operation fails; from N on: every later one does (under `where` only); once with EIO
# under all is the quick test above
VARIANTS = [
    ("once", errno.ENOSPC, "all"),
    ("from-n-on", errno.EIO, "tiers"),
    ("from-n-on", errno.ENOSPC, "tiers"),
    ("from-n-on", errno.EIO, "source"),
]


@pytest.mark.slow
@pytest.mark.parametrize("mode,injected,where", VARIANTS, ids=[f"{m}-{errno.errorcode[e]}-{w}" for m, e, w in VARIANTS])
@pytest.mark.parametrize("path", list(PATHS))
def test_a_fill_failing_at_every_io_serves_the_golden_batches_or_a_typed_error(
    rig: FillRig, path: str, mode: str, injected: int, where: str
) -> None:
    run, roots = _run(rig, path), _roots(rig, where)
    points = sample_points(run, roots, reset=rig.reset)
    done = fail_each(
        run,
        lambda t: rig.check(t, injected, PATHS[path]),
        roots,
        error=injected,
        persistent=mode == "from-n-on",
        reset=rig.reset,
        points=points,
    )
    assert len(done.trials) >= 3
