"""Fair shares of a tier read by several datasets at once, so no job on the node starves another.

Why: each job's policy knows only its own future. A job that filled the node's L2 first keeps it
under `nochurn` (what is cached stays), and a second job on another dataset then caches nothing
and fetches every epoch in full; a clairvoyant job sees the other's entries as never needed and
evicts them first. The tier is the one place that sees both, so it divides the room: while live
processes read D datasets through the tier, each dataset's share is capacity / D. A dataset below
its share may claim room from datasets above theirs (their least recently read entries) even when
its own policy would decline; a policy's victim from another dataset at or below its share is
passed over. Within its share each job's policy decides as before. Datasets no live process reads
have no share: their entries go first when room is claimed. Entries are content-addressed, so one
shard of two datasets counts for the dataset that admitted it.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from typing import Protocol


class Resident(Protocol):
    """What a space decision knows of a resident entry (a tier's index row, a simulation's entry)."""

    @property
    def key(self) -> str: ...

    @property
    def size(self) -> int: ...

    @property
    def dataset(self) -> str | None: ...

    @property
    def last_access(self) -> float: ...


class FairShare:
    """One space decision's view of the shares: bytes resident per dataset against capacity / readers."""

    def __init__(self, rows: Mapping[str, Resident], readers: AbstractSet[str], mine: str, capacity: int) -> None:
        self.mine = mine
        self.readers = readers | {mine}
        self.share = capacity // len(self.readers)
        self.usage: dict[str | None, int] = {}
        for row in rows.values():
            self.usage[row.dataset] = self.usage.get(row.dataset, 0) + row.size
        self.rows: dict[str, Resident] = dict(rows)

    @classmethod
    def of(
        cls, rows: Mapping[str, Resident], readers: AbstractSet[str], mine: str | None, capacity: int
    ) -> FairShare | None:
        """The shares, or None when the tier holds and serves only `mine` (or none is named)."""
        if mine is None or not (readers - {mine} or any(r.dataset != mine for r in rows.values())):
            return None
        return cls(rows, readers, mine, capacity)

    def under_share(self, size: int) -> bool:
        """Whether `mine` would still be within its share with `size` more bytes."""
        return self.usage.get(self.mine, 0) + size <= self.share

    def _claimable(self, row: Resident) -> bool:
        return row.dataset != self.mine and (
            row.dataset not in self.readers or self.usage.get(row.dataset, 0) > self.share
        )

    def claim(self, skip: set[str]) -> str | None:
        """The entry `mine` takes room from: the least recently read of a dataset over its share (or
        read by no one), not in `skip`; None when there is none."""
        candidates = [r for r in self.rows.values() if r.key not in skip and self._claimable(r)]
        if not candidates:
            return None
        return min(candidates, key=lambda r: (r.dataset in self.readers, r.last_access)).key

    def protected(self, key: str) -> bool:
        """Whether evicting `key` would take room from another dataset that is within its share."""
        row = self.rows[key]
        return row.dataset != self.mine and row.dataset in self.readers and self.usage.get(row.dataset, 0) <= self.share

    def removed(self, key: str) -> None:
        row = self.rows.pop(key)
        self.usage[row.dataset] -= row.size
