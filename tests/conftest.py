"""Fixtures shared across test packages."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from factories import EtcdProcess


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdProcess]:
    """A real etcd of its own on loopback (tests/factories.EtcdProcess)."""
    server = EtcdProcess(tmp_path / "etcd").start()
    try:
        yield server
    finally:
        server.stop()
