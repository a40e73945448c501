"""A tier as a user writes it: `TierConfig("L2", "/nvme/tf", "30%")` or `"L2=/nvme/tf:50GB:auto:at_rest"`.

Capacities are on the user's yardstick: `"30%"` (or `0.3`) is 30% of the dataset's bytes at rest,
what was uploaded (`du` of the packed dataset, `aws s3 ls --summarize`); `"30%disk"` is 30% of the
tier's disk (free space + the tier's own use at start); bytes are bytes (`"50GB"`, `5e10`). The
form defaults to `auto`: shards kept at rest (compressed) unless the tier holds the whole dataset
decoded (docs/tiers.md, "Forms by what fits"). Both are resolved when the dataset is known
(`resolve`, which `build_stack` calls with the dataset's manifest).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tierflow._sizes import parse_size
from tierflow.telemetry import MetricsRegistry
from tierflow.format.shard import Form
from tierflow.tiers.capacity import is_tmpfs
from tierflow.tiers.tier import Tier, tier_form

NODE_PLACEHOLDER = "{node}"


class DatasetShare(float):
    """A capacity that is a share of the dataset's bytes at rest (`"30%"`, `0.3`; may exceed 1:
    `"120%"`), made bytes by `TierConfig.resolve` once the dataset is known."""

    def __repr__(self) -> str:
        return f"DatasetShare({float(self)!r})"

    def of(self, dataset_at_rest: int) -> int:
        return max(1, int(round(float(self) * dataset_at_rest)))


class DiskShare(float):
    """A capacity that is a share of the tier's disk (`"30%disk"`): free space + the tier's own use at
    start (`Tier` reads a float in (0, 1] so)."""

    def __repr__(self) -> str:
        return f"DiskShare({float(self)!r})"


AUTO_FORM = "auto"
"""`TierConfig.form`'s default: at rest unless the tier holds the whole dataset decoded."""


def parse_capacity(value: str | float) -> float:
    """A tier capacity: bytes (`"50GB"`, 5e10, any number above 1), a share of the dataset's bytes at
    rest (`"30%"`, `"120%"`, 0.3: a `DatasetShare`), or a share of the disk (`"30%disk"`: a plain
    float in (0, 1], which `Tier` reads as free space + its own use)."""
    if isinstance(value, (DatasetShare, DiskShare)):
        return value
    text = value.strip().lower().replace(" ", "") if isinstance(value, str) else None
    if text is not None and (text.endswith("%disk") or text.endswith("%")):
        disk = text.endswith("%disk")
        digits = text[:-5] if disk else text[:-1]
        if not _is_number(digits):
            raise ValueError(f"capacity {value!r}: expected a share like 30% (of the dataset at rest) or 30%disk")
        share = float(digits) / 100
        if disk and not 0 < share <= 1:
            raise ValueError(f"capacity {value!r}: a share of the disk must be in (0%, 100%]")
        if share <= 0:
            raise ValueError(f"capacity {value!r} must be positive")
        return DiskShare(share) if disk else DatasetShare(share)
    number = float(value) if not isinstance(value, str) or _is_number(value) else float(parse_size(value))
    if number <= 0:
        raise ValueError(f"capacity {value!r} must be positive")
    return DatasetShare(number) if number <= 1 else number


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


