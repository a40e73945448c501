"""No module under src/tierflow is over 600 lines (issue 41): past that, a module holds more than
one job, and splitting it is cheaper the earlier it is done."""

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "tierflow"
MAX_LINES = 600


def test_no_module_is_over_600_lines():
    sizes = {str(path.relative_to(PACKAGE)): len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")}
    assert {name: lines for name, lines in sorted(sizes.items()) if lines > MAX_LINES} == {}
