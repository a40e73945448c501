"""Loader benchmark: a training loop fed by tierflow against the same batches preloaded in RAM.

The dry run (DESIGN.md) is the bound: the same step driven by the same batches already in memory.
Rounds alternate tierflow / dry run; each figure is the median of the rounds with its spread
(min-max). Timing starts when the first batch has arrived (start-up is reported on its own).
Also the raw loader speed with no step: samples/s, wall us and CPU us per batch (main process
plus DataLoader workers, from getrusage after the workers have exited).

`--cold` instead measures the first epoch from a throttled object store: moto's S3 behind a
`ProxyProcess` whose bandwidth is set below the loop's at-rest consumption, then above it, read
through an empty L2 with the stager running. Below consumption the source is the bound, so the
achieved at-rest rate should be close to the throttle; above it the step is, so the epoch should
take about as long as its steps. Rounds alternate the two bandwidths (`--rounds`). Beside each row
stands the whole-shard bound: the epoch of the best schedule that fetches whole shards, one at a
time at the throttle in order of first use (earliest deadline first: no order of whole-shard
fetches through one link does better), with the loop taking exactly one step per batch and no
request latency or decoding. What it cannot beat is the order's shape: every lane's first window
is needed within the first few batches, and after the last windows open the rest of the epoch
runs on shards already fetched.

    PYTHONPATH=src .venv/bin/python benchmarks/loader.py [--quick] [--cold [--rounds N] [--events DIR]] [--bounds]

`--events DIR` writes each cold epoch's event log (telemetry/eventlog.py) there: the loop's "batch"
records (wait, fetch attribution) and the stager's "stage" records (shard, first use, when its
transfer began and ended), the timeline of which shard each wait was for.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

import tierflow
from tierflow.loader import BatchSpec, Loader, OrderSpec, TieredDataset
from tierflow.telemetry.loader_metrics import LoaderTelemetry
from tierflow.telemetry.eventlog import EventLog
from tierflow.tiers.stager import Stager
from tierflow.commands.bench import steps_per_second
from tierflow.testing import ProxyProcess
from tierflow.tiers import TierConfig, build_stack
from _harness import alternating, s3_rig, spread
from warm import remove_l1, warm_dataset, warm_l1

SEQ_LEN = 2048
BATCH = 8


def make_dataset(root: Path, tokens: int) -> str:
    rng = np.random.default_rng(0)
    source = root / "docs.jsonl"
    written = 0
    with open(source, "w") as f:
        while written < tokens:
            n = int(rng.integers(200, 4000))
            f.write(json.dumps({"text": "".join(chr(97 + c) for c in rng.integers(0, 26, n))}) + "\n")
            written += n + 1
    tierflow.pack([source], root / "ds", tokenizer="bytes", workers=1, target_shard_bytes=4 << 20)
    return str(root / "ds")


L1: list = []  # the warmed L1 tier's config, once made


def dataset(path: str) -> TieredDataset:
    return warm_dataset(path, L1[0], batch_size=BATCH, seq_len=SEQ_LEN, partitions=8)


def tierflow_round(
    path: str, workers: int, steps: int, step_s: float, background: bool | None = None
) -> tuple[float, float]:
    loader = Loader(dataset(path), device="cpu", num_workers=workers, background=background, endless=True)
    try:
        return steps_per_second(loader, steps, step_s)
    finally:
        loader.close()


def preload(path: str, count: int) -> list:
    loader = Loader(dataset(path), device="cpu", endless=True)
    batches = []
    for batch in loader:
        batches.append({k: (v.clone() if hasattr(v, "clone") else v) for k, v in batch.items()})
        if len(batches) == count:
            break
    loader.close()
    return batches


def raw_speed(path: str, workers: int, batches: int, background: bool | None = None) -> dict[str, float]:
    self_before = resource.getrusage(resource.RUSAGE_SELF)
    kids_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    loader = Loader(dataset(path), device="cpu", num_workers=workers, background=background, endless=True)
    iterator = iter(loader)
    next(iterator)
    begin = time.perf_counter()
    for n, _ in enumerate(iterator, 1):
        if n == batches:
            break
    wall = time.perf_counter() - begin
    loader.close()
    self_after = resource.getrusage(resource.RUSAGE_SELF)
    kids_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = sum(
        after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        for before, after in ((self_before, self_after), (kids_before, kids_after))
    )
    return {
        "samples_per_s": batches * BATCH / wall,
        "us_per_batch": wall / batches * 1e6,
        "cpu_us_per_batch": cpu / (batches + 1) * 1e6,
    }


MB = 1e6
COLD_BATCH = 8
COLD_SEQ_LEN = 1024
COLD_STEP_S = 0.005


def make_cold_dataset(root: Path, decoded_bytes: int) -> Path:
    """Word text drawn from a Zipf-like vocabulary, so zstd compresses it about as much as prose."""
    rng = np.random.default_rng(1)
    letters = np.frombuffer(b"etaoinshrdlcumwfgypbvkjxqz", dtype=np.uint8)
    vocabulary = ["".join(chr(c) for c in rng.choice(letters, int(rng.integers(2, 10)), p=None)) for _ in range(5000)]
    weights = 1.0 / np.arange(1, len(vocabulary) + 1)
    weights /= weights.sum()
    source = root / "cold.jsonl"
    written = 0
    tokens_per_byte = 2  # uint16 token ids
    with open(source, "w") as f:
        while written < decoded_bytes:
            words = rng.choice(len(vocabulary), int(rng.integers(40, 800)), p=weights)
            text = " ".join(vocabulary[w] for w in words)
            f.write(json.dumps({"text": text}) + "\n")
            written += (len(text) + 1) * tokens_per_byte
    tierflow.pack([source], root / "cold", tokenizer="bytes", workers=1, target_shard_bytes=2 << 20)
    return root / "cold"


class SourceActivity:
    """Samples the proxy's byte count, to time the span in which the source was sending.

    The epoch's rate also counts start-up and the tail after the last byte; the active span
    shows whether the throttle was saturated while there was something left to fetch.
    """

    def __init__(self, proxy: ProxyProcess, interval_s: float = 0.25) -> None:
        self.proxy = proxy
        self.interval_s = interval_s
        self.first_byte_s: float | None = None
        self.last_byte_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="bench-source-activity", daemon=True)

    def __enter__(self) -> SourceActivity:
        self._started = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        seen = 0
        while not self._stop.wait(self.interval_s):
            sent = self.proxy.traffic().response_bytes("GET")
            now = time.perf_counter() - self._started
            if sent > seen:
                if self.first_byte_s is None:
                    self.first_byte_s = now - self.interval_s
                self.last_byte_s = now
                seen = sent

    @property
    def active_s(self) -> float:
        return self.last_byte_s - (self.first_byte_s or 0.0)


COLD_ORDERS = {
    "default": {},
    "wide first epoch (narrow_first_epoch=False)": {"narrow_first_epoch": False},
    "tuned (partitions=4, window_shards=2)": {"partitions": 4, "window_shards": 2},
}
"""The order's shape decides the bound. With an L2 that holds the dataset the breadth is the
widest, 16 lanes x windows of 4; read that wide from the start, epoch 0 opens nearly every shard
in its first batches. The default reads epoch 0 at most 1/16 of the node's shards at once
(working_set.FIRST_EPOCH_SHARE), so shards are first needed all through the epoch; the tuned row
reads every epoch 4 lanes x 2 shards at a time."""


def cold_epoch(
    url: str, endpoint: str, proxy: ProxyProcess, tier_dir: Path, order: dict, events_path: Path | None = None
) -> dict[str, float]:
    """One first epoch through an empty L2; source bytes are what the proxy sent."""
    stack = build_stack(url, [TierConfig("L2", str(tier_dir), 1 << 30, form="decoded")], endpoint_url=endpoint)
    events = EventLog(events_path, stack.registry, name=f"cold epoch {tier_dir.name}") if events_path else None
    ds = TieredDataset(stack.dataset(), BatchSpec(batch_size=COLD_BATCH, seq_len=COLD_SEQ_LEN), OrderSpec(**order))
    steps = ds.num_order_samples // COLD_BATCH
    proxy.reset_counters()
    waited = 0.0
    first = 0.0
    done = 0
    with SourceActivity(proxy) as activity:
        started = time.perf_counter()
        loader = Loader(
            ds,
            stager=Stager(ds, stack, events=events),
            endless=True,
            telemetry=LoaderTelemetry(events=events) if events is not None else True,
        )
        loader.start_prefetch()
        try:
            iterator = iter(loader)
            while done < steps:
                asked = time.perf_counter()
                next(iterator)
                got = time.perf_counter()
                waited += got - asked
                if done == 0:
                    first = got - started
                time.sleep(COLD_STEP_S)
                done += 1
            wall = time.perf_counter() - started
        finally:
            loader.close()
            if events is not None:
                events.close()
    source_bytes = proxy.traffic().response_bytes("GET")
    return {
        "steps": steps,
        "wall_s": wall,
        "source_bytes": source_bytes,
        "first_s": first,
        "bubble": waited / wall,
        "step_bound_s": steps * COLD_STEP_S,
        "active_s": activity.active_s,
        "last_byte_s": activity.last_byte_s,
    }


def warm_floor(local: Path, order: dict) -> float:
    """The cold loop's own floor: the same steps read from local disk, nothing fetched, x the step-bound
    time (what the loop costs beyond its sleeps; the cold rows cannot go below it)."""
    ds = TieredDataset(str(local), BatchSpec(batch_size=COLD_BATCH, seq_len=COLD_SEQ_LEN), OrderSpec(**order))
    steps = ds.num_order_samples // COLD_BATCH
    loader = Loader(ds, endless=True)
    loader.start_prefetch()
    try:
        iterator = iter(loader)
        next(iterator)
        started = time.perf_counter()
        for _ in range(steps):
            next(iterator)
            time.sleep(COLD_STEP_S)
        return (time.perf_counter() - started) / (steps * COLD_STEP_S)
    finally:
        loader.close()


def whole_shard_bound(uses: list, rest_bytes: list[int], throttle: float, steps: int, step_samples: int) -> float:
    """Seconds of the best epoch that fetches whole shards through one link of `throttle` bytes/s
    (module docstring): shards in order of first use, back to back; batch i starts when every shard
    whose window opens by its end has arrived and batch i - 1 has taken its step."""
    arrival: dict[int, float] = {}
    sent = 0
    for use in sorted((u for u in uses if u.epoch == 0), key=lambda u: (u.first_use, u.shard)):
        if use.shard not in arrival:
            sent += rest_bytes[use.shard]
            arrival[use.shard] = sent / throttle
    opens = sorted((u.first_use, arrival[u.shard]) for u in uses if u.epoch == 0)
    ready, k, clock = 0.0, 0, 0.0
    for batch in range(steps):
        while k < len(opens) and opens[k][0] < (batch + 1) * step_samples:
            ready = max(ready, opens[k][1])
            k += 1
        clock = max(clock, ready) + COLD_STEP_S
    return clock


BOUND_ORDERS = (
    {},
    {"narrow_first_epoch": False},
    {"lanes": 8},
    {"lanes": 8, "window_shards": 1},
    {"partitions": 4, "window_shards": 2},
    {"lanes": 4, "window_shards": 1},
    {"lanes": 2, "window_shards": 1},
)


def bounds(work: Path) -> None:
    """The whole-shard bound of the cold dataset's first epoch under several orders (docs/order.md):
    computed, nothing is fetched."""
    local = make_cold_dataset(work, 48 << 20)
    manifest = tierflow.Manifest.load(local)
    at_rest = sum(s.bytes for s in manifest.shards)
    rest_bytes = [s.bytes for s in manifest.shards]
    print(f"whole-shard bound of the first epoch, {len(manifest.shards)} shards, {at_rest / MB:.1f} MB at rest")
    print(
        "| order | lanes x k | 2 x the needed bandwidth: x step-bound | 0.5 x: achieved / throttle |\n|---|---|---|---|"
    )
    for order in BOUND_ORDERS:
        ds = TieredDataset(str(local), BatchSpec(batch_size=COLD_BATCH, seq_len=COLD_SEQ_LEN), OrderSpec(**order))
        steps = ds.num_order_samples // COLD_BATCH
        step_bound_s = steps * COLD_STEP_S
        need = at_rest / step_bound_s
        uses = ds.future_shard_uses(None, horizon_batches=steps + 1)
        fast, slow = (whole_shard_bound(uses, rest_bytes, need * f, steps, ds.node_step_samples()) for f in (2.0, 0.5))
        ws = ds.working_set
        breadth = f"{ws.lanes} x {ws.window_shards}" + (
            f" (epoch 0: {ws.first_epoch[0]} x {ws.first_epoch[1]})" if ws.first_epoch else ""
        )
        print(f"| {order or 'default'} | {breadth} | {fast / step_bound_s:.2f} | {at_rest / slow / (need * 0.5):.2f} |")


def cold(work: Path, quick: bool, rounds: int, events: Path | None = None) -> None:
    local = make_cold_dataset(work, (16 if quick else 48) << 20)
    manifest = tierflow.Manifest.load(local)
    at_rest = sum(s.bytes for s in manifest.shards)
    decoded = sum(s.decoded_bytes for s in manifest.shards)
    with s3_rig("loadercold") as rig:
        proxy = rig.proxy
        url = rig.upload(local, "ds")
        # the order each row reads (an L2 that holds the dataset reads as the local copy does)
        probes = {
            name: TieredDataset(str(local), BatchSpec(batch_size=COLD_BATCH, seq_len=COLD_SEQ_LEN), OrderSpec(**order))
            for name, order in COLD_ORDERS.items()
        }
        probe = probes["default"]
        steps = probe.num_order_samples // COLD_BATCH
        step_bound_s = steps * COLD_STEP_S
        consumption = at_rest / step_bound_s  # at-rest bytes/s the step-bound loop needs
        rest_bytes = [s.bytes for s in manifest.shards]
        factors = (0.5, 2.0)
        cases = [(name, factor) for name in COLD_ORDERS for factor in factors]
        runs: dict[tuple[str, float], list[dict[str, float]]] = {c: [] for c in cases}
        floors: list[float] = []
        for number, (name, factor) in alternating(rounds, cases):
            if (name, factor) == cases[0]:
                floors.append(warm_floor(local, COLD_ORDERS["default"]))
            proxy.set_bandwidth(consumption * factor)
            tag = f"order{list(COLD_ORDERS).index(name)}-{factor:g}x-{number}"
            log = events / f"cold-{tag}.jsonl" if events else None
            runs[(name, factor)].append(cold_epoch(url, proxy.url, proxy, work / f"l2-{tag}", COLD_ORDERS[name], log))
    print(
        f"cold first epoch: moto S3 -> throttled ProxyProcess -> empty L2 (decoded), stager on; "
        f"{len(manifest.shards)} shards, {at_rest / MB:.1f} MB at rest, {decoded / MB:.1f} MB decoded; "
        f"batch {COLD_BATCH} x {COLD_SEQ_LEN + 1} tokens, {COLD_STEP_S * 1e3:.0f} ms step; "
        f"step-bound epoch {step_bound_s:.1f} s = {consumption / MB:.2f} MB/s at rest consumed"
    )
    print(
        "  achieved = source bytes / epoch wall (start-up and the tail after the last byte included); "
        "active = source bytes / the span the source was sending (sampled every 0.25 s); whole-shard bound: "
        "see the docstring"
    )
    for name, order in probes.items():
        ws = order.working_set
        first = (
            f"; epoch 0 {ws.first_epoch[0]} lanes at a time x windows of {ws.first_epoch[1]}" if ws.first_epoch else ""
        )
        print(f"  order {name}: {ws.lanes} lanes x windows of {ws.window_shards} ({ws.reason}){first}")
    print(
        f"  medians of {rounds} alternating rounds (min-max); the loop's own floor, the same steps warm from "
        f"local disk (default order, nothing fetched): {spread(floors, '.3f')} x step-bound"
    )
    print(
        f"{'order':>37} {'throttle MB/s':>13} {'x need':>6} {'epoch s':>17} {'x step-bound':>18} {'bound s':>7} {'x bound':>18} "
        f"{'last byte s':>17} {'source MB':>9} {'achieved/thr.':>18} {'active/thr.':>18} {'bound/thr.':>10} "
        f"{'bubble':>18} {'1st batch s':>17}  target"
    )
    for name, factor in cases:
        throttle = consumption * factor
        rs = runs[(name, factor)]
        order = probes[name]
        bound = whole_shard_bound(
            order.future_shard_uses(None, horizon_batches=steps + 1),
            rest_bytes,
            throttle,
            steps,
            order.node_step_samples(),
        )
        achieved = [r["source_bytes"] / r["wall_s"] / throttle for r in rs]
        active = [r["source_bytes"] / r["active_s"] / throttle if r["active_s"] > 0 else None for r in rs]
        wall = statistics.median(r["wall_s"] for r in rs)
        source_mb = statistics.median(r["source_bytes"] for r in rs) / MB
        if factor < 1:
            target, met = "achieved >= 0.9 x throttle", statistics.median(achieved) >= 0.9
        else:
            target, met = "epoch <= 1.1 x step-bound", wall <= 1.1 * step_bound_s
        print(
            f"{name:>37} {throttle / MB:>13.2f} {factor:>6.1f} {spread([r['wall_s'] for r in rs]):>17} "
            f"{spread([r['wall_s'] / step_bound_s for r in rs], '.2f'):>18} {bound:>7.1f} "
            f"{spread([r['wall_s'] / bound for r in rs], '.2f'):>18} "
            f"{spread([r['last_byte_s'] for r in rs]):>17} {source_mb:>9.1f} "
            f"{spread(achieved, '.2f'):>18} {spread(active, '.2f'):>18} {at_rest / bound / throttle:>10.2f} "
            f"{spread([r['bubble'] for r in rs], '.1%'):>18} {spread([r['first_s'] for r in rs], '.2f'):>17}  "
            f"{target}: {'met' if met else 'MISSED'}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and steps")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--feed-thread",
        action="store_true",
        help="with workers, receive batches on the device feed's thread (Loader(background=True))",
    )
    parser.add_argument(
        "--cold", action="store_true", help="the first epoch from a throttled S3 proxy instead of the warm-cache runs"
    )
    parser.add_argument("--events", type=Path, help="--cold: write each epoch's event log to this folder")
    parser.add_argument(
        "--bounds",
        action="store_true",
        help="only the cold epoch's whole-shard bound under several orders (computed, no S3)",
    )
    args = parser.parse_args()
    if args.bounds:
        with tempfile.TemporaryDirectory() as tmp:
            bounds(Path(tmp))
        return
    if args.cold:
        with tempfile.TemporaryDirectory() as tmp:
            cold(Path(tmp), args.quick, 1 if args.quick else args.rounds, args.events)
        return
    background = True if args.feed_thread else None
    rounds = 1 if args.quick else args.rounds
    plan = {0.002: 150, 0.010: 60, 0.050: 16}
    if args.quick:
        plan = {k: max(8, v // 3) for k, v in plan.items()}
    with tempfile.TemporaryDirectory() as tmp:
        path = make_dataset(Path(tmp), 24 << 20)
        L1.append(warm_l1(path))
        try:
            measure(path, plan, rounds, background, 100 if args.quick else 400)
        finally:
            remove_l1(L1[0])


def measure(path: str, plan: dict[float, int], rounds: int, background: bool | None, raw_batches: int) -> None:
    preloaded = preload(path, max(plan.values()) + 2)
    print(f"dataset: {tierflow.open_dataset(path)!r}; batch {BATCH} x {SEQ_LEN + 1} tokens (uint16)")
    print(
        f"{'workers':>7} {'step ms':>7} {'tierflow steps/s':>24} {'dry run steps/s':>24} {'ratio':>6} "
        f"{'target':>6} {'first batch ms':>14}"
    )
    for workers in (0, 2):
        for step_s, steps in plan.items():
            ours, dry, firsts = [], [], []
            for _ in range(rounds):
                rate, first = tierflow_round(path, workers, steps, step_s, background)
                ours.append(rate)
                firsts.append(first * 1e3)
                dry.append(steps_per_second(preloaded, steps, step_s)[0])
            ratio = statistics.median(ours) / statistics.median(dry)
            target = 0.9 if step_s < 0.005 else 0.95
            print(
                f"{workers:>7} {step_s * 1e3:>7.0f} {spread(ours):>24} {spread(dry):>24} {ratio:>6.3f} "
                f"{'met' if ratio >= target else 'MISSED':>6} {statistics.median(firsts):>14.0f}"
            )
    print()
    print(f"{'workers':>7} {'samples/s':>12} {'us/batch':>10} {'CPU us/batch':>13}  (raw, no step; median of {rounds})")
    for workers in (0, 2):
        runs = [raw_speed(path, workers, raw_batches, background) for _ in range(rounds)]
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(
            f"{workers:>7} {med['samples_per_s']:>12.0f} {med['us_per_batch']:>10.0f} {med['cpu_us_per_batch']:>13.0f}"
        )


if __name__ == "__main__":
    main()
