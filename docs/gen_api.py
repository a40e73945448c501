"""Build the API reference (HTML, pdoc) of tierflow's public packages.

    python docs/gen_api.py docs/_build/api      # what `make docs` runs; open index.html

One page per package in PUBLIC_PACKAGES (and per public submodule pdoc finds below it: a package
with `__all__` shows those names; one without shows its modules). The test rig (tierflow.testing)
and the command implementations (tierflow.commands; docs/cli.md is their reference) are left out.
tests/test_docs.py builds this into a temporary directory on every test run.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

PUBLIC_PACKAGES = (
    "tierflow",
    "tierflow.errors",
    "tierflow.pack",
    "tierflow.format",
    "tierflow.storage",
    "tierflow.tiers",
    "tierflow.order",
    "tierflow.policies",
    "tierflow.loader",
    "tierflow.transforms",
    "tierflow.telemetry",
    "tierflow.checkpoint",
    "tierflow.integrations",  # its submodules import their framework: the `frameworks` extra (in dev)
)
#: subpackages of tierflow deliberately without a page
LEFT_OUT = ("tierflow.testing", "tierflow.commands")


def build(out: Path, packages: tuple[str, ...] = PUBLIC_PACKAGES) -> list[Path]:
    """Write the reference of `packages` (all of PUBLIC_PACKAGES: `make docs`) under `out`; return
    the page of each."""
    import pdoc
    import pdoc.render

    import tierflow

    # tierflow loads its loader names (which import torch) on first use, from a module
    # __getattr__; pdoc reads a module's __dict__, so resolve them first.
    for name in tierflow.__all__:
        if name not in vars(tierflow):
            setattr(tierflow, name, getattr(tierflow, name))
    pdoc.render.configure(docformat="markdown", footer_text=f"tierflow {tierflow.__version__}")
    out = Path(out)
    with warnings.catch_warnings():
        # `tierflow` already reaches `tierflow.pack` (a name in its __all__); listing it again is
        # deliberate, so a change to tierflow.__all__ cannot drop the page.
        warnings.filterwarnings("ignore", message=".*has already been added")
        pdoc.pdoc(*packages, output_directory=out)
    return [page(out, name) for name in packages]


def page(out: Path, module: str) -> Path:
    return Path(out) / (module.replace(".", "/") + ".html")


def main(argv: list[str]) -> int:
    out = Path(argv[0] if argv else "docs/_build/api")
    build(out)
    print(f"wrote {out}/index.html")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
