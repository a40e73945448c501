"""Automatic policy choice from the job's lifecycle, with the reason stated for telemetry.

The right policy follows how the data is read: single pass -> stream; known order ->
clairvoyant; every entry read once per epoch in a fresh order -> nochurn; skewed,
shared or unknown access -> hotscore.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from tierflow.policies.base import CachePolicy, EntryStats, NextUseOracle
from tierflow.policies.clairvoyant import ClairvoyantPolicy
from tierflow.policies.hotscore import HotScorePolicy
from tierflow.policies.nochurn import NoChurnPolicy
from tierflow.policies.stream import StreamPolicy

#: what `auto` chooses among (by name, as choose_policy answers)
_CHOICES: dict[str, type[CachePolicy]] = {
    "hotscore": HotScorePolicy,
    "stream": StreamPolicy,
    "nochurn": NoChurnPolicy,
    "clairvoyant": ClairvoyantPolicy,
}

Pattern = Literal["reshuffle", "skewed", "unknown"]

STREAM_DATA_TO_CACHE = 100.0
"""Above this data/cache ratio a reshuffled epoch hits under 1% whatever is kept: just stream."""


@dataclass(frozen=True)
class Lifecycle:
    """What the job knows about how it will read this tier's data.

    passes: epochs planned (1 = single pass, None = unknown). pattern: "reshuffle" when
    every epoch reads every entry once (fresh shuffle or a fixed loop), "skewed" when
    some entries are read far more than others (mixture up-sampling), else "unknown".
    shared: several jobs read through the same tier directory.
    """

    passes: int | None = None
    pattern: Pattern = "unknown"
    shared: bool = False
    data_bytes: int | None = None
    capacity_bytes: int | None = None


def choose_policy(lifecycle: Lifecycle, has_oracle: bool) -> tuple[str, str]:
    """The policy name for a lifecycle and the short reason telemetry shows."""
    if lifecycle.shared:
        return "hotscore", "shared by several jobs: no single future order, rank by heat"
    if lifecycle.passes == 1:
        return "stream", "single pass: no entry is read twice, drop after use"
    if lifecycle.pattern == "reshuffle":
        # before the oracle: a fresh shuffle makes every non-resident entry equally likely next,
        # so what a known order can add over keeping the resident set is small, and its churn is not
        data, capacity = lifecycle.data_bytes, lifecycle.capacity_bytes
        if data and capacity and data >= STREAM_DATA_TO_CACHE * capacity:
            return "stream", f"data is {data / capacity:.0f}x the cache: caching buys under 1%"
        return "nochurn", "every entry read once per epoch in a fresh order: keep what is cached"
    if has_oracle:
        return "clairvoyant", "future order known: evict the entry needed furthest ahead"
    if lifecycle.pattern == "skewed":
        return "hotscore", "skewed reads without a known order: keep the hottest entries"
    return "hotscore", "unknown future: rank by decayed frequency"


class AutoPolicy(CachePolicy):
    """Delegates to the policy `choose_policy` picks; re-picks when the oracle changes.

    A change of pick moves every resident, with its statistics and pins, to the new policy.
    """

    name = "auto"

    def __init__(
        self,
        lifecycle: Lifecycle | None = None,
        oracle: NextUseOracle | None = None,
        half_life: float = 1.0,
        co_weight: float = 0.3,
    ) -> None:
        super().__init__()
        self.lifecycle = lifecycle or Lifecycle()
        self._hotscore_options = {"half_life": half_life, "co_weight": co_weight}
        self._sizes: dict[str, int] = {}
        self._epochs = 0
        self._oracle = oracle
        self.chosen, self.reason = choose_policy(self.lifecycle, oracle is not None)
        self.inner = self._build(self.chosen)

    def _build(self, name: str) -> CachePolicy:
        options: dict[str, Any] = {}
        if name == "hotscore":
            options = dict(self._hotscore_options)
        elif name == "nochurn":
            options = {"epoch": self._epochs}
        policy = _CHOICES[name](**options)
        policy.set_oracle(self._oracle)
        return policy

    def describe(self) -> str:
        """'<policy>: <reason>', for telemetry."""
        return f"{self.chosen}: {self.reason}"

    def set_lifecycle(self, lifecycle: Lifecycle) -> None:
        """What the reader declares about how it reads (the tier stack passes it on)."""
        self.lifecycle = lifecycle
        self.set_oracle(self._oracle)

    def set_oracle(self, oracle: NextUseOracle | None) -> None:
        self._oracle = oracle
        chosen, reason = choose_policy(self.lifecycle, oracle is not None)
        if chosen == self.chosen:
            self.reason = reason
            self.inner.set_oracle(oracle)
            return
        old, new = self.inner, self._build(chosen)
        for key, size in self._sizes.items():
            new.restore(key, size, old.stats(key))
            for _ in range(old.pin_count(key)):
                new.pin(key)
        new.set_oracle(oracle)
        self.inner, self.chosen, self.reason = new, chosen, reason

    def admit(self, key: str, size: int, now: float, free_bytes: int) -> bool:
        return self.inner.admit(key, size, now, free_bytes)

    def admit_read(self, key: str, size: int, now: float, free_bytes: int) -> bool:
        return self.inner.admit_read(key, size, now, free_bytes)

    def on_insert(self, key: str, size: int, now: float) -> None:
        self._sizes[key] = size
        self.inner.on_insert(key, size, now)

    def on_access(self, key: str, now: float) -> None:
        self.inner.on_access(key, now)

    def on_remove(self, key: str) -> None:
        self.inner.on_remove(key)
        del self._sizes[key]

    def victim(self, now: float) -> str | None:
        return self.inner.victim(now)

    def on_epoch_end(self, now: float) -> None:
        self._epochs += 1
        self.inner.on_epoch_end(now)

    def stats(self, key: str) -> EntryStats:
        return self.inner.stats(key)

    def restore(self, key: str, size: int, stats: EntryStats) -> None:
        self._sizes[key] = size
        self.inner.restore(key, size, stats)

    def pin(self, key: str) -> None:
        self.inner.pin(key)

    def unpin(self, key: str, now: float | None = None) -> None:
        self.inner.unpin(key, now)

    def is_pinned(self, key: str) -> bool:
        return self.inner.is_pinned(key)

    def pin_count(self, key: str) -> int:
        return self.inner.pin_count(key)

    @property
    def pinned_count(self) -> int:
        return self.inner.pinned_count

    def __contains__(self, key: object) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def _withdraw(self, key: str) -> None:  # pins live in the inner policy
        raise AssertionError("auto delegates pinning to its inner policy")

    def _reinstate(self, key: str, now: float) -> None:
        raise AssertionError("auto delegates pinning to its inner policy")
