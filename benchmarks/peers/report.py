"""The markdown table (results/peers.md) and the bar chart (results/peers.png) from run.py's results."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from collections.abc import Callable, Sequence

from _harness import spread, summary  # benchmarks/ is on the path (run.py puts it there)

MB = 1e6
PEERS = ("streaming", "litdata")
RAW_PEERS = ("litdata", "webdataset", "streaming")  # the raw path's peers; "inram" is the bound
RAW_NAMES = {
    "inram": "in-RAM list (bound)",
    "handmade": "hand-written (memmap + DataLoader)",
    "litdata": "LitData",
    "webdataset": "WebDataset",
    "streaming": "MosaicML Streaming",
    "tierflow": "tierflow",
}
RAW_MODES = {0: "main process", 2: "2 workers"}


class Row:
    def __init__(
        self,
        label: str,
        unit: str,
        higher_better: bool,
        values: dict[str, list[float]],
        fmt: str,
        target: float | None = None,
        note: str = "",
        absolute: bool = False,
    ) -> None:
        self.label, self.unit, self.higher_better, self.values, self.fmt = label, unit, higher_better, values, fmt
        self.target, self.note, self.absolute = target, note, absolute

    def medians(self) -> dict[str, float | None]:
        return {s: (st[0] if (st := summary(v)) else None) for s, v in self.values.items()}

    def ratio(self) -> tuple[float | None, str | None]:
        """tierflow / the better peer's median (what the targets are stated in)."""
        med = self.medians()
        peers = {p: med.get(p) for p in PEERS if med.get(p) is not None}
        if med.get("tierflow") is None or not peers:
            return None, None
        best = (max if self.higher_better else min)(peers, key=lambda p: peers[p])
        if not peers[best]:
            return None, best
        return med["tierflow"] / peers[best], best

    def verdict(self) -> str:
        if self.absolute and self.target is not None:
            mine = self.medians().get("tierflow")
            if mine is None:
                return ""
            met = mine >= self.target if self.higher_better else mine <= self.target
            return f"{'met' if met else 'MISSED'} (tierflow {'>=' if self.higher_better else '<='} {self.target:g} {self.unit})"
        ratio, _ = self.ratio()
        if ratio is None or self.target is None:
            return ""
        met = ratio >= self.target if self.higher_better else ratio <= self.target
        return f"{'met' if met else 'MISSED'} ({'>=' if self.higher_better else '<='} {self.target:g})"


