"""Fixtures of the framework tests (tests/integrations/harness.py holds the shared code)."""

from __future__ import annotations

import importlib.util

import pytest

from harness import pack_corpus


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A packed dataset of random-letter documents in byte tokens (2 shards)."""
    return pack_corpus(tmp_path_factory.mktemp("frameworks"))


def needs(module: str) -> pytest.MarkDecorator:
    """Skip where the framework is not installed (it comes with the `frameworks` extra, in `dev`)."""
    return pytest.mark.skipif(
        importlib.util.find_spec(module) is None, reason=f"{module} is not installed (pip install -e '.[frameworks]')"
    )
