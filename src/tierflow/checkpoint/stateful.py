"""The loader's cursor as a `torch.distributed.checkpoint` Stateful, so it commits with the model.

    dcp.save({"model": model.state_dict(), "loader": LoaderState(loader)}, checkpoint_id=step_dir)

DCP writes `.metadata` last, so a step directory holds either both the model and the cursor of
the last batch the model saw, or neither. The loader's state is a JSON dict; DCP stores tensors
or picklable objects, so it travels as the UTF-8 bytes of its JSON (a leaf DCP writes as one
byte item) under a per-rank key, and comes back as the identical dict. DCP's `Stateful` is a
runtime-checkable protocol, so this class satisfies it without importing torch (the uploader
process imports this package and stays light).
"""

from __future__ import annotations

import json
from typing import Any


class LoaderState:
    """Wraps anything with JSON-able `state_dict()`/`load_state_dict()` (a `Loader`) for DCP."""

    def __init__(self, loader: Any, key: str | None = None) -> None:
        self.loader = loader
        self.key = key if key is not None else f"rank{_rank()}"
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {self.key: encode_state(self.loader.state_dict())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.key not in state_dict:
            raise KeyError(f"checkpoint has no loader state {self.key!r} (saved with another world size?)")
        self.loaded = decode_state(state_dict[self.key])
        self.loader.load_state_dict(self.loaded)


def encode_state(state: dict[str, Any]) -> bytes:
    """A JSON dict as bytes; refuses anything JSON cannot carry exactly (NaN, non-string keys)."""
    return json.dumps(state, sort_keys=True, allow_nan=False).encode()


def decode_state(raw: Any) -> dict[str, Any]:
    """The dict back from bytes (or from a uint8 tensor, as other tools may store it)."""
    if hasattr(raw, "numpy"):
        raw = raw.cpu().numpy().tobytes()
    return json.loads(bytes(raw).decode())


def _rank() -> int:
    import sys

    dist = sys.modules.get("torch.distributed")  # not initialised unless torch was imported already
    return dist.get_rank() if dist is not None and dist.is_available() and dist.is_initialized() else 0
