"""Branch-only coverage (covered branches / all branches) per package, from `coverage json`'s report.

coverage.py's own "Cover" column mixes statements and branches; issue 18 holds format/, tiers/ and
checkpoint/ to >= 95% of their branches, so `make test` prints this beside it:

    coverage json -q -o .coverage-data/coverage.json && python .ci/branch_coverage.py .coverage-data/coverage.json
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def main(path: str) -> None:
    with open(path) as f:
        files = json.load(f)["files"]
    packages: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for name, data in files.items():
        package = name.split("tierflow/", 1)[-1].split("/", 1)[0]
        summary = data["summary"]
        for key in (package, "total"):
            packages[key][0] += summary["covered_branches"]
            packages[key][1] += summary["num_branches"]
    print("branch-only coverage (covered / all branches):")
    for package in sorted(packages, key=lambda p: (p == "total", p)):
        covered, total = packages[package]
        print(
            f"  {package + '/' if package != 'total' else 'total':<12} {covered:>5} / {total:<5} "
            f"{100 * covered / total if total else 100.0:5.1f}%"
        )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".coverage-data/coverage.json")
