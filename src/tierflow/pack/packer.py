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
import fcntl
import logging
import os
import shutil
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import numpy as np
import pyarrow as pa

from tierflow._bootstrap import refuse_while_bootstrapping
from tierflow.format.manifest import MANIFEST_NAME, Manifest
from tierflow.format.metadata import TABLE_PREFIX, TABLE_SUFFIX
from tierflow.format.metadata_index import ShardNames
from tierflow.format.metadata_writer import is_published, referenced_tables, write_with_manifest
from tierflow.format.shard import SHARD_PREFIX, SHARD_SUFFIX, ShardInfo
from tierflow.pack._assemble import ShardAssembler
from tierflow.pack._journal import JOURNAL_NAME, PackedSoFar, PackJournal, ResumePoint, UnitsDigest, digest_before
from tierflow.pack._journal import fingerprint as options_fingerprint
from tierflow.pack._media import has_images
from tierflow.pack.sources import estimate_input_bytes, length_histogram, plan_units, read_unit, rows_to_batch
from tierflow.pack.tokenize import PackInputError, make_tokenizer, token_dtype
from tierflow.pack.units import SourceOptions, Unit, UnitStats
from tierflow.pack._workers import die_with_parent

if TYPE_CHECKING:
    from concurrent.futures import Future

log = logging.getLogger("tierflow.pack")
MIN_SHARD_BYTES = 256 << 10
WARN_SHARD_BYTES = 64 << 20
TMP_DIR = ".tmp-pack"
IMAGE_BLOCK_BYTES = 1 << 20
"""Default block size of image shards: 4 MB blocks cost 3.6 CPU ms per decoded + cropped image at 2
workers, 1 MB blocks 3.1 (benchmarks/images.py), the rest being each worker hashing whole blocks."""
LOCK_NAME = ".tierflow.lock"


@dataclass
class PackConfig:
    """Everything a worker needs; plain data so it crosses the process boundary cheaply."""

    sources: SourceOptions
    fn: Callable[[dict], dict | None] | None = None
    tokenizer: str | None = None
    eos_token: str | None = None
    keep_text: bool = False
    block_bytes: int = 1 << 20
    tmp_dir: str = ""
    image_block_bytes: int | None = None
    """Blocks of a batch holding images (when block_bytes was not chosen): a read of one image
    verifies its whole block, so big blocks multiply the bytes hashed per random image."""


@dataclass
class UnitResult:
    index: int
    where: str
    parts: list[str]
    stats: UnitStats
    input_bytes: int
    tokens: int = 0
    histogram: np.ndarray = field(default_factory=lambda: np.zeros(64, np.int64))


# ---------------------------------------------------------------- worker side


def _apply_fn(batch: pa.RecordBatch, fn: Callable, stats: UnitStats, where: str) -> pa.RecordBatch | None:
    out = []
    for row in batch.to_pylist():
        sample = fn(row)
        if sample is None:
            stats.filtered += 1
            continue
        out.append(sample)
    stats.samples -= batch.num_rows - len(out)
    return rows_to_batch(out, where) if out else None


def _tokenize(batch: pa.RecordBatch, config: PackConfig, result: UnitResult, where: str) -> pa.RecordBatch:
    tokenizer = make_tokenizer(config.tokenizer, config.eos_token)
    field_name = config.sources.text_field
    texts = text_column(batch, field_name, where)
    if texts.null_count:
        batch = _drop_null_texts(batch, texts, config.sources, result.stats, where)
        texts = batch.column(field_name)
    if "text_bytes" in batch.schema.names and batch.column("text_bytes").null_count < batch.num_rows:
        raw = batch.column("text_bytes").cast(pa.large_binary())
        texts = pa.array([t if t is not None else r for t, r in
                          zip(texts.cast(pa.large_binary()).to_pylist(), raw.to_pylist())], pa.large_binary())
    offsets, ids = tokenizer.encode_arrow(texts)
    ids = ids.astype(token_dtype(tokenizer.vocab_size), copy=False)
    tokens = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(ids))
    result.tokens += len(ids)
    result.histogram += length_histogram(np.diff(offsets) - 1)
    columns = {name: batch.column(name) for name in batch.schema.names
               if config.keep_text or name not in (field_name, "text_bytes")}
    columns["tokens"] = tokens
    return pa.RecordBatch.from_pydict(columns)


