"""Per-sample randomness keyed by (seed, epoch, sample id), the same on every rank and worker.

sample_seed = splitmix64 fold of ("sample", seed, epoch, sample_id) (keys.derive_key): our own
arithmetic, pinned by golden values. sample_rng wraps it in numpy's PCG64 Generator; numpy keeps
PCG64's bit stream stable, while a Generator method's output may change with numpy's own stream
policy, so transforms that must never change should draw from sample_seed(s) directly.
"""

from __future__ import annotations

import functools

import numpy as np

from tierflow.order._keys import MASK64, derive_key, splitmix64, splitmix64_array


@functools.lru_cache(maxsize=64)
def _epoch_key(seed: int, epoch: int) -> int:
    """derive_key's fold of ("sample", seed, epoch): the same for every sample of an epoch, so it is
    folded once, not once per sample (~90 us of string and integer folding)."""
    return derive_key("sample", seed, epoch)


def sample_seed(seed: int, epoch: int, sample_id: int) -> int:
    sample_id = int(sample_id)
    if not -(1 << 63) <= sample_id < (1 << 64):  # derive_key's range and folding of the last part
        raise ValueError(f"key part {sample_id} does not fit in 64 bits")
    return splitmix64(_epoch_key(int(seed), int(epoch)) ^ (sample_id & MASK64))


def sample_seeds(seed: int, epoch: int, sample_ids: np.ndarray) -> np.ndarray:
    """Vectorised sample_seed: uint64 array, equal element by element."""
    base = np.uint64(_epoch_key(int(seed), int(epoch)))
    return splitmix64_array(np.asarray(sample_ids).astype(np.uint64) ^ base)


def sample_rng(seed: int, epoch: int, sample_id: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(sample_seed(seed, epoch, sample_id)))
