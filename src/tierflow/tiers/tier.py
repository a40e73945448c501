"""A tier: a directory + a capacity + a policy + the form it stores, shared by every process on a node.

`Tier.ensure(key, ...)` is the one way to get a readable local file of an entry. A hit pins
and returns it; a miss takes the entry's kernel lock (one fetch per entry per node), reserves
space (occupancy + reservations <= capacity, evicting unpinned victims named by the policy),
fetches to a temporary name, verifies size and checksum, renames and admits. When the policy
declines or no space can be made, `ensure` returns None and the caller serves from the tier
below without caching (`ensure_made` is the same for an entry made on the node, whose bytes are
known only once made: transforms/resized.py's image blocks). The same code serves a tmpfs L1
and an NVMe L2. So does a full disk, whether the shard write or the index (SQLite) hits it: the
read is served from below, a warning is logged once and `tier_enospc_fallbacks` /
`tier_index_unwritable` count it. A failing device (EIO or a read-only file system while
writing an entry, its fetch lock or the index) is served from below the same way, counted in
`tier_write_error_fallbacks`.

A hit is verified whole (xxh3-128) unless the caller verifies by block as it reads
(`verify_hit=False`, the tier stack's readers): then a hit costs a size check, and the entry's
block list (byte ranges + xxh3-64, `blocks/<key>.json`, recorded at admission from verified
bytes for a form whose blocks the manifest does not list) is what the reader checks against.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import secrets
import shutil
import sqlite3
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Sequence

from tierflow.format._checksum import file_xxh3_128, xxh3_128_hex, xxh3_hex
from tierflow.format._regular import read_regular
from tierflow.format.shard import Block, Form
from tierflow.policies import make_policy
from tierflow.policies.auto import Lifecycle
from tierflow.policies.base import CachePolicy, EntryStats, NextUseOracle, rebase_stats
from tierflow.telemetry import Counter, MetricsRegistry
from tierflow.tiers._fairshare import FairShare
from tierflow.tiers._index import EntryRow, IndexTrouble, TierIndex, index_damaged, process_alive
from tierflow.tiers._lock import FileLock, Pin, is_pinned, try_remove_unpinned
from tierflow.errors import FetchError, ShardCorruptError, TierIndexError, TierUnavailableWarning

log = logging.getLogger("tierflow.tiers")
INDEX_NAME = "tierflow-index.sqlite"
MAX_BLOCK_LIST_BYTES = 64 << 20
NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})
DEVICE_FAILED = frozenset({errno.EIO, errno.EROFS})
"""Write errors of a tier's own files after which the read is served from below (tiers are optional)."""
SUBDIRS = ("entries", "locks", "tmp", "quarantine", "blocks")


@dataclass(frozen=True)
class EntryHeat:
    """One resident entry's statistics as a checkpoint carries them to another process or node:
    its policy's state (`stats`), its hits and its last access, in the clock of the tier it left."""

    key: str
    size: int
    hits: int
    last_access: float
    stats: EntryStats


@dataclass
class Capacity:
    """Bytes, or a fraction of (free space + the tier's own usage) at start."""

    value: float

    def resolve(self, root: Path, own_usage: int) -> int:
        if self.value > 1:
            return int(self.value)
        usage = shutil.disk_usage(root)
        return int(self.value * (usage.free + own_usage))


