"""A tier: a directory + a capacity + a policy + the form it stores, shared by every process on a node.

`Tier.ensure(key, ...)` is the one way to get a readable local file of an entry. A hit pins
and returns it; a miss takes the entry's kernel lock (one fetch per entry per node), reserves
space (occupancy + reservations <= capacity, evicting unpinned victims named by the policy),
fetches to a temporary name, verifies size and checksum, renames and admits. When the policy
declines or no space can be made, `ensure` returns None and the caller serves from the tier
below without caching (`ensure_made` is the same for an entry made on the node, whose bytes are
known only once made: transforms/resized.py's image blocks). The same code serves a tmpfs L1
and an NVMe L2.

`Tier` is the façade over three parts: the entries on disk and their index rows
(tiers/entries.py: lookup, verification, block lists, quarantine), the admission controller
(policies/admission.py: policy, fair share, making room; the simulator and `tierflow plan` run
the same one), and the failure fallbacks (tiers/fallbacks.py: a vanished tier, a full or failing
disk). What is left here is configuration, capacity and filling a miss.
"""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from tierflow.errors import FetchError, TierIndexError
from tierflow.format._checksum import file_xxh3_128, xxh3_128_hex
from tierflow.format.shard import Block, Form
from tierflow.policies.admission import AdmissionController, Refusal
from tierflow.policies.auto import AutoPolicy, Lifecycle
from tierflow.policies.base import EntryStats, NextUseOracle, rebase_stats
from tierflow.policies.registry import make_policy
from tierflow.telemetry import MetricsRegistry
from tierflow.tiers._index import EntryRow, index_damaged
from tierflow.tiers._lock import Pin
from tierflow.tiers.capacity import Capacity, is_tmpfs, memory_headroom
from tierflow.tiers.entries import INDEX_NAME, BlockLister, EntryStore
from tierflow.tiers.fallbacks import DEVICE_FAILED, NO_SPACE, TierFallbacks
from tierflow.tiers.tier_metrics import TierMetrics

log = logging.getLogger("tierflow.tiers")


@dataclass(frozen=True)
class EntryHeat:
    """One resident entry's statistics as a checkpoint carries them to another process or node:
    its policy's state (`stats`), its hits and its last access, in the clock of the tier it left."""

    key: str
    size: int
    hits: int
    last_access: float
    stats: EntryStats


def tier_form(form: Form | str, tier: str) -> Form:
    """A tier's form from a config's or the CLI's string; a wrong one is named with the tier."""
    try:
        return Form(form)
    except ValueError as e:
        raise ValueError(f"tier {tier}: {e}") from None


