"""Fixtures of the command tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
from version_twins import VersionTwins


@pytest.fixture(scope="module")
def version_twins() -> Iterator[VersionTwins]:
    """This module's twins as SGLang versions (tests/commands/version_twins.py)."""
    with contextlib.ExitStack() as stack:
        yield VersionTwins(stack)
