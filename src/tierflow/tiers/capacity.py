"""How many bytes a tier may hold: configured bytes or a share of its disk, and what RAM allows.

Why apart: an L1 on tmpfs is memory, so its usable room changes with what the job allocates; the
tier asks these at every space decision, the tier stack asks `memory_headroom` for its staging area.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Capacity:
    """Bytes, or a fraction of (free space + the tier's own usage) at start."""

    value: float

    def resolve(self, root: Path, own_usage: int) -> int:
        if self.value > 1:
            return int(self.value)
        usage = shutil.disk_usage(root)
        return int(self.value * (usage.free + own_usage))


def memory_headroom(cgroup: Path = Path("/sys/fs/cgroup"), meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """Bytes the job may still allocate: cgroup v2 limit minus usage, else MemAvailable (None: neither
    is known). The paths are the kernel's; a test hands its own files."""
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        current = int((cgroup / "memory.current").read_text())
        if limit != "max":
            return max(0, int(limit) - current)
    except (OSError, ValueError):
        pass
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def is_tmpfs(path: Path) -> bool:
    """Whether `path` lives on tmpfs (memory): the longest mount point of /proc/mounts above it."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return False
    best, fstype = "", ""
    resolved = str(path.resolve())
    for line in mounts:
        parts = line.split()
        if len(parts) >= 3 and (resolved == parts[1] or resolved.startswith(parts[1].rstrip("/") + "/")):
            if len(parts[1]) > len(best):
                best, fstype = parts[1], parts[2]
    return fstype == "tmpfs"
