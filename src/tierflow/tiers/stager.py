"""The stager: one per node, it walks the node's known future and pulls shards up the tiers first.

Correctness never depends on it (every reader calls `tier.ensure` itself); it only makes the
reader's `ensure` a hit. Its thread plans from the cursor of the last batch the training loop
consumed (the order's future view, across epoch edges) with `plan_staging` (tiers/plan.py: the
Little's-law lookahead, the fetch order, the holds), and carries the plan out: it hands the
policies the next-use oracle, fetches in order of first use on threads (I/O and decompression
release the GIL), and holds a pin on every entry it staged until its use has passed, so a
prefetch can never evict, or be evicted before, an entry that is needed sooner ("do no harm").
A transfer from below shares the link only with transfers of shards first needed at the same
position (a window's shards, needed together): one needed later waits its turn, so it never takes
bandwidth from the shard the loop needs next (where the source is the bound, two fetches in flight
each arrive at half the rate). It reads the dataset only through the `FutureView` protocol. A
burst announced through `ride_through` (a checkpoint upload, tiers/burst.py) stretches the
lookahead to cover it.
"""

from __future__ import annotations

import logging
import threading
import time
import queue
from typing import TYPE_CHECKING, Any

from tierflow.errors import FetchError, ShardCorruptError, SourceNotFound
from tierflow.format.metadata import shard_column
from tierflow.format.metadata_index import ShardKeys, shard_key
from tierflow.format.shard import Form
from tierflow.policies.oracle import IntervalOracle
from tierflow.telemetry import MetricsRegistry
from tierflow.tiers.burst import Ride
from tierflow.tiers.fault_log import FaultLog
from tierflow.tiers.plan import FutureView, Lookahead, NodeShape, passed, plan_staging, size_lookahead
from tierflow.tiers.handle import SOURCE, Handle, on_downloaded
from tierflow.tiers.stack import STAGING_NAME, TierStack

if TYPE_CHECKING:
    from tierflow.telemetry.prometheus import PrometheusExporter

log = logging.getLogger("tierflow.stager")


class PositionOracle:
    """Next use in the node's sample positions, whatever clock the tier passes as `now`."""

    def __init__(self, intervals: IntervalOracle, position: float = 0.0) -> None:
        self.intervals = intervals
        self.position = position

    def next_use(self, key: str, now: float) -> float:
        return self.intervals.next_use(key, self.position)

    def use_after_current(self, key: str, now: float) -> float:
        return self.intervals.use_after_current(key, self.position)


PLAN_SHARE = 10
_NEVER = 1 << 62


