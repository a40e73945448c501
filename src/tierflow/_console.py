"""The console and tables tierflow prints: whole paths, dataset ids and checksums, piped or not.

Rich assumes 80 columns when output is not a terminal (a log, a pipe, a notebook's captured
stream) and cuts cells with "…", which cut the one thing a user copies from a table: a path or an
id. Piped output gets room instead (COLUMNS still wins), and table cells fold rather than cut in a
narrow terminal.
"""

from __future__ import annotations

import os
from typing import Any

from rich.console import Console
from rich.table import Table

PIPED_WIDTH = 200


def output_console() -> Console:
    """A rich Console: the terminal's width on a terminal or with COLUMNS set, else PIPED_WIDTH."""
    probe = Console()
    if probe.is_terminal or os.environ.get("COLUMNS"):
        return probe
    return Console(width=PIPED_WIDTH)


def folding_table(*headers: str, **options: Any) -> Table:
    """A rich Table whose cells fold onto more lines instead of being cut."""
    out = Table(**options)
    for header in headers:
        out.add_column(header, overflow="fold")
    return out


__all__ = ["PIPED_WIDTH", "folding_table", "output_console"]
