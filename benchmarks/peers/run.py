"""tierflow side by side with MosaicML Streaming and LitData: same data, same machine, same run.

    .venv-peers/bin/python benchmarks/peers/run.py [--quick] [--rounds 3]     (or: make bench-peers)

Every measurement runs each system in a fresh child process, the systems alternating within
each round (A B C A B C ...); figures are medians over the rounds with their spread (min-max).
Writes results/peers.md, results/peers.json and results/peers.png next to this file (--out to
change), and prints the table. See README.md beside this file for what each row means.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
for _path in (HERE.parent, HERE):  # benchmarks/ (the shared harness), then the peers' own modules
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

ORDER = ("tierflow", "streaming", "litdata")
PEERS = ("streaming", "litdata")
RAW_ONLY = (
    "webdataset",
    "inram",
    "handmade",
)  # measured on the raw path only (systems.RAW_ORDER has the table's order)
MB = 1e6
ORDER_KEYS = ("convert", "warm", "cold", "epochs", "resume", "raw")
RAW_CELLS = (("tokens", 0), ("tokens", 2), ("text", 0), ("text", 2))  # (data, DataLoader workers)


# ============================================================================ the child side
def child_main(name: str, payload: str) -> None:
    imported_at = time.perf_counter()
    import measures

    kwargs = json.loads(payload)
    if name == "resume":
        kwargs["imported_at"] = imported_at
    result = getattr(measures, name)(**kwargs)
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # peers' atexit hooks (shared memory, threads) are not part of the measurement


# ============================================================================ the parent side
class Sampler:
    """Peak summed PSS of a process tree and peak bytes under a directory, sampled in a thread."""

    def __init__(self, pid: int, directory: Path | None, interval_s: float = 0.25) -> None:
        self.pid = pid
        self.directory = directory
        self.interval_s = interval_s
        self.peak_pss = 0
        self.peak_disk = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        from systems import dir_bytes

        try:
            root = psutil.Process(self.pid)
        except psutil.Error:
            return
        while not self._stop.is_set():
            total = 0
            try:
                procs = [root] + root.children(recursive=True)
            except psutil.Error:
                break
            for proc in procs:
                try:
                    total += proc.memory_full_info().pss
                except psutil.Error:
                    pass
            self.peak_pss = max(self.peak_pss, total)
            if self.directory is not None and self.directory.exists():
                self.peak_disk = max(self.peak_disk, dir_bytes(self.directory))
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


FAILURES: list[str] = []
CHILD_TIMEOUT = [900.0]  # seconds; a child past it (a hung peer worker) is killed and retried once


def run_child(
    name: str,
    env: dict[str, str],
    watch: Path | None = None,
    timeout: float | None = None,
    attempts: int = 2,
    **kwargs: Any,
) -> dict[str, Any]:
    """One measurement in a fresh process; a crash is retried once (and recorded in the results)."""
    for attempt in range(attempts):
        try:
            return _run_child(name, env, watch, timeout or CHILD_TIMEOUT[0], **kwargs)
        except RuntimeError as e:
            last = str(e).strip().splitlines()
            FAILURES.append(f"{name} {kwargs.get('system')}: {last[0]} ... {last[-1][:160]}")
            log(f"FAILED (attempt {attempt + 1}/{attempts}): {FAILURES[-1]}")
            if watch is not None:
                shutil.rmtree(watch, ignore_errors=True)
                watch.mkdir(parents=True, exist_ok=True)
            if attempt + 1 == attempts:
                raise
    raise AssertionError


def _run_child(name: str, env: dict[str, str], watch: Path | None, timeout: float, **kwargs: Any) -> dict[str, Any]:
    command = [sys.executable, str(HERE / "run.py"), "--child", name, json.dumps(kwargs)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    sampler = Sampler(process.pid, watch)
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        raise RuntimeError(f"{name} {kwargs.get('system')} timed out after {timeout:.0f} s:\n{err[-3000:]}") from None
    finally:
        sampler.stop()
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if process.returncode != 0 or not lines:
        raise RuntimeError(f"{name} {kwargs.get('system')} exited {process.returncode}:\n{err[-4000:]}\n{out[-2000:]}")
    result = json.loads(lines[-1][len("RESULT ") :])
    result["peak_pss"] = sampler.peak_pss
    result["peak_disk"] = sampler.peak_disk
    return result


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def cached_bytes(system: str, path: Path) -> int:
    """The dataset's size in the form the system's local cache holds (decoded / uncompressed)."""
    if system == "tierflow":
        import tierflow

        return sum(s.decoded_bytes for s in tierflow.Manifest.load(path).shards)
    if system == "streaming":
        index = json.loads((path / "index.json").read_text())
        return sum(s["raw_data"]["bytes"] for s in index["shards"])
    from systems import dir_bytes

    return dir_bytes(path)


def shard_count(system: str, path: Path) -> int:
    index_name = "manifest.json" if system == "tierflow" else "index.json"
    if system == "tierflow":
        import tierflow

        return len(tierflow.Manifest.load(path).shards)
    index = json.loads((path / index_name).read_text())
    return len(index["shards"] if system == "streaming" else index["chunks"])


def upload_dir(client: Any, local: Path, bucket: str, prefix: str) -> None:
    for root, _, files in os.walk(local):
        for name in files:
            path = Path(root) / name
            client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(local).as_posix()}")


# ============================================================================ the run
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("payload", nargs="?", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="the CI smoke: one round, a few MB, small sizes")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-mb", type=float, default=96.0, help="MB of text in the corpus (stdlib first)")
    parser.add_argument("--shard-mb", type=float, default=2.0, help="shard size for every system (uncompressed MB)")
    parser.add_argument("--bandwidth-mb", type=float, default=50.0, help="proxy throttle for the cold epoch, MB/s")
    parser.add_argument("--cache-fraction", type=float, default=0.3)
    parser.add_argument("--sizes", default="1M,10M", help="resume datasets, samples of 8 bytes")
    parser.add_argument("--step-ms", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=17)
    parser.add_argument(
        "--epoch-limit-s",
        type=float,
        default=150.0,
        help="stop a 30%%-cache epoch after this long (extrapolated from the part done)",
    )
    parser.add_argument(
        "--reuse", action="store_true", help="take the measurements not in --only from the existing results/peers.json"
    )
    parser.add_argument(
        "--stop-factor",
        type=float,
        default=20.0,
        help="stop a 30%%-cache epoch once it fetched this many times the dataset (extrapolated)",
    )
    parser.add_argument(
        "--systems",
        default=",".join(ORDER + RAW_ONLY),
        help="systems to measure (webdataset, inram (the in-RAM list) and handmade (a memmap behind DataLoader) on the raw path only)",
    )
    parser.add_argument("--only", default=",".join(ORDER_KEYS), help="measurements to run: " + ",".join(ORDER_KEYS))
    parser.add_argument("--work", default="/tmp/tierflow-peers", help="scratch (corpus, datasets, caches)")
    parser.add_argument("--out", default=str(HERE / "results"))
    args = parser.parse_args()
    if args.child:
        child_main(args.child, args.payload)
        return
    if args.quick:
        args.rounds = 1
        args.max_mb = min(args.max_mb, 6.0)
        args.shard_mb = 0.25
        args.sizes = "20K,200K"
        args.epoch_limit_s = min(args.epoch_limit_s, 20.0)
        CHILD_TIMEOUT[0] = 120.0
    run(args)


def parse_size(text: str) -> int:
    scale = {"K": 10**3, "M": 10**6}
    text = text.strip().upper()
    return int(float(text[:-1]) * scale[text[-1]]) if text[-1] in scale else int(text)


def read_all(path: Path) -> int:
    """Read every file under `path` once (the page cache warm for a raw-path epoch); bytes read."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                while chunk := f.read(1 << 22):
                    total += len(chunk)
    return total


