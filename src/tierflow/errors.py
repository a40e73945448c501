"""Every error tierflow raises on purpose derives from `TierflowError`, so one `except` catches them.

Each also derives from the builtin a caller would expect (`ValueError` for bad input,
`IOError` for bytes that cannot be read or trusted), so code written against those still works.
Messages name the file, shard, block, line or URL concerned.

Every one survives a process boundary with its type: it pickles (`__reduce__`), and it can be
built from one message string, which is how PyTorch's DataLoader re-raises a worker's exception
(`exc_type(message)`; a class that refuses that reaches the training loop as a bare RuntimeError).
"""

from __future__ import annotations

from typing import Any


class TierflowError(Exception):
    """The base of every error tierflow raises on purpose."""


class ManifestError(TierflowError, ValueError):
    """A manifest is missing, unreadable or unsafe; the message names the file and field."""


class ShardCorruptError(TierflowError, IOError):
    """Bytes of a shard do not match the manifest; names the shard and, when known, the block."""


class PackInputError(TierflowError, ValueError):
    """Input that cannot be packed; the message names the file and, where known, the line."""


class CursorError(TierflowError, ValueError):
    """A saved cursor that cannot resume this dataset, order or arrangement."""


class CursorFormatError(CursorError):
    """A dict that is not a valid order cursor."""


class CursorMismatchError(CursorError):
    """A cursor was written for a different dataset or order configuration."""


class BatchOrderError(TierflowError, RuntimeError):
    """Batches arrived out of order (e.g. a DataLoader with in_order=False); exact resume would break."""


class WorkerLostError(TierflowError, RuntimeError):
    """A DataLoader worker died (killed by a signal, the OOM killer, a crash in native code); the
    message says how `loader.state_dict()` resumes exactly after the last batch the loop got."""


class LoaderMisuseError(TierflowError, TypeError):
    """A TieredDataset used in a way that cannot work (e.g. collated by a DataLoader with a
    batch_size); the message says what to write instead."""


class TopologyError(TierflowError, ValueError):
    """Where this process sits in the job cannot be told, or its launcher's variables and
    torch.distributed disagree; the message names the variable."""


class FetchError(TierflowError, IOError):
    """Bytes produced for a tier entry did not verify; names the entry and the tier."""


class TierIndexError(TierflowError, IOError):
    """A tier directory's index is not a usable SQLite database (damaged, or a foreign file); names it."""


class SourceError(TierflowError, IOError):
    """An object of a source could not be read or written; names the object's URL and why.

    `SourceError(message)` alone (no name, no reason) is a whole message: what a DataLoader
    rebuilds from a worker's error, whose text already names the object."""

    def __init__(self, url: str, name: str | None = None, reason: str | None = None, attempts: int = 1) -> None:
        self.url = url
        self.name = name or ""
        self.reason = reason or ""
        self.attempts = attempts
        if name is None and reason is None:
            self.message = url
        else:
            tries = f" after {attempts} attempts" if attempts > 1 else ""
            where = f"{url.rstrip('/')}/{name}" if name else url
            self.message = f"{where}: {reason or 'failed'}{tries}"
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[Any, ...]:
        if not self.name and not self.reason:
            return (type(self), (self.message,))
        return (type(self), (self.url, self.name, self.reason, self.attempts))


class SourceNotFound(SourceError, FileNotFoundError):
    """The object does not exist; never retried."""


class SourceTimeout(SourceError, TimeoutError):
    """An operation on an object outlived its deadline (a silent or too slow peer), retries included."""


class CheckpointError(TierflowError, IOError):
    """A checkpoint step is missing, incomplete or does not match its manifest; names the file.
    `CheckpointError(message)` alone is a whole message (as a DataLoader rebuilds it)."""

    def __init__(self, where: str, reason: str | None = None) -> None:
        self.where = where
        self.reason = reason
        super().__init__(where if reason is None else f"{where}: {reason}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.where, self.reason))


class CheckpointTimeout(CheckpointError, TimeoutError):
    """`CheckpointStore.wait(timeout)` outlived its deadline with an upload still running; names the step."""


class TierflowWarning(UserWarning):
    """The base of every warning tierflow issues on purpose (`warnings.filterwarnings` takes it)."""


class CheckpointWarning(TierflowWarning):
    """A checkpoint step was passed over (damaged, unreadable, bound to another step, a special
    file) or a checkpoint chore could not be done now; the message names the step and the file."""


class TierUnavailableWarning(TierflowWarning):
    """A tier directory vanished under a running process (deleted to free a disk, or replaced) or
    its index broke (truncated, damaged): the tier is bypassed, its reads served from the tier
    below or the source. Issued once per tier object; the message names the directory."""


__all__ = [
    "BatchOrderError",
    "CheckpointError",
    "CheckpointTimeout",
    "CheckpointWarning",
    "CursorError",
    "CursorFormatError",
    "CursorMismatchError",
    "FetchError",
    "LoaderMisuseError",
    "ManifestError",
    "PackInputError",
    "ShardCorruptError",
    "SourceError",
    "SourceNotFound",
    "SourceTimeout",
    "TierIndexError",
    "TierUnavailableWarning",
    "TierflowError",
    "TierflowWarning",
    "TopologyError",
    "WorkerLostError",
]
