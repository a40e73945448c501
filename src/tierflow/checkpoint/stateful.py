"""The loader's cursor as a `torch.distributed.checkpoint` Stateful, so it commits with the model.

    dcp.save({"model": model.state_dict(), "loader": LoaderState(loader)}, checkpoint_id=step_dir)

DCP writes `.metadata` last, so a step directory holds either both the model and the cursor of
the last batch the model saw, or neither. The loader's state is a JSON dict; DCP stores tensors
or picklable objects, so it travels as the UTF-8 bytes of its JSON (a leaf DCP writes as one
byte item) under a per-rank key, and comes back as the identical dict. DCP's `Stateful` is a
runtime-checkable protocol, so this class satisfies it without importing torch (the uploader
process imports this package and stays light).

Elastic resume (another world size): `LoaderState(loader, checkpoint=step_dir)` reads which
ranks the step holds (its DCP metadata) and loads every saved rank's state. The same world
size resumes each rank from its own; another one resumes every rank from the one cursor the
saved ranks share (steps are synchronous, and the order's cursor does not depend on the world
size), and refuses, naming the step, when their states differ (a token budget's samples
pending on each rank belong to that rank). The cursor carries the working set it was read
with (lanes, window_shards), which the loader's default sizes to its node: give the resumed
loader the saved ones (or build it with `open_loader(resume=...)`, which takes them).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from tierflow.errors import CursorError

_RANK_KEY = re.compile(r"rank(\d+)")


class LoaderState:
    """Wraps anything with JSON-able `state_dict()`/`load_state_dict()` (a `Loader`) for DCP.

    `name` is the key the LoaderState has in the state dict given to DCP (`{"loader": ...}`);
    with `checkpoint` (a step directory to load), it is how the saved ranks are found there."""

    def __init__(
        self, loader: Any, key: str | None = None, *, checkpoint: str | Path | None = None, name: str = "loader"
    ) -> None:
        self.loader = loader
        self.key = key if key is not None else f"rank{_rank()}"
        self.loaded: dict[str, Any] | None = None
        self.checkpoint = Path(checkpoint) if checkpoint is not None else None
        self.saved_ranks = saved_loader_ranks(self.checkpoint, name) if self.checkpoint is not None else None

    def state_dict(self) -> dict[str, Any]:
        if self.saved_ranks is not None:  # a load: ask DCP for every saved rank's state
            return {f"rank{r}": b"" for r in self.saved_ranks}
        return {self.key: encode_state(self.loader.state_dict())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.saved_ranks is not None:
            self.loaded = self._elastic({k: decode_state(v) for k, v in state_dict.items()})
        elif self.key not in state_dict:
            raise KeyError(
                f"checkpoint has no loader state {self.key!r} (saved with another world size? "
                f"pass checkpoint= to resume elastically)"
            )
        else:
            self.loaded = decode_state(state_dict[self.key])
        self.loader.load_state_dict(self.loaded)

    def _elastic(self, states: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """This rank's state: its own under the saved world size, else the one all ranks shared."""
        world = _world_size()
        if len(states) == world and self.key in states:
            return states[self.key]
        distinct = {json.dumps(s, sort_keys=True) for s in states.values()}
        if len(distinct) != 1:
            raise CursorError(
                f"{self.checkpoint}: the loader states of its {len(states)} ranks differ (e.g. a token "
                f"budget's pending samples, which belong to their rank), so they cannot resume under "
                f"world size {world}; resume with {len(states)} ranks"
            )
        return next(iter(states.values()))


def saved_loader_ranks(step_dir: Path, name: str = "loader") -> list[int]:
    """The ranks whose loader state (`name`.rankR) the DCP checkpoint in `step_dir` holds."""
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    prefix = f"{name}."
    ranks = sorted(
        int(m.group(1))
        for k in keys
        if k.startswith(prefix)
        for m in [_RANK_KEY.fullmatch(k[len(prefix) :])]
        if m is not None
    )
    if not ranks:
        raise CursorError(f"{step_dir}: no loader state under {name!r} in its DCP metadata")
    return ranks


def encode_state(state: dict[str, Any]) -> bytes:
    """A JSON dict as bytes; refuses anything JSON cannot carry exactly (NaN, non-string keys)."""
    return json.dumps(state, sort_keys=True, allow_nan=False).encode()


def decode_state(raw: Any) -> dict[str, Any]:
    """The dict back from bytes (or from a uint8 tensor, as other tools may store it)."""
    if hasattr(raw, "numpy"):
        raw = raw.cpu().numpy().tobytes()
    return json.loads(bytes(raw).decode())


def _dist() -> Any:
    import sys

    dist = sys.modules.get("torch.distributed")  # not initialised unless torch was imported already
    return dist if dist is not None and dist.is_available() and dist.is_initialized() else None


def _rank() -> int:
    dist = _dist()
    return dist.get_rank() if dist is not None else 0


def _world_size() -> int:
    dist = _dist()
    return dist.get_world_size() if dist is not None else 1