def build_rows(r: dict[str, Any]) -> list[Row]:
    systems = r["systems"]
    rows: list[Row] = []

    def per(getter: Callable[[str], list[float]]) -> dict[str, list[float]]:
        return {s: getter(s) for s in systems}

    conv = r["convert"]
    if any(conv["seconds"][s]["tokens"] for s in systems):
        rows.append(Row("convert, tokens", "s", False, per(lambda s: conv["seconds"][s]["tokens"]), ".1f", 1.0))
        rows.append(Row("convert, documents", "s", False, per(lambda s: conv["seconds"][s]["docs"]), ".1f", 1.0))
    rows.append(Row("at rest, tokens", "MB", False, per(lambda s: [conv["at_rest"][s]["tokens"] / MB]), ".1f", 1.0))
    rows.append(Row("at rest, documents", "MB", False, per(lambda s: [conv["at_rest"][s]["docs"] / MB]), ".1f", 1.0))
    step = r["settings"]["step_ms"]
    warm = r.get("warm", {})
    if any(warm.get(s) for s in systems):
        for key, label, target in (
            ("w0_s0", "warm steps/s, main process, no step", None),
            (f"w0_s{step:g}", f"warm steps/s, main process, {step:g} ms step", 1.0),
            ("w2_s0", "warm steps/s, 2 workers, no step", None),
            (f"w2_s{step:g}", f"warm steps/s, 2 workers, {step:g} ms step", 1.5),
        ):
            rows.append(
                Row(label, "steps/s", True, per(lambda s, k=key: [x[k]["steps_per_s"] for x in warm[s]]), ".0f", target)
            )
        rows.append(
            Row(
                "warm peak PSS (main + workers)",
                "MB",
                False,
                per(lambda s: [x["peak_pss"] / MB for x in warm[s]]),
                ".0f",
            )
        )
    cold = r.get("cold", {})
    if any(cold.get(s) for s in systems):
        rows.append(
            Row(
                "cold epoch from throttled S3: first batch",
                "s",
                False,
                per(lambda s: [x["first_s"] for x in cold[s]]),
                ".2f",
            )
        )
        rows.append(Row("cold epoch: wall", "s", False, per(lambda s: [x["epoch_s"] for x in cold[s]]), ".1f"))
        rows.append(Row("cold epoch: fetched", "MB", False, per(lambda s: [x["bytes"] / MB for x in cold[s]]), ".1f"))
        rows.append(
            Row("cold epoch: peak PSS", "MB", False, per(lambda s: [x["peak_pss"] / MB for x in cold[s]]), ".0f")
        )
        rows.append(
            Row(
                "cold epoch: peak local disk", "MB", False, per(lambda s: [x["peak_disk"] / MB for x in cold[s]]), ".0f"
            )
        )
    ep = r.get("epochs", {})
    if any(ep.get(s) for s in systems):
        for i, label in enumerate(("epoch 1 (cold)", "epoch 2", "epoch 3")):
            rows.append(
                Row(
                    f"30% cache: fetched, {label}",
                    "MB",
                    False,
                    per(lambda s, i=i: [x["per_epoch"][i] / MB for x in ep[s] if len(x["per_epoch"]) > i]),
                    ".1f",
                )
            )
        rows.append(
            Row(
                "30% cache: fetched per epoch, mean of the epochs run",
                "MB",
                False,
                per(lambda s: [sum(x["per_epoch"]) / len(x["per_epoch"]) / MB for x in ep[s] if x["per_epoch"]]),
                ".1f",
                0.75,
            )
        )
        rows.append(
            Row(
                "30% cache: optimum per epoch (Belady, own order)",
                "MB",
                False,
                per(
                    lambda s: [
                        x["optimum"]["byte_miss_ratio"]
                        * x["optimum"]["used_per_epoch"]
                        * r["at_rest_bytes_tokens"][s]
                        / r["cached_form_bytes"][s]
                        / MB
                        for x in ep[s]
                        if x.get("optimum")
                    ]
                ),
                ".1f",
            )
        )
        rows.append(
            Row(
                "30% cache: peak PSS",
                "MB",
                False,
                per(lambda s: [x["peak_pss"] / MB for x in ep[s] if x.get("peak_pss")]),
                ".0f",
            )
        )
        rows.append(
            Row("30% cache: peak local disk", "MB", False, per(lambda s: [x["peak_disk"] / MB for x in ep[s]]), ".0f")
        )
    res = r.get("resume", {})
    sizes = r.get("resume_sizes", [])
    if sizes and any(res.get(s) for s in systems):
        for n in sizes:
            rows.append(
                Row(
                    f"resume at 50%, {n:,} samples: to first batch",
                    "ms",
                    False,
                    per(lambda s, n=n: [x["first_s"] * 1e3 for x in res[s].get(str(n), [])]),
                    ".0f",
                    1000.0,
                    absolute=True,
                )
            )
        small, large = str(sizes[0]), str(sizes[-1])

        def growth(s: str) -> list[float]:
            a, b = (
                summary([x["first_s"] for x in res[s].get(small, [])]),
                summary([x["first_s"] for x in res[s].get(large, [])]),
            )
            return [b[0] / a[0]] if a and b and a[0] else []

        rows.append(
            Row(
                f"resume growth {sizes[0]:,} -> {sizes[-1]:,} (ratio)",
                "x",
                False,
                per(growth),
                ".2f",
                1.10,
                absolute=True,
            )
        )
        rows.append(
            Row(
                f"resume at {sizes[-1]:,}: peak PSS",
                "MB",
                False,
                per(lambda s: [x["peak_pss"] / MB for x in res[s].get(large, [])]),
                ".0f",
            )
        )
        rows.append(
            Row(
                "resume: imports (not in the figure above)",
                "s",
                False,
                per(lambda s: [x["import_s"] for x in res[s].get(large, [])]),
                ".2f",
            )
        )
    return rows


