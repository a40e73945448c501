"""tierflow.checkpoint: the Recover stage. The loader's cursor inside the model's DCP commit, a
local-first, atomic, verified checkpoint store uploaded in the background within the node's
bandwidth budget, retention, and a warm restart that pre-stages what the next batches read."""

from tierflow.checkpoint.manifest import COMMIT_NAME, CheckpointError, StepReport, step_name
from tierflow.checkpoint.remote import prune_remote, remote_steps, verify_remote
from tierflow.checkpoint.stateful import LoaderState
from tierflow.checkpoint.store import CheckpointStore
from tierflow.checkpoint.warm import next_shards, restore_warm

__all__ = [
    "COMMIT_NAME",
    "CheckpointError",
    "CheckpointStore",
    "LoaderState",
    "StepReport",
    "next_shards",
    "prune_remote",
    "remote_steps",
    "restore_warm",
    "step_name",
    "verify_remote",
]
