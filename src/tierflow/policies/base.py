"""The cache policy interface: what a tier tells a policy, and what the policy decides.

A policy ranks the entries of one cache directory. It is told about insertions,
accesses and removals, decides admission and names victims; the byte accounting
belongs to its caller (a tier, or `tierflow.policies.cache.Cache`). Time `now` is
always passed in by the caller, so a policy never reads a clock and a simulation
replays exactly.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Protocol, runtime_checkable

EntryStats = dict[str, Any]
"""A small JSON-able dict a tier stores per entry and hands back to `restore` after a restart."""

TIME_STATS = ("last_access",)
"""The EntryStats fields that are times of the tier's clock (every policy here names its time so)."""


def rebase_stats(stats: EntryStats, shift: float) -> EntryStats:
    """`stats` moved `shift` along the clock: what they are on another clock (a restart, another
    node) whose now is `shift` later. Every time moves alike, so a ranking by recency or decayed
    frequency (hot score's is shift-invariant) is unchanged against what is read from now on."""
    return {k: (float(v) + shift if k in TIME_STATS and isinstance(v, (int, float)) else v) for k, v in stats.items()}


@runtime_checkable
class NextUseOracle(Protocol):
    """Knows the future: when an entry is next needed, given the current logical position."""

    def next_use(self, key: str, now: float) -> float:
        """The position of the next use after `now`; `now` itself while the entry is in use;
        `math.inf` when it is never used again."""
        ...

    def use_after_current(self, key: str, now: float) -> float:
        """The start of the next use after the one in progress at `now` (or next_use if none is)."""
        ...


class CachePolicy(ABC):
    """A swappable eviction and admission rule for one cache directory.

    Pinned entries (pin counts, so two pins need two unpins) are withdrawn from the
    ranking, so `victim()` never names one and returns None when every resident is pinned.
    Subclasses implement the ranking and the `_withdraw`/`_reinstate` hooks.
    """

    name: ClassVar[str] = "policy"

    def __init__(self) -> None:
        self._pins: dict[str, int] = {}
        self._oracle: NextUseOracle | None = None
        self._latest = -math.inf

    # --- what the tier tells the policy -------------------------------------------------
    def admit(self, key: str, size: int, now: float, free_bytes: int) -> bool:
        """Whether a missed entry should be cached; `free_bytes` says if room must be made."""
        return True

    def admit_read(self, key: str, size: int, now: float, free_bytes: int) -> bool:
        """Whether an entry a reader needs now should be cached, or read from below this once
        (the reader holds it in memory for its use). By default it is cached; a policy that
        knows what it keeps is worth more says no."""
        return True

    @abstractmethod
    def on_insert(self, key: str, size: int, now: float) -> None:
        """The entry is now resident."""

    @abstractmethod
    def on_access(self, key: str, now: float) -> None:
        """A resident entry was read (a hit)."""

    @abstractmethod
    def on_remove(self, key: str) -> None:
        """The entry left the cache (evicted, deleted or invalidated)."""

    @abstractmethod
    def victim(self, now: float) -> str | None:
        """The unpinned resident to evict next, or None when every resident is pinned."""

    def on_epoch_end(self, now: float) -> None:  # noqa: B027 - a hook: most policies ignore epochs
        """An epoch of the caller's order ended; policies that care about epochs override this."""

    def set_oracle(self, oracle: NextUseOracle | None) -> None:
        """Give (or replace, or withdraw) the next-use oracle; policies that use it override this."""
        self._oracle = oracle

    @property
    def oracle(self) -> NextUseOracle | None:
        return self._oracle

    # --- restart ------------------------------------------------------------------------
    @abstractmethod
    def stats(self, key: str) -> EntryStats:
        """The entry's statistics as a small JSON-able dict, for the tier to persist."""

    @abstractmethod
    def restore(self, key: str, size: int, stats: EntryStats) -> None:
        """Re-seed a resident entry after a restart from what `stats` exported.

        Stats from another policy are accepted: missing fields take neutral defaults.
        """

    # --- residency ----------------------------------------------------------------------
    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...

    # --- pinning ------------------------------------------------------------------------
    def pin(self, key: str) -> None:
        """Protect a resident entry from eviction while it is in use (counted)."""
        if key not in self:
            raise KeyError(f"{self.name}: cannot pin {key!r}: not resident")
        count = self._pins.get(key, 0)
        self._pins[key] = count + 1
        if count == 0:
            self._withdraw(key)

    def unpin(self, key: str, now: float | None = None) -> None:
        """Release one pin; the last release makes the entry evictable again."""
        count = self._pins.get(key, 0)
        if count == 0:
            raise KeyError(f"{self.name}: cannot unpin {key!r}: not pinned")
        if count > 1:
            self._pins[key] = count - 1
            return
        del self._pins[key]
        self._reinstate(key, self._latest if now is None else now)

    def is_pinned(self, key: str) -> bool:
        return key in self._pins

    def pin_count(self, key: str) -> int:
        return self._pins.get(key, 0)

    @property
    def pinned_count(self) -> int:
        """How many entries are pinned now (in use alongside each other)."""
        return len(self._pins)

    def _forget_pins(self, key: str) -> None:
        if key in self._pins:
            raise ValueError(f"{self.name}: cannot remove {key!r}: it is pinned")

    def _observe(self, now: float) -> None:
        if now > self._latest:
            self._latest = now

    @abstractmethod
    def _withdraw(self, key: str) -> None:
        """Take a newly pinned entry out of the eviction ranking."""

    @abstractmethod
    def _reinstate(self, key: str, now: float) -> None:
        """Put a fully unpinned entry back into the eviction ranking."""
