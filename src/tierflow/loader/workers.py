"""The Loader's own worker processes: each builds whole batches of the plan into its shared-memory ring.

Each worker builds the output batches the pool deals it (`TieredDataset.ownership`: a lane's
batches stay with one worker, which then decodes that lane's blocks alone, while no worker is dealt
more than `LAG` batches beyond another), writes each into a free slot of its `Arena` (ring.py) and
sends small messages (where the arrays lie, the batches' meta) over its socket, one per run of
batches where the loop is ahead of it (runs grow from one batch, so the first comes at once;
RUN_BATCHES, RUN_SECONDS). A worker ahead of the loop (its ring full) sends what it built and
refills each slot as it comes back: waiting for a run's worth of free slots made both workers build
in bursts, which on 2 cores delayed a stepping loop (10 ms step, text: 0.91 -> 0.82 of the dry
run). The training process deals the same batches alike and takes batch n from the worker that
built it, so the order and the cursors are exactly those of building in process. A slot comes back
to its worker once nothing in the training process views it any more (the numpy views' base is collected): a
worker has `prefetch_factor + hold` slots, so it runs at most that far ahead (backpressure from
the consumer's position), and when the loop keeps more than `hold` of one worker's batches alive
(a list of batches), later ones are copied out of their slot at once, so no worker waits for ever.

Lifetime: a worker ends with the trainer however it ends (tierflow._lifetime: parent-death signal
and a watchdog on the trainer), a worker that dies reaches the loop as `WorkerLostError` naming it,
and `close()` (or collecting the pool) stops the workers. The rings have no names: their memory
goes with the last process mapping them, SIGKILL included.
"""

from __future__ import annotations

import collections
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import socket
import struct
import threading
import time
import traceback
import weakref
from multiprocessing.reduction import recv_handle, send_handle
from typing import Any
from collections.abc import Iterator

from tierflow._lifetime import Owner, die_with
from tierflow.loader._collate import CarriedBatch
from tierflow.loader._lifetime import lost_worker
from tierflow.loader.plan import PlannedCursor
from tierflow.loader.ring import Arena, anonymous_memory, lay_out, view_batch
from tierflow.telemetry.attribution import time_batches

DEFAULT_PREFETCH = 2
"""Batches a worker may build ahead of the loop beyond those the loop holds (DataLoader's default)."""
RING_BYTES = 4 << 20
"""A worker's ring holds at least this many bytes of batches (more slots than `prefetch_factor + hold`
where batches are small), so a worker that stalls a moment (decoding a block, descheduled on a busy
node) does not stall the other: with 6 token batches of slack each, the workers of a 2-core run
waited for slots ~0.9 s of a 2.6 s epoch, with 16 about half that."""
MAX_SLOTS = 64
LAG = 8
"""The most batches one worker is dealt beyond another (`LaneSticky`), within the slots of its ring:
by lane with a lag of 8 the peers' corpus decodes 1.21 (tokens) and 1.24 (documents) times its
blocks with 2 workers, against 1.79 and 1.58 dealt in turn (`benchmarks/peers/ownership.py`)."""
RUN_BATCHES = 8
"""The most batches one message carries (a worker's run)."""
RUN_SECONDS = 0.001
"""A run goes out once its first batch has waited this long, and a batch that took this long to
build goes out at once: where batches are slow to build the loop gets each as soon as it is built,
and a worker's batches held back for a run do not leave the loop waiting while the other worker's
ring fills (text, 2 workers, with 5 ms: ~0.8x the samples/s)."""
STOP_SECONDS = 2.0
"""How long `close()` waits for the workers to stop before killing them."""
QUIT_SECONDS = 0.25
"""How long `close()` lets a worker notice its closed socket (it does at its next batch) before it
is asked to stop with SIGTERM: a worker decoding a large batch on a loaded machine would otherwise
hold a trainer that is exiting on SIGTERM for seconds. Nothing a worker holds needs it to finish:
its tier entries are written under temporary names and its pins go with the process."""
_FREE = struct.Struct("<II")  # (arena generation, slot): the training process gives a slot back


