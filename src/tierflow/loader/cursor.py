"""The loader's resumable state, typed: where the order stands and what each stage holds.

One `LoaderCursor` is the state after a batch has been consumed on every rank. Each stage owns its
fields: the order stream `order` (train) or `step` (eval); the batcher `skip` (output batches of
the order batch at `order` already consumed) or, for a token budget, `pending` and `rank`; the
dataset the `arrangement` that a cursor inside a group (or in eval) needs to resume. `to_dict()`
writes the JSON `Loader.state_dict()` saves under "cursor" (the same keys since version 1), and
`from_dict()` checks its shape, naming the field that is wrong; `TieredDataset.load_state_dict`
then checks it against the dataset (order hash, sample ids, arrangement).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from collections.abc import Mapping

from tierflow.errors import CursorError, CursorFormatError
from tierflow.order.cursor import OrderCursor
from tierflow.order.mixed import MixedCursor

if TYPE_CHECKING:
    from tierflow.loader.plan import OrderStream

LOADER_CURSOR_VERSION = 1
KINDS = ("train", "eval")


def _int(value: Any, what: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise CursorError(f"loader cursor field {what!r} must be an integer >= {minimum}, got {value!r}")
    return value


@dataclass(frozen=True)
class Arrangement:
    """The layout a batch position means something under: nodes, ranks per node, batch size, group."""

    num_nodes: int
    ranks_per_node: int
    batch_size: int
    group: int

    def to_dict(self) -> dict[str, int]:
        return {
            "num_nodes": self.num_nodes,
            "ranks_per_node": self.ranks_per_node,
            "batch_size": self.batch_size,
            "group": self.group,
        }

    @classmethod
    def from_dict(cls, state: Any) -> Arrangement:
        if not isinstance(state, Mapping):
            raise CursorError(f"loader cursor field 'arrangement' must be a dict, got {type(state).__name__}")
        return cls(
            *(
                _int(state.get(name), f"arrangement.{name}", 1)
                for name in ("num_nodes", "ranks_per_node", "batch_size", "group")
            )
        )


@dataclass(frozen=True)
class Pending:
    """A token budget's samples pulled from the order but not yet in a batch, oldest first."""

    ids: tuple[int, ...]
    epochs: tuple[int, ...]

    def to_dict(self) -> dict[str, list[int]]:
        return {"ids": list(self.ids), "epochs": list(self.epochs)}

    @classmethod
    def from_dict(cls, state: Any) -> Pending:
        ids = state.get("ids") if isinstance(state, Mapping) else None
        epochs = state.get("epochs") if isinstance(state, Mapping) else None
        if (
            not isinstance(ids, list)
            or not isinstance(epochs, list)
            or len(ids) != len(epochs)
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ids + epochs)
        ):
            raise CursorError(
                "the cursor's pending samples are not two equal lists of sample ids and epochs (non-negative integers)"
            )
        return cls(tuple(ids), tuple(epochs))


