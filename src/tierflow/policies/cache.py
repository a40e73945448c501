"""A byte-bounded cache model: one policy plus the capacity accounting a tier does.

The simulator drives policies through this class, and a tier directory can call it
the same way (its files being the entries), so what the simulator scores is what runs.
"""

from __future__ import annotations

from collections.abc import Callable

from tierflow.policies.base import CachePolicy


class Cache:
    """Admits, evicts and accounts bytes for one policy, never above `capacity_bytes`.

    `access` is the whole read path of one request: a hit, or a miss that the policy may
    admit. `required=True` means the entry must be cached to be read (an in-use shard
    that is memory-mapped from the tier), so the policy's admission is not asked; the
    entry is still served uncached when every resident is pinned. Victims are evicted one
    at a time until the entry fits; if the policy runs out of victims on the way, the
    entry is served uncached and the evictions made stand.
    """

    def __init__(self, policy: CachePolicy, capacity_bytes: int,
                 on_evict: Callable[[str], None] | None = None) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"cache capacity must be >= 0 bytes, got {capacity_bytes}")
        self.policy = policy
        self.capacity_bytes = int(capacity_bytes)
        self.used_bytes = 0
        self.evictions = 0
        self._sizes: dict[str, int] = {}
        self._on_evict = on_evict

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    def __contains__(self, key: object) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def size_of(self, key: str) -> int:
        return self._sizes[key]

    def access(self, key: str, size: int, now: float, *, required: bool = False) -> bool:
        """Read `key` at `now`; True on a hit. On a miss, cache it if admitted and room is made."""
        if key in self._sizes:
            self.policy.on_access(key, now)
            return True
        if size < 0:
            raise ValueError(f"entry {key!r} has a negative size {size}")
        if size > self.capacity_bytes:
            return False
        if not required and not self.policy.admit(key, size, now, self.free_bytes):
            return False
        while self.used_bytes + size > self.capacity_bytes:
            victim = self.policy.victim(now)
            if victim is None:
                return False
            self.remove(victim)
            self.evictions += 1
            if self._on_evict is not None:
                self._on_evict(victim)
        self._sizes[key] = size
        self.used_bytes += size
        self.policy.on_insert(key, size, now)
        return False

    def remove(self, key: str) -> None:
        """Drop a resident entry (eviction, deletion or invalidation)."""
        self.policy.on_remove(key)
        self.used_bytes -= self._sizes.pop(key)

    def pin(self, key: str) -> None:
        self.policy.pin(key)

    def unpin(self, key: str, now: float | None = None) -> None:
        self.policy.unpin(key, now)

    def end_epoch(self, now: float) -> None:
        self.policy.on_epoch_end(now)

    def restore(self, key: str, size: int, stats: dict) -> None:
        """Re-seed an entry found on disk after a restart, with its saved statistics."""
        if key in self._sizes:
            raise ValueError(f"cannot restore {key!r}: already resident")
        self._sizes[key] = size
        self.used_bytes += size
        self.policy.restore(key, size, stats)