class WorkerPool:
    """`workers` processes building `dataset`'s batches; iterating it starts them and yields the
    batches (`CarriedBatch`es of numpy arrays viewing the rings) in the plan's order.

    `context`: a multiprocessing context or start method (None: the platform's default). Each
    worker has `prefetch_factor + hold` slots: `hold` of its batches the loop may keep viewing in
    place (more are copied out), `prefetch_factor` it may build beyond them. `timed`: each batch's
    meta carries its production timing (telemetry)."""

    def __init__(
        self,
        dataset: Any,
        workers: int,
        *,
        context: Any = None,
        prefetch_factor: int | None = None,
        hold: int = 4,
        timed: bool = False,
    ) -> None:
        if workers < 1:
            raise ValueError(f"a worker pool has at least one worker, got {workers}")
        self.dataset = dataset
        self.workers = workers
        self.context = context
        self.prefetch_factor = DEFAULT_PREFETCH if prefetch_factor is None else prefetch_factor
        if self.prefetch_factor < 1:
            raise ValueError(f"prefetch_factor must be >= 1, got {self.prefetch_factor}")
        self.hold = hold
        self.timed = timed

    def __iter__(self) -> PoolIterator:
        return PoolIterator(self)

    def __repr__(self) -> str:
        return f"WorkerPool({self.dataset!r}, workers={self.workers})"


FORKSERVER_PRELOAD = ["__main__", "tierflow.loader.workers"]
"""What a forkserver imports once, before it forks any worker: each worker then starts with torch
and tierflow loaded instead of importing them itself (the first batch over S3 with 2 workers took
3.5-4.9 s, most of it each worker's imports). Takes effect when this process starts its forkserver."""


def _context(context: Any) -> Any:
    """The multiprocessing context of a context, a start method's name, or None (the default)."""
    if context is None:
        context = multiprocessing.get_context()
    elif isinstance(context, str):
        context = multiprocessing.get_context(context)
    if context.get_start_method() == "forkserver":
        context.set_forkserver_preload(FORKSERVER_PRELOAD)
    return context


def start_forkserver(context: Any) -> None:
    """Start this process's forkserver now, from a thread, so its imports (FORKSERVER_PRELOAD)
    overlap the model's loading instead of delaying the first batch; nothing for fork or spawn."""
    context = _context(context)
    if context.get_start_method() == "forkserver":
        from multiprocessing import forkserver

        threading.Thread(target=forkserver.ensure_running, name="tierflow-forkserver", daemon=True).start()


class _Channel:
    """The training process's end of one worker's socket: messages in, freed slots out. Slots are
    given back by finalizers, from whichever thread drops a batch's last view: each is one write of
    8 bytes on a descriptor of its own, closed only once no finalizer can write to it."""

    def __init__(self, sock: socket.socket) -> None:
        self.connection = multiprocessing.connection.Connection(sock.detach())
        self._free_fd = os.dup(self.connection.fileno())
        self._pid = os.getpid()
        self.returned: collections.deque[None] = collections.deque()
        self.interrupted: BaseException | None = None

    def returned_slot(self, generation: int, slot: int) -> None:
        """A finalizer's: the training process no longer views this slot. A signal handler's exception
        (`sys.exit` on SIGTERM) that lands in here would be printed and dropped by the finalizer: it is
        kept, and the loop's next batch raises it."""
        try:
            self.returned.append(None)
            self.give_back(generation, slot)
        except BaseException as error:
            self.interrupted = error
            raise

    def give_back(self, generation: int, slot: int) -> None:
        if os.getpid() != self._pid:  # a forked child collecting what it inherited: the slot is not its to give
            return
        try:
            os.write(self._free_fd, _FREE.pack(generation, slot))
        except OSError:  # the worker is gone (or the pool shut down): nothing waits for the slot
            pass

    def shutdown(self) -> None:
        """End both directions now: the worker's next read or write fails, and it stops."""
        try:
            with socket.socket(fileno=os.dup(self._free_fd)) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.connection.close()

    def __del__(self) -> None:
        try:
            os.close(self._free_fd)
        except (OSError, AttributeError):  # AttributeError: at interpreter exit, `os` may be gone
            pass