@dataclass(frozen=True)
class LoaderCursor:
    """Where a `TieredDataset` resumes: the state once every rank has consumed one batch."""

    kind: str
    arrangement: Arrangement
    order: OrderCursor | MixedCursor | None = None
    skip: int = 0
    pending: Pending | None = None
    rank: int | None = None
    step: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise CursorError(f"loader cursor kind must be 'train' or 'eval', got {self.kind!r}")
        if self.kind == "train" and self.order is None:
            raise CursorError("a train loader cursor needs the order's position ('order')")
        if self.kind == "eval" and self.step is None:
            raise CursorError("an eval loader cursor needs the last step consumed ('step')")
        if self.pending is not None and self.rank is None:
            raise CursorError("a token-budget cursor needs the rank whose stream it follows ('rank')")

    @property
    def inside_group(self) -> bool:
        """True when resuming it needs the arrangement it was saved under (see `Arrangement`)."""
        return self.kind == "eval" or self.skip > 0 or self.pending is not None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (the keys `Loader.state_dict()["cursor"]` has held since version 1)."""
        out: dict[str, Any] = {"version": LOADER_CURSOR_VERSION, "kind": self.kind}
        if self.kind == "eval":
            out["step"] = self.step
        else:
            assert self.order is not None
            out["order"] = self.order.to_dict()
            out["skip"] = self.skip
            if self.pending is not None:
                out["pending"] = self.pending.to_dict()
                out["rank"] = self.rank
        out["arrangement"] = self.arrangement.to_dict()
        return out

    @classmethod
    def from_dict(cls, state: Any) -> LoaderCursor:
        """Parse what `to_dict` wrote; `CursorError` names the field that is missing or wrong."""
        if not isinstance(state, Mapping):
            raise CursorError(f"a loader cursor is a dict, got {type(state).__name__}")
        if state.get("version") != LOADER_CURSOR_VERSION:
            raise CursorError(
                f"loader cursor version {state.get('version')!r}, this tierflow reads {LOADER_CURSOR_VERSION}"
            )
        kind = state.get("kind")
        if kind not in KINDS:
            raise CursorError(f"loader cursor field 'kind' must be 'train' or 'eval', got {kind!r}")
        arrangement = Arrangement.from_dict(state.get("arrangement"))
        if kind == "eval":
            return cls("eval", arrangement, step=_int(state.get("step"), "step"))
        if "order" not in state:
            raise CursorError("loader cursor lacks field 'order' (the order's position)")
        try:
            saved = state["order"]
            order: OrderCursor | MixedCursor = (
                MixedCursor.from_dict(saved)
                if isinstance(saved, Mapping) and "draws" in saved
                else OrderCursor.from_dict(saved)
            )
        except CursorFormatError as error:
            raise CursorFormatError(f"loader cursor field 'order': {error}") from None
        pending = Pending.from_dict(state["pending"]) if "pending" in state else None
        rank = _int(state.get("rank"), "rank") if pending is not None else None
        return cls(
            "train", arrangement, order=order, skip=_int(state.get("skip", 0), "skip"), pending=pending, rank=rank
        )

    @classmethod
    def parse(cls, state: LoaderCursor | Mapping[str, Any] | None) -> LoaderCursor | None:
        """A cursor from what users pass as `resume`: a cursor, its dict, or a `Loader.state_dict()`."""
        if state is None or isinstance(state, LoaderCursor):
            return state
        if isinstance(state, Mapping) and "cursor" in state and "kind" not in state:
            return cls.parse(state["cursor"])
        return cls.from_dict(state)


def check_arrangement(cursor: LoaderCursor, arrangement: Arrangement) -> None:
    """A cursor stopped inside a group resumes only under the arrangement it was saved with."""
    if cursor.inside_group and cursor.arrangement != arrangement:
        saved = cursor.arrangement.to_dict()
        raise CursorError(
            f"cursor stopped inside a group of {saved['group']} batches (or in eval) under {saved}; "
            f"resuming it needs the same arrangement, not {arrangement.to_dict()} "
            f"(change world size or batch size at a group boundary)"
        )


def cursor_after_batches(
    stream: OrderStream, start: LoaderCursor | None, batches: int, batches_per_group: int
) -> LoaderCursor:
    """The cursor once `batches` (> 0) more output batches of `stream` (from `start`) are consumed."""
    group, part = divmod((start.skip if start is not None else 0) + batches - 1, batches_per_group)
    if part + 1 == batches_per_group:
        return stream.cursor(group)
    return stream.cursor(group - 1, skip=part + 1)


def mismatch_advice(saved: str, ours: str) -> str:
    """What to say about a cursor saved over other samples: another batcher's, or another dataset's."""
    saved_id, _, saved_unit = saved.partition("/")
    our_id, _, our_unit = ours.partition("/")
    if saved_id == our_id:
        return (
            f"this cursor counts {saved_unit!r} samples (the batcher it was saved with), this dataset reads "
            f"{our_unit!r}: resume with the batcher it was saved with, or start fresh (resume=None)"
        )
    return (
        f"this cursor was saved by dataset {saved_id!r} ({saved_unit}), not by this one ({our_id!r}): resume "
        f"with the dataset it was saved from, or start this one fresh (resume=None); allow_mismatch=True "
        f"maps its positions onto this dataset anyway"
    )
