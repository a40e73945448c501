"""Dict-of-columns collation: samples (dicts of numpy views, scalars, strings) into one batch.

Numeric arrays of one shape are stacked, and with `pad` arrays of different lengths are padded
into one buffer (plus `<column>_lengths`): either way one copy, from the shard's mapped view into
the batch buffer. Strings, bytes, nested values and None stay Python lists.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

_NUMERIC = "biuf"


def collate_column(values: Sequence[Any], pad: bool, pad_value: int | float) -> tuple[Any, np.ndarray | None, int]:
    """(collated column, per-row lengths when padded, bytes copied)."""
    if values and all(isinstance(v, np.ndarray) and v.dtype.kind in _NUMERIC for v in values):
        shapes = {v.shape for v in values}
        dtype = np.result_type(*{v.dtype for v in values})
        if len(shapes) == 1:
            out = np.empty((len(values), *values[0].shape), dtype=dtype)
            for row, value in enumerate(values):
                out[row] = value
            return out, None, out.nbytes
        if pad and len({v.ndim for v in values}) == 1:
            longest = tuple(max(v.shape[d] for v in values) for d in range(values[0].ndim))
            out = np.full((len(values), *longest), pad_value, dtype=dtype)
            for row, value in enumerate(values):
                out[(row, *(slice(0, n) for n in value.shape))] = value
            lengths = np.array([v.shape[0] if v.ndim else 1 for v in values], dtype=np.int32)
            return out, lengths, sum(v.nbytes for v in values)
        return list(values), None, 0
    if values and all(isinstance(v, (bool, int, float, np.number, np.bool_)) for v in values):
        return np.asarray(values), None, 0
    return list(values), None, 0


def collate_samples(
    samples: Sequence[Mapping[str, Any]], columns: Sequence[str], pad: bool = False, pad_value: int | float = 0
) -> tuple[dict[str, Any], int]:
    """(batch as dict of columns, bytes copied into batch buffers)."""
    batch: dict[str, Any] = {}
    copied = 0
    for name in columns:
        column, lengths, nbytes = collate_column([s.get(name) for s in samples], pad, pad_value)
        batch[name] = column
        if lengths is not None:
            batch[f"{name}_lengths"] = lengths
        copied += nbytes
    return batch, copied