def memory_headroom(cgroup: Path = Path("/sys/fs/cgroup"), meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """Bytes the job may still allocate: cgroup v2 limit minus usage, else MemAvailable (None: neither
    is known). The paths are the kernel's; a test hands its own files."""
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        current = int((cgroup / "memory.current").read_text())
        if limit != "max":
            return max(0, int(limit) - current)
    except (OSError, ValueError):
        pass
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def is_tmpfs(path: Path) -> bool:
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return False
    best, fstype = "", ""
    resolved = str(path.resolve())
    for line in mounts:
        parts = line.split()
        if len(parts) >= 3 and (resolved == parts[1] or resolved.startswith(parts[1].rstrip("/") + "/")):
            if len(parts[1]) > len(best):
                best, fstype = parts[1], parts[2]
    return fstype == "tmpfs"


def tier_form(form: Form | str, tier: str) -> Form:
    """A tier's form from a config's or the CLI's string; a wrong one is named with the tier."""
    try:
        return Form(form)
    except ValueError as e:
        raise ValueError(f"tier {tier}: {e}") from None


class Tier:
    """One cache directory. Thread- and process-safe; cheap to construct in every process."""

    def __init__(self, root: str | os.PathLike, capacity: float, policy: str = "lru", form: Form | str = Form.DECODED,
                 name: str = "L2", lock_timeout: float = 120.0, verify_hits: bool = True,
                 registry: MetricsRegistry | None = None, policy_options: dict | None = None,
                 ram: bool | None = None, fetch_attempts: int = 3,
                 clock: Callable[[], float] = time.time, configure: bool = True, strict: bool = True) -> None:
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
        for sub in SUBDIRS:
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        root = os.stat(self.root)
        self._identity = (root.st_dev, root.st_ino)
        self._bypass_lock = threading.Lock()
        self.unavailable: str | None = None
        """Why this process no longer uses the tier (its directory vanished or was replaced, its index
        broke), or None: then every read is served from below (`TierUnavailableWarning`, once)."""
        self._metrics(registry)
        self._index_trouble = IndexTrouble(self.m_index_unwritable, f"tier {name} ({self.root})", self._broken)
        self.index = TierIndex(self.root / INDEX_NAME)
        # what is used while the index cannot be opened (a full disk): what was asked
        stored = requested = {"capacity": str(Capacity(capacity).resolve(self.root, 0)), "policy": policy, "form": form.value}
        try:
            requested["capacity"] = str(Capacity(capacity).resolve(self.root, self.index.occupancy()[0]))
            stored = self.index.set_config_if_absent(requested) if configure else (self.index.config() or requested)
        except sqlite3.Error as e:  # a full disk: no caching, with what was asked, until the index opens
            if index_damaged(e) and not strict:
                self._broken(e)
            elif index_damaged(e):
                raise TierIndexError(f"tier {name}: {self.root / INDEX_NAME}: {e}; the tier is a cache: remove the "
                                     f"tier directory (its entries are fetched again)") from e
            if not self._index_trouble(e):
                raise
        for k, v in requested.items() if configure else ():  # a look asks for nothing
            if stored[k] != v and not (k == "capacity" and capacity <= 1):
                log.warning("tier %s (%s): asked for %s=%s but the directory is configured with %s; "
                            "capacity and policy belong to the directory, keeping %s", name, self.root, k, v,
                            stored[k], stored[k])
        self._requested = requested
        self._configured = stored is not requested  # else stored before the first entry is (`_reserve`)
        self.configured_capacity = int(stored["capacity"])
        self.policy_name = stored["policy"]
        self.form = tier_form(stored["form"], name)
        self.policy_options = policy_options or {}
        self.oracle: NextUseOracle | None = None
        self._live: CachePolicy | None = None
        self._live_keys: set[str] = set()
        self._policy_lock = threading.RLock()
        self.ram = is_tmpfs(self.root) if ram is None else ram
        self._readers: set[tuple[int, str]] = set()  # (pid, dataset) this process has recorded
        self._block_lists: dict[str, list[Block]] = {}  # content-addressed: never stale

    def _metrics(self, registry: MetricsRegistry | None) -> None:
        self.registry = registry or MetricsRegistry()
        labels = {"tier": self.name}
        r = self.registry

        def count(what: str, description: str = "") -> Counter:
            return r.counter(f"tierflow_tier_{what}_total", labels, description)

        self.m_hits = count("hits", "entry found in this tier")
        self.m_misses = count("misses", "a reader's entry fetched from below (demand miss)")
        self.m_prefetches = count("prefetches", "entries fetched ahead of need by the stager")
        self.m_bytes_in = count("in_bytes", "bytes written into this tier")
        self.m_bytes_out = count("out_bytes", "bytes served from this tier")
        self.m_promotions = count("promotions", "entries admitted from a lower tier")
        self.m_evictions = count("evictions")
        self.m_evicted_unused = count("evictions_before_use", "prefetched, evicted before any read")
        self.m_corruptions = count("corruptions", "entries that failed verification")
        self.m_enospc = count("enospc_fallbacks", "served from below: no space")
        self.m_write_errors = count("write_error_fallbacks", "served from below: the tier's device failed a write "
                                    "(EIO, read-only)")
        self.m_index_unwritable = count("index_unwritable", "index writes failed (filesystem full or failing); "
                                        "served from below")
        self.m_bypass = count("bypass", "served from below: the policy declined")
        self.m_in_use = count("full_in_use", "served from below: every resident entry in use")
        self.m_prefetch_no_room = count("prefetch_no_room", "prefetches dropped: every resident entry in use")
        self.m_takeovers = count("lock_takeovers", "fetch lock timed out; fetched anyway")
        self.m_unavailable = count("unavailable_fallbacks", "served from below: the tier's directory vanished or "
                                   "was replaced, or its index broke, under this process")
        self.m_latency = r.histogram("tierflow_tier_fetch_seconds", labels, "time to fill a miss")
        self.m_occupancy = r.gauge("tierflow_tier_occupancy_bytes", labels, aggregate="max")
        self.m_capacity = r.gauge("tierflow_tier_capacity_bytes", labels, aggregate="max")
        self._warned_enospc = False
        self._warned_write_error = False

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
            return 0 if self.unavailable is not None or self._vanished() else self.configured_capacity
        limits = [self.configured_capacity, free + own]
        headroom = memory_headroom()
        if headroom is not None:
            limits.append(own + headroom // 2)
        return int(min(limits))

    def path_of(self, key: str) -> Path:
        return self.root / "entries" / f"{key}.arrow"

    # ------------------------------------------------------------ policy
    def _policy(self) -> CachePolicy:
        policy = make_policy(self.policy_name, **self.policy_options)
        if self.oracle is not None:
            policy.set_oracle(self.oracle)
        return policy

    def set_oracle(self, oracle: NextUseOracle | None) -> None:
        """The known future (from the order), for the clairvoyant and auto policies."""
        self.oracle = oracle
        if self._live is not None:
            self._live.set_oracle(oracle)

    def set_lifecycle(self, lifecycle: Lifecycle) -> None:
        """How this process reads the tier (reshuffled epochs, a single pass...), for `auto`."""
        if self.policy_name != "auto":
            return
        self.policy_options = {**self.policy_options, "lifecycle": lifecycle}
        with self._policy_lock:
            if self._live is not None:
                self._live.set_lifecycle(lifecycle)  # type: ignore[attr-defined]

    def _synced_policy(self, rows: dict[str, EntryRow]) -> CachePolicy:
        """This process's long-lived policy, made to agree with the shared index.

        It lives as long as the process so policies with memory beyond residents (hotscore's
        history of evicted keys) keep it; entries other processes admitted or removed are
        restored from, or dropped to, what the index says.
        """
        if self._live is None:
            self._live = self._policy()
        policy = self._live
        for key in [k for k in self._live_keys if k not in rows]:  # no policy pin is held here (see _reserve)
            policy.on_remove(key)
            self._live_keys.discard(key)
        for row in rows.values():
            if row.key not in self._live_keys:
                policy.restore(row.key, row.size, row.stats)
                self._live_keys.add(row.key)
        return policy

    def _touch(self, row: EntryRow, now: float) -> None:
        with self._policy_lock:
            if self._live is not None and row.key in self._live_keys:
                self._live.on_access(row.key, now)
                stats = self._live.stats(row.key)
            else:
                scratch = self._policy()
                scratch.restore(row.key, row.size, row.stats)
                scratch.on_access(row.key, now)
                stats = scratch.stats(row.key)
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
            with self.index.transaction() as c, self._policy_lock:
                rows = {r.key: r for r in self.index.entries(c)}
                policy = self._synced_policy(rows)  # no policy pin is held outside _reserve: restore is safe
                for entry in saved:
                    row = rows.get(entry.key)
                    if row is None or row.size != entry.size:
                        continue
                    stats = rebase_stats(entry.stats, shift)
                    policy.restore(entry.key, row.size, stats)
                    self.index.set_heat(c, entry.key, entry.last_access + shift, entry.hits, stats)
                    restored += 1
            committed = restored
        return committed

    # ------------------------------------------------------------ reads
    def lookup(self, key: str, verify: bool | None = None,
               block_list: Callable[[Path], Sequence[Block]] | None = None) -> Pin | None:
        """A pinned, verified resident entry, or None (a miss, or a quarantined corrupt entry).

        `verify=False`: the caller verifies each block before it serves a byte of it, so only the
        size is checked here; with `block_list` (how to cut a verified file into blocks) the
        entry must have its block list, which is made now, after one whole-file check, if it
        has none (an entry admitted without one)."""
        if self.unavailable is not None:
            return None
        row = None
        with self._index_trouble.tolerated():  # an index that cannot be opened: a miss
            row = self.index.get(key)
        if row is None:
            return None
        try:
            pin = Pin(self.path_of(key))
        except FileNotFoundError:
            with self._index_trouble.tolerated(), self.index.transaction() as c:
                self.index.remove(c, key)
            return None
        except ShardCorruptError:  # not a regular file (a FIFO, a device)
            self._quarantine(key, "is not a regular file")
            return None
        whole = self.verify_hits if verify is None else verify
        sound = os.fstat(pin.fd).st_size == row.size
        if sound and not whole and block_list is not None and self.blocks_of(key, row.size, row.checksum) is None:
            whole = True
        if sound and whole:
            try:
                sound = file_xxh3_128(pin.path) == row.checksum
            except ShardCorruptError:  # replaced by a special file since it was pinned
                sound = False
            if sound and block_list is not None and self.blocks_of(key, row.size, row.checksum) is None:
                self._record_blocks(key, row.size, row.checksum, block_list(pin.path))
        if not sound:
            pin.release()
            self._quarantine(key, "failed verification on read")
            return None
        with self._index_trouble.tolerated():  # a hit is still a hit when its statistics cannot be saved
            self._touch(row, self.clock())
        self.m_hits.inc()
        self.m_bytes_out.inc(row.size)
        return pin

    # ------------------------------------------------------------ block lists
    def _blocks_path(self, key: str) -> Path:
        return self.root / "blocks" / f"{key}.json"

    def blocks_of(self, key: str, size: int | None = None, checksum: str | None = None) -> list[Block] | None:
        """The entry's block list (recorded at admission), or None when it has none or it is unsound."""
        found = self._block_lists.get(key)
        if found is not None:
            return found
        try:
            d = json.loads(read_regular(self._blocks_path(key), MAX_BLOCK_LIST_BYTES))
            body = {k: v for k, v in d.items() if k != "digest"}
            if d["digest"] != xxh3_hex(json.dumps(body, sort_keys=True).encode()) or d["key"] != key:
                raise ValueError("digest")
            if (size is not None and d["size"] != size) or (checksum is not None and d["checksum"] != checksum):
                raise ValueError("another entry")
            b = d["blocks"]
            blocks = [Block(int(o), int(n), int(r), str(c))
                      for o, n, r, c in zip(b["offset"], b["length"], b["rows"], b["checksum"], strict=True)]
            end = 0
            for block in blocks:  # contiguous from 0, inside the file
                if block.offset != end or block.length <= 0 or block.rows < 0:
                    raise ValueError("layout")
                end += block.length
            if end > d["size"]:
                raise ValueError("layout")
        except (OSError, ValueError, KeyError, TypeError, RecursionError):
            return None
        self._block_lists[key] = blocks
        return blocks

    def _record_blocks(self, key: str, size: int, checksum: str, blocks: Sequence[Block]) -> None:
        """Keep the block list of a verified file (in memory, and beside the entry for other processes)."""
        blocks = list(blocks)
        self._block_lists[key] = blocks
        body = {"key": key, "size": size, "checksum": checksum,
                "blocks": {"offset": [b.offset for b in blocks], "length": [b.length for b in blocks],
                           "rows": [b.rows for b in blocks], "checksum": [b.checksum for b in blocks]}}
        body["digest"] = xxh3_hex(json.dumps(body, sort_keys=True).encode())
        path = self._blocks_path(key)
        tmp = self.root / "tmp" / f"{key}.{os.getpid()}.{secrets.token_hex(4)}.blocks"
        try:
            tmp.write_text(json.dumps(body))
            os.replace(tmp, path)
        except OSError as e:  # no room for it: this process keeps it; others verify whole
            tmp.unlink(missing_ok=True)
            log.warning("tier %s: could not record the block list of %s (%s)", self.name, key, e)

    def _drop_blocks(self, key: str) -> None:
        self._blocks_path(key).unlink(missing_ok=True)

    def quarantine(self, key: str, why: str, pin: Pin | None = None) -> bool:
        """Move a corrupt entry aside (it is fetched again on next use); with `pin`, only if the
        entry is still the file that pin holds (another process may have replaced it already)."""
        if pin is not None and pin.fd is not None:
            try:
                if os.stat(self.path_of(key)).st_ino != os.fstat(pin.fd).st_ino:
                    return False
            except FileNotFoundError as e:
                self._broken(e)  # the whole directory may be gone: then the tier is bypassed
                return False
        self._quarantine(key, why)
        return True

    def _quarantine(self, key: str, why: str) -> None:
        self.m_corruptions.inc()
        log.warning("tier %s: entry %s %s; quarantined, it will be fetched again", self.name, key, why)
        try:
            os.replace(self.path_of(key), self.root / "quarantine" / f"{key}.{secrets.token_hex(4)}")
        except FileNotFoundError:
            pass
        with self._index_trouble.tolerated(), self.index.transaction() as c:
            self.index.remove(c, key)

    def ensure(self, key: str, size: int, checksum: str, produce: Callable[[Path], None],
               dataset: str | None = None, prefetch: bool = False, verify_hit: bool | None = None,
               block_list: Callable[[Path], Sequence[Block]] | None = None) -> Pin | None:
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
            if not self._broken(e):
                raise
            self.m_unavailable.inc()
            return None

    def _ensure(self, key: str, size: int, checksum: str, produce: Callable[[Path], None], dataset: str | None,
                prefetch: bool, verify_hit: bool | None,
                block_list: Callable[[Path], Sequence[Block]] | None) -> Pin | None:
        if dataset is not None:
            self.add_reader(dataset)
        pin = self.lookup(key, verify_hit, block_list)
        if pin is not None:
            return pin
        if self._bypassed():
            return None
        with self._fetch_lock(key) as lock:
            if lock is None:
                return None  # its lock file cannot be made (a failing or full device): serve from below
            if not lock.acquired:
                self.m_takeovers.inc()
            pin = self.lookup(key, verify_hit, block_list)
            if pin is not None:
                return pin
            return self._fill(key, size, checksum, produce, dataset, prefetch, block_list)

    def ensure_made(self, key: str, make: Callable[[], bytes], dataset: str | None = None,
                    verify_hit: bool | None = None) -> tuple[Pin | None, bytes | None]:
        """`ensure` for an entry derived on this node (an image cache's resized pixels), whose size and
        checksum are known only once it is made: `make()` runs under the entry's fetch lock (one maker
        per node) and its bytes are what is reserved, written, verified and admitted like any fill.
        Returns (the pin, None) on a hit, else (the pin or None where the tier keeps nothing, the bytes);
        `verify_hit=False`: the caller checks the entry's contents as it reads them."""
        try:
            return self._ensure_made(key, make, dataset, verify_hit)
        except (OSError, sqlite3.Error) as e:
            if not self._broken(e):
                raise
            self.m_unavailable.inc()
            return None, make()

    def _ensure_made(self, key: str, make: Callable[[], bytes], dataset: str | None,
                     verify_hit: bool | None) -> tuple[Pin | None, bytes | None]:
        if dataset is not None:
            self.add_reader(dataset)
        pin = self.lookup(key, verify_hit)
        if pin is not None:
            return pin, None
        if self._bypassed():
            return None, make()
        with self._fetch_lock(key) as lock:
            if lock is not None:
                if not lock.acquired:
                    self.m_takeovers.inc()
                pin = self.lookup(key, verify_hit)
                if pin is not None:
                    return pin, None
            data = make()
            if lock is None:  # its lock file cannot be made (a failing or full device): not kept
                return None, data
            pin = self._fill(key, len(data), xxh3_128_hex(data), lambda tmp: tmp.write_bytes(data), dataset)
            return pin, data

    def _fill(self, key: str, size: int, checksum: str, produce: Callable[[Path], None], dataset: str | None,
              prefetch: bool = False, block_list: Callable[[Path], Sequence[Block]] | None = None) -> Pin | None:
        """A miss under the entry's fetch lock: reserve, produce to a temporary name, verify, rename, admit."""
        (self.m_prefetches if prefetch else self.m_misses).inc()
        started = time.perf_counter()
        enospc = 0
        corrupt = 0
        while True:
            try:
                reservation = self._reserve(key, size, extra=size * enospc, required=not prefetch,
                                            dataset=dataset)
            except sqlite3.Error as e:
                if not self._index_trouble(e):
                    raise
                return None
            if reservation is None:
                return None
            tmp = self.root / "tmp" / f"{key}.{os.getpid()}.{secrets.token_hex(4)}"
            pin = None
            try:
                produce(tmp)
                self._verify_fetched(tmp, key, size, checksum)
                if block_list is not None:  # before the entry appears: a resident entry has its list
                    self._record_blocks(key, size, checksum, block_list(tmp))
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
                    self._write_failed(e)
                    return None
                if e.errno not in NO_SPACE:
                    raise
                enospc += 1
                if enospc == 1:
                    continue  # evict one entry's worth more and try again
                self.m_enospc.inc()
                if not self._warned_enospc:
                    log.warning("tier %s (%s): no space left on the device; serving from the tier "
                                "below without caching", self.name, self.root)
                    self._warned_enospc = True
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

    @contextmanager
    def _fetch_lock(self, key: str) -> Iterator[FileLock | None]:
        """The entry's fetch lock, held; None when its file cannot be made (a full or failing device)."""
        lock: FileLock | None = FileLock(self.root / "locks" / f"{key}.lock", self.lock_timeout)
        try:
            lock.__enter__()
        except OSError as e:
            if e.errno in NO_SPACE:
                self.m_enospc.inc()
            elif e.errno in DEVICE_FAILED:
                self._write_failed(e)
            else:
                raise
            lock = None
        try:
            yield lock
        finally:
            if lock is not None:
                lock.__exit__()

    def resident_keys(self) -> set[str]:
        """The keys of the admitted entries; none where the tier is bypassed or its index unreadable."""
        if self.unavailable is None:
            with self._index_trouble.tolerated():
                return self.index.keys()
        return set()

    def is_resident(self, key: str) -> bool:
        """Whether the index lists `key` (False where the tier is bypassed or its index unreadable)."""
        if self.unavailable is None:
            with self._index_trouble.tolerated():
                return self.index.get(key) is not None
        return False

    # ------------------------------------------------------------ a tier that vanished or broke
    def _vanished(self) -> str | None:
        """What is gone of the tier's directory (an operator deleted it to free a disk, or replaced
        it), or None while it is the directory this tier opened, whole."""
        try:
            found = os.stat(self.root)
        except FileNotFoundError:
            return "its directory vanished"
        except OSError:
            return None  # a failing device: the write-error paths decide
        if (found.st_dev, found.st_ino) != self._identity:
            return "its directory was replaced by another"
        missing = [sub for sub in SUBDIRS if not os.path.lexists(self.root / sub)]
        return f"{', '.join(missing)} vanished from its directory" if missing else None

    def _bypassed(self) -> bool:
        """Whether this tier is no longer used (checked on a miss: one look at the directory)."""
        if self.unavailable is None:
            reason = self._vanished()
            if reason is not None:
                self._bypass(reason)
        if self.unavailable is not None:
            self.m_unavailable.inc()
            return True
        return False

    def _broken(self, error: BaseException) -> bool:
        """Whether `error`, raised using the tier's files or index, means the tier cannot be used by
        this process any more: its directory vanished or was replaced, or its index is damaged.
        Then the tier is bypassed from now on (warned once) and True is returned; any other error
        (the source's, a bug) is False, for the caller to raise."""
        if self.unavailable is not None:
            return True
        reason = None
        if index_damaged(error):
            reason = f"its index {self.root / INDEX_NAME} is damaged ({error})"
        elif isinstance(error, (OSError, sqlite3.Error)):
            reason = self._vanished()
        if reason is None:
            return False
        self._bypass(reason)
        return True

    def _bypass(self, reason: str) -> None:
        with self._bypass_lock:  # one warning, whichever thread finds it first
            if self.unavailable is not None:
                return
            self.unavailable = reason
        warnings.warn(TierUnavailableWarning(
            f"tier {self.name} ({self.root}): {reason}; this process bypasses the tier from now on, reading from "
            f"the tier below (or the source); a new process sets the directory up again"), stacklevel=3)

    def _write_failed(self, error: OSError) -> None:
        self.m_write_errors.inc()
        if not self._warned_write_error:
            log.warning("tier %s (%s): a write failed (%s); serving from the tier below without caching",
                        self.name, self.root, error)
            self._warned_write_error = True

    def _release(self, reservation: int) -> None:
        """Give back a reservation; on a full disk it stays until this process exits (then reclaimed)."""
        with self._index_trouble.tolerated():
            self.index.release(reservation)

    def _unadmit(self, key: str, reservation: int) -> None:
        """Remove an entry the index could not record (the disk filled): nothing unaccounted stays."""
        with self._policy_lock:
            if self._live is not None and key in self._live_keys:
                self._live.on_remove(key)
                self._live_keys.discard(key)
        if try_remove_unpinned(self.path_of(key)):
            self._drop_blocks(key)
        self._release(reservation)

    def _verify_fetched(self, tmp: Path, key: str, size: int, checksum: str) -> None:
        got_size = tmp.stat().st_size
        if got_size != size or file_xxh3_128(tmp) != checksum:
            self.m_corruptions.inc()
            raise FetchError(f"tier {self.name}: fetched bytes of {key} do not verify (size {got_size}, "
                             f"expected {size}) after {self.fetch_attempts} attempts; nothing was admitted")

    def _admit(self, key: str, size: int, checksum: str, dataset: str | None, reservation: int,
               used: bool) -> None:
        now = self.clock()
        with self._policy_lock:
            assert self._live is not None, "admitted without a reservation"  # _reserve made the policy
            self._live.on_insert(key, size, now)
            self._live_keys.add(key)
            stats = self._live.stats(key)
        row = EntryRow(key, size, checksum, dataset, now, now, int(used), stats)
        with self.index.transaction() as c:
            self.index.admit(c, row, reservation)
        self.m_occupancy.set(self.index.occupancy()[0])

    # ------------------------------------------------------------ space
    def add_reader(self, dataset: str) -> None:
        """Record that this process reads `dataset` through the tier: while it lives, the dataset has
        a fair share of the room (tiers._fairshare). Once per process and dataset."""
        if (os.getpid(), dataset) in self._readers:
            return
        with self._index_trouble.tolerated():
            self.index.add_reader(dataset)
            self._readers.add((os.getpid(), dataset))

    def _reserve(self, key: str, size: int, extra: int = 0, required: bool = True,
                 dataset: str | None = None) -> int | None:
        """Reserve `size` bytes, evicting as the policy says; None when the entry cannot be cached.

        A reader's entry is `required`: it is read now, so the policy says only whether it is worth
        keeping (`admit_read`; if not, the reader reads it from below this once); a prefetch asks
        whether it is worth its room (`admit`). With other datasets read through the tier too, the
        entry's `dataset` is held to its fair share (tiers._fairshare): below it, it claims room
        from datasets above theirs even where the policy declines; it never takes another's below."""
        if not self._configured:  # the index opens now: the directory's configuration goes first
            if self.index.set_config_if_absent(self._requested)["form"] != self.form.value:
                self.m_bypass.inc()
                return None  # another process configured it for another form meanwhile: not ours to fill
            self._configured = True
        capacity = self.capacity
        self.m_capacity.set(capacity)
        if size > capacity:
            self.m_bypass.inc()
            return None
        now = self.clock()
        with self.index.transaction() as c, self._policy_lock:
            used = self.index.used(c)
            rows = {r.key: r for r in self.index.entries(c)}
            policy = self._synced_policy(rows)
            fair = FairShare.of(rows, self.index.read_datasets(c), dataset, capacity)
            decide = policy.admit_read if required else policy.admit
            if not decide(key, size, now, capacity - used) and \
                    not (fair is not None and fair.under_share(size) and fair.claim(set()) is not None):
                self.m_bypass.inc()
                return None
            held: list[str] = []
            try:
                return self._make_room(c, policy, rows, key, size, extra, used, capacity, now, held, required,
                                       fair)
            finally:  # the policy pins of this decision go with it: none is held outside _reserve
                for victim in held:
                    policy.unpin(victim, now)

    def _make_room(self, c, policy: CachePolicy, rows: dict[str, EntryRow], key: str, size: int, extra: int,
                   used: int, capacity: int, now: float, held: list[str], required: bool = True,
                   fair: FairShare | None = None) -> int | None:
        """Evict unpinned victims until the entry fits; pinned ones are skipped via `held`. Under a
        fair share, a dataset below its share takes its victims from those above theirs first."""
        in_use: set[str] = set()
        while used + size + extra > capacity:
            victim = fair.claim(in_use) if fair is not None and fair.under_share(size) else None
            if victim is None:
                victim = policy.victim(now)
                if victim is None:  # every resident entry is in use (or another dataset's fair share)
                    (self.m_in_use if required else self.m_prefetch_no_room).inc()
                    return None
                if fair is not None and fair.protected(victim):
                    policy.pin(victim)  # another dataset's, within its share: not ours to take
                    held.append(victim)
                    continue
            if not try_remove_unpinned(self.path_of(victim)):
                # in use by some process: skip it for this decision (a victim is never one pinned
                # already: the policy names none, and a fair claim takes none a share protects)
                in_use.add(victim)
                policy.pin(victim)
                held.append(victim)
                continue
            if fair is not None:
                fair.removed(victim)
            row = rows[victim]
            self._drop_blocks(victim)
            self.index.remove(c, victim)
            policy.on_remove(victim)
            self._live_keys.discard(victim)
            used -= row.size
            extra = max(0, extra - row.size)
            self.m_evictions.inc()
            if row.hits == 0:
                self.m_evicted_unused.inc()
        return self.index.reserve(c, key, size)

    def evict(self, keys: list[str] | None = None) -> int:
        """Drop entries (all when None) that no process is using; returns how many went."""
        removed = 0
        with self.index.transaction() as c:
            for row in self.index.entries(c):
                if keys is not None and row.key not in keys:
                    continue
                if try_remove_unpinned(self.path_of(row.key)):
                    self._drop_blocks(row.key)
                    self.index.remove(c, row.key)
                    removed += 1
        return removed

    def clean(self) -> int:
        """Remove leftovers of dead jobs: temporaries, quarantined files, files the index does not know."""
        removed = 0
        known = {r.key for r in self.index.entries()}
        for p in (self.root / "tmp").iterdir():
            pid = p.name.split(".")[1] if p.name.count(".") >= 2 else ""
            if not pid.isdigit() or not process_alive(int(pid)):
                p.unlink(missing_ok=True)
                removed += 1
        for p in (self.root / "quarantine").iterdir():
            p.unlink(missing_ok=True)
            removed += 1
        for p in (self.root / "entries").iterdir():
            if p.name.removesuffix(".arrow") not in known and not is_pinned(p):
                p.unlink(missing_ok=True)
                removed += 1
        for p in (self.root / "blocks").iterdir():
            if p.name.removesuffix(".json") not in known and not self.path_of(p.name.removesuffix(".json")).exists():
                p.unlink(missing_ok=True)
                removed += 1
        return removed

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its configuration (capacity, policy and form are the directory's): the child
        opens its own index connection and locks."""
        return (Tier, (self.root, self.configured_capacity, self.policy_name, self.form, self.name,
                       self.lock_timeout, self.verify_hits, self.registry, self.policy_options, self.ram,
                       self.fetch_attempts, self.clock, True, False))

    def snapshot(self) -> dict:
        resident = reserved = entries = 0
        with self._index_trouble.tolerated():
            resident, reserved = self.index.occupancy()
            entries = len(self.index.entries())
        self.m_occupancy.set(resident)
        return {"name": self.name, "root": str(self.root), "form": self.form, "policy": self.policy_name,
                "capacity": self.capacity, "resident_bytes": resident, "reserved_bytes": reserved,
                "entries": entries}

