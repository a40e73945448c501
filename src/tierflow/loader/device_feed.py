"""The device feed (L0): put batch N+1 on the accelerator while step N computes.

On CUDA every array of a batch is copied into a ring of pinned host buffers
and sent to the device by asynchronous copies on a side stream, from a
background thread; token ids cross the bus narrow (uint16/int32) and are
widened on the device. Without a GPU a batch becomes CPU tensors that view
the source's numpy arrays (no copy); `staged=True` runs the CUDA path's
structure on the host instead (ring copy, then a copy the batch owns).

Copies and bytes are counted per stage ("contiguous", "ring", "to_device",
"widen"), and the time the training loop waited in `next()` is recorded, in
the feed's `MetricsRegistry`.

The feed keeps no state of its own: a `CarriedBatch` comes out with its data
moved and its meta untouched, so what the loop resumes from is the meta of
the last batch it took. How arrays become tensors is `device_feed_tensors`; how the feed reads ahead
(inline or on a thread) is `device_feed_readahead`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tierflow.loader._collate import CarriedBatch
from tierflow.loader.device_feed_readahead import FeedIterator
from tierflow.loader.device_feed_tensors import (
    NUMPY_UNSIGNED,
    TENSOR_KINDS,
    check_widening,
    host_tensor,
    numpy_dtype,
    storage_extent,
    tensor_from_numpy,
    torch_dtype,
    widen_numpy,
    widened_tensor,
)
from tierflow.telemetry.metrics import BoundaryTimer, Counter, MetricsRegistry

ID_KEYS = frozenset({"input_ids", "labels"})
"""The keys holding token ids: they widen to the feed's `ids` dtype on the device."""
COPY_STAGES = ("contiguous", "ring", "to_device", "widen")

_RING_ALIGN = 4096


@dataclass(frozen=True)
class FeedStats:
    """What the feed did so far: batches, copies and bytes per stage, and the training loop's wait."""

    batches: int
    copies: dict[str, int]
    bytes: dict[str, int]
    wait_s: float
    wait_p90_s: float
    wait_p99_s: float
    source_wait_s: float
    ring_allocations: int


