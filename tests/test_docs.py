"""The docs are built and checked by the test suite (CI runs it), so they cannot rot.

- API reference: docs/gen_api.py builds the pdoc HTML into a temporary directory; every public
  package gets a page that shows every name of its `__all__` (the whole build and the runnable
  pages are `slow`: the fast set builds one package's page and the README runs in tests/test_readme.py).
- CLI reference: docs/cli.md must equal what docs/gen_cli.py generates from the parser now
  (`make docs` regenerates it), and every argument of every verb must have help text.
- Runnable docs. Convention: a fenced code block whose info string is `python tested`

      ```python tested
      ...
      ```

  is run by this file; a plain ```` ```python ```` block is an illustration and is not (other
  libraries, paths of real machines). Renderers highlight `python tested` as Python (they read
  the first word). The tested blocks of one page are joined, in page order, into one script,
  run by a fresh interpreter in a temporary directory that holds the inputs the page names,
  generated here (`make_images`, `make_corpus`). A page that uses `s3://my-bucket/...` runs
  against the moto S3 server of tests/conftest.py: the bucket `my-bucket` is created there and
  the script's environment points default S3 clients at it (AWS_ENDPOINT_URL, fake
  credentials), so the code runs exactly as printed.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import json
import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
TESTED_BLOCK = re.compile(r"^```python tested[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
ANY_BLOCK = re.compile(r"^```(\S*)[^\n]*\n", re.MULTILINE)


def _generator(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"docs_{name}", DOCS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen_api = _generator("gen_api")
gen_cli = _generator("gen_cli")


# ---------------------------------------------------------------------------- API reference


def check_api_pages(out: Path, packages: tuple[str, ...]) -> None:
    """Build the reference of `packages` under `out`: a page each, showing every name of its `__all__`."""
    if importlib.util.find_spec("pdoc") is None:
        pytest.fail("pdoc is not installed: pip install -e '.[dev]' (or '.[docs]')")
    pages = gen_api.build(out, packages)
    assert (out / "index.html").is_file()
    for module_name, page in zip(packages, pages):
        assert page.is_file(), f"no API page for {module_name} ({page})"
        html = page.read_text(encoding="utf-8")
        names = getattr(importlib.import_module(module_name), "__all__", [])
        missing = [name for name in names if f'id="{name}"' not in html]
        assert not missing, f"{page.name}: names of {module_name}.__all__ not documented: {missing}"


@pytest.mark.slow  # pdoc renders every public package: seconds
def test_api_reference_has_a_page_per_public_package_with_every_name(tmp_path: Path) -> None:
    check_api_pages(tmp_path, gen_api.PUBLIC_PACKAGES)


def test_the_api_reference_builds_a_page_with_every_name(tmp_path: Path) -> None:
    """The fast set's share of the build above: one small package through the same generator."""
    check_api_pages(tmp_path, ("tierflow.errors",))


def test_every_stage_package_is_in_the_api_reference() -> None:
    import tierflow

    packages = {f"tierflow.{m.name}" for m in pkgutil.iter_modules(tierflow.__path__) if not m.name.startswith("_")}
    unlisted = packages - set(gen_api.PUBLIC_PACKAGES) - set(gen_api.LEFT_OUT)
    assert not unlisted, f"add {sorted(unlisted)} to PUBLIC_PACKAGES (or LEFT_OUT) in docs/gen_api.py"


# ---------------------------------------------------------------------------- CLI reference


def test_cli_reference_is_generated_from_the_current_parser() -> None:
    expected = gen_cli.build()
    actual = (DOCS / "cli.md").read_text(encoding="utf-8")
    if actual != expected:
        diff = "".join(
            list(difflib.unified_diff(actual.splitlines(True), expected.splitlines(True), "docs/cli.md", "generated"))[
                :60
            ]
        )
        pytest.fail(f"docs/cli.md is behind the CLI's parser: run `make docs` and commit docs/cli.md\n{diff}")


def test_cli_reference_covers_every_verb_and_option() -> None:
    from tierflow.commands.cli import build_parser

    parser = build_parser()
    text = gen_cli.render(parser)
    for prog, sub, _ in gen_cli.walk(parser, parser.prog):
        assert f"`{prog}`" in text
        for action in gen_cli.arguments(sub):
            for flag in action.option_strings:
                assert flag in text, f"{prog} {flag} missing from the generated reference"
    verbs = {"pack", "inspect", "verify", "gc", "cache", "plan", "bench", "report", "top", "demo"}
    assert verbs <= {prog.split()[1] for prog, _, _ in gen_cli.walk(parser, parser.prog) if " " in prog}


def test_every_cli_argument_has_help_text() -> None:
    from tierflow.commands.cli import build_parser

    missing = gen_cli.missing_help(build_parser())
    assert not missing, "CLI arguments without help text (commands/cli.py): " + ", ".join(missing)


# ---------------------------------------------------------------------------- runnable docs


def runnable_blocks(page: Path) -> list[str]:
    return TESTED_BLOCK.findall(page.read_text(encoding="utf-8"))


