"""Merging metric snapshots from several processes, kept apart so metrics.py holds only the primitives."""

from __future__ import annotations

from typing import Any
from collections.abc import Callable, Iterable, Mapping

SNAPSHOT_SCHEMA = 1
"""The version of a snapshot's layout; `merge_snapshots` refuses any other."""

LabelKey = tuple[tuple[str, str], ...]


def merge_snapshots(snapshots: Iterable[Mapping[str, Any]], drop_labels: Iterable[str] = ()) -> dict[str, Any]:
    """Add snapshots from several processes: counters and histogram buckets sum exactly.

    Entries with equal name and labels combine; `drop_labels` (e.g. ("rank",))
    removes labels first, so per-rank series add up to a per-node one. Gauges
    combine by their own `aggregate` rule. Histograms must share a bucket layout.
    """
    dropped = set(drop_labels)
    counters: dict[tuple[str, LabelKey], dict[str, Any]] = {}
    gauges: dict[tuple[str, LabelKey], dict[str, Any]] = {}
    histograms: dict[tuple[str, LabelKey], dict[str, Any]] = {}
    descriptions: dict[str, str] = {}

    def keyed(entry: Mapping[str, Any]) -> tuple[tuple[str, LabelKey], dict[str, str]]:
        labels = {k: v for k, v in entry["labels"].items() if k not in dropped}
        return (entry["name"], tuple(sorted(labels.items()))), labels

    for snapshot in snapshots:
        if snapshot.get("schema") != SNAPSHOT_SCHEMA:
            raise ValueError(f"metrics snapshot schema {snapshot.get('schema')!r} is not {SNAPSHOT_SCHEMA}")
        for name, text in snapshot.get("descriptions", {}).items():
            descriptions.setdefault(name, text)
        for entry in snapshot["counters"]:
            key, labels = keyed(entry)
            if key in counters:
                counters[key]["value"] += entry["value"]
            else:
                counters[key] = {"name": entry["name"], "labels": labels, "value": entry["value"]}
        for entry in snapshot["gauges"]:
            key, labels = keyed(entry)
            if key not in gauges:
                gauges[key] = {**entry, "labels": labels}
                continue
            merged = gauges[key]
            if merged["aggregate"] != entry["aggregate"]:
                raise ValueError(
                    f"gauge {entry['name']} {labels} is merged with both {merged['aggregate']} and {entry['aggregate']}"
                )
            combines: dict[str, Callable[[float, float], float]] = {"sum": lambda a, b: a + b, "max": max, "min": min}
            combine = combines[merged["aggregate"]]
            merged["value"] = combine(merged["value"], entry["value"])
        for entry in snapshot["histograms"]:
            key, labels = keyed(entry)
            if key not in histograms:
                histograms[key] = {**entry, "labels": labels, "buckets": [list(b) for b in entry["buckets"]]}
                continue
            merged = histograms[key]
            if merged["layout"] != entry["layout"]:
                raise ValueError(
                    f"histogram {entry['name']} {labels} has bucket layouts {merged['layout']} and {entry['layout']}"
                )
            buckets = dict((i, c) for i, c in merged["buckets"])
            for index, count in entry["buckets"]:
                buckets[index] = buckets.get(index, 0) + count
            merged["buckets"] = [[i, buckets[i]] for i in sorted(buckets)]
            merged["count"] += entry["count"]
            merged["sum"] += entry["sum"]
            merged["min"] = _optional(min, merged["min"], entry["min"])
            merged["max"] = _optional(max, merged["max"], entry["max"])

    def ordered(entries: dict[tuple[str, LabelKey], dict[str, Any]]) -> list[dict[str, Any]]:
        return [entries[key] for key in sorted(entries)]

    return {
        "schema": SNAPSHOT_SCHEMA,
        "counters": ordered(counters),
        "gauges": ordered(gauges),
        "histograms": ordered(histograms),
        "descriptions": descriptions,
    }


def _optional(pick: Any, a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    if b is None:
        return a
    return pick(a, b)
