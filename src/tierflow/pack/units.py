"""What pack's planning hands its workers: units of input, the options they are read with, and
the counts each unit reports back (every input file packed or counted by reason)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from collections.abc import Sequence


@dataclass
class Unit:
    """One piece of input a worker turns into record batches."""

    index: int
    kind: str
    path: str
    start: int = 0
    end: int = -1
    members: Sequence[str] = ()
    records: list | None = None
    input_bytes: int = 0
    sidecars: Sequence[str] = ()
    """Caption files of the unit's images (read with them, never samples of their own)."""


@dataclass
class UnitStats:
    samples: int = 0
    files: int = 0
    kept_as_bytes: int = 0
    skipped_records: int = 0
    filtered: int = 0
    sidecars: int = 0
    corrupt_images: int = 0
    skipped_files: dict[str, int] = field(default_factory=dict)
    """Input files not packed, by reason; with `skipped_examples`, the first path of each."""
    skipped_examples: dict[str, str] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    skipped_reasons: dict[str, int] = field(default_factory=dict)
    """Records skipped under on_error="skip", by reason (their sum is `skipped_records`); with
    `skipped_record_examples`, the first FILE:LINE of each."""
    skipped_record_examples: dict[str, str] = field(default_factory=dict)

    def skip_record(self, reason: str, message: str) -> None:
        """Count a bad record skipped under on_error="skip"; `message` is FILE:LINE: what is wrong."""
        self.skipped_records += 1
        self.skipped_reasons[reason] = self.skipped_reasons.get(reason, 0) + 1
        self.skipped_record_examples.setdefault(reason, message.split(": ", 1)[0])
        if len(self.errors) < 50:
            self.errors.append(message)

    def skip_file(self, reason: str, path: str) -> None:
        """Count a file that is not packed: every input file is packed or counted, never dropped."""
        self.skipped_files[reason] = self.skipped_files.get(reason, 0) + 1
        self.skipped_examples.setdefault(reason, path)

    def merge(self, other: UnitStats) -> None:
        self.samples += other.samples
        self.files += other.files
        self.kept_as_bytes += other.kept_as_bytes
        self.skipped_records += other.skipped_records
        self.filtered += other.filtered
        self.sidecars += other.sidecars
        self.corrupt_images += other.corrupt_images
        for reason, count in other.skipped_files.items():
            self.skipped_files[reason] = self.skipped_files.get(reason, 0) + count
            self.skipped_examples.setdefault(reason, other.skipped_examples[reason])
        for reason, count in other.skipped_reasons.items():
            self.skipped_reasons[reason] = self.skipped_reasons.get(reason, 0) + count
            self.skipped_record_examples.setdefault(reason, other.skipped_record_examples[reason])
        self.errors.extend(other.errors[: max(0, 50 - len(self.errors))])

    def skipped_summary(self) -> dict[str, dict[str, Any]]:
        """{reason: {"count", "example"}}, as the manifest's stats record it."""
        return {r: {"count": n, "example": self.skipped_examples[r]} for r, n in self.skipped_files.items()}

    def skipped_records_summary(self) -> dict[str, dict[str, Any]]:
        """{reason: {"count", "example"}} of the records skipped, the example a FILE:LINE."""
        return {r: {"count": n, "example": self.skipped_record_examples[r]} for r, n in self.skipped_reasons.items()}


@dataclass
class SourceOptions:
    text_field: str = "text"
    kind: str = "auto"
    include: Sequence[str] = ()
    exclude: Sequence[str] = ()
    on_error: str = "raise"
    chunk_bytes: int = 16 << 20
    files_per_unit: int = 2048
    records_per_unit: int = 1024
    require_text: bool = False
    """Every record must hold a string in `text_field` (set when a tokenizer reads the records as
    they are, with no `fn`): a record without one is bad input, named with its line, never packed
    as an empty document."""
