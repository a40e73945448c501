"""CheckpointStore: write a step locally, make it visible atomically, upload it in the background.

    ckpt = CheckpointStore("s3://bucket/run7/ckpt", local="/nvme/ckpt", keep_last=3)
    step_dir = ckpt.begin(step)                  # a temporary directory: DCP or any files go here
    dcp.save({"model": model.state_dict(), "loader": LoaderState(loader)}, checkpoint_id=step_dir)
    ckpt.commit(step)                            # fsync, manifest, rename; the upload starts
    ...
    path = ckpt.load(ckpt.latest())              # verified before it is handed out

The training process only hashes and renames; a separate uploader process copies the step to
`dest` within the node's bandwidth budget at low priority (training reads keep theirs), files
first, part manifest next, commit marker last, then applies retention. With several ranks each
commits its part; rank 0 writes the marker once every rank's upload has finished (an
all-reduce, i.e. a barrier, in `wait()` or the next `commit`), so a step is whole for all ranks
or for none. Temporaries are named `.tmp-...` and never listed.

With `stager=` (the node's `Stager`, or anything `tiers.burst.RidesBursts`), `commit` tells it,
before it hashes, that an upload of the step's bytes is coming and how long it is expected to
take (bytes / the upload rate measured so far, the budget's rate until one is measured): the
stager's lookahead covers that long at the loop's measured consumption rate (within its tier's
room), and returns when the upload's answer comes. `commit_async` hands the step to the
uploader once that much is staged (or the expected duration, at most PRESTAGE_WAIT_S, passed);
`commit` does not wait for it, since the loop it blocks is what consumes.

Crashes. Opening a store with a destination reconciles the two sides: the committed local
steps retention keeps that the destination lacks, or holds incomplete, are queued to the
uploader again, newest first (`requeued`), so `wait()` returns once a step committed just before
a node crash is at the destination. Temporaries of commits and downloads are locked (flock) by
their owner while it lives; those of dead or failed ones are removed at open and at each
`begin` (`swept`). `latest()` warns (`CheckpointWarning`) for every step it passes over, naming
the step and the file (`skipped`), and retention then never deletes a step older than one it
skipped. A remote candidate that `latest()` verifies deeply is downloaded once, verified while it
streams, and kept here, so `load()` hands it out without reading it again.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import xxhash

from tierflow.checkpoint.download import download_step
from tierflow.checkpoint.manifest import (
    COMMIT_NAME,
    CheckpointError,
    StepReport,
    encode_commit,
    encode_part,
    fsync_dir,
    fsync_file,
    naming,
    parse_step,
    part_files,
    part_name,
    step_name,
    verify_local,
    write_durably,
)
from tierflow.checkpoint.remote import open_dest, prune_local, prune_remote, remote_steps, retained, verify_remote
from tierflow.checkpoint.temporaries import Temporaries
from tierflow.checkpoint.upload_queue import UploadQueue, stop_uploader
from tierflow.errors import CheckpointWarning, SourceError
from tierflow.storage.budget import BandwidthBudget
from tierflow.tiers.burst import Ride, RidesBursts


PRESTAGE_WAIT_S = 30.0
"""The longest `commit_async` holds an upload back while the stager pre-stages for it."""


class CheckpointStore:
    """Checkpoints of one run: local directory `local` first, then `dest` (s3://, a path, fsspec)."""

    def __init__(
        self,
        dest: str | Path | None,
        local: str | Path,
        *,
        keep_last: int | None = 3,
        keep_every: int | None = None,
        endpoint_url: str | None = None,
        budget: BandwidthBudget | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        group: Any = None,
        stager: RidesBursts | None = None,
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None (keep all), got {keep_last}")
        if keep_every is not None and keep_every < 1:
            raise ValueError(f"keep_every must be >= 1 or None, got {keep_every}")
        self.dest = str(dest) if dest is not None else None
        self.local = Path(local)
        self.local.mkdir(parents=True, exist_ok=True)
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.endpoint_url = endpoint_url
        self.budget = budget
        self.group = group
        dist_rank, dist_world = _distributed(group)
        self.rank = dist_rank if rank is None else rank
        self.world_size = dist_world if world_size is None else world_size
        self.uploads = UploadQueue(self.dest)
        """The uploader process's jobs and answers (`uploads.last_answer`, `uploads.rate`)."""
        self.temporaries = Temporaries(self.local)
        self._open: dict[int, Path] = {}
        self._part_hash: dict[int, str] = {}
        self._awaiting_marker: list[int] = []
        self._source: Any = None
        self._committer: ThreadPoolExecutor | None = None
        self.stager = stager
        self._verified: dict[int, tuple[Any, ...] | None] = {}  # steps verified deeply here -> their files' stat
        self._remote_seen: set[int] = set()  # steps committed at the destination when latest() last looked
        self.skipped: dict[int, str] = {}
        """Steps `latest()` passed over -> the first problem found (it also warned)."""
        self.swept: list[str] = self.temporaries.sweep()
        """Temporaries of dead or failed commits and downloads removed when the store opened."""
        self.requeued: list[int] = self._reconcile()
        """Committed local steps queued again at open because the destination lacked them, newest first."""

    # ------------------------------------------------------------ writing
    def begin(self, step: int) -> Path:
        """A fresh temporary directory for this rank's part of `step`; write into it, then commit.
        It is locked while this process lives; temporaries nobody holds any more are swept."""
        self._refuse_overwrite(step)
        self.swept.extend(self.temporaries.sweep())
        tmp = self.temporaries.make(self.local / f".tmp-{step_name(step)}-rank{self.rank}-{os.getpid()}")
        self._open[step] = tmp
        return tmp

    def _refuse_overwrite(self, step: int) -> None:
        """A committed step older than one `latest()` skipped is what a resume falls back to:
        never written over."""
        floor = self._floor()
        if floor is None or step >= floor:
            return
        if step in self._remote_seen or (self.local / step_name(step) / COMMIT_NAME).exists():
            raise CheckpointError(
                f"{self.dest or self.local}/{step_name(step)}",
                f"committed, and older than {step_name(floor)}, which latest() skipped "
                f"({self.skipped[floor]}); it is never written over",
            )

    def _reconcile(self) -> list[int]:
        """Queue the committed local steps retention keeps that the destination lacks or holds
        incomplete, newest first; a destination that cannot be listed now is a warning."""
        if self.dest is None or self.world_size > 1:
            return []
        local = {s for s in self.local_steps() if verify_local(self.local / step_name(s), s, deep=False).ok}
        if not local:
            return []
        try:
            source = self._dest()
            remote = {s for s, done in remote_steps(source).items() if done}
            keep = retained(local | remote, self.keep_last, self.keep_every)
            missing = [
                s
                for s in sorted(local & keep, reverse=True)
                if s not in remote or not verify_remote(source, s, deep=False).ok
            ]
        except SourceError as exc:
            warnings.warn(
                f"{self.dest}: cannot compare the destination with {self.local} now ({exc}); committed "
                f"local steps {sorted(local)} are not queued for upload again",
                CheckpointWarning,
                stacklevel=3,
            )
            return []
        for step in missing:
            self._submit(step, self.local / step_name(step))
        return missing

    def commit(self, step: int, *, loader: Any = None, warm_batches: int = 256, stack: Any = None) -> Path:
        """Make `step` durable and visible locally, then queue its upload; returns the step directory.

        Blocks only for fsync, hashing (xxh3) and renames. With `loader`, the shards its next
        `warm_batches` batches need and the heat of the tiers of `stack` (default: the loader's
        stager's) are recorded for `restore_warm`. With several ranks, the previous step's
        marker is settled first (a collective: every rank must call commit)."""
        return self._commit(step, _warm_record(loader, warm_batches, stack))

    def _commit(self, step: int, warm: dict[str, Any] | None, prestage: bool = False) -> Path:
        if step not in self._open:
            raise CheckpointError(step_name(step), "commit without begin (or committed twice)")
        if self.world_size > 1 and self._awaiting_marker:
            self.wait()
        tmp = self._open.pop(step)
        ride = self._ride(step, tmp)
        try:
            try:
                final = self._durable(step, tmp, warm)
            finally:  # a failed commit leaves no temporary behind (it cannot be committed again)
                self.temporaries.remove(tmp)
            if ride is not None and prestage:
                ride.wait(timeout=min(ride.seconds, PRESTAGE_WAIT_S))
            if self.dest is not None:
                self._submit(step, final)
        except BaseException:
            self.uploads.end_ride(step)
            raise
        if self.dest is None and self.world_size == 1:
            prune_local(self.local, None, self.keep_last, self.keep_every, self._floor())
        if self.world_size > 1:
            self._awaiting_marker.append(step)
        return final

    def _ride(self, step: int, tmp: Path) -> Ride | None:
        """Tell the stager an upload of `tmp`'s bytes is coming (None: no stager, no upload, no rate)."""
        if self.stager is None or self.dest is None:
            return None
        rate = self.uploads.rate or (self.budget.rate if self.budget is not None else None)
        if not rate:
            return None  # nothing to expect its duration from until one upload is measured
        nbytes = sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file())
        ride = self.stager.ride_through(nbytes / rate)
        self.uploads.hold_ride(step, ride)
        return ride

    def _durable(self, step: int, tmp: Path, warm: dict[str, Any] | None) -> Path:
        """fsync, hash, manifest, rename: the step is whole and visible here."""
        if warm is not None:
            from tierflow.checkpoint.warm import warm_name

            with naming(tmp / warm_name(self.rank)):
                (tmp / warm_name(self.rank)).write_text(json.dumps(warm, sort_keys=True))
        with naming(tmp):
            entries = part_files(tmp)
        for entry in entries:
            fsync_file(tmp / entry.name)
        part = encode_part(step, self.rank, entries)
        write_durably(tmp / part_name(self.rank), part)
        self._part_hash[step] = xxhash.xxh3_128_hexdigest(part)
        if self.world_size == 1:
            write_durably(tmp / COMMIT_NAME, encode_commit(step, {0: self._part_hash[step]}))
        for directory, _, _ in os.walk(tmp):
            fsync_dir(Path(directory))
        final = self.local / step_name(step)
        with naming(final):
            self._install(tmp, final)
        self._verified.pop(step, None)
        return final

    def commit_async(
        self, step: int, after: Any = None, *, loader: Any = None, warm_batches: int = 256, stack: Any = None
    ) -> Future[Path]:
        """`commit` on a background thread, after `after` (e.g. `dcp.async_save`'s future) is done,
        so neither the write nor fsync and hashing hold up the loop. The warm record is taken
        now, at the cursor that was saved. Single-rank jobs only: the multi-rank marker needs
        collectives on the training thread."""
        if self.world_size > 1:
            raise ValueError("commit_async is for single-rank jobs; with several ranks call commit")
        if self._committer is None:
            self._committer = ThreadPoolExecutor(1, thread_name_prefix="tierflow-ckpt-commit")

        warm = _warm_record(loader, warm_batches, stack)

        def run() -> Path:
            if after is not None:
                after.result()
            return self._commit(step, warm, prestage=True)

        return self._committer.submit(run)

    def _install(self, tmp: Path, final: Path) -> None:
        """The atomic switch: rename the whole directory, or (the step exists: another rank's part,
        or a crashed earlier try) move file by file with this rank's part manifest last."""
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
        else:  # a failing fsync after it is raised: the step is in place, never taken apart again
            fsync_dir(self.local)
            return
        if self.world_size == 1:
            (final / COMMIT_NAME).unlink(missing_ok=True)  # the step stops being a checkpoint first
        last = {part_name(self.rank): 1, COMMIT_NAME: 2}
        names = sorted(
            (p.relative_to(tmp) for p in tmp.rglob("*") if p.is_file()),
            key=lambda n: (last.get(n.as_posix(), 0), n.as_posix()),
        )
        for name in names:
            (final / name).parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp / name, final / name)
        for directory, _, _ in os.walk(final):
            fsync_dir(Path(directory))
        shutil.rmtree(tmp, ignore_errors=True)
        fsync_dir(self.local)

    # ------------------------------------------------------------ the uploader process
    def _submit(self, step: int, final: Path) -> None:
        self.uploads.submit(
            {
                "step": step,
                "rank": self.rank,
                "dir": str(final),
                "dest": self.dest,
                "endpoint_url": self.endpoint_url,
                "budget": _budget_spec(self.budget),
                "marker": self.world_size == 1,
                "local": str(self.local),
                "keep_last": self.keep_last,
                "keep_every": self.keep_every,
                "floor": self._floor(),
            }
        )

    def uploading(self) -> list[int]:
        """Steps whose upload has not finished yet."""
        return self.uploads.uploading()

    def wait(self, timeout: float | None = None) -> None:
        """Block until every queued upload has finished (raise if one failed since the last wait,
        whether its answer came before this call or during it); with several ranks,
        then agree across ranks and let rank 0 write the commit markers (a collective)."""
        if self._committer is not None:
            self._committer.shutdown(wait=True)  # background commits first: they queue uploads
            self._committer = None
        failed = self.uploads.wait(timeout)  # every failure since the last wait
        if self.world_size > 1:
            self._settle_markers()
        if failed:
            raise CheckpointError(
                f"{self.dest}/{step_name(failed[0]['step'])}", f"upload failed: {failed[0].get('error')}"
            )

    def _settle_markers(self) -> None:
        import torch
        import torch.distributed as dist

        for step in list(self._awaiting_marker):
            result = self.uploads.result(step)
            mine_ok = self.dest is None or bool(result and result.get("ok"))
            flag = torch.tensor([int(mine_ok)], dtype=torch.int64)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)  # the barrier: every part is up
            hashes: list[Any] = [None] * self.world_size
            dist.all_gather_object(hashes, (self.rank, self._part_hash.get(step)), group=self.group)
            self._awaiting_marker.remove(step)
            if not int(flag.item()):
                continue  # some rank's part is not at the destination: the step stays uncommitted
            marker = encode_commit(step, {int(r): str(h) for r, h in hashes})
            final = self.local / step_name(step)
            if final.is_dir():
                write_durably(final / COMMIT_NAME, marker)
            if self.rank == 0 and self.dest is not None:
                source = self._dest()
                tmp = final / f".tmp-marker-{os.getpid()}"
                tmp.write_bytes(marker)
                try:
                    source.upload(tmp, f"{step_name(step)}/{COMMIT_NAME}", priority="high")
                finally:
                    tmp.unlink(missing_ok=True)
                prune_remote(source, self.keep_last, self.keep_every, self._floor())
            dist.barrier(group=self.group)  # the marker is up before any rank prunes its local copies
            prune_local(
                self.local,
                self._dest() if self.dest is not None else None,
                self.keep_last,
                self.keep_every,
                self._floor(),
            )

    def _dest(self) -> Any:
        if self._source is None:
            if self.dest is None:
                raise CheckpointError(str(self.local), "no destination configured")
            self._source = open_dest(self.dest, self.endpoint_url)
        return self._source

    # ------------------------------------------------------------ reading
    def local_steps(self) -> list[int]:
        """Steps with a directory here (committed or not; temporaries are never listed)."""
        return sorted(s for s in (parse_step(p.name) for p in self.local.iterdir() if p.is_dir()) if s is not None)

    def remote_steps(self) -> dict[int, bool]:
        """Steps at the destination -> committed (marker present)."""
        return remote_steps(self._dest()) if self.dest is not None else {}

    def verify(self, step: int, deep: bool = True) -> StepReport:
        """The local copy's report when it is whole, else the destination's."""
        local = verify_local(self.local / step_name(step), step, deep)
        if local.ok or self.dest is None:
            return local
        return verify_remote(self._dest(), step, deep)

    def latest(self, deep: bool = True) -> int | None:
        """The newest step whose marker exists and whose files match it, here or at the
        destination (`deep`: every checksum; a remote candidate is then downloaded once, verified
        as it streams, and kept here for `load()`). Every step passed over is a
        `CheckpointWarning` naming the step and the file, and is recorded in `skipped`; retention
        then keeps every step older than it."""
        candidates = set(self.local_steps())
        remote: set[int] = set()
        if self.dest is not None:
            remote = {s for s, done in self.remote_steps().items() if done}
            candidates |= remote
            self._remote_seen = remote
        for step in sorted(candidates, reverse=True):
            report = self._check(step, deep, step in remote)
            if report.ok:
                return step
            self.skipped[step] = report.problems[0]
            more = f" (and {len(report.problems) - 1} more problems)" if len(report.problems) > 1 else ""
            warnings.warn(
                f"checkpoint {step_name(step)} skipped: {report.problems[0]}{more}", CheckpointWarning, stacklevel=2
            )
        return None

    def _check(self, step: int, deep: bool, at_dest: bool) -> StepReport:
        """The local copy's report when it is whole; else (the destination has the step) the
        destination's, which a deep check takes by downloading the step here."""
        final = self.local / step_name(step)
        if deep and self._still_verified(step):
            return StepReport(step, [], [])
        local = verify_local(final, step, deep)
        if local.ok:
            if deep:
                self._verified[step] = _fingerprint(final)
            return local
        if self.dest is None or not at_dest:
            return local
        if not deep:
            return verify_remote(self._dest(), step, deep=False)
        try:
            self._download(step, final)
        except CheckpointError as exc:
            return StepReport(step, [], [str(exc)])
        return StepReport(step, [], [])

    def _still_verified(self, step: int) -> bool:
        seen = self._verified.get(step)
        return seen is not None and seen == _fingerprint(self.local / step_name(step))  # None never matches

    def _floor(self) -> int | None:
        """The newest step `latest()` skipped: retention keeps every step older than it."""
        return max(self.skipped) if self.skipped else None

    def load(self, step: int | None = None) -> Path:
        """A verified local directory of `step` (default: latest), downloaded when only the
        destination has it whole; one `latest()` verified (or downloaded) is handed out without
        reading it again while its files are unchanged. Raises CheckpointError naming the first
        bad file."""
        if step is None:
            step = self.latest(deep=False)
            if step is None:
                raise CheckpointError(self.dest or str(self.local), "no committed checkpoint")
        final = self.local / step_name(step)
        if self._still_verified(step):
            return final
        local = verify_local(final, step, deep=True)
        if local.ok:
            self._verified[step] = _fingerprint(final)
            return final
        if self.dest is None:
            raise CheckpointError(str(final), "; ".join(local.problems))
        return self._download(step, final)

    def _download(self, step: int, final: Path) -> Path:
        download_step(self._dest(), step, final, self.temporaries)
        self._verified[step] = _fingerprint(final)
        return final

    def restore_warm(
        self, step: int, loader: Any, stack: Any = None, batches: int | None = None, minutes: float | None = None
    ) -> int:
        """Pre-stage, before the first step on a fresh node, the shards the loader's next batches
        need (recorded at commit, else derived from the loader's cursor; `minutes`: as many batches
        as the loop ran in that time before the stop) and give the tiers back their saved
        statistics (policy state per entry); returns shards staged."""
        from tierflow.checkpoint.warm import restore_warm

        return restore_warm(self.load(step), loader, stack=stack, batches=batches, rank=self.rank, minutes=minutes)

    def prune(self) -> list[int]:
        """Apply retention now (at the destination, then here); returns the removed steps (the
        destination's, or the local ones when there is no destination)."""
        self.swept.extend(self.temporaries.sweep())
        if self.dest is None:
            return prune_local(self.local, None, self.keep_last, self.keep_every, self._floor())
        removed = prune_remote(self._dest(), self.keep_last, self.keep_every, self._floor())
        prune_local(self.local, self._dest(), self.keep_last, self.keep_every, self._floor())
        return removed

    def close(self, wait: bool = True) -> None:
        """Stop the uploader after the jobs in hand (`wait`), or at once."""
        proc = self.uploads.detach()
        if proc is None:
            return
        if wait:
            self.wait()
        stop_uploader(proc, kill=not wait)

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(wait=exc[0] is None)


def _fingerprint(step_dir: Path) -> tuple[Any, ...] | None:
    """What identifies the bytes of a verified step without reading them: each file's stat (None:
    no such directory)."""
    if not step_dir.is_dir():
        return None
    found = []
    for directory, _, files in os.walk(step_dir):
        for file in files:
            try:
                info = os.stat(os.path.join(directory, file))
            except OSError:
                return None
            found.append((os.path.join(directory, file), info.st_size, info.st_mtime_ns, info.st_ino, info.st_ctime_ns))
    return tuple(sorted(found))


def _distributed(group: Any) -> tuple[int, int]:
    try:
        import torch.distributed as dist
    except ImportError:
        return 0, 1
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def _warm_record(loader: Any, batches: int, stack: Any) -> dict[str, Any] | None:
    if loader is None:
        return None
    from tierflow.checkpoint.warm import warm_state

    return warm_state(loader, batches, stack)


def _budget_spec(budget: BandwidthBudget | None) -> dict[str, Any] | None:
    """What the uploader needs to open the same shared bucket (its file) in its own process."""
    if budget is None or budget.unlimited:
        return None
    return {"rate": budget.rate, "path": str(budget.path), "burst": budget.burst, "reserve": budget.reserve}
