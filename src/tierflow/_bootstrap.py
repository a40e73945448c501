"""A clear error, instead of a worker that dies unexplained, when a script without a main guard is
re-run by a spawn/forkserver worker (the Loader starts workers with forkserver over object stores).

Python starts such a worker by running the parent's main script again as `__mp_main__`; code at
its top level (a pack, a loader, a training loop) then runs again inside the worker.
"""

from __future__ import annotations

import multiprocessing

from tierflow.errors import TierflowError


class MainGuardError(TierflowError, RuntimeError):
    """tierflow was called from a script's top level while a worker process was starting."""


def refuse_while_bootstrapping(what: str) -> None:
    """Raise MainGuardError when called while this process is a spawn/forkserver child still
    importing its parent's main script."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise MainGuardError(
            f"{what} was called while a DataLoader worker was starting: the worker re-runs the main "
            f"script (workers over an object store start with forkserver, as with spawn), so put the "
            f'script\'s top-level code under `if __name__ == "__main__":`'
        )
