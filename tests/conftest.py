"""Fixtures shared across test packages."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
import structlog
from factories import EtcdProcess

from specd.twin.process import use_ports

# Seconds each test file took in a full run (`pytest --record-durations` rewrites it). Only
# the order the files start in depends on it: `--dist loadfile` keeps a file on one worker
# and hands files out in collection order, so the longest go first and the short ones fill
# the workers' ends (xdist's own reorder, by number of tests, put the few-but-slow files
# last: the systemd, fleet and bench files made a minutes-long tail on one worker).
DURATIONS = Path(__file__).with_name("durations.json")
_spent: Counter[str] = Counter()
MAX_LOGS_SHOWN, LOG_TAIL_CHARS = 6, 4000
# Each pytest worker hands out ports (free_port) from its own share of 10000-32767, below
# the kernel's ephemeral range (32768 up): a port one worker chose for a server it has not
# started yet is offered to no other worker, and no outgoing connection takes it meanwhile.
PORTS_FROM, PORTS_TO, PORT_SHARES = 10000, 32768, 16
# The twins these tests start (in this process or as its children) answer /health at once,
# as SGLang does with this variable false, a common setting: with SGLang's default each
# /health runs a generation, and every wait for a twin to come up would take a second
# more. specd itself probes /health_generate, which always takes that second. SGLang's
# default is tested where it matters: tests/twin/test_versions.py, and the fleets a real
# gateway (smg) probes: tests/systemd/test_fleet_systemd.py, `python -m bench fleet`.
HEALTH_GENERATION = "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"
os.environ.setdefault(HEALTH_GENERATION, "false")


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--record-durations",
        action="store_true",
        help=f"write each test file's total seconds in this run to {DURATIONS}",
    )


def pytest_configure(config: pytest.Config) -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    if worker.isdigit() and int(worker) < PORT_SHARES:
        use_ports(range(PORTS_FROM + int(worker), PORTS_TO, PORT_SHARES))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Longest files first (a stable sort: each file's tests keep their order)."""
    known: dict[str, float] = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    items.sort(key=lambda item: -known.get(_file_of(item.nodeid), 0.0))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test that ran `specd run` (its logs under tmp_path: the fleet and fault
    tests) shows each log's tail: CI prints the failure only, and a timed-out wait says what
    it waited for, not what specd was doing."""
    report = yield
    tmp_path = getattr(item, "funcargs", {}).get("tmp_path")
    if not report.failed or call.when != "call" or not isinstance(tmp_path, Path):
        return report
    for log in sorted(tmp_path.rglob("specd*.log"))[:MAX_LOGS_SHOWN]:
        tail = log.read_text(errors="replace")[-LOG_TAIL_CHARS:]
        report.sections.append((f"specd log {log.relative_to(tmp_path)}", tail))
    return report


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _spent[_file_of(report.nodeid)] += report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    # The xdist controller sees every worker's reports; a worker writes nothing.
    if config.getoption("record_durations") and not hasattr(config, "workerinput"):
        # `make test` runs two sessions (the `alone` tests after the rest): each updates
        # the files it ran and keeps the others'.
        known = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
        known.update({f: round(s, 1) for f, s in _spent.items()})
        spent = dict(sorted(known.items(), key=lambda fs: -fs[1]))
        DURATIONS.write_text(json.dumps(spent, indent=1) + "\n")


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
