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

ROOT = Path(__file__).resolve().parents[1]


def usage_block() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Using it"):]
    match = re.search(r"^```python\n(.*?)^```$", section, re.MULTILINE | re.DOTALL)
    assert match, "README.md's 'Using it' section has no ```python block"
    return match.group(1)


def test_the_readme_usage_block_runs_as_written(tmp_path, s3_server, monkeypatch):
    code = usage_block()
    assert "s3://my-bucket/" in code and "/nvme/tierflow" in code  # what is substituted below
    bucket = s3_server.create_bucket("readme")
    code = code.replace("s3://my-bucket/", f"s3://{bucket}/").replace("/nvme/tierflow", str(tmp_path / "nvme"))
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
    exec(compile(code, "README.md (Using it)", "exec"), block)
    assert block["epoch"] + 1 == 2 and block["state"]["consumed"] > 0
    assert (tmp_path / "nvme").is_dir()  # the L2 was used
