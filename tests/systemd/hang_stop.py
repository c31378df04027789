"""`specd run` whose loop can be made to hang while it stops: a hung loop, not a stopped
process (hang_loop.py hangs it at a tick, which a stop waiting for a restart never reaches).

Once specd is stopping, its loop's next beat finds HANG_FILE in the state directory, removes
it and blocks that thread forever: nothing beats from there on, while the rest of the
process (its metrics server thread, its stop guard) lives on. This wrapper is the
deliberate, test-only way to hang it; nothing in specd itself reads HANG_FILE.

Usage (as ExecStart=): python hang_stop.py run --config /etc/specd/specd.toml
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

from specd import cli
from specd.daemon import Daemon

HANG_FILE = Path("/var/lib/specd/hang-stop")
_real_heartbeat = Daemon._heartbeat


def _heartbeat_that_can_hang(self: Daemon) -> None:
    if self.stop_event.is_set() and HANG_FILE.exists():
        HANG_FILE.unlink()
        threading.Event().wait()  # no timeout: the loop never comes back
    _real_heartbeat(self)


Daemon._heartbeat = _heartbeat_that_can_hang  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(cli.main())