@dataclass
class TierConfig:
    """One tier: a directory shared by every job on the node, its capacity, policy and form.

    `capacity` is bytes (`5e10`, `"50GB"`), a share of the dataset's bytes at rest (`"30%"`, `0.3`,
    `"120%"`) or a share of the disk (`"30%disk"`: free space + the tier's own usage at start). `form`
    is `at_rest`, `decoded` or `auto` (at rest unless the tier holds the whole dataset decoded). A
    share of the dataset and `auto` are resolved by `resolve` (build_stack does). A `{node}` in `path` ("/nvme/tf-{node}") becomes the node index,
    so nodes that share a file system (or a test on one machine) each keep their own directory;
    `open_loader` fills it in from the environment (loader.topology.node_index).
    """

    name: str
    path: str
    capacity: float | str
    policy: str = "auto"
    form: Form | str = AUTO_FORM  # a string is converted (configs, the CLI); auto: see `resolve`
    policy_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.capacity = parse_capacity(self.capacity)
        if self.form != AUTO_FORM:
            self.form = tier_form(self.form, self.name)

    @property
    def resolved(self) -> bool:
        """Capacity and form known without the dataset."""
        return not isinstance(self.capacity, DatasetShare) and self.form != AUTO_FORM

    def resolve(self, at_rest_bytes: int, decoded_bytes: int, node: int | None = None) -> TierConfig:
        """This tier for a dataset of `at_rest_bytes` (`decoded_bytes` decoded): a share of the dataset
        made bytes, and `auto` made a form by what fits: `decoded` where the capacity holds the whole
        decoded dataset, else `at_rest` (a disk budget keeps as much of the dataset as it can)."""
        current = self.capacity
        assert not isinstance(current, str), "parsed by __post_init__"
        capacity = float(current.of(at_rest_bytes)) if isinstance(current, DatasetShare) else current
        form = self.form
        if form == AUTO_FORM:
            where = _existing(self.for_node(node).path)
            room = capacity if capacity > 1 else int(float(capacity) * shutil.disk_usage(where).free)
            # RAM (a tmpfs L1) holds decoded blocks, where they are reused; a disk keeps what fits at rest
            form = Form.DECODED if room >= decoded_bytes or is_tmpfs(where) else Form.AT_REST
        return replace(self, capacity=capacity, form=form)

    @classmethod
    def parse(cls, spec: str) -> TierConfig:
        """`NAME=PATH[:CAPACITY[:POLICY[:FORM]]]`, e.g. `L2=/nvme/tf:30%:auto:at_rest`, `L1=/dev/shm/tf:8G`."""
        name, _, rest = spec.partition("=")
        parts = rest.split(":")
        if not name or not parts[0]:
            raise ValueError(f"tier {spec!r}: expected NAME=PATH[:CAPACITY[:POLICY[:FORM]]]")
        capacity = parts[1] if len(parts) > 1 and parts[1] else "50%disk"
        try:
            return cls(
                name,
                parts[0],
                capacity,
                policy=parts[2] if len(parts) > 2 and parts[2] else "auto",
                form=parts[3] if len(parts) > 3 and parts[3] else AUTO_FORM,
            )
        except ValueError as e:
            raise ValueError(f"tier {spec!r}: {e}") from None

    def for_node(self, node: int | None) -> TierConfig:
        """This tier on node `node`: `{node}` in the path replaced (the same config where there is none)."""
        if NODE_PLACEHOLDER not in self.path:
            return self
        if node is None:
            raise ValueError(
                f"tier {self.name} path {self.path!r} has {NODE_PLACEHOLDER} but no node index is known "
                f"here: open_loader fills it in from GROUP_RANK / NODE_RANK, build_stack takes node=; "
                f"on the command line give the node's own path"
            )
        return replace(self, path=self.path.replace(NODE_PLACEHOLDER, str(int(node))))

    def build(self, registry: MetricsRegistry | None = None, node: int | None = None, configure: bool = True) -> Tier:
        """The tier itself; `node` fills a `{node}` placeholder in the path; `configure`: see Tier."""
        if NODE_PLACEHOLDER in self.path:
            return self.for_node(node).build(registry, configure=configure)
        capacity, form = self.capacity, self.form
        if isinstance(capacity, DatasetShare):
            if configure:
                raise ValueError(
                    f"tier {self.name}: capacity {float(capacity):.0%} is a share of the dataset at rest: "
                    f"resolve(at_rest_bytes, decoded_bytes) first (build_stack does), or give bytes "
                    f'or a share of the disk ("30%disk")'
                )
            capacity = min(1.0, float(capacity))  # a look (tierflow cache ls|evict|clean): the directory's config rules
        if form == AUTO_FORM:  # no dataset to measure against: RAM keeps decoded blocks, a disk keeps shards at rest
            form = Form.DECODED if is_tmpfs(_existing(self.path)) else Form.AT_REST
        return Tier(
            self.path,
            float(capacity),
            policy=self.policy,
            form=form,
            name=self.name,
            registry=registry,
            policy_options=self.policy_options,
            configure=configure,
        )


def _existing(path: str) -> Path:
    """`path` or its nearest existing parent (a tier directory not made yet is on its parent's disk)."""
    where = Path(path)
    while not where.exists() and where != where.parent:
        where = where.parent
    return where
