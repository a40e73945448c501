"""A worker's ring of batch slots in shared memory: arrays written in place, viewed in place.

A worker's `Arena` is an anonymous memory file (memfd; an unlinked file in /dev/shm where memfd
is not offered) cut into equal slots. It has no name, so nothing is left behind however its
processes end: the memory goes with the last descriptor and mapping. The worker hands the
descriptor to the training process once (SCM_RIGHTS over their socket); from then on a batch is
its arrays copied once into a slot (`Arena.write`) and one small message saying where
(`Layout`), and the training process views them where they lie (`view_batch`): no pickling of
arrays, no per-array segment. Views of one buffer (`input_ids` and `labels` of a token batch)
stay views of one place in the slot. A column of strings (or bytes) travels in the slot too, as
its UTF-8 bytes end to end and their offsets, so a batch of long documents is no large message
(one that outgrows the socket's buffer would hold its worker until the loop reads it).
"""

from __future__ import annotations

import functools
import mmap
import os
import tempfile
from typing import Any
from collections.abc import Mapping, Sequence

import numpy as np

from tierflow.loader._collate import _address, _as_array, placeable

_ALIGN = 64
_PAGE = mmap.PAGESIZE
SLOT_HEADROOM = 1.25
"""A new arena's slots hold its first batch this many times over, so a slightly larger later batch
(a longer padded shape) still fits; a batch that does not fit makes a new arena."""

Layout = tuple[tuple[str, str, tuple[int, ...], tuple[int, ...], int, int, int], ...]
"""Per array: (key, dtype, shape, strides, start in the slot, and the start and bytes of the buffer
it views); a text column's dtype is "str" or "bytes", its shape (rows,), and it starts at its
offsets (int64, rows + 1) followed by its bytes."""
_TEXT: dict[type, str] = {str: "str", bytes: "bytes"}
Placed = np.ndarray | list[Any]
"""What `Arena.write` copies into a slot: an array's owning buffer, or a text column's values' bytes."""


def anonymous_memory(nbytes: int) -> int:
    """A descriptor of `nbytes` of shared memory with no name anywhere (memfd, else an unlinked file)."""
    create = getattr(os, "memfd_create", None)
    if create is not None:
        fd = create("tierflow-ring", getattr(os, "MFD_CLOEXEC", 0))
    else:
        with tempfile.NamedTemporaryFile(dir="/dev/shm" if os.path.isdir("/dev/shm") else None, delete=True) as f:
            fd = os.dup(f.fileno())
    os.ftruncate(fd, nbytes)
    return fd


