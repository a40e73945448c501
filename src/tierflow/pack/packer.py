"""`tierflow.pack`: raw inputs -> content-addressed shards + one manifest, on every core.

Workers parse, map (`fn`) and tokenise units of input and hand back uncompressed Arrow
files; the parent cuts them into shards of the target size in unit order, compresses and
hashes them, and publishes the manifest last. Shard boundaries depend only on the data, so
the output is byte-identical whatever the number of workers, and memory stays bounded
(a window of units in flight plus the shard being assembled). So does scratch space: the
workers' Arrow files (in `<out>/.tmp-pack`) are mapped, unlinked and gone as soon as the
shard writers have written their batches, so a pack needs about two units per worker of
scratch, never the dataset's decoded size; short of that it says how much it needs, and where.
A killed pack (either engine) publishes nothing, and its rerun resumes after the last sealed shard
(pack._journal), with the same output as a pack that was never interrupted.
"""

from __future__ import annotations

import copy
import dataclasses
import errno
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from tierflow._bootstrap import refuse_while_bootstrapping
from tierflow._sizes import parse_size
from tierflow.format.manifest import MANIFEST_NAME, Manifest
from tierflow.format.metadata_windows import DEFAULT_LENGTHS
from tierflow.format.metadata_writer import is_published, write_with_manifest
from tierflow.format.shard import ShardInfo
from tierflow.pack._assemble import ShardAssembler
from tierflow.pack._journal import PackedSoFar, PackJournal, ResumePoint, UnitsDigest, digest_before
from tierflow.pack._journal import fingerprint as options_fingerprint
from tierflow.pack.dataset_dir import TMP_DIR, DatasetLock, prepare_out, remove_unreferenced
from tierflow.pack.report import PackProgress, PackSummary, report, skipped_note
from tierflow.pack.sources import estimate_input_bytes, plan_units
from tierflow.pack.tokenize import PackInputError, make_tokenizer, token_dtype
from tierflow.pack.unit_packer import PackConfig, UnitResult, run_units
from tierflow.pack.units import SourceOptions, Unit, UnitStats

log = logging.getLogger("tierflow.pack")
MIN_SHARD_BYTES = 256 << 10
WARN_SHARD_BYTES = 64 << 20
DEFAULT_SHARD_BYTES = 256 << 20
SMALL_CORPUS_SHARDS = 64
"""A corpus whose input files the default shard size would cut into fewer shards is cut into about
this many (the default order's 64 partitions, each with shards of its own): a 56 MB corpus in one
256 MB shard left one rank with all the data and the others none."""
SMALL_CORPUS_MIN_SHARD_BYTES = 1 << 20
IMAGE_BLOCK_BYTES = 1 << 20
"""Default block size of image shards: 4 MB blocks cost 3.6 CPU ms per decoded + cropped image at 2
workers, 1 MB blocks 3.1 (benchmarks/images.py), the rest being each worker hashing whole blocks."""


