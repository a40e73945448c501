"""Key derivation for the order: splitmix64 mixing of (seed, purpose, indices) into 64-bit keys.

Our own arithmetic, so no library upgrade can change a shuffle that a saved cursor points into.
"""

from __future__ import annotations

import numpy as np

MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB
_ROOT = 0x243F6A8885A308D3
_STR_TAG = 0x5354520000000000

_GOLDEN_U = np.uint64(_GOLDEN)
_MUL1_U = np.uint64(_MUL1)
_MUL2_U = np.uint64(_MUL2)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def splitmix64(value: int) -> int:
    """The splitmix64 finaliser (Steele, Lea, Flood 2014) on a Python int, mod 2^64."""
    z = (value + _GOLDEN) & MASK64
    z = ((z ^ (z >> 30)) * _MUL1) & MASK64
    z = ((z ^ (z >> 27)) * _MUL2) & MASK64
    return z ^ (z >> 31)


def splitmix64_array(values: np.ndarray) -> np.ndarray:
    """splitmix64 over a uint64 array; equals `splitmix64` element by element."""
    z = values.astype(np.uint64, copy=True)
    z += _GOLDEN_U
    z ^= z >> _S30
    z *= _MUL1_U
    z ^= z >> _S27
    z *= _MUL2_U
    z ^= z >> _S31
    return z


def derive_key(*parts: int | str) -> int:
    """Fold integers and strings into one 64-bit key; each int part is `h = splitmix64(h ^ part)`."""
    key = _ROOT
    for part in parts:
        if isinstance(part, str):
            data = part.encode("utf-8")
            key = splitmix64(key ^ _STR_TAG ^ len(data))
            for start in range(0, len(data), 8):
                key = splitmix64(key ^ int.from_bytes(data[start : start + 8], "little"))
        elif isinstance(part, (int, np.integer)):
            value = int(part)
            if not -(1 << 63) <= value < (1 << 64):
                raise ValueError(f"key part {value} does not fit in 64 bits")
            key = splitmix64(key ^ (value & MASK64))
        else:
            raise TypeError(f"key part {part!r} is neither int nor str")
    return key
