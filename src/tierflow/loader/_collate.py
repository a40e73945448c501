"""Dict-of-columns collation, and the batch as it crosses the DataLoader worker boundary.

Numeric arrays of one shape are stacked, and with `pad` arrays of different lengths are padded
into one buffer (plus `<column>_lengths`): either way one copy, from the shard's mapped view into
the batch buffer. Strings, bytes, nested values and None stay Python lists. A built batch travels
as a `CarriedBatch` (its data and its meta), one message per batch (below).
"""

from __future__ import annotations

import functools
from typing import Any, Mapping, Sequence

import numpy as np

from tierflow.errors import LoaderMisuseError

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


# -- crossing the DataLoader worker boundary ------------------------------------------------
# DataLoader sends each tensor through its own shared-memory segment, and receiving a segment
# costs the main process a socket connection and an fd hand-over (~0.7 ms measured): with ~7
# arrays per batch that alone cost more than building the batch. A `CarriedBatch` (the user's
# data and, beside it, the batch's meta) pickles as one payload holding every numeric array of
# the data, and unpickles straight into a carrier of CPU tensors viewing that payload. DataLoader's
# own conversion leaves it alone (it is not a dict), so in a worker its arrays are still the numpy
# views the batcher made and a buffer shared by views (`input_ids`, `labels`) travels once.

_ALIGN = 64
SHARED_MEMORY_BYTES = 8 << 20
"""Payloads at least this large travel as one shared-memory tensor instead of inside the message."""

Layout = tuple[tuple[str, str, tuple[int, ...], tuple[int, ...], int], ...]


def _owning_base(array: np.ndarray) -> np.ndarray | None:
    """The contiguous array that owns `array`'s memory, when `array` is a view of one."""
    base = array.base
    if isinstance(base, np.ndarray) and base.base is None and base.flags.c_contiguous:
        return base
    return None


def _address(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


def _as_array(value: Any) -> np.ndarray | None:
    """A numeric numpy view of `value` (numpy array or plain CPU tensor), None for anything else."""
    if isinstance(value, np.ndarray):
        return value if value.dtype.kind in _NUMERIC + "b" else None
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is the loader's dependency
        return None
    if isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.layout == torch.strided \
            and not value.requires_grad:
        try:
            return value.numpy()
        except TypeError:  # bfloat16 and other dtypes numpy lacks
            return None
    return None


class CarriedBatch:
    """One output batch on its way to the training loop: the user's `data` (a dict of columns)
    and, beside it, its `meta` (a `BatchMeta`); crosses the worker boundary as one message."""

    __slots__ = ("data", "meta", "shared_memory_bytes")

    def __init__(self, data: dict[str, Any], meta: Any, shared_memory_bytes: int = SHARED_MEMORY_BYTES) -> None:
        self.data = data
        self.meta = meta
        self.shared_memory_bytes = shared_memory_bytes

    def __reduce__(self) -> tuple[Any, ...]:
        return _unpack_carried, (*pack_arrays(self.data, self.shared_memory_bytes), self.meta)

    def __repr__(self) -> str:
        return f"CarriedBatch(keys={list(self.data)}, meta={self.meta!r})"


def pack_arrays(data: Mapping[str, Any], shared_memory_bytes: int = SHARED_MEMORY_BYTES
                ) -> tuple[Any, Layout, dict[str, Any], tuple[str, ...]]:
    """(payload, layout, other values, key order): every numeric array of `data` in one buffer,
    each owning buffer once however many views of it there are; `unpack_arrays` rebuilds it."""
    placed: dict[int, tuple[np.ndarray, int]] = {}
    layout = []
    rest: dict[str, Any] = {}
    size = 0
    for name, value in data.items():
        array = _as_array(value)
        if array is None:
            rest[name] = value
            continue
        base = _owning_base(array)
        if base is None or any(s < 0 for s in array.strides):
            base = array = np.array(array, order="C")
        if id(base) not in placed:
            size = -(-size // _ALIGN) * _ALIGN
            placed[id(base)] = (base, size)
            size += base.nbytes
        start = placed[id(base)][1] + _address(array) - _address(base)
        layout.append((name, array.dtype.str, array.shape, array.strides, start))
    size = -(-size // _ALIGN) * _ALIGN
    if size >= shared_memory_bytes:
        import torch

        # made in shared memory, as torch's own collate does: share_memory_() on a fresh tensor moves
        # it there, a second copy of the batch (~9 ms of CPU for a 64 x 224 x 224 x 3 image batch)
        payload: Any = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(size))
        view = payload.numpy()
    else:
        payload = bytearray(size)
        view = np.frombuffer(payload, dtype=np.uint8)
    for base, start in placed.values():
        view[start:start + base.nbytes] = base.reshape(-1).view(np.uint8)
    return payload, tuple(layout), rest, tuple(data)


def unpack_arrays(payload: Any, layout: Layout, rest: Mapping[str, Any], keys: Sequence[str]) -> dict[str, Any]:
    """The dict `pack_arrays` packed: CPU tensors viewing one payload storage (no copy), plus the rest."""
    import torch

    if isinstance(payload, torch.Tensor):
        whole = payload
    else:
        whole = torch.frombuffer(payload, dtype=torch.uint8) if len(payload) else torch.empty(0, dtype=torch.uint8)
    values: dict[str, Any] = dict(rest)
    for name, dtype_str, shape, strides, start in layout:
        dtype, torch_dtype = _dtypes(dtype_str)
        size = dtype.itemsize
        if start % size or any(s % size for s in strides):
            array = np.ndarray(shape, dtype=dtype, buffer=whole.numpy(), offset=start, strides=strides)
            values[name] = torch.from_numpy(array)
            continue
        values[name] = whole.view(torch_dtype).as_strided(shape, tuple(s // size for s in strides), start // size)
    return {key: values[key] for key in keys}


@functools.cache
def _dtypes(dtype_str: str) -> tuple[np.dtype, Any]:
    """(numpy dtype, torch dtype) of an array's dtype string (the receiving process's per-batch lookup)."""
    import torch

    dtype = np.dtype(dtype_str)
    return dtype, torch.from_numpy(np.empty(0, dtype=dtype)).dtype


def _unpack_carried(payload: Any, layout: Layout, rest: Mapping[str, Any], keys: Sequence[str],
                    meta: Any) -> CarriedBatch:
    return CarriedBatch(unpack_arrays(payload, layout, rest, keys), meta)


COLLATED_MESSAGE = (
    "a DataLoader tried to collate tierflow batches: a TieredDataset builds whole batches itself (its "
    "batch_size), and DataLoader's batch_size (default 1) would stack batches of batches. Iterate "
    "tierflow.Loader(ds, num_workers=...) instead (it keeps the resume cursor), or pass "
    "DataLoader(ds, batch_size=None) and read item.data / item.meta")


def _refuse_collate(batch: Sequence[Any], *, collate_fn_map: Any = None) -> Any:
    raise LoaderMisuseError(COLLATED_MESSAGE)


def _register_refusal() -> None:
    """torch's default_collate looks a type up in this map: a plain DataLoader(ds, batch_size=8)
    then fails with a message that says what to do, not deep inside torch's collate."""
    try:
        from torch.utils.data._utils.collate import default_collate_fn_map
    except ImportError:  # another torch layout: its own collate error remains
        return
    default_collate_fn_map.setdefault(CarriedBatch, _refuse_collate)


_register_refusal()