def pack(
    sources: Any,
    out: str | os.PathLike,
    fn: Callable[[dict], dict | None] | None = None,
    *,
    workers: int | None = None,
    target_shard_bytes: int | None = None,
    compression: str = "zstd",
    compression_level: int | None = None,
    tokenizer: str | None = None,
    eos_token: str | None = None,
    text_field: str = "text",
    keep_text: bool = False,
    kind: str = "auto",
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    on_error: str = "raise",
    overwrite: bool = False,
    progress: bool = False,
    chunk_bytes: int = 16 << 20,
    block_bytes: int | None = None,
    endpoint_url: str | None = None,
    engine: str = "local",
    address: str | None = None,
    shard_size: int | str | None = None,
    seq_len: int | Sequence[int] | None = None,
) -> PackSummary:
    """Pack files, directories or an iterable of records into a tierflow dataset at `out`.

    `shard_size` is the CLI's `--shard-size` under its own name ("256MB", "1GiB" or bytes), the same
    setting as `target_shard_bytes` (give one of them): the decoded size a shard is cut at. Default:
    256 MB, or, for input files under 64 x 256 MB, their size / 64 (at least 1 MB), so a small corpus
    still has a shard for each of the order's partitions (`default_shard_bytes`).

    `fn` maps one raw record (a dict) to a sample dict, or None to drop it; it runs in the
    worker processes, so features computed here are paid once, not every epoch. `out` may be
    an object-store URL (s3://bucket/prefix): each shard is uploaded as soon as it is sealed
    and deleted locally (a few shards of local space, whatever the dataset's size), and the
    manifest last. `block_bytes` (default: the shard size / 64, within 256 KB-4 MB; at most 1 MB
    for images) sizes the blocks, the unit of compression, checksum and random access: larger
    ones compress better, and a read decodes a whole block. Input files of a directory that are not packed (another
    kind than `kind`) are counted by reason in the manifest's stats and logged, never dropped.
    `engine="ray"` runs the units as Ray tasks on the cluster at `address` (pack.ray_engine):
    the same shards, byte for byte; `workers` then caps the tasks at once (default: its CPUs).
    A pack into a directory that was killed (either engine) resumes when rerun with the same
    inputs and options: the shards it had sealed are kept and their units not packed again.
    `seq_len` (a tokenized pack's; one length or several): store the token-window order's layout for
    windows of each, so a loader with that `seq_len` starts without a pass over every shard
    (format/metadata_windows.py; `tierflow upgrade --seq-len` adds one later). Default: a tokenized
    pack stores those of 2048, 4096 and 8192 (`DEFAULT_LENGTHS`); `seq_len=()` stores none.
    """
    refuse_while_bootstrapping("tierflow.pack")
    if seq_len is None:
        seq_lens: tuple[int, ...] = DEFAULT_LENGTHS if tokenizer is not None else ()
    else:
        seq_lens = (seq_len,) if isinstance(seq_len, int) else tuple(seq_len)
    if seq_lens and tokenizer is None:
        raise ValueError(f"seq_len={seq_len!r} stores token-window layouts: it needs a tokenizer")
    if any(type(n) is not int or n < 1 for n in seq_lens):
        raise ValueError(f"seq_len must be positive window lengths, got {seq_len!r}")
    if shard_size is not None:
        if target_shard_bytes is not None:
            raise ValueError("give shard_size= or target_shard_bytes=, not both (they are the same setting)")
        target_shard_bytes = parse_size(shard_size)
    options: dict[str, Any] = dict(
        fn=fn,
        workers=workers,
        target_shard_bytes=target_shard_bytes,
        compression=compression,
        compression_level=compression_level,
        tokenizer=tokenizer,
        eos_token=eos_token,
        text_field=text_field,
        keep_text=keep_text,
        kind=kind,
        include=include,
        exclude=exclude,
        on_error=on_error,
        overwrite=overwrite,
        progress=progress,
        chunk_bytes=chunk_bytes,
        block_bytes=block_bytes,
        engine_run=_engine(engine, address, workers),
        seq_lens=seq_lens,
    )
    target = str(out)
    if "://" not in target or target.startswith("file://"):
        summary = _pack_local(sources, Path(target.removeprefix("file://")), **options)
    else:
        summary = _pack_remote(sources, target, endpoint_url, **options)
    report(summary, target, progress)
    return summary


def _pack_remote(sources: Any, url: str, endpoint_url: str | None, **options: Any) -> PackSummary:
    """Pack in a local staging directory that never holds more than a few shards (see pack.upload)."""
    import tempfile

    from tierflow.pack._upload import ShardUploader
    from tierflow.storage.remote import SourceNotFound, open_store

    remote = open_store(url, endpoint_url=endpoint_url)
    if not options["overwrite"]:
        try:
            remote.size(MANIFEST_NAME)
        except SourceNotFound:
            pass
        else:
            raise PackInputError(f"{url} already holds a finished dataset; pass --overwrite to replace it")
    with tempfile.TemporaryDirectory(prefix="tierflow-pack-") as staging, ShardUploader(remote) as uploader:
        summary = _pack_local(sources, Path(staging) / "dataset", on_shard=uploader, **options)
        uploader.publish(Path(staging) / "dataset")
    return summary


