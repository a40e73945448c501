"""The first batch in two lines: `open_loader` over a local path with no tier vocabulary, and over
s3:// with an L2 given as a string; capacities as users write them."""

import numpy as np
import pytest

import tierflow
from tierflow.storage.remote import upload_dataset
from tierflow.tiers import DatasetShare, DiskShare, TierConfig, parse_capacity, parse_size


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> str:
    src = tmp_path_factory.mktemp("src") / "docs.jsonl"
    src.write_text("".join(f'{{"text": "document {i} {"x" * (i % 200)}"}}\n' for i in range(6000)))
    out = str(tmp_path_factory.mktemp("ds") / "tokens")
    tierflow.pack([str(src)], out, tokenizer="bytes", target_shard_bytes=256 << 10, workers=1)
    return out


def first_epoch(loader, limit=10_000):
    seen = []
    for batch in loader:
        seen.append(np.asarray(batch["input_ids"]))
        if len(seen) >= limit:
            break
    return seen


def test_a_local_path_needs_no_tiers(tokens):
    loader = tierflow.open_loader(tokens, batch_size=4, seq_len=32, max_batches=5)
    batches = first_epoch(loader)
    assert len(batches) == 5 and all(b.shape == (4, 32) for b in batches)
    assert loader.stager is None
    loader.close()


def test_s3_with_an_l2_string_reads_what_the_local_path_reads(tokens, s3_server, s3_bucket, tmp_path):
    url = f"s3://{s3_bucket}/tokens"
    upload_dataset(tokens, url, endpoint_url=s3_server.endpoint_url)
    local = first_epoch(
        tierflow.open_loader(tokens, batch_size=4, seq_len=32, max_batches=12, lanes=1, window_shards=1)
    )
    remote = tierflow.open_loader(
        url,
        tiers=[f"L2={tmp_path / 'l2'}:30%"],
        endpoint_url=s3_server.endpoint_url,
        batch_size=4,
        seq_len=32,
        max_batches=12,
        lanes=1,
        window_shards=1,
    )
    assert remote.stager is not None
    got = first_epoch(remote)
    remote.close()
    assert len(got) == 12 and all(np.array_equal(a, b) for a, b in zip(local, got))


def test_resume_continues_after_the_saved_batch(tokens):
    whole = first_epoch(tierflow.open_loader(tokens, batch_size=4, seq_len=32, max_batches=8))
    first = tierflow.open_loader(tokens, batch_size=4, seq_len=32, max_batches=3)
    first_epoch(first)
    rest = first_epoch(tierflow.open_loader(tokens, batch_size=4, seq_len=32, max_batches=5, resume=first.state_dict()))
    assert all(np.array_equal(a, b) for a, b in zip(whole[3:], rest)) and len(rest) == 5


@pytest.mark.parametrize(
    "text,expected",
    [
        ("50GB", 50 * 10**9),
        ("50GiB", 50 << 30),
        ("8G", 8 << 30),
        ("512k", 512 << 10),
        ("1e6", 10**6),
        ("64 MB", 64 * 10**6),
    ],
)
def test_sizes_are_read_as_users_write_them(text, expected):
    assert parse_size(text) == expected


def test_capacities_take_shares_and_sizes_and_refuse_nonsense():
    assert parse_capacity("30%") == pytest.approx(0.3) and parse_capacity(0.8) == 0.8
    assert parse_capacity("2GB") == 2e9
    tier = TierConfig.parse("L2=/nvme/tf:30%:lru:at_rest")
    assert (tier.name, tier.path, tier.capacity, tier.policy, tier.form) == ("L2", "/nvme/tf", 0.3, "lru", "at_rest")
    # a share is of the dataset's bytes at rest (may exceed it); "%disk" names the disk's share
    assert isinstance(parse_capacity("30%"), DatasetShare) and parse_capacity("150%") == pytest.approx(1.5)
    assert isinstance(parse_capacity("30%disk"), DiskShare) and parse_capacity("30% disk") == pytest.approx(0.3)
    assert TierConfig.parse("L2=/nvme/tf").capacity == DiskShare(0.5)  # no capacity: half the disk, as before
    resolved = TierConfig.parse("L2=/nvme/tf:30%").resolve(1000, 7000)
    assert (resolved.capacity, resolved.form) == (300, "at_rest")  # 30% of the bytes at rest, kept compressed
    assert TierConfig.parse("L2=/nvme/tf:800%").resolve(1000, 7000).form == "decoded"  # holds it all decoded
    for bad in ("150%disk", "-1", "lots", "0", "0%", "x%"):
        with pytest.raises(ValueError, match="capacity|size"):
            parse_capacity(bad)
    with pytest.raises(ValueError, match="NAME=PATH"):
        TierConfig.parse("/nvme/tf")


