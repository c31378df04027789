"""specd's /metrics over real HTTP on loopback: served, and bounded against clients that
hold connections open (slowloris), from another process as a local user would."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from factories import tables
from prometheus_client import CollectorRegistry, Gauge

from specd.daemon import Daemon
from specd.io.config import Config
from specd.io.metrics_http import MAX_CONNECTIONS, MetricsServer
from specd.io.notify import Notifier

HELD = 300  # half-sent requests held open: past the thread count anyone would accept


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@contextmanager
def slowloris(port: int, count: int = HELD) -> Iterator[subprocess.Popen[str]]:
    """A process holding ``count`` connections to ``port``, each with a request line and
    no end of headers, until the block ends."""
    code = textwrap.dedent(
        f"""
        import socket, sys, time
        held = []
        for _ in range({count}):
            s = socket.create_connection(("127.0.0.1", {port}))
            s.sendall(b"GET /metrics HTTP/1.1\\r\\nHost: x\\r\\n")
            held.append(s)
        print("held", len(held), flush=True)
        time.sleep(3600)
        """
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == f"held {count}"
        yield child
    finally:
        child.kill()
        child.wait()


def wait_until(condition: object, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if callable(condition) and condition():
            return True
        time.sleep(0.05)
    return False


def test_the_daemons_page_stays_up_and_bounded_under_held_connections(tmp_path: Path) -> None:
    """A local user holding a thousand half-sent requests open took a thread and a file
    descriptor each from specd (the unit's soft limit is 1024): state writes and override
    reads failed with EMFILE and accept() spun a core. Now at most MAX_CONNECTIONS are
    served at once, a new one closing the oldest, and Prometheus' scrape still answers."""
    (tmp_path / "state").mkdir()
    cfg = Config(
        **tables(
            state_dir=str(tmp_path / "state"),
            override_file=str(tmp_path / "override.toml"),
            env_file=str(tmp_path / "sglang.env"),
            url="http://127.0.0.1:9",
            metrics_listen_address="127.0.0.1",
            metrics_port=0,
        )
    )
    d = Daemon(cfg, registry=CollectorRegistry(), notifier=Notifier({}))
    fds, threads = open_fds(), threading.active_count()
    d.start_metrics_server()
    try:
        with slowloris(d.metrics_port):
            time.sleep(0.5)  # every connection accepted that will be
            assert open_fds() - fds <= MAX_CONNECTIONS + 2
            assert threading.active_count() - threads <= MAX_CONNECTIONS + 2
            page = httpx.get(f"http://127.0.0.1:{d.metrics_port}/metrics", timeout=5)
            assert page.status_code == 200
            assert "specd_build_info" in page.text
    finally:
        d.client.close()
        assert d._metrics_server is not None
        d._metrics_server.close()


@pytest.fixture
def server() -> Iterator[MetricsServer]:
    registry = CollectorRegistry()
    Gauge("specd_test_value", "A value.", registry=registry).set(7)
    served = MetricsServer(registry, "127.0.0.1", 0, max_connections=4, read_timeout_s=0.5)
    try:
        yield served
    finally:
        served.close()


def test_the_page_is_served(server: MetricsServer) -> None:
    page = httpx.get(f"http://127.0.0.1:{server.port}/metrics", timeout=5)
    assert page.status_code == 200
    assert "specd_test_value 7.0" in page.text


def test_a_connection_that_sends_nothing_is_closed_after_the_read_timeout(
    server: MetricsServer,
) -> None:
    with socket.create_connection(("127.0.0.1", server.port)) as idle:
        idle.settimeout(5)
        started = time.monotonic()
        assert idle.recv(1024) == b""  # closed by the server
        assert time.monotonic() - started < 3
    assert wait_until(lambda: server.open_connections() == 0, 2)


def test_a_connection_past_the_bound_closes_the_oldest(server: MetricsServer) -> None:
    held = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(4)]
    try:
        for sock in held:
            sock.sendall(b"GET /metrics HTTP/1.1\r\n")
        assert wait_until(lambda: server.open_connections() == 4, 2)
        held[0].settimeout(5)
        page = httpx.get(f"http://127.0.0.1:{server.port}/metrics", timeout=5)
        assert page.status_code == 200
        assert held[0].recv(1024) == b""  # the oldest, closed for it
        assert server.open_connections() <= 4
    finally:
        for sock in held:
            sock.close()
