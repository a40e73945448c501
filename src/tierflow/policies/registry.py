"""Policies by name: `make_policy("lru")`, and `register_policy` for a user's own."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tierflow.policies.auto import AutoPolicy
from tierflow.policies.base import CachePolicy
from tierflow.policies.clairvoyant import ClairvoyantPolicy
from tierflow.policies.hotscore import HotScorePolicy
from tierflow.policies.lru import LRUPolicy
from tierflow.policies.nochurn import NoChurnPolicy
from tierflow.policies.stream import StreamPolicy

PolicyFactory = Callable[..., CachePolicy]

_FACTORIES: dict[str, PolicyFactory] = {
    "lru": LRUPolicy,
    "hotscore": HotScorePolicy,
    "clairvoyant": ClairvoyantPolicy,
    "nochurn": NoChurnPolicy,
    "stream": StreamPolicy,
    "auto": AutoPolicy,
}


def register_policy(name: str, factory: PolicyFactory, *, replace: bool = False) -> None:
    """Make `make_policy(name, **kwargs)` build `factory(**kwargs)`."""
    if name in _FACTORIES and not replace:
        raise ValueError(f"cache policy {name!r} is already registered")
    _FACTORIES[name] = factory


def make_policy(name: str, **kwargs: Any) -> CachePolicy:
    """A fresh policy object by registered name."""
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise ValueError(f"unknown cache policy {name!r}; known: {', '.join(policy_names())}") from None
    return factory(**kwargs)


def policy_names() -> list[str]:
    return sorted(_FACTORIES)
