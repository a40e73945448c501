"""Bulk reads through a dataset's index, for batchers that read many samples or windows at once.

`TokenReader` copies token ranges straight from the mapped blocks into a caller's buffer (one
copy, also across blocks and shards, where `Dataset.tokens` would concatenate); `SampleLengths`
gives a list column's lengths by sample id from the blocks' offsets alone (no values read).
Both locate a whole batch with one vectorised index lookup and keep nothing of their own: the
views they read are the table's, made once per loaded block and dropped with it (holding them
here would hold the shard's mapping, and with it its tier pin).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from tierflow.format.table import ShardTable

if TYPE_CHECKING:
    from tierflow.format.dataset import Dataset


def _by_block(flat: np.ndarray) -> list[np.ndarray]:
    """Positions of `flat` grouped by value (its block), each group in input order."""
    order = np.argsort(flat, kind="stable")
    return np.split(order, np.flatnonzero(np.diff(flat[order])) + 1) if order.size else []


class TokenReader:
    """Copies token ranges of a dataset into a caller's buffer; counts the slices it copied."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset
        self.column = dataset.token_column
        self.pieces = 0

    def copy_windows(
        self, out: np.ndarray, starts: np.ndarray, row_pieces: np.ndarray | None = None, groups: int = 0
    ) -> None:
        """out[r] = tokens[starts[r] : starts[r] + out.shape[1]] for every row: one slice copy per
        block a row touches (almost always one). One index lookup for the batch; each shard is
        opened and each block's values taken once per call, or with `groups` once per group of that
        many rows (a run's batches: a shard stays open, and its tier entry in use, while the batch
        that reads it is built, as when each is read alone). `row_pieces` (ones, one per row), when
        given, gets each row's slices counted (a row crossing into the next block adds one each)."""
        width = out.shape[1]
        begins = starts.tolist()
        if not begins:
            return
        last = max(begins)
        if last + width > self.dataset.num_tokens:
            raise IndexError(
                f"{self.dataset.location}: a window of {width} tokens from {last} "
                f"runs past the stream end {self.dataset.num_tokens}"
            )
        column, dataset, pieces = self.column, self.dataset, 0
        tables: dict[int, ShardTable] = {}
        views: dict[int, np.ndarray] = {}  # block's first token -> its values from there
        rows = dataset.index.token_blocks(starts).tolist()
        for row, start, (shard, block, first, end) in zip(range(len(begins)), begins, rows):
            if groups and row and not row % groups:
                tables, views = {}, {}  # the last group's shards let go
            values = views.get(first)
            if values is None:
                table = tables.get(shard)
                if table is None:
                    table = tables[shard] = dataset.shard(shard)
                values = views[first] = table.list_values(block, column)
            at = start - first
            if start + width <= end:
                out[row] = values[at : at + width]
                pieces += 1
                continue
            target = out[row]
            done = end - start  # the rest from the blocks after, in this shard or the next
            target[:done] = values[at : at + done]
            pieces += 1
            while done < width:
                shard, block, first, end = dataset.index.token_blocks(np.array([start + done])).tolist()[0]
                table = tables.get(shard)
                if table is None:
                    table = tables[shard] = dataset.shard(shard)
                values = table.list_values(block, column)
                take = min(width - done, end - first)
                target[done : done + take] = values[:take]
                done += take
                pieces += 1
                if row_pieces is not None:
                    row_pieces[row] += 1
        self.pieces += pieces


class SampleLengths:
    """Lengths of one list column by global sample id, from each block's offsets (no values read)."""

    def __init__(self, dataset: Dataset, column: str) -> None:
        self.dataset = dataset
        self.column = column

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        out = np.empty(ids.size, dtype=np.int64)
        index = self.dataset.index
        shards, blocks, rows = index.locate_samples(ids)
        for here in _by_block(index.first_block[shards] + blocks):
            first = int(here[0])
            offsets, _ = self.dataset.shard(int(shards[first])).list_parts(int(blocks[first]), self.column)
            r = rows[here]
            out[here] = offsets[r + 1] - offsets[r]
        return out
