"""`specd unfreeze --reason TEXT`: the operator's word that a failed restart is dealt with.

specd freezes automatic changes after a restart failed and was rolled back. Clearing that
is deliberately a human act: this writes a request into specd's state directory (root or
the specd user can), and the daemon clears the freeze at its next tick and logs who and why.
"""

from __future__ import annotations

import argparse
import getpass
import time
from pathlib import Path

from specd.commands.check_config import load_for_command
from specd.daemon import UNFREEZE_REQUEST
from specd.io.config import DEFAULT_CONFIG_PATH
from specd.io.state import STATE_FILE, atomic_write_json, read_json


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reason", required=True, help="why it is safe to resume")
    parser.add_argument("--config", type=Path, default=None, help=f"default {DEFAULT_CONFIG_PATH}")


def run(args: argparse.Namespace) -> int:
    config = load_for_command(args.config)
    if config is None:
        return 2
    state_dir = Path(config.files.state_dir)
    try:
        frozen = read_json(state_dir / STATE_FILE).get("frozen")
    except (OSError, ValueError, AttributeError):
        frozen = None
    if not frozen:
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
    print(
        f"frozen since: {frozen.get('reason')}\nunfreeze requested; specd clears it within one tick"
    )
    return 0