def _drop_null_texts(batch: pa.RecordBatch, texts: pa.Array, options: SourceOptions, stats: UnitStats,
                     where: str) -> pa.RecordBatch:
    """A record with no text to tokenise (null, and no raw bytes of a file) is bad input, never an
    empty document: raised, or counted and dropped under on_error="skip". (Records read as they are
    were named with their line by the reader; these come from `fn` or a Parquet file.)"""
    missing = texts.is_null()
    if "text_bytes" in batch.schema.names:
        import pyarrow.compute as pc

        missing = pc.and_(missing, batch.column("text_bytes").is_null())
    rows = np.flatnonzero(missing.to_numpy(zero_copy_only=False))
    if not len(rows):
        return batch
    source = "the input" if options.require_text else "fn's output"  # tokenising without require_text: fn ran
    for r in rows:
        message = f"{where}: record {int(r)} of {source} has no text in {options.text_field!r} (null or missing)"
        if options.on_error != "skip":
            raise PackInputError(message + "; pass --on-error skip to count and skip such records")
        stats.skip_record("null text", message)
    stats.samples -= len(rows)
    keep = np.setdiff1d(np.arange(batch.num_rows), rows)
    return batch.take(pa.array(keep, pa.int64()))


def text_column(batch: pa.RecordBatch, name: str, where: str) -> pa.Array:
    """The column to tokenise, checked here so a wrong one is named with its file, not a cast traceback."""
    idx = batch.schema.get_field_index(name)
    if idx < 0:
        raise PackInputError(f"{where}: no text field {name!r} to tokenise "
                             f"(columns: {batch.schema.names}); pass --text-field")
    kind = batch.schema.field(idx).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind)
            or pa.types.is_large_binary(kind) or pa.types.is_null(kind)):
        raise PackInputError(f"{where}: column {name!r} is {kind}, expected string (or binary) text to tokenise; "
                             f"pass --text-field to choose another column")
    return batch.column(idx)