class Arena:
    """`slots` slots of `slot_bytes` each in one shared mapping of `fd` (the caller keeps `fd`)."""

    def __init__(self, fd: int, slots: int, slot_bytes: int, generation: int) -> None:
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.generation = generation
        # Not MADV_DONTFORK, though a worker forked later then keeps these pages until it ends: a
        # forked child still inherits this object, and when its cycle collector frees it, munmap
        # would remove whatever the child had mapped since at the same address (its own ring).
        self.map = mmap.mmap(fd, slots * slot_bytes)
        self._whole = np.frombuffer(self.map, dtype=np.uint8)

    @staticmethod
    def sized_for(nbytes: int) -> int:
        """Slot bytes for a batch of `nbytes`, with headroom, in whole pages."""
        want = int(nbytes * SLOT_HEADROOM) + _PAGE
        return -(-want // _PAGE) * _PAGE

    def slot(self, index: int) -> np.ndarray:
        """Slot `index` as a fresh uint8 array (every view made from it keeps it, and so the slot, alive)."""
        start = index * self.slot_bytes
        return np.frombuffer(self.map, dtype=np.uint8, count=self.slot_bytes, offset=start)

    def write(self, index: int, placed: Sequence[tuple[Placed, int]]) -> None:
        """Copy each placed buffer to its start in slot `index` (a text column's values one after
        another, straight from their blocks: no joined copy of the column first)."""
        offset = index * self.slot_bytes
        whole, mapped = self._whole, self.map
        for base, start in placed:
            at = offset + start
            if isinstance(base, list):
                for piece in base:
                    end = at + len(piece)
                    mapped[at:end] = piece
                    at = end
            else:
                whole[at : at + base.nbytes] = base.reshape(-1).view(np.uint8)


def lay_out(data: Mapping[str, Any]) -> tuple[list[tuple[Placed, int]], Layout, dict[str, Any], int]:
    """(buffers and their starts, layout, other values, bytes): every numeric array of `data` placed
    in one slot, each owning buffer once however many views of it there are."""
    placed: dict[int, tuple[Placed, int]] = {}
    layout: list[tuple[str, str, tuple[int, ...], tuple[int, ...], int, int, int]] = []
    rest: dict[str, Any] = {}
    size = 0
    for name, value in data.items():
        array = _as_array(value)
        if array is None:
            text = _text_column(value)
            if text is None:
                rest[name] = value
                continue
            kind, offsets, pieces = text
            size = -(-size // _ALIGN) * _ALIGN
            placed[id(offsets)] = (offsets, size)
            placed[id(pieces)] = (pieces, size + offsets.nbytes)
            layout.append((name, kind, (len(value),), (), size, size, 0))
            size += offsets.nbytes + int(offsets[-1])
            continue
        array, base = placeable(array)
        found = placed.get(id(base))
        if found is None:
            size = -(-size // _ALIGN) * _ALIGN
            found = placed[id(base)] = (base, size)
            size += base.nbytes
        start = found[1] + _address(array) - _address(base)
        layout.append((name, array.dtype.str, array.shape, array.strides, start, found[1], base.nbytes))
    return list(placed.values()), tuple(layout), rest, size


def view_batch(
    slot: np.ndarray, layout: Layout, rest: Mapping[str, Any], keys: Sequence[str], copy: bool = False
) -> dict[str, Any]:
    """The batch `write`/`lay_out` put in `slot`: numpy views of it (copies with `copy`), in key order.
    Views of one buffer in the worker (`input_ids` and `labels` of a window buffer) are views of one
    array of their dtype here too, which owns no other memory, so the device feed widens it once."""
    values: dict[str, Any] = dict(rest)
    roots: dict[tuple[int, str], np.ndarray] = {}
    for name, dtype_str, shape, strides, start, base_start, base_bytes in layout:
        if dtype_str in ("str", "bytes"):
            values[name] = _read_text(slot, dtype_str, shape[0], start)
            continue
        dtype = _dtype(dtype_str)
        root = roots.get((base_start, dtype_str))
        if root is None and base_bytes % dtype.itemsize == 0:  # of a memoryview: it keeps the slot alive
            root = roots[base_start, dtype_str] = np.frombuffer(slot.data[base_start : base_start + base_bytes], dtype)
        if root is None:
            array = np.ndarray(shape, dtype=dtype, buffer=slot, offset=start, strides=strides)
        else:
            array = np.ndarray(shape, dtype=dtype, buffer=root, offset=start - base_start, strides=strides)
        values[name] = array.copy() if copy else array
    return {key: values[key] for key in keys}


def _text_column(value: Any) -> tuple[str, np.ndarray, list[Any]] | None:
    """("str" or "bytes", offsets, each value's bytes) of a list of strings or of bytes (or of
    memoryviews of UTF-8 bytes: `SampleContext.text_views`), else None."""
    if type(value) is not list or not value:
        return None
    kind: str | None
    if any(type(v) is memoryview for v in value):
        if not all(type(v) is memoryview for v in value):  # beside a block's nulls: decoded, then as any column
            value[:] = [str(v, "utf-8") if type(v) is memoryview else v for v in value]
            return _text_column(value)
        kind, encoded = "str", value
    else:
        kind = _TEXT.get(type(value[0]))
        if kind is None or any(type(v) is not type(value[0]) for v in value):
            return None
        encoded = [v.encode() for v in value] if kind == "str" else value
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in encoded], out=offsets[1:])
    return kind, offsets, list(encoded)


def _read_text(slot: np.ndarray, kind: str, rows: int, start: int) -> list[Any]:
    offsets = np.ndarray((rows + 1,), dtype=np.int64, buffer=slot, offset=start).tolist()
    blob = slot[start + (rows + 1) * 8 :].data
    if kind == "str":
        return [str(blob[a:z], "utf-8") for a, z in zip(offsets, offsets[1:])]
    return [bytes(blob[a:z]) for a, z in zip(offsets, offsets[1:])]


@functools.cache
def _dtype(dtype_str: str) -> np.dtype:
    return np.dtype(dtype_str)


__all__ = ["Arena", "Layout", "anonymous_memory", "lay_out", "view_batch"]
