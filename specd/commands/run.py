"""`specd run`: the daemon, as specd.service starts it.

The daemon and everything it loads are imported in `run`, not for ``--help``."""

from __future__ import annotations

import argparse
from pathlib import Path

from specd.io.paths import DEFAULT_CONFIG_PATH


# -- CLI: specd run ----------------------------------------------------------------
def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help=f"configuration file (default {DEFAULT_CONFIG_PATH}; SPECD_* env vars override)",
    )


def run(args: argparse.Namespace) -> int:
    # Imported here, not for --help (see the module's docstring).
    from specd.commands.check_config import load_for_command  # noqa: PLC0415
    from specd.daemon import Daemon  # noqa: PLC0415
    from specd.io import logs  # noqa: PLC0415
    from specd.io.state import (  # noqa: PLC0415
        STATE_FILE,
        LockFileUnusable,
        StateDirLocked,
        StateUnreadable,
        lock_state_dir,
    )
    from specd.io.writable import env_file_unwritable, fix_for, written_dirs  # noqa: PLC0415

    config = load_for_command(args.config)
    if config is None:
        return 2  # a bad config stops start-up, one line per problem
    logs.configure(config.report.log_format)
    try:
        # Held for the process's life: the descriptor is never closed.
        lock_state_dir(config.files.state_dir)
    except StateDirLocked as exc:
        logs.get_logger().error(
            "state_dir_locked", state_dir=str(config.files.state_dir), error=str(exc)
        )
        return 1
    except LockFileUnusable as exc:
        logs.get_logger().error(
            "state_dir_unusable", state_dir=str(config.files.state_dir), error=str(exc)
        )
        return 1
    except OSError as exc:
        logs.get_logger().error(
            "state_dir_unusable",
            state_dir=str(config.files.state_dir),
            error=exc.strerror or str(exc),
            fix=fix_for(written_dirs(config)[0], config.sglang.unit),
        )
        return 1
    # An env file specd cannot write failed every change, at every window, for as long as
    # specd ran (a directory outside specd.service's writable paths): said now, with the fix.
    problem = env_file_unwritable(config)
    if problem is not None:
        logs.get_logger().error(
            "env_file_unwritable", env_file=str(config.sglang.env_file), problem=problem
        )
        return 1
    try:
        daemon = Daemon(config, args.config)
    except StateUnreadable as exc:
        # Started fresh, specd forgot a freeze and a restart in flight, and its next save
        # replaced the file (a rename needs only the directory): said, and nothing started.
        state = Path(config.files.state_dir) / STATE_FILE
        logs.get_logger().error(
            "state_unreadable",
            problem=str(exc),
            fix=f"make it readable by specd's user (chown specd:specd {state}, if a command "
            "run as root wrote it), or check the disk; specd starts once it can read it",
        )
        return 1
    daemon.install_signal_handlers()
    return daemon.run()
