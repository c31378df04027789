"""`specd run` whose loop can be made to hang on request: a hung loop, not a stopped process.

The watchdog test creates HANG_FILE in the state directory; the next tick removes it (so
the specd systemd starts next runs normally) and then blocks the loop thread forever. The
process lives on — its metrics server thread answers, its signal handlers run — so only a
watchdog fed by the loop's own heartbeat notices. This wrapper is the deliberate, test-only
way to hang the loop; nothing in specd itself reads HANG_FILE.

Usage (as ExecStart=): python hang_loop.py run --config /etc/specd/specd.toml
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

from specd import cli
from specd.core.decide import Decision
from specd.daemon import Daemon

HANG_FILE = Path("/var/lib/specd/hang-loop")
_real_tick = Daemon.tick


def _tick_that_can_hang(self: Daemon) -> Decision:
    if HANG_FILE.exists():
        HANG_FILE.unlink()
        threading.Event().wait()  # no timeout: the loop never comes back
    return _real_tick(self)


Daemon.tick = _tick_that_can_hang  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(cli.main())
