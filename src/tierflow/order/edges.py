"""The epoch-major edge (order cursor version 3, remainder="carry"): a node reads an epoch, then the next.

Why: version 2 cut each lane's walk into batches of B straight across its epoch edges, so with `a`
lanes up to `a` node batches held samples of two epochs, and a `for` over one epoch was not one
epoch. Here a lane's epoch e is read as its head (samples the previous epoch's last batch took),
then whole batches of B (its body, interleaved with the other lanes' bodies by the proportional
keys of interleave.py), then its tail (< B). After every body batch of e the tails, in lane order,
are pooled into the node's last batches of e; the pool's remainder, if any, is filled with the
first samples of the next epoch (the heads, lanes in order), so at most one node batch holds two
epochs at each edge (more only when a batch is larger than the node's epoch).

Everything derives from the lanes' positions at the cursor (their epoch clocks): a lane with fewer
than B samples left in its epoch is in the pool, and a cursor always stands between batches, so
the rule continues exactly after any resume.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast
from collections.abc import Sequence

from tierflow.order.interleave import LaneSchedule, ScheduleWalker
from tierflow.order.lanes import Lane, LaneBatches, Positions


@dataclass(frozen=True)
class Piece:
    """Offsets [start, stop) of a lane's epoch `epoch` that a batch reads."""

    lane: int
    epoch: int
    start: int
    stop: int


