"""Admission: what a cache of bounded bytes keeps, as bookkeeping only (no files, no index).

Why here, below the tiers: a tier directory (`tiers/tier.py`), the policy simulator
(`policies/simulator.py`) and `tierflow plan`'s forecast (`tiers/forecast.py`) must decide alike,
or a simulation scores a cache that never runs. So the decision exists once: whether an entry is
worth its room (`admit` for a prefetch, `admit_read` for an entry a reader needs now), the fair
share of each dataset read through the cache (policies/fairshare.py), and which residents make
room, passing over those in use. The caller owns the residents and their bytes (a tier's index,
a simulation's dict) and removes a victim's bytes itself (`remove`), saying when it cannot
because the entry is in use.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from tierflow.policies.base import CachePolicy, EntryStats, NextUseOracle
from tierflow.policies.fairshare import FairShare, Resident


class StoredResident(Resident, Protocol):
    """A resident whose policy statistics were saved (a tier's index row), to restore a policy from."""

    @property
    def stats(self) -> EntryStats: ...


class Refusal(Enum):
    """Why an entry was not given room."""

    DECLINED = "declined"
    """Larger than the cache, or the policy judged it not worth its room."""
    IN_USE = "in_use"
    """Room could not be made: every resident is in use (or another dataset's within its share)."""


@dataclass(slots=True)
class Admission:
    """One space decision: admitted or why not, and the residents evicted on the way (evictions made
    before room ran out stand)."""

    refused: Refusal | None = None
    evicted: list[Resident] = field(default_factory=list)

    @property
    def admitted(self) -> bool:
        return self.refused is None


class AdmissionController:
    """One cache's policy and its space decisions. Thread-safe under `lock` (held by the caller
    across a decision and the writes that record it).

    The policy lives as long as the controller, so a policy with memory beyond the residents
    (hotscore's history of evicted keys) keeps it; `sync` makes it agree with residents that
    others (another process sharing a tier) admitted or removed.
    """

    def __init__(self, make_policy: Callable[[], CachePolicy]) -> None:
        self.make_policy = make_policy
        """What makes the live policy (and a scratch one); replaced when the policy's options change."""
        self._live: CachePolicy | None = None
        self._known: set[str] = set()
        self.oracle: NextUseOracle | None = None
        self.lock = threading.RLock()

    def _new_policy(self) -> CachePolicy:
        policy = self.make_policy()
        if self.oracle is not None:
            policy.set_oracle(self.oracle)
        return policy

    @property
    def policy(self) -> CachePolicy:
        """The live policy, made on first use."""
        if self._live is None:
            self._live = self._new_policy()
        return self._live

    @property
    def live(self) -> CachePolicy | None:
        """The live policy if one was made yet (a look at a tier makes none)."""
        return self._live

    def set_oracle(self, oracle: NextUseOracle | None) -> None:
        """The known future (from the order), for the clairvoyant and auto policies."""
        self.oracle = oracle
        if self._live is not None:
            self._live.set_oracle(oracle)

    def knows(self, key: str) -> bool:
        return self._live is not None and key in self._known

    # ------------------------------------------------------------ residents
    def sync(self, residents: Mapping[str, StoredResident]) -> CachePolicy:
        """The live policy, made to agree with `residents`: entries it does not know are restored from
        their saved statistics, entries gone are dropped (no policy pin is held outside `reserve`)."""
        policy = self.policy
        for key in [k for k in self._known if k not in residents]:
            policy.on_remove(key)
            self._known.discard(key)
        for row in residents.values():
            if row.key not in self._known:
                policy.restore(row.key, row.size, row.stats)
                self._known.add(row.key)
        return policy

    def inserted(self, key: str, size: int, now: float) -> None:
        """The entry is resident now."""
        self.policy.on_insert(key, size, now)
        self._known.add(key)

    def accessed(self, key: str, size: int, stats: EntryStats, now: float) -> EntryStats:
        """A resident was read at `now`; its statistics after. An entry the live policy does not know
        yet (admitted by another process since the last decision) is ranked on a scratch policy."""
        if self.knows(key):
            self.policy.on_access(key, now)
            return self.policy.stats(key)
        scratch = self._new_policy()
        scratch.restore(key, size, stats)
        scratch.on_access(key, now)
        return scratch.stats(key)

    def restored(self, key: str, size: int, stats: EntryStats) -> None:
        """A resident's saved statistics (a restart, a checkpoint's heat) take the place of its own."""
        self.policy.restore(key, size, stats)
        self._known.add(key)

    def removed(self, key: str) -> None:
        """A resident left (deleted, or its admission undone)."""
        if self._live is not None and key in self._known:
            self._live.on_remove(key)
            self._known.discard(key)

    # ------------------------------------------------------------ space
    def reserve(
        self,
        residents: Mapping[str, Resident],
        key: str,
        size: int,
        now: float,
        capacity: int,
        used: int,
        *,
        required: bool,
        extra: int = 0,
        dataset: str | None = None,
        readers: AbstractSet[str] = frozenset(),
        remove: Callable[[str], bool] | None = None,
    ) -> Admission:
        """Whether `key` (`size` bytes) gets room in a cache of `capacity` with `used` bytes taken,
        evicting victims through `remove` (False: in use, passed over for this decision; None: the
        caller's ledger holds no files, and what is in use is pinned in the policy).

        A reader's entry is `required`: it is read now, so the policy says only whether it is worth
        keeping (`admit_read`; if not, it is read from below this once); a prefetch asks whether it
        is worth its room (`admit`). With other datasets read through the cache (`readers`), the
        entry's `dataset` is held to its fair share: below it, it claims room from datasets above
        theirs even where the policy declines; it never takes another's below. `extra` bytes more
        are freed than the entry needs (a full device's retry). The policy must know `residents`
        (`sync`); the caller records the entry (`inserted`) once its bytes are in place.
        """
        if size > capacity:
            return Admission(Refusal.DECLINED)
        policy = self.policy
        fair = None if dataset is None else FairShare.of(residents, readers, dataset, capacity)
        decide = policy.admit_read if required else policy.admit
        if not decide(key, size, now, capacity - used) and not (
            fair is not None and fair.under_share(size) and fair.claim(set()) is not None
        ):
            return Admission(Refusal.DECLINED)
        held: list[str] = []
        try:
            return self._make_room(policy, residents, size, extra, used, capacity, now, held, fair, remove)
        finally:  # the policy pins of this decision go with it: none is held outside `reserve`
            for victim in held:
                policy.unpin(victim, now)

    def _make_room(
        self,
        policy: CachePolicy,
        residents: Mapping[str, Resident],
        size: int,
        extra: int,
        used: int,
        capacity: int,
        now: float,
        held: list[str],
        fair: FairShare | None,
        remove: Callable[[str], bool] | None,
    ) -> Admission:
        """Evict victims until the entry fits; those in use are skipped via `held`. Under a fair
        share, a dataset below its share takes its victims from those above theirs first."""
        admission = Admission()
        in_use: set[str] = set()
        while used + size + extra > capacity:
            victim = fair.claim(in_use) if fair is not None and fair.under_share(size) else None
            if victim is None:
                victim = policy.victim(now)
                if victim is None:  # every resident is in use (or another dataset's fair share)
                    admission.refused = Refusal.IN_USE
                    return admission
                if fair is not None and fair.protected(victim):
                    policy.pin(victim)  # another dataset's, within its share: not ours to take
                    held.append(victim)
                    continue
            if remove is not None and not remove(victim):
                # in use: skip it for this decision (a victim is never one pinned already: the
                # policy names none, and a fair claim takes none a share protects)
                in_use.add(victim)
                policy.pin(victim)
                held.append(victim)
                continue
            if fair is not None:
                fair.removed(victim)
            row = residents[victim]
            policy.on_remove(victim)
            self._known.discard(victim)
            used -= row.size
            extra = max(0, extra - row.size)
            admission.evicted.append(row)
        return admission
