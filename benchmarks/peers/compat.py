"""Import guard for the peers on a CPU-only torch.

PyPI's Linux torchvision wheels are CUDA builds: `torchvision==0.28.0` (the release paired with
torch 2.13.0) links libtorch_cuda, so next to the CPU torch 2.13.0 pinned in constraints.txt its
C extension does not load and `import torchvision` dies with `operator torchvision::nms does not
exist`. The CPU build lives only on PyTorch's own wheel index, which this project's machines
cannot reach. Both peers declare torchvision as a dependency, but neither needs it for text and
token data: LitData imports it lazily (only to decode images/video) and MosaicML Streaming imports
it eagerly in `streaming/__init__.py` (for `streaming.vision`, its CIFAR/ImageNet datasets).

So `make bench-peers` uninstalls the broken torchvision after installing the extra, and
`guard_torchvision()`, called before either peer is imported, registers a stand-in `torchvision`
module when the real one is missing or broken. The stand-in offers only the names
`streaming.vision` binds at import time (`VisionDataset`, `to_tensor`), and both raise if used,
so nothing in these benchmarks can silently run without a real torchvision. Its metadata is
absent, so LitData's `RequirementCache("torchvision")` still reports torchvision unavailable.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types

STAND_IN = "tierflow-benchmarks torchvision stand-in"


def _unavailable(*args: object, **kwargs: object) -> None:
    raise RuntimeError("torchvision is not usable with this CPU torch (see benchmarks/peers/compat.py)")


def guard_torchvision() -> str:
    """'real' when torchvision imports, else installs the stand-in and says why."""
    existing = sys.modules.get("torchvision")
    if existing is not None and getattr(existing, "__doc__", None) == STAND_IN:
        return "stand-in"
    try:
        import torchvision  # noqa: F401

        return "real"
    except ModuleNotFoundError:
        reason = "stand-in (torchvision not installed)"
    except (RuntimeError, ImportError, OSError) as e:
        reason = f"stand-in (torchvision failed to import: {str(e).splitlines()[0][:80]})"
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]

    class VisionDataset:  # what streaming.vision.base subclasses
        def __init__(self, *args: object, **kwargs: object) -> None:
            _unavailable()

    modules = {}
    for name in ("torchvision", "torchvision.datasets", "torchvision.transforms", "torchvision.transforms.functional"):
        module = types.ModuleType(name, STAND_IN)
        module.__path__ = []  # a package, so submodule imports resolve to the entries below
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        modules[name] = module
    modules["torchvision.datasets"].VisionDataset = VisionDataset
    modules["torchvision.datasets"].CIFAR10 = VisionDataset
    modules["torchvision.transforms.functional"].to_tensor = _unavailable
    modules["torchvision"].datasets = modules["torchvision.datasets"]
    modules["torchvision"].transforms = modules["torchvision.transforms"]
    modules["torchvision.transforms"].functional = modules["torchvision.transforms.functional"]
    sys.modules.update(modules)
    return reason
