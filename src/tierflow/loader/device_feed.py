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
the last batch it took. A background thread that is still reading when the
interpreter exits is stopped and joined by an `atexit` hook: left running, it
would be killed inside a torch call at finalization (std::terminate, SIGABRT).
"""

from __future__ import annotations

import atexit
import collections
import functools
import queue
import threading
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping

import numpy as np
import torch

from tierflow.loader._collate import CarriedBatch
from tierflow.telemetry.metrics import BoundaryTimer, Counter, MetricsRegistry

ID_KEYS = frozenset({"input_ids", "labels"})
"""The keys holding token ids: they widen to the feed's `ids` dtype on the device."""
COPY_STAGES = ("contiguous", "ring", "to_device", "widen")

# Unsigned ids travel as the signed type of the same width (fully supported by
# every torch op) and are masked back to their value when widened.
_UNSIGNED_AS_SIGNED: dict[torch.dtype, tuple[torch.dtype, int]] = {
    torch.uint16: (torch.int16, 0xFFFF),
    torch.uint32: (torch.int32, 0xFFFFFFFF),
}
_NUMPY_UNSIGNED = {np.dtype(np.uint16): (np.int16, torch.uint16), np.dtype(np.uint32): (np.int32, torch.uint32)}
_SIGNED_NUMPY = {unsigned: signed for signed, unsigned in _NUMPY_UNSIGNED.values()}
_UNSIGNED_NUMPY = {torch.uint16: np.dtype(np.uint16), torch.uint32: np.dtype(np.uint32)}
_NUMPY_WIDE = {torch.int32: np.dtype(np.int32), torch.int64: np.dtype(np.int64)}
"""Integer dtypes a CPU tensor widens to through numpy (a view, one astype, a tensor of the result)."""
_TENSOR_KINDS = "biufc"
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


def _host_tensor(value: Any) -> tuple[torch.Tensor, torch.dtype | None, int] | None:
    """A CPU tensor viewing `value`, the unsigned dtype it stands for, and bytes copied to make it.

    None means the value is not an array the feed moves (cursor dicts,
    strings, object arrays, tensors already on a device): it passes through.
    """
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in _TENSOR_KINDS:
            return None
        copied = 0
        if not value.dtype.isnative:
            value = value.astype(value.dtype.newbyteorder("="))
            copied = value.nbytes
        elif any(stride < 0 for stride in value.strides):
            value = np.ascontiguousarray(value)
            copied = value.nbytes
        unsigned = _NUMPY_UNSIGNED[value.dtype][1] if value.dtype in _NUMPY_UNSIGNED else None
        return _from_numpy(value, unsigned), unsigned, copied
    if isinstance(value, torch.Tensor) and value.device.type == "cpu":
        if value.dtype in _UNSIGNED_AS_SIGNED:
            return value.view(_UNSIGNED_AS_SIGNED[value.dtype][0]), value.dtype, 0
        return value, None, 0
    return None


def _from_numpy(value: np.ndarray, unsigned: torch.dtype | None) -> torch.Tensor:
    if unsigned is not None:
        value = value.view(_SIGNED_NUMPY[unsigned])
    if value.flags.writeable:
        return torch.from_numpy(value)
    # Read-only views of mapped shards are fine: the feed never writes into them.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(value)


_EXACT_INTEGER_BITS = {
    torch.int32: 31, torch.int64: 63, torch.float16: 11, torch.bfloat16: 8, torch.float32: 24, torch.float64: 53,
}
_UNSIGNED_BITS = {torch.uint16: 16, torch.uint32: 32}


def _check_widening(key: str, logical: torch.dtype, wide: torch.dtype) -> None:
    if logical in _UNSIGNED_BITS:  # torch.promote_types refuses the unsigned types
        lossless = _EXACT_INTEGER_BITS.get(wide, 0) >= _UNSIGNED_BITS[logical]
    else:
        try:
            lossless = torch.promote_types(logical, wide) == wide
        except RuntimeError:  # e.g. uint64, which torch does not promote
            lossless = False
    if not lossless:
        raise ValueError(f"device feed: cannot widen {key!r} from {logical} to {wide} without loss")


