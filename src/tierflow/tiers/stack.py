"""The tier stack: a shard is served from the fastest tier that holds it, promoted up on a miss.

Data moves source (L4, or a remote L3) -> L2 -> L1, each tier storing its own form (at rest
or decoded); decoding happens once, at the first tier that stores the decoded form. The stack
is a `ShardSupply`, so `Dataset(manifest, source=stack)` reads samples through it.

A shard no tier will keep (the policy prefers what it holds, or it is larger than the tier)
is still read once per node: it goes to the stack's staging area, a small LRU tier in host
RAM (tmpfs) sized to the order's working set, shared by the loader's workers and private to
the job, removed when the job exits. A job with several ranks a node shares one area among the
node's ranks (tiers/_staging.py), whose entry locks make one of them fetch a shard while the
others wait for that copy; the node's stager holds what it stages until the slowest rank has
passed it, and a faster rank that finds the area full waits while the slowest moves rather
than fetch a shard once more. Only when even that cannot take it is it read into the
process's memory, block by block from the source (see the end of this docstring).

Whole files are verified where whole files move (a fetch, a copy or a decode into a tier). A
reader opening a shard already resident verifies only what it reads, block by block (the
manifest's block checksums for the at-rest form, the tier's block list for the decoded form);
a block that fails is quarantined with its entry, fetched again from below and read from the
new copy, so wrong bytes are never served and a corrupted entry costs one refetch. A shard no
tier (and no staging area) takes is read as a stack-less reader reads it (`format/reader.py`): the
store's blocks, in ranged reads of runs of blocks, each block checked against its xxh3-64 when used.
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import shutil
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any
from collections.abc import Callable, Sequence

from tierflow.errors import ShardCorruptError
from tierflow.format._checksum import file_xxh3_128
from tierflow.format._regular import fd_path
from tierflow.format.blocks import BlockBytes
from tierflow.format.dataset import Dataset
from tierflow.format.manifest import MANIFEST_NAME, Manifest
from tierflow.format.metadata import shard_column
from tierflow.format.shard import Form, ShardInfo
from tierflow.format.shard_writer import decode_shard, scan_blocks
from tierflow.storage.datasets import StoreBlocks, read_manifest
from tierflow.format.table import BlockCache, LazyShardTable, ShardTable
from tierflow.telemetry import Counter, MetricsRegistry
from tierflow.telemetry.ledger import thread_ledger
from tierflow.policies.auto import Lifecycle
from tierflow.tiers._lock import Pin
from tierflow.tiers._staging import Membership, NodeProgress, area_path, staging_root, sweep_unused
from tierflow.errors import FetchError
from tierflow.tiers.capacity import memory_headroom
from tierflow.tiers.handle import MEMORY, SOURCE, Handle, Opened, downloaded, expected
from tierflow.tiers.staging_wait import StagingWait
from tierflow.tiers.tier import Tier

log = logging.getLogger("tierflow.tiers")


STAGING_NAME = "staging"
STAGING_WAIT_S = 5.0
"""How long a reader waits for room in the node's staging area (every entry in use by the node's
readers) with no rank of the node moving, before it reads the shard into its own memory."""
STAGING_RAM_SHARE = 0.25
"""The staging area holds the order's working set decoded while that is at most this share of the
memory headroom, else at rest (the order never narrows to fit it: order/working_set.py)."""


def _remove_staging(path: Path, owner: int) -> None:
    if os.getpid() == owner:  # a forked worker exiting must not remove its parent's area
        shutil.rmtree(path, ignore_errors=True)


class TierStack(StagingWait):
    """Tiers fastest first (e.g. [L1, L2]) over a source of at-rest shards."""

    def __init__(
        self,
        source: Any,
        tiers: Sequence[Tier] = (),
        registry: MetricsRegistry | None = None,
        max_open: int = 8,
        max_decoded_bytes: int = 1 << 30,
        manifest: Manifest | None = None,
    ) -> None:
        self.source = source
        self._manifest = manifest  # read already (build_stack's, to size tiers against it): not fetched again
        self.tiers = list(tiers)
        for upper, lower in zip(self.tiers, self.tiers[1:]):
            if upper.form is Form.AT_REST and lower.form is Form.DECODED:
                raise ValueError(
                    f"tier {upper.name} stores at-rest shards above {lower.name}, which stores "
                    f"decoded ones: decoded bytes never move down to a compressed form"
                )
        self.registry = registry or (self.tiers[0].registry if self.tiers else MetricsRegistry())
        self.max_open = max_open
        self.dataset_id: str | None = None
        self.cache = BlockCache(max_decoded_bytes)  # blocks of at-rest (compressed) copies, decoded
        self.schema = None
        self._open_declared = False  # a reader that declared what it reads at once: no guessing
        self.staging: Tier | None = None
        self.staging_bytes = 0
        self.staging_job: str | None = None  # set: the staging area is the node's, shared by this job's ranks
        self._membership: Membership | None = None
        self.progress: NodeProgress | None = None  # the node's ranks' steps, beside their staging area
        self.staging_readers = 1
        self._staged_per_byte = 1.0  # staged (decoded) bytes per byte of the top tier's form
        self._rest_per_byte = 1.0  # at-rest bytes per byte of the top tier's form
        self.staging_form = Form.DECODED
        """The staging area's form: decoded (decoded once per node), or at rest where the working set
        decoded would take more than STAGING_RAM_SHARE of the memory headroom (`declare`)."""
        self.staging_wait_s = STAGING_WAIT_S
        self._open: OrderedDict[int, ShardTable] = OrderedDict()
        self.generation = 0
        """Changes whenever a table joins or leaves the open ones: while it stays the same, a table the stack
        held open is still the one it holds (what lets a reader that knows it skip asking again)."""
        self._dropped: set[int] = set()
        self._store_blocks: StoreBlocks | None = None
        self._lock = threading.Lock()
        self.m_source_bytes = self.registry.counter(
            "tierflow_stack_source_bytes_total", {"tier": SOURCE}, "at-rest bytes fetched from the source"
        )
        self.m_served = {name: self._served_counter(name) for name in [t.name for t in self.tiers] + [MEMORY]}
        self.m_staging_waits = self.registry.counter(
            "tierflow_stack_staging_waits_total", description="reads that waited for room in the node's staging area"
        )
        self.m_staging_wait_s = self.registry.counter(
            "tierflow_stack_staging_wait_seconds_total",
            description="seconds reads waited for room in the node's staging area (held for a slower rank of the node)",
        )

    def _served_counter(self, where: str) -> Counter:
        return self.registry.counter(
            "tierflow_stack_served_total", {"tier": where}, "readable copies handed out, by where the copy lives"
        )

    # ------------------------------------------------------------ manifest
    def manifest(self) -> Manifest:
        manifest, self._manifest = self._manifest, None  # build_stack's, read to size the tiers against it
        if manifest is None:
            # size-checked before a byte of it is read (a hostile one could be any size), as open_dataset
            # does; a version-3 dataset's metadata mapped
            manifest = _read_manifest(self.source)
        self.dataset_id = manifest.dataset_id
        self.schema = manifest.schema
        for tier in self.tiers:  # from now on the dataset has its fair share of each tier
            tier.add_reader(manifest.dataset_id)
        form = self.tiers[0].form if self.tiers else Form.AT_REST
        decoded = int(shard_column(manifest, "decoded_bytes").sum())
        at_rest = int(shard_column(manifest, "bytes").sum())
        stored = decoded if form == Form.DECODED else at_rest
        self._staged_per_byte = decoded / stored if stored else 1.0
        self._rest_per_byte = at_rest / stored if stored else 1.0
        return manifest

    def dataset(self, columns: Sequence[str] | None = None) -> Dataset:
        return Dataset(self.manifest(), self, columns=columns, location=self.source.url)

    # ------------------------------------------------------------ reader's declarations
    def declare(
        self, lifecycle: Lifecycle, working_bytes: int, open_shards: int, readers: int = 1, job: str | None = None
    ) -> None:
        """What the reader knows before it reads: how (for `auto` policies), how many bytes of
        shards it needs at once (the staging area's size) and how many it reads at once (kept
        open, pinned). Call before forking workers.

        `readers` processes of one `job` (its ranks on this node; `job` names the job the same way
        on each of them) read the node's shards together: then the staging area is the node's,
        shared by them, so a shard no tier keeps is fetched once for all of them; it has room for
        each of them reading a different part of the working set, in the form it stores."""
        self.max_open = max(1, open_shards)
        self._open_declared = True
        for tier in self.tiers:
            tier.set_lifecycle(lifecycle)
        shared = readers > 1 and job is not None and bool(self.tiers)
        # the area stores the decoded form: `working_bytes` (the top tier's form) scaled to it; an at-rest
        # L2's working set sized the area in compressed bytes, a seventh of the shards read at once, so
        # each reopen fetched its shard again (39x the dataset per epoch at 5-30% of byte tokens, issue 37)
        wanted = int((readers if shared else 1) * working_bytes * self._staged_per_byte)
        form = Form.DECODED
        headroom = memory_headroom()
        if self.tiers and headroom is not None and wanted > STAGING_RAM_SHARE * headroom:
            # the cache adapts to the order, not the order to the cache: the working set at rest (the
            # readers decode the blocks they read), and a warning with the numbers where even that is more
            at_rest = int((readers if shared else 1) * working_bytes * self._rest_per_byte)
            log.warning(
                "the staging area would hold the order's working set decoded, %.1f MB, more than %.0f%% "
                "of the memory headroom (%.1f MB); it holds it at rest instead (%.1f MB)%s",
                wanted / 1e6,
                STAGING_RAM_SHARE * 100,
                headroom / 1e6,
                at_rest / 1e6,
                ""
                if at_rest <= STAGING_RAM_SHARE * headroom
                else "; that is still more: shards it cannot hold are read into each process's memory and "
                "fetched again; lanes= and window_shards= narrow the order (a new order)",
            )
            wanted, form = at_rest, Form.AT_REST
        if self.tiers and (
            wanted > self.staging_bytes or form is not self.staging_form or (shared and self.staging_job != job)
        ):
            self.staging_form = form
            self.staging_bytes = max(wanted, self.staging_bytes)
            self.staging_job = job if shared else None
            self.staging_readers = readers if shared else 1
            if self.staging is not None:
                self.staging = None  # a larger one; the old directory goes with the process
            self._staging()

    def _staging(self) -> Tier | None:
        if self.staging is None and self.staging_bytes and self.tiers:
            root = staging_root()
            try:
                root.mkdir(parents=True, exist_ok=True)
                sweep_unused(root)
                if self.staging_job is not None:  # the node's, for the job's ranks: named alike by each
                    path = area_path(self.tiers[0].root, f"{self.staging_job}/{self.dataset_id}/{self.staging_bytes}")
                    self._membership = Membership(path)
                    self.progress = NodeProgress(path, self.staging_readers)
                else:
                    path = root / f"staging-{os.getpid()}-{secrets.token_hex(4)}"
                self.staging = Tier(
                    path,
                    self.staging_bytes,
                    policy="lru",
                    form=self.staging_form,
                    name=STAGING_NAME,
                    registry=self.registry,
                )
            except OSError as e:
                log.warning("no staging area in %s (%s): shards no tier keeps are read into memory", root, e)
                self.staging_bytes = 0
                return None
            if self.staging_job is None:
                atexit.register(_remove_staging, path, os.getpid())
            self.m_served[STAGING_NAME] = self._served_counter(STAGING_NAME)
        return self.staging

    # ------------------------------------------------------------ ensure
    def ensure(self, info: ShardInfo, level: int = 0, prefetch: bool = False, read: bool = False) -> Handle | None:
        """A readable copy of the shard from tier `level` or below, filling misses on the way up;
        the handle says which tier served it and how long that took.

        `prefetch` (the stager) marks the top tier's new entry as not yet used, and gets None when
        no tier takes the shard (a copy in memory would be dropped unread). `read`: the copy is
        for a reader that verifies each block before using it, so a hit is not hashed whole."""
        started = time.perf_counter()
        handle = self._ensure(info, level, prefetch, read)
        if handle is not None:
            handle.fetch_s = time.perf_counter() - started
        return handle

    def _ensure(self, info: ShardInfo, level: int, prefetch: bool, read: bool) -> Handle | None:
        if level == len(self.tiers):
            staged = self._stage(info, prefetch)
            return staged if staged is not None or prefetch else self._from_source(info)
        tier = self.tiers[level]
        size, checksum = expected(info, tier.form)
        found: list[str] = []  # where a fill found the bytes; none: this tier held them (a hit)

        def produce(tmp: Path) -> None:
            found.append(self._produce(info, level, tmp))

        block_list = scan_blocks if tier.form is Form.DECODED else None
        pin = tier.ensure(
            info.key,
            size,
            checksum,
            produce,
            dataset=self.dataset_id,
            prefetch=prefetch,
            verify_hit=False if read else None,
            block_list=block_list,
        )
        if pin is not None:
            self.m_served[tier.name].inc()
            # a decoded entry's block list: recorded at admission, or by the hit that found none
            blocks = tier.blocks_of(info.key, size, checksum) if tier.form is Form.DECODED else None
            return Handle(
                tier.form, tier.name, pin.path, pin, blocks=blocks, served_by=found[-1] if found else tier.name
            )
        return self._ensure(info, level + 1, prefetch, read)

    def warm(self, on_shard: Callable[[], None] | None = None) -> tuple[int, int]:
        """Stage every shard of the dataset as a prefetch would (a shard no tier takes is not
        downloaded); returns (warmed, declined). `on_shard` is called after each, for progress."""
        warmed = declined = 0
        for info in self.manifest().shards:
            handle = self.ensure(info, prefetch=True)
            if handle is None:
                declined += 1
            else:
                handle.release()
                warmed += 1
            if on_shard is not None:
                on_shard()
        return warmed, declined

    def _stage(self, info: ShardInfo, prefetch: bool) -> Handle | None:
        """The shard in the staging area (fetched once per node from the source), or None."""
        staging = self._staging()
        if staging is None:
            return None
        size, checksum = expected(info, staging.form)
        fetched: list[bool] = []

        def produce(tmp: Path) -> None:
            fetched.append(True)
            self._fill(info, staging.form, None, tmp)

        decoded = staging.form is Form.DECODED

        def attempt() -> Pin | None:
            return staging.ensure(
                info.key,
                size,
                checksum,
                produce,
                dataset=self.dataset_id,
                prefetch=prefetch,
                verify_hit=False,
                block_list=scan_blocks if decoded else None,
            )

        pin = attempt()
        if pin is None and not prefetch and self.progress is not None and size <= staging.capacity:
            pin = self._wait_for_room(info, attempt)
        if pin is None:
            return None
        self.m_served[STAGING_NAME].inc()
        return Handle(
            staging.form,
            STAGING_NAME,
            pin.path,
            pin,
            blocks=staging.blocks_of(info.key, size, checksum) if decoded else None,
            served_by=SOURCE if fetched else STAGING_NAME,
        )

    def _produce(self, info: ShardInfo, level: int, tmp: Path) -> str:
        """Write the shard in tier `level`'s form to `tmp`, from the nearest lower copy; returns
        where that copy's bytes were found."""
        lower = self._ensure(info, level + 1, False, False) if level + 1 < len(self.tiers) else None
        served_by = lower.served_by if lower is not None else SOURCE
        self._fill(info, self.tiers[level].form, lower, tmp)
        return served_by

    def _fill(self, info: ShardInfo, form: Form, lower: Handle | None, tmp: Path) -> None:
        """Write `form` of the shard to `tmp` from `lower`'s file (released after), or from the source
        (no lower copy, or only the source's blocks: `_from_source`)."""
        try:
            if lower is not None and lower.path is not None:
                # the pinned file itself: the lower tier's directory may vanish meanwhile (an
                # operator freeing its disk), the pinned file stays readable until released
                pinned = lower.pin.fd if lower.pin is not None else None
                path = lower.path
                if pinned is not None and not path.exists():  # errors name the entry while it is there
                    path = Path(fd_path(pinned, lower.path))
                if lower.form == form:
                    shutil.copyfile(path, tmp)
                else:
                    decode_shard(path, tmp, info)
                return
            if form is Form.AT_REST:
                self._download(info, tmp)
            else:
                rest = tmp.with_name(tmp.name + ".rest")
                try:
                    self._download(info, rest)
                    if file_xxh3_128(rest) != info.checksum:  # verify before decoding torn bytes
                        raise FetchError(f"shard {info.name} from {self.source.url}: at-rest bytes do not verify")
                    decode_shard(rest, tmp, info)
                finally:
                    rest.unlink(missing_ok=True)
        finally:
            if lower is not None:
                lower.release()

    def _download(self, info: ShardInfo, dst: Path) -> None:
        """The at-rest bytes from the source; the tier verifies them (size + xxh3) on admission."""
        self.source.download(info.name, dst, expected_size=info.bytes)
        self.m_source_bytes.inc(info.bytes)
        arrived = downloaded.get()
        if arrived is not None:
            arrived()

    def _from_source(self, info: ShardInfo) -> Handle:
        """No tier could hold it: the source's blocks, as a reader without tiers reads them (ranged reads
        of runs of blocks, each block checked against its xxh3-64 when used). Nothing is fetched until a reader
        reads (`_blocks`), so a tier filled from below downloads instead."""
        if self._store_blocks is None:  # one for the stack: its blocks fetched ahead share one bound
            self._store_blocks = StoreBlocks(self.source, self._fetched)
        return Handle(Form.AT_REST, MEMORY, store_blocks=self._store_blocks, served_by=SOURCE)

    def _fetched(self, nbytes: int, seconds: float) -> None:
        """A block read from the source for a reader: its bytes counted, its seconds charged to the
        source as the building batch's fetch time, as a whole fetch's are."""
        self.m_source_bytes.inc(nbytes)
        thread_ledger().add(SOURCE, seconds, 0)

    def _blocks(self, handle: Handle, info: ShardInfo) -> BlockBytes:
        """Where a reader reads `handle`'s blocks; a copy read from the source is served from memory."""
        blocks = handle.block_bytes(info)
        if handle.tier == MEMORY:
            self.m_served[MEMORY].inc()
        return blocks

    # ------------------------------------------------------------ ShardSupply
    def open_shard(self, index: int, info: ShardInfo) -> ShardTable:
        table = self.held_open(index)
        return table if table is not None else self._open_new(index, info).table

    def open_served(self, index: int, info: ShardInfo) -> Opened:
        """`open_shard`, saying which tier served the shard and the seconds the open took (what
        telemetry charges a batch's fetch time to)."""
        started = time.perf_counter()
        table = self.held_open(index)
        if table is not None:
            return Opened(table, None, time.perf_counter() - started)
        opened = self._open_new(index, info)
        return opened._replace(fetch_s=time.perf_counter() - started)

    def held_open(self, index: int) -> ShardTable | None:
        """The shard's table if this stack holds it open (refreshing its place among the open ones, as an
        open does), else None: what a reader that attributes its opens asks before one it must time."""
        with self._lock:
            table = self._open.get(index)
            if table is not None:
                self._open.move_to_end(index)
            return table

    def _open_new(self, index: int, info: ShardInfo) -> Opened:
        handle = self.ensure(info, read=True)
        assert handle is not None  # a reader's ensure falls back to memory, never None
        try:
            blocks = self._blocks(handle, info)
        except FileNotFoundError:  # its tier's directory vanished since the pin: that tier is bypassed now
            handle.release()
            handle = self.ensure(info, read=True)
            assert handle is not None
            blocks = self._blocks(handle, info)

        def recover(block: int, error: ShardCorruptError, current: BlockBytes) -> BlockBytes:
            return self._recover(info, block, error, current)

        table = LazyShardTable(info.name, blocks, self.schema, self.cache, recover=recover)
        with self._lock:
            limit = self._open_limit(info)
            if index in self._dropped and self.max_open < limit and not self._open_declared:
                self.max_open += 1  # the reader's working set (its shuffle window) is larger: grow
            self._dropped.discard(index)
            self._open[index] = table
            while len(self._open) > min(self.max_open, limit):
                dropped, _ = self._open.popitem(last=False)
                self._dropped.add(dropped)
            self.generation += 1
        return Opened(table, handle.served_by, handle.fetch_s)

    def _recover(self, info: ShardInfo, block: int, error: ShardCorruptError, current: BlockBytes) -> BlockBytes:
        """A block of a resident entry failed its checksum, or could not be read (EIO): quarantine
        the entry (counted by its tier), fetch the shard again and give the reader the new copy.
        A checksum failure is fetched again into the tier; an unreadable entry from the tiers
        below it (its device fails reads: a copy written there would fail the same way)."""
        handle = current.keepalive
        if not isinstance(handle, Handle):
            raise error
        tier = next((t for t in [*self.tiers, self.staging] if t is not None and t.name == handle.tier), None)
        if tier is None:
            raise error
        unreadable = isinstance(error.__cause__, OSError) and not isinstance(error.__cause__, ShardCorruptError)
        again: Callable[[], Handle | None]
        try:
            tier.quarantine(
                info.key,
                f"{'could not be read' if unreadable else 'failed verification'} at block {block}",
                pin=handle.pin,
            )
            if tier.unavailable is None:  # else the tier warned that it is bypassed: its files are gone
                log.warning("%s; quarantining its entry in tier %s and fetching it again", error, tier.name)
        except OSError as e:  # the tier's device fails: it would serve the same entry again
            log.warning("tier %s could not quarantine %s (%s); reading it from the source", tier.name, info.name, e)
            again = lambda: self._from_source(info)
        else:
            below = self.tiers.index(tier) + 1 if tier in self.tiers else len(self.tiers) + 1
            if not unreadable:
                again = lambda: self.ensure(info, read=True)
            elif below <= len(self.tiers):
                again = lambda: self.ensure(info, level=below, read=True)
            else:  # the staging area's device: nothing between it and the source
                again = lambda: self._from_source(info)
        try:
            copy = again()
            assert copy is not None, "a reader's copy always comes (from the source at worst)"
            return self._blocks(copy, info)
        except (OSError, ValueError) as e:
            raise ShardCorruptError(f"{error}; fetching it again failed: {e}") from e

    def _open_limit(self, info: ShardInfo) -> int:
        """Open shards hold pins: keep them to half the top tier so eviction always has room, but never
        fewer than the reader declared it reads at once (the order's, whatever the tier: a shard
        dropped while its window is read is opened, and maybe fetched, again at its next batch; a
        tier whose entries are all pinned serves from below, through the staging area)."""
        if not self.tiers:
            return 1 << 10
        declared = self.max_open if self._open_declared else 0
        return max(4, declared, self.tiers[0].capacity // (2 * max(info.decoded_bytes, info.bytes, 1)))

    def close(self) -> None:
        with self._lock:
            self._open.clear()
            self.generation += 1

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its configuration, for spawn/forkserver workers: the child opens its own
        clients, index connections and locks, and shares the parent's staging area."""
        staging = self.staging.root if self.staging is not None else None
        state = {
            "dataset_id": self.dataset_id,
            "schema": self.schema,
            "declared": self._open_declared,
            "staging_bytes": self.staging_bytes,
            "staging": staging,
            "staging_job": self.staging_job,
            "staging_readers": self.staging_readers,
            "staged_per_byte": self._staged_per_byte,
            "staging_form": self.staging_form.value,
        }
        return (_reopened, (self.source, self.tiers, self.registry, self.max_open, self.cache.max_bytes, state))

    def snapshot(self) -> dict:
        return {"tiers": [t.snapshot() for t in self.tiers], "metrics": self.registry.snapshot()}


def _reopened(
    source: Any,
    tiers: Sequence[Tier],
    registry: MetricsRegistry,
    max_open: int,
    max_decoded_bytes: int,
    state: dict[str, Any],
) -> TierStack:
    """A pickled stack in the process that unpickles it (`TierStack.__reduce__`)."""
    stack = TierStack(source, tiers, registry, max_open, max_decoded_bytes)
    stack.dataset_id, stack.schema = state["dataset_id"], state["schema"]
    stack._open_declared, stack.staging_bytes = state["declared"], state["staging_bytes"]
    stack._staged_per_byte, stack.staging_job = state["staged_per_byte"], state["staging_job"]
    if state["staging"] is not None:  # the parent's area (its owner removes it), not a new one
        if stack.staging_job is not None:  # the node's: this process uses it too, until it exits
            stack._membership = Membership(Path(state["staging"]))
            stack.staging_readers = state["staging_readers"]
            stack.progress = NodeProgress(Path(state["staging"]), stack.staging_readers)
        stack.staging_form = Form(state.get("staging_form", Form.DECODED))
        stack.staging = Tier(
            state["staging"],
            stack.staging_bytes,
            policy="lru",
            form=stack.staging_form,
            name=STAGING_NAME,
            registry=stack.registry,
        )
        stack.m_served[STAGING_NAME] = stack._served_counter(STAGING_NAME)
    return stack


def _read_manifest(source: Any) -> Manifest:
    """The manifest of the stack's source: `storage.datasets.read_manifest` for a source it knows (a
    version-3 dataset's mapped metadata, or manifest.json), else manifest.json's bytes."""
    if hasattr(source, "read_into") and hasattr(source, "size"):
        return read_manifest(source)
    return Manifest.from_bytes(source.read_bytes(MANIFEST_NAME), f"{source.url}/{MANIFEST_NAME}")
