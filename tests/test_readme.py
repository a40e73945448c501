"""README's Python usage block, extracted from README.md and run as written, so the README cannot
drift from the code. Only what a test machine cannot have is substituted, each spelled out here:
the bucket (a fresh one on the loopback moto server, whose endpoint the block gets from
AWS_ENDPOINT_URL_S3 as the README says) and the L2 path (/nvme/tierflow -> a temporary folder).

The block runs in this process (its own globals, the temporary folder as working directory): a
fresh interpreter would cost more than the block itself. tests/test_docs.py runs its pages' blocks
in fresh interpreters, which is where `import tierflow` from nothing is exercised."""

from __future__ import annotations

import json
import re
from pathlib import Path
from collections.abc import Callable

import pytest
import torch

import tierflow

ROOT = Path(__file__).resolve().parents[1]


def usage_blocks() -> list[str]:
    """The ```python blocks of README's 'Using it' section, in order."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Using it") : text.index("## Benchmarks")]
    blocks = re.findall(r"^```python\n(.*?)^```$", section, re.MULTILINE | re.DOTALL)
    assert blocks, "README.md's 'Using it' section has no ```python block"
    return blocks


def usage_block() -> str:
    return usage_blocks()[0]


def run_usage(tmp_path, s3_server, monkeypatch) -> tuple[dict, Callable[[str], str]]:
    """README's first block run on a fresh bucket: its globals, and how a block's paths are substituted."""
    bucket = s3_server.create_bucket("readme")

    def substituted(code: str) -> str:
        assert "s3://my-bucket/" in code and "/nvme/" in code  # what is substituted below
        return code.replace("s3://my-bucket/", f"s3://{bucket}/").replace("/nvme/", f"{tmp_path}/nvme/")

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for part in range(3):
        with open(corpus / f"part-{part}.jsonl", "w") as f:
            for i in range(400):
                f.write(json.dumps({"text": f"document {part}-{i}: " + "lorem ipsum " * (20 + i % 40)}) + "\n")
    for name, value in s3_server.endpoint.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL")  # only the variable the README names
    monkeypatch.chdir(tmp_path)
    block: dict = {"__name__": "__main__"}
    exec(compile(substituted(usage_block()), "README.md (Using it)", "exec"), block)
    return block, substituted


def test_the_readme_usage_block_runs_as_written(tmp_path, s3_server, monkeypatch):
    block, _ = run_usage(tmp_path, s3_server, monkeypatch)
    assert block["epoch"] + 1 == 2 and block["state"]["consumed"] > 0
    assert (tmp_path / "nvme" / "tierflow").is_dir()  # the L2 was used


@pytest.mark.slow  # ~6 s: the fast set keeps the usage block above
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_readme_checkpoint_block_commits_then_resumes_where_it_stopped(tmp_path, s3_server, monkeypatch):
    """Run once, the block trains an epoch and commits every 10 steps (uploaded to the bucket); run
    again, as after a crash, it resumes from the newest step and ends the epoch at the same step,
    which it reaches only if the stream continued where it stopped (from the start it would run a
    whole epoch past it)."""
    block, substituted = run_usage(tmp_path, s3_server, monkeypatch)
    ckpt_block = next(b for b in usage_blocks() if "CheckpointStore" in b)
    code = compile(substituted(ckpt_block), "README.md (checkpoints)", "exec")
    exec(code, block)
    last = block["step"]
    assert last >= 10 and last % 10 and block["ckpt"].latest() == last - last % 10  # steps left after it
    from tierflow.checkpoint import CheckpointStore

    fresh = CheckpointStore(block["ckpt"].dest, tmp_path / "fresh-node")
    assert fresh.latest() == last - last % 10  # at the destination too
    exec(code, block)
    assert block["step"] == last


@pytest.mark.slow
def test_the_readme_images_block_runs_as_written_on_the_cpu(tmp_path, monkeypatch):
    """README's images block on a folder of 70 captioned JPEGs, with device="cuda" read as "cpu"."""
    from corpora import jpeg

    images = tmp_path / "images"
    images.mkdir()
    for i in range(70):
        (images / f"{i:03d}.jpg").write_bytes(jpeg(40 + i, 200 - i, i))
        (images / f"{i:03d}.txt").write_text(f"picture {i}")
    block_code = next(b for b in usage_blocks() if "ImagePipeline" in b)
    assert 'device="cuda"' in block_code
    monkeypatch.chdir(tmp_path)
    block: dict = {"__name__": "__main__", "tierflow": tierflow}
    exec(compile(block_code.replace('device="cuda"', 'device="cpu"'), "README.md (images)", "exec"), block)
    batch, x = block["batch"], block["x"]
    assert x.dtype == torch.float32 and x.shape == (64, 3, 224, 224)
    assert batch["caption_ids"].shape == (64, 77) and len(batch["caption"]) == 64
    assert all(
        ids[: n - 1].tolist() == list(text.encode())
        for ids, n, text in zip(batch["caption_ids"], batch["caption_length"].tolist(), batch["caption"])
    )
    block["loader"].close()