class _EpochBodies:
    """A lane's body batches in one epoch, as `LaneSchedule` merges them: batch i starts at lane
    position epoch * size + first + i * B; a batch past the body keys after every real one."""

    def __init__(self, lane: Lane, epoch: int, first: int, count: int, batch_size: int) -> None:
        self.lane = lane
        self.base = epoch * lane.size + first
        self.count = count
        self.batch_size = batch_size
        self.beyond = (epoch + 2) * lane.size

    def start(self, i: int) -> int:
        return self.base + i * self.batch_size if i < self.count else self.beyond

    def count_before(self, position: int) -> int:
        return min(self.count, max(0, -(-(position - self.base) // self.batch_size)))


@dataclass
class EpochPlan:
    """One stage of a node (an epoch; in a narrowed first epoch, one lane group's part of it): `picks`
    batches from `first_pick`, the bodies merged, then the pool's batches, the last one completed by
    `mixed` heads of later stages. `starts`: where each lane's body starts (its heads taken)."""

    epoch: int
    group: int
    index: int
    first_pick: int
    starts: list[int]
    bodies: list[int]
    pool: list[Piece]
    pool_size: int
    schedule: LaneSchedule
    head_pick: int = -1
    mixed: list[Piece] = field(default_factory=list)

    @property
    def body_picks(self) -> int:
        return sum(self.bodies)

    def picks(self, batch_size: int) -> int:
        return self.body_picks + -(-self.pool_size // batch_size)


class EpochEdges:
    """A node's batches under the epoch-major edge, from its lanes' positions at a cursor."""

    def __init__(
        self, lanes: Sequence[Lane], bases: Sequence[Positions], batch_size: int, groups: list[int] | None
    ) -> None:
        self.lanes = list(lanes)
        self.bases = list(bases)
        self.batch_size = batch_size
        self.groups = groups
        self.first_epochs = self._first = [min(e for e, _ in base.values()) for base in self.bases]
        self._last = [max(e for e, _ in base.values()) for base in self.bases]
        self.plans: list[EpochPlan] = []
        self._index: dict[tuple[int, int], int] = {}
        self._located = 0  # the stage the last pick was found in: where the next search starts
        self._pending: tuple[EpochPlan, int] | None = None  # the plan whose last batch still needs samples
        self._reading: dict[int, ScheduleWalker] = {}
        self._counting: dict[int, ScheduleWalker] = {}
        self._walk_starts: dict[tuple[int, int], int] = {}  # (lane, epoch) -> walk_index at offset 0

    # lane clocks: (epoch, samples of it read) and the walk position (samples read from the cursor)

    def _done_at(self, lane: int, epoch: int) -> int:
        """Samples of the lane's epoch `epoch` already read when it starts (partitions ahead)."""
        sizes = self.lanes[lane].sizes
        return sum(sizes[p] if e > epoch else o if e == epoch else 0 for p, (e, o) in self.bases[lane].items())

    def available(self, lane: int, epoch: int) -> int:
        """Where the lane's epoch `epoch` starts to be read from the cursor (its size: nothing left)."""
        return self.lanes[lane].size if epoch < self._first[lane] else self._done_at(lane, epoch)

    def walk_index(self, lane: int, epoch: int, offset: int) -> int:
        """Samples the lane reads from the cursor before offset `offset` of its epoch `epoch`."""
        if epoch < self._first[lane]:
            return 0
        before = self._walk_starts.get((lane, epoch))
        if before is None:  # the bases never change: once per (lane, epoch), not once per batch
            first, last, size = self._first[lane], self._last[lane], self.lanes[lane].size
            before = sum(size - self._done_at(lane, e) for e in range(first, min(epoch, last + 1)))
            before += max(0, epoch - last - 1) * size - self._done_at(lane, epoch)
            if len(self._walk_starts) > 4096:
                self._walk_starts.clear()
            self._walk_starts[(lane, epoch)] = before
        return before + offset

    def clock_of(self, lane: int, walked: int) -> tuple[int, int]:
        """(epoch, offset) of the lane's sample at walk position `walked`."""
        size, epoch = self.lanes[lane].size, self._first[lane]
        while epoch <= self._last[lane]:
            done = self._done_at(lane, epoch)
            if walked < size - done:
                return epoch, done + walked
            walked -= size - done
            epoch += 1
        return epoch + walked // size, walked % size

    # plans: one stage per epoch, or per lane group in a narrowed first epoch (each group's pool at its end)

    def _stage_after(self, epoch: int, group: int) -> tuple[int, int]:
        if epoch == 0 and self.groups is not None and group + 1 <= max(self.groups):
            return 0, group + 1
        return epoch + 1, -1

    def _first_stage(self, epoch: int) -> tuple[int, int]:
        return (0, 0) if epoch == 0 and self.groups is not None else (epoch, -1)

    def _at(self, index: int) -> EpochPlan:
        while len(self.plans) <= index:
            self._extend()
        return self.plans[index]

    def plan(self, epoch: int, group: int = -1) -> EpochPlan:
        """The stage of node epoch `epoch` (>= the first one the cursor stands in): its first one, or
        that of lane group `group` in a narrowed first epoch."""
        key = (0, group) if epoch == 0 and self.groups is not None and group >= 0 else self._first_stage(epoch)
        while key not in self._index:
            self._extend()
        return self.plans[self._index[key]]

    def stage_of(self, lane: int, epoch: int) -> EpochPlan:
        """The stage that reads the lane's epoch `epoch`."""
        return self.plan(epoch, self.groups[lane] if epoch == 0 and self.groups is not None else -1)

    def _extend(self) -> None:
        B = self.batch_size
        previous = self.plans[-1] if self.plans else None
        if previous is None:
            epoch, group = self._first_stage(min(self._first))
        else:
            epoch, group = self._stage_after(previous.epoch, previous.group)
        members = [m for m in range(len(self.lanes)) if group < 0 or self.groups is None or self.groups[m] == group]
        starts = [self.available(m, epoch) for m in range(len(self.lanes))]
        if group >= 0 and self.groups is not None:  # lanes of groups before this one have read their epoch 0
            starts = [lane.size if self.groups[m] < group else s for m, (lane, s) in enumerate(zip(self.lanes, starts))]
        head_pick = -1
        if self._pending is not None:
            owner, wanted = self._pending
            head_pick = owner.first_pick + owner.picks(B) - 1
            for m in members:
                take = min(wanted, self.lanes[m].size - starts[m])
                if take:
                    owner.mixed.append(Piece(m, epoch, starts[m], starts[m] + take))
                    starts[m] += take
                    wanted -= take
            self._pending = (owner, wanted) if wanted else None
        bodies = [(self.lanes[m].size - starts[m]) // B if m in members else 0 for m in range(len(self.lanes))]
        pool = [
            Piece(m, epoch, starts[m] + bodies[m] * B, self.lanes[m].size)
            for m in members
            if starts[m] + bodies[m] * B < self.lanes[m].size
        ]
        pool_size = sum(p.stop - p.start for p in pool)
        # the merge asks a lane's batches only for lane.size, start and count_before, as LaneBatches has them
        bodies_of = [_EpochBodies(lane, epoch, s, n, B) for lane, s, n in zip(self.lanes, starts, bodies)]
        schedule = LaneSchedule(cast("list[LaneBatches]", bodies_of), self.groups)
        first_pick = previous.first_pick + previous.picks(B) if previous is not None else 0
        plan = EpochPlan(
            epoch, group, len(self.plans), first_pick, starts, bodies, pool, pool_size, schedule, head_pick
        )
        self._index[(epoch, group)] = plan.index
        self.plans.append(plan)
        if pool_size % B:  # its last batch waits for the next stage's heads
            self._pending = (plan, B - pool_size % B)

    def locate(self, pick: int) -> EpochPlan:
        """The stage whose batches include node batch `pick`."""
        B = self.batch_size
        plan = self._at(self._located if self.plans and self.plans[self._located].first_pick <= pick else 0)
        while plan.first_pick + plan.picks(B) <= pick:
            plan = self._at(plan.index + 1)
        while self._pending is not None and self._pending[0].index <= plan.index:  # its last batch's heads
            self._extend()
        self._located = plan.index
        return plan

    @staticmethod
    def _walker(walkers: dict[int, ScheduleWalker], plan: EpochPlan) -> ScheduleWalker:
        """The plan's body merge walked forward (one per use, so reading and counting never rewind)."""
        walker = walkers.get(plan.index)
        if walker is None:
            walker = walkers[plan.index] = ScheduleWalker(plan.schedule)
            if len(walkers) > 2:
                del walkers[min(k for k in walkers if k != plan.index)]
        return walker

    def pieces(self, pick: int) -> tuple[int, list[Piece]]:
        """(the batch's epoch, the pieces node batch `pick` reads, in order)."""
        B = self.batch_size
        plan = self.locate(pick)
        local = pick - plan.first_pick
        if local < plan.body_picks:
            lane, i = self._walker(self._reading, plan).pick(local)
            start = plan.starts[lane] + i * B
            return plan.epoch, [Piece(lane, plan.epoch, start, start + B)]
        out = _cut(plan.pool, (local - plan.body_picks) * B, B)
        wanted = B - sum(p.stop - p.start for p in out)
        return plan.epoch, out + (_cut(plan.mixed, 0, wanted) if wanted else [])

    def clocks_after(self, picks: int) -> list[tuple[int, int]]:
        """Each lane's (epoch, offset) once the node has consumed `picks` batches."""
        B = self.batch_size
        plan = self.locate(picks)
        local = picks - plan.first_pick
        if local <= plan.body_picks:
            walker = self._walker(self._counting, plan)
            walker.advance(local)
            return [(plan.epoch, s + c * B) for s, c in zip(plan.starts, walker.counts)]
        clocks = [(plan.epoch, s + n * B) for s, n in zip(plan.starts, plan.bodies)]
        for piece in _cut(plan.pool, 0, (local - plan.body_picks) * B):
            clocks[piece.lane] = (piece.epoch, piece.stop)
        return clocks

    def epoch_counts(self, pick: int) -> list[tuple[int, int]]:
        """(epoch, samples of it) in node batch `pick`, oldest first: a stage's last batch holds the
        pool's samples, then the heads of later stages (`mixed`); every other batch one epoch."""
        B = self.batch_size
        plan = self.locate(pick)
        if pick != plan.first_pick + plan.picks(B) - 1 or not plan.mixed:
            return [(plan.epoch, B)]
        counts: dict[int, int] = {}
        for piece in self.pieces(pick)[1]:
            counts[piece.epoch] = counts.get(piece.epoch, 0) + piece.stop - piece.start
        return sorted(counts.items())

    def pick_of(self, lane: int, epoch: int, offset: int) -> int:
        """The node batch that reads offset `offset` of the lane's epoch `epoch`."""
        plan = self.stage_of(lane, epoch)
        if offset < plan.starts[lane]:
            return plan.head_pick
        i = (offset - plan.starts[lane]) // self.batch_size
        if i < plan.bodies[lane]:
            return plan.first_pick + plan.schedule.pick_of(lane, i)
        before = 0
        for piece in plan.pool:
            if piece.lane == lane:
                return plan.first_pick + plan.body_picks + (before + offset - piece.start) // self.batch_size
            before += piece.stop - piece.start
        raise AssertionError("offset outside the lane's epoch")


def _cut(pieces: list[Piece], skip: int, count: int) -> list[Piece]:
    """Samples [skip, skip + count) of the pieces' concatenation, as pieces."""
    out = []
    for piece in pieces:
        length = piece.stop - piece.start
        if skip >= length:
            skip -= length
            continue
        take = min(count, length - skip)
        if take <= 0:
            break
        out.append(Piece(piece.lane, piece.epoch, piece.start + skip, piece.start + skip + take))
        count -= take
        skip = 0
    return out