class PinnedRing:
    """Host staging buffers, one set per slot, reused round-robin and regrown when a shape grows.

    The caller must not refill a slot while a copy out of it may still be
    running; the device feed waits for the slot's last copy event first.
    """

    def __init__(self, slots: int, pin: bool) -> None:
        if slots < 1:
            raise ValueError(f"pinned ring needs at least one slot, got {slots}")
        self.slots = slots
        self.pin = pin
        self.allocations = 0
        self._buffers: list[dict[str, torch.Tensor]] = [{} for _ in range(slots)]

    def stage(self, slot: int, key: str, source: torch.Tensor) -> torch.Tensor:
        """Copy `source` into `slot`'s buffer for `key`; returns that buffer viewed with its shape."""
        nbytes = source.numel() * source.element_size()
        buffer = self._buffers[slot].get(key)
        if buffer is None or buffer.numel() < nbytes:
            size = max(_RING_ALIGN, -(-nbytes // _RING_ALIGN) * _RING_ALIGN)
            buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
            self._buffers[slot][key] = buffer
            self.allocations += 1
        staged = buffer[:nbytes].view(source.dtype).view(source.shape)
        staged.copy_(source)
        return staged

    def buffer(self, slot: int, key: str) -> torch.Tensor | None:
        return self._buffers[slot].get(key)


class DeviceFeed:
    """Iterate `batches` (dicts, or `CarriedBatch`es) with their arrays as tensors on `device`,
    `depth` batches ahead.

    `widen` maps keys to the dtype they take on the device (e.g.
    {"input_ids": torch.int64}); they cross the bus in their source dtype.
    `ids` is the dtype integer token ids (`ID_KEYS`) take unless `widen`
    names them, so what reaches the model is trainable (embeddings and losses
    want int64) while the wire stays uint16/int32.
    Values that are not numeric arrays or CPU tensors pass through unchanged,
    and so does a carried batch's meta.

    `background`: read ahead from a thread (True; the default on CUDA), inline
    (False), or, on the CPU by default, decide from the loop's first batches:
    a thread where the loop steps between batches, inline where it does not.

    Memory: a CUDA batch owns fresh device memory (the pinned ring is host
    only), so holding earlier batches is safe. A CPU batch views the source's
    arrays unless `staged=True`: if the source reuses its arrays, copy or stage.
    """

    def __init__(
        self,
        batches: Iterable[Mapping[str, Any]],
        device: str | torch.device | None = None,
        depth: int = 2,
        widen: Mapping[str, torch.dtype] | None = None,
        *,
        staged: bool | None = None,
        background: bool | None = None,
        registry: MetricsRegistry | None = None,
        labels: Mapping[str, Any] | None = None,
        ids: torch.dtype | None = None,
        timed: Callable[[Any, float], None] | None = None,
    ) -> None:
        if depth < 1:
            raise ValueError(f"device feed depth must be >= 1, got {depth}")
        self.device = _resolve_device(device)
        self._cuda = self.device.type == "cuda"
        if staged is False and self._cuda:
            raise ValueError(f"device feed to {self.device} always stages through the pinned ring")
        self._staged = self._cuda if staged is None else staged
        self._background: bool | None = True if self._cuda and background is None else background
        self.depth = depth
        self.widen = dict(widen or {})
        self.ids = ids
        self._batches = batches
        self._timed = timed
        """Called `timed(batch, seconds)` with each source batch and the seconds its `next()` took, in the
        thread that read it (the Loader's production timing without workers)."""
        self._ring = PinnedRing(depth + 1, pin=self._cuda) if self._staged else None
        self._copy_stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._slot_events: list[Any] = [None] * (depth + 1)
        self._lookahead = depth if self._cuda else 1
        self._widen_checked: set[tuple[str, torch.dtype]] = set()
        self._array_plans: dict[tuple[str, np.dtype], tuple[str, Any]] = {}

        self.registry = registry if registry is not None else MetricsRegistry()
        base = dict(labels or {})
        self._copies: dict[str, tuple[Counter, Counter]] = {
            stage: (
                self.registry.counter(
                    "tierflow_feed_copies_total", {**base, "stage": stage}, "array copies made by the device feed"
                ),
                self.registry.counter(
                    "tierflow_feed_copy_bytes_total", {**base, "stage": stage}, "bytes copied by the device feed"
                ),
            )
            for stage in COPY_STAGES
        }
        self._batch_count = self.registry.counter(
            "tierflow_feed_batches_total", base, "batches handed to the training loop"
        )
        self._copy_boundary: BoundaryTimer = self.registry.boundary("device_copy", base)
        self._loop_boundary: BoundaryTimer = self.registry.boundary("train_loop", base)

        self._iterator: FeedIterator | None = None

    def __iter__(self) -> Iterator[Any]:
        self.close()
        self._iterator = FeedIterator(self)
        return self._iterator

    def __len__(self) -> int:
        return len(self._batches)  # type: ignore[arg-type]

    def __enter__(self) -> DeviceFeed:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop reading ahead and end the background thread; a loop that breaks early should call it."""
        if self._iterator is not None:
            self._iterator.close()
            self._iterator = None

    def stats(self) -> FeedStats:
        wait = self._loop_boundary.get
        return FeedStats(
            batches=int(self._batch_count.value),
            copies={stage: int(counters[0].value) for stage, counters in self._copies.items()},
            bytes={stage: int(counters[1].value) for stage, counters in self._copies.items()},
            wait_s=wait.sum,
            wait_p90_s=wait.quantile(0.9),
            wait_p99_s=wait.quantile(0.99),
            source_wait_s=self._copy_boundary.get.sum,
            ring_allocations=self._ring.allocations if self._ring is not None else 0,
        )

    def _count(self, tally: dict[str, list[int]]) -> None:
        """Add one batch's copies to the counters: two updates per stage, not per array."""
        for stage, (copies, nbytes) in tally.items():
            if copies:
                copy_counter, byte_counter = self._copies[stage]
                copy_counter.inc(copies)
                byte_counter.inc(nbytes)

    def _prepare(self, batch: Mapping[str, Any] | CarriedBatch, slot: int) -> tuple[Any, Any]:
        """Convert one batch (a carried batch's data, its meta passed along); on CUDA also returns
        the event its copies and widening complete at."""
        data = batch.data if isinstance(batch, CarriedBatch) else batch
        if not isinstance(data, dict) and not isinstance(data, Mapping):
            raise TypeError(f"device feed: a batch must be a dict of arrays, got {type(data).__name__}")
        ready = None
        if not self._cuda:
            converted = self._convert(data, slot)
        else:
            previous = self._slot_events[slot]
            if previous is not None:
                previous.synchronize()  # the last copy out of this pinned slot has finished
            with torch.cuda.stream(self._copy_stream):
                converted = self._convert(data, slot)
                ready = torch.cuda.Event()
                ready.record(self._copy_stream)
            self._slot_events[slot] = ready
        return (CarriedBatch(converted, batch.meta) if isinstance(batch, CarriedBatch) else converted), ready

    def _convert(self, batch: Mapping[str, Any], slot: int) -> dict[str, Any]:
        if self._ring is None:
            converted = self._convert_arrays(batch)
            if converted is not None:
                return converted
        converted = {}
        tally = {stage: [0, 0] for stage in COPY_STAGES}
        owners: dict[int, tuple[np.ndarray, int]] = {}
        together: dict[tuple[int, torch.dtype, torch.dtype], list[tuple[str, torch.Tensor, torch.dtype | None]]] = {}
        for key, value in batch.items():
            if (
                self._ring is None
                and type(value) is np.ndarray
                and (key in ID_KEYS or key in self.widen)
                and value.dtype.kind in "iu"
            ):
                wide = self._wide_dtype(key, torch_dtype(value.dtype))
                if wide is not None:  # on the CPU numpy widens in one pass (torch's uint16 .to takes ~2x)
                    widened, made = widen_numpy(value, numpy_dtype(wide), owners)
                    converted[key] = torch.from_numpy(widened)
                    if made:
                        _add(tally["widen"], made)
                    continue
            host = host_tensor(value)
            if host is None:
                converted[key] = value
                continue
            tensor, unsigned, contiguous_bytes = host
            if contiguous_bytes:
                _add(tally["contiguous"], contiguous_bytes)
            if self._ring is not None:
                staged = self._ring.stage(slot, key, tensor)
                nbytes = staged.numel() * staged.element_size()
                _add(tally["ring"], nbytes)
                tensor = staged.to(self.device, non_blocking=True) if self._cuda else staged.clone()
                _add(tally["to_device"], nbytes)
            wide = self._wide_dtype(key, unsigned if unsigned is not None else tensor.dtype)
            if wide is None:
                converted[key] = tensor.view(unsigned) if unsigned is not None else tensor
                continue
            converted[key] = None  # keeps the batch's key order; filled below
            storage = tensor.untyped_storage().data_ptr() if self._ring is None else id(tensor)
            together.setdefault((storage, tensor.dtype, wide), []).append((key, tensor, unsigned))
        for (_, _, wide), views in together.items():
            self._widen_views(views, wide, tally["widen"], converted)
        self._count(tally)
        return converted

    def _convert_arrays(self, batch: Mapping[str, Any]) -> dict[str, Any] | None:
        """The host path for a batch of numpy arrays and plain values (what the batchers build): how
        each array converts is decided once per (key, dtype), not per batch. None: a batch holding
        anything else (tensors, byte-swapped or reversed arrays) goes the general way."""
        converted: dict[str, Any] = {}
        owners: dict[int, tuple[np.ndarray, int]] = {}
        widened = made = 0
        plans = self._array_plans
        for key, value in batch.items():
            if type(value) is not np.ndarray:
                if isinstance(value, (torch.Tensor, np.ndarray)):
                    return None
                converted[key] = value
                continue
            plan = plans.get((key, value.dtype))
            if plan is None:
                plan = plans[(key, value.dtype)] = self._array_plan(key, value.dtype)
            kind, target = plan
            if kind == "pass":
                converted[key] = value
                continue
            if kind == "general" or (value.ndim and min(value.strides) < 0):
                return None
            if kind == "widen":
                array, nbytes = widen_numpy(value, target, owners)
                converted[key] = torch.from_numpy(array)
                if nbytes:
                    widened += 1
                    made += nbytes
            else:
                tensor = tensor_from_numpy(value, target)
                converted[key] = tensor.view(target) if target is not None else tensor
        if widened:
            copies, nbytes_counter = self._copies["widen"]
            copies.inc(widened)
            nbytes_counter.inc(made)
        return converted

    def _array_plan(self, key: str, dtype: np.dtype) -> tuple[str, Any]:
        """("pass", None): not a tensor kind; ("tensor", the unsigned dtype it stands for or None);
        ("widen", numpy dtype); ("general", None): what the host path does not do."""
        if dtype.kind not in TENSOR_KINDS:
            return "pass", None
        if not dtype.isnative:
            return "general", None
        unsigned = NUMPY_UNSIGNED[dtype][1] if dtype in NUMPY_UNSIGNED else None
        wide = self._wide_dtype(key, unsigned if unsigned is not None else torch_dtype(dtype))
        if wide is None:
            return "tensor", unsigned
        return ("widen", numpy_dtype(wide)) if dtype.kind in "iu" else ("general", None)

    def _wide_dtype(self, key: str, logical: torch.dtype) -> torch.dtype | None:
        """The dtype `key` takes on the device, None when it keeps its own."""
        wide = self.widen.get(key)
        if (
            wide is None
            and key in ID_KEYS
            and self.ids is not None
            and not (logical.is_floating_point or logical.is_complex or logical == torch.bool)
        ):
            wide = self.ids
        if wide is None or wide == logical:
            return None
        if (key, logical) not in self._widen_checked:
            check_widening(key, logical, wide)
            self._widen_checked.add((key, logical))
        return wide

    @staticmethod
    def _widen_views(
        views: list[tuple[str, torch.Tensor, torch.dtype | None]],
        wide: torch.dtype,
        widen_tally: list[int],
        converted: dict[str, Any],
    ) -> None:
        """Widen tensors viewing one storage (input_ids and labels of one window buffer) in one
        pass over the span they cover, and hand out views
        of the result: half the bytes written for a window batch, which is what a batch
        fresh from the batcher (not in cache) pays for."""
        if len(views) == 1:
            key, tensor, unsigned = views[0]
            converted[key] = widened = widened_tensor(tensor, unsigned, wide)
            _add(widen_tally, widened.numel() * widened.element_size())
            return
        low = min(t.storage_offset() for _, t, _ in views)
        high = max(t.storage_offset() + storage_extent(t) for _, t, _ in views)
        first = views[0][1]
        span = widened_tensor(first.as_strided((high - low,), (1,), low), views[0][2], wide)
        _add(widen_tally, span.numel() * span.element_size())
        for key, tensor, _ in views:
            converted[key] = span.as_strided(tensor.shape, tensor.stride(), tensor.storage_offset() - low)

    def _hand_off(self, converted: Any, ready: Any) -> Any:
        """Make the training loop's stream wait for this batch's copies, and keep its memory alive for it."""
        if ready is None:
            return converted
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_event(ready)
        data = converted.data if isinstance(converted, CarriedBatch) else converted
        for value in data.values():
            if isinstance(value, torch.Tensor) and value.device.type == "cuda":
                value.record_stream(consumer)
        return converted


def _add(tally: list[int], nbytes: int) -> None:
    tally[0] += 1
    tally[1] += nbytes


def _resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    resolved = torch.device(device)
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device feed: {resolved} was asked for but CUDA is not available")
        if resolved.index is None:
            resolved = torch.device("cuda", torch.cuda.current_device())
    elif resolved.type != "cpu":
        raise ValueError(f"device feed: device {resolved} is not supported (cuda or cpu)")
    return resolved
