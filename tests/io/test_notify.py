"""specd.io.notify against a real AF_UNIX datagram socket standing in for systemd's."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from specd.io.notify import Notifier


@pytest.fixture
def notify_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """systemd's side: NOTIFY_SOCKET in the environment, as a service manager sets it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    sock.settimeout(0.2)
    monkeypatch.setenv("NOTIFY_SOCKET", sock.getsockname())
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    try:
        yield sock
    finally:
        sock.close()


def received(sock: socket.socket) -> list[str]:
    out = []
    while True:
        try:
            out.append(sock.recv(4096).decode())
        except TimeoutError:
            return out


def test_beats_send_watchdog_at_most_every_half_period(
    notify_socket: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "1000000")
    notifier = Notifier()
    assert notifier.watchdog_period_s == 1.0
    end = time.monotonic() + 1.3
    beats = 0
    while time.monotonic() < end:
        notifier.beat()
        beats += 1
        time.sleep(0.01)
    # Many beats in 1.3 s with a 1 s period: one at once, then one per half period.
    assert beats > 50
    assert received(notify_socket) == ["WATCHDOG=1"] * 3


@pytest.mark.parametrize(
    "watchdog_env",
    [
        {},  # no WatchdogSec=
        {"WATCHDOG_USEC": "0"},
        {"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"},  # meant for another process
    ],
)
def test_without_a_watchdog_for_us_beats_send_nothing(
    notify_socket: socket.socket, monkeypatch: pytest.MonkeyPatch, watchdog_env: dict[str, str]
) -> None:
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    for name, value in watchdog_env.items():
        monkeypatch.setenv(name, value)
    notifier = Notifier()
    for _ in range(5):
        notifier.beat()
    notifier.status("alive")
    # The socket works: the STATUS= arrives, no WATCHDOG=1 does.
    assert received(notify_socket) == ["STATUS=alive"]


@pytest.mark.parametrize(
    "status",
    [
        "steps 4, target 3, window_closed, mode auto",
        "restarting SGLang: 4 → 3",  # not Latin-1: sdnotify dropped it whole
        "pinned by José",  # Latin-1, but not UTF-8 as sdnotify sent it
    ],
)
def test_status_reaches_systemd_as_utf8(notify_socket: socket.socket, status: str) -> None:
    notifier = Notifier()
    notifier.status(status)
    notifier.ready(status)
    # systemd ignores a STATUS= that is not UTF-8; READY=1 in the same message must arrive.
    assert received(notify_socket) == [f"STATUS={status}", f"READY=1\nSTATUS={status}"]


def test_extend_timeout_asks_for_that_much_more_and_says_why(
    notify_socket: socket.socket,
) -> None:
    """EXTEND_TIMEOUT_USEC= in microseconds, with STATUS= in the same message (systemd only
    ever lengthens its timeout for it, and forgets it at a daemon-reload: specd.service's
    TimeoutStopSec= covers a restart sequence on its own)."""
    notifier = Notifier()
    notifier.extend_timeout(60.0, "stopping once the restart in flight ends (4 → 3)")
    notifier.extend_timeout(0.0, "x")  # never 0, which systemd would ignore
    assert received(notify_socket) == [
        "EXTEND_TIMEOUT_USEC=60000000\nSTATUS=stopping once the restart in flight ends (4 → 3)",
        "EXTEND_TIMEOUT_USEC=1\nSTATUS=x",
    ]
