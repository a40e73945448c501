"""The node-wide bandwidth budget: one shared token bucket, priorities, fork and crash safety."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import signal
import threading
import time
import warnings
from pathlib import Path

import pytest

from tierflow.telemetry.metrics import MetricsRegistry
from tierflow.storage.budget import NODE_BANDWIDTH_ENV, BandwidthBudget, node_bandwidth, refilled


def test_an_unlimited_budget_never_waits_and_touches_no_file(tmp_path: Path) -> None:
    budget = BandwidthBudget(None, path=tmp_path / "budget")
    assert budget.acquire(10**12) == 0.0 and budget.acquire(10**12, "low") == 0.0
    assert not (tmp_path / "budget").exists()
    assert budget.acquired_bytes == {"high": 10**12, "low": 10**12}


def test_refill_adds_rate_times_elapsed_up_to_the_burst_and_repays_debt_first() -> None:
    assert refilled(0.0, 10.0, 10.5, rate=100.0, burst=1000.0) == 50.0
    assert refilled(900.0, 10.0, 12.0, rate=100.0, burst=1000.0) == 1000.0
    assert refilled(-300.0, 10.0, 11.0, rate=100.0, burst=1000.0) == -200.0
    assert refilled(500.0, 10.0, 9.0, rate=100.0, burst=1000.0) == 500.0


def test_processes_opening_one_path_share_one_bucket(tmp_path: Path) -> None:
    first = BandwidthBudget(1000.0, path=tmp_path / "budget", burst=100_000)
    second = BandwidthBudget(1000.0, path=tmp_path / "budget", burst=100_000)
    first.acquire(90_000)
    assert second.available() < 11_000


def test_high_priority_past_the_burst_waits_off_its_debt(tmp_path: Path) -> None:
    budget = BandwidthBudget(1_000_000.0, path=tmp_path / "budget", burst=100_000)
    waited = budget.acquire(150_000)
    assert 0.04 <= waited <= 0.051
    assert budget.waited_seconds["high"] == waited


def test_low_priority_never_takes_the_reserve(tmp_path: Path) -> None:
    budget = BandwidthBudget(1.0, path=tmp_path / "budget", burst=1000, reserve=0.5)
    assert budget.acquire(500, "low") == 0.0
    assert budget.available() < 501
    assert budget.acquire(500, "high") == 0.0  # the reserve was left for high priority


def test_low_priority_yields_to_high_priority(tmp_path: Path) -> None:
    budget = BandwidthBudget(10_000.0, path=tmp_path / "budget", burst=1000, reserve=0.5)
    finished: list[str] = []

    def move(priority: str) -> None:
        budget.acquire(3000, priority)  # type: ignore[arg-type]
        finished.append(priority)

    threads = [threading.Thread(target=move, args=(p,)) for p in ("low", "high")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert finished == ["high", "low"]
    assert budget.waited_seconds["low"] > 0


def test_a_corrupt_state_file_is_read_as_a_full_bucket(tmp_path: Path) -> None:
    path = tmp_path / "budget"
    path.write_bytes(b"garbage that is not a budget state!!!!!")
    budget = BandwidthBudget(1000.0, path=path, burst=5000)
    assert budget.available() == 5000


def test_rates_live_in_each_process_not_in_the_file(tmp_path: Path) -> None:
    first = BandwidthBudget(1000.0, path=tmp_path / "budget", burst=5000)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = BandwidthBudget(2000.0, path=tmp_path / "budget", burst=5000)
    assert (first.rate, second.rate) == (1000.0, 2000.0)


def _job(rate: float | None, nbytes: int, out: multiprocessing.Queue) -> None:
    budget = BandwidthBudget(rate)  # a job of its own: no path, its cap private to it
    started = time.monotonic()
    budget.acquire(nbytes)
    out.put((str(budget.path), time.monotonic() - started))


def test_a_jobs_own_cap_goes_with_it_and_never_throttles_the_next_job(tmp_path: Path, monkeypatch) -> None:
    from tierflow.tiers import build_stack

    monkeypatch.delenv(NODE_BANDWIDTH_ENV, raising=False)
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    job_a = context.Process(target=_job, args=(2e6, (1 << 20) + 400_000, out))  # its 1 MiB burst and 0.2 s more
    job_a.start()
    path, waited = out.get(timeout=60)
    job_a.join(timeout=30)
    assert job_a.exitcode == 0 and waited > 0.1  # A was held to its 2 MB/s
    assert not Path(path).exists()  # and left nothing behind
    job_b = BandwidthBudget()
    assert job_b.unlimited and job_b.acquire(10**10) == 0.0
    assert build_stack(str(tmp_path)).source.budget.rate is None  # B's stack: no cap it did not ask for
    job_c = BandwidthBudget(1e9)  # a job with its own cap has its own bucket, whatever A had
    assert job_c.path != Path(path) and job_c.acquire(10**8) == 0.0


def test_a_job_can_only_ask_for_less_than_the_node_budget(tmp_path: Path) -> None:
    greedy = BandwidthBudget(1e12, node_rate=1e6, node_path=tmp_path / "node")
    modest = BandwidthBudget(1e5, node_rate=1e9, node_path=tmp_path / "node")
    assert (greedy.rate, modest.rate) == (1e6, 1e5)
    waited = greedy.acquire((1 << 20) + 200_000)  # the node's bucket: 1 MiB deep, at 1 MB/s
    assert 0.15 <= waited <= 0.3


def test_the_node_budget_comes_from_the_operators_environment(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(NODE_BANDWIDTH_ENV, "2e6")
    assert node_bandwidth() == 2e6 and BandwidthBudget(node_path=tmp_path / "node").rate == 2e6
    monkeypatch.setenv(NODE_BANDWIDTH_ENV, "fast")
    with pytest.raises(ValueError, match=NODE_BANDWIDTH_ENV):
        BandwidthBudget(node_path=tmp_path / "node")
    monkeypatch.delenv(NODE_BANDWIDTH_ENV)
    assert node_bandwidth() is None and BandwidthBudget().unlimited


def test_waits_and_bytes_are_counted_in_the_registry(tmp_path: Path) -> None:
    registry = MetricsRegistry()
    budget = BandwidthBudget(1_000_000.0, path=tmp_path / "budget", burst=10_000, registry=registry)
    budget.acquire(30_000, "high")
    counters = {(c["name"], c["labels"]["priority"]): c["value"] for c in registry.snapshot()["counters"]}
    assert counters[("tierflow_budget_bytes_total", "high")] == 30_000
    assert counters[("tierflow_budget_wait_seconds_total", "high")] == pytest.approx(budget.waited_seconds["high"])


def test_bad_arguments_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="rate"):
        BandwidthBudget(0, path=tmp_path / "b")
    with pytest.raises(ValueError, match="reserve"):
        BandwidthBudget(10.0, path=tmp_path / "b", reserve=1.0)
    with pytest.raises(ValueError, match="priority"):
        BandwidthBudget(10.0, path=tmp_path / "b").acquire(1, "urgent")  # type: ignore[arg-type]


def _acquire_in_child(budget: BandwidthBudget, nbytes: int, done: multiprocessing.Queue) -> None:
    budget.acquire(nbytes)
    done.put(time.monotonic())


def test_a_forked_child_takes_the_lock_itself_and_waits_for_the_parent(tmp_path: Path) -> None:
    budget = BandwidthBudget(1e9, path=tmp_path / "budget", burst=10**9)
    budget.acquire(1)  # the parent's descriptor is open before the fork
    context = multiprocessing.get_context("fork")
    done = context.Queue()
    with budget._locked():
        child = context.Process(target=_acquire_in_child, args=(budget, 1, done))
        child.start()
        time.sleep(0.3)
        released_at = time.monotonic()
    finished_at = done.get(timeout=10)
    child.join(timeout=10)
    assert child.exitcode == 0 and finished_at >= released_at


def _hold_the_lock_forever(path: str, ready: multiprocessing.Event) -> None:
    fd = os.open(path, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    ready.set()
    time.sleep(60)


@pytest.mark.slow
def test_a_holder_killed_with_sigkill_does_not_block_the_others(tmp_path: Path) -> None:
    budget = BandwidthBudget(1e9, path=tmp_path / "budget", burst=10**9)
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    holder = context.Process(target=_hold_the_lock_forever, args=(str(budget.path), ready))
    holder.start()
    assert ready.wait(30)
    os.kill(holder.pid, signal.SIGKILL)
    holder.join(timeout=10)
    assert budget.acquire(1000) == 0.0


def _spend(
    path: str,
    rate: float | None,
    burst: int | None,
    total: int,
    chunk: int,
    out: multiprocessing.Queue,
    node_path: str | None = None,
) -> None:
    budget = BandwidthBudget(rate, path=path, burst=burst, node_path=node_path)
    start = time.monotonic()
    for _ in range(total // chunk):
        budget.acquire(chunk)
    out.put((start, time.monotonic()))


def _two_processes_spending(*args: object) -> float:
    """Seconds from the first start to the last finish of two spawned processes running `_spend(*args)`."""
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    processes = [context.Process(target=_spend, args=(*args[:5], out, *args[5:])) for _ in range(2)]
    for process in processes:
        process.start()
    spans = [out.get(timeout=60) for _ in processes]
    for process in processes:
        process.join(timeout=10)
    return max(end for _, end in spans) - min(start for start, _ in spans)


@pytest.mark.slow
def test_two_processes_sharing_a_budget_together_stay_within_its_rate(tmp_path: Path) -> None:
    rate, burst, each, chunk = 2_000_000.0, 200_000, 2_000_000, 50_000
    BandwidthBudget(rate, path=tmp_path / "budget", burst=burst)
    elapsed = _two_processes_spending(str(tmp_path / "budget"), rate, burst, each, chunk)
    floor = (2 * each - burst) / rate  # 1.9 s: what the bucket allows at best
    assert elapsed >= 0.9 * floor


@pytest.mark.slow
def test_two_live_jobs_share_the_node_budget(tmp_path: Path, monkeypatch) -> None:
    rate, each, chunk = 2_000_000.0, 2_000_000, 50_000
    monkeypatch.setenv(NODE_BANDWIDTH_ENV, str(rate))  # the operator's, in both jobs' environment
    elapsed = _two_processes_spending(None, None, None, each, chunk, str(tmp_path / "node"))
    floor = (2 * each - (1 << 20)) / rate  # 1.5 s: what one 1 MiB-deep bucket at the node's rate allows
    assert elapsed >= 0.9 * floor