UNGUARDED = """
import tierflow, sys
loader = tierflow.open_loader(sys.argv[1], batch_size=4, seq_len=32, num_workers=2,
                              multiprocessing_context="forkserver")
for batch in loader:
    break
"""


@pytest.mark.slow
def test_a_script_without_a_main_guard_is_told_why_its_workers_die(tokens, tmp_path):
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(UNGUARDED)
    done = subprocess.run([sys.executable, str(script), tokens], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "MainGuardError" in done.stderr and 'if __name__ == "__main__":' in done.stderr


@pytest.mark.slow
def test_a_reading_process_loads_none_of_packs_input_readers():
    """Every reading process (a DataLoader worker too) carries what `import tierflow` loads: Arrow's
    Parquet, JSON and filesystem modules are ~4.5 MB of each one's PSS and only `pack` reads them."""
    import subprocess
    import sys

    script = (
        "import sys\nimport tierflow\nfrom tierflow.loader import open_loader\n"
        "print(sorted(m for m in ('pyarrow.parquet', 'pyarrow.json', 'pyarrow.fs', "
        "'concurrent.futures.process') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


EXIT_AFTER_WITH = """
import sys
import tierflow
with tierflow.open_loader(sys.argv[1], batch_size=8, seq_len=64, tiers=[f"L2={sys.argv[2]}:50%"]) as loader:
    for step, batch in enumerate(loader):
        if step == 3:
            break
"""
EXIT_UNCLOSED = """
import sys
import tierflow
loader = tierflow.open_loader(sys.argv[1], batch_size=8, seq_len=64, tiers=[f"L2={sys.argv[2]}:50%"])
for step, batch in enumerate(loader):
    if step == 3:
        break
"""


@pytest.mark.slow
@pytest.mark.parametrize("script", [EXIT_AFTER_WITH, EXIT_UNCLOSED], ids=["closed", "never-closed"])
def test_a_script_that_closed_its_loader_exits_without_a_traceback(tokens, tmp_path, script):
    """The Loader is collected at interpreter exit, closed or not (a notebook's or a script's global):
    closing the stager then must not reach module globals the interpreter has already torn down
    ("Exception ignored in Loader.__del__")."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "PYTHONPATH": str(Path(tierflow.__file__).parents[1])}
    done = subprocess.run(
        [sys.executable, "-c", script, tokens, str(tmp_path / "l2")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr


READ_TOKENS_AND_TEXT = """
import sys
import tierflow
for batch in tierflow.open_loader(sys.argv[1], batch_size=4, seq_len=32, max_batches=20):
    pass
for batch in tierflow.open_loader(sys.argv[2], batch_size=4, max_batches=20):
    assert isinstance(batch["text"][0], str)
print(sorted(m for m in ("pandas", "pyarrow.compute") if m in sys.modules))
"""


@pytest.mark.slow
def test_reading_tokens_and_text_loads_no_pandas(tokens, tmp_path):
    """pyarrow's `Array.to_numpy` imports pandas: ~0.2 s before the first batch and ~57 MB in every
    reading process. The read path takes numpy views of Arrow buffers instead."""
    import subprocess
    import sys

    src = tmp_path / "docs.jsonl"
    src.write_text("".join(f'{{"text": "document {i}"}}\n' for i in range(500)))
    text = str(tmp_path / "text")
    tierflow.pack([str(src)], text, workers=1)
    script = tmp_path / "read.py"
    script.write_text(READ_TOKENS_AND_TEXT)
    done = subprocess.run([sys.executable, str(script), tokens, text], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
