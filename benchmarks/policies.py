"""Score every cache policy against the offline optimum on the traces of issue 3, and time them.

Prints hit ratios (policy x trace x capacity, the window-aware optimum beside each),
checks the issue's targets, and measures microseconds per access at 10k and 1M
resident entries. Default run: about 1-2 minutes on 2 cores. `--quick` shrinks it.

Sizes (default): (a) 5,000 shards x 6 epochs, shuffle windows of 4 shards x 8 samples
(30,000 shard-intervals); (b) Zipf over 10,000 items, 100,000 reads; (c) 10,000 items
in three datasets up-sampled x1, x2, x8, 4 epochs (60,000 reads); (d) 500 hot items
and a 40,000-item scan (80,000 reads); (e) 1,100 items looped 10 times, cache 1,000.
Entries are equal-sized, so the byte miss ratio is 1 - hit ratio.
"""

from __future__ import annotations

import argparse
import gc
import time

from tierflow.policies import Cache, make_policy, optimum, simulate, traces
from tierflow.policies.traces import Trace

POLICIES = ["lru", "hotscore", "clairvoyant", "nochurn", "stream", "auto", "auto-"]
ORACLE_FREE = ["lru", "hotscore", "nochurn", "stream"]


def run_policy(trace: Trace, name: str, capacity: int):
    options: dict = {}
    if name.startswith("auto"):
        options = {"lifecycle": trace.lifecycle, "half_life": trace.epoch_length}
    elif name == "hotscore":
        options = {"half_life": trace.epoch_length}
    return simulate(trace, name.rstrip("-"), capacity, oracle=not name.endswith("-"), **options)


def score(label: str, trace: Trace, fractions: list[float]) -> list[dict]:
    rows = []
    data = trace.data_bytes
    for fraction in fractions:
        capacity = max(1, round(fraction * data))
        row = {"trace": label, "cap": fraction, "capacity": capacity, "opt": optimum(trace, capacity).hit_ratio}
        for name in POLICIES:
            result = run_policy(trace, name, capacity)
            row[name] = result.hit_ratio
            if name.startswith("auto"):
                row[name + "pick"] = result.note.split(":")[0]
        rows.append(row)
        print_row(row)
    return rows


def print_header() -> None:
    cells = "".join(f"{name:>12}" for name in POLICIES)
    print(f"{'trace':<10}{'cache':>7}{cells}{'optimum':>9}   auto picks (oracle / none)")


def print_row(row: dict) -> None:
    cells = "".join(f"{row[name]:>7.3f} {row[name] / row['opt'] if row['opt'] else 1:>4.2f}" for name in POLICIES)
    print(
        f"{row['trace']:<10}{row['cap']:>6.1%} {cells}{row['opt']:>9.3f}   {row['autopick']} / {row['auto-pick']}",
        flush=True,
    )


def check_targets(rows: list[dict]) -> list[tuple[str, bool, str]]:
    checks = []
    a_rows = [r for r in rows if r["trace"] == "a"]
    for name in ("clairvoyant", "nochurn"):
        worst = min(a_rows, key=lambda r: r[name] / r["opt"])
        ratio = worst[name] / worst["opt"]
        checks.append(
            (f"(a) {name} >= 0.97 x optimum at 5-90%", ratio >= 0.97, f"worst {ratio:.3f} at {worst['cap']:.0%}")
        )
    b_rows = [r for r in rows if r["trace"].startswith("b")]
    worst = min(b_rows, key=lambda r: r["hotscore"] - r["lru"])
    checks.append(
        (
            "(b) hotscore >= lru everywhere",
            worst["hotscore"] >= worst["lru"],
            f"smallest margin {worst['hotscore'] - worst['lru']:+.3f} ({worst['trace']}, {worst['cap']:.0%})",
        )
    )
    b1 = next(r for r in rows if r["trace"] == "b a=1.0" and r["cap"] == 0.01)
    closed = (b1["hotscore"] - b1["lru"]) / (b1["opt"] - b1["lru"])
    checks.append(
        (
            "(b) alpha 1.0, 1%: hotscore closes >= 50% of lru->opt gap",
            closed >= 0.5,
            f"closes {closed:.0%} (lru {b1['lru']:.3f}, hotscore {b1['hotscore']:.3f}, opt {b1['opt']:.3f})",
        )
    )
    c10 = next(r for r in rows if r["trace"] == "c" and r["cap"] == 0.10)
    checks.append(
        (
            "(c) hotscore >= lru + 0.05 at 10%",
            c10["hotscore"] >= c10["lru"] + 0.05,
            f"{c10['hotscore']:.3f} vs lru {c10['lru']:.3f} ({c10['hotscore'] - c10['lru']:+.3f})",
        )
    )
    e = next(r for r in rows if r["trace"] == "e")
    bound = 0.8 * e["capacity"] / 1100
    for name in ("hotscore", "nochurn"):
        checks.append(
            (
                f"(e) {name} >= 0.8 x capacity/data",
                e[name] >= bound,
                f"{e[name]:.3f} vs {bound:.3f} (lru {e['lru']:.3f})",
            )
        )
    worst_auto = 1.0
    where = ""
    for r in rows:
        best_any = max(r[name] for name in POLICIES[:5])
        best_blind = max(r[name] for name in ORACLE_FREE)
        for got, best, tag in ((r["auto"], best_any, "oracle"), (r["auto-"], best_blind, "no oracle")):
            ratio = got / best if best else 1.0
            if ratio < worst_auto:
                worst_auto, where = ratio, f"{r['trace']} {r['cap']:.1%} ({tag})"
    checks.append(
        (
            "auto within 3% of the best policy on (a)-(e)",
            worst_auto >= 0.97,
            f"worst {worst_auto:.3f} at {where}" if where else "always the best",
        )
    )
    return checks


