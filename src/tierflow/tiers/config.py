"""A tier as a user writes it: `TierConfig("L2", "/nvme/tf", "30%")` or `"L2=/nvme/tf:50GB:auto:at_rest"`."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

from tierflow.telemetry import MetricsRegistry
from tierflow.format.shard import Form
from tierflow.tiers.tier import Tier, tier_form

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "b": 1}
NODE_PLACEHOLDER = "{node}"
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_size(text: str | float) -> int:
    """Bytes from `"50GB"` (10^9), `"50GiB"` or `"50G"` (2^30), `"512k"`, `"1e6"` or a number."""
    if isinstance(text, (int, float)):
        return int(text)
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size (like 512MB, 50GiB, 8G or 1e9 bytes)")
    return int(float(match.group(1)) * _UNITS[unit])


def parse_capacity(value: str | float) -> float:
    """A tier capacity: bytes (`"50GB"`, 5e10) or a share of the disk (`"30%"`, 0.3)."""
    if isinstance(value, str) and value.strip().endswith("%"):
        share = float(value.strip()[:-1]) / 100
        if not 0 < share <= 1:
            raise ValueError(f"capacity {value!r}: a share must be in (0%, 100%]")
        return share
    number = float(value) if not isinstance(value, str) or _is_number(value) else float(parse_size(value))
    if number <= 0:
        raise ValueError(f"capacity {value!r} must be positive")
    return number


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


@dataclass
class TierConfig:
    """One tier: a directory shared by every job on the node, its capacity, policy and form.

    `capacity` is bytes (`5e10`, `"50GB"`), or a share (`0.3`, `"30%"`) of (free space + the
    tier's own usage) at start. A `{node}` in `path` ("/nvme/tf-{node}") becomes the node index,
    so nodes that share a file system (or a test on one machine) each keep their own directory;
    `open_loader` fills it in from the environment (loader.topology.node_index).
    """

    name: str
    path: str
    capacity: float | str
    policy: str = "auto"
    form: Form | str = Form.DECODED  # a string is converted (configs, the CLI)
    policy_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.capacity = parse_capacity(self.capacity)
        self.form = tier_form(self.form, self.name)

    @classmethod
    def parse(cls, spec: str) -> "TierConfig":
        """`NAME=PATH[:CAPACITY[:POLICY[:FORM]]]`, e.g. `L2=/nvme/tf:30%:auto:at_rest`, `L1=/dev/shm/tf:8G`."""
        name, _, rest = spec.partition("=")
        parts = rest.split(":")
        if not name or not parts[0]:
            raise ValueError(f"tier {spec!r}: expected NAME=PATH[:CAPACITY[:POLICY[:FORM]]]")
        capacity = parts[1] if len(parts) > 1 and parts[1] else "50%"
        try:
            return cls(name, parts[0], capacity, policy=parts[2] if len(parts) > 2 and parts[2] else "auto",
                       form=parts[3] if len(parts) > 3 and parts[3] else Form.DECODED)
        except ValueError as e:
            raise ValueError(f"tier {spec!r}: {e}") from None

    def for_node(self, node: int | None) -> "TierConfig":
        """This tier on node `node`: `{node}` in the path replaced (the same config where there is none)."""
        if NODE_PLACEHOLDER not in self.path:
            return self
        if node is None:
            raise ValueError(f"tier {self.name} path {self.path!r} has {NODE_PLACEHOLDER} but no node index is known "
                             f"here: open_loader fills it in from GROUP_RANK / NODE_RANK, build_stack takes node=; "
                             f"on the command line give the node's own path")
        return replace(self, path=self.path.replace(NODE_PLACEHOLDER, str(int(node))))

    def build(self, registry: MetricsRegistry | None = None, node: int | None = None,
              configure: bool = True) -> Tier:
        """The tier itself; `node` fills a `{node}` placeholder in the path; `configure`: see Tier."""
        if NODE_PLACEHOLDER in self.path:
            return self.for_node(node).build(registry, configure=configure)
        return Tier(self.path, float(self.capacity), policy=self.policy, form=self.form, name=self.name,
                    registry=registry, policy_options=self.policy_options, configure=configure)
