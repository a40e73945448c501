"""An image cache of the decoded-and-resized form: each block of a shard's images decoded once and
resized to a short side, kept in a tier directory, so the epochs of a small hot dataset only crop.

    cache = ResizedImages("/dev/shm/tf-resized", "4GB", short_side=256)
    pipeline = ImagePipeline([RandomResizedCrop(224), HorizontalFlip()], cache=cache)

benchmarks/images.py measured the trade (issue 16): serving a sample from resized pixels costs
~0.5 CPU ms against ~2.4 for decode + RandomResizedCrop from the encoded bytes, at about twice
the encoded bytes per image in the cache. Tiers of shards keep the encoded form by default; this
is the opt-in for a hot dataset whose resized form fits in RAM.

How it changes the augmentation: with a cache, the pipeline's steps plan on the *resized* image
(short side `short_side`; an image already that small is kept at full size, never upscaled), not
on the original. The random part (RandomResizedCrop's area, aspect and offsets, the flip) still
draws from the order's per-sample rng, so a run replays exactly on resume and with any worker
count; but each crop is resampled from the pre-resized pixels: a small crop (scale 0.08 of a
256 short side is ~72 px) is upsampled from fewer source pixels, so it is softer than the same
crop from the original, and the box's rounding happens in resized pixels, so the pixels differ
from the encoded path's. Every sample goes through the resized form whether its block is
resident, being filled, or declined by a full tier: batches are the same with the cache warm or
cold.

An entry holds one block of one shard (pack writes image blocks of about 1 MB encoded): its key
is the shard's content hash, the block and a hash of the form's parameters (short side, image
column, decoder and its version, filter, entry format), so a change of size or decoder misses
instead of serving old pixels. It is an Arrow IPC file (HWC uint8 pixels as large_binary, width,
height, each image's xxh3-64, and the error of an image that does not decode), made in memory
under the entry's fetch lock (one maker per node) and written through `Tier.ensure_made`:
reserved within the tier's capacity, written to a temporary name, verified (size, xxh3-128),
renamed, admitted. A hit checks the size; each image is checked against its xxh3-64 the first
time a process reads it (a whole-entry hash on every open cost ~0.7 ms, most of a sample's
budget when shuffled reads open a block per sample), and an entry that fails either check, or
does not parse, is quarantined and made again. Each process keeps up to `open_blocks` entries
open (pinned and mapped: their pages are the tier's, and a hit on an open block costs a dict
lookup), and the last UNKEPT_BLOCKS blocks the tier did not keep in its own memory.
"""

from __future__ import annotations

import io
import json
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import xxhash

from tierflow.errors import ShardCorruptError
from tierflow.format._checksum import xxh3_hex
from tierflow.telemetry.metrics import MetricsRegistry
from tierflow.tiers.config import parse_capacity
from tierflow.tiers.tier import Tier
from tierflow.transforms.decode import ImageDecodeError, decode, size_of, to_array

SOURCE_KEY = "__source__"
"""Where a sample lives (SampleLocation), set by the batchers for a transform with `needs_source`."""
ENTRY_FORMAT = 2
UNKEPT_BLOCKS = 4
"""Blocks the tier did not keep (full, or smaller than an entry) that a process holds in its memory."""
SCHEMA = pa.schema(
    [
        ("pixels", pa.large_binary()),
        ("width", pa.int32()),
        ("height", pa.int32()),
        ("checksum", pa.uint64()),
        ("error", pa.string()),
    ]
)


class SampleLocation(NamedTuple):
    """A sample's dataset, shard, block and row: what names its cache entry and fills it; and the
    registry its reading process counts into (the cache's counters go there)."""

    dataset: Any
    shard: int
    block: int
    row: int
    registry: MetricsRegistry | None = None


def resized_size(width: int, height: int, short_side: int) -> tuple[int, int]:
    """(width, height) with the short side brought down to `short_side` (never up)."""
    scale = short_side / max(1, min(width, height))
    if scale >= 1:
        return int(width), int(height)
    return max(1, round(width * scale)), max(1, round(height * scale))


def _decoder_version(decoder: str) -> str:
    module = __import__("simplejpeg" if decoder == "simplejpeg" else "PIL")
    return f"{decoder}-{getattr(module, '__version__', '?')}"


class _Damaged(Exception):
    """An entry whose bytes do not parse or do not match their checksums (quarantined, made again)."""


