"""Device feed on a GPU: copy rate against a bare pinned copy, training-loop wait, and checksums.

Skips cleanly without CUDA. Targets (issue 6): feed H2D >= 80% of a bare
`copy_(non_blocking=True)` of the same bytes from pinned memory; with 20 ms of
device compute per step the loop waits < 2% of step time; device checksums
equal CPU checksums over 500 steps. Run: .venv/bin/python benchmarks/device_feed.py
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch

from tierflow.loader.device_feed import DeviceFeed

WIDEN = {"input_ids": torch.int64, "labels": torch.int64}


def token_batch(rng: np.random.Generator, rows: int, length: int) -> dict:
    return {
        "input_ids": rng.integers(0, 2**16, (rows, length), dtype=np.uint16),
        "labels": rng.integers(0, 2**16, (rows, length), dtype=np.uint16),
        "loss_mask": rng.random((rows, length)) < 0.9,
        "rows": rows,
    }


def batch_bytes(batch: dict) -> int:
    return sum(v.nbytes for v in batch.values() if isinstance(v, np.ndarray))


def bare_copy_rate(nbytes: int, repeats: int) -> float:
    """Bytes/s of copy_(non_blocking=True) from one pinned buffer to one device buffer."""
    source = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        target.copy_(source, non_blocking=True)
        start.record(stream)
        for _ in range(repeats):
            target.copy_(source, non_blocking=True)
        end.record(stream)
    end.synchronize()
    return nbytes * repeats / (start.elapsed_time(end) / 1e3)


def feed_rate(batches: list[dict], depth: int) -> float:
    """Bytes/s the feed delivers with no compute: host staging, H2D and widening, end to end."""
    list(DeviceFeed(batches[: depth + 1], "cuda", depth=depth, widen=WIDEN))  # warm the allocators
    feed = DeviceFeed(batches, "cuda", depth=depth, widen=WIDEN)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in feed:
        pass
    torch.cuda.synchronize()
    return sum(batch_bytes(b) for b in batches) / (time.perf_counter() - started)


def sleep_cycles_per_ms() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / start.elapsed_time(end)


def wait_share(step_ms: float, steps: int, rows: int, length: int) -> tuple[float, float]:
    """Share of wall time the loop waited in next(), with step_ms of device compute and a sync per step.

    Steady state: the first batch (thread start, first pinned allocations) is left out.
    """
    rng = np.random.default_rng(1)
    batches = [token_batch(rng, rows, length) for _ in range(steps)]
    cycles = int(sleep_cycles_per_ms() * step_ms)
    feed = DeviceFeed(batches, "cuda", depth=2, widen=WIDEN)
    total = torch.zeros((), dtype=torch.int64, device="cuda")
    iterator = iter(feed)
    total += next(iterator)["input_ids"][:, :8].sum()
    torch.cuda.synchronize()
    first_wait = feed.stats().wait_s
    started = time.perf_counter()
    for batch in iterator:
        total += batch["input_ids"][:, :8].sum()
        torch.cuda._sleep(cycles)
        torch.cuda.current_stream().synchronize()  # as loss.item() would
    wall = time.perf_counter() - started
    return (feed.stats().wait_s - first_wait) / wall, wall / (steps - 1)


def checksums_match(steps: int, rows: int, length: int) -> tuple[bool, int]:
    """Device sums equal CPU sums; the loop runs ahead (sync every 16 steps) to stress buffer reuse."""
    rng = np.random.default_rng(2)
    batches = [token_batch(rng, rows, length) for _ in range(steps)]
    expected = [
        (int(b["input_ids"].astype(np.int64).sum()), int(b["labels"].astype(np.int64).sum()), int(b["loss_mask"].sum()))
        for b in batches
    ]
    short_sleep = int(sleep_cycles_per_ms() * 0.2)
    sums = []
    for step, batch in enumerate(DeviceFeed(batches, "cuda", depth=2, widen=WIDEN)):
        sums.append(torch.stack([batch["input_ids"].sum(), batch["labels"].sum(), batch["loss_mask"].sum()]))
        torch.cuda._sleep(short_sleep)
        sums.append(torch.stack([batch["input_ids"].sum(), batch["labels"].sum(), batch["loss_mask"].sum()]))
        del batch
        if step % 16 == 15:
            torch.cuda.synchronize()
    observed = torch.stack(sums).cpu().tolist()
    mismatches = sum(
        tuple(observed[2 * i]) != expected[i] or tuple(observed[2 * i + 1]) != expected[i] for i in range(steps)
    )
    return mismatches == 0, mismatches


def main() -> int:
    if not torch.cuda.is_available():
        print("device feed benchmark: skipped, CUDA is not available")
        return 0
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print()
    print(
        f"{'batch (rows x tokens)':<24}{'MiB':>8}{'bare GB/s':>11}{'feed GB/s':>11}{'ratio':>8}{'target':>8}{'met':>6}"
    )
    rng = np.random.default_rng(0)
    for rows, length, count in ((8, 8192, 200), (64, 8192, 100), (256, 8192, 40)):
        batches = [token_batch(rng, rows, length) for _ in range(count)]
        nbytes = batch_bytes(batches[0])
        bare = bare_copy_rate(nbytes, repeats=count)
        ours = feed_rate(batches, depth=2)
        ratio = ours / bare
        print(
            f"{f'{rows} x {length}':<24}{nbytes / 2**20:8.1f}{bare / 1e9:11.1f}{ours / 1e9:11.1f}{ratio:8.2f}{'0.80':>8}{'yes' if ratio >= 0.8 else 'NO':>6}"
        )
    print()
    share, step_s = wait_share(step_ms=20.0, steps=100, rows=64, length=8192)
    print(f"{'20 ms device step, 64 x 8192 tokens':<40}{'wait share':>12}{'target':>8}{'met':>6}")
    print(f"{f'measured step {step_s * 1e3:.1f} ms':<40}{share:12.3%}{'< 2%':>8}{'yes' if share < 0.02 else 'NO':>6}")
    print()
    ok, mismatches = checksums_match(steps=500, rows=16, length=4096)
    print(f"checksums over 500 steps (device vs CPU): {'equal' if ok else f'{mismatches} steps differ'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