class _HashOracle:
    """A cheap stand-in future (next use a fixed pseudo-random distance ahead), for timing only."""

    def next_use(self, key: str, now: float) -> float:
        return now + (hash(key) & 0xFFFFF)

    def use_after_current(self, key: str, now: float) -> float:
        return self.next_use(key, now)


def cost_per_access(entries: int, accesses: int) -> dict[str, float]:
    results = {}
    for name in ["lru", "hotscore", "clairvoyant", "nochurn", "stream"]:
        gc.collect()
        policy = make_policy(name, **({"half_life": float(entries)} if name == "hotscore" else {}))
        if name == "clairvoyant":
            policy.set_oracle(_HashOracle())
        cache = Cache(policy, entries)
        for index in range(entries):
            cache.access(f"k{index}", 1, float(index))
        keys = [
            f"k{(index * 7919) % (2 * entries)}" if index % 2 else f"k{(index * 104729) % entries}"
            for index in range(accesses)
        ]
        clock = float(entries)
        started = time.perf_counter()
        for key in keys:
            cache.access(key, 1, clock, required=True)
            clock += 1.0
        results[name] = (time.perf_counter() - started) / accesses * 1e6
        del cache, policy
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller traces (about 15 s)")
    args = parser.parse_args()
    scale = 5 if args.quick else 1
    started = time.perf_counter()
    print("hit ratio per policy, then its ratio to the optimum; auto- = auto without an oracle")
    print_header()
    rows: list[dict] = []
    rows += score(
        "a",
        traces.uniform_reshuffle(5000 // scale, 6, window=4, samples_per_shard=8),
        [0.05, 0.10, 0.25, 0.50, 0.75, 0.90],
    )
    for alpha in (0.8, 1.0):
        rows += score(f"b a={alpha}", traces.zipf(10000 // scale, 100000 // scale, alpha), [0.01, 0.10, 0.30])
    rows += score(
        "c", traces.mixture([(8000 // scale, 1), (1500 // scale, 2), (500 // scale, 8)], 4), [0.05, 0.10, 0.25]
    )
    rows += score("d", traces.hot_and_scan(500 // scale, 40000 // scale, 0.5), [0.005, 0.0125, 0.025])
    rows += score("e", traces.loop(1100, 10), [1000 / 1100])
    print(f"\ntargets (issue 3)  [{time.perf_counter() - started:.0f} s]")
    for label, met, figure in check_targets(rows):
        print(f"  {'MET ' if met else 'MISS'} {label}: {figure}")
    print("\ncost per access (us; half hits, half misses with eviction, capacity full)")
    sizes = [10_000, 100_000] if args.quick else [10_000, 1_000_000]
    costs = {n: cost_per_access(n, 100_000) for n in sizes}
    print(f"{'policy':<12}" + "".join(f"{n:>12,}" for n in sizes))
    for name in costs[sizes[0]]:
        print(f"{name:<12}" + "".join(f"{costs[n][name]:>12.2f}" for n in sizes))
    print(f"\ntotal {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
