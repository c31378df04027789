"""`specd install` and `specd uninstall`: the command line."""

from __future__ import annotations

import argparse
import os
import sys

from specd.install.installer import InstallError, Layout, install, specd_command, uninstall
from specd.io.runner import SubprocessRunner


def configure(parser: argparse.ArgumentParser) -> None:
    if parser.prog.endswith("uninstall"):
        parser.description = (
            "Remove exactly what `specd install` added (its manifest says what), restore the "
            "files it changed, and leave the SGLang unit as it was."
        )
        parser.add_argument(
            "--restart-sglang",
            action="store_true",
            help="restart the SGLang unit afterwards so it runs its original command now",
        )
        parser.set_defaults(action="uninstall")
        return
    parser.description = (
        "Wire an existing SGLang unit to specd: a drop-in repeating its ExecStart= with the "
        "step count from specd's env file, the specd user and state dir, specd.service, the "
        "polkit rule and /etc/specd/specd.toml. Never restarts SGLang. Idempotent."
    )
    parser.add_argument("--unit", required=True, help="the SGLang service, e.g. sglang.service")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print every file (as a diff) and command; change nothing",
    )
    parser.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
    parser.add_argument(
        "--add-enable-metrics",
        action="store_true",
        help="add --enable-metrics to the command in the drop-in if the unit lacks it",
    )
    parser.set_defaults(action="install", specd=specd_command())


def run(args: argparse.Namespace) -> int:
    runner = SubprocessRunner()
    layout = Layout()
    try:
        if args.action == "uninstall":
            if os.geteuid() != 0:
                raise InstallError("must run as root (removes files in /etc, runs systemctl)")
            return uninstall(layout, runner, args.restart_sglang, sys.stdout)
        return install(args, runner, layout, sys.stdout)
    except InstallError as exc:
        print(f"specd {args.action}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"specd {args.action}: {exc.strerror or exc}: {exc.filename or ''}", file=sys.stderr)
        return 1
