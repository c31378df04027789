"""`specd check-config`: validate a configuration and print the effective values."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import tomli_w

from specd.io.config import (
    DEFAULT_CONFIG_PATH,
    ENV_PREFIX,
    Config,
    ConfigError,
    config_to_dict,
    load_config,
)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Validate a specd configuration and print the effective values "
        "(file, then SPECD_* environment) as TOML, table by table. Exit 0 if valid, 2 if not."
    )
    parser.add_argument("path", nargs="?", type=Path, help="config file (same as --config)")
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help=f"config file (default {DEFAULT_CONFIG_PATH})",
    )
    parser.add_argument("--json", action="store_true", help="print the config as JSON")


def load_for_command(path: Path | None) -> Config | None:
    """`load_config` for a command line: each problem on its own stderr line, naming the
    file and the key (no traceback); None when the configuration is unusable."""
    try:
        return load_config(path)
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


def run(args: argparse.Namespace) -> int:
    if args.path is not None and args.config is not None and args.path != args.config:
        print("specd check-config: give the file once (PATH or --config)", file=sys.stderr)
        return 2
    path: Path | None = args.path if args.path is not None else args.config
    shown = path if path is not None else DEFAULT_CONFIG_PATH
    config = load_for_command(path)
    if config is None:
        return 2
    data = config_to_dict(config)
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        source = str(shown) if shown.exists() else f"{shown} (absent: built-in defaults)"
        env = sorted(n for n in os.environ if n.upper().startswith(ENV_PREFIX))
        print(f"# effective specd configuration from {source}")
        if env:
            print(f"# overridden by environment: {', '.join(env)}")
        sys.stdout.write(grouped_toml(data))
    print(f"{shown}: OK", file=sys.stderr)
    return 0
