"""The stager: one per node, it walks the node's known future and pulls shards up the tiers first.

Correctness never depends on it (every reader calls `tier.ensure` itself); it only makes the
reader's `ensure` a hit. It plans from the cursor of the last batch the training loop consumed
(the order's future view, across epoch edges), sizes its lookahead by Little's law (bytes ahead
>= 2 x consumption rate x (p99 fetch latency + one shard's transfer), at least `min_batches`
steps, at most the top tier's capacity minus the window being read), fetches in order of first
use on threads (I/O and decompression release the GIL), and holds a pin on every entry it
staged until its use has passed: a prefetch can never evict, or be evicted before, an entry
that is needed sooner ("do no harm"). The same future drives the clairvoyant policy's oracle.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import queue
from typing import Any

from tierflow.format.shard import Form
from tierflow.policies.oracle import IntervalOracle
from tierflow.telemetry import MetricsRegistry
from tierflow.tiers.stack import Handle, TierStack

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


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for first, last in sorted(spans):
        if out and first <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], last))
        else:
            out.append((first, last))
    return out


PLAN_SHARE = 10


class Stager:
    """Prefetch for `dataset` (a TieredDataset) through `stack` on this node; threads, not processes."""

    def __init__(self, dataset: Any, stack: TierStack, *, threads: int = 2, min_batches: int = 5,
                 max_bytes: int | None = None, registry: MetricsRegistry | None = None,
                 enabled: bool | None = None, prometheus_port: int | None = None) -> None:
        self.dataset = dataset
        self.stack = stack
        self.threads = threads
        self.min_batches = min_batches
        self.enabled = dataset.world.local_rank == 0 if enabled is None else enabled
        manifest = dataset.manifest
        self.shards = manifest.shards
        top_form = stack.tiers[0].form if stack.tiers else Form.AT_REST
        sizes = [s.bytes_in(top_form) for s in self.shards]
        self.shard_bytes = max(sizes) if sizes else 0
        samples = max(1, dataset.num_order_samples)
        per_step_samples = dataset.batch_size * dataset.batcher.batches_per_group * dataset.world.ranks_per_node
        self.bytes_per_step = sum(sizes) / samples * per_step_samples
        self.samples_per_step = per_step_samples
        capacity = min((t.capacity for t in stack.tiers), default=0)
        self.capacity = capacity
        working = dataset.working_set
        active = working.shards * self.shard_bytes
        if capacity and active > capacity:
            log.warning("tier capacity %.1f MB is below the %d shards being read at once (%d lanes x windows of "
                        "%d and the next window): shards the tier cannot take are read from below",
                        capacity / 1e6, working.shards, working.lanes, working.window_shards)
        # at least the next window of every lane, or each window boundary is a stall
        self.next_windows_bytes = working.reading * self.shard_bytes
        self.staging_slots = working.reading
        self.dataset_bytes = sum(sizes)
        cap = capacity - active if capacity else 0
        self.max_bytes = max_bytes if max_bytes is not None else max(cap, self.shard_bytes)
        self.registry = registry or stack.registry
        r = self.registry
        self.m_fetched = r.counter("stager_fetches", description="shards staged ahead of need")
        self.m_already = r.counter("stager_already_resident", description="planned shards already staged")
        self.m_latency = r.histogram("stager_fetch_seconds", description="time to stage one shard")
        self.m_ahead = r.gauge("stager_ahead_bytes", aggregate="max", description="bytes staged and pinned ahead")
        self.m_lookahead = r.gauge("stager_lookahead_bytes", aggregate="max", description="bytes the stager aims ahead")
        self.m_declined = r.counter("stager_declined", description="planned shards no tier would take")
        self.m_plan = r.histogram("stager_plan_seconds", description="time to plan the lookahead once")
        self.m_errors = r.counter("stager_errors", description="fetches that failed (readers fetch on demand)")
        self._cursor: dict | None = None
        self._consumed_steps = 0
        self._plan_steps = 0
        self._rate_started: float | None = None
        self._held: dict[int, Handle] = {}
        self._held_until: dict[int, int] = {}
        self._inflight: set[int] = set()
        self._queue: queue.Queue[int | None] = queue.Queue()
        self._oracle: PositionOracle | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self.prometheus_port = prometheus_port
        self.exporter = None

    # ------------------------------------------------------------ control
    def start(self, cursor: dict | None = None) -> None:
        """Begin staging from `cursor` (the loader's state); returns at once."""
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
        self._threads += [threading.Thread(target=self._fetcher, name=f"tierflow-stage-{i}", daemon=True)
                          for i in range(self.threads)]
        for t in self._threads:
            t.start()

    def consumed(self, cursor: dict) -> None:
        """The training loop consumed a batch whose cursor is `cursor`."""
        if not self.enabled:
            return
        with self._lock:
            self._cursor = cursor
            self._consumed_steps += 1
            if self._rate_started is None:
                self._rate_started = time.perf_counter()
                self._rate_steps0 = self._consumed_steps
            if self._oracle is not None:
                self._oracle.position = (self._consumed_steps - self._plan_steps) * self.samples_per_step
        self._wake.set()

    def close(self) -> None:
        """Stop staging and release what it holds. Call before forking (the Loader does): a thread
        running across a fork can leave the child a lock (an import, a metric) it never gets back."""
        self._stop.set()
        self._wake.set()
        for _ in range(self.threads):
            self._queue.put(None)
        for t in self._threads:
            t.join(timeout=120)  # a fetch in flight finishes first: no thread may outlive close()
            if t.is_alive():
                log.warning("stager thread %s still busy after 120 s; a fork now is unsafe", t.name)
        self._threads = []
        self._queue = queue.Queue()
        with self._lock:
            for handle in self._held.values():
                handle.release()
            self._held.clear()
            self._inflight.clear()

    # ------------------------------------------------------------ planning
    def consumption_rate(self) -> float:
        """Bytes per second the training loop consumes (0 until measured)."""
        if self._rate_started is None:
            return 0.0
        elapsed = time.perf_counter() - self._rate_started
        steps = self._consumed_steps - self._rate_steps0
        return steps * self.bytes_per_step / elapsed if elapsed > 0 and steps > 0 else 0.0

    def lookahead_bytes(self) -> float:
        """Little's law with a 2x margin, at least `min_batches` steps, at most `max_bytes`."""
        p99 = self.m_latency.quantile(0.99) if self.m_latency.count else 1.0
        transfer = self.m_latency.mean if self.m_latency.count else 1.0
        want = max(self.min_batches * self.bytes_per_step, 2 * self.consumption_rate() * (p99 + transfer),
                   self.next_windows_bytes)
        return min(want, self.max_bytes)

    def _run(self) -> None:
        planned_at, planned_time, cost = -1, 0.0, 0.0
        while not self._stop.is_set():
            steps = self._consumed_steps
            # a plan holds the GIL for ~1-40 ms (it walks two tier-capacities of future): plan at most
            # every 10 plans' time, so the stager never takes more than ~10% from the training loop
            rested = time.monotonic() - planned_time > max(0.05, PLAN_SHARE * cost)  # see the wait below
            due = steps - planned_at >= max(1, self.min_batches // 2) and rested
            if planned_at < 0 or due or (not self._wake.is_set() and rested):
                planned_at, planned_time = steps, time.monotonic()
                try:
                    self._plan_and_fetch()
                except Exception:  # noqa: BLE001 - the stager is an optimisation: readers fetch on demand
                    self.m_errors.inc()
                    log.exception("stager planning failed; readers fetch on demand")
                cost = time.monotonic() - planned_time
                self.m_plan.observe(cost)
            else:
                self._release_passed()
            self._wake.clear()
            gap = max(0.05, PLAN_SHARE * cost)  # the same rest as `rested` above, or this loop spins
            self._wake.wait(timeout=0.5 if rested else max(0.001, gap - (time.monotonic() - planned_time)))

    def _plan_and_fetch(self) -> None:
        with self._lock:
            cursor = self._cursor
            plan_base = self._consumed_steps
        lookahead = self.lookahead_bytes()
        self.m_lookahead.set(lookahead)
        horizon = max(self.min_batches, math.ceil(lookahead / max(self.bytes_per_step, 1)))
        # the policy's oracle sees further than the stager fetches: beyond its horizon every entry
        # looks never-needed-again, so it must cover what the tier can hold, twice over
        covered = min(self.capacity, self.dataset_bytes) if self.capacity else self.dataset_bytes
        seen = max(horizon, math.ceil(2 * covered / max(self.bytes_per_step, 1)))
        every_use = self.dataset.future_shard_uses(cursor, horizon_batches=seen)
        limit = horizon * self.samples_per_step
        uses = [u for u in every_use if u.first_use < limit]
        spans: dict[int, list[tuple[int, int]]] = {}
        for use in every_use:
            spans.setdefault(use.shard, []).append((use.first_use, use.last_use))
        oracle = PositionOracle(IntervalOracle(
            (self.shards[s].key, f, l) for s, ss in spans.items() for f, l in _merged(ss)), 0.0)
        with self._lock:
            self._plan_steps = plan_base
            oracle.position = (self._consumed_steps - plan_base) * self.samples_per_step
            self._oracle = oracle
        for tier in self.stack.tiers:
            tier.set_oracle(oracle)
        wanted: list[int] = []
        for use in sorted(uses, key=lambda u: u.first_use):
            if use.shard not in wanted:
                wanted.append(use.shard)
        until: dict[int, int] = {}
        with self._lock:
            staged = set(self._held) | self._inflight
        for use in every_use:  # held to the end of its next use, even one past this plan's horizon
            if use.shard not in until and (use.first_use < limit or use.shard in staged):
                until[use.shard] = use.last_use
        with self._lock:
            self._held_until = until
        self._release_passed()
        in_use = {u.shard for u in uses if u.first_use <= 0}
        budget = lookahead
        top = self.stack.tiers[0] if self.stack.tiers else None
        passing = 0  # shards the top tier does not hold go through the staging area: one window ahead
        for shard in wanted:
            if shard not in in_use:  # the windows being read now are needed, not "ahead"
                if budget < self.shard_bytes:
                    break
                budget -= self.shard_bytes
                if top is not None and top.index.get(self.shards[shard].key) is None:
                    passing += 1
                    if passing > self.staging_slots:
                        break
            with self._lock:
                if shard in self._held or shard in self._inflight:
                    continue
                self._inflight.add(shard)
            self._queue.put(shard)
        with self._lock:
            self.m_ahead.set(sum(self._shard_size(s) for s in self._held))

    def _release_passed(self) -> None:
        """Unpin staged shards whose last planned use the loop has passed (between plans too, so a
        small tier is not left full of pins of finished windows)."""
        with self._lock:
            position = (self._consumed_steps - self._plan_steps) * self.samples_per_step
            for shard in [s for s in self._held if self._held_until.get(s, -1) < position]:
                self._held.pop(shard).release()  # its use has passed: evictable again

    def _shard_size(self, shard: int) -> int:
        info = self.shards[shard]
        return info.bytes_in(self.stack.tiers[0].form if self.stack.tiers else Form.AT_REST)

    def _fetcher(self) -> None:
        while not self._stop.is_set():
            shard = self._queue.get()
            if shard is None or self._stop.is_set():
                return
            self._fetch(shard)

    def _fetch(self, shard: int) -> None:
        started = time.perf_counter()
        info = self.shards[shard]
        resident = bool(self.stack.tiers) and self.stack.tiers[0].index.get(info.key) is not None
        try:
            handle = self.stack.ensure(info, prefetch=True)
        except Exception:  # noqa: BLE001
            self.m_errors.inc()
            log.warning("stager could not stage shard %s; readers will fetch it on demand",
                        self.shards[shard].name, exc_info=True)
            with self._lock:
                self._inflight.discard(shard)
            return
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
        with self._lock:
            self._inflight.discard(shard)
            if self._stop.is_set():
                handle.release()
            else:
                self._held[shard] = handle

    def snapshot(self) -> dict:
        with self._lock:
            held = sorted(self._held)
        return {"enabled": self.enabled, "held_shards": held, "lookahead_bytes": self.lookahead_bytes(),
                "consumption_bytes_per_s": self.consumption_rate(), "max_bytes": self.max_bytes,
                "fetches": self.m_fetched.value, "already_resident": self.m_already.value}
