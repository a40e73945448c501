"""The order's resumable state: one stream position per canonical partition, as a small JSON dict.

World size, ranks, workers and micro-batch size are not part of it; the dataset and the
order-relevant configuration are, through a hash that `load` checks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tierflow.errors import CursorFormatError

CURSOR_VERSION = 3
"""3: remainder="carry" reads a node's epoch before the next (edges.py); 2: each lane's batches ran
straight across its epoch edges. A cursor keeps its version, so it resumes the order it was saved in."""
READABLE_VERSIONS = (2, 3)


@dataclass(frozen=True)
class OrderCursor:
    """Per partition p: the stream position (epochs[p], offsets[p]) of its next sample; the
    lanes and their interleave are derived from these alone."""

    seed: int
    epochs: tuple[int, ...]
    offsets: tuple[int, ...]
    config_hash: str
    config: dict[str, Any] = field(default_factory=dict)
    version: int = CURSOR_VERSION

    @property
    def partitions(self) -> int:
        return len(self.epochs)

    @property
    def epoch(self) -> int:
        """The epoch every partition has at least reached."""
        return min(self.epochs)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "seed": self.seed,
            "epoch": self.epoch,
            "partitions": self.partitions,
            "epochs": list(self.epochs),
            "offsets": list(self.offsets),
            "config_hash": self.config_hash,
            "config": dict(self.config),
        }

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> OrderCursor:
        if not isinstance(state, dict):
            raise CursorFormatError(f"an order cursor is a dict, got {type(state).__name__}")
        missing = [k for k in ("version", "seed", "partitions", "epochs", "offsets", "config_hash") if k not in state]
        if missing:
            raise CursorFormatError(f"order cursor lacks fields {missing}")
        if state["version"] not in READABLE_VERSIONS:
            raise CursorFormatError(
                f"order cursor version {state['version']!r}; this tierflow reads versions {READABLE_VERSIONS}"
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
            version=int(state["version"]),
        )
