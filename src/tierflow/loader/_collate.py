"""Dict-of-columns collation, and the batch as it crosses a DataLoader's worker boundary.

Numeric arrays of one shape are stacked, and with `pad` arrays of different lengths are padded
into one buffer (plus `<column>_lengths`): either way one copy, from the shard's mapped view into
the batch buffer. Strings, bytes, nested values and None stay Python lists. A built batch travels
as a `CarriedBatch` (its data and its meta), one message per batch (below).
"""

from __future__ import annotations

import functools
from typing import Any
from collections.abc import Mapping, Sequence

import numpy as np
import torch

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
                index: tuple[int | slice, ...] = (row, *(slice(0, n) for n in value.shape))
                out[index] = value
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
    return collate_columns({name: [s.get(name) for s in samples] for name in columns}, pad, pad_value)


def collate_columns(
    columns: Mapping[str, Sequence[Any]], pad: bool = False, pad_value: int | float = 0
) -> tuple[dict[str, Any], int]:
    """`collate_samples` of values already gathered column by column (a run's rows, no dict per sample)."""
    batch: dict[str, Any] = {}
    copied = 0
    for name, values in columns.items():
        column, lengths, nbytes = collate_column(values, pad, pad_value)
        batch[name] = column
        if lengths is not None:
            batch[f"{name}_lengths"] = lengths
        copied += nbytes
    return batch, copied


# -- crossing the boundary of a DataLoader the user built -------------------------------------
# (the Loader's own workers write batches into shared memory instead: loader/ring.py)
# DataLoader sends each tensor through its own shared-memory segment, and receiving a segment
# costs the main process a socket connection and an fd hand-over (~0.7 ms measured): with ~7
# arrays per batch that alone cost more than building the batch. A `CarriedBatch` (the user's
# data and, beside it, the batch's meta) pickles as one payload holding every numeric array of
# the data, and unpickles straight into a carrier of CPU tensors viewing that payload. DataLoader's
# own conversion leaves it alone (it is not a dict), so in a worker its arrays are still the numpy
# views the batcher made and a buffer shared by views (`input_ids`, `labels`) travels once.
#
# The payload is what the main process pays for per byte (the pipe read, pickle's copies), so a
# wide integer array whose values fit a narrower type travels narrow and is widened back to its
# own dtype on arrival (`position_ids` of a window batch: int32 values below L, uint16 on the
# wire, ~1/3 of a token batch's bytes). The receiver gets the dtypes the sender had, always.

_ALIGN = 64
SHARED_MEMORY_BYTES = 8 << 20
"""Payloads at least this large travel as one shared-memory tensor instead of inside the message."""
NARROW_MIN_ELEMENTS = 1024
"""Integer arrays of at least this many elements are checked for a narrower wire dtype (two passes
over them in the worker, min and max; smaller ones are not worth it)."""
_NARROWER = {
    np.dtype(t): tuple((np.dtype(n), int(np.iinfo(n).min), int(np.iinfo(n).max)) for n in narrower)
    for t, narrower in (
        (np.int64, (np.uint8, np.int8, np.uint16, np.int16, np.uint32, np.int32)),
        (np.int32, (np.uint8, np.int8, np.uint16, np.int16)),
        (np.uint64, (np.uint8, np.uint16, np.uint32)),
        (np.uint32, (np.uint8, np.uint16)),
    )
}

Layout = tuple[tuple[str, str, tuple[int, ...], tuple[int, ...], int, "str | None"], ...]
"""Per array: (key, wire dtype, shape, strides in the payload, start in the payload, and the dtype it
is widened back to on arrival or None when it travels as it is)."""


def _owning_base(array: np.ndarray) -> np.ndarray | None:
    """The contiguous array that owns `array`'s memory, when `array` is a view of one."""
    base = array.base
    if isinstance(base, np.ndarray) and base.base is None and base.flags.c_contiguous:
        return base
    return None