def _vs_least_peer(values: dict[str, list[float]], peers: Sequence[str]) -> tuple[float | None, str | None]:
    """tierflow's median over the least peer's (CPU seconds, PSS), and that peer; None where either is missing."""
    medians = {s: _median(v) for s, v in values.items()}
    least = {p: medians[p] for p in peers if medians.get(p)}
    peer = min(least, key=least.__getitem__) if least else None
    ours = medians.get("tierflow")
    return (ours / least[peer] if ours is not None and peer else None), peer


def _median(values: list[float]) -> float | None:
    found = summary(values)
    return found[0] if found else None


def _check(ratio: float | None, target: float, higher: bool, what: str) -> str:
    if ratio is None:
        return f"{what}: -"
    met = ratio >= target if higher else ratio <= target
    return f"{'met' if met else 'MISSED'} ({what}: {ratio:.2f})"


def raw_tables(r: dict[str, Any]) -> list[str]:
    """The raw path's two tables (samples/s, peak PSS), one row per (data, mode), with issue 17's targets."""
    raw = r.get("raw") or {}
    systems = raw.get("systems") or []
    cells = raw.get("cells") or {}
    if not systems or not any(v for cell in cells.values() for v in cell.values()):
        return []
    peers = [p for p in RAW_PEERS if p in systems]
    names = [RAW_NAMES.get(s, s) for s in systems]
    rate = [
        "| data | mode | "
        + " | ".join(names)
        + " | tierflow ÷ best peer | tierflow ÷ hand-written | tierflow ÷ bound | target |",
        "|---|---|" + "---|" * len(systems) + "---|---|---|---|",
    ]
    cpu = [
        "| data | mode | " + " | ".join(names) + " | tierflow ÷ lowest peer |",
        "|---|---|" + "---|" * len(systems) + "---|",
    ]
    pss = [
        "| data | mode | " + " | ".join(names) + " | tierflow ÷ lowest peer | target |",
        "|---|---|" + "---|" * len(systems) + "---|---|",
    ]
    for key, cell in cells.items():
        kind, workers = key.rsplit("_w", 1)
        mode = RAW_MODES.get(int(workers), f"{workers} workers")
        rates = {s: [x["samples_per_s"] for x in cell.get(s, [])] for s in systems}
        med = {s: _median(v) for s, v in rates.items()}
        mine, bound = med.get("tierflow"), med.get("inram")
        known = {p: med[p] for p in peers if med.get(p)}
        best = max(known, key=known.get) if known else None
        vs_best = mine / known[best] if mine is not None and best else None
        vs_bound = mine / bound if mine is not None and bound else None
        hand = med.get("handmade")
        vs_hand = mine / hand if mine is not None and hand else None
        if int(workers) == 0:
            lit = med.get("litdata")
            checks = [_check(mine / lit if mine is not None and lit else None, 2.0, True, ">= 2 x LitData")]
            if kind == "tokens":
                checks.append(_check(vs_bound, 0.5, True, ">= 0.5 x bound"))
        else:
            checks = [_check(vs_bound, 0.9, True, ">= 0.9 x bound"), _check(vs_best, 1.5, True, ">= 1.5 x best peer")]
        rate.append(
            f"| {kind} | {mode} | "
            + " | ".join(spread(rates[s], ".1f", 1e-3) for s in systems)
            + f" | {f'{vs_best:.2f} (vs {best})' if vs_best is not None else '-'}"
            + f" | {f'{vs_hand:.2f}' if vs_hand is not None else '-'}"
            + f" | {f'{vs_bound:.2f}' if vs_bound is not None else '-'} | {'; '.join(checks)} |"
        )
        seconds = {s: [x.get("cpu_all_s", x["cpu_s"]) for x in cell.get(s, [])] for s in systems}
        cpu_ratio, cheapest = _vs_least_peer(seconds, peers)
        cpu.append(
            f"| {kind} | {mode} | "
            + " | ".join(spread(seconds[s], ".2f") for s in systems)
            + f" | {f'{cpu_ratio:.2f} (vs {cheapest})' if cpu_ratio is not None else '-'} |"
        )
        mem = {s: [x["peak_pss"] / MB for x in cell.get(s, []) if x.get("peak_pss")] for s in systems}
        ratio, lowest = _vs_least_peer(mem, peers)
        pss.append(
            f"| {kind} | {mode} | "
            + " | ".join(spread(mem[s], ".0f") for s in systems)
            + f" | {f'{ratio:.2f} (vs {lowest})' if ratio is not None else '-'}"
            + f" | {_check(ratio, 1.0, False, '<= lowest peer')} |"
        )
    counts = {
        s: sorted(
            {x["samples"] for cell_key, cell in cells.items() if cell_key.startswith("tokens") for x in cell.get(s, [])}
        )
        for s in systems
    }
    texts = {
        s: sorted(
            {x["samples"] for cell_key, cell in cells.items() if cell_key.startswith("text") for x in cell.get(s, [])}
        )
        for s in systems
    }
    lines = [
        "",
        "## Raw path",
        "",
        "One warm epoch of local data per fresh process (page cache warm, each system's local form), no "
        "training step, batch 8, every system at its defaults; samples/s after the first batch, in "
        "thousands, median (min-max) of the rounds. tokens: 2048-token byte-token samples; text: the "
        "documents as variable-length text records. The in-RAM list is the bound (not a peer).",
        "",
    ]
    lines += rate + ["", "Peak PSS summed over the child and its workers (MB), same runs:", ""] + pss
    lines += [
        "",
        "CPU seconds of the epoch after its first batch, the child and its workers together (living, or joined at the"
        " epoch's end: their CPU is then their parent's children's), same runs:",
        "",
    ] + cpu
    lines += [
        "",
        "Samples per epoch (tokens / text): "
        + ", ".join(
            f"{RAW_NAMES.get(s, s)} {'/'.join(map(str, counts[s])) or '-'} / {'/'.join(map(str, texts[s])) or '-'}"
            for s in systems
        )
        + ".",
    ]
    wds = raw.get("webdataset") or {}
    if wds.get("tokens", {}).get("shards"):
        lines += [
            "",
            "WebDataset shards (ShardWriter, maxsize = the shard size): "
            + ", ".join(
                f"{v} {w['shards']} tars, {w['at_rest'] / MB:.1f} MB"
                + (f", written in {w['seconds']:.1f} s" if "seconds" in w else "")
                for v, w in wds.items()
            )
            + ".",
        ]
    return lines