class _Block:
    """One block's resized images, read off an entry's bytes (mapped, or in memory). Each image is
    checked against its xxh3-64 the first time this process reads it, so opening an entry costs no
    pass over its bytes (a tier hit checks only the size, as the tier stack's readers do)."""

    def __init__(self, buffer: pa.Buffer, pin: Any = None) -> None:
        self.pin = pin
        try:
            batch = pa.ipc.open_file(buffer).get_batch(0)
            if batch.schema != SCHEMA:
                raise ValueError(f"schema {batch.schema}")
            pixels = batch.column("pixels")
            self.offsets = np.frombuffer(pixels.buffers()[1], np.int64)[pixels.offset : pixels.offset + len(pixels) + 1]
            data = pixels.buffers()[2]
            self.data = np.frombuffer(data, np.uint8) if data is not None else np.empty(0, np.uint8)
            self.widths = batch.column("width").to_numpy()
            self.heights = batch.column("height").to_numpy()
            self.checksums = batch.column("checksum").to_numpy()
            self.errors = batch.column("error").to_pylist()
        except (pa.ArrowException, OSError, ValueError, IndexError) as e:  # a damaged footer is an OSError
            raise _Damaged(f"does not parse ({type(e).__name__}: {e})") from None
        self.verified = np.zeros(len(self.errors), dtype=bool)

    def image(self, row: int) -> np.ndarray:
        if self.errors[row] is not None:
            raise ImageDecodeError(self.errors[row])
        start, end = int(self.offsets[row]), int(self.offsets[row + 1])
        values = self.data[start:end]
        if not self.verified[row]:
            if xxhash.xxh3_64_intdigest(values.data) != int(self.checksums[row]):
                raise _Damaged(f"row {row} does not match its checksum")
            self.verified[row] = True
        try:
            return values.reshape(int(self.heights[row]), int(self.widths[row]), 3)
        except ValueError:
            raise _Damaged(f"row {row}: {values.size} bytes are not {self.heights[row]}x{self.widths[row]}x3") from None

    def close(self) -> None:
        if self.pin is not None:
            self.pin.release()
            self.pin = None


