"""Fixtures shared across test packages."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
from factories import EtcdProcess


@pytest.fixture(autouse=True)
def _structlog_defaults() -> Iterator[None]:
    """A test that runs a command in-process (demo, sweep, run) configures structlog to write
    to its log file or pytest's capture of its stdout; both are closed once it ends, and the
    next test on that worker to log would fail writing to them. Each test starts from the
    defaults."""
    structlog.reset_defaults()
    yield
    structlog.reset_defaults()


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdProcess]:
    """A real etcd of its own on loopback (tests/factories.EtcdProcess)."""
    server = EtcdProcess(tmp_path / "etcd").start()
    try:
        yield server
    finally:
        server.stop()