def run_raw(
    args: argparse.Namespace,
    env: dict[str, str],
    work: Path,
    corpus: Any,
    data: dict[str, dict[str, Path]],
    raw_systems: list[str],
    shard_bytes: int,
    only: set[str],
) -> dict[str, Any]:
    """The raw path: one warm epoch of local data per fresh process, tokens and text, main process and
    2 workers, every system at its defaults (systems.System.raw_loader); the systems alternate
    within each round (reversed every other round)."""
    from systems import dir_bytes, prepare_dir

    from _harness import round_order

    paths: dict[str, dict[str, Path]] = {}
    written: dict[str, Any] = {}
    for s in raw_systems:
        if s in ("inram", "handmade"):
            paths[s] = {"tokens": corpus.root, "text": corpus.root}
        elif s == "webdataset":
            wds = {v: work / "data" / f"webdataset-{v}" for v in ("tokens", "docs")}
            marker = work / "data" / "webdataset.done"
            key = f"{corpus.describe()}; shard bytes {shard_bytes}"
            if "convert" in only or not marker.exists() or marker.read_text() != key:
                marker.unlink(missing_ok=True)
                for variant, out in wds.items():
                    prepare_dir(out)
                    res = run_child(
                        "convert",
                        env,
                        system=s,
                        variant=variant,
                        corpus=str(corpus.root),
                        out=str(out),
                        shard_bytes=shard_bytes,
                    )
                    written[variant] = {"seconds": res["seconds"], "peak_pss": res["peak_pss"]}
                    log(
                        f"convert webdataset {variant:6} {res['seconds']:6.1f} s  {dir_bytes(out) / MB:7.1f} MB at rest"
                    )
                marker.write_text(key)
            for variant, out in wds.items():
                written.setdefault(variant, {}).update(at_rest=dir_bytes(out), shards=len(list(out.glob("*.tar"))))
            paths[s] = {"tokens": wds["tokens"], "text": wds["docs"]}
        else:
            paths[s] = {"tokens": data[s]["tokens"], "text": data[s]["docs"]}
    warmed = sum(read_all(p) for s in raw_systems for p in {paths[s]["tokens"], paths[s]["text"]})
    log(f"raw path: page cache warmed ({warmed / MB:.0f} MB read)")
    cells: dict[str, dict[str, list[dict]]] = {f"{kind}_w{w}": {s: [] for s in raw_systems} for kind, w in RAW_CELLS}
    for r in range(args.rounds):
        for kind, w in RAW_CELLS:
            for s in round_order(r, raw_systems):
                try:
                    res = run_child(
                        "raw", env, system=s, kind=kind, data=str(paths[s][kind]), workers=w, seed=args.seed
                    )
                except RuntimeError:
                    continue  # recorded in FAILURES; the cell keeps the rounds that ran
                cells[f"{kind}_w{w}"][s].append(res)
                log(
                    f"raw round {r + 1} {kind:6} {w} workers {s:10} {res['samples_per_s']:10,.0f} samples/s "
                    f"({res['samples']:,} samples in {res['seconds']:.2f} s + first batch {res['first_s']:.2f} s), "
                    f"peak PSS {res['peak_pss'] / MB:.0f} MB"
                )
    return {"systems": raw_systems, "cells": cells, "webdataset": written}