class PoolIterator:
    """One run of a pool's workers from the dataset's resume cursor: batch n from worker n mod W."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool
        dataset, workers = pool.dataset, pool.workers
        context = _context(pool.context)
        method = context.get_start_method()
        # the parent-death signal fires when the forking *thread* exits: safe from the main thread, and
        # from the forkserver (the parent of forkserver workers); otherwise the watchdog alone
        parent_signal = threading.current_thread() is threading.main_thread() or method == "forkserver"
        owner = Owner.current()
        self.processes: list[Any] = []
        self._channels: list[_Channel] = []
        slots = pool.prefetch_factor + pool.hold
        lag = min(LAG, slots)
        for worker in range(workers):
            ours, theirs = socket.socketpair()
            process = context.Process(
                target=_work,
                name=f"tierflow-worker-{worker}",
                daemon=True,
                args=(
                    dataset,
                    worker,
                    workers,
                    slots,
                    lag,
                    pool.hold,
                    pool.timed,
                    owner,
                    parent_signal,
                    multiprocessing.connection.Connection(theirs.detach()),
                ),
            )
            process.start()
            process._args = ()  # no reference to the worker's end stays here
            self.processes.append(process)
            self._channels.append(_Channel(ours))
        self._stream = dataset.stream()  # where the workers' compact cursors are resolved (the same start)
        self._ownership = dataset.ownership(workers, lag)  # the workers deal their batches alike
        self._arenas: list[Arena | None] = [None] * workers
        self._held = [0] * workers
        self._received: list[collections.deque[tuple[Any, ...]]] = [collections.deque() for _ in range(workers)]
        self._next = 0
        self._ended = False
        self._where = repr(dataset)
        self._stopper = weakref.finalize(self, _stop, list(self.processes), list(self._channels))

    def __iter__(self) -> PoolIterator:
        return self

    def __next__(self) -> CarriedBatch:
        for dropped in self._channels:
            if dropped.interrupted is not None:
                error, dropped.interrupted = dropped.interrupted, None
                raise error
        if self._ended:
            raise StopIteration
        worker = self._ownership.owner(self._next)
        channel = self._channels[worker]
        received = self._received[worker]
        while not received:
            message = self._receive(worker)
            kind = message[0]
            if kind == "batches":
                received.extend(message[1])
                break
            if kind == "arena":
                _, generation, slots, slot_bytes = message
                fd = recv_handle(channel.connection)
                try:
                    self._arenas[worker] = Arena(fd, slots, slot_bytes, generation)
                finally:
                    os.close(fd)
                continue
            if kind == "end":
                self._ended = True
                raise StopIteration
            _, error, text = message  # "error": what the worker raised, re-raised here
            self._ended = True
            error.add_note(f"raised in tierflow worker {worker} (pid {self.processes[worker].pid}):\n{text}")
            raise error
        generation, slot, layout, rest, keys, meta = received.popleft()
        arena = self._arenas[worker]
        assert arena is not None and arena.generation == generation
        returned = channel.returned
        while returned:
            returned.popleft()
            self._held[worker] -= 1
        holder = arena.slot(slot)
        copy = self._held[worker] >= self.pool.hold  # the loop keeps its batches: copy, so the worker goes on
        data = view_batch(holder, layout, rest, keys, copy=copy)
        if copy:
            channel.give_back(generation, slot)
        else:
            self._held[worker] += 1
            weakref.finalize(holder, channel.returned_slot, generation, slot).atexit = False
        planned = meta.planned
        if isinstance(planned, PlannedCursor):
            planned.bind(self._stream)
        self._next += 1
        return CarriedBatch(data, meta)

    def _receive(self, worker: int) -> Any:
        """The next message of `worker`; WorkerLostError once it is gone with nothing left to read."""
        connection = self._channels[worker].connection
        process = self.processes[worker]
        while not connection.poll():
            ready = multiprocessing.connection.wait([connection, process.sentinel])
            if connection in ready:
                break
            process.join(0.1)
            if not connection.poll():
                raise self._lost(worker)
        try:
            return connection.recv()
        except (EOFError, OSError):
            process.join(1.0)
            raise self._lost(worker) from None

    def _lost(self, worker: int) -> Exception:
        self._ended = True
        process = self.processes[worker]
        code = process.exitcode
        if code is not None and code < 0:
            try:
                how = f"was killed by signal {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        elif code is not None:
            how = f"exited with code {code}"
        else:
            how = "closed its connection"
        return lost_worker(f"tierflow worker {worker} of {self.pool.workers} (pid {process.pid}) {how}", self._where)

    def close(self) -> None:
        """Stop the workers (at once if they do not stop by themselves); the rings go with the last view."""
        self._ended = True
        self._stopper()


def _stop(processes: list[Any], channels: list[_Channel]) -> None:
    for channel in channels:
        channel.shutdown()
    started = time.monotonic()
    for process in processes:
        process.join(max(0.0, started + QUIT_SECONDS - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(max(0.0, started + STOP_SECONDS - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join(1.0)


# -- in the worker ------------------------------------------------------------------------------
class _Stopped(Exception):
    """The training process closed the pool (or is gone): the worker ends quietly."""


class _Ring:
    """The worker's side: its arena's free slots, given back over the socket by the training process,
    and the batches written since its last message. At least `slots` slots, more where they fit
    `RING_BYTES`; the loop may keep `hold` of them."""

    def __init__(self, connection: Any, slots: int, hold: int) -> None:
        self.connection = connection
        self.least_slots = slots
        self.hold = hold
        self.arena: Arena | None = None
        self.run = 1
        """Batches the next message carries at most: 1, 2, 4, ... RUN_BATCHES."""
        self._fd = -1
        self._free: collections.deque[int] = collections.deque()
        self._unread = b""
        self._written: list[tuple[Any, ...]] = []
        self._first = 0.0  # when the oldest batch not sent yet was written
        self._done = time.monotonic()  # when the last `put` returned: the next batch's build began

    def put(self, batch: CarriedBatch) -> None:
        """Write `batch` into a free slot; a run's worth of them goes out as one message (sooner
        where they are slow to build: RUN_SECONDS)."""
        built = time.monotonic()
        placed, layout, rest, size = lay_out(batch.data)
        arena = self.arena
        if arena is None or size > arena.slot_bytes:
            self.flush()  # batches of the old arena go before the new one is announced
            arena = self._grow(size)
        slot = self._take()
        arena.write(slot, placed)
        now = time.monotonic()
        if not self._written:
            self._first = now
        self._written.append((arena.generation, slot, layout, rest, tuple(batch.data), batch.meta))
        if len(self._written) >= self.run or now - self._first >= RUN_SECONDS or built - self._done >= RUN_SECONDS:
            self.flush()
        self._done = time.monotonic()

    def flush(self) -> None:
        """Send the batches written since the last message, if any."""
        if self._written:
            self.connection.send(("batches", self._written))
            self._written = []
            self.run = min(2 * self.run, RUN_BATCHES)

    def _grow(self, size: int) -> Arena:
        """A new arena whose slots hold `size` bytes; the old one's slots are the training process's to drop."""
        generation = self.arena.generation + 1 if self.arena is not None else 0
        slot_bytes = Arena.sized_for(size)
        slots = max(self.least_slots, min(MAX_SLOTS, RING_BYTES // slot_bytes))
        fd = anonymous_memory(slots * slot_bytes)
        try:
            self.arena = Arena(fd, slots, slot_bytes, generation)
            self.connection.send(("arena", generation, slots, slot_bytes))
            send_handle(self.connection, fd, os.getppid())
        finally:
            os.close(fd)
        self._free = collections.deque(range(slots))
        return self.arena

    def _take(self) -> int:
        """A free slot of the current arena; with none, what was written goes out first and the
        worker waits for the training process to give one back."""
        assert self.arena is not None
        if not self._free:
            self.flush()
            while not self._free:
                self._read_free()
        return self._free.popleft()

    def _read_free(self) -> None:
        data = os.read(self.connection.fileno(), 4096)
        if not data:
            raise _Stopped
        data = self._unread + data
        whole = len(data) - len(data) % _FREE.size
        self._unread = data[whole:]
        assert self.arena is not None
        for generation, slot in _FREE.iter_unpack(data[:whole]):
            if generation == self.arena.generation:
                self._free.append(slot)


def _work(
    dataset: Any,
    worker: int,
    workers: int,
    slots: int,
    lag: int,
    hold: int,
    timed: bool,
    owner: Owner,
    parent_signal: bool,
    connection: Any,
) -> None:
    """A worker process: build this worker's batches into its ring until the plan ends or the pool stops."""
    die_with(owner, parent_signal=parent_signal)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the training loop's to handle
    ring = _Ring(connection, slots, hold)
    try:
        batches: Iterator[CarriedBatch] = dataset.worker_batches(
            worker, workers, compact=True, text_views=True, lag=lag
        )
        if timed:
            batches = time_batches(dataset, batches)
        for batch in batches:
            ring.put(batch)
        ring.flush()
        connection.send(("end",))
    except (_Stopped, BrokenPipeError, ConnectionResetError):
        return
    except Exception as error:  # handed to the training loop, which raises it
        text = traceback.format_exc()
        try:
            pickle.dumps(error)
        except Exception:
            error = RuntimeError(f"{type(error).__name__}: {error}")
        try:
            ring.flush()  # every batch before the failing one reaches the loop first
            connection.send(("error", error, text))
        except (OSError, _Stopped):
            pass


__all__ = ["PoolIterator", "WorkerPool"]
