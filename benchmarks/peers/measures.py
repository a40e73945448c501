"""The measurements, each run in a fresh child process (`run.py --child NAME`), one system at a time.

The parent (run.py) starts the child, samples the summed PSS of the child's process tree
(psutil `memory_full_info().pss`, DataLoader workers included) and the bytes under the child's
local cache directory while it runs, and reads one JSON result line from its stdout.

- convert: the system's own writer over the corpus (token variant, then documents), timed.
- warm: local data already in each system's local form (tierflow: a warmed decoded L2; Streaming:
  every shard prepared, i.e. decompressed, in its local dir; LitData: its uncompressed chunks
  read in place), shuffle on; steps/s after the first batch with and without a simulated step,
  in the main process and with 2 DataLoader workers (each system's own loader).
- cold: one epoch from the moto S3 server behind the throttled proxy into an empty local cache
  (each system's default cache size), 2 workers; time to the first batch, epoch seconds, bytes.
- epochs: 3 epochs from S3 with the local cache capped at 30% of the dataset's cached form;
  bytes each epoch as counted at the proxy, and the optimum for this system's own shard order
  where it is known (Belady's MIN with bypass, `tierflow.policies.simulator.optimum`).
- raw: the raw path: one epoch of local data at the system's defaults (tierflow's open_loader on
  the packed dir, no tiers; the peers' own datasets and loaders; the in-RAM list as the bound),
  tokens or text, main process or 2 DataLoader workers, no step: samples/s after the first batch.
- state / resume: the state each system's loader saves at 50% of the first epoch of an 8-byte
  sample dataset, then, in a new process, the time from constructing the loader with that state
  to its first batch (imports timed apart).
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

from _harness import tree_cpu_s
from systems import SYSTEMS


def proxy_bytes(control: str | None, key: str) -> int:
    """GET response bytes the proxy sent for paths containing `key` (the ProxyProcess control API)."""
    if not control:
        return 0
    from tierflow.testing.proxy import PathTraffic

    with urllib.request.urlopen(f"{control}/traffic", timeout=30) as response:
        state = json.loads(response.read())
    total = 0
    for method, path, *counts in state["totals"]:
        if method == "GET" and key in path:
            total += PathTraffic(*counts).response_bytes
    return total


def convert(system: str, variant: str, corpus: str, out: str, shard_bytes: int) -> dict[str, Any]:
    from corpus import MANIFEST

    meta = json.loads((Path(corpus) / MANIFEST).read_text())
    files = [Path(corpus) / "docs" / name for name in meta["files"]]
    impl = SYSTEMS[system]
    began = time.perf_counter()
    getattr(impl, f"convert_{variant}")(files, Path(out), shard_bytes)
    return {"seconds": time.perf_counter() - began}


def _loop(batches, steps: int, step_s: float) -> tuple[float, float]:
    """(steps/s after the first batch, seconds to the first batch): tierflow.commands.bench's
    steps_per_second, kept apart so a peer's process never imports tierflow."""
    began = time.perf_counter()
    iterator = iter(batches)
    next(iterator)
    first = time.perf_counter() - began
    start = time.perf_counter()
    done = 0
    for _ in iterator:
        if step_s:
            time.sleep(step_s)
        done += 1
        if done == steps:
            break
    return done / (time.perf_counter() - start), first


def warm(system: str, data: str, cache: str, plan: list[list[float]], seed: int) -> dict[str, Any]:
    """plan: [workers, step_ms, steps] rows, run in order in this process."""
    impl = SYSTEMS[system]
    results = {}
    warmed = False
    for workers, step_ms, steps in plan:
        reader = impl.reader(data, Path(cache), workers=int(workers), seed=seed, stager=False)
        if not warmed:
            reader.warm()
            warmed = True
        rate, first = _loop(_endless(reader), int(steps), step_ms / 1e3)
        reader.close()
        results[f"w{int(workers)}_s{step_ms:g}"] = {"steps_per_s": rate, "first_s": first}
    return results


def _endless(reader):
    while True:
        yield from reader.epoch()


def cold(
    system: str, url: str, endpoint: str, control: str, cache: str, workers: int, seed: int, key: str
) -> dict[str, Any]:
    impl = SYSTEMS[system]
    before = proxy_bytes(control, key)
    began = time.perf_counter()
    reader = impl.reader(url, Path(cache), workers=workers, seed=seed, endpoint=endpoint)
    first = None
    batches = 0
    for _ in reader.epoch():
        if first is None:
            first = time.perf_counter() - began
        batches += 1
    seconds = time.perf_counter() - began
    reader.close()
    return {"first_s": first, "epoch_s": seconds, "batches": batches, "bytes": proxy_bytes(control, key) - before}


