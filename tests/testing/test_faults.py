"""tierflow.testing.faults: the N-th operation under the roots fails, nothing else is touched."""

from __future__ import annotations

import errno
import io
import os
import shutil
from pathlib import Path

import pytest

from tierflow.testing.faults import FailNth, boundaries, count_ops, error_chain, fail_each


def _work(root: Path) -> None:
    (root / "d").mkdir()
    with open(root / "d" / "a", "w") as f:
        f.write("x")
        f.flush()
        os.fsync(f.fileno())
    os.replace(root / "d" / "a", root / "d" / "b")
    assert (root / "d" / "b").read_text() == "x"


def test_counts_each_family_under_the_roots_only(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    inside = tmp_path / "in"
    inside.mkdir()
    faults = count_ops(lambda: (_work(inside), _work(outside)), [inside])
    assert [op for op, _ in faults.log] == ["mkdir", "open_write", "write", "fsync", "rename", "read"]
    assert all(path.startswith(str(inside.resolve())) for _, path in faults.log)
    assert open is io.open and os.write.__module__ == "posix"  # everything restored


@pytest.mark.parametrize("n", range(1, 7))
def test_the_nth_operation_fails_with_the_errno_and_path(tmp_path: Path, n: int) -> None:
    with FailNth(n, [tmp_path], error=errno.ENOSPC) as faults, pytest.raises(OSError) as raised:
        _work(tmp_path)
    assert raised.value.errno == errno.ENOSPC and faults.fired is not None and faults.fired.n == n
    assert raised.value.filename == faults.fired.path


def test_fail_each_stops_at_the_first_complete_run(tmp_path: Path) -> None:
    seen = []
    run = fail_each(
        lambda: _work(tmp_path),
        seen.append,
        [tmp_path],
        reset=lambda: shutil.rmtree(tmp_path / "d", ignore_errors=True),
    )
    assert [t.n for t in run.trials] == list(range(1, 8)) and run.operations == 6
    assert [t.outcome for t in seen] == ["OSError"] * 6 + ["ok"]
    assert run.by_op() == {"mkdir": 1, "open_write": 1, "write": 1, "fsync": 1, "rename": 1, "read": 1}


def test_persistent_faults_fail_every_later_operation(tmp_path: Path) -> None:
    with FailNth(2, [tmp_path], persistent=True) as faults:
        (tmp_path / "d").mkdir()
        for _ in range(3):
            with pytest.raises(OSError):
                (tmp_path / "d" / "f").write_bytes(b"1")
    assert faults.failures == 3 and faults.fired.op == "open_write"


def test_error_chain_walks_causes() -> None:
    try:
        try:
            raise OSError(errno.EIO, "inner")
        except OSError as e:
            raise ValueError("outer") from e
    except ValueError as outer:
        assert [type(e) for e in error_chain(outer)] == [ValueError, OSError]


def test_boundaries_keep_the_first_and_last_of_each_run(tmp_path: Path) -> None:
    def work() -> None:
        with open(tmp_path / "m", "w") as f:
            for _ in range(50):
                f.write("x")
        os.replace(tmp_path / "m", tmp_path / "n")

    faults = count_ops(work, [tmp_path])
    assert boundaries(faults) == [1, 2, 51, 52]
    run = fail_each(work, lambda t: None, [tmp_path], points=boundaries(faults))
    assert [t.n for t in run.trials] == [1, 2, 51, 52, 0] and run.trials[-1].fault is None


def test_distinct_boundaries_try_each_kind_of_point_once(tmp_path: Path) -> None:
    def work() -> None:
        for key in ("0123456789abcdef0123456789abcdef", "fedcba9876543210fedcba9876543210"):
            with open(tmp_path / f"{key}.1234.tmp", "w") as f:
                f.write("x")
                f.write("y")
            os.replace(tmp_path / f"{key}.1234.tmp", tmp_path / f"{key}.arrow")

    faults = count_ops(work, [tmp_path])
    assert boundaries(faults) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert boundaries(faults, distinct=True) == [1, 2, 3, 4]
