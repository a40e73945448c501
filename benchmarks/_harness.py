"""What the benchmarks share: the "median (min-max)" cell."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def spread(values: Sequence[float], digits: int = 1) -> str:
    """The median of `values` and their spread: "12.3 (11.0-14.1)"."""
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"
