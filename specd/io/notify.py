"""sd_notify for specd.service (Type=notify, WatchdogSec=).

A thin layer over ``sdnotify`` that knows specd's messages, reads the watchdog period
from ``WATCHDOG_USEC`` and does nothing outside systemd (no ``NOTIFY_SOCKET``).

``beat()`` is how the daemon's loop says it is alive: called as often as the loop likes, it
sends ``WATCHDOG=1`` at most once per half watchdog period. Nothing else sends it, so a loop
that stops beating is killed by systemd within ``WatchdogSec=``.

systemd runs no watchdog while a unit starts or stops: ``extend_timeout()`` is how a stop
that may outlast ``TimeoutStopSec=`` (a restart of SGLang in flight) says it is still
making progress; the daemon sends it from its heartbeat. systemd keeps an extension only
until its next `systemctl daemon-reload`, which re-arms the stop timeout from
``TimeoutStopSec=`` alone (a stop older than that is killed at once): specd.service's is as
long as a restart sequence at the default timeouts, and the daemon ends itself when its
loop stops beating while it stops (``specd.daemon.StopGuard``, one ``watchdog_period_s``).
"""

from __future__ import annotations

import os
import time

import sdnotify


class Notifier:
    def __init__(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self.enabled = bool(env.get("NOTIFY_SOCKET"))
        self._notifier = sdnotify.SystemdNotifier() if self.enabled else None
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        # WATCHDOG_PID, when set, names the process the watchdog is meant for.
        mine = not pid or pid == str(os.getpid())
        self.watchdog_period_s: float | None = (
            int(usec) / 1e6 if usec.isdigit() and int(usec) > 0 and mine else None
        )
        self._last_watchdog: float | None = None

    def _send(self, message: str) -> None:
        if self._notifier is not None:
            # sdnotify encodes Latin-1 and drops, silently, a message it cannot (the "→"
            # of "restarting SGLang: 4 → 3"; READY=1 with it). systemd reads UTF-8: hand
            # it the UTF-8 bytes as the Latin-1 text that encodes to exactly them.
            self._notifier.notify(message.encode("utf-8").decode("latin-1"))

    def ready(self, status: str) -> None:
        self._send(f"READY=1\nSTATUS={status}")

    def status(self, status: str) -> None:
        self._send(f"STATUS={status}")

    def watchdog(self) -> None:
        self._send("WATCHDOG=1")

    def beat(self) -> None:
        """The loop is alive: WATCHDOG=1, unless one went out less than half a period ago."""
        if self.watchdog_period_s is None:
            return
        now = time.monotonic()
        if self._last_watchdog is not None and now - self._last_watchdog < (
            self.watchdog_period_s / 2
        ):
            return
        self._last_watchdog = now
        self.watchdog()

    def reloading(self) -> None:
        self._send("RELOADING=1")

    def reloaded(self, status: str) -> None:
        self._send(f"READY=1\nSTATUS={status}")

    def stopping(self, status: str) -> None:
        self._send(f"STOPPING=1\nSTATUS={status}")

    def extend_timeout(self, seconds: float, status: str) -> None:
        """EXTEND_TIMEOUT_USEC= (systemd >= 236): the start or stop under way may take
        ``seconds`` more from now, past TimeoutStartSec=/TimeoutStopSec= (systemd never
        shortens its timeout for it, and forgets it at a daemon-reload); an older systemd
        ignores it. Never sent while running: there systemd applies it to the watchdog."""
        usec = max(1, round(seconds * 1e6))
        self._send(f"EXTEND_TIMEOUT_USEC={usec}\nSTATUS={status}")