def run_tested_blocks(page: Path, cwd: Path, env: dict[str, str] | None = None, timeout: float = 240) -> str:
    blocks = runnable_blocks(page)
    assert blocks, f"{page.name} has no ```python tested blocks"
    script = cwd / f"_{page.stem}_tested.py"
    script.write_text("\n\n".join(blocks), encoding="utf-8")
    child_env = {**os.environ, **(env or {})}
    src = str(Path(__file__).resolve().parents[1] / "src")
    child_env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [child_env.get("PYTHONPATH")])])
    proc = subprocess.run(
        [sys.executable, script.name], cwd=cwd, env=child_env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, (
        f"the `python tested` blocks of docs/{page.name} failed (rc {proc.returncode}); "
        f"the script is {script}\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}"
    )
    return proc.stdout


def make_images(root: Path, count: int = 48) -> None:
    """PNGs of assorted sizes, each with a `.txt` caption; a few with a `.json` sidecar instead."""
    from PIL import Image

    rng = np.random.default_rng(7)
    root.mkdir(parents=True)
    for i in range(count):
        w, h = int(rng.integers(40, 120)), int(rng.integers(40, 120))
        gradient = np.linspace(0, 255, w, dtype=np.float64)[None, :, None] * np.ones((h, 1, 3))
        pixels = (gradient + rng.integers(0, 40, (h, w, 3))).clip(0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(root / f"{i:04d}.png")
        if i % 8 == 7:
            (root / f"{i:04d}.json").write_text(json.dumps({"caption": f"a gradient, {w}x{h}", "width": w}))
        else:
            (root / f"{i:04d}.txt").write_text(f"gradient number {i}, {w} by {h}\n")


def make_corpus(root: Path, files: int = 4, records: int = 150) -> None:
    """JSONL files of {"id", "text"} records, ~300 KB in all."""
    rng = np.random.default_rng(3)
    words = ("tier", "shard", "cache", "epoch", "stream", "order", "batch", "token", "node", "disk")
    root.mkdir(parents=True)
    for f in range(files):
        with open(root / f"part-{f:03d}.jsonl", "w", encoding="utf-8") as out:
            for r in range(records):
                text = " ".join(words[int(i)] for i in rng.integers(0, len(words), int(rng.integers(20, 180))))
                out.write(json.dumps({"id": f * records + r, "text": text}) + "\n")


def test_tested_blocks_convention_is_used_on_the_recipe_pages() -> None:
    for name in ("multimodal.md", "coming-from.md"):
        assert runnable_blocks(DOCS / name), f"docs/{name}: no ```python tested blocks"
    for page in DOCS.glob("*.md"):
        for info in ANY_BLOCK.findall(page.read_text(encoding="utf-8")):
            assert info != "python-tested", f"docs/{page.name}: write ```python tested (a space)"


@pytest.mark.slow  # a fresh interpreter whose loaders start DataLoader workers: seconds
def test_multimodal_recipe_runs(tmp_path: Path) -> None:
    pytest.importorskip("PIL", reason="the recipe decodes with Pillow")
    make_images(tmp_path / "images")
    run_tested_blocks(DOCS / "multimodal.md", tmp_path)


@pytest.mark.slow  # its loaders start forkserver workers over S3 twice, each importing torch: seconds
def test_coming_from_tierflow_column_runs_against_s3(tmp_path: Path, s3_server) -> None:
    client = s3_server.endpoint.boto3_client()
    client.create_bucket(Bucket="my-bucket")
    try:
        make_corpus(tmp_path / "corpus")
        run_tested_blocks(DOCS / "coming-from.md", tmp_path, env=s3_server.endpoint.env())
    finally:
        s3_server.delete_bucket("my-bucket")


# ---------------------------------------------------------------------------- names the pages use

OTHER_TOOLS_FLAGS = {"--num-cpus"}  # Ray's, named in the prose of scale-out.md
"""Flags of other tools a page names in its prose (outside their own command lines)."""


def _cli_flags() -> dict[str, set[str]]:
    from tierflow.commands.cli import build_parser

    parser = build_parser()
    flags = {}
    for prog, sub, _ in gen_cli.walk(parser, parser.prog):
        verb = prog.split()[1] if " " in prog else ""
        flags[verb] = {flag for action in gen_cli.arguments(sub) for flag in action.option_strings}
    return flags


@pytest.mark.parametrize("page", ["scale-out.md", "tiers.md"])
def test_the_flags_variables_and_tier_specs_a_page_names_exist(page: str) -> None:
    """Every `tierflow VERB --flag` is that verb's, every flag named in prose is tierflow's (or a
    listed tool's), every TIERFLOW_ variable is read by the code, every tier spec parses."""
    from tierflow.tiers import TierConfig

    text = (DOCS / page).read_text(encoding="utf-8").replace("\\\n", " ")
    flags = _cli_flags()
    every = set().union(*flags.values())
    verbs = "|".join(v for v in flags if v)
    for verb, rest in re.findall(rf"\btierflow ({verbs})\b([^\n`]*)", text):
        for flag in re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", rest):
            assert flag in flags[verb], f"docs/{page}: tierflow {verb} has no {flag}"
    for flag in re.findall(r"`(--[a-z][a-z-]*)[^`]*`", text):
        assert flag in every | OTHER_TOOLS_FLAGS, f"docs/{page}: no command of tierflow has {flag}"
    source = "\n".join(p.read_text(encoding="utf-8") for p in (DOCS.parent / "src" / "tierflow").rglob("*.py"))
    for variable in set(re.findall(r"\bTIERFLOW_[A-Z_]+\b", text)):
        assert variable in source, f"docs/{page}: {variable} is read nowhere in src/tierflow"
    specs = re.findall(r"\bL[0-4]=[^\s\"'`),]+", text)
    assert specs or page != "scale-out.md"
    for spec in specs:
        TierConfig.parse(spec.rstrip(".:;"))
