"""What is done with one unit of input, in a worker process (or in the packer's own with one
worker): parse it, map it (`fn`), tokenise it and write its rows as uncompressed Arrow stream files
in the pack's scratch directory; and `run_units`, the local engine that runs the units on worker
processes and hands the results back in unit order (pack.ray_engine is the other engine)."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from tierflow.pack._media import has_images
from tierflow.pack._workers import die_with_parent, interrupts_held
from tierflow.pack.sources import length_histogram, read_unit, rows_to_batch
from tierflow.pack.tokenize import PackInputError, make_tokenizer, token_dtype
from tierflow.pack.units import SourceOptions, Unit, UnitStats

if TYPE_CHECKING:
    from concurrent.futures import Future


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
    assert tokenizer is not None, "_tokenize runs only when the pack has a tokenizer"
    field_name = config.sources.text_field
    texts = text_column(batch, field_name, where)
    if texts.null_count:
        batch = _drop_null_texts(batch, texts, config.sources, result.stats, where)
        texts = batch.column(field_name)
    if "text_bytes" in batch.schema.names and batch.column("text_bytes").null_count < batch.num_rows:
        raw = batch.column("text_bytes").cast(pa.large_binary())
        texts = pa.array(
            [t if t is not None else r for t, r in zip(texts.cast(pa.large_binary()).to_pylist(), raw.to_pylist())],
            pa.large_binary(),
        )
    offsets, ids = tokenizer.encode_arrow(texts)
    ids = ids.astype(token_dtype(tokenizer.vocab_size), copy=False)
    tokens = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(ids))
    result.tokens += len(ids)
    result.histogram += length_histogram(np.diff(offsets) - 1)
    columns = {
        name: batch.column(name)
        for name in batch.schema.names
        if config.keep_text or name not in (field_name, "text_bytes")
    }
    columns["tokens"] = tokens
    return pa.RecordBatch.from_pydict(columns)


def _drop_null_texts(
    batch: pa.RecordBatch, texts: pa.Array, options: SourceOptions, stats: UnitStats, where: str
) -> pa.RecordBatch:
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
        raise PackInputError(
            f"{where}: no text field {name!r} to tokenise (columns: {batch.schema.names}); pass --text-field"
        )
    kind = batch.schema.field(idx).type
    if not (
        pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or pa.types.is_binary(kind)
        or pa.types.is_large_binary(kind)
        or pa.types.is_null(kind)
    ):
        raise PackInputError(
            f"{where}: column {name!r} is {kind}, expected string (or binary) text to tokenise; "
            f"pass --text-field to choose another column"
        )
    return batch.column(idx)


def _split_blocks(
    batch: pa.RecordBatch, block_bytes: int, image_block_bytes: int | None = None
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


def run_units(units: Iterable[Unit], config: PackConfig, workers: int, consume: Callable[[UnitResult], None]) -> None:
    """Pack every unit on `workers` processes; results are consumed in unit order, from a window
    of two units per worker, so the output never depends on which worker finished first."""
    if workers == 1:
        for unit in units:
            consume(pack_unit(unit, config))
        return
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    with ProcessPoolExecutor(
        workers, mp_context=get_context("fork"), initializer=die_with_parent, initargs=(os.getpid(),)
    ) as pool:  # no orphans if this process is killed
        window: deque[Future] = deque()
        try:
            units = iter(units)
            with interrupts_held():  # the first submit forks the workers
                first = next(units, None)
                if first is not None:
                    window.append(pool.submit(_pack_unit_in_worker, first, config))
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