def _widen_numpy(value: np.ndarray, wide: np.dtype,
                 owners: dict[int, tuple[np.ndarray, int]]) -> tuple[np.ndarray, int]:
    """`value` as `wide`, by value, and the bytes widened for it now. Views of one contiguous array
    (input_ids and labels of a window buffer) widen that array once, kept in `owners` with its
    address, and come out as views of the result."""
    owner = value.base
    size = value.itemsize
    if type(owner) is np.ndarray and owner.base is None and owner.dtype == value.dtype \
            and owner.flags.c_contiguous and not any(s < 0 or s % size for s in value.strides):
        found = owners.get(id(owner))
        made = 0
        if found is None:
            widened = owner.astype(wide)
            found = owners[id(owner)] = (widened, owner.ctypes.data)
            made = widened.nbytes
        widened, address = found
        wide_size = wide.itemsize
        return np.ndarray(value.shape, wide, buffer=widened, offset=(value.ctypes.data - address) // size * wide_size,
                          strides=tuple(s // size * wide_size for s in value.strides)), made
    widened = value.astype(wide)
    return widened, widened.nbytes


@functools.cache
def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


@functools.cache
def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return torch.empty(0, dtype=dtype).numpy().dtype


def _extent(tensor: torch.Tensor) -> int:
    """Elements of its storage a tensor's view reaches, from its first."""
    if tensor.numel() == 0:
        return 0
    return 1 + sum((n - 1) * stride for n, stride in zip(tensor.shape, tensor.stride()))


_DIRECT_UNSIGNED: dict[str, bool] = {}
"""Per device type: whether this torch converts uint16/uint32 tensors itself (2.3 and later do,
on CPU, in one pass); else they widen from their signed view and are masked back."""


def _widened(tensor: torch.Tensor, unsigned: torch.dtype | None, wide: torch.dtype) -> torch.Tensor:
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
                self.registry.counter("tierflow_feed_copies_total", {**base, "stage": stage}, "array copies made by the device feed"),
                self.registry.counter("tierflow_feed_copy_bytes_total", {**base, "stage": stage}, "bytes copied by the device feed"),
            )
            for stage in COPY_STAGES
        }
        self._batch_count = self.registry.counter("tierflow_feed_batches_total", base, "batches handed to the training loop")
        self._copy_boundary: BoundaryTimer = self.registry.boundary("device_copy", base)
        self._loop_boundary: BoundaryTimer = self.registry.boundary("train_loop", base)

        self._iterator: _FeedIterator | None = None

    def __iter__(self) -> Iterator[Any]:
        self.close()
        self._iterator = _FeedIterator(self)
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
            if self._ring is None and type(value) is np.ndarray and (key in ID_KEYS or key in self.widen) \
                    and value.dtype.kind in "iu":
                wide = self._wide_dtype(key, _torch_dtype(value.dtype))
                if wide is not None:  # on the CPU numpy widens in one pass (torch's uint16 .to takes ~2x)
                    widened, made = _widen_numpy(value, _numpy_dtype(wide), owners)
                    converted[key] = torch.from_numpy(widened)
                    if made:
                        _add(tally["widen"], made)
                    continue
            host = _host_tensor(value)
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
                array, nbytes = _widen_numpy(value, target, owners)
                converted[key] = torch.from_numpy(array)
                if nbytes:
                    widened += 1
                    made += nbytes
            else:
                tensor = _from_numpy(value, target)
                converted[key] = tensor.view(target) if target is not None else tensor
        if widened:
            copies, nbytes_counter = self._copies["widen"]
            copies.inc(widened)
            nbytes_counter.inc(made)
        return converted

    def _array_plan(self, key: str, dtype: np.dtype) -> tuple[str, Any]:
        """("pass", None): not a tensor kind; ("tensor", the unsigned dtype it stands for or None);
        ("widen", numpy dtype); ("general", None): what the host path does not do."""
        if dtype.kind not in _TENSOR_KINDS:
            return "pass", None
        if not dtype.isnative:
            return "general", None
        unsigned = _NUMPY_UNSIGNED[dtype][1] if dtype in _NUMPY_UNSIGNED else None
        wide = self._wide_dtype(key, unsigned if unsigned is not None else _torch_dtype(dtype))
        if wide is None:
            return "tensor", unsigned
        return ("widen", _numpy_dtype(wide)) if dtype.kind in "iu" else ("general", None)

    def _wide_dtype(self, key: str, logical: torch.dtype) -> torch.dtype | None:
        """The dtype `key` takes on the device, None when it keeps its own."""
        wide = self.widen.get(key)
        if wide is None and key in ID_KEYS and self.ids is not None and not (
                logical.is_floating_point or logical.is_complex or logical == torch.bool):
            wide = self.ids
        if wide is None or wide == logical:
            return None
        if (key, logical) not in self._widen_checked:
            _check_widening(key, logical, wide)
            self._widen_checked.add((key, logical))
        return wide

    @staticmethod
    def _widen_views(views: list[tuple[str, torch.Tensor, torch.dtype | None]], wide: torch.dtype,
                     widen_tally: list[int], converted: dict[str, Any]) -> None:
        """Widen tensors viewing one storage (input_ids and labels of one window buffer) in one
        pass over the span they cover, and hand out views
        of the result: half the bytes written for a window batch, which is what a batch
        fresh from the batcher (not in cache) pays for."""
        if len(views) == 1:
            key, tensor, unsigned = views[0]
            converted[key] = widened = _widened(tensor, unsigned, wide)
            _add(widen_tally, widened.numel() * widened.element_size())
            return
        low = min(t.storage_offset() for _, t, _ in views)
        high = max(t.storage_offset() + _extent(t) for _, t, _ in views)
        first = views[0][1]
        span = _widened(first.as_strided((high - low,), (1,), low), views[0][2], wide)
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


