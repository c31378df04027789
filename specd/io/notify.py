"""sd_notify for specd.service (Type=notify, WatchdogSec=).

A thin layer over ``sdnotify`` that knows specd's messages, reads the watchdog period
from ``WATCHDOG_USEC`` and does nothing outside systemd (no ``NOTIFY_SOCKET``).

``beat()`` is how the daemon's loop says it is alive: called as often as the loop likes, it
sends ``WATCHDOG=1`` at most once per half watchdog period. Nothing else sends it, so a loop
that stops beating is killed by systemd within ``WatchdogSec=``.

``extend_start()`` is how a start that is still making progress before ``READY=1`` keeps
systemd's ``TimeoutStartSec=`` (90 s by default) from ending it: specd finishes a restart
sequence a killed predecessor left (a model load, a start limit waited out) before it is
ready, which can take minutes.
"""

from __future__ import annotations

import os
import time

import sdnotify

# EXTEND_TIMEOUT_USEC goes out at most this often (each one pushes the deadline forward).
EXTEND_EVERY_S = 5.0


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
        self._last_extend: float | None = None

    def _send(self, message: str) -> None:
        if self._notifier is not None:
            self._notifier.notify(message)

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

    def extend_start(self, seconds: float) -> None:
        """Before READY: give the start ``seconds`` more from now (EXTEND_TIMEOUT_USEC),
        unless that was said less than ``EXTEND_EVERY_S`` ago."""
        now = time.monotonic()
        if self._last_extend is not None and now - self._last_extend < EXTEND_EVERY_S:
            return
        self._last_extend = now
        self._send(f"EXTEND_TIMEOUT_USEC={round(seconds * 1e6)}")

    def reloading(self) -> None:
        self._send("RELOADING=1")

    def reloaded(self, status: str) -> None:
        self._send(f"READY=1\nSTATUS={status}")

    def stopping(self, status: str) -> None:
        self._send(f"STOPPING=1\nSTATUS={status}")
