"""Fail the N-th I/O operation below tierflow's own code (SQLite's fault-injection tests, in Python).

    with FailNth(5, roots=[tmp_path], error=errno.EIO) as faults:
        tierflow.pack(...)                     # the 5th write/fsync/rename/... under tmp_path fails
    faults.fired                               # the IOFault raised, or None: the run needed < 5 ops

`FailNth(None, ...)` only counts. `fail_each(run, check, ...)` runs `run` for N = 1, 2, ... until
a run completes without reaching its N-th operation, and calls `check(trial)` after each with
the outcome, so every failure point of an operation is tried once (`persistent=True`: every
operation from the N-th on fails, as on a disk that died or filled); `boundaries` and
`sample_points` (TIERFLOW_FAULT_POINTS=kinds|boundaries|every) pick a sample of those N.
`sample_digests` gives a dataset's golden sample hashes, `tier_problems` what a tier directory
shows that is not whole.

What is patched, process-wide while the context is open (other threads count too): `os.write`,
`os.pwrite`, `os.sendfile` (write), `os.fsync`, `os.fdatasync` (fsync), `os.rename`,
`os.replace` (rename), `os.mkdir` (mkdir; `os.makedirs` and `Path.mkdir` call it), `os.open`
with a writing flag and `open`/`io.open` in a writing mode (open_write), `os.read`, `os.pread`,
`os.readv`, `os.preadv` (read), `os.unlink`/`os.remove` (unlink, off by default) and the
`read*`/`write*` methods of every file `open` returns. Only operations on paths under `roots` count (a
descriptor's path is read from /proc/self/fd), so pytest's and the interpreter's own I/O is
untouched. Not reached: I/O done in C below Python (pyarrow's own file writers and memory
maps, SQLite, mmap reads); those are tried by the kill loop and the full-disk tests instead.
"""

from __future__ import annotations

import builtins
import errno as errnos
import io
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterable, Iterator, Sequence

OPS = ("read", "write", "fsync", "rename", "open_write", "mkdir", "unlink")
"""Every operation family FailNth can fail."""
DEFAULT_OPS = ("read", "write", "fsync", "rename", "open_write", "mkdir")
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


@dataclass(frozen=True)
class IOFault:
    """The operation that was failed: its number (1-based), family, path and the errno raised."""

    n: int
    op: str
    path: str
    errno: int

    def __str__(self) -> str:
        return f"#{self.n} {self.op} {self.path} -> {errnos.errorcode.get(self.errno, self.errno)}"


