"""The node's staging area (tiers/_staging.py): named alike by each of a job's ranks on a node, removed
by its last user, swept after a kill; the ranks' steps beside it count only live processes. The
stack reading through it is tested with the tiers (test_tiers.py), the plan's lead with the plan."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tierflow.tiers._staging import Membership, NodeProgress, area_path, sweep_unused


def test_the_area_is_named_alike_by_each_rank_and_apart_for_each_tier_and_job(tmp_path):
    top = tmp_path / "nvme-0" / "tf"
    same = area_path(top, "job/a", root=tmp_path / "shm")
    assert same == area_path(tmp_path / "nvme-0" / ".." / "nvme-0" / "tf", "job/a", root=tmp_path / "shm")
    assert same != area_path(tmp_path / "nvme-1" / "tf", "job/a", root=tmp_path / "shm")
    assert same != area_path(top, "job/b", root=tmp_path / "shm")


JOIN = """
import sys, time
from pathlib import Path
from tierflow.tiers._staging import Membership
Membership(Path(sys.argv[1]))
print("joined", flush=True)
time.sleep(float(sys.argv[2]))
"""


def _join(area: Path, seconds: float) -> subprocess.Popen:
    p = subprocess.Popen(
        [sys.executable, "-c", JOIN, str(area), str(seconds)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert p.stdout.readline().strip() == "joined"
    return p


@pytest.mark.slow
def test_the_last_user_removes_the_area_and_a_killed_users_area_is_swept(tmp_path):
    root = tmp_path / "shm"
    area = area_path(tmp_path / "l2", "job", root=root)
    mine = Membership(area)
    other = _join(area, 0.2)
    (area / "entry").write_bytes(b"x")
    mine.leave()
    assert area.is_dir()  # another process uses it still
    assert other.wait(30) == 0
    assert not area.exists() and not list(root.glob("*.users"))  # it left last, and removed it
    killed = _join(area, 60)
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait(30)
    assert area.is_dir()  # its exit hook never ran
    sweep_unused(root)
    assert not area.exists() and not list(root.glob("*.users"))
    mine, alive = Membership(area), _join(area, 60)
    try:
        sweep_unused(root)
        assert area.is_dir()  # in use: never swept
    finally:
        alive.kill()
        alive.wait(30)
        mine.leave()
    assert not area.exists() and not list(root.glob("*.users"))


def test_the_ranks_steps_count_only_live_processes(tmp_path):
    area = tmp_path / "area"
    area.mkdir()
    progress = NodeProgress(area, ranks=3)
    assert progress.steps() == {} and progress.lag() == (None, None)
    progress.publish(0, 7)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.pwrite(progress.fd, NodeProgress.SLOT.pack(child.pid, 3), NodeProgress.SLOT.size)  # rank 1, behind
        assert progress.steps() == {0: (os.getpid(), 7), 1: (child.pid, 3)}
        assert progress.lag() == (7, 3)
    finally:
        child.kill()
        child.wait(30)
    assert progress.lag() == (7, None)  # a dead rank holds nobody back
    progress.leave(0)
    assert progress.steps() == {}
    progress.publish(3, 9)  # a rank the area was not made for (LOCAL_WORLD_SIZE grew): no slot, not another's
    progress.leave(3)
    assert progress.steps() == {} and os.fstat(progress.fd).st_size <= 3 * NodeProgress.SLOT.size


CHURN = """
import sys
from pathlib import Path
from tierflow.tiers._staging import Membership, sweep_unused
area = Path(sys.argv[1])
for _ in range(40):
    m = Membership(area)
    assert area.is_dir()
    (area / f"x{m.owner}").write_bytes(b"x")  # a use of the area: never removed under a member
    m.leave()
    sweep_unused(area.parent)
"""


@pytest.mark.slow
def test_members_joining_leaving_and_sweeping_at_once_never_lose_the_area_under_a_member(tmp_path):
    area = area_path(tmp_path / "l2", "job", root=tmp_path / "shm")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    churn = [
        subprocess.Popen([sys.executable, "-c", CHURN, str(area)], env=env, stderr=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    assert all(p.wait(120) == 0 for p in churn), [p.stderr.read() for p in churn]
    assert not area.exists() and not list(area.parent.glob("*.users"))  # the last one out removed both