class Stager:
    """Prefetch for `view` (a TieredDataset) through `stack` on this node; threads, not processes."""

    def __init__(
        self,
        view: FutureView,
        stack: TierStack,
        *,
        threads: int = 2,
        min_batches: int = 5,
        max_bytes: int | None = None,
        registry: MetricsRegistry | None = None,
        enabled: bool | None = None,
        prometheus_port: int | None = None,
        events: Any = None,
    ) -> None:
        self.view = view
        self.events = events
        """An `EventLog` (telemetry/eventlog.py) that gets a "stage" record per transfer from below, or None:
        beside the loop's "batch" records it shows which shard a wait at a window edge was for."""
        self.stack = stack
        self.threads = threads
        self.enabled = view.world.local_rank == 0 if enabled is None else enabled
        self.shards = view.manifest.shards
        self._key_shards = ShardKeys(view.manifest)  # equal content, one key: a repacked shard may repeat
        self.node = self._shape(min_batches, max_bytes)
        self.registry = registry or stack.registry
        r = self.registry
        self.m_fetched = r.counter("tierflow_stager_fetches_total", description="shards staged ahead of need")
        self.m_already = r.counter(
            "tierflow_stager_already_resident_total", description="planned shards already staged"
        )
        self.m_latency = r.histogram("tierflow_stager_fetch_seconds", description="time to stage one shard")
        self.m_ahead = r.gauge(
            "tierflow_stager_ahead_bytes", aggregate="max", description="bytes staged and pinned ahead"
        )
        self.m_lookahead = r.gauge(
            "tierflow_stager_lookahead_bytes", aggregate="max", description="bytes the stager aims ahead"
        )
        self.m_declined = r.counter("tierflow_stager_declined_total", description="planned shards no tier would take")
        self.m_plan = r.histogram("tierflow_stager_plan_seconds", description="time to plan the lookahead once")
        self.source_bytes_by_epoch: dict[int, int] = {}
        """At-rest bytes this stager's fetches took from the source, by the epoch of the use each was
        staged for: the cold epoch's lookahead into the next is the next epoch's (issue 37)."""
        self.m_errors = r.counter(
            "tierflow_stager_errors_total", description="fetches that failed (readers fetch on demand)"
        )
        self._cursor: Any = None  # opaque: the loader's cursor, handed to the view as is
        self._consumed_steps = 0
        # the steps of the node's ranks, where they share the node's staging area: the stager looks
        # ahead of the fastest and holds what it stages until the slowest has passed it, so a shard
        # one rank brought in stays for the others
        self.progress = getattr(stack, "progress", None)
        self.local_rank = int(getattr(view.world, "local_rank", 0))
        if self.progress is not None:
            self.progress.publish(self.local_rank, 0)
        self._plan_steps = 0
        self._rate_started: float | None = None
        self._held: dict[int, Handle] = {}
        self._held_until: dict[int, int] = {}
        self._inflight: set[int] = set()
        self._given_up: set[int] = set()
        """Shards whose staging failed for good (bytes that never verify, an object not found): not
        staged again, readers fetch them on demand (and raise)."""
        self.faults = FaultLog(log)
        self._queue: queue.Queue[tuple[int, int, int, int] | None] = queue.Queue()  # (shard, first use, ticket, epoch)
        self._link = threading.Condition()
        self._transfers: list[int] = []  # first uses (node samples) of the transfers from below in flight
        self._queued: dict[int, int] = {}  # ticket -> first use, of the fetches queued and not yet begun
        self._tickets = 0
        self._rides: list[Ride] = []
        self._replan = False
        self._oracle: PositionOracle | None = None
        self._wake = threading.Event()
        self._next_plan: tuple[int, float] = (0, 0.0)  # (steps, monotonic time) a plan is due at: _run sets it
        self._release_at = _NEVER  # the node sample at which the first held shard's use has passed
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self.prometheus_port = prometheus_port
        self.exporter: PrometheusExporter | None = None

    # ------------------------------------------------------------ control
    def start(self, cursor: Any = None) -> None:
        """Begin staging from `cursor` (the loader's state); returns at once."""
        if self.progress is not None:
            self.progress.publish(self.local_rank, self._consumed_steps)
        if not self.enabled or self._threads:
            return
        if self.prometheus_port is not None and self.exporter is None:
            from tierflow.telemetry.prometheus import PrometheusExporter

            # the node's one exporter lives with its one stager (port 0: any free port, see .url)
            self.exporter = PrometheusExporter([self.registry], port=self.prometheus_port).start()
        with self._lock:
            self._cursor = cursor
            self._plan_steps = self._consumed_steps
        self._stop.clear()
        # daemon threads: a fetch stuck on a dead network must never hold the process at exit
        self._threads = [threading.Thread(target=self._run, name="tierflow-stager", daemon=True)]
        self._threads += [
            threading.Thread(target=self._fetcher, name=f"tierflow-stage-{i}", daemon=True) for i in range(self.threads)
        ]
        for t in self._threads:
            t.start()

    @property
    def running(self) -> bool:
        """Whether its threads are staging (from `start` until `close`)."""
        return bool(self._threads)

    def consumed(self, cursor: Any) -> None:
        """The training loop consumed a batch whose cursor is `cursor`."""
        if self.progress is not None:  # before the stager plans on: the node's stager holds for the slowest
            self.progress.publish(self.local_rank, self._consumed_steps + 1)
        if not self.enabled:
            self._consumed_steps += 1
            return
        with self._lock:
            self._cursor = cursor
            self._consumed_steps += 1
            if self._rate_started is None:
                self._rate_started = time.perf_counter()
                self._rate_steps0 = self._consumed_steps
            if self._oracle is not None:
                self._oracle.position = (self._consumed_steps - self._plan_steps) * self.node.samples_per_step
        steps, at = self._next_plan
        # wake the thread when a plan is due or a pin can go, not per batch (that cost the loop ~0.3 ms a batch)
        if (
            self._consumed_steps >= steps
            and time.monotonic() >= at
            or self._consumed_steps * self.node.samples_per_step >= self._release_at
        ):
            self._wake.set()

    def close(self) -> None:
        """Stop staging and release what it holds. Call before forking (the Loader does): a thread
        running across a fork can leave the child a lock (an import, a metric) it never gets back."""
        if self.progress is not None:
            self.progress.leave(self.local_rank)  # not reading: the node's stager holds nothing for it
        self._stop.set()
        self._wake.set()
        with self._link:
            self._link.notify_all()  # a fetcher waiting its turn stops waiting
        for _ in range(self.threads):
            self._queue.put(None)
        for t in self._threads:
            t.join(timeout=120)  # a fetch in flight finishes first: no thread may outlive close()
            if t.is_alive():
                log.warning("stager thread %s still busy after 120 s; a fork now is unsafe", t.name)
        self._threads = []
        with self._queue.mutex:  # the stop marks no thread took: a restart starts with none (no module
            self._queue.queue.clear()  # global here: close may run while the interpreter shuts down)
        with self._link:
            self._queued.clear()
        with self._lock:
            for handle in self._held.values():
                handle.release()
            self._held.clear()
            self._inflight.clear()
            self._given_up.clear()
            for ride in self._rides:
                ride.staged()  # no one stages for it any more: its owner must not wait
        self.faults.close()

    # ------------------------------------------------------------ planning
    def _node_steps(self) -> tuple[int, int]:
        """(slowest, fastest) batches consumed by the node's live ranks: this loop's alone unless
        the node's ranks share a staging area (they step through the same batches)."""
        own = self._consumed_steps
        if self.progress is None:
            return own, own
        steps = [s for rank, (_, s) in self.progress.steps().items() if rank != self.local_rank] + [own]
        return min(steps), max(steps)

    def consumption_rate(self) -> float:
        """Bytes per second the training loop consumes (0 until measured)."""
        if self._rate_started is None:
            return 0.0
        elapsed = time.perf_counter() - self._rate_started
        steps = self._consumed_steps - self._rate_steps0
        return steps * self.node.bytes_per_step / elapsed if elapsed > 0 and steps > 0 else 0.0

    def lookahead(self) -> Lookahead:
        """The plan's lookahead from what was measured so far (1 s per fetch until one is timed)."""
        return size_lookahead(self.node, self.consumption_rate(), *self._fetch_latency(), self.burst_seconds())

    # ------------------------------------------------------------ bursts (tiers/burst.py)
    def ride_through(self, seconds: float) -> Ride:
        """A burst of about `seconds` (a checkpoint upload) starts: until the ride ends, look ahead
        `seconds` of consumption at the measured rate, within the tier's room (`max_bytes`), and
        plan now. Rides add up (uploads queued one after another)."""
        cover = min(max(0.0, seconds) * self.consumption_rate(), self.node.max_bytes)
        if not self.enabled or not self._threads or cover <= 0:
            return Ride(seconds, 0.0)  # nothing measured or nothing staging: covered as it is
        ride = Ride(seconds, cover, self._ride_ended)
        with self._lock:
            self._rides.append(ride)
            self._replan = True
        self._wake.set()
        return ride

    def burst_seconds(self) -> float:
        """Seconds of the open rides together (0: no burst)."""
        with self._lock:
            return sum(r.seconds for r in self._rides)

    def _ride_ended(self, ride: Ride) -> None:
        with self._lock:
            self._rides.remove(ride)  # once: Ride.end calls this only the first time
            self._replan = True
        self._wake.set()

    def _note_rides(self, idle: bool = False) -> None:
        """Tell the open rides whose bytes are held ahead (or, `idle`: the plan wants nothing more)."""
        with self._lock:
            if not self._rides:
                return
            held = sum(self._shard_size(s) for s in self._held)
            for ride in self._rides:
                if idle or held + self.node.shard_bytes >= ride.cover_bytes:
                    ride.staged()

    def _fetch_latency(self) -> tuple[float, float]:
        """(p99, mean) seconds of one staged fetch."""
        if not self.m_latency.count:
            return 1.0, 1.0
        return self.m_latency.quantile(0.99), self.m_latency.mean

    def _shape(self, min_batches: int, max_bytes: int | None) -> NodeShape:
        """The node's sizes, measured once from the view and the stack's tiers."""
        view, stack = self.view, self.stack
        form = self.stack.tiers[0].form if self.stack.tiers else Form.AT_REST
        sizes = shard_column(view.manifest, "decoded_bytes" if form == Form.DECODED else "bytes")
        shard_bytes = int(sizes.max()) if len(sizes) else 0
        samples_per_step = view.node_step_samples()
        capacity = min((t.capacity for t in stack.tiers), default=0)
        working = view.working_set
        active = working.bytes  # the shards read at once and the window just left, no more than the dataset
        if capacity and active > capacity:  # the order's, not narrowed to the tier: the staging area carries it
            log.info(
                "tier capacity %.1f MB is below the %d shards of the order's working set (%d lanes x windows of "
                "%d and the next window): the tier keeps what its policy chooses, the rest passes through "
                "the staging area",
                capacity / 1e6,
                working.shards,
                working.lanes,
                working.window_shards,
            )
        room = capacity - active if capacity else 0
        return NodeShape(
            shard_bytes=shard_bytes,
            bytes_per_step=int(sizes.sum()) / max(1, view.num_order_samples) * samples_per_step,
            samples_per_step=samples_per_step,
            min_batches=min_batches,
            max_bytes=max_bytes if max_bytes is not None else max(room, shard_bytes),
            # at least the next window of every lane, or each window boundary is a stall
            next_windows_bytes=working.reading * shard_bytes,
            capacity=capacity,
            dataset_bytes=int(sizes.sum()),
            staging_slots=working.reading,
            # the windows being read are staged whole only where the top tier holds the working set:
            # in a smaller one they would push out the warm entries the next windows hit
            reading_shards=working.reading if not capacity or active <= capacity else 0,
        )

    def _run(self) -> None:
        planned_at, planned_time, cost = -1, 0.0, 0.0
        while not self._stop.is_set():
            steps = self._node_steps()[1]  # the fastest rank reading new shards is what to plan for
            # a plan holds the GIL for ~1-40 ms (it walks two tier-capacities of future): plan at most
            # every 10 plans' time, so the stager never takes more than ~10% from the training loop
            rested = time.monotonic() - planned_time > max(0.05, PLAN_SHARE * cost)  # see the wait below
            due = steps - planned_at >= max(1, self.node.min_batches // 2) and rested
            if planned_at < 0 or due or (self._replan and rested) or (not self._wake.is_set() and rested):
                planned_at, planned_time = steps, time.monotonic()
                self._replan = False
                try:
                    self._plan_and_fetch()
                except Exception as e:  # the stager is an optimisation: readers fetch on demand
                    self.m_errors.inc()
                    self.faults.warn("stager planning failed", e, "readers fetch on demand")
                cost = time.monotonic() - planned_time
                self.m_plan.observe(cost)
            else:
                self._release_passed()
            self._wake.clear()
            if self._stop.is_set():  # close() woke it while it planned: that wake-up was just cleared
                return
            gap = max(0.05, PLAN_SHARE * cost)  # the same rest as `rested` above, or this loop spins
            self._next_plan = (planned_at + max(1, self.node.min_batches // 2), planned_time + gap)
            # the node's other ranks do not wake this thread: look at their steps every 50 ms
            idle = 0.5 if self.progress is None else 0.05
            rest = max(0.001, gap - (time.monotonic() - planned_time))
            # a ride wants its next plan as soon as the rest allows, not at the next idle look
            self._wake.wait(timeout=rest if self._replan or not rested else idle)

    def _plan_and_fetch(self) -> None:
        """Make one plan from the loop's latest cursor and carry it out: the oracle, the holds, the
        fetches. The node's ranks sharing a staging area, the plan reaches past the fastest of them
        (its windows being read are wanted whatever the budget), and holds last until the slowest
        has passed them (in node samples from this stager's first step, `_held_until`)."""
        with self._lock:
            cursor = self._cursor
            plan_base = self._consumed_steps
        fastest = self._node_steps()[1]
        sps = self.node.samples_per_step
        lead = max(0, fastest - plan_base)
        rate, (p99, mean) = self.consumption_rate(), self._fetch_latency()
        cover = self.burst_seconds()
        ahead = size_lookahead(self.node, rate, p99, mean, cover)
        self.m_lookahead.set(ahead.bytes)
        uses = self.view.future_shard_uses(cursor, horizon_batches=ahead.view_steps + lead)
        first_use: dict[int, int] = {}
        serves: dict[int, int] = {}  # the epoch of that next use: what a fetch for it is counted in
        for use in uses:  # sorted by first use: a shard's next use is its first entry
            first_use.setdefault(use.shard, plan_base * sps + use.first_use)
            serves.setdefault(use.shard, use.epoch)
        with self._lock:
            held, in_flight = set(self._held), set(self._inflight)
            position = (self._consumed_steps - plan_base) * sps
        plan = plan_staging(
            uses,
            self.node,
            consumption_bytes_s=rate,
            fetch_p99_s=p99,
            fetch_mean_s=mean,
            position=position,
            resident=self._resident(),
            held=held,
            in_flight=in_flight,
            lead=lead * sps,
            cover_s=cover,
        )
        manifest = self.view.manifest  # keys from the mapped column: no ShardInfo per planned shard
        oracle = PositionOracle(IntervalOracle((shard_key(manifest, s), f, last) for s, f, last in plan.intervals), 0.0)
        with self._lock:
            self._plan_steps = plan_base
            oracle.position = (self._consumed_steps - plan_base) * self.node.samples_per_step
            self._oracle = oracle
        for tier in self.stack.tiers:
            tier.set_oracle(oracle)
        with self._lock:
            until = {shard: plan_base * sps + last for shard, last in plan.hold_until.items()}
            for shard, last in self._held_until.items():
                if shard not in self._held:
                    continue
                if self._held[shard].tier == STAGING_NAME:
                    # passing through: held for the use it was staged for, not on to a later one
                    # (the next epoch's), which would keep the small staging area full of them
                    until[shard] = min(last, until.get(shard, last))
                elif self.progress is not None:
                    until.setdefault(shard, last)  # this loop passed it: held until the slowest rank has
            self._held_until = until
            self._note_release()
        self._release_passed()
        for shard in plan.fetch:
            with self._lock:
                if shard in self._held or shard in self._inflight or shard in self._given_up:  # staged since
                    continue  # the plan was made, or failed for good
                self._inflight.add(shard)
            with self._link:
                self._tickets += 1
                ticket = self._tickets
                self._queued[ticket] = first_use[shard]
            self._queue.put((shard, first_use[shard], ticket, serves[shard]))
        with self._lock:
            self.m_ahead.set(sum(self._shard_size(s) for s in self._held))
        self._note_rides(idle=not plan.fetch and not in_flight)

    def _resident(self) -> set[int] | None:
        """The shards the top tier holds now (None without tiers)."""
        if not self.stack.tiers:
            return None
        keys = self.stack.tiers[0].resident_keys()
        return {shard for key in keys for shard in self._key_shards.get(key, ())}

    def _release_passed(self) -> None:
        """Unpin staged shards whose last planned use the loop (the node's slowest rank, where they
        share a staging area) has passed, between plans too, so a small tier is not left full of
        pins of finished windows."""
        position = self._node_steps()[0] * self.node.samples_per_step
        with self._lock:
            for shard in passed(self._held_until, self._held, position):
                self._held.pop(shard).release()  # its use has passed: evictable again
            self._note_release()

    def _note_release(self) -> None:
        """Where the next held shard's use passes (under the lock): `consumed` wakes the thread there."""
        until = self._held_until
        self._release_at = min((until.get(shard, -1) + 1 for shard in self._held), default=_NEVER)

    def _shard_size(self, shard: int) -> int:
        info = self.shards[shard]
        return info.bytes_in(self.stack.tiers[0].form if self.stack.tiers else Form.AT_REST)

    def _fetcher(self) -> None:
        while not self._stop.is_set():
            item = self._queue.get()
            if item is None or self._stop.is_set():
                return
            self._fetch(*item)

    def _wait_turn(self, due: int, ticket: int) -> bool:
        """Wait until no transfer in flight, and no fetch queued before this one (a thread has it, or
        will before this one's), is for a shard first needed before `due`, then count this one in;
        False when the stager stopped meanwhile. Only earlier tickets count: the earliest never waits
        on a queued one, so the fetch threads cannot all wait on fetches none of them holds."""

        def earlier_due() -> bool:
            return any(d < due for d in self._transfers) or any(d < due for t, d in self._queued.items() if t < ticket)

        with self._link:
            while earlier_due() and not self._stop.is_set():
                self._link.wait()
            if self._stop.is_set():
                return False
            self._queued.pop(ticket, None)
            self._transfers.append(due)
            return True

    def _dequeued(self, ticket: int) -> None:
        """A queued fetch that moves nothing from below (resident, stopped or failed) stops counting."""
        with self._link:
            if self._queued.pop(ticket, None) is not None:
                self._link.notify_all()

    def _transferred(self, due: int) -> None:
        with self._link:
            self._transfers.remove(due)
            self._link.notify_all()

    def _fetch(self, shard: int, due: int, ticket: int, epoch: int = 0) -> None:
        info = self.shards[shard]
        turn = False  # this fetch transfers from below and counts in `_transfers` until its bytes are in
        counted = False

        def arrived() -> None:  # the link is the next shard's while this one is verified and admitted
            nonlocal counted
            if turn and not counted:
                counted = True
                self._transferred(due)

        try:
            resident = bool(self.stack.tiers) and self.stack.tiers[0].is_resident(info.key)
            if not resident:
                turn = self._wait_turn(due, ticket)
                if not turn:  # the stager stopped while this fetch waited its turn
                    with self._lock:
                        self._inflight.discard(shard)
                    return
            began = self.events.elapsed() if self.events is not None and turn else None
            started = time.perf_counter()  # after the turn: the latency Little's law uses is the transfer's
            with on_downloaded(arrived):
                handle = self.stack.ensure(info, prefetch=True)
            if began is not None:
                self.events.write(
                    "stage",
                    shard=shard,
                    name=info.name,
                    first_use=due,
                    began=began,
                    served_by=None if handle is None else handle.served_by,
                )
        except Exception as e:
            self.m_errors.inc()
            self.faults.warn("stager could not stage a shard", e, "readers will fetch it on demand")
            with self._lock:
                self._inflight.discard(shard)
                if isinstance(e, (FetchError, ShardCorruptError, SourceNotFound)):
                    self._given_up.add(shard)  # its bytes will not verify (or exist) on another try either
            return
        finally:
            if turn:
                arrived()
            else:
                self._dequeued(ticket)
        if handle is None:  # every tier declined it (the policy prefers what it holds): nothing to hold
            self.m_declined.inc()
            with self._lock:
                self._inflight.discard(shard)
            return
        if resident:
            self.m_already.inc()
        else:
            self.m_latency.observe(time.perf_counter() - started)
            self.m_fetched.inc()
        if handle.served_by == SOURCE:
            with self._lock:
                self.source_bytes_by_epoch[epoch] = self.source_bytes_by_epoch.get(epoch, 0) + info.bytes
        with self._lock:
            self._inflight.discard(shard)
            if self._stop.is_set():
                handle.release()
            else:
                self._held[shard] = handle
                self._note_release()
            riding = bool(self._rides)
            if riding and not self._inflight:
                self._replan = True  # a plan stages a few shards at a time: the next few, now
        if riding:
            self._note_rides()
            self._wake.set()

    def snapshot(self) -> dict:
        with self._lock:
            held = sorted(self._held)
        return {
            "enabled": self.enabled,
            "held_shards": held,
            "lookahead_bytes": self.lookahead().bytes,
            "consumption_bytes_per_s": self.consumption_rate(),
            "max_bytes": self.node.max_bytes,
            "fetches": self.m_fetched.value,
            "already_resident": self.m_already.value,
        }