def _pack_local(
    sources: Any,
    out: Path,
    fn: Callable[[dict], dict | None] | None,
    *,
    workers: int | None,
    target_shard_bytes: int | None,
    compression: str,
    compression_level: int | None,
    tokenizer: str | None,
    eos_token: str | None,
    text_field: str,
    keep_text: bool,
    kind: str,
    include: Sequence[str],
    exclude: Sequence[str],
    on_error: str,
    overwrite: bool,
    progress: bool,
    chunk_bytes: int,
    block_bytes: int | None,
    engine_run: Callable | None = None,
    seq_lens: Sequence[int] = (),
    on_shard: Callable[[Path, ShardInfo], None] | None = None,
) -> PackSummary:
    sources = _as_sources(sources)
    if target_shard_bytes is not None:
        _check_shard_bytes(target_shard_bytes)
    _check_on_error(on_error)
    workers = workers or os.cpu_count() or 1
    _check_inputs(sources, fn, workers, engine_run is not None)
    tok = make_tokenizer(tokenizer, eos_token)
    options = SourceOptions(
        text_field=text_field,
        kind=kind,
        include=tuple(include),
        exclude=tuple(exclude),
        on_error=on_error,
        chunk_bytes=chunk_bytes,
        require_text=tok is not None and fn is None,
    )
    input_bytes = estimate_input_bytes(sources, options)
    if target_shard_bytes is None:
        target_shard_bytes = default_shard_bytes(input_bytes)
    image_block_bytes = IMAGE_BLOCK_BYTES if block_bytes is None else None
    if block_bytes is None:
        block_bytes = int(min(4 << 20, max(256 << 10, target_shard_bytes // 64)))
    out.mkdir(parents=True, exist_ok=True)
    with DatasetLock(out):
        journal = None
        if on_shard is None and all(isinstance(s, (str, os.PathLike)) for s in sources):  # replayable input
            journal = PackJournal(
                out,
                options_fingerprint(
                    dict(
                        sources=[os.path.abspath(s) for s in sources],
                        options=dataclasses.asdict(options),
                        tokenizer=tok.identity() if tok is not None else None,
                        keep_text=keep_text,
                        block_bytes=block_bytes,
                        image_block_bytes=image_block_bytes,
                        target=target_shard_bytes,
                        compression=compression,
                        level=compression_level,
                    ),
                    fn,
                ),
            )
        point = _resume_point(journal, out, sources, options)
        prepare_out(out, overwrite, {s.name for s in point.shards} if point else set())
        tmp_dir = out / TMP_DIR
        tmp_dir.mkdir()
        config = PackConfig(options, fn, tokenizer, eos_token, keep_text, block_bytes, str(tmp_dir), image_block_bytes)
        assembler = ShardAssembler(
            out, target_shard_bytes, compression, compression_level, "tokens" if tok is not None else None, on_shard
        )
        run = _PackRun(assembler, PackProgress(input_bytes if progress else None, progress))
        units: Iterable[Unit] = plan_units(sources, options, run.totals)
        if journal is not None:
            journal.start(point)
            units = run.journal_to(journal, UnitsDigest(units), point)
        try:
            with run.bar:
                (engine_run or run_units)(units, config, workers, run.consume)
                assembler.flush()
                run.bar.finish(run.totals, len(assembler.shards))
        except BaseException as e:
            if journal is not None and isinstance(e, KeyboardInterrupt):  # interrupted: a rerun resumes
                journal.close()
                assembler.abort()
                shutil.rmtree(tmp_dir, ignore_errors=True)
                raise
            if journal is not None:
                journal.remove()
            _discard(out, assembler, tmp_dir)
            if isinstance(e, OSError) and e.errno == errno.ENOSPC:
                raise _no_space(out, run, workers, _planned_units(sources, options), _expansion(tok)) from e
            raise
        if journal is not None:
            journal.close()
        shutil.rmtree(tmp_dir, ignore_errors=True)
        if not assembler.shards:
            where = ", ".join(str(s) for s in sources if isinstance(s, (str, os.PathLike))) or "the iterable"
            raise PackInputError(f"no samples found in {where}" + skipped_note(run.totals))
        manifest = run.manifest(tok)
        write_with_manifest(out, manifest, seq_lens=seq_lens)  # the version-3 tables and header, manifest.json last
        remove_unreferenced(out, manifest)
    return PackSummary(
        manifest, time.perf_counter() - run.started, run.input_bytes, run.units_packed, point.unit if point else 0
    )


def _resume_point(journal: PackJournal | None, out: Path, sources: list, options: SourceOptions) -> ResumePoint | None:
    """Where an interrupted pack of the same inputs and options stopped, or None to start over."""
    if journal is None or is_published(out):
        return None
    point = journal.last_point()
    if point is None:
        return None
    try:
        same_inputs = digest_before(plan_units(sources, options), point.unit) == point.units_digest
    except (OSError, PackInputError):
        same_inputs = False
    if not same_inputs:
        log.info("%s: the inputs changed since the interrupted pack; starting over", out)
        return None
    log.info("%s: resuming after %d sealed shards (unit %d)", out, len(point.shards), point.unit)
    return point


def _planned_units(sources: list, options: SourceOptions) -> list[int]:
    """Input bytes of each unit the sources plan into (empty for an iterable of records)."""
    if not all(isinstance(s, (str, os.PathLike)) for s in sources):
        return []
    try:
        return [unit.input_bytes for unit in plan_units(sources, options)]
    except (OSError, PackInputError):
        return []


def _expansion(tok: Any) -> float:
    """Decoded (scratch) bytes a unit may take per byte of its input, at most: its fields (text
    included) no larger than the input they were parsed from, plus the token ids, one id of the
    tokenizer's dtype per input byte at most (the byte tokenizer's exactly: 3x its input with
    the text kept, where counting the input alone under-stated the need by 3)."""
    if tok is None:
        return 1.0
    return 1.0 + np.dtype(token_dtype(tok.vocab_size)).itemsize


def _no_space(out: Path, run: _PackRun, workers: int, units: list[int], expansion: float = 1.0) -> PackInputError:
    """ENOSPC, with what the pack needs: scratch for the units in flight (their decoded Arrow
    files, a window of two per worker: never the whole dataset) and room for the shards.
    `expansion`: decoded bytes per input byte at most (`_expansion`), for a unit none came back of."""
    window = min(2 * workers + 1 if workers > 1 else 1, len(units) or 1 << 30)
    # the largest unit's scratch seen; before any unit came back, the largest planned one expanded
    unit = run.largest_unit or int(max(units, default=0) * expansion)
    written = sum(s.bytes for s in run.assembler.shards)
    free = shutil.disk_usage(out).free  # this run's files are removed by now
    return PackInputError(
        f"{out}: no space left on the device while writing shards; nothing was published and this run's "
        f"files were removed. Packing needs about {window * unit / 1e6:.1f} MB of scratch in {out / TMP_DIR} "
        f"({window} unit{'s' * (window != 1)} of up to {unit / 1e6:.1f} MB decoded in flight) plus room for the shards "
        f"({written / 1e6:.1f} MB written when it ran out); {free / 1e6:.1f} MB are free. Free some space, "
        f"pack elsewhere (or to s3://), or use fewer workers (or a smaller chunk_bytes)"
    )


def _as_sources(sources: Any) -> list:
    if isinstance(sources, (str, os.PathLike)) or isinstance(sources, dict):
        return [sources]
    if not isinstance(sources, (list, tuple)):
        return [sources]  # an iterable of records
    return list(sources)


def _check_inputs(sources: list, fn: Callable | None, workers: int, engine: bool) -> None:
    """Refuse before anything is written: an input path that does not exist (a typo must not leave an
    empty output directory behind), or an `fn` the worker processes cannot receive."""
    for source in sources:
        if isinstance(source, (str, os.PathLike)) and not os.path.exists(source):
            raise PackInputError(f"{os.fspath(source)}: no such file or directory")
    if fn is not None and workers > 1 and not engine:  # (Ray pickles with cloudpickle, lambdas included)
        import pickle

        try:
            pickle.dumps(fn)
        except Exception:
            name = getattr(fn, "__name__", repr(fn))
            raise PackInputError(
                f"fn={name} cannot be sent to the worker processes (they receive it pickled): define it with "
                f"`def` at the top level of a module (or a notebook cell), not as a lambda or inside a function, "
                f"or pass workers=1 to run it in this process"
            ) from None


def default_shard_bytes(input_bytes: int | None) -> int:
    """DEFAULT_SHARD_BYTES, or for input files it would cut into fewer than SMALL_CORPUS_SHARDS
    shards, their size / SMALL_CORPUS_SHARDS (at least SMALL_CORPUS_MIN_SHARD_BYTES); records from an
    iterable (`input_bytes` None) are not counted ahead and get the default."""
    if input_bytes is None:
        return DEFAULT_SHARD_BYTES
    return int(min(DEFAULT_SHARD_BYTES, max(SMALL_CORPUS_MIN_SHARD_BYTES, input_bytes // SMALL_CORPUS_SHARDS)))


def _check_shard_bytes(target_shard_bytes: int) -> None:
    if target_shard_bytes < MIN_SHARD_BYTES:
        raise ValueError(f"target_shard_bytes {target_shard_bytes} < {MIN_SHARD_BYTES} (256 KB)")
    if target_shard_bytes < WARN_SHARD_BYTES:
        log.warning(
            "shards of %d bytes are small: each costs a request and a cache entry; 256 MB is the default",
            target_shard_bytes,
        )


def _check_on_error(on_error: str) -> None:
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', not {on_error!r}")


def _engine(engine: str, address: str | None, workers: int | None) -> Callable | None:
    if engine not in ("local", "ray"):
        raise ValueError(f"engine must be 'local' or 'ray', not {engine!r}")
    if engine == "local":
        return None
    from tierflow.pack.ray_engine import RayRunner

    return RayRunner(address, workers)


def _discard(out: Path, assembler: ShardAssembler, tmp_dir: Path) -> None:
    """A failed pack: drop what it wrote, unless a manifest (of an earlier pack) still needs it."""
    assembler.abort()
    shutil.rmtree(tmp_dir, ignore_errors=True)
    for info in assembler.shards:
        if not is_published(out):
            (out / info.name).unlink(missing_ok=True)


class _PackRun:
    """What one pack gathers from its units, in unit order: batches into shards, and the stats.

    `totals` also receives planning's counts (files skipped by reason, sidecars) as it goes.
    """

    def __init__(self, assembler: ShardAssembler, bar: PackProgress) -> None:
        self.assembler = assembler
        self.bar = bar
        self.totals = UnitStats()
        self.so_far = PackedSoFar(UnitStats())
        """The units consumed whole: their counts (without planning's) and their tokens, lengths, bytes."""
        self.largest_unit = 0
        """Bytes of the largest unit's scratch files (its decoded Arrow form) so far."""
        self.units_packed = 0
        self.started = time.perf_counter()
        self._unit = -1
        self._unit_start = 0
        """`assembler.rows_appended` when the current unit's first row (skipped ones included) went in."""
        self._skip: tuple[int, int] = (-1, 0)
        self._digests: UnitsDigest | None = None

    @property
    def input_bytes(self) -> int:
        return self.so_far.input_bytes

    @property
    def tokens(self) -> int:
        return self.so_far.tokens

    def journal_to(self, journal: PackJournal, units: UnitsDigest, point: ResumePoint | None) -> Iterable[Unit]:
        """Record each sealed shard in `journal`; when resuming from `point`, carry on from there.

        Returns the units left to pack: those from the point's unit on (whose first rows, already
        in the point's shards, `consume` skips).
        """
        self._digests = units
        self.assembler.on_cut = self._position
        self.assembler.on_sealed = lambda info, mark: journal.sealed(info, *mark)
        if point is None:
            return units
        self.assembler.resume(point.shards, point.schema)
        self.so_far = copy.deepcopy(point.so_far)
        self.totals.merge(point.so_far.stats)
        self._skip = (point.unit, point.rows)
        self.bar.advance(point.so_far.input_bytes, self.totals, len(point.shards))
        return (unit for unit in units if unit.index >= point.unit)

    def _position(self) -> tuple:
        """Where the stream stands at a cut: (unit, its rows before the cut, digest, schema, counts)."""
        assert self._digests is not None
        rows = self.assembler.rows_appended - self._unit_start
        return (self._unit, rows, self._digests.take(self._unit), self.assembler.schema, copy.deepcopy(self.so_far))

    def consume(self, result: UnitResult) -> None:
        self.largest_unit = max(self.largest_unit, sum(os.stat(part).st_size for part in result.parts))
        skip = self._skip[1] if result.index == self._skip[0] else 0
        self._unit, self._unit_start = result.index, self.assembler.rows_appended - skip
        for part in result.parts:
            with pa.memory_map(part) as source:
                reader = pa.ipc.open_stream(source)
                os.unlink(part)  # the mapping keeps the bytes until the shard is written
                try:
                    for batch in reader:
                        if skip >= batch.num_rows:  # in a shard the interrupted run sealed
                            skip -= batch.num_rows
                            continue
                        self.assembler.add(batch.slice(skip) if skip else batch)
                        skip = 0
                except PackInputError as e:
                    raise PackInputError(f"{result.where}: {e}") from None
        self.totals.merge(result.stats)
        self.so_far.stats.merge(result.stats)
        self.so_far.tokens += result.tokens
        self.so_far.histogram += result.histogram
        self.so_far.input_bytes += result.input_bytes
        self.so_far.units += 1
        self.units_packed += 1
        self._unit, self._unit_start = result.index + 1, self.assembler.rows_appended  # counted: a cut from
        # here on (the final shard's, in flush) resumes at the next unit
        self.bar.advance(result.input_bytes, self.totals, len(self.assembler.shards))

    def manifest(self, tok: Any) -> Manifest:
        totals, shards = self.totals, self.assembler.shards
        stats = {
            "samples": sum(s.samples for s in shards),
            "tokens": self.tokens,
            "files": totals.files,
            "sidecars": totals.sidecars,
            "corrupt_images": totals.corrupt_images,
            "skipped_files": totals.skipped_summary(),
            "kept_as_bytes": totals.kept_as_bytes,
            "skipped_records": totals.skipped_records,
            "skipped_records_by_reason": totals.skipped_records_summary(),
            "filtered": totals.filtered,
            "errors": totals.errors,
            "input_bytes": self.input_bytes,
            "length_histogram": {
                "unit": "tokens" if tok is not None else None,
                "bucket_upper_bounds": [0] + [1 << b for b in range(63)],
                "counts": self.so_far.histogram.tolist(),
            },
        }
        return Manifest(
            schema=self.assembler.unified,
            shards=shards,
            tokenizer=tok.identity() if tok is not None else None,
            token_column="tokens" if tok is not None else None,
            token_dtype=str(token_dtype(tok.vocab_size)) if tok is not None else None,
            eos_id=tok.eos_id if tok is not None else None,
            stats=stats,
        )
