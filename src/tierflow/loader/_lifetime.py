"""The Loader's processes die with the trainer, and a lost worker reaches the loop as a tierflow error.

`bind_workers(dataloader)`, called just before `iter(dataloader)` starts the workers, installs a
`worker_init_fn` (the user's own runs after it) that makes each DataLoader worker end when the
process that iterates the Loader does, SIGKILL included (tierflow._lifetime: the parent-death
signal where the worker's parent lives exactly as long as the trainer, a watchdog on the trainer
always). With the workers gone, the forkserver (over object stores) and the resource tracker
end by themselves: each lives only while a process holding its pipe does. No worker then holds
a tier pin or the trainer's stdout.

`worker_lost(error)` turns torch's bare RuntimeError for a worker that died (killed by the OOM
killer, a signal, a crash in native code) into `WorkerLostError`, which says how to resume;
`bind_workers` also wraps torch's SIGCHLD handler, which raises that RuntimeError wherever the
main thread happens to be.
"""

from __future__ import annotations

import multiprocessing
import re
import signal
import threading
from typing import Any
from collections.abc import Callable, Iterator

from tierflow._lifetime import Owner, die_with
from tierflow.errors import WorkerLostError

_TORCH_WORKER_DIED = re.compile(r"DataLoader worker \(pid")  # "... exited unexpectedly", "... is killed by signal"
_RESUME = (
    "the batches it was building are lost. loader.state_dict() holds the cursor of the last batch "
    "the loop consumed and resumes exactly after it: load_state_dict() it into a new Loader (or "
    "restart from your last checkpoint's)"
)


class WorkerLifetime:
    """A DataLoader `worker_init_fn`: the worker ends with `owner`, then `chained(worker_id)` runs."""

    def __init__(self, owner: Owner, parent_signal: bool, chained: Callable[[int], Any] | None = None) -> None:
        self.owner = owner
        self.parent_signal = parent_signal
        self.chained = chained

    def __call__(self, worker_id: int) -> None:
        die_with(self.owner, parent_signal=self.parent_signal)
        if self.chained is not None:
            self.chained(worker_id)


def _start_method(dataloader: Any) -> str | None:
    context = getattr(dataloader, "multiprocessing_context", None)
    if isinstance(context, str):
        return context
    if context is not None and hasattr(context, "get_start_method"):
        return context.get_start_method()
    return multiprocessing.get_start_method(allow_none=True) or "fork"


def bind_workers(dataloader: Any) -> None:
    """Before `iter(dataloader)`: its workers will die with this process (see the module's doc)."""
    if not getattr(dataloader, "num_workers", 0):
        return
    fn = dataloader.worker_init_fn
    chained = fn.chained if isinstance(fn, WorkerLifetime) else fn
    # the parent-death signal fires when the forking *thread* exits: safe from the main thread (or
    # from the forkserver, the parent of forkserver workers); a worker forked by a thread that
    # may end before the trainer does relies on the watchdog alone
    parent_signal = threading.current_thread() is threading.main_thread() or _start_method(dataloader) == "forkserver"
    dataloader.worker_init_fn = WorkerLifetime(Owner.current(), parent_signal, chained)
    _wrap_sigchld()


def lost_worker(what: str, where: str = "") -> WorkerLostError:
    """The error for a worker that died (`what` says which and how), saying how to resume."""
    return WorkerLostError(f"{where + ': ' if where else ''}{what.rstrip('. ')}; {_RESUME}")


def worker_lost(error: BaseException, where: str = "") -> WorkerLostError | None:
    """The tierflow error for torch's report that a DataLoader worker died; None for other errors."""
    if isinstance(error, WorkerLostError) or not isinstance(error, RuntimeError):
        return None
    text = str(error)
    if not _TORCH_WORKER_DIED.search(text):
        return None
    return lost_worker(text, where)


def raising_lost_workers(received: Iterator[Any], where: str = "") -> Iterator[Any]:
    """`received` (what the workers send), torch's error for a dead worker raised as WorkerLostError."""
    try:
        yield from received
    except RuntimeError as error:
        lost = worker_lost(error, where)
        if lost is None:
            raise
        raise lost from error


class _LostWorkerHandler:
    """torch's SIGCHLD handler, its RuntimeError for a dead worker raised as WorkerLostError."""

    def __init__(self, previous: Callable[..., Any]) -> None:
        self.previous = previous

    def __call__(self, signum: int, frame: Any) -> None:
        try:
            self.previous(signum, frame)
        except RuntimeError as error:
            lost = worker_lost(error)
            if lost is None:
                raise
            raise lost from error


def _wrap_sigchld() -> None:
    """Install torch's SIGCHLD handler now (it installs it once per process, from the main thread)
    and wrap it; a no-op off the main thread or once done."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGCHLD"):
        return
    try:
        from torch.utils.data._utils import signal_handling
    except ImportError:
        return
    signal_handling._set_SIGCHLD_handler()
    current = signal.getsignal(signal.SIGCHLD)
    if callable(current) and not isinstance(current, _LostWorkerHandler):
        signal.signal(signal.SIGCHLD, _LostWorkerHandler(current))


__all__ = ["WorkerLifetime", "bind_workers", "lost_worker", "raising_lost_workers", "worker_lost"]