_END = object()
_RUNNING: weakref.WeakSet[_FeedIterator] = weakref.WeakSet()
"""Feed iterators whose background thread may still run; `_stop_running` ends them at exit."""


@atexit.register
def _stop_running() -> None:
    """Stop every feed thread before the interpreter finalizes. A daemon thread that is inside a
    torch call then (one that released the GIL) is killed when it takes the GIL back, by an unwind
    through a C++ destructor that may not throw: std::terminate, SIGABRT at the end of a script that
    broke out of its loop without close(). atexit runs before finalization, while threads still can."""
    for iterator in list(_RUNNING):
        iterator.close(timeout=10.0)


AUTO_DECIDE_AFTER = 32
"""Batches an automatic feed reads inline before it decides whether a background thread pays."""
AUTO_WARMUP_GAPS = 8
"""The loop's first gaps between batches, left out of the decision: they hold its first torch calls
and first metric updates (a loop with no step showed 0.8-1.4 ms, then 0.2 ms, then its steady ~40 us)."""
AUTO_MIN_STEP_S = 100e-6
"""A loop whose gaps between batches are at least this long (their lower quartile) gets the background
thread. The quartile, not the median: a loop with no step took ~110 us a gap for its first ~15
batches of a fresh process, then 10-40 us, and a median of its first gaps chose the thread, which
cost that loop ~20% (a real step is long in every gap, so its lower quartile is long too)."""


