"""Instructions per batch of the loader with telemetry on and off (issue 17's cost), counted by callgrind.

Wall-clock on a shared machine drifts by more than the cost being measured; instructions do not (to
~0.3k a batch between runs with the hash seed fixed). The parent packs the benchmark's token dataset
(`telemetry.warm_token_dataset`) and warms its L1, then runs itself under
`valgrind --tool=callgrind --collect-atstart=no --toggle-collect=functools_reduce`, once with telemetry
on and once off, side by side: each child reads 300 warm batches of an inline-feed Loader (no step), then
`BATCHES` more inside `functools.reduce`, the only part callgrind counts. Prints instructions per batch,
on, off and the difference; `--keep DIR` keeps the callgrind outputs (callgrind_annotate them).
Run: .venv/bin/python benchmarks/telemetry_callgrind.py [--keep DIR]   (a few minutes: valgrind is slow)
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

BATCHES = 1024
WARM = 300


def child(path: str, l1_path: str, on: bool) -> None:
    from tierflow.loader import Loader
    from tierflow.tiers import TierConfig
    from warm import warm_dataset
    from telemetry import LOADER_BATCH, LOADER_SEQ_LEN

    l1 = TierConfig("L1", l1_path, 4 << 30, policy="lru", form="decoded")
    dataset = warm_dataset(path, l1, batch_size=LOADER_BATCH, seq_len=LOADER_SEQ_LEN, partitions=4)
    with Loader(dataset, "cpu", telemetry=on, endless=True, background=False) as loader:
        batches = iter(loader)
        for _ in range(WARM):
            next(batches)
        functools.reduce(lambda _, __: next(batches), range(BATCHES), None)


def main(keep: str | None) -> None:
    from telemetry import warm_token_dataset
    from warm import remove_l1

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(keep) if keep else Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        path, l1 = warm_token_dataset(Path(tmp))
        try:
            runs = {}
            for mode in ("on", "off"):
                runs[mode] = subprocess.Popen(
                    [
                        "valgrind",
                        "--tool=callgrind",
                        "--collect-atstart=no",
                        "--toggle-collect=functools_reduce",
                        f"--callgrind-out-file={out / f'callgrind.{mode}'}",
                        sys.executable,
                        __file__,
                        "--child",
                        str(path),
                        l1.path,
                        mode,
                    ],
                    env={**os.environ, "PYTHONHASHSEED": "0"},
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            counted = {}
            for mode, run in runs.items():
                _, err = run.communicate()
                found = re.search(r"Collected : (\d+)", err)
                if run.returncode or not found:
                    raise RuntimeError(f"callgrind run ({mode}) failed:\n{err[-2000:]}")
                counted[mode] = int(found.group(1)) / BATCHES
        finally:
            remove_l1(l1)
    on, off = counted["on"], counted["off"]
    print(
        f"instructions per batch, {BATCHES} warm batches, inline feed, no step (callgrind): "
        f"on {on / 1e3:.1f}k, off {off / 1e3:.1f}k, on - off {(on - off) / 1e3:.1f}k ({on / off - 1:.2%})"
    )


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], sys.argv[3], sys.argv[4] == "on")
    else:
        main(sys.argv[sys.argv.index("--keep") + 1] if "--keep" in sys.argv else None)
