"""`specd unfreeze --reason TEXT`: the operator's word that a failed restart is dealt with.

specd freezes automatic changes after a restart failed and was rolled back. Clearing that
is deliberately a human act: this writes a request into specd's state directory (root or
the specd user can), and the daemon clears the freeze at its next tick and logs who and why.
"""

from __future__ import annotations

import argparse
import getpass
import sys
import time
from pathlib import Path
from typing import Any

from specd.commands.check_config import load_for_command
from specd.commands.reason import reason_type
from specd.core.history import HistorySettings
from specd.core.text import printable
from specd.daemon import UNFREEZE_REQUEST
from specd.io.config import DEFAULT_CONFIG_PATH, Config
from specd.io.override import daemon_uids, read_override
from specd.io.state import STATE_FILE, atomic_write_json, held_freeze, read_state

_reason = reason_type("say why it is safe to resume: the log keeps it")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reason", type=_reason, required=True, help="why it is safe to resume")
    parser.add_argument("--config", type=Path, default=None, help=f"default {DEFAULT_CONFIG_PATH}")


def run(args: argparse.Namespace) -> int:
    config = load_for_command(args.config)
    if config is None:
        return 2
    state_dir = Path(config.files.state_dir)
    path = state_dir / STATE_FILE
    unknown: str | None = None
    frozen: dict[str, Any] | None = None
    try:
        # As the daemon reads it: a freeze it cannot read is a freeze all the same.
        frozen = read_state(path, HistorySettings.from_config(config), [], now=time.time()).frozen
    except FileNotFoundError:
        pass
    except ValueError as exc:
        frozen = held_freeze(exc, time.time())  # as the daemon keeps it (a newer specd's file)
        if frozen is None:
            # Not "not frozen": a daemon runs on with the freeze it loaded; whoever may not
            # read the file cannot tell. Ask all the same: the daemon clears one, if any.
            unknown = f"cannot tell whether specd is frozen: {path} is {exc}"
            print(f"specd unfreeze: {unknown}", file=sys.stderr)
    if frozen is None and unknown is None:
        print("specd is not frozen; nothing to clear")
        return 0
    try:
        atomic_write_json(
            state_dir / UNFREEZE_REQUEST,
            {"requested_at": time.time(), "reason": args.reason, "by": getpass.getuser()},
            mode=0o640,
        )
    except OSError as exc:
        print(f"specd: cannot write the request into {state_dir}: {exc} (run as root?)")
        return 1
    if frozen is not None:
        print(f"frozen since: {printable(str(frozen.get('reason')))}")
    print("unfreeze requested; specd clears it within one tick")
    pin = _pin_now(config)
    if pin is not None:
        # A freeze after a failed restart often follows an on-call pin that failed: the pin
        # is still in force and, with apply = now, is retried at the first tick unfrozen.
        print(
            f"note: the override pins {pin} with apply = now: unfrozen, specd restarts SGLang "
            "into it at once, outside any window. If that is what failed, clear the override "
            "first: specd override clear"
        )
    return 0


def _pin_now(config: Config) -> str | None:
    """The setting an override in force pins with apply = now, or None."""
    status = read_override(
        config.files.override_file,
        config.choose.min_steps,
        config.choose.max_steps,
        time.time(),
        allowed_uids=daemon_uids(),
    )
    held = status.override
    if held is None or held.apply != "now" or not held.active(time.time()):
        return None
    name = held.pinned_name  # None unless a pin
    return f"{name} steps" if name is not None and name.isdigit() else name
