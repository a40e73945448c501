"""The packages' imports form docs/architecture.md's layering: nothing imports upward, no package
cycle, and nothing outside `tierflow.integrations` imports it.

The layers are read from the architecture table itself, so the table and the code cannot drift
apart silently. Cycles are counted over module-level imports (those under `if TYPE_CHECKING:`
excepted); an import inside a function may be lazy, but it may not reach upward either.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "tierflow"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
FACADE = {"__init__", "__main__"}
"""`tierflow/__init__.py` (the top-level API) and `__main__.py`: above every layer."""


def documented_layers() -> dict[str, int]:
    """Each package (`loader/`) or top-level module (`errors.py`) named in the table, by its layer."""
    layers: dict[str, int] = {}
    for line in ARCHITECTURE.read_text().splitlines():
        row = re.match(r"\|\s*(\d+)\s*\|([^|]*)\|", line)
        if row:
            for name in re.findall(r"`([\w.]+?)(?:/|\.py)`", row.group(2)):
                layers[name] = int(row.group(1))
    return layers


def unit_of(path: Path) -> str:
    """The package a module belongs to (`loader`), or the top-level module's own name (`errors`)."""
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


def module_name(path: Path) -> str:
    parts = ("tierflow", *path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def module_level_imports(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """The imports a module runs when it is imported: its top level, into `if` and `try` blocks."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if not is_type_checking(node):
                yield from module_level_imports(node.body)
            yield from module_level_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, *(handler.body for handler in node.handlers), node.orelse, node.finalbody):
                yield from module_level_imports(block)


def imported_modules(node: ast.Import | ast.ImportFrom, importer: Path) -> list[str]:
    """The absolute names an import statement loads (`from tierflow import errors` loads tierflow.errors)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = module_name(importer).split(".")
        if importer.name != "__init__.py":
            package = package[:-1]
        package = package[: len(package) - node.level + 1]
        base = ".".join([*package, *([node.module] if node.module else [])])
    if base == "tierflow":
        return [f"tierflow.{alias.name}" if is_unit(alias.name) else "tierflow" for alias in node.names]
    return [base]


def is_unit(name: str) -> bool:
    return (PACKAGE / name).is_dir() or (PACKAGE / f"{name}.py").is_file()


def tierflow_unit(name: str) -> str | None:
    """The package or top-level module of tierflow that `name` loads; `tierflow` itself is `__init__`."""
    parts = name.split(".")
    if parts[0] != "tierflow":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def package_imports() -> dict[tuple[str, str], list[str]]:
    """(importing unit, imported unit) -> the `file:line` of each module-level import between them."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in sources():
        importer = unit_of(path)
        for node in module_level_imports(ast.parse(path.read_text(), str(path)).body):
            for name in imported_modules(node, path):
                imported = tierflow_unit(name)
                if imported and imported != importer:
                    edges[importer, imported].append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return edges


def test_every_package_has_a_documented_layer():
    layers = documented_layers()
    units = {unit_of(path) for path in sources()} - FACADE
    assert units - layers.keys() == set(), "add a row to docs/architecture.md's table"
    assert layers.keys() - units == set(), "the table names a package that is gone"


def every_import(path: Path) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement of a module, inside functions too."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node


def test_no_package_imports_a_package_above_it_not_even_inside_a_function():
    layers = documented_layers()
    upward = [
        f"{path.relative_to(ROOT)}:{node.lineno}: {importer} (layer {layers[importer]}) imports {imported} "
        f"(layer {layers[imported]})"
        for path in sources()
        if (importer := unit_of(path)) in layers
        for node in every_import(path)
        for name in imported_modules(node, path)
        if (imported := tierflow_unit(name)) in layers and layers[imported] > layers[importer]
    ]
    assert upward == []


def test_nothing_imports_the_top_level_api():
    inward = [
        f"{where}: {importer} imports tierflow.{imported}"
        for (importer, imported), places in package_imports().items()
        if imported in FACADE and importer not in FACADE
        for where in places
    ]
    assert inward == []


def test_no_cycle_between_packages():
    graph: dict[str, set[str]] = defaultdict(set)
    for importer, imported in package_imports():
        if importer not in FACADE:
            graph[importer].add(imported)

    def path_back(start: str) -> list[str] | None:
        """A chain of imports from `start` that leads back to it, if any."""
        stack, seen = [(start, [start])], set()
        while stack:
            unit, chain = stack.pop()
            for nxt in graph[unit]:
                if nxt == start:
                    return [*chain, start]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*chain, nxt]))
        return None

    cycles = [" -> ".join(chain) for unit in sorted(graph) if (chain := path_back(unit))]
    assert cycles == []


def test_the_core_never_imports_integrations():
    """Not even inside a function: `import tierflow` and every verb work without any framework."""
    found = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in sources()
        if unit_of(path) != "integrations"
        for node in every_import(path)
        if any(tierflow_unit(name) == "integrations" for name in imported_modules(node, path))
    ]
    assert found == []
