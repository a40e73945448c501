"""Every error tierflow raises on purpose derives from `TierflowError`, so one `except` catches them.

Each also derives from the builtin a caller would expect (`ValueError` for bad input,
`IOError` for bytes that cannot be read or trusted), so code written against those still works.
Messages name the file, shard, block, line or URL concerned.
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


class FetchError(TierflowError, IOError):
    """Bytes produced for a tier entry did not verify; names the entry and the tier."""


class SourceError(TierflowError, IOError):
    """An object of a source could not be read or written; names the object's URL and why."""

    def __init__(self, url: str, name: str, reason: str, attempts: int = 1) -> None:
        self.url = url
        self.name = name
        self.reason = reason
        self.attempts = attempts
        tries = f" after {attempts} attempts" if attempts > 1 else ""
        where = f"{url.rstrip('/')}/{name}" if name else url
        self.message = f"{where}: {reason}{tries}"
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.url, self.name, self.reason, self.attempts))


class SourceNotFound(SourceError, FileNotFoundError):
    """The object does not exist; never retried."""


__all__ = ["BatchOrderError", "CursorError", "CursorFormatError", "CursorMismatchError", "FetchError",
           "ManifestError", "PackInputError", "ShardCorruptError", "SourceError", "SourceNotFound",
           "TierflowError"]
