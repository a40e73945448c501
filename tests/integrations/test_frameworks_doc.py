"""docs/frameworks.md's recipes, each run as written in a fresh interpreter (bash for litgpt's
CLI, with this interpreter's bin/ first on PATH). Substituted, and only
this: the dataset path (/data/packed -> a small packed dataset), the Trainer's 2 epochs (->
20 steps), and TORCHDYNAMO_DISABLE=1 in the environment (litgpt's pretraining torch.compiles the
model, minutes on a CPU for nothing these checks need)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from harness import ROOT

pytestmark = pytest.mark.slow  # each recipe starts a framework in a fresh interpreter

DOC = ROOT / "docs" / "frameworks.md"
SUBSTITUTED = {"num_train_epochs=2": "max_steps=20"}


def recipes() -> dict[str, tuple[str, str]]:
    """{section title: (language, its ```python or ```bash block)} for each section with one."""
    text = DOC.read_text()
    out = {}
    for section in re.split(r"^## ", text, flags=re.MULTILINE)[1:]:
        title = section.splitlines()[0].strip()
        blocks = re.findall(r"^```(python|bash)\n(.*?)^```$", section, re.MULTILINE | re.DOTALL)
        if blocks:
            assert len(blocks) == 1, f"{title}: one recipe per framework"
            out[title] = blocks[0]
    return out


FRAMEWORK = {
    "PyTorch Lightning": "lightning",
    "The transformers `Trainer`": "transformers",
    "accelerate": "accelerate",
    "litgpt": "litgpt",
    "torchtitan": "torchtitan",
}


def test_every_framework_has_a_recipe():
    assert set(recipes()) == set(FRAMEWORK)


@pytest.mark.parametrize("title", list(FRAMEWORK))
def test_recipe_runs(title, corpus, tmp_path):
    if importlib.util.find_spec(FRAMEWORK[title]) is None:
        pytest.skip(f"{FRAMEWORK[title]} is not installed")
    language, code = recipes()[title]
    code = code.replace("/data/packed", corpus)
    for a, b in SUBSTITUTED.items():
        code = code.replace(a, b)
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "src"),
        "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]),
        "TORCHDYNAMO_DISABLE": "1",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "WANDB_MODE": "disabled",
    }
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    command = [sys.executable, "-c", code] if language == "python" else ["bash", "-ec", code]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"docs/frameworks.md, {title}:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