def markdown(r: dict[str, Any], rows: list[Row]) -> str:
    systems = r["systems"]
    settings = r["settings"]
    lines = [
        "# tierflow vs MosaicML Streaming vs LitData (and WebDataset on the raw path)",
        "",
        f"Corpus: {r['corpus']}. Shard size {settings['shard_mb']:g} MB (uncompressed) for every system; "
        f"batch 8 x 2048 tokens; shuffle on, seed {settings['seed']}; {settings['rounds']} round(s), systems "
        f"alternating within each; median (min-max). Cold epoch throttled to {settings['bandwidth_mb']:g} MB/s at "
        f"the proxy; 30% cache = {settings['cache_fraction']:.0%} of each system's dataset in its cached "
        f"(uncompressed) form, 3 epochs, unthrottled, 2 workers. Machine: {r['machine']}; run took "
        f"{r['wall_s'] / 60:.1f} min.",
        "",
        "| measure | unit | " + " | ".join(systems) + " | tierflow / better peer | target |",
        "|---|---|" + "---|" * len(systems) + "---|---|",
    ]
    for row in rows:
        ratio, best = row.ratio()
        ratio_text = f"{ratio:.2f} (vs {best})" if ratio is not None else "-"
        lines.append(
            f"| {row.label} | {row.unit} | "
            + " | ".join(spread(row.values.get(s, []), row.fmt) for s in systems)
            + f" | {ratio_text} | {row.verdict()} |"
        )
    stopped = [(s, x["stopped"]) for s in systems for x in r.get("epochs", {}).get(s, []) if x.get("stopped")]
    if stopped:
        lines += [
            "",
            "Stopped 30%-cache runs (the epoch figure is extrapolated from the part done): "
            + "; ".join(
                f"{s}: epoch {st['epoch'] + 1} stopped at "
                + (f"{st['fraction']:.1%} after {st['bytes'] / MB:.0f} MB" if st.get("fraction") else "its time limit")
                + (f" (crashed: {st['crashed']})" if st.get("crashed") else "")
                for s, st in stopped
            )
            + ".",
        ]
    if r.get("failures"):
        lines += ["", "Crashed children (each retried once in a fresh process): " + "; ".join(r["failures"]) + "."]
    shards = r["convert"]["shards"]
    lines += [
        "",
        "Shards (tokens / documents): "
        + ", ".join(f"{s} {shards[s]['tokens']} / {shards[s]['docs']}" for s in systems)
        + ".",
    ]
    lines += raw_tables(r)
    if r.get("notes"):
        lines += ["", r["notes"]]
    if r.get("reused"):
        lines += ["", f"Reused: {r['reused']} (this run measured the rest)."]
    lines += ["", "Versions: " + ", ".join(f"{k} {v}" for k, v in r["versions"].items()) + "."]
    return "\n".join(lines) + "\n"