def run(args: argparse.Namespace) -> None:
    from corpus import build_corpus
    from systems import RAW_ORDER, dir_bytes, prepare_dir, versions

    from _harness import s3_rig
    from tierflow.testing import fake_credentials_env

    selected = args.systems.split(",")
    systems = [s for s in ORDER if s in selected]
    raw_systems = [s for s in RAW_ORDER if s in selected]
    only = set(args.only.split(","))
    work = Path(args.work) / ("quick" if args.quick else "full")
    work.mkdir(parents=True, exist_ok=True)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    shard_bytes = int(args.shard_mb * (1 << 20))
    env = {
        **os.environ,
        **fake_credentials_env(),
        "PYTHONPATH": os.pathsep.join(
            [str(HERE)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
        ),
    }
    env.pop("AWS_ENDPOINT_URL", None)
    os.environ.update(fake_credentials_env())
    env["TQDM_DISABLE"] = "1"
    started = time.perf_counter()
    results: dict[str, Any] = {
        "versions": versions(),
        "machine": f"{os.cpu_count()} CPUs, {platform.platform()}",
        "settings": {k: v for k, v in vars(args).items() if k not in ("child", "payload")},
        "systems": systems,
    }
    corpus = build_corpus(work, max_mb=args.max_mb)
    results["corpus"] = corpus.describe()
    log(f"corpus: {corpus.describe()}")
    data = {s: {v: work / "data" / f"{s}-{v}" for v in ("tokens", "docs")} for s in systems}

    # -- 1. conversion ----------------------------------------------------------------------
    conv: dict[str, dict[str, list[float]]] = {s: {"tokens": [], "docs": []} for s in systems}
    at_rest: dict[str, dict[str, int]] = {s: {} for s in systems}
    shards: dict[str, dict[str, int]] = {s: {} for s in systems}
    conv_pss: dict[str, list[float]] = {s: [] for s in systems}
    need_convert = "convert" in only or any(
        not (data[s]["tokens"] / ("manifest.json" if s == "tierflow" else "index.json")).exists() for s in systems
    )
    rounds = args.rounds if "convert" in only else 1
    if need_convert:
        for r in range(rounds):
            for s in systems:
                for variant in ("tokens", "docs"):
                    out = prepare_dir(data[s][variant])
                    res = run_child(
                        "convert",
                        env,
                        system=s,
                        variant=variant,
                        corpus=str(corpus.root),
                        out=str(out),
                        shard_bytes=shard_bytes,
                    )
                    conv[s][variant].append(res["seconds"])
                    conv_pss[s].append(res["peak_pss"])
                    log(
                        f"convert round {r + 1} {s:9} {variant:6} {res['seconds']:6.1f} s  "
                        f"{dir_bytes(out) / MB:7.1f} MB at rest"
                    )
    for s in systems:
        for variant in ("tokens", "docs"):
            at_rest[s][variant] = dir_bytes(data[s][variant])
            shards[s][variant] = shard_count(s, data[s][variant])
    results["convert"] = {"seconds": conv, "at_rest": at_rest, "shards": shards, "peak_pss": conv_pss}
    decoded = {s: cached_bytes(s, data[s]["tokens"]) for s in systems}
    results["cached_form_bytes"] = decoded
    log(f"shards (tokens): {shards}; cached form MB: { {s: round(b / MB, 1) for s, b in decoded.items()} }")

    # -- 2. warm local throughput -------------------------------------------------------------
    quick = args.quick
    n_fast, n_step = (60, 40) if quick else (600, 300)
    plan = [[0, 0.0, n_fast], [0, args.step_ms, n_step], [2, 0.0, n_fast], [2, args.step_ms, n_step]]
    warm: dict[str, list[dict]] = {s: [] for s in systems}
    if "warm" in only:
        for r in range(args.rounds):
            for s in systems:
                cache = prepare_dir(work / "cache" / f"warm-{s}")
                res = run_child(
                    "warm",
                    env,
                    watch=cache,
                    system=s,
                    data=str(data[s]["tokens"]),
                    cache=str(cache),
                    plan=plan,
                    seed=args.seed,
                )
                warm[s].append(res)
                log(
                    f"warm round {r + 1} {s:9} "
                    + "  ".join(f"{k} {v['steps_per_s']:7.0f}/s" for k, v in res.items() if k.startswith("w"))
                )
                shutil.rmtree(cache, ignore_errors=True)
    results["warm"] = warm

    # -- 2b. the raw path -----------------------------------------------------------------------
    results["raw"] = run_raw(args, env, work, corpus, data, raw_systems, shard_bytes, only) if "raw" in only else {}

    # -- 3./4. from S3 through the proxy -------------------------------------------------------
    cold: dict[str, list[dict]] = {s: [] for s in systems}
    epochs: dict[str, list[dict]] = {s: [] for s in systems}
    if only & {"cold", "epochs"}:
        with s3_rig("peers") as rig:
            server, proxy, bucket = rig.server, rig.proxy, rig.bucket
            client = server.endpoint.boto3_client()
            urls = {}
            for s in systems:
                prefix = f"{s}-tokens"
                if s == "tierflow":
                    rig.upload(data[s]["tokens"], prefix)
                else:
                    upload_dir(client, data[s]["tokens"], bucket, prefix)
                urls[s] = f"s3://{bucket}/{prefix}"
            control = proxy._control
            log(f"uploaded to moto S3 {server.endpoint_url}; proxy {proxy.url}")
            for r in range(args.rounds):
                if "cold" in only:
                    proxy.set_bandwidth(args.bandwidth_mb * MB)
                    for s in systems:
                        cache = prepare_dir(work / "cache" / f"cold-{s}")
                        res = run_child(
                            "cold",
                            env,
                            watch=cache,
                            system=s,
                            url=urls[s],
                            endpoint=proxy.url,
                            control=control,
                            cache=str(cache),
                            workers=2,
                            seed=args.seed,
                            key=f"/{s}-tokens/",
                        )
                        cold[s].append(res)
                        log(
                            f"cold round {r + 1} {s:9} first batch {res['first_s']:.2f} s, epoch {res['epoch_s']:.1f} s, "
                            f"{res['bytes'] / MB:.1f} MB, peak PSS {res['peak_pss'] / MB:.0f} MB, "
                            f"disk {res['peak_disk'] / MB:.0f} MB"
                        )
                        shutil.rmtree(cache, ignore_errors=True)
                if "epochs" in only:
                    proxy.set_bandwidth(None)
                    for s in systems:
                        cache = prepare_dir(work / "cache" / f"epochs-{s}")
                        limit = int(args.cache_fraction * decoded[s])
                        for attempt in range(3):  # LitData's TokensLoader can crash under cache pressure
                            res = run_child(
                                "epochs",
                                env,
                                watch=cache,
                                system=s,
                                url=urls[s],
                                endpoint=proxy.url,
                                control=control,
                                cache=str(cache),
                                workers=2,
                                seed=args.seed,
                                key=f"/{s}-tokens/",
                                cache_limit=limit,
                                count=3,
                                stop_bytes=int(args.stop_factor * at_rest[s]["tokens"]),
                                stop_seconds=args.epoch_limit_s,
                                extrapolate_crash=False,
                            )
                            crash = (res.get("stopped") or {}).get("crashed")
                            if not crash:
                                break
                            FAILURES.append(
                                f"epochs {s} (attempt {attempt + 1}): {crash} in epoch "
                                f"{res['stopped']['epoch'] + 1} at {res['stopped']['fraction']:.0%}"
                            )
                            log(f"CRASHED: {FAILURES[-1]}")
                            shutil.rmtree(cache, ignore_errors=True)
                            cache.mkdir(parents=True)
                        res["cache_limit"] = limit
                        epochs[s].append(res)
                        log(
                            f"epochs round {r + 1} {s:9} MB per epoch "
                            f"{[round(b / MB, 1) for b in res['per_epoch']]} in {res['seconds']:.0f} s "
                            f"(cache {limit / MB:.0f} MB, peak disk {res['peak_disk'] / MB:.0f} MB)"
                        )
                        shutil.rmtree(cache, ignore_errors=True)
    results["cold"] = cold
    results["epochs"] = epochs
    results["at_rest_bytes_tokens"] = {s: at_rest[s]["tokens"] for s in systems}

    # -- 5. resume ------------------------------------------------------------------------------
    resume: dict[str, dict[str, list[dict]]] = {s: {} for s in systems}
    if "resume" in only:
        sizes = [parse_size(x) for x in args.sizes.split(",")]
        states = {}
        for n in sizes:
            for s in systems:
                path = work / "ints" / f"{s}-{n}"
                marker = path.parent / f"{s}-{n}.done"
                if not marker.exists():
                    prepare_dir(path)
                    began = time.perf_counter()
                    run_child("convert_ints", env, system=s, samples=n, out=str(path), shard_bytes=shard_bytes)
                    marker.write_text("ok")
                    log(
                        f"built {s} {n:,} samples of 8 bytes in {time.perf_counter() - began:.0f} s "
                        f"({dir_bytes(path) / MB:.1f} MB)"
                    )
                state_file = work / "ints" / f"{s}-{n}.state.json"
                cache = prepare_dir(work / "cache" / f"state-{s}")
                run_child("state", env, system=s, data=str(path), cache=str(cache), fraction=0.5, out=str(state_file))
                states[(s, n)] = state_file
        for r in range(args.rounds):
            for n in sizes:
                for s in systems:
                    cache = prepare_dir(work / "cache" / f"resume-{s}")
                    res = run_child(
                        "resume",
                        env,
                        system=s,
                        data=str(work / "ints" / f"{s}-{n}"),
                        cache=str(cache),
                        state_file=str(states[(s, n)]),
                    )
                    resume[s].setdefault(str(n), []).append(res)
                    log(
                        f"resume round {r + 1} {s:9} {n:>10,} samples: first batch {res['first_s'] * 1e3:.0f} ms "
                        f"(imports {res['import_s']:.1f} s), peak PSS {res['peak_pss'] / MB:.0f} MB"
                    )
        results["resume_sizes"] = sizes
    results["resume"] = resume
    results["wall_s"] = time.perf_counter() - started
    results["failures"] = FAILURES

    previous = out_dir / "peers.json"
    if args.reuse and previous.exists():
        old = json.loads(previous.read_text())
        for key in ("warm", "cold", "epochs", "resume", "raw"):
            if key not in only and key in old:
                results[key] = old[key]
        if "resume" not in only and "resume_sizes" in old:
            results["resume_sizes"] = old["resume_sizes"]
        if "convert" not in only:
            results["convert"]["seconds"] = old["convert"]["seconds"]
            results["convert"]["peak_pss"] = old["convert"]["peak_pss"]
        results["failures"] = old.get("failures", []) + FAILURES
        results["reused"] = f"{sorted(set(ORDER_KEYS) - only)} from a run of {old.get('wall_s', 0) / 60:.1f} min"
    (out_dir / "peers.json").write_text(json.dumps(results, indent=1, default=str))
    from report import write_report

    text = write_report(results, out_dir)
    print(text)
    log(f"done in {results['wall_s'] / 60:.1f} min; results in {out_dir}")


if __name__ == "__main__":
    main()
