"""`tierflow demo --images` (issue 16, item 5): photographs -> byte-exact shards -> decoded,
augmented batches through a throttled L4 -> a tiny CNN whose loss falls, and a report."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("matplotlib", reason="the demo cuts its corpus from matplotlib's sample photographs")


@pytest.mark.slow
def test_the_images_demo_packs_byte_exact_trains_and_reports(tmp_path):
    from rich.console import Console

    from tierflow.commands.demo_images import run_images_demo

    result = run_images_demo(
        tmp_path / "demo", images=160, epochs=1, train_steps=30, step_ms=2.0, console=Console(quiet=True)
    )
    assert result["samples"] == 160
    losses = result["losses"]
    assert np.mean(losses[-5:]) < 0.5 * losses[0]
    assert (tmp_path / "demo" / "report.png").stat().st_size > 0