def placeable(array: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(`array`, the buffer it is copied from): native byte order (a batch travels, and arrives,
    in it: torch has no other), and a contiguous owner that its views share, so a buffer viewed by
    several columns is copied once; a view that is neither is made contiguous first."""
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    base = _owning_base(array)
    if base is None or any(s < 0 for s in array.strides):
        if array.base is None and array.flags.c_contiguous:
            base = array
        else:
            base = array = np.array(array, order="C")
    return array, base


def _address(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


def _as_array(value: Any) -> np.ndarray | None:
    """A numeric numpy view of `value` (numpy array or plain CPU tensor), None for anything else."""
    if isinstance(value, np.ndarray):
        return value if value.dtype.kind in _NUMERIC + "b" else None
    if (
        isinstance(value, torch.Tensor)
        and value.device.type == "cpu"
        and value.layout == torch.strided
        and not value.requires_grad
    ):
        try:
            return value.numpy()
        except TypeError:  # bfloat16 and other dtypes numpy lacks
            return None
    return None


def wire_dtype(array: np.ndarray) -> np.dtype | None:
    """The narrowest integer dtype holding every value of `array` when that is narrower than its own
    (and the array is large enough to be worth checking), else None."""
    narrower = _NARROWER.get(array.dtype)
    if narrower is None or array.size < NARROW_MIN_ELEMENTS:
        return None
    low, high = int(array.min()), int(array.max())
    for dtype, least, most in narrower:
        if least <= low and high <= most:
            return dtype
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

    @property
    def __dict__(self) -> dict[str, Any]:  # type: ignore[override]
        """A collator that reads a sample's attributes (the transformers Trainer's calls vars())
        was handed a whole tierflow batch: say what to do instead."""
        raise LoaderMisuseError(COLLATED_MESSAGE + TRAINER_HINT)


def pack_arrays(
    data: Mapping[str, Any], shared_memory_bytes: int = SHARED_MEMORY_BYTES
) -> tuple[Any, Layout, dict[str, Any], tuple[str, ...]]:
    """(payload, layout, other values, key order): every numeric array of `data` in one buffer,
    each owning buffer once however many views of it there are, a standalone integer array in the
    narrowest dtype its values fit (`wire_dtype`); `unpack_arrays` rebuilds it."""
    placed: dict[int, tuple[np.ndarray, int, np.dtype | None]] = {}
    layout: list[tuple[str, str, tuple[int, ...], tuple[int, ...], int, str | None]] = []
    rest: dict[str, Any] = {}
    size = 0
    for name, value in data.items():
        array = _as_array(value)
        if array is None:
            rest[name] = value
            continue
        array, base = placeable(array)
        found = placed.get(id(base))
        if found is None:
            narrow = wire_dtype(base) if base is array else None
            size = -(-size // _ALIGN) * _ALIGN
            found = placed[id(base)] = (base, size, narrow)
            size += base.size * narrow.itemsize if narrow is not None else base.nbytes
        _, at, narrow = found
        if narrow is not None:  # a standalone array: C-contiguous in its wire dtype
            strides = tuple(s // array.itemsize * narrow.itemsize for s in array.strides)
            layout.append((name, narrow.str, array.shape, strides, at, array.dtype.str))
            continue
        start = at if base is array else at + _address(array) - _address(base)
        layout.append((name, array.dtype.str, array.shape, array.strides, start, None))
    size = -(-size // _ALIGN) * _ALIGN
    if size >= shared_memory_bytes:
        # made in shared memory, as torch's own collate does: share_memory_() on a fresh tensor moves
        # it there, a second copy of the batch (~9 ms of CPU for a 64 x 224 x 224 x 3 image batch)
        payload: Any = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(size))
        view = payload.numpy()
        for base, start, narrow in placed.values():
            if narrow is None:
                view[start : start + base.nbytes] = base.reshape(-1).view(np.uint8)
            else:
                np.copyto(
                    view[start : start + base.size * narrow.itemsize].view(narrow), base.reshape(-1), casting="unsafe"
                )
        return payload, tuple(layout), rest, tuple(data)
    # one bytes object, each array copied into it once (pickle, protocol 4, would copy a bytearray
    # into a bytes object anyway)
    parts: list[Any] = []
    end = 0
    for base, start, narrow in placed.values():
        if start > end:
            parts.append(bytes(start - end))
        wire = base if narrow is None else base.astype(narrow)
        parts.append(wire.reshape(-1).view(np.uint8).data)
        end = start + wire.nbytes
    if size > end:
        parts.append(bytes(size - end))
    return b"".join(parts), tuple(layout), rest, tuple(data)


def unpack_arrays(payload: Any, layout: Layout, rest: Mapping[str, Any], keys: Sequence[str]) -> dict[str, Any]:
    """The dict `pack_arrays` packed, plus the rest: each array a CPU tensor viewing one writable
    tensor of the whole payload, so keys that shared a buffer when sent (input_ids, labels) share one
    storage again, and a shared-memory payload's stay shared (is_shared, no copy on a re-send); an
    array that travelled narrow is widened back into its own."""
    # bytearray: writable, as the loop may write into its tensors
    whole = payload if isinstance(payload, torch.Tensor) else torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    typed: dict[np.dtype, Any] = {}
    values: dict[str, Any] = dict(rest)
    for name, dtype_str, shape, strides, start, own in layout:
        dtype = _dtype(dtype_str)
        size = dtype.itemsize
        if own is None and not start % size and not any(s % size for s in strides):
            view = typed.get(dtype)
            if view is None:
                view = typed[dtype] = whole.view(_torch_dtype(dtype))
            values[name] = view.as_strided(shape, tuple(s // size for s in strides), start // size)
            continue
        array = np.ndarray(shape, dtype=dtype, buffer=whole.numpy(), offset=start, strides=strides)
        values[name] = torch.from_numpy(array.astype(_dtype(own)) if own is not None else array)
    return {key: values[key] for key in keys}


@functools.cache
def _torch_dtype(dtype: np.dtype) -> Any:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


@functools.cache
def _dtype(dtype_str: str) -> np.dtype:
    """The numpy dtype of an array's dtype string (the receiving process's per-array lookup)."""
    return np.dtype(dtype_str)


def _unpack_carried(
    payload: Any, layout: Layout, rest: Mapping[str, Any], keys: Sequence[str], meta: Any
) -> CarriedBatch:
    return CarriedBatch(unpack_arrays(payload, layout, rest, keys), meta)


COLLATED_MESSAGE = (
    "a DataLoader tried to collate tierflow batches: a TieredDataset builds whole batches itself (its "
    "batch_size), and DataLoader's batch_size (default 1) would stack batches of batches. Iterate "
    "tierflow.Loader(ds, num_workers=...) instead (it keeps the resume cursor), or pass "
    "DataLoader(ds, batch_size=None) and read item.data / item.meta"
)
TRAINER_HINT = (
    "; under the transformers Trainer pass the Loader: "
    "tierflow.integrations.transformers.TierflowTrainer(train_loader=Loader(dataset)) (docs/frameworks.md)"
)


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