class Tier(TierMetrics):
    """One cache directory. Thread- and process-safe; cheap to construct in every process."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        capacity: float,
        policy: str = "lru",
        form: Form | str = Form.DECODED,
        name: str = "L2",
        lock_timeout: float = 120.0,
        verify_hits: bool = True,
        registry: MetricsRegistry | None = None,
        policy_options: dict[str, Any] | None = None,
        ram: bool | None = None,
        fetch_attempts: int = 3,
        clock: Callable[[], float] = time.time,
        configure: bool = True,
        strict: bool = True,
    ) -> None:
        """`configure`: store this capacity, policy and form as the directory's if it has none yet
        (the first to open a tier decides). False for a look at it (`tierflow cache ls|evict|clean`):
        the directory is configured by the first entry written through this handle, if any.
        `strict`: a damaged index is TierIndexError; False (a running job's tier reopened in its
        worker process) bypasses the tier instead (`unavailable`, TierUnavailableWarning)."""
        form = tier_form(form, name)
        self.clock = clock
        """The time the policy is told (`now`); a test replays a sequence with its own."""
        self.root = Path(root)
        self.name = name
        self.lock_timeout = lock_timeout
        self.verify_hits = verify_hits
        self.fetch_attempts = fetch_attempts
        self.root.mkdir(parents=True, exist_ok=True)
        self._metrics(registry)
        self.fallbacks = TierFallbacks(
            self.root,
            name,
            enospc=self.m_enospc,
            write_errors=self.m_write_errors,
            unavailable=self.m_unavailable,
            index_unwritable=self.m_index_unwritable,
        )
        self._index_trouble = self.fallbacks.index_trouble
        self.store = EntryStore(self.root, name, self._index_trouble, self.m_corruptions, self.fallbacks.broken)
        self.index = self.store.index
        # what is used while the index cannot be opened (a full disk): what was asked
        stored = requested = {
            "capacity": str(Capacity(capacity).resolve(self.root, 0)),
            "policy": policy,
            "form": form.value,
        }
        try:
            requested["capacity"] = str(Capacity(capacity).resolve(self.root, self.index.occupancy()[0]))
            stored = self.index.set_config_if_absent(requested) if configure else (self.index.config() or requested)
        except sqlite3.Error as e:  # a full disk: no caching, with what was asked, until the index opens
            if index_damaged(e) and not strict:
                self.fallbacks.broken(e)
            elif index_damaged(e):
                raise TierIndexError(
                    f"tier {name}: {self.root / INDEX_NAME}: {e}; the tier is a cache: remove the "
                    f"tier directory (its entries are fetched again)"
                ) from e
            if not self._index_trouble(e):
                raise
        for k, v in requested.items() if configure else ():  # a look asks for nothing
            if stored[k] != v and not (k == "capacity" and capacity <= 1):
                log.warning(
                    "tier %s (%s): asked for %s=%s but the directory is configured with %s; "
                    "capacity and policy belong to the directory, keeping %s",
                    name,
                    self.root,
                    k,
                    v,
                    stored[k],
                    stored[k],
                )
        self._requested = requested
        self._configured = stored is not requested  # else stored before the first entry is (`_reserve`)
        self.configured_capacity = int(stored["capacity"])
        self.policy_name = stored["policy"]
        self.form = tier_form(stored["form"], name)
        self.policy_options = policy_options or {}
        self.admission = AdmissionController(partial(make_policy, self.policy_name, **self.policy_options))
        self.ram = is_tmpfs(self.root) if ram is None else ram
        self._readers: set[tuple[int, str]] = set()  # (pid, dataset) this process has recorded

    @property
    def unavailable(self) -> str | None:
        """Why this process no longer uses the tier, or None (tiers/fallbacks.py)."""
        return self.fallbacks.unavailable

    # ------------------------------------------------------------ capacity
    @property
    def capacity(self) -> int:
        """Usable bytes now. On tmpfs (L1): min(configured, tmpfs free + own, half the memory headroom)."""
        if not self.ram:
            return self.configured_capacity
        own = 0
        with self._index_trouble.tolerated():
            own = self.index.occupancy()[0]
        try:
            free = shutil.disk_usage(self.root).free
        except OSError:  # the directory vanished: the tier is bypassed (`unavailable`), nothing more fits
            return 0 if self.unavailable is not None or self.fallbacks.vanished() else self.configured_capacity
        limits = [self.configured_capacity, free + own]
        headroom = memory_headroom()
        if headroom is not None:
            limits.append(own + headroom // 2)
        return int(min(limits))

    def path_of(self, key: str) -> Path:
        return self.store.path_of(key)

    # ------------------------------------------------------------ policy
    @property
    def oracle(self) -> NextUseOracle | None:
        return self.admission.oracle

    def set_oracle(self, oracle: NextUseOracle | None) -> None:
        """The known future (from the order), for the clairvoyant and auto policies."""
        self.admission.set_oracle(oracle)

    def set_lifecycle(self, lifecycle: Lifecycle) -> None:
        """How this process reads the tier (reshuffled epochs, a single pass...), for `auto`."""
        if self.policy_name != "auto":
            return
        self.policy_options = {**self.policy_options, "lifecycle": lifecycle}
        with self.admission.lock:
            self.admission.make_policy = partial(make_policy, self.policy_name, **self.policy_options)
            if isinstance(self.admission.live, AutoPolicy):
                self.admission.live.set_lifecycle(lifecycle)

    def _touch(self, row: EntryRow, now: float) -> None:
        with self.admission.lock:
            stats = self.admission.accessed(row.key, row.size, row.stats, now)
        with self.index.transaction() as c:
            self.index.touch(c, row.key, now, stats)

    # ------------------------------------------------------------ heat (checkpoint and restore)
    def heat(self) -> list[EntryHeat]:
        """Every resident entry's statistics, hottest first (most hits, then latest access)."""
        rows = []
        with self._index_trouble.tolerated():
            rows = self.index.entries()
        rows.sort(key=lambda r: (-r.hits, -r.last_access, r.key))
        return [EntryHeat(r.key, r.size, r.hits, r.last_access, r.stats) for r in rows]

    def restore_heat(self, saved: Iterable[EntryHeat], shift: float = 0.0) -> int:
        """Give the resident entries among `saved` their saved statistics, moved `shift` along the
        clock (this tier's now less the saved tier's now at the save), in the index and this
        process's policy, so that its decisions from now on are those the saved tier would have
        made. Entries not resident here, or of another size, are skipped; returns how many took.
        Call before readers of other processes start (their policies read the index once). An
        index that cannot be written (a full disk) restores nothing: the resume goes on cold."""
        committed = 0
        with self._index_trouble.tolerated():
            restored = 0
            with self.index.transaction() as c, self.admission.lock:
                rows = {r.key: r for r in self.index.entries(c)}
                self.admission.sync(rows)  # no policy pin is held outside a reservation: restore is safe
                for entry in saved:
                    row = rows.get(entry.key)
                    if row is None or row.size != entry.size:
                        continue
                    stats = rebase_stats(entry.stats, shift)
                    self.admission.restored(entry.key, row.size, stats)
                    self.index.set_heat(c, entry.key, entry.last_access + shift, entry.hits, stats)
                    restored += 1
            committed = restored
        return committed

    # ------------------------------------------------------------ reads
    def lookup(self, key: str, verify: bool | None = None, block_list: BlockLister | None = None) -> Pin | None:
        """A pinned, verified resident entry, or None (a miss, or a quarantined corrupt entry).

        `verify=False`: the caller verifies each block before it serves a byte of it, so only the
        size is checked here; with `block_list` (how to cut a verified file into blocks) the
        entry must have its block list (tiers/entries.py)."""
        if self.unavailable is not None:
            return None
        found = self.store.find(key, self.verify_hits if verify is None else verify, block_list)
        if found is None:
            return None
        pin, row = found
        with self._index_trouble.tolerated():  # a hit is still a hit when its statistics cannot be saved
            self._touch(row, self.clock())
        self.m_hits.inc()
        self.m_bytes_out.inc(row.size)
        return pin

    def blocks_of(self, key: str, size: int | None = None, checksum: str | None = None) -> list[Block] | None:
        """The entry's block list (recorded at admission), or None when it has none or it is unsound."""
        return self.store.blocks_of(key, size, checksum)

    def quarantine(self, key: str, why: str, pin: Pin | None = None) -> bool:
        """Move a corrupt entry aside (it is fetched again on next use); with `pin`, only if the
        entry is still the file that pin holds (another process may have replaced it already)."""
        return self.store.quarantine(key, why, pin)

    def resident_keys(self) -> set[str]:
        """The keys of the admitted entries; none where the tier is bypassed or its index unreadable."""
        return self.store.resident_keys() if self.unavailable is None else set()

    def is_resident(self, key: str) -> bool:
        """Whether the index lists `key` (False where the tier is bypassed or its index unreadable)."""
        return self.unavailable is None and self.store.is_resident(key)

    # ------------------------------------------------------------ filling a miss
    def ensure(
        self,
        key: str,
        size: int,
        checksum: str,
        produce: Callable[[Path], None],
        dataset: str | None = None,
        prefetch: bool = False,
        verify_hit: bool | None = None,
        block_list: BlockLister | None = None,
    ) -> Pin | None:
        """A pin on the entry, fetching it with `produce(tmp_path)` on a miss; None = serve from below.

        `prefetch` marks a fetch ahead of need: the entry is not yet used, so evicting it before
        a reader asks for it counts as an eviction before use (a demand fetch is its own first use).
        `verify_hit=False`: the caller verifies blocks as it reads them (see `lookup`);
        `block_list` cuts a fetched, verified file into blocks, recorded with the entry.
        A tier whose directory vanished or whose index broke under this process returns None from
        then on (`unavailable`, `TierUnavailableWarning` once).
        """
        try:
            return self._ensure(key, size, checksum, produce, dataset, prefetch, verify_hit, block_list)
        except (OSError, sqlite3.Error) as e:
            if not self.fallbacks.broken(e):
                raise
            self.m_unavailable.inc()
            return None

    def _ensure(
        self,
        key: str,
        size: int,
        checksum: str,
        produce: Callable[[Path], None],
        dataset: str | None,
        prefetch: bool,
        verify_hit: bool | None,
        block_list: BlockLister | None,
    ) -> Pin | None:
        if dataset is not None:
            self.add_reader(dataset)
        pin = self.lookup(key, verify_hit, block_list)
        if pin is not None:
            return pin
        if self.fallbacks.bypassed():
            return None
        with self.fallbacks.fetch_lock(key, self.lock_timeout) as lock:
            if lock is None:
                return None  # its lock file cannot be made (a failing or full device): serve from below
            if not lock.acquired:
                self.m_takeovers.inc()
            pin = self.lookup(key, verify_hit, block_list)
            if pin is not None:
                return pin
            return self._fill(key, size, checksum, produce, dataset, prefetch, block_list)

    def ensure_made(
        self, key: str, make: Callable[[], bytes], dataset: str | None = None, verify_hit: bool | None = None
    ) -> tuple[Pin | None, bytes | None]:
        """`ensure` for an entry derived on this node (an image cache's resized pixels), whose size and
        checksum are known only once it is made: `make()` runs under the entry's fetch lock (one maker
        per node) and its bytes are what is reserved, written, verified and admitted like any fill.
        Returns (the pin, None) on a hit, else (the pin or None where the tier keeps nothing, the bytes);
        `verify_hit=False`: the caller checks the entry's contents as it reads them."""
        try:
            return self._ensure_made(key, make, dataset, verify_hit)
        except (OSError, sqlite3.Error) as e:
            if not self.fallbacks.broken(e):
                raise
            self.m_unavailable.inc()
            return None, make()

    def _ensure_made(
        self, key: str, make: Callable[[], bytes], dataset: str | None, verify_hit: bool | None
    ) -> tuple[Pin | None, bytes | None]:
        if dataset is not None:
            self.add_reader(dataset)
        pin = self.lookup(key, verify_hit)
        if pin is not None:
            return pin, None
        if self.fallbacks.bypassed():
            return None, make()
        with self.fallbacks.fetch_lock(key, self.lock_timeout) as lock:
            if lock is not None:
                if not lock.acquired:
                    self.m_takeovers.inc()
                pin = self.lookup(key, verify_hit)
                if pin is not None:
                    return pin, None
            data = make()
            if lock is None:  # its lock file cannot be made (a failing or full device): not kept
                return None, data

            def write(tmp: Path) -> None:
                tmp.write_bytes(data)

            return self._fill(key, len(data), xxh3_128_hex(data), write, dataset), data

    def _fill(
        self,
        key: str,
        size: int,
        checksum: str,
        produce: Callable[[Path], None],
        dataset: str | None,
        prefetch: bool = False,
        block_list: BlockLister | None = None,
    ) -> Pin | None:
        """A miss under the entry's fetch lock: reserve, produce to a temporary name, verify, rename, admit."""
        (self.m_prefetches if prefetch else self.m_misses).inc()
        started = time.perf_counter()
        enospc = 0
        corrupt = 0
        while True:
            try:
                reservation = self._reserve(key, size, extra=size * enospc, required=not prefetch, dataset=dataset)
            except sqlite3.Error as e:
                if not self._index_trouble(e):
                    raise
                return None
            if reservation is None:
                return None
            tmp = self.store.temporary(key)
            pin = None
            try:
                produce(tmp)
                self._verify_fetched(tmp, key, size, checksum)
                if block_list is not None:  # before the entry appears: a resident entry has its list
                    self.store.record_blocks(key, size, checksum, block_list(tmp))
                # pinned before it appears: once admitted, another process could pick it as a
                # victim and unlink it before this one had pinned it
                pin = Pin(tmp)
                os.replace(tmp, self.path_of(key))
                pin.path = self.path_of(key)
            except FetchError:
                tmp.unlink(missing_ok=True)
                self._release(reservation)
                corrupt += 1
                if corrupt < self.fetch_attempts:
                    continue  # a torn or corrupted transfer: fetch it again
                raise
            except OSError as e:
                if pin is not None:
                    pin.release()
                tmp.unlink(missing_ok=True)
                self._release(reservation)
                if e.errno in DEVICE_FAILED:
                    self.fallbacks.write_failed(e)
                    return None
                if e.errno not in NO_SPACE:
                    raise
                enospc += 1
                if enospc == 1:
                    continue  # evict one entry's worth more and try again
                self.fallbacks.no_space()
                return None
            except BaseException:
                if pin is not None:
                    pin.release()
                tmp.unlink(missing_ok=True)
                self._release(reservation)
                raise
            try:
                self._admit(key, size, checksum, dataset, reservation, used=not prefetch)
            except BaseException as e:
                pin.release()
                if isinstance(e, sqlite3.Error) and self._index_trouble(e):
                    self._unadmit(key, reservation)
                    return None
                raise
            self.m_latency.observe(time.perf_counter() - started)
            self.m_promotions.inc()
            self.m_bytes_in.inc(size)
            return pin

    def _verify_fetched(self, tmp: Path, key: str, size: int, checksum: str) -> None:
        got_size = tmp.stat().st_size
        if got_size != size or file_xxh3_128(tmp) != checksum:
            self.m_corruptions.inc()
            raise FetchError(
                f"tier {self.name}: fetched bytes of {key} do not verify (size {got_size}, "
                f"expected {size}) after {self.fetch_attempts} attempts; nothing was admitted"
            )

    def _admit(self, key: str, size: int, checksum: str, dataset: str | None, reservation: int, used: bool) -> None:
        now = self.clock()
        with self.admission.lock:
            self.admission.inserted(key, size, now)
            stats = self.admission.policy.stats(key)
        row = EntryRow(key, size, checksum, dataset, now, now, int(used), stats)
        with self.index.transaction() as c:
            self.index.admit(c, row, reservation)
        self.m_occupancy.set(self.index.occupancy()[0])

    def _release(self, reservation: int) -> None:
        """Give back a reservation; on a full disk it stays until this process exits (then reclaimed)."""
        with self._index_trouble.tolerated():
            self.index.release(reservation)

    def _unadmit(self, key: str, reservation: int) -> None:
        """Remove an entry the index could not record (the disk filled): nothing unaccounted stays."""
        with self.admission.lock:
            self.admission.removed(key)
        self.store.remove_file(key)
        self._release(reservation)

    # ------------------------------------------------------------ space
    def add_reader(self, dataset: str) -> None:
        """Record that this process reads `dataset` through the tier: while it lives, the dataset has
        a fair share of the room (policies/fairshare.py). Once per process and dataset."""
        if (os.getpid(), dataset) in self._readers:
            return
        with self._index_trouble.tolerated():
            self.index.add_reader(dataset)
            self._readers.add((os.getpid(), dataset))

    def _reserve(
        self, key: str, size: int, extra: int = 0, required: bool = True, dataset: str | None = None
    ) -> int | None:
        """Reserve `size` bytes in the index, evicting what the admission controller names; None when
        the entry cannot be cached (policies/admission.py says when: a reader's entry is `required`)."""
        if not self._configured:  # the index opens now: the directory's configuration goes first
            if self.index.set_config_if_absent(self._requested)["form"] != self.form.value:
                self.m_bypass.inc()
                return None  # another process configured it for another form meanwhile: not ours to fill
            self._configured = True
        capacity = self.capacity
        self.m_capacity.set(capacity)
        if size > capacity:  # declined without opening the index (the controller would decline it too)
            self.m_bypass.inc()
            return None
        now = self.clock()
        with self.index.transaction() as c, self.admission.lock:
            rows = {r.key: r for r in self.index.entries(c)}
            self.admission.sync(rows)
            decided = self.admission.reserve(
                rows,
                key,
                size,
                now,
                capacity,
                self.index.used(c),
                required=required,
                extra=extra,
                dataset=dataset,
                readers=self.index.read_datasets(c),
                remove=lambda victim: self.store.remove_unpinned(c, victim),
            )
            for victim in decided.evicted:
                self.m_evictions.inc()
                if rows[victim.key].hits == 0:
                    self.m_evicted_unused.inc()
            if decided.refused is Refusal.DECLINED:
                self.m_bypass.inc()
                return None
            if decided.refused is Refusal.IN_USE:
                (self.m_in_use if required else self.m_prefetch_no_room).inc()
                return None
            return self.index.reserve(c, key, size)

    def evict(self, keys: list[str] | None = None) -> int:
        """Drop entries (all when None) that no process is using; returns how many went."""
        return self.store.evict(keys)

    def clean(self) -> int:
        """Remove leftovers of dead jobs: temporaries, quarantined files, files the index does not know."""
        return self.store.clean()

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its configuration (capacity, policy and form are the directory's): the child
        opens its own index connection and locks."""
        return (
            Tier,
            (
                self.root,
                self.configured_capacity,
                self.policy_name,
                self.form,
                self.name,
                self.lock_timeout,
                self.verify_hits,
                self.registry,
                self.policy_options,
                self.ram,
                self.fetch_attempts,
                self.clock,
                True,
                False,
            ),
        )

    def snapshot(self) -> dict[str, Any]:
        resident = reserved = entries = 0
        with self._index_trouble.tolerated():
            resident, reserved = self.index.occupancy()
            entries = len(self.index.entries())
        self.m_occupancy.set(resident)
        return {
            "name": self.name,
            "root": str(self.root),
            "form": self.form,
            "policy": self.policy_name,
            "capacity": self.capacity,
            "resident_bytes": resident,
            "reserved_bytes": reserved,
            "entries": entries,
        }