class _FeedIterator:
    """One pass over the source: reads ahead inline or from a background thread.

    An automatic feed (`background=None` on the CPU) starts inline and measures the loop: a
    thread overlaps production with the step only where there is a step to hide it behind; with
    none (a raw read, a tiny eval model) the hand-over between threads and their turns at the GIL
    cost more per batch than building it, so it stays inline.
    """

    def __init__(self, feed: DeviceFeed) -> None:
        self._feed = feed
        self._source = iter(feed._batches)
        self._slot = 0
        self._closed = False
        self._pending: collections.deque[Any] = collections.deque()
        self.ready: Callable[[], int] = self._pending.__len__
        """Batches read and converted ahead of the loop right now (what telemetry asks per batch): the
        inline read-ahead's length, a C call; with a background thread, that and its queue's."""
        self._exhausted = False
        self._thread: threading.Thread | None = None
        self._gaps: list[float] | None = [] if feed._background is None else None
        self._returned: float | None = None
        if feed._background:
            self._start_thread()

    def _start_thread(self) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=self._feed.depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, name="tierflow-device-feed", daemon=True)
        self.ready = self._ready_with_thread
        _RUNNING.add(self)
        self._thread.start()

    @property
    def background(self) -> bool:
        """Whether a background thread reads ahead now."""
        return self._thread is not None

    def _ready_with_thread(self) -> int:
        return len(self._pending) + self._queue.qsize()

    def __iter__(self) -> _FeedIterator:
        return self

    def __next__(self) -> Any:
        if self._closed:
            raise StopIteration
        started = time.perf_counter()
        gaps = self._gaps
        if gaps is not None and self._returned is not None:
            gaps.append(started - self._returned)
            if len(gaps) >= AUTO_DECIDE_AFTER:
                self._gaps = None
                steady = sorted(gaps[AUTO_WARMUP_GAPS:])
                if steady[len(steady) // 4] >= AUTO_MIN_STEP_S and not self._exhausted:
                    self._start_thread()
        if self._thread is not None and not self._pending:
            converted, ready = self._next_background()
        else:
            converted, ready = self._next_inline()
        batch = self._feed._hand_off(converted, ready)
        self._feed._batch_count.inc()
        self._returned = now = time.perf_counter()
        self._feed._loop_boundary.blocked_get(now - started)
        return batch

    def _pull(self) -> tuple[Any, Any]:
        """Read and convert the next source batch (raises StopIteration at the end)."""
        started = time.perf_counter()
        batch = next(self._source)
        took = time.perf_counter() - started
        self._feed._copy_boundary.blocked_get(took)
        timed = self._feed._timed  # an attribute load, then a call: a method load of it is not specialised
        if timed is not None:
            timed(batch, took)
        converted, ready = self._feed._prepare(batch, self._slot)
        self._slot = (self._slot + 1) % (self._feed.depth + 1)
        return converted, ready

    def _next_inline(self) -> tuple[Any, Any]:
        while self._thread is None and not self._exhausted and len(self._pending) < self._feed._lookahead:
            try:
                self._pending.append(self._pull())
            except StopIteration:
                self._exhausted = True
        if not self._pending:
            self._closed = True
            raise StopIteration
        return self._pending.popleft()

    def _next_background(self) -> tuple[Any, Any]:
        kind, payload = self._queue.get()
        if kind is _END:
            self._closed = True
            self._thread.join()
            raise StopIteration
        if kind == "error":
            self._closed = True
            self._thread.join()
            raise payload
        return payload

    def _produce(self) -> None:
        try:
            if self._feed._cuda:
                torch.cuda.set_device(self._feed.device)
            while not self._stop.is_set():
                try:
                    item = self._pull()
                except StopIteration:
                    break
                if not self._put(("batch", item)):
                    return
            self._put((_END, None))
        except BaseException as error:  # handed to the training loop, which re-raises it
            self._put(("error", error))

    def _put(self, message: tuple[Any, Any]) -> bool:
        started = time.perf_counter()
        while not self._stop.is_set():
            try:
                self._queue.put(message, timeout=0.05)
            except queue.Full:
                continue
            self._feed._copy_boundary.blocked_put(time.perf_counter() - started)
            return True
        return False

    def close(self, timeout: float | None = None) -> None:
        """Stop reading ahead; a background thread is joined (for at most `timeout` seconds)."""
        if self._closed:
            return
        self._closed = True
        self._pending.clear()
        if self._thread is None:
            return
        self._stop.set()
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._thread.is_alive() and (deadline is None or time.monotonic() < deadline):
            try:
                self._queue.get(timeout=0.05)
            except queue.Empty:
                pass
        self._thread.join(timeout=0 if deadline is not None else None)
        _RUNNING.discard(self)
