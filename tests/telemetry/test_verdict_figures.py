"""A verdict follows from the figures printed beside it (issue 39, item 5): the verdict logic fed
the figures `make demo`, `tierflow demo --images` and `tierflow bench --steps 300` printed."""

from __future__ import annotations

from tierflow.commands.bench import BytesPerEpoch
from tierflow.telemetry.health import health_flags
from tierflow.telemetry.loader_metrics import LoaderFigures
from tierflow.telemetry.tier_figures import TierFigures
from tierflow.telemetry.verdict import judge


def loader(
    batches: int = 300,
    bubble: float = 0.02,
    step_s: float = 0.005,
    produce_s: float = 0.002,
    stall_s: dict | None = None,
) -> LoaderFigures:
    return LoaderFigures(
        batches=batches,
        wait_s=bubble * batches * step_s,
        step_s=batches * step_s,
        bubble_rate=bubble,
        wait_p90_s=0.0005,
        wait_p99_s=0.002,
        production_p50_s=produce_s,
        production_p90_s=produce_s,
        production_p99_s=produce_s * 2,
        step_mean_s=step_s,
        prefetch_depth_mean=2.0,
        stall_s=stall_s or {},
        stalls=len(stall_s or {}),
        fetch_s={},
        fetch_bytes={"source": 40 << 20, "L2": 60 << 20},
    )


def l2(hit_ratio: float, requests: int = 200) -> TierFigures:
    hits = round(hit_ratio * requests)
    return TierFigures(
        "L2", hits, requests - hits, 40 << 20, 60 << 20, 10, 5, 0, 0, 0, 0, 3 << 20, 4 << 20, 0.01, 0.02, 0.04
    )


def test_the_demos_figures_loader_at_079_of_the_dry_run_is_not_compute():
    # make demo printed: ratio 0.79, bubble rate 1.6%, L2 served 46% (want > 70%); verdict "compute"
    figures, tiers = loader(bubble=0.016, stall_s={"fetch:source": 0.02}), {"L2": l2(0.46)}
    verdict = judge(figures, tiers, dry_run_step_s=0.005, loader_ratio=0.79, cores=2)
    assert verdict.bound != "compute"
    assert "0.79 of the dry run" in verdict.reason and "21%" in verdict.reason


def test_a_compute_verdict_does_not_call_caches_fine_beside_a_low_hit_ratio():
    figures = loader(bubble=0.01)
    flags = health_flags(figures, {"L2": l2(0.46)})
    assert any(f.status == "warn" and "L2 served 46% of requests (want > 70%)" == f.message for f in flags)
    verdict = judge(figures, {"L2": l2(0.46)}, dry_run_step_s=0.005, loader_ratio=0.99, cores=2)
    assert verdict.bound == "compute"
    assert "can stay as they are" not in verdict.change and "L2 served 46% (want > 70%)" in verdict.change
    good = judge(figures, {"L2": l2(0.95)}, dry_run_step_s=0.005, loader_ratio=0.99, cores=2)
    assert good.bound == "compute" and "the caches can stay as they are" in good.change


def test_the_image_demos_figures_never_recommend_more_workers_than_cores():
    # demo --images printed: a batch takes 25 ms against a 5 ms step, and "num_workers=6" on 2 cores
    figures = loader(bubble=0.6, produce_s=0.025, stall_s={"prep": 1.5})
    verdict = judge(figures, dry_run_step_s=0.005, loader_ratio=0.35, cores=2)
    assert verdict.bound == "preprocessing"
    assert "num_workers=1" in verdict.change and "num_workers=6" not in verdict.change
    assert "num_workers=6" in judge(figures, dry_run_step_s=0.005, loader_ratio=0.35, cores=16).change
    already = judge(figures, dry_run_step_s=0.005, loader_ratio=0.35, cores=2, workers=1)
    assert "num_workers" not in already.change and "cheaper" in already.change


def test_bytes_per_epoch_of_a_run_shorter_than_an_epoch_is_not_extrapolated():
    # tierflow bench --steps 300 printed "2.45x the dataset over 0.0 epochs"
    short = BytesPerEpoch(measured=2.45, predicted=2.5, optimum=2.0, epochs=0.04).describe()
    assert "0.10x the dataset in 0.04 of an epoch" in short and "0.0 epochs" not in short and "2.45" not in short
    whole = BytesPerEpoch(measured=0.78, predicted=0.78, optimum=0.75, epochs=3.0).describe()
    assert whole == "per epoch: 0.78x the dataset over 3.0 epochs (plan 0.78x; optimum with the same room 0.75x)"