def epochs(
    system: str,
    url: str,
    endpoint: str,
    control: str,
    cache: str,
    workers: int,
    seed: int,
    key: str,
    cache_limit: int,
    count: int,
    stop_bytes: int,
    stop_seconds: float,
    extrapolate_crash: bool = True,
) -> dict[str, Any]:
    """`stop_bytes`, `stop_seconds`: give up once an epoch has fetched this much or run this long (a
    thrashing cache would take hours); that epoch's figure is then extrapolated from the fraction of
    it done, and flagged."""
    impl = SYSTEMS[system]
    reader = impl.reader(url, Path(cache), workers=workers, seed=seed, endpoint=endpoint, cache_limit=cache_limit)
    per_epoch: list[float] = []
    stopped = None
    mark = proxy_bytes(control, key)
    began = time.perf_counter()
    total = reader.epoch_samples() // reader.batch
    crashed = None
    for epoch in range(count):
        done = 0
        epoch_began = time.perf_counter()
        try:
            for done, _ in enumerate(reader.epoch(), 1):
                if done % 5 == 0 and (
                    proxy_bytes(control, key) - mark > stop_bytes or time.perf_counter() - epoch_began > stop_seconds
                ):
                    break
        except Exception as e:
            crashed = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:120]}"
        now = proxy_bytes(control, key)
        if done < total:
            stopped = {"epoch": epoch, "fraction": done / total, "bytes": now - mark, "crashed": crashed}
            if crashed is None or extrapolate_crash:
                per_epoch.append((now - mark) * total / max(done, 1))
            break
        per_epoch.append(now - mark)
        mark = now
    seconds = time.perf_counter() - began
    uses = reader.shard_uses(count)
    if stopped is None:
        reader.close()  # a stopped peer may hang joining its download threads; the process exits anyway
    optimum = None
    if uses:
        from tierflow.policies.simulator import optimum as belady
        from tierflow.policies.traces import from_records

        records = [(k, size, float(i), float(i)) for i, (k, size) in enumerate(uses)]
        best = belady(from_records(records, name=f"{system} shard uses"), cache_limit)
        optimum = best.byte_miss_ratio  # of the bytes used, in the cached (decoded) form
        used = sum(size for _, size in uses)
        per_epoch_used = used / count
        optimum = {"byte_miss_ratio": best.byte_miss_ratio, "used_per_epoch": per_epoch_used}
    return {"per_epoch": per_epoch, "seconds": seconds, "optimum": optimum, "stopped": stopped}


def raw(system: str, kind: str, data: str, workers: int, seed: int, hold_s: float = 0.6) -> dict[str, Any]:
    """One epoch of `kind` batches through the system's raw path; samples/s after the first batch
    (start-up, worker spawn and the first batch timed apart). The loader is held open `hold_s`
    after the epoch, so the parent's PSS sampler (every 0.25 s) sees it at its fullest."""
    impl = SYSTEMS[system]
    impl.preload()
    began = time.perf_counter()
    loader = impl.raw_loader(data, kind, int(workers), seed)
    opened = time.perf_counter() - began
    iterator = iter(loader)
    first_batch = next(iterator)
    first = time.perf_counter() - began
    first_samples = impl.raw_count(first_batch)
    samples = batches = 0
    start, cpu, cpu_all = time.perf_counter(), time.process_time(), tree_cpu_s()
    for batch in iterator:
        samples += impl.raw_count(batch)
        batches += 1
    seconds = time.perf_counter() - start
    cpu = time.process_time() - cpu  # this process's threads only (the whole reader in the main-process rows)
    cpu_all = tree_cpu_s() - cpu_all  # with its workers, living or joined
    time.sleep(hold_s)
    return {
        "samples_per_s": samples / seconds if seconds > 0 else 0.0,
        "samples": samples + first_samples,
        "batches": batches + 1,
        "seconds": seconds,
        "cpu_s": cpu,
        "cpu_all_s": cpu_all,
        "first_s": first,
        "open_s": opened,
        "batch_type": type(first_batch).__name__,
    }


def state(system: str, data: str, cache: str, fraction: float, out: str) -> dict[str, Any]:
    reader = SYSTEMS[system].reader(data, Path(cache), kind="ints", workers=0, seed=17, stager=False)
    samples = int(reader.epoch_samples() * fraction)
    samples -= samples % reader.batch
    saved = reader.state_at(samples)
    reader.close()
    Path(out).write_text(json.dumps(saved))
    return {"samples": samples}


def resume(system: str, data: str, cache: str, state_file: str, imported_at: float) -> dict[str, Any]:
    SYSTEMS[system].preload()
    saved = json.loads(Path(state_file).read_text())
    began = time.perf_counter()
    reader = SYSTEMS[system].reader(data, Path(cache), kind="ints", workers=0, seed=17, resume=saved, stager=False)
    batch = next(iter(reader.epoch()))
    first = time.perf_counter() - began
    reader.close()
    return {"first_s": first, "import_s": began - imported_at, "batch_type": type(batch).__name__}


def convert_ints(system: str, samples: int, out: str, shard_bytes: int) -> dict[str, Any]:
    began = time.perf_counter()
    SYSTEMS[system].convert_ints(samples, Path(out), shard_bytes)
    return {"seconds": time.perf_counter() - began}