class FailNth:
    """Count I/O operations under `roots`; raise OSError(`error`) at the `fail_at`-th (1-based).

    `ops`: the families counted (and failed); `persistent`: every counted operation from the
    `fail_at`-th on fails, not only that one. `calls` is the count so far, `log` each (op, path)
    when `record` is set, `fired` the first fault raised, `failures` how many were raised."""

    _active_lock = threading.Lock()
    _active: FailNth | None = None

    def __init__(
        self,
        fail_at: int | None,
        roots: Iterable[str | os.PathLike],
        *,
        ops: Sequence[str] = DEFAULT_OPS,
        error: int = errnos.EIO,
        persistent: bool = False,
        record: bool = False,
    ) -> None:
        unknown = set(ops) - set(OPS)
        if unknown:
            raise ValueError(f"unknown I/O operation families {sorted(unknown)}; expected some of {OPS}")
        self.fail_at = fail_at
        self.roots = tuple(os.path.realpath(os.fspath(r)).rstrip("/") + "/" for r in roots)
        self.ops = frozenset(ops)
        self.error = error
        self.persistent = persistent
        self.record = record
        self.calls = 0
        self.failures = 0
        self.fired: IOFault | None = None
        self.log: list[tuple[str, str]] = []
        self.by_op: dict[str, int] = {}
        self._lock = threading.Lock()
        self._saved: list[tuple[Any, str, Any]] = []

    @classmethod
    def current(cls) -> FailNth | None:
        """The injector whose context is open, if any (a run can note how far it got: `calls`)."""
        return cls._active

    # ------------------------------------------------------------ the decision
    def _inside(self, path: str) -> bool:
        return path.startswith(self.roots) or path + "/" in self.roots

    def _path_of(self, target: Any) -> str | None:
        if isinstance(target, int):
            try:
                path = _real_readlink(f"/proc/self/fd/{target}")
            except OSError:
                return None
            return path.removesuffix(" (deleted)")
        try:
            raw = os.fspath(target)
        except TypeError:
            return None
        if isinstance(raw, bytes):
            raw = os.fsdecode(raw)
        return os.path.realpath(raw)

    def hit(self, op: str, target: Any) -> None:
        """Count one operation on `target` (a path or a descriptor); raise when it is the one to fail."""
        if op not in self.ops:
            return
        path = self._path_of(target)
        if path is None or not self._inside(path):
            return
        with self._lock:
            self.calls += 1
            n = self.calls
            self.by_op[op] = self.by_op.get(op, 0) + 1
            if self.record:
                self.log.append((op, path))
            fail = self.fail_at is not None and (n == self.fail_at or (self.persistent and n > self.fail_at))
            if fail:
                self.failures += 1
                if self.fired is None:
                    self.fired = IOFault(n, op, path, self.error)
        if fail:
            raise OSError(self.error, f"{os.strerror(self.error)} (injected: {op} #{n})", path)

    # ------------------------------------------------------------ patching
    def __enter__(self) -> FailNth:
        with FailNth._active_lock:
            if FailNth._active is not None:
                raise RuntimeError("FailNth does not nest")
            FailNth._active = self
        hit = self.hit
        real = {
            name: getattr(os, name)
            for name in (
                "write",
                "pwrite",
                "sendfile",
                "fsync",
                "fdatasync",
                "rename",
                "replace",
                "mkdir",
                "open",
                "read",
                "pread",
                "preadv",
                "readv",
                "unlink",
                "remove",
            )
        }
        real_open = io.open

        def fd_op(op: str, name: str, which: int = 0) -> Callable[..., Any]:
            fn = real[name]

            def patched(*args: Any, **kwargs: Any) -> Any:
                hit(op, args[which])
                return fn(*args, **kwargs)

            return patched

        def path_op(op: str, name: str) -> Callable[..., Any]:
            fn = real[name]

            def patched(path: Any, *args: Any, **kwargs: Any) -> Any:
                hit(op, path if kwargs.get("dir_fd") is None else None)
                return fn(path, *args, **kwargs)

            return patched

        def rename(name: str) -> Callable[..., Any]:
            fn = real[name]

            def patched(src: Any, dst: Any, *args: Any, **kwargs: Any) -> Any:
                hit("rename", dst)
                return fn(src, dst, *args, **kwargs)

            return patched

        def os_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
            if flags & WRITE_FLAGS:
                hit("open_write", path)
            return real["open"](path, flags, *args, **kwargs)

        def opener(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            writing = any(c in mode for c in "wax+")
            if writing:
                hit("open_write", file)
            f = real_open(file, mode, *args, **kwargs)
            path = self._path_of(file if not isinstance(file, int) else f.fileno())
            if path is None or not self._inside(path):
                return f
            return _CountedFile(f, hit)

        self._patch(os, "write", fd_op("write", "write"))
        self._patch(os, "pwrite", fd_op("write", "pwrite"))
        self._patch(os, "sendfile", fd_op("write", "sendfile"))
        self._patch(os, "fsync", fd_op("fsync", "fsync"))
        self._patch(os, "fdatasync", fd_op("fsync", "fdatasync"))
        self._patch(os, "read", fd_op("read", "read"))
        self._patch(os, "pread", fd_op("read", "pread"))
        self._patch(os, "preadv", fd_op("read", "preadv"))
        self._patch(os, "readv", fd_op("read", "readv"))
        self._patch(os, "rename", rename("rename"))
        self._patch(os, "replace", rename("replace"))
        self._patch(os, "mkdir", path_op("mkdir", "mkdir"))
        self._patch(os, "unlink", path_op("unlink", "unlink"))
        self._patch(os, "remove", path_op("unlink", "remove"))
        self._patch(os, "open", os_open)
        self._patch(io, "open", opener)
        self._patch(builtins, "open", opener)
        return self

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def __exit__(self, *exc: object) -> None:
        for owner, name, value in reversed(self._saved):
            setattr(owner, name, value)
        self._saved.clear()
        with FailNth._active_lock:
            FailNth._active = None


_real_readlink = os.readlink


class _CountedFile:
    """A file `open` returned, whose reads and writes count as operations on its path."""

    def __init__(self, f: Any, hit: Callable[[str, Any], None]) -> None:
        self._f = f
        self._hit = hit
        self._name = f.name if isinstance(getattr(f, "name", None), (str, bytes)) else f.fileno()

    def _op(self, op: str) -> None:
        self._hit(op, self._name)

    def write(self, data: Any) -> Any:
        self._op("write")
        return self._f.write(data)

    def writelines(self, lines: Any) -> None:
        self._op("write")
        self._f.writelines(lines)

    def read(self, *args: Any) -> Any:
        self._op("read")
        return self._f.read(*args)

    def read1(self, *args: Any) -> Any:
        self._op("read")
        return self._f.read1(*args)

    def readinto(self, buffer: Any) -> Any:
        self._op("read")
        return self._f.readinto(buffer)

    def readline(self, *args: Any) -> Any:
        self._op("read")
        return self._f.readline(*args)

    def readlines(self, *args: Any) -> Any:
        self._op("read")
        return self._f.readlines(*args)

    def __iter__(self) -> Iterator[Any]:
        while True:
            line = self.readline()
            if not line:
                return
            yield line

    def __next__(self) -> Any:
        line = self.readline()
        if not line:
            raise StopIteration
        return line

    def __enter__(self) -> _CountedFile:
        self._f.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._f.__exit__(*exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


# ---------------------------------------------------------------- the loop over N


@dataclass
class Trial:
    """One run of the loop: N, the fault raised (None: the run needed fewer operations), the
    exception the run ended with (None: it returned), its seconds and operations counted."""

    n: int
    fault: IOFault | None
    error: BaseException | None
    seconds: float
    calls: int
    result: Any = None

    @property
    def outcome(self) -> str:
        if self.error is None:
            return "ok"
        return type(self.error).__name__


@dataclass
class FaultRun:
    """What `fail_each` tried: every trial, in order; the last one is the run that completed."""

    trials: list[Trial] = field(default_factory=list)

    @property
    def operations(self) -> int:
        """Counted operations of the run that completed (the loop tried N = 1 .. this)."""
        return self.trials[-1].calls if self.trials else 0

    def outcomes(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for t in self.trials[:-1]:
            counts[t.outcome] = counts.get(t.outcome, 0) + 1
        return counts

    def by_op(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for t in self.trials:
            if t.fault is not None:
                counts[t.fault.op] = counts.get(t.fault.op, 0) + 1
        return counts


def fail_each(
    run: Callable[[], Any],
    check: Callable[[Trial], None],
    roots: Iterable[str | os.PathLike],
    *,
    ops: Sequence[str] = DEFAULT_OPS,
    error: int = errnos.EIO,
    persistent: bool = False,
    reset: Callable[[], None] | None = None,
    max_trials: int = 100_000,
    points: Sequence[int] | None = None,
) -> FaultRun:
    """Run `run()` with its N-th I/O operation failed, for N = 1, 2, ... until a run completes
    without reaching its N-th (or for each N of `points`, then once without a fault: a sample of
    the loop, see `boundaries`); `check(trial)` after each (with faults off), `reset()` before
    each. Returns every trial; raises if `max_trials` pass without a complete run."""
    roots = list(roots)
    done = FaultRun()
    todo: Iterator[int | None] = iter([*points, None]) if points is not None else iter(range(1, max_trials + 1))
    for n in todo:
        if reset is not None:
            reset()
        started = time.perf_counter()
        result = error_seen = None
        with FailNth(n, roots, ops=ops, error=error, persistent=persistent) as faults:
            try:
                result = run()
            except BaseException as exc:
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                error_seen = exc
        trial = Trial(n or 0, faults.fired, error_seen, time.perf_counter() - started, faults.calls, result)
        done.trials.append(trial)
        check(trial)
        if faults.fired is None and (points is None or n is None):
            _report(done, error, persistent)
            return done
    raise AssertionError(f"no run completed within {max_trials} trials")


def _report(run: FaultRun, error: int, persistent: bool) -> None:
    """With TIERFLOW_FAULTS_REPORT=path, one JSON line per loop (the test, its trials, outcomes and
    the operations failed): what docs/reliability.md's table is counted from."""
    path = os.environ.get("TIERFLOW_FAULTS_REPORT")
    if not path:
        return
    import json

    line = {
        "test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0],
        "errno": errnos.errorcode[error],
        "persistent": persistent,
        "trials": len(run.trials),
        "operations": run.operations,
        "outcomes": run.outcomes(),
        "by_op": run.by_op(),
        "max_seconds": round(max(t.seconds for t in run.trials), 3),
    }
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


def boundaries(faults: FailNth, ops: Sequence[str] = DEFAULT_OPS, distinct: bool = False) -> list[int]:
    """From a recorded run (`count_ops`), the N of the first and the last operation of each run of
    the same operation on the same file: a sample of every kind of failure point in a fraction of
    the trials (a manifest written in 400 small writes is tried at its first and its last).
    `ops`: the families the loop will fail (they number the operations). `distinct`: only the
    first such point of each kind (the operation, the file's name with its hashes and numbers
    blanked, first or last of its run), e.g. one entry's temporary of each tier, not every one."""
    points: list[int] = []
    seen: set[tuple[str, str, bool]] = set()
    log = [entry for entry in faults.log if entry[0] in ops]
    for i, entry in enumerate(log):
        first, last = i == 0 or log[i - 1] != entry, i + 1 == len(log) or log[i + 1] != entry
        if not (first or last):
            continue
        if distinct:
            kind = (entry[0], _kind_of(entry[1]), first)
            if kind in seen:
                continue
            seen.add(kind)
        points.append(i + 1)
    return points


POINTS_ENV = "TIERFLOW_FAULT_POINTS"
"""Which N a fault test tries: "kinds" (default: one of each kind of failure point), "boundaries"
(the first and last of every run of one operation on one file) or "every" (SQLite's loop)."""


def sample_points(
    run: Callable[[], Any],
    roots: Iterable[str | os.PathLike],
    ops: Sequence[str] = DEFAULT_OPS,
    how: str | None = None,
    reset: Callable[[], None] | None = None,
) -> list[int] | None:
    """The N for `fail_each(points=...)` as TIERFLOW_FAULT_POINTS (or `how`) says, from one
    counted run of `run` (after `reset()`); None for "every" (fail_each then tries every N)."""
    how = how or os.environ.get(POINTS_ENV) or "kinds"
    if how not in ("kinds", "boundaries", "every"):
        raise ValueError(f"{POINTS_ENV}={how!r}: expected kinds, boundaries or every")
    if how == "every":
        return None
    if reset is not None:
        reset()
    return boundaries(count_ops(run, roots, ops=ops), ops, distinct=how == "kinds")


def _kind_of(path: str) -> str:
    import re

    head, _, name = path.rpartition("/")
    return f"{head.rpartition('/')[2]}/{re.sub(r'[0-9]+', 'N', re.sub(r'[0-9a-f]{8,}', 'H', name))}"


def tier_problems(root: str | os.PathLike, manifest: Any, name: str = "L2", form: str = "decoded") -> list[str]:
    """What a tier directory shows that is not whole: an indexed entry that is unknown to the
    manifest, recorded with the wrong size or checksum for the tier's form, or without its file
    and not dropped by a lookup; a file under entries/ whose bytes are not the entry's; a
    reservation of a dead process left after the index reclaims them. Empty when every entry a
    reader could find is whole. `form`: the tier's (what a directory not configured yet would be
    configured with)."""
    from tierflow.format._checksum import file_xxh3_128
    from tierflow.tiers import Tier

    # a look: a directory a killed child left unconfigured stays so for the next job to configure
    tier = Tier(root, 1.0, name=name, form=form, configure=False)
    expected = {s.key: (s.bytes_in(tier.form), s.checksum_in(tier.form)) for s in manifest.shards}
    problems = []
    for row in tier.index.entries():
        if row.key not in expected:
            problems.append(f"{name}: indexes an unknown entry {row.key}")
        elif (row.size, row.checksum) != expected[row.key]:
            problems.append(f"{name}: indexes {row.key} with size {row.size}, checksum {row.checksum}")
        elif not tier.path_of(row.key).is_file():
            # killed between unlinking an evicted entry and committing its removal: a reader
            # must take it for a miss and drop the row (it is never served)
            pin = tier.lookup(row.key)
            if pin is not None or tier.index.get(row.key) is not None:
                problems.append(f"{name}: indexes {row.key}, whose file is gone, and a lookup keeps it")
    for path in (Path(root) / "entries").iterdir():
        key = path.name.removesuffix(".arrow")
        size, checksum = expected.get(key, (-1, ""))
        if path.stat().st_size != size or file_xxh3_128(path) != checksum:
            problems.append(f"{name}: holds a partial or wrong entry {path.name}")
    with tier.index.transaction() as c:
        tier.index.used(c)  # reclaims the reservations of dead processes
    if tier.index.occupancy()[1]:
        problems.append(f"{name}: {tier.index.occupancy()[1]} bytes reserved after dead processes' were reclaimed")
    return problems


def sample_digests(dataset: Iterable[dict[str, Any]]) -> list[str]:
    """One xxh3-64 per sample (every column's value, arrays by dtype, shape and bytes), in order:
    the golden hashes a rerun or a survivor is compared with."""
    import numpy as np
    import xxhash

    digests = []
    for sample in dataset:
        h = xxhash.xxh3_64()
        for name in sorted(sample):
            value = sample[name]
            h.update(name.encode() + b"\0")
            if isinstance(value, np.ndarray):
                h.update(f"{value.dtype.str}{value.shape}".encode() + np.ascontiguousarray(value).tobytes())
            else:
                h.update(repr(value).encode())
        digests.append(h.hexdigest())
    return digests


CORPUS_WORDS = ("alpha", "beta", "gamma", "delta", "tier", "flow", "shard", "cursor", "batch", "node")


def write_corpus(path: Path, docs: int, seed: int) -> Path:
    """A JSONL corpus of `docs` records ({"id", "text"}, 5-200 words each) drawn from `seed`: the
    input the fault and kill suites pack, the same bytes for the same arguments."""
    import json
    import random

    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(docs):
            words = " ".join(rng.choice(CORPUS_WORDS) for _ in range(rng.randint(5, 200)))
            f.write(json.dumps({"id": i, "text": f"{seed}:{i} {words}"}) + "\n")
    return path


def verified_golden(out: str | os.PathLike) -> tuple[str, list[str]]:
    """The local dataset's id and its samples' hashes, after `tierflow verify`'s checks, which must
    pass (AssertionError listing the problems otherwise)."""
    import tierflow
    from tierflow.format._audit import audit_manifest
    from tierflow.format.manifest import Manifest
    from tierflow.format.verify import verify_shard

    out = Path(out)
    manifest = Manifest.load(out)
    problems = [p for info in manifest.shards for p in verify_shard(out / info.name, info)]
    problems = problems or audit_manifest(out, manifest)
    assert not problems, problems
    return manifest.dataset_id, sample_digests(tierflow.open_dataset(out))


def count_ops(run: Callable[[], Any], roots: Iterable[str | os.PathLike], *, ops: Sequence[str] = OPS) -> FailNth:
    """Run `run()` once, counting (and recording) its operations without failing any."""
    with FailNth(None, roots, ops=ops, record=True) as faults:
        run()
    return faults


def error_chain(error: BaseException | None) -> Iterator[BaseException]:
    """`error`, its __cause__ and __context__, and theirs (each once)."""
    seen: set[int] = set()
    todo = [error] if error is not None else []
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)


__all__ = [
    "DEFAULT_OPS",
    "FailNth",
    "FaultRun",
    "IOFault",
    "OPS",
    "POINTS_ENV",
    "Trial",
    "boundaries",
    "count_ops",
    "error_chain",
    "fail_each",
    "sample_digests",
    "sample_points",
    "tier_problems",
]