@dataclass
class ResizedImages:
    """The decoded-and-resized form of a pipeline's images, cached per block in a tier directory
    (`path`, `capacity` as bytes, "4GB" or a share of its disk like "30%disk" ("30%" reads the same
    here: there is no dataset at rest to measure a resized cache against), `policy`); give it to
    `ImagePipeline(cache=...)`. Use its own directory (tmpfs for RAM): the tier's capacity and
    policy belong to the directory."""

    path: str | os.PathLike
    capacity: float | str
    short_side: int = 256
    policy: str = "lru"
    open_blocks: int = 256
    name: str = "resized"
    _state: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.short_side < 1 or self.open_blocks < 1:
            raise ValueError(
                f"ResizedImages needs short_side >= 1 and open_blocks >= 1, got {self.short_side}, {self.open_blocks}"
            )
        self.capacity = parse_capacity(self.capacity)

    def __getstate__(self) -> dict:
        """Pickled (into DataLoader workers) without its open tier and blocks: each process opens its own."""
        state = dict(self.__dict__)
        state["_state"] = {}
        return state

    @property
    def tier(self) -> Tier:
        """This process's handle on the tier directory (opened on first use in each process)."""
        return self._tier(None)

    def _tier(self, registry: MetricsRegistry | None) -> Tier:
        """The tier, opened in this process on first use; its counters (hits, misses, bytes in and
        out) and the cache's own (blocks and bytes made) go in `registry`: the reading context's
        (SampleLocation.registry: the tier stack's, else the context's own, which a DataLoader worker
        ships to the Loader's telemetry with its batches). Read through another context's registry,
        the cache opens afresh there (its open blocks closed) so each context's counts are its own.
        None: the handle already open, else one with a registry of its own."""
        state = self._state
        ours = state.get("pid") == os.getpid()
        if not ours or (registry is not None and state["tier"].registry is not registry):
            if ours:  # a forked child's copies of its parent's pins are the parent's to release
                for blocks in (state["blocks"], state["unkept"]):
                    for block in blocks.values():
                        block.close()
            tier = Tier(self.path, float(self.capacity), policy=self.policy, name=self.name, registry=registry)
            labels = {"tier": self.name}
            state.clear()
            state.update(
                pid=os.getpid(),
                blocks=OrderedDict(),
                unkept=OrderedDict(),
                tier=tier,
                made_blocks=tier.registry.counter(
                    "tierflow_resized_made_blocks_total", labels, "blocks of images decoded and resized"
                ),
                made_bytes=tier.registry.counter(
                    "tierflow_resized_made_bytes_total", labels, "bytes of resized entries made (kept or not)"
                ),
            )
        return state["tier"]

    def params(self, image: str, decoder: str) -> dict[str, Any]:
        """What the cached pixels depend on besides the shard's content (hashed into every key)."""
        return {
            "short_side": self.short_side,
            "image": image,
            "decoder": _decoder_version(decoder),
            "filter": "bilinear",
            "format": ENTRY_FORMAT,
        }

    def key(self, shard_key: str, block: int, image: str, decoder: str) -> str:
        digests = self._state.setdefault("digests", {})  # asked for every sample: hashed once per process
        digest = digests.get((image, decoder))
        if digest is None:
            digest = digests[(image, decoder)] = xxh3_hex(
                json.dumps(self.params(image, decoder), sort_keys=True).encode()
            )
        return f"{shard_key}-b{block}-r{digest}"

    def resize(self, data: bytes | None, decoder: str) -> np.ndarray:
        """One image's resized form (HWC uint8): decoded at the smallest JPEG scale covering the
        resized size, then resized to it in one antialiased bilinear pass."""
        from PIL import Image

        from tierflow.pack._media import CorruptImage, probe

        if data is None:
            raise ImageDecodeError("no image (null)")
        try:
            width, height, _ = probe(data)
        except CorruptImage as e:
            raise ImageDecodeError(str(e)) from None
        out = resized_size(width, height, self.short_side)
        img = decode(data, out, decoder)
        if size_of(img) == out:
            return np.ascontiguousarray(to_array(img))
        pil = img if isinstance(img, Image.Image) else Image.fromarray(img)
        return to_array(pil.resize(out, Image.Resampling.BILINEAR))

    def image(self, sample: dict, image: str, decoder: str) -> np.ndarray:
        """The sample's resized pixels: from its block's entry when the batcher said where it lives
        (SOURCE_KEY), made here otherwise (the same pixels, not kept)."""
        source: SampleLocation | None = sample.get(SOURCE_KEY)
        if source is None:
            return self.resize(sample.get(image), decoder)
        info = source.dataset.manifest.shards[source.shard]
        key = self.key(info.key, source.block, image, decoder)
        for attempt in range(2):
            block = self._block(key, source, image, decoder)
            try:
                return block.image(source.row)
            except _Damaged as e:
                self._quarantine(key, block, str(e))
                if attempt:
                    raise self._damaged_again(key, source, e) from None
        raise AssertionError("unreachable")

    def _damaged_again(self, key: str, source: SampleLocation, error: _Damaged) -> ShardCorruptError:
        name = source.dataset.manifest.shards[source.shard].name
        return ShardCorruptError(
            f"resized cache {self.tier.root}: entry {key} (shard {name} block {source.block}) "
            f"{error}, again after it was made again"
        )

    def _quarantine(self, key: str, block: _Block, why: str) -> None:
        for blocks in (self._state["blocks"], self._state["unkept"]):
            blocks.pop(key, None)
        if block.pin is not None:
            self.tier.quarantine(key, why, block.pin)
        block.close()

    def _block(self, key: str, source: SampleLocation, image: str, decoder: str) -> _Block:
        """The key's block, open in this process, else made or found in the tier (a hit checks the
        size; its images are checked as they are read)."""
        tier = self._tier(source.registry)
        for blocks in (self._state["blocks"], self._state["unkept"]):
            found = blocks.get(key)
            if found is not None:
                blocks.move_to_end(key)
                return found
        for attempt in range(2):
            pin, made = tier.ensure_made(
                key,
                lambda: self._make(source, image, decoder),
                dataset=source.dataset.manifest.dataset_id,
                verify_hit=False,
            )
            if pin is None:
                found = _Block(pa.py_buffer(made))
                blocks, bound = self._state["unkept"], UNKEPT_BLOCKS
                break
            try:
                with pa.memory_map(str(pin.path)) as mapped:  # the buffer keeps the mapping, not the file open
                    found = _Block(mapped.read_buffer(), pin)
            except _Damaged as e:
                tier.quarantine(key, str(e), pin)
                pin.release()
                if attempt:
                    raise self._damaged_again(key, source, e) from None
                continue
            blocks, bound = self._state["blocks"], self.open_blocks
            break
        blocks[key] = found
        while len(blocks) > bound:
            blocks.popitem(last=False)[1].close()
        return found

    def _make(self, source: SampleLocation, image: str, decoder: str) -> bytes:
        """The entry's bytes: every image of the block resized (an image that does not decode keeps
        its error, raised when that sample is read)."""
        table = source.dataset.shard(source.shard)
        get = table.getter(source.block, image)
        pixels, widths, heights, checksums = [], [], [], []
        errors: list[str | None] = []
        for row in range(table.block_rows(source.block)):
            error: str | None
            try:
                arr = self.resize(get(row), decoder)
            except ImageDecodeError as e:
                arr, error = np.empty((0, 0, 3), np.uint8), str(e)
            else:
                error = None
            pixels.append(arr.tobytes())
            checksums.append(xxhash.xxh3_64_intdigest(pixels[-1]))
            heights.append(arr.shape[0])
            widths.append(arr.shape[1])
            errors.append(error)
        batch = pa.record_batch(
            [
                pa.array(pixels, pa.large_binary()),
                pa.array(widths, pa.int32()),
                pa.array(heights, pa.int32()),
                pa.array(checksums, pa.uint64()),
                pa.array(errors, pa.string()),
            ],
            schema=SCHEMA,
        )
        sink = io.BytesIO()
        with pa.ipc.new_file(sink, SCHEMA) as writer:
            writer.write_batch(batch)
        self._state["made_blocks"].inc()
        self._state["made_bytes"].inc(sink.tell())
        return sink.getvalue()
