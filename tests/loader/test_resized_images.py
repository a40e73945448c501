"""ImagePipeline(cache=ResizedImages(...)) (issue 16 item 4): batches are byte-identical with the cache
cold, warm or keeping nothing; resume replays; a changed short side misses instead of serving old
pixels; entries stay within the tier's capacity, whole and accounted; a damaged entry is made again."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import tierflow
from tierflow.loader import AspectBuckets, ImageSamples, Loader, TieredDataset, BatchSpec, OrderSpec
from tierflow.testing import assert_resumes_exactly
from tierflow.testing.resume import assert_same_batches, take
from tierflow.transforms import (
    HorizontalFlip,
    ImagePipeline,
    RandomResizedCrop,
    ResizedImages,
    ResizeToBucket,
    aspect_buckets,
)
from tierflow.transforms.resized import resized_size

from corpora import pack_pictures, pack_with_a_corrupt_jpeg

SIDE, SHORT = 32, 48
COLUMNS = ["image", "image_width", "image_height", "caption", "path"]


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    """48 JPEGs of 40-160 px (most larger than SHORT on the short side) in blocks of ~16 KB."""
    return pack_pictures(tmp_path_factory.mktemp("resized"), block_bytes=16 << 10)


def blocks_of(packed: Path) -> int:
    return sum(len(s.blocks) for s in tierflow.Manifest.load(packed).shards)


def loader(packed: Path, cache: ResizedImages, workers: int = 0, **kw) -> Loader:
    pipeline = ImagePipeline([RandomResizedCrop(SIDE), HorizontalFlip()], cache=cache)
    ds = TieredDataset(
        packed, BatchSpec(batch_size=8, batcher=ImageSamples(select=COLUMNS), transform=pipeline), OrderSpec(seed=3)
    )
    return Loader(ds, num_workers=workers, **(kw or {"epoch_end": "rank"}))


def epoch(packed: Path, cache: ResizedImages, workers: int = 0) -> list:
    with loader(packed, cache, workers) as it:
        return take(it, 1000)


def counts(cache: ResizedImages) -> dict[str, int]:
    t = cache.tier
    return {"hits": int(t.m_hits.value), "misses": int(t.m_misses.value), "corruptions": int(t.m_corruptions.value)}


def test_batches_are_byte_identical_cold_warm_and_with_a_tier_that_keeps_nothing(packed, tmp_path):
    blocks = blocks_of(packed)
    cold = ResizedImages(tmp_path / "l1", "10MB", short_side=SHORT)
    first = epoch(packed, cold)
    assert counts(cold) == {"hits": 0, "misses": blocks, "corruptions": 0}
    warm = ResizedImages(tmp_path / "l1", "10MB", short_side=SHORT)  # a new process's view: nothing open yet
    assert_same_batches(first, epoch(packed, warm), "warm vs cold")
    assert counts(warm) == {"hits": blocks, "misses": 0, "corruptions": 0}
    nothing = ResizedImages(tmp_path / "tiny", 1000, short_side=SHORT)  # smaller than any block's entry
    assert_same_batches(first, epoch(packed, nothing), "a tier that keeps nothing vs cold")
    assert nothing.tier.snapshot()["entries"] == 0 and int(nothing.tier.m_bypass.value) >= blocks
    images = np.concatenate([b["image"].numpy() for b, _ in first])
    assert images.shape == (48, SIDE, SIDE, 3) and images.std() > 0


def test_the_pipeline_crops_from_the_resized_image(packed, tmp_path):
    """With no steps the output is the whole cached image: short side SHORT, the same pixels as
    ResizedImages.resize, whether the sample comes through the loader (its block's entry) or alone."""
    cache = ResizedImages(tmp_path / "l1", "10MB", short_side=SHORT)
    whole = ImagePipeline([], cache=cache)
    ds = TieredDataset(
        packed, BatchSpec(batch_size=1, batcher=ImageSamples(select=COLUMNS), transform=whole), OrderSpec(seed=3)
    )
    sample = tierflow.open_dataset(packed)[0]
    alone = whole(sample, np.random.default_rng(0))["image"]
    with Loader(ds, num_workers=0, epoch_end="rank") as it:
        ((batch, meta),) = take(it, 1)
    first = tierflow.open_dataset(packed)[int(meta.sample_ids[0])]
    want = cache.resize(first["image"], whole.decoder)
    assert want.shape[:2][::-1] == resized_size(first["image_width"], first["image_height"], SHORT)
    assert min(want.shape[:2]) == min(SHORT, first["image_width"], first["image_height"])
    assert np.array_equal(batch["image"][0].numpy(), want)
    assert np.array_equal(alone, cache.resize(sample["image"], whole.decoder))


def test_augmentations_replay_exactly_on_resume_through_the_cache(packed, tmp_path):
    def make(workers: int) -> Loader:
        return loader(packed, ResizedImages(tmp_path / "l1", "10MB", short_side=SHORT), workers, endless=True)

    assert_resumes_exactly(make, stops=[1, 4], workers=0)


def test_a_changed_short_side_misses_instead_of_serving_the_old_pixels(packed, tmp_path):
    blocks = blocks_of(packed)
    at_48 = epoch(packed, ResizedImages(tmp_path / "l1", "10MB", short_side=SHORT))
    other = ResizedImages(tmp_path / "l1", "10MB", short_side=40)
    at_40 = epoch(packed, other)
    assert counts(other) == {"hits": 0, "misses": blocks, "corruptions": 0}
    assert other.tier.snapshot()["entries"] == 2 * blocks  # both forms resident, each under its own key
    assert_same_batches(
        epoch(packed, ResizedImages(tmp_path / "fresh", "10MB", short_side=40)),
        at_40,
        "short side 40, fresh vs beside 48's entries",
    )
    assert not all(np.array_equal(a["image"].numpy(), b["image"].numpy()) for (a, _), (b, _) in zip(at_48, at_40))


def test_entries_stay_within_capacity_whole_and_accounted(packed, tmp_path):
    """A tier for about three blocks' entries of ten: evictions keep it within capacity; what the
    index counts is exactly the entry files there, and no temporary is left behind."""
    full = ResizedImages(tmp_path / "full", "10MB", short_side=SHORT)
    reference = epoch(packed, full)
    sizes = sorted(p.stat().st_size for p in (tmp_path / "full" / "entries").iterdir())
    capacity = sum(sizes[-3:])
    small = ResizedImages(tmp_path / "small", capacity, short_side=SHORT, open_blocks=1)
    assert_same_batches(reference, epoch(packed, small), "a tier of three blocks vs one of all")
    tier = small.tier
    snap = tier.snapshot()
    files = list((tmp_path / "small" / "entries").iterdir())
    assert int(tier.m_evictions.value) > 0 and 0 < snap["resident_bytes"] <= capacity
    assert snap["resident_bytes"] == sum(p.stat().st_size for p in files) and snap["entries"] == len(files)
    assert snap["reserved_bytes"] == 0 and not list((tmp_path / "small" / "tmp").iterdir())


def test_aspect_buckets_crop_from_the_cache_one_shape_per_batch_cold_and_warm(packed, tmp_path):
    buckets = aspect_buckets(area=SIDE * SIDE, multiple=8, max_ratio=2.0, count=5)

    def run(cache: ResizedImages) -> list:
        ds = TieredDataset(
            packed,
            BatchSpec(
                batch_size=8,
                batcher=AspectBuckets(buckets, group=3, select=COLUMNS),
                transform=ImagePipeline([ResizeToBucket(buckets), HorizontalFlip()], cache=cache),
            ),
            OrderSpec(seed=3),
        )
        with Loader(ds, num_workers=0, epoch_end="rank") as it:
            return take(it, 1000)

    cold = run(ResizedImages(tmp_path / "l1", "10MB", short_side=SHORT))
    shapes = {tuple(b["image"].shape[1:3]) for b, _ in cold}
    assert shapes <= set(buckets) and len(shapes) > 1
    warm = ResizedImages(tmp_path / "l1", "10MB", short_side=SHORT)
    assert_same_batches(cold, run(warm), "aspect buckets, warm vs cold")
    assert counts(warm)["misses"] == 0


@pytest.mark.parametrize("where", [0.5, -12], ids=["pixels", "footer"])
def test_a_damaged_entry_is_quarantined_and_made_again(packed, tmp_path, where):
    """A flipped byte in an image's pixels fails its checksum when read, one in the file's footer
    fails the parse when opened: either way the entry is quarantined and made again, same batches."""
    first = epoch(packed, ResizedImages(tmp_path / "l1", "10MB", short_side=SHORT))
    entry = sorted((tmp_path / "l1" / "entries").iterdir())[0]
    data = bytearray(entry.read_bytes())
    data[int(len(data) * where) if where > 0 else where] ^= 0xFF
    entry.write_bytes(bytes(data))
    again = ResizedImages(tmp_path / "l1", "10MB", short_side=SHORT)
    assert_same_batches(first, epoch(packed, again), "after one entry was damaged")
    assert counts(again) == {"hits": blocks_of(packed), "misses": 1, "corruptions": 1}
    assert len(list((tmp_path / "l1" / "quarantine").iterdir())) == 1


def test_a_corrupt_jpeg_in_a_cached_block_is_skipped_and_counted(tmp_path):
    packed = pack_with_a_corrupt_jpeg(tmp_path, 12, 96, 72)
    pipeline = ImagePipeline([RandomResizedCrop(SIDE)], cache=ResizedImages(tmp_path / "l1", "10MB", short_side=SHORT))
    for _ in range(2):  # cold, then warm: the error is kept in the entry
        ds = TieredDataset(
            packed,
            BatchSpec(batch_size=4, batcher=ImageSamples(select=COLUMNS, on_error="skip"), transform=pipeline),
            OrderSpec(seed=3),
        )
        with Loader(ds, num_workers=0, epoch_end="rank") as it:
            got = take(it, 100)
        assert sum(m.stats["corrupt"] for _, m in got) == 1 and sum(len(b["caption"]) for b, _ in got) == 11


@pytest.mark.slow
def test_two_workers_fill_every_block_batch_as_one_process_does_and_resume(packed, tmp_path):
    reference = epoch(packed, ResizedImages(tmp_path / "ref", "10MB", short_side=SHORT))
    two = ResizedImages(tmp_path / "l1", "10MB", short_side=SHORT)
    assert_same_batches(reference, epoch(packed, two, workers=2), "2 workers vs 0")
    assert two.tier.snapshot()["entries"] == blocks_of(packed)

    def make(workers: int) -> Loader:
        return loader(packed, ResizedImages(tmp_path / "l1", "10MB", short_side=SHORT), workers, endless=True)

    assert_resumes_exactly(make, stops=[3], workers=2)


def cache_counts(snapshot: dict, name: str) -> float:
    return sum(c["value"] for c in snapshot["counters"] if c["name"] == name and c["labels"].get("tier") == "resized")


def scraped(registry) -> dict:
    """{(name, tier): value} of one Prometheus scrape over HTTP of `registry`."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from tierflow.telemetry.prometheus import PrometheusExporter

    with PrometheusExporter([registry], port=0) as exporter:
        text = urllib.request.urlopen(exporter.url, timeout=10).read().decode()
    return {
        (sample.name, sample.labels.get("tier")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


@pytest.mark.parametrize("tiers", [False, True], ids=["local", "tiers"])
@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_the_caches_counts_reach_the_loaders_telemetry_prometheus_and_top(
    packed, tmp_path, workers, tiers, monkeypatch
):
    """On a plain local dataset or through tiers, built here or in 2 workers, one cold epoch's cache
    counts (a miss and a made block per block, the bytes it wrote) are in the loader's telemetry at
    the epoch's end, exactly: in its figures, a Prometheus scrape and the event log `tierflow top`
    reads. The workers are dealt batches in turn (lag 1): dealt by lane, this epoch's 6 batches all
    go to one worker, and the other, building the next epoch's meanwhile, may make a block the first
    then finds in the shared cache (a hit here; its miss ships with its own batch, next epoch)."""
    from rich.console import Console

    from tierflow.loader import workers as pool

    monkeypatch.setattr(pool, "LAG", 1)

    from tierflow.commands.top import RunState, render
    from tierflow.telemetry import MetricsRegistry
    from tierflow.telemetry.eventlog import EventLog, read_events
    from tierflow.telemetry.loader_metrics import LoaderTelemetry
    from tierflow.telemetry.tier_figures import tier_figures

    blocks = blocks_of(packed)
    registry = MetricsRegistry()
    log = EventLog(tmp_path / "run.jsonl", registry, snapshot_every_s=0.0)
    pipeline = ImagePipeline(
        [RandomResizedCrop(SIDE), HorizontalFlip()], cache=ResizedImages(tmp_path / "l1", "10MB", short_side=SHORT)
    )
    with tierflow.open_loader(
        packed,
        tiers=[f"L2={tmp_path / 'l2'}:50MB"] if tiers else [],
        batch_size=8,
        transform=pipeline,
        seed=3,
        columns=COLUMNS,
        num_workers=workers,
        epoch_end="rank",
        telemetry=LoaderTelemetry(registry, events=log),
    ) as it:
        assert sum(len(b["caption"]) for b in it) == 48
        snapshot = it.telemetry.registry.snapshot()
    log.close()
    resized = tier_figures(snapshot)["resized"]
    made = cache_counts(snapshot, "tierflow_resized_made_bytes_total")
    assert resized.misses == blocks == cache_counts(snapshot, "tierflow_resized_made_blocks_total")
    assert made > 0 and resized.bytes_in == made and resized.occupancy_bytes == made
    if tiers:
        assert tier_figures(snapshot)["L2"].hits + tier_figures(snapshot)["L2"].misses > 0  # the tiers' beside it
    samples = scraped(registry)
    assert samples[("tierflow_tier_misses_total", "resized")] == blocks
    assert samples[("tierflow_resized_made_bytes_total", "resized")] == made
    state = RunState().fold(read_events(tmp_path / "run.jsonl"))
    assert tier_figures(state.snapshot)["resized"].misses == blocks
    console = Console(record=True, width=160)
    console.print(render(state))
    assert "resized" in console.export_text()


def test_open_loaders_telemetry_is_the_tier_stacks_registry_the_stager_exports(packed, tmp_path):
    pipeline = ImagePipeline([RandomResizedCrop(SIDE)], cache=ResizedImages(tmp_path / "l1", "10MB", short_side=SHORT))
    with tierflow.open_loader(
        packed,
        tiers=[f"L2={tmp_path / 'l2'}:50MB"],
        batch_size=8,
        transform=pipeline,
        seed=3,
        columns=COLUMNS,
        epoch_end="rank",
    ) as it:
        assert sum(len(b["caption"]) for b in it) == 48
        assert it.telemetry.registry is it.stager.registry
        assert scraped(it.stager.registry)[("tierflow_tier_misses_total", "resized")] == blocks_of(packed)
