"""The memory headroom an L1 on tmpfs is held to half of (Tier.capacity) and the working set is sized
by: the cgroup v2 limit less usage, else MemAvailable. The kernel's files are replaced by files
written here in the same formats, so each case is exact whatever machine runs it."""

from __future__ import annotations

from pathlib import Path

from tierflow.tiers.config import parse_size
from tierflow.tiers.capacity import memory_headroom

MEMINFO = "MemTotal:       16000000 kB\nMemFree:         1000000 kB\nMemAvailable:    2000000 kB\n"


def kernel_files(tmp_path: Path, limit: str | None, current: str = "1000", meminfo: str = MEMINFO) -> tuple[Path, Path]:
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir(parents=True)
    if limit is not None:
        (cgroup / "memory.max").write_text(limit + "\n")
        (cgroup / "memory.current").write_text(current + "\n")
    (tmp_path / "meminfo").write_text(meminfo)
    return cgroup, tmp_path / "meminfo"


def test_a_cgroup_limit_gives_the_headroom_left_under_it(tmp_path: Path) -> None:
    assert memory_headroom(*kernel_files(tmp_path, "5000", "1000")) == 4000


def test_a_cgroup_over_its_limit_has_no_headroom_not_a_negative_one(tmp_path: Path) -> None:
    assert memory_headroom(*kernel_files(tmp_path, "5000", "7000")) == 0


def test_without_a_cgroup_limit_the_headroom_is_memavailable(tmp_path: Path) -> None:
    assert memory_headroom(*kernel_files(tmp_path, "max")) == 2000000 * 1024
    assert memory_headroom(*kernel_files(tmp_path / "v1", None)) == 2000000 * 1024  # no cgroup v2 files


def test_a_headroom_nothing_states_is_unknown(tmp_path: Path) -> None:
    assert memory_headroom(*kernel_files(tmp_path, "max", meminfo="MemTotal: 16000000 kB\n")) is None
    assert memory_headroom(tmp_path / "none", tmp_path / "none") is None


def test_a_size_given_as_a_number_is_bytes() -> None:
    assert parse_size(4096) == 4096 and parse_size(1.5e9) == 1_500_000_000 and parse_size("1.5e9") == 1_500_000_000
