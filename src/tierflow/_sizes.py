"""Sizes as people write them (`"50GB"`, `"8G"`, `"512k"`, `1e9`): one parser for tier capacities,
shard sizes and the CLI, below every stage that takes a size."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "k": 1 << 10,
    "m": 1 << 20,
    "g": 1 << 30,
    "t": 1 << 40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
    "b": 1,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_size(text: str | float) -> int:
    """Bytes from `"50GB"` (10^9), `"50GiB"` or `"50G"` (2^30), `"512k"`, `"1e6"` or a number."""
    if isinstance(text, (int, float)):
        return int(text)
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size (like 512MB, 50GiB, 8G or 1e9 bytes)")
    return int(float(match.group(1)) * _UNITS[unit])
