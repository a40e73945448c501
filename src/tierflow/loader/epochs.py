"""Where one `for` over a Loader ends: the epoch clock every framework's loop can count on.

A `for` finishes one epoch E: the epoch of its first batch, and at least one past the epoch the
last `for` finished. `len(loader)` is this rank's batches of the whole of E, before and after a
resume (torch's DataLoader convention, which Lightning and the transformers Trainer count on);
`EpochClock.done` of them are consumed. A loop may drain the iterator or stop after `len()`
batches and call `iter()` again: the clock finishes E when its last batch is handed out, so the
next `for` is E + 1 either way.

Batchers that locate batches by position give every rank's count from the order alone, so ranks
agree on where E ends with no collective (`TieredDataset.epoch_span(agree=True)`: the fewest of
any rank; a rank's batches of E past that open its next epoch). A sorted group (LengthBuckets,
AspectBuckets) that straddles the edge is counted by parts: those holding E's last samples end E,
the rest open E + 1 (`RankStream.epoch_parts`), so no `for` holds batches of the next epoch but the
one edge batch of two. A token budget's count depends on lengths not yet planned: there the ranks
vote once per batch (`EpochVote`), and a batch takes the next epoch's samples only as E's last.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from collections.abc import Mapping

import torch


@dataclass
class EpochClock:
    """The epoch last finished (None: none yet) and the batches of the one in progress consumed."""

    finished: int | None = None
    done: int = 0

    def finish(self, epoch: int) -> None:
        self.finished, self.done = epoch, 0

    def to_dict(self) -> dict[str, Any]:
        return {"finished": self.finished, "done": self.done}

    @classmethod
    def parse(cls, state: Mapping[str, Any] | None) -> EpochClock:
        """From `to_dict`; a state saved before the clock existed starts a fresh one."""
        if not state:
            return cls()
        finished, done = state.get("finished"), state.get("done", 0)
        if (finished is not None and type(finished) is not int) or type(done) is not int or done < 0:
            raise ValueError(
                f"a loader state's epoch is {{'finished': int or None, 'done': int >= 0}}, got {dict(state)!r}"
            )
        return cls(finished, done)


class EpochVote:
    """Where a `for` ends when the epoch's length is known only once planned (a token budget): at
    the first batch of a later epoch, held for the next `for`. With `agree`, every rank
    all-reduces one flag per batch over `group` and all stop at the first step where any rank has
    run past the epoch (the batches of it a rank still holds open its next `for`). Under
    NCCL each vote is a device all-reduce read back by the CPU: pass the Loader `group=` a gloo
    group to keep the votes off the GPU."""

    def __init__(self, agree: bool, group: Any = None) -> None:
        self.agree = agree
        self.group = group
        self.target: int | None = None
        self._voting = False

    def begin(self) -> None:
        self.target = None
        self._voting = self.collective()  # once per `for`: asking torch.distributed per batch costs

    def stop_here(self, epoch: int | None, clock: EpochClock) -> bool:
        """True when the batch of `epoch` (None: this rank has no more batches) ends the `for`; the
        clock then records the epoch finished."""
        if self.target is None:
            proposal = epoch if epoch is not None else _NO_EPOCH
            if clock.finished is not None:
                proposal = max(proposal, clock.finished + 1)
            self.target = self._reduce_min(proposal)
        go_on = epoch is not None and epoch <= self.target
        if self._reduce_min(int(go_on)):
            return False
        clock.finish(self.target)
        return True

    def collective(self) -> bool:
        """Whether the ranks really vote: `agree`, under torch.distributed with more than one rank
        (otherwise each rank stops at its own edge)."""
        import torch.distributed as dist

        return self.agree and dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1

    def _reduce_min(self, value: int) -> int:
        if not self._voting:
            return value
        import torch.distributed as dist

        device = "cuda" if dist.get_backend(self.group) == "nccl" else "cpu"
        flag = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return int(flag.item())


_NO_EPOCH = 2**62
