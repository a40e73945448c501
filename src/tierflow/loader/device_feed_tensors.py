"""How the device feed turns a batch's arrays into tensors: CPU tensors that view numpy arrays (no
copy; unsigned token ids as the signed type of the same width, which every torch op supports), and
widening by value (uint16 ids to int64), once per storage that several arrays view."""

from __future__ import annotations

import functools
import warnings
from typing import Any

import numpy as np
import torch

# Unsigned ids travel as the signed type of the same width (fully supported by
# every torch op) and are masked back to their value when widened.
_UNSIGNED_AS_SIGNED: dict[torch.dtype, tuple[torch.dtype, int]] = {
    torch.uint16: (torch.int16, 0xFFFF),
    torch.uint32: (torch.int32, 0xFFFFFFFF),
}
NUMPY_UNSIGNED: dict[np.dtype, tuple[type[np.signedinteger], torch.dtype]] = {
    np.dtype(np.uint16): (np.int16, torch.uint16),
    np.dtype(np.uint32): (np.int32, torch.uint32),
}
_SIGNED_NUMPY = {unsigned: signed for signed, unsigned in NUMPY_UNSIGNED.values()}
_UNSIGNED_NUMPY: dict[torch.dtype, np.dtype] = {torch.uint16: np.dtype(np.uint16), torch.uint32: np.dtype(np.uint32)}
_NUMPY_WIDE: dict[torch.dtype, np.dtype] = {torch.int32: np.dtype(np.int32), torch.int64: np.dtype(np.int64)}
"""Integer dtypes a CPU tensor widens to through numpy (a view, one astype, a tensor of the result)."""
TENSOR_KINDS = "biufc"


def host_tensor(value: Any) -> tuple[torch.Tensor, torch.dtype | None, int] | None:
    """A CPU tensor viewing `value`, the unsigned dtype it stands for, and bytes copied to make it.

    None means the value is not an array the feed moves (cursor dicts,
    strings, object arrays, tensors already on a device): it passes through.
    """
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in TENSOR_KINDS:
            return None
        copied = 0
        if not value.dtype.isnative:
            value = value.astype(value.dtype.newbyteorder("="))
            copied = value.nbytes
        elif any(stride < 0 for stride in value.strides):
            value = np.ascontiguousarray(value)
            copied = value.nbytes
        unsigned = NUMPY_UNSIGNED[value.dtype][1] if value.dtype in NUMPY_UNSIGNED else None
        return tensor_from_numpy(value, unsigned), unsigned, copied
    if isinstance(value, torch.Tensor) and value.device.type == "cpu":
        if value.dtype in _UNSIGNED_AS_SIGNED:
            return value.view(_UNSIGNED_AS_SIGNED[value.dtype][0]), value.dtype, 0
        return value, None, 0
    return None


def tensor_from_numpy(value: np.ndarray, unsigned: torch.dtype | None) -> torch.Tensor:
    if unsigned is not None:
        value = value.view(_SIGNED_NUMPY[unsigned])
    if value.flags.writeable:
        return torch.from_numpy(value)
    # Read-only views of mapped shards are fine: the feed never writes into them.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(value)


_EXACT_INTEGER_BITS = {
    torch.int32: 31,
    torch.int64: 63,
    torch.float16: 11,
    torch.bfloat16: 8,
    torch.float32: 24,
    torch.float64: 53,
}
_UNSIGNED_BITS = {torch.uint16: 16, torch.uint32: 32}


def check_widening(key: str, logical: torch.dtype, wide: torch.dtype) -> None:
    if logical in _UNSIGNED_BITS:  # torch.promote_types refuses the unsigned types
        lossless = _EXACT_INTEGER_BITS.get(wide, 0) >= _UNSIGNED_BITS[logical]
    else:
        try:
            lossless = torch.promote_types(logical, wide) == wide
        except RuntimeError:  # e.g. uint64, which torch does not promote
            lossless = False
    if not lossless:
        raise ValueError(f"device feed: cannot widen {key!r} from {logical} to {wide} without loss")


def _address(array: np.ndarray) -> int:
    """Where `array`'s first element lies (`array.ctypes.data` makes a ctypes object: ~2x slower)."""
    return array.__array_interface__["data"][0]


def widen_numpy(value: np.ndarray, wide: np.dtype, owners: dict[int, tuple[np.ndarray, int]]) -> tuple[np.ndarray, int]:
    """`value` as `wide`, by value, and the bytes widened for it now. Views of one contiguous array
    (input_ids and labels of a window buffer) widen that array once, kept in `owners` with its
    address, and come out as views of the result. The array is the views' root: it owns its
    memory, or views memory that is not an array's (one batch's rows of a run's buffer, made by
    `np.frombuffer`); one at most twice the view's size (a view of a much larger array widens alone)."""
    owner = value.base
    size = value.itemsize
    if (
        type(owner) is np.ndarray
        and type(owner.base) is not np.ndarray
        and owner.nbytes <= 2 * value.nbytes
        and owner.dtype == value.dtype
        and owner.flags.c_contiguous
        and not any(s < 0 or s % size for s in value.strides)
    ):
        found = owners.get(id(owner))
        made = 0
        if found is None:
            widened = owner.astype(wide)
            found = owners[id(owner)] = (widened, _address(owner))
            made = widened.nbytes
        widened, address = found
        wide_size = wide.itemsize
        return np.ndarray(
            value.shape,
            wide,
            buffer=widened,
            offset=(_address(value) - address) // size * wide_size,
            strides=tuple(s // size * wide_size for s in value.strides),
        ), made
    widened = value.astype(wide)
    return widened, widened.nbytes


@functools.cache
def torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


@functools.cache
def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return torch.empty(0, dtype=dtype).numpy().dtype


def storage_extent(tensor: torch.Tensor) -> int:
    """Elements of its storage a tensor's view reaches, from its first."""
    if tensor.numel() == 0:
        return 0
    return 1 + sum((n - 1) * stride for n, stride in zip(tensor.shape, tensor.stride()))


_DIRECT_UNSIGNED: dict[str, bool] = {}
"""Per device type: whether this torch converts uint16/uint32 tensors itself (2.3 and later do,
on CPU, in one pass); else they widen from their signed view and are masked back."""


def widened_tensor(tensor: torch.Tensor, unsigned: torch.dtype | None, wide: torch.dtype) -> torch.Tensor:
    """`tensor` (for unsigned ids: its signed view) as `wide`, by value."""
    if tensor.device.type == "cpu" and wide in _NUMPY_WIDE:  # numpy widens in one pass, ~2x torch's uint16 .to
        try:
            array = tensor.numpy()
        except (RuntimeError, TypeError):  # a tensor numpy cannot view (conjugate, bfloat16, ...)
            pass
        else:
            if unsigned is not None:
                array = array.view(_UNSIGNED_NUMPY[unsigned])
            return torch.from_numpy(array.astype(_NUMPY_WIDE[wide]))
    if unsigned is None:
        return tensor.to(wide)
    kind = tensor.device.type
    if _DIRECT_UNSIGNED.get(kind, True):
        try:
            widened = tensor.view(unsigned).to(wide)
            _DIRECT_UNSIGNED[kind] = True
            return widened
        except (RuntimeError, TypeError, NotImplementedError):
            _DIRECT_UNSIGNED[kind] = False
    mask = _UNSIGNED_AS_SIGNED[unsigned][1]
    through = torch.int64 if wide == torch.int64 or unsigned == torch.uint32 else torch.int32
    widened = tensor.to(through).bitwise_and_(mask)
    return widened.to(wide) if through != wide else widened
