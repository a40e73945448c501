"""The dependency ranges pip can check (issue 35): numpy 1.x beside pyarrow 26 installed with
`pip check` clean and did not import; the frameworks extra installs with `.[dev]`."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from harness import ROOT

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def requirement(name: str, requirements: list[str]) -> Requirement:
    found = [Requirement(r) for r in requirements if Requirement(r).name == name]
    assert found, f"{name} not in {requirements}"
    return found[0]


def test_numpy_and_pyarrow_ranges_admit_only_pairs_that_import():
    """numpy >= 2 only, and a pyarrow built against numpy 2 (16+): no resolvable pair fails to import."""
    numpy = requirement("numpy", PROJECT["dependencies"])
    pyarrow = requirement("pyarrow", PROJECT["dependencies"])
    assert not numpy.specifier.contains("1.26.4") and numpy.specifier.contains("2.0.0")
    assert not pyarrow.specifier.contains("15.0.2") and pyarrow.specifier.contains("16.0.0")


def test_dev_installs_the_frameworks_and_no_torchvision():
    extras = PROJECT["optional-dependencies"]
    assert "frameworks" in Requirement(extras["dev"][0]).extras
    names = {Requirement(r).name for r in extras["frameworks"]}
    assert {"lightning", "transformers", "accelerate", "litgpt", "torchtitan"} <= names
    # PyPI's torchvision cannot load beside the CPU torch that constraints.txt pins
    assert importlib.util.find_spec("torchvision") is None


def test_the_installed_environment_passes_pip_check():
    done = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    import numpy
    import pyarrow

    assert Version(numpy.__version__) >= Version("2") and Version(pyarrow.__version__) >= Version("16")
