"""The order's resumable state: one stream position per canonical partition, as a small JSON dict.

World size, ranks, workers and micro-batch size are not part of it; the dataset and the
order-relevant configuration are, through a hash that `load` checks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tierflow.errors import CursorFormatError, CursorMismatchError

CURSOR_VERSION = 2


@dataclass(frozen=True)
class OrderCursor:
    """Per partition p: the stream position (epochs[p], offsets[p]) of its next sample; the
    lanes and their interleave are derived from these alone."""

    seed: int
    epochs: tuple[int, ...]
    offsets: tuple[int, ...]
    config_hash: str
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def partitions(self) -> int:
        return len(self.epochs)

    @property
    def epoch(self) -> int:
        """The epoch every partition has at least reached."""
        return min(self.epochs)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": CURSOR_VERSION,
            "seed": self.seed,
            "epoch": self.epoch,
            "partitions": self.partitions,
            "epochs": list(self.epochs),
            "offsets": list(self.offsets),
            "config_hash": self.config_hash,
            "config": dict(self.config),
        }

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> "OrderCursor":
        if not isinstance(state, dict):
            raise CursorFormatError(f"an order cursor is a dict, got {type(state).__name__}")
        missing = [k for k in ("version", "seed", "partitions", "epochs", "offsets", "config_hash") if k not in state]
        if missing:
            raise CursorFormatError(f"order cursor lacks fields {missing}")
        if state["version"] != CURSOR_VERSION:
            raise CursorFormatError(
                f"order cursor version {state['version']!r}; this tierflow reads version {CURSOR_VERSION}"
            )
        partitions = state["partitions"]
        for name in ("epochs", "offsets"):
            values = state[name]
            if not isinstance(values, list) or len(values) != partitions:
                raise CursorFormatError(f"order cursor field {name!r} must list {partitions} integers")
            if any(not isinstance(v, int) or v < 0 for v in values):
                raise CursorFormatError(f"order cursor field {name!r} holds a non-integer or negative value")
        return cls(
            seed=int(state["seed"]),
            epochs=tuple(state["epochs"]),
            offsets=tuple(state["offsets"]),
            config_hash=str(state["config_hash"]),
            config=dict(state.get("config", {})),
        )
