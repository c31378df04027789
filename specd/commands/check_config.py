"""`specd check-config`: validate a configuration and print the effective values."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import tomli_w

from specd.io.config import (
    DEFAULT_CONFIG_PATH,
    ENV_PREFIX,
    FOREIGN_ENV_PREFIXES,
    Config,
    ConfigError,
    config_to_dict,
    load_config,
)

if sys.version_info >= (3, 11):
    pass
else:  # pragma: no cover - exercised on 3.10 only
    pass  # type: ignore[import-not-found,unused-ignore]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Validate a specd configuration and print the effective values "
        "(file, then SPECD_* environment). Exit 0 if valid, 2 if not."
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
        env = [n for n in env if not n.upper().startswith(FOREIGN_ENV_PREFIXES)]
        print(f"# effective specd configuration from {source}")
        if env:
            print(f"# overridden by environment: {', '.join(env)}")
        sys.stdout.write(tomli_w.dumps(data))
    print(f"{shown}: OK", file=sys.stderr)
    return 0
