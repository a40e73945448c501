"""A byte-bounded cache in memory: the residents and bytes a tier's index keeps, for simulations.

The simulator and `tierflow plan`'s forecast drive a policy through this class; its decisions are
the tier's own (`AdmissionController`, policies/admission.py), so what a simulation scores is what
runs. Only the ledger differs: a dict here, files and an index in a tier.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tierflow.policies.admission import AdmissionController
from tierflow.policies.base import CachePolicy, EntryStats


@dataclass(slots=True)
class CachedEntry:
    """One resident of a simulated cache (of one dataset: no fair share to keep)."""

    key: str
    size: int
    last_access: float
    dataset: str | None = None


class Cache:
    """Admits, evicts and accounts bytes for one policy, never above `capacity_bytes`.

    `access` is the whole read path of one request: a hit, or a miss that may be admitted, as a
    tier decides it. `required=True` is a reader's entry (read now, in use while it is read): the
    policy's `admit_read` says whether it is worth keeping, else it is served uncached this once;
    otherwise (a prefetch) `admit` says whether it is worth its room. Victims are evicted one at a
    time until the entry fits; if the policy runs out of victims on the way (every resident
    pinned), the entry is served uncached and the evictions made stand.
    """

    def __init__(self, policy: CachePolicy, capacity_bytes: int, on_evict: Callable[[str], None] | None = None) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"cache capacity must be >= 0 bytes, got {capacity_bytes}")
        self.policy = policy
        self.admission = AdmissionController(lambda: policy)
        self.capacity_bytes = int(capacity_bytes)
        self.used_bytes = 0
        self.evictions = 0
        self._entries: dict[str, CachedEntry] = {}
        self._on_evict = on_evict

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def size_of(self, key: str) -> int:
        return self._entries[key].size

    def access(self, key: str, size: int, now: float, *, required: bool = False) -> bool:
        """Read `key` at `now`; True on a hit. On a miss, cache it if admitted and room is made."""
        entry = self._entries.get(key)
        if entry is not None:
            self.policy.on_access(key, now)
            entry.last_access = now
            return True
        if size < 0:
            raise ValueError(f"entry {key!r} has a negative size {size}")
        admission = self.admission.reserve(
            self._entries, key, size, now, self.capacity_bytes, self.used_bytes, required=required
        )
        for victim in admission.evicted:
            self.used_bytes -= self._entries.pop(victim.key).size
            self.evictions += 1
            if self._on_evict is not None:
                self._on_evict(victim.key)
        if admission.admitted:
            self._entries[key] = CachedEntry(key, size, now)
            self.used_bytes += size
            self.admission.inserted(key, size, now)
        return False

    def remove(self, key: str) -> None:
        """Drop a resident entry (deletion or invalidation)."""
        self.admission.removed(key)
        self.used_bytes -= self._entries.pop(key).size

    def pin(self, key: str) -> None:
        self.policy.pin(key)

    def unpin(self, key: str, now: float | None = None) -> None:
        self.policy.unpin(key, now)

    def end_epoch(self, now: float) -> None:
        self.policy.on_epoch_end(now)

    def restore(self, key: str, size: int, stats: EntryStats) -> None:
        """Re-seed an entry found on disk after a restart, with its saved statistics."""
        if key in self._entries:
            raise ValueError(f"cannot restore {key!r}: already resident")
        self._entries[key] = CachedEntry(key, size, float(stats.get("last_access", 0.0)))
        self.used_bytes += size
        self.admission.restored(key, size, stats)
