"""What a start reads of every shard, summarised in the version-3 header (issue 38): the largest
shards at rest and decoded (the working set, the staging area and the decoded bound count the
largest few) and the sum of every shard's largest decoded block (the block groups' mean). With them a
rank's start reads no whole column of sizes; a header written before them reads the columns.

The summary is covered by the header's checksum, checked for its shape at open, and recomputed by
`tierflow verify`; it sizes caches and bounds, never where a sample lies."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from tierflow.format.metadata_layout import largest_blocks, ordered_counts

TOP_SHARDS = 256
"""Largest shards the summary lists per size column: above the widest working set's 129."""
SIZE_COLUMNS = ("bytes", "decoded_bytes")
SUMMARY_COLUMNS = (*SIZE_COLUMNS, "largest_rows", "samples")
"""The shard-table columns the summary is made from."""


def summary_fields(shard_columns: dict[str, np.ndarray]) -> dict[str, Any]:
    """The header's `summary` of a dataset's shard columns (pack, upgrade)."""
    fields: dict[str, Any] = {}
    for name in SIZE_COLUMNS:
        values = np.asarray(shard_columns[name], dtype=np.int64)
        count = min(TOP_SHARDS, values.size)
        top = np.sort(np.partition(values, values.size - count)[values.size - count :])[::-1] if count else values[:0]
        fields[name] = [int(v) for v in top]
    blocks = largest_blocks(
        np.asarray(shard_columns["decoded_bytes"], dtype=np.int64),
        np.asarray(shard_columns["largest_rows"], dtype=np.int64),
        np.asarray(shard_columns["samples"], dtype=np.int64),
    )
    fields["largest_blocks"] = int(blocks.sum(dtype=np.int64))
    return fields


def check_summary(summary: Any, shards: int, fail: Callable[[str], Exception]) -> None:
    """The header's `summary`, when it has one: per size column the largest min(TOP_SHARDS, shards)
    sizes, falling; the largest blocks' sum a count."""
    if summary is None:
        return
    if not isinstance(summary, dict) or set(summary) != {*SIZE_COLUMNS, "largest_blocks"}:
        raise fail(f'"summary" is not the largest {SIZE_COLUMNS} and the largest blocks\' sum')
    for name in SIZE_COLUMNS:
        top = summary[name]
        if not isinstance(top, list) or len(top) != min(TOP_SHARDS, shards) or not ordered_counts(top, falling=True):
            raise fail(f"summary.{name} is not the {min(TOP_SHARDS, shards)} largest sizes, falling")
    if type(summary["largest_blocks"]) is not int or summary["largest_blocks"] < 0:
        raise fail("summary.largest_blocks is not a count")


def verify_summary(tables: Any) -> list[str]:
    """The header's summary against the columns it summarises (`tierflow verify`)."""
    recorded = tables.header.get("summary")
    if recorded is None:
        return []
    wanted = summary_fields({name: tables.column(name) for name in SUMMARY_COLUMNS})
    return [
        f"{tables.where}: summary.{key} is not what the shard table's columns give"
        for key in wanted
        if recorded[key] != wanted[key]
    ]
