"""`specd check-config`: validate a configuration and print the effective values."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import tomli_w

from specd.core import windows
from specd.install.sandbox import SHIPPED, needs_read_write
from specd.io.config import (
    DEFAULT_CONFIG_PATH,
    ENV_PREFIX,
    Config,
    ConfigError,
    config_to_dict,
    load_config,
    shadowed_in_file,
)
from specd.io.systemd import DEFAULT_STOP_TIMEOUT_S
from specd.io.writable import STATE_DIRECTORY, written_dirs


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Validate a specd configuration and print the effective values "
        "(file, then SPECD_* environment) as TOML, table by table. Exit 0 if valid, 2 if not "
        f"(also with no file named and no {DEFAULT_CONFIG_PATH}, which specd.service runs on)."
    )
    parser.add_argument("path", nargs="?", type=Path, help="config file (same as --config)")
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help=f"config file (default {DEFAULT_CONFIG_PATH})",
    )
    parser.add_argument("--json", action="store_true", help="print the config as JSON")


def load_for_command(path: Path | None, *, calibration: bool = True) -> Config | None:
    """`load_config` for a command line: each problem on its own stderr line, naming the
    file and the key (no traceback); None when the configuration is unusable.
    ``calibration``: False for the on-call's commands (`load_config`)."""
    try:
        return load_config(path, calibration=calibration)
    except ConfigError as exc:
        shown = path if path is not None else DEFAULT_CONFIG_PATH
        for problem in exc.problems:
            print(f"{shown}: {problem}", file=sys.stderr)
        return None


def grouped_toml(data: dict[str, Any]) -> str:
    """The config as TOML in the example file's order: each table under its header, then
    each array entry as ``[[bands]]`` / ``[[windows]]`` (tomli_w alone would inline them)."""
    blocks = []
    for key, value in data.items():
        if isinstance(value, dict):
            blocks.append(tomli_w.dumps({key: value}))
    for key, value in data.items():
        if isinstance(value, list):
            blocks += [f"[[{key}]]\n" + tomli_w.dumps(item) for item in value]
    return "\n".join(blocks)


def window_warnings(config: Config, now: datetime) -> list[str]:
    """A line for each window no restart fits in, as far as the config tells: one restart
    needs the unit's TimeoutStopSec= (systemd's, which `specd doctor` reads) + restart_cost_s,
    and specd starts one only with that much of the open window left. Shorter than
    restart_cost_s alone, it never does; shorter than that + systemd's default stop
    timeout, only if the unit stops faster. Valid either way: the daemon runs with it."""
    unit = config.sglang.unit
    cost_s = config.choose.restart_cost_s
    # As the applier counts it: a stop timeout is bounded by the restart command's own.
    stop_s = min(DEFAULT_STOP_TIMEOUT_S, config.restart.restart_command_timeout_s)
    stop = (
        f"systemd's default stop timeout {stop_s:g} s"
        if stop_s == DEFAULT_STOP_TIMEOUT_S
        else f"restart_command_timeout_s {stop_s:g} s, the longest a stop is waited for"
    )
    never = {i for i, _ in windows.too_short(config.windows, cost_s, now)}
    lines = []
    for i, open_s in windows.too_short(config.windows, stop_s + cost_s, now):
        window = config.windows[i]
        where = f"windows[{i}].duration_s"
        name = f"{window.cron!r} ({window.duration_s:g} s)"
        if i in never:
            lines.append(
                f"{where}: warning: {name} shorter than restart_cost_s alone, {cost_s:g} s: "
                f"specd never restarts there (one restart needs {unit}'s TimeoutStopSec= + "
                f"restart_cost_s, {stop_s + cost_s:g} s with {stop}; `specd doctor` reads "
                "the unit's)"
            )
        else:
            lines.append(
                f"{where}: warning: {name} shorter than one restart needs, {stop_s + cost_s:g} s "
                f"({stop} + restart_cost_s {cost_s:g} s): "
                f"specd never restarts there unless {unit}'s TimeoutStopSec= is at most "
                f"{open_s - cost_s:g} s (`specd doctor` reads it)"
            )
    return lines


def path_warnings(config: Config) -> list[str]:
    """A line for each directory specd writes in that the shipped specd.service does not let
    it write as it stands (ProtectSystem=strict: /var/lib/specd only), or hides from it
    (PrivateTmp=, ProtectHome=). Valid either way: outside that unit specd may write there."""
    lines = []
    for written in written_dirs(config):
        where = f"{written.key}: warning: specd writes {written.what} in {written.directory}"
        hidden = SHIPPED.hides(written.directory)
        if hidden is not None:
            lines.append(f"{where}, but {hidden}: keep it under {STATE_DIRECTORY}")
        elif needs_read_write(written.directory):
            lines.append(
                f"{where}, outside {STATE_DIRECTORY}: specd.service (ProtectSystem=strict) may "
                "write there only once its ReadWritePaths= names it, which `specd install` adds "
                "(and creates the directory for user specd; by hand: `systemctl edit "
                'specd.service`), or every change fails with "Read-only file system"'
            )
    return lines


def run(args: argparse.Namespace) -> int:
    if args.path is not None and args.config is not None and args.path != args.config:
        print("specd check-config: give the file once (PATH or --config)", file=sys.stderr)
        return 2
    path: Path | None = args.path if args.path is not None else args.config
    shown = path if path is not None else DEFAULT_CONFIG_PATH
    if path is None and not DEFAULT_CONFIG_PATH.exists():
        # specd.service names this file (`specd run --config`), and will not start without
        # it; built-in defaults, which `specd run` alone would use, are not what it runs.
        print(
            f"{shown}: no such file: specd.service runs `specd run --config {shown}`, which "
            "does not start without it (`specd install` writes it; a file of comments only "
            "keeps every default); check another file with `specd check-config FILE`",
            file=sys.stderr,
        )
        return 2
    config = load_for_command(shown)  # named: gone since, it is not taken as defaults
    if config is None:
        return 2
    data = config_to_dict(config)
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        env = sorted(n for n in os.environ if n.upper().startswith(ENV_PREFIX))
        print(f"# effective specd configuration from {shown}")
        if env:
            print(f"# overridden by environment: {', '.join(env)}")
        sys.stdout.write(grouped_toml(data))
    # This command's own environment: the daemon warns of specd.service's at each reload.
    shadowed = [f"{s.key}: warning: {s.warning()}" for s in shadowed_in_file(shown)]
    now = datetime.fromtimestamp(time.time(), tz=timezone.utc)
    for line in [*shadowed, *window_warnings(config, now), *path_warnings(config)]:
        print(f"{shown}: {line}", file=sys.stderr)
    print(f"{shown}: OK", file=sys.stderr)
    return 0