def chart(r: dict[str, Any], rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = r["systems"]
    chosen = [row for row in rows if row.target is not None or "first batch" in row.label or "peak PSS" in row.label]
    chosen = [row for row in chosen if any(summary(row.values.get(s, [])) for s in systems)]
    cols = 3
    nrows = max(1, (len(chosen) + cols - 1) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 2.8 * nrows), squeeze=False)
    colors = {"tierflow": "#1f77b4", "streaming": "#ff7f0e", "litdata": "#2ca02c"}
    for ax, row in zip(axes.flat, chosen):
        meds, lows, highs = [], [], []
        for s in systems:
            st = summary(row.values.get(s, [])) or (0.0, 0.0, 0.0)
            meds.append(st[0])
            lows.append(st[0] - st[1])
            highs.append(st[2] - st[0])
        ax.bar(systems, meds, yerr=[lows, highs], color=[colors.get(s, "grey") for s in systems], capsize=3)
        positive = [m for m in meds if m > 0]
        if positive and max(positive) / min(positive) > 50:
            ax.set_yscale("log")
        better = "higher" if row.higher_better else "lower"
        ax.set_title(f"{row.label}\n({row.unit}, {better} is better)", fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(chosen) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def raw_chart(r: dict[str, Any], path: Path) -> bool:
    """The raw path's samples/s and peak PSS per (data, mode), bars with min-max whiskers."""
    raw = r.get("raw") or {}
    systems, cells = raw.get("systems") or [], raw.get("cells") or {}
    if not systems or not any(v for cell in cells.values() for v in cell.values()):
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {
        "inram": "#7f7f7f",
        "litdata": "#2ca02c",
        "webdataset": "#9467bd",
        "streaming": "#ff7f0e",
        "tierflow": "#1f77b4",
    }
    fig, axes = plt.subplots(2, len(cells), figsize=(3.6 * len(cells), 5.6), squeeze=False)
    for col, (key, cell) in enumerate(cells.items()):
        kind, workers = key.rsplit("_w", 1)
        for row, (field, scale, unit) in enumerate(
            (
                ("samples_per_s", 1e-3, "k samples/s, higher is better"),
                ("peak_pss", 1 / MB, "peak PSS MB, lower is better"),
            )
        ):
            ax = axes[row][col]
            meds, lows, highs = [], [], []
            for s in systems:
                st = summary([x[field] * scale for x in cell.get(s, []) if x.get(field)]) or (0.0, 0.0, 0.0)
                meds.append(st[0])
                lows.append(st[0] - st[1])
                highs.append(st[2] - st[0])
            ax.bar(systems, meds, yerr=[lows, highs], color=[colors.get(s, "grey") for s in systems], capsize=3)
            positive = [m for m in meds if m > 0]
            if positive and max(positive) / min(positive) > 50:
                ax.set_yscale("log")
            ax.set_title(f"raw, {kind}, {RAW_MODES.get(int(workers), workers)}\n({unit})", fontsize=8)
            ax.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_report(r: dict[str, Any], out_dir: Path) -> str:
    rows = build_rows(r)
    text = markdown(r, rows)
    (Path(out_dir) / "peers.md").write_text(text)
    chart(r, rows, Path(out_dir) / "peers.png")
    raw_chart(r, Path(out_dir) / "peers-raw.png")
    return text