def _split_blocks(batch: pa.RecordBatch, block_bytes: int, image_block_bytes: int | None = None
                  ) -> Iterable[pa.RecordBatch]:
    if batch.num_rows == 0:
        return
    if image_block_bytes is not None and has_images(batch.schema):
        block_bytes = min(block_bytes, image_block_bytes)
    per_row = max(1, batch.nbytes // batch.num_rows)
    rows = max(1, block_bytes // per_row)
    for start in range(0, batch.num_rows, rows):
        yield batch.slice(start, rows)


def pack_unit(unit: Unit, config: PackConfig) -> UnitResult:
    """Turn one unit into uncompressed Arrow stream files (one per schema run)."""
    stats = UnitStats()
    where = f"{unit.path}" + (f" [bytes {unit.start}..{unit.end}]" if unit.kind == "jsonl" and unit.start else "")
    result = UnitResult(unit.index, where, [], stats, unit.input_bytes)
    writer, schema, sink_path = None, None, None
    try:
        for batch in read_unit(unit, config.sources, stats):
            if config.fn is not None:
                try:
                    batch = _apply_fn(batch, config.fn, stats, where)
                except PackInputError:
                    raise
                except Exception as e:
                    raise PackInputError(f"{where}: fn raised {type(e).__name__}: {e}") from e
                if batch is None:
                    continue
            if config.tokenizer is not None:
                batch = _tokenize(batch, config, result, where)
            if batch.num_rows == 0:
                continue
            if writer is None or batch.schema != schema:
                if writer is not None:
                    writer.close()
                schema = batch.schema
                sink_path = os.path.join(config.tmp_dir, f"unit-{unit.index:09d}-{len(result.parts)}.arrows")
                writer = pa.ipc.new_stream(sink_path, schema)
                result.parts.append(sink_path)
            for block in _split_blocks(batch, config.block_bytes, config.image_block_bytes):
                writer.write_batch(block)
    finally:
        if writer is not None:
            writer.close()
    return result


def _pack_unit_in_worker(unit: Unit, config: PackConfig) -> UnitResult:
    return pack_unit(unit, config)


# ---------------------------------------------------------------- parent side


@dataclass(repr=False)
class PackSummary:
    manifest: Manifest
    seconds: float
    input_bytes: int
    units_packed: int = 0
    """Units this run packed; with `units_resumed`, those an interrupted run had finished."""
    units_resumed: int = 0

    @property
    def mb_per_s(self) -> float:
        return self.input_bytes / 1e6 / max(self.seconds, 1e-9)

    def __repr__(self) -> str:
        """One line (the dataclass's own would print the whole manifest, every shard's block table)."""
        m = self.manifest
        tokens = f", {m.num_tokens:,} tokens" if m.token_column else ""
        skipped = m.stats.get("skipped_records", 0)
        return (f"PackSummary(dataset_id={m.dataset_id!r}, {m.num_samples:,} samples{tokens} in {len(m.shards)} "
                f"shards, {sum(s.bytes for s in m.shards) / 1e6:.1f} MB at rest, {self.seconds:.2f} s"
                + (f", {skipped:,} records skipped" if skipped else "") + ")")


def _prepare_out(out: Path, overwrite: bool, keep: set[str] = frozenset()) -> None:
    """Clear what an earlier run left, but the shards in `keep` (those a resumed pack carries on from)."""
    out.mkdir(parents=True, exist_ok=True)
    if is_published(out) and not overwrite:
        raise PackInputError(f"{out} already holds a finished dataset; pass --overwrite to replace it")
    shutil.rmtree(out / TMP_DIR, ignore_errors=True)
    for p in out.iterdir():
        if p.name.startswith(".tmp-") and p.is_file():
            p.unlink()
    if not is_published(out):
        for p in out.glob(f"{SHARD_PREFIX}*{SHARD_SUFFIX}"):
            if p.name not in keep:
                p.unlink()  # leftovers of a pack that died before publishing its manifest


def remove_unreferenced(out: Path, manifest: Manifest | None) -> list[Path]:
    """Delete shard files, temporaries and a resume journal the manifest (if any) does not reference
    (`tierflow gc`)."""
    shards = ShardNames(manifest) if manifest is not None else set()  # no string per shard of a mapped one
    tables = referenced_tables(out)  # the version-3 tables its header names (a header last written keeps them)
    removed = []
    for p in out.iterdir():
        if (p.name.startswith(SHARD_PREFIX) and p.name.endswith(SHARD_SUFFIX) and p.name not in shards) or \
                (p.name.startswith(TABLE_PREFIX) and p.name.endswith(TABLE_SUFFIX) and p.name not in tables) or \
                (p.name.startswith(".tmp-") and p.is_file()):
            p.unlink()
            removed.append(p)
    if (out / TMP_DIR).exists():
        shutil.rmtree(out / TMP_DIR)
        removed.append(out / TMP_DIR)
    if (out / JOURNAL_NAME).exists():
        (out / JOURNAL_NAME).unlink()
        removed.append(out / JOURNAL_NAME)
    return removed


_HELD_LOCK_FDS: set[int] = set()


def _close_inherited_locks() -> None:
    """In a forked child (a pack worker): drop the copies of the parent's lock descriptors.

    An flock belongs to the open file, which fork shares: a worker still holding a copy would
    keep the dataset locked after its parent died. Closing the copy leaves the parent's lock.
    """
    for fd in _HELD_LOCK_FDS:
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD_LOCK_FDS.clear()


os.register_at_fork(after_in_child=_close_inherited_locks)


class DatasetLock:
    """An exclusive kernel lock on a dataset directory, released if the holder dies."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / LOCK_NAME
        self.fd: int | None = None

    def __enter__(self) -> "DatasetLock":
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise PackInputError(f"{self.path.parent}: another tierflow process is writing this dataset") from None
        _HELD_LOCK_FDS.add(self.fd)
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self.fd is not None
        _HELD_LOCK_FDS.discard(self.fd)
        os.close(self.fd)


def pack(sources: Any, out: str | os.PathLike, fn: Callable[[dict], dict | None] | None = None, *,
         workers: int | None = None, target_shard_bytes: int = 256 << 20, compression: str = "zstd",
         compression_level: int | None = None, tokenizer: str | None = None, eos_token: str | None = None,
         text_field: str = "text", keep_text: bool = False, kind: str = "auto",
         include: Sequence[str] = (), exclude: Sequence[str] = (), on_error: str = "raise",
         overwrite: bool = False, progress: bool = False, chunk_bytes: int = 16 << 20,
         block_bytes: int | None = None, endpoint_url: str | None = None, engine: str = "local",
         address: str | None = None, shard_size: int | str | None = None) -> PackSummary:
    """Pack files, directories or an iterable of records into a tierflow dataset at `out`.

    `shard_size` is the CLI's `--shard-size` under its own name ("256MB", "1GiB" or bytes), the same
    setting as `target_shard_bytes` (give one of them): the decoded size a shard is cut at.

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
    """
    refuse_while_bootstrapping("tierflow.pack")
    if shard_size is not None:
        from tierflow.tiers.config import parse_size

        if target_shard_bytes != 256 << 20:
            raise ValueError("give shard_size= or target_shard_bytes=, not both (they are the same setting)")
        target_shard_bytes = parse_size(shard_size)
    options = dict(fn=fn, workers=workers, target_shard_bytes=target_shard_bytes, compression=compression,
                   compression_level=compression_level, tokenizer=tokenizer, eos_token=eos_token,
                   text_field=text_field, keep_text=keep_text, kind=kind, include=include, exclude=exclude,
                   on_error=on_error, overwrite=overwrite, progress=progress, chunk_bytes=chunk_bytes,
                   block_bytes=block_bytes, run_units=_engine(engine, address, workers))
    target = str(out)
    if "://" not in target or target.startswith("file://"):
        summary = _pack_local(sources, Path(target.removeprefix("file://")), **options)
    else:
        summary = _pack_remote(sources, target, endpoint_url, **options)
    _report(summary, target, progress)
    return summary


def _pack_remote(sources: Any, url: str, endpoint_url: str | None, **options: Any) -> PackSummary:
    """Pack in a local staging directory that never holds more than a few shards (see pack.upload)."""
    import tempfile

    from tierflow.pack._upload import ShardUploader
    from tierflow.storage.remote import SourceNotFound, open_source

    remote = open_source(url, endpoint_url=endpoint_url)
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


def _pack_local(sources: Any, out: Path, fn: Callable[[dict], dict | None] | None, *, workers: int | None,
                target_shard_bytes: int, compression: str, compression_level: int | None, tokenizer: str | None,
                eos_token: str | None, text_field: str, keep_text: bool, kind: str, include: Sequence[str],
                exclude: Sequence[str], on_error: str, overwrite: bool, progress: bool,
                chunk_bytes: int, block_bytes: int | None, run_units: Callable | None = None,
                on_shard: Callable[[Path, ShardInfo], None] | None = None) -> PackSummary:
    sources = _as_sources(sources)
    _check_options(target_shard_bytes, on_error)
    workers = workers or os.cpu_count() or 1
    _check_inputs(sources, fn, workers, run_units is not None)
    tok = make_tokenizer(tokenizer, eos_token)
    options = SourceOptions(text_field=text_field, kind=kind, include=tuple(include), exclude=tuple(exclude),
                            on_error=on_error, chunk_bytes=chunk_bytes, require_text=tok is not None and fn is None)
    image_block_bytes = IMAGE_BLOCK_BYTES if block_bytes is None else None
    if block_bytes is None:
        block_bytes = int(min(4 << 20, max(256 << 10, target_shard_bytes // 64)))
    out.mkdir(parents=True, exist_ok=True)
    with DatasetLock(out):
        journal = None
        if on_shard is None and all(isinstance(s, (str, os.PathLike)) for s in sources):  # replayable input
            journal = PackJournal(out, options_fingerprint(dict(
                sources=[os.path.abspath(s) for s in sources], options=dataclasses.asdict(options),
                tokenizer=tok.identity() if tok is not None else None, keep_text=keep_text,
                block_bytes=block_bytes, image_block_bytes=image_block_bytes, target=target_shard_bytes,
                compression=compression, level=compression_level), fn))
        point = _resume_point(journal, out, sources, options)
        _prepare_out(out, overwrite, {s.name for s in point.shards} if point else set())
        tmp_dir = out / TMP_DIR
        tmp_dir.mkdir()
        config = PackConfig(options, fn, tokenizer, eos_token, keep_text, block_bytes, str(tmp_dir),
                            image_block_bytes)
        assembler = ShardAssembler(out, target_shard_bytes, compression, compression_level,
                                   "tokens" if tok is not None else None, on_shard)
        run = _PackRun(assembler, _PackProgress(estimate_input_bytes(sources, options) if progress else None,
                                                progress))
        units: Iterable[Unit] = plan_units(sources, options, run.totals)
        if journal is not None:
            journal.start(point)
            units = run.journal_to(journal, UnitsDigest(units), point)
        try:
            with run.bar:
                (run_units or _run_units)(units, config, workers, run.consume)
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
            raise PackInputError(f"no samples found in {where}" + _skipped_note(run.totals))
        manifest = run.manifest(tok)
        write_with_manifest(out, manifest)  # the version-3 tables and header, manifest.json last
        remove_unreferenced(out, manifest)
    return PackSummary(manifest, time.perf_counter() - run.started, run.input_bytes, run.units_packed,
                       point.unit if point else 0)


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


def _no_space(out: Path, run: "_PackRun", workers: int, units: list[int], expansion: float = 1.0) -> PackInputError:
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
        f"pack elsewhere (or to s3://), or use fewer workers (or a smaller chunk_bytes)")


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
        except Exception:  # noqa: BLE001 - pickle raises several kinds for the same reason
            name = getattr(fn, "__name__", repr(fn))
            raise PackInputError(
                f"fn={name} cannot be sent to the worker processes (they receive it pickled): define it with "
                f"`def` at the top level of a module (or a notebook cell), not as a lambda or inside a function, "
                f"or pass workers=1 to run it in this process") from None


def _check_options(target_shard_bytes: int, on_error: str) -> None:
    if target_shard_bytes < MIN_SHARD_BYTES:
        raise ValueError(f"target_shard_bytes {target_shard_bytes} < {MIN_SHARD_BYTES} (256 KB)")
    if target_shard_bytes < WARN_SHARD_BYTES:
        log.warning("shards of %d bytes are small: each costs a request and a cache entry; "
                    "256 MB is the default", target_shard_bytes)
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', not {on_error!r}")


def _engine(engine: str, address: str | None, workers: int | None) -> Callable | None:
    if engine not in ("local", "ray"):
        raise ValueError(f"engine must be 'local' or 'ray', not {engine!r}")
    if engine == "local":
        return None
    from tierflow.pack.ray_engine import RayRunner
    return RayRunner(address, workers)


def _run_units(units: Iterable[Unit], config: PackConfig, workers: int,
               consume: Callable[[UnitResult], None]) -> None:
    """Pack every unit on `workers` processes; results are consumed in unit order, from a window
    of two units per worker, so the output never depends on which worker finished first."""
    if workers == 1:
        for unit in units:
            consume(pack_unit(unit, config))
        return
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    with ProcessPoolExecutor(workers, mp_context=get_context("fork"), initializer=die_with_parent,
                             initargs=(os.getpid(),)) as pool:  # no orphans if this process is killed
        window: deque[Future] = deque()
        try:
            for unit in units:
                window.append(pool.submit(_pack_unit_in_worker, unit, config))
                if len(window) >= 2 * workers:
                    consume(_unit_result(window.popleft()))
            while window:
                consume(_unit_result(window.popleft()))
        except BaseException:
            for f in window:
                f.cancel()
            raise


def _unit_result(future: Future) -> UnitResult:
    """A worker's result. Bad input is raised without the worker's traceback: its message names
    the file and what is wrong, and 40 lines of pyarrow frames would only bury that."""
    try:
        return future.result()
    except PackInputError as e:
        raise e from None


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

    def __init__(self, assembler: ShardAssembler, bar: "_PackProgress") -> None:
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
            schema=self.assembler.unified, shards=shards, tokenizer=tok.identity() if tok is not None else None,
            token_column="tokens" if tok is not None else None,
            token_dtype=str(token_dtype(tok.vocab_size)) if tok is not None else None,
            eos_id=tok.eos_id if tok is not None else None, stats=stats,
        )


def _skipped_note(totals: UnitStats) -> str:
    skipped = totals.skipped_summary()
    return "; skipped " + _describe_skipped(skipped) if skipped else ""


def _describe_skipped(skipped: dict[str, dict[str, Any]]) -> str:
    return ", ".join(f"{v['count']:,} file{'s' * (v['count'] != 1)} ({reason}, e.g. {v['example']})"
                     for reason, v in skipped.items())


def _report(summary: PackSummary, target: str, progress: bool) -> None:
    """Say what was not packed (always: a log warning) and, with progress, the summary table."""
    skipped = summary.manifest.stats.get("skipped_files")
    if skipped:
        log.warning("%s: packed without %s", target, _describe_skipped(skipped))
    if progress:
        print_summary(summary, target)


class _PackProgress:
    """A rich progress bar (input bytes, files, samples, shards, MB/s, ETA) or nothing."""

    def __init__(self, total: int | None, enabled: bool) -> None:
        self.enabled = enabled
        self.total = total
        self.progress = None
        self.started = time.perf_counter()
        self.done = 0

    def __enter__(self) -> "_PackProgress":
        if self.enabled:
            from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("[bold]pack"), BarColumn(), TaskProgressColumn(),
                                     TextColumn("{task.description}"), TimeRemainingColumn(), transient=False)
            self.progress.start()
            self.task = self.progress.add_task("starting", total=self.total)
        return self

    def advance(self, nbytes: int, totals: UnitStats, shards: int) -> None:
        self.done += nbytes
        if self.progress is not None:
            self.progress.update(self.task, advance=nbytes, description=self._describe(totals, shards))

    def finish(self, totals: UnitStats, shards: int) -> None:
        """The final counts: every shard sealed, and the bar full (the total is known by now)."""
        if self.progress is not None:
            self.progress.update(self.task, total=self.done, completed=self.done,
                                 description=self._describe(totals, shards))

    def _describe(self, totals: UnitStats, shards: int) -> str:
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        return (f"{totals.files:,} files  {totals.samples:,} samples  {shards} shards  "
                f"{self.done / 1e6 / elapsed:.1f} MB/s")

    def __exit__(self, *exc: Any) -> None:
        if self.progress is not None:
            self.progress.stop()


def print_summary(summary: PackSummary, out: str | os.PathLike) -> None:
    from rich.console import Console
    from rich.table import Table

    m = summary.manifest
    at_rest = sum(s.bytes for s in m.shards)
    decoded = sum(s.decoded_bytes for s in m.shards)
    table = Table(title=f"packed {out}", show_header=False)
    rows = [
        ("dataset id", m.dataset_id),
        ("samples", f"{m.num_samples:,}"),
        ("shards", f"{len(m.shards)} (at rest {at_rest / 1e6:.1f} MB, decoded {decoded / 1e6:.1f} MB, "
                   f"ratio {decoded / max(at_rest, 1):.2f}x)"),
        ("input", f"{summary.input_bytes / 1e6:.1f} MB, {m.stats.get('files', 0):,} files"),
        ("time", f"{summary.seconds:.2f} s, {summary.mb_per_s:.1f} MB/s, "
                 f"{m.stats.get('files', 0) / max(summary.seconds, 1e-9):,.0f} files/s"),
    ]
    if summary.units_resumed:
        rows.append(("resumed", f"{summary.units_resumed:,} units an interrupted run had packed, "
                                f"{summary.units_packed:,} packed now"))
    if m.token_column:
        rows.append(("tokens", f"{m.num_tokens:,} ({m.token_dtype}, {m.tokenizer['name']})"))
    if m.stats.get("sidecars"):
        rows.append(("sidecars", f"{m.stats['sidecars']:,} caption files, read with their images"))
    if m.stats.get("kept_as_bytes"):
        rows.append(("kept as bytes", f"{m.stats['kept_as_bytes']:,} (not valid UTF-8)"))
    if m.stats.get("skipped_records"):
        reasons = m.stats.get("skipped_records_by_reason") or {}
        rows.append(("skipped", f"{m.stats['skipped_records']:,} record{'s' * (m.stats['skipped_records'] != 1)}" + (" (" + ", ".join(
            f"{v['count']:,} {reason}, e.g. {v['example']}" for reason, v in reasons.items()) + ")" if reasons else "")))
    if m.stats.get("skipped_files"):
        rows.append(("skipped files", _describe_skipped(m.stats["skipped_files"])))
    for k, v in rows:
        table.add_row(k, v)
    Console().print(table)
