"""`specd unfreeze --reason TEXT`: the operator's word that a failed restart is dealt with.

specd freezes automatic changes after a restart failed and was rolled back. Clearing that
is deliberately a human act: this writes a request into specd's state directory (root or
the specd user can), and the daemon clears the freeze at its next tick and logs who and why.

A pin with apply = now that does not run is restarted into at the first tick unfrozen, outside
any window: after a failed `specd override pin K --now` that is the restart that failed.
Unfreezing then is refused (exit 2, nothing written) unless ``--retry-pin`` says so: the
on-call clears the pin first, or retries it knowingly.
"""

from __future__ import annotations

import argparse
import errno
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from specd.commands.config_fallback import load_for_oncall
from specd.commands.reason import operator, reason_type
from specd.commands.status import (
    budget_note,
    daemon,
    read_override_as_daemon,
    restart_needs_of,
    restart_window,
    setting_text,
    when_text,
)
from specd.core.decide import Control, pin_restarts_spent
from specd.core.history import HistorySettings
from specd.core.setting import parse as parse_setting
from specd.core.text import iso_time, printable
from specd.io.config import DEFAULT_CONFIG_PATH, Config
from specd.io.override import OverrideStatus
from specd.io.state import (
    STATE_FILE,
    STATUS_FILE,
    UNFREEZE_REQUEST,
    atomic_write_json,
    held_freeze,
    read_state,
    read_status,
    with_status,
)

PERMISSION = (errno.EACCES, errno.EPERM)


_reason = reason_type("say why it is safe to resume: the log keeps it")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reason", type=_reason, required=True, help="why it is safe to resume")
    parser.add_argument(
        "--retry-pin",
        action="store_true",
        help="unfreeze even though the override pins, with apply = now, a setting SGLang does "
        "not run: specd restarts into it at once (after a failed pin --now, that restart again)",
    )
    parser.add_argument("--config", type=Path, default=None, help=f"default {DEFAULT_CONFIG_PATH}")


def run(args: argparse.Namespace) -> int:
    # Without the calibration: an on-call command must work while the table is broken; a
    # file with problems (a reload rejected it: the daemon runs on its last good config)
    # gives its valid parts, said on stderr, or refuses where [files] is among them.
    loaded = load_for_oncall("specd unfreeze", args.config)
    if loaded is None:
        return 2
    config = loaded.config
    state_dir = Path(config.files.state_dir)
    now = time.time()
    found = read_freeze(config, now)
    frozen, live, restarts, unknown = found.frozen, found.live, found.restarts, found.unknown
    if unknown is not None:
        # Not "not frozen": a daemon runs on with the freeze it loaded; whoever may not read
        # the file cannot tell. Ask all the same: the daemon clears one, if any.
        print(f"specd unfreeze: {unknown}", file=sys.stderr)
    if frozen is None and unknown is None:
        print("specd is not frozen; nothing to clear")
        return 0
    override = read_override_as_daemon(config, now)
    held = override.override if override.valid else None
    pinned = held.pinned_name if held is not None and held.active(now) else None
    retried = held is not None and held.apply == "now" and pinned != live
    if pinned is not None and retried and not args.retry_pin:
        # Said before anything is written: once the request is there, the daemon unfreezes
        # at its next tick and restarts at once; advice printed after it comes too late.
        runs = f"SGLang runs {setting_text(live)}" if live else "what SGLang runs is unknown"
        print(
            f"specd unfreeze: the override pins {setting_text(pinned)} with apply = now and "
            f"{runs}: unfrozen, specd would restart SGLang into it at once, outside any "
            "window (after a failed `specd override pin --now`, the restart that failed). "
            "Clear the pin first (`specd override clear`) and unfreeze again, or retry it "
            "knowingly with --retry-pin; nothing written",
            file=sys.stderr,
        )
        return 2
    try:
        atomic_write_json(
            state_dir / UNFREEZE_REQUEST,
            {"requested_at": now, "reason": args.reason, "by": operator()},
            mode=0o640,
        )
    except OSError as exc:
        hint = " (run it as root or as the specd user)" if exc.errno in PERMISSION else ""
        print(
            f"specd unfreeze: cannot write the request into {state_dir}: "
            f"{exc.strerror or exc}{hint}",
            file=sys.stderr,
        )
        return 1
    if frozen is not None:
        since = frozen.get("since")
        when = when_text(float(since), now) if isinstance(since, (int, float)) else "?"
        print(f"frozen since {when}: {printable(str(frozen.get('reason')))}")
    running = daemon(state_dir)
    if running["running"] is False:
        print("unfreeze requested; specd is not running: it clears the freeze when it starts")
    elif running.get("problem"):
        print(
            "unfreeze requested; specd clears it within one tick if it runs, else when it "
            f"starts (cannot tell whether it runs: {running['problem']})"
        )
    else:
        print("unfreeze requested; specd clears it within one tick (its log says `unfrozen`)")
    print(f"then: {_next(config, override, pinned, live, now, restarts)}")
    return 0


@dataclass(frozen=True)
class FreezeRead:
    """What the state file says of a freeze, as the daemon reads it: the freeze (None: not
    frozen), the setting SGLang runs, when it was restarted, and why it cannot be told
    (None: it can)."""

    frozen: dict[str, Any] | None = None
    live: str | None = None
    restarts: list[float] = field(default_factory=list)
    unknown: str | None = None
    # The daemon's last decision (status.json over state.json), {} when none is known.
    last_decision: dict[str, Any] = field(default_factory=dict)


def read_freeze(config: Config, now: float) -> FreezeRead:
    """The state file's freeze as the daemon keeps it: a freeze in a file it cannot read (a
    newer specd's) is a freeze all the same; no file, none."""
    path = Path(config.files.state_dir) / STATE_FILE
    try:
        state = read_state(path, HistorySettings.from_config(config), [], now=now)
    except FileNotFoundError:
        return FreezeRead()
    except ValueError as exc:
        frozen = held_freeze(exc, now)
        if frozen is not None:
            return FreezeRead(frozen)
        return FreezeRead(unknown=f"cannot tell whether specd is frozen: {path} is {exc}")
    with_status(state, read_status(Path(config.files.state_dir) / STATUS_FILE))
    live = (state.live or {}).get("setting")
    return FreezeRead(state.frozen, live, list(state.restart_times()), None, state.last_decision)


def _next(
    config: Config,
    override: OverrideStatus,
    pinned: str | None,
    live: str | None,
    now: float,
    restarts: list[float],
) -> str:
    """What specd does once unfrozen, as the override file, the windows and the daily
    restart budget (``restarts``: when SGLang was restarted, once per restart) make it."""
    at = datetime.fromtimestamp(now, tz=timezone.utc)
    if not override.valid:
        return (
            "the override file is invalid: specd keeps the last valid override it read, if "
            "any (`specd status`: mode, last decision)"
        )
    held = override.override
    if held is not None and held.active(now) and held.mode == "freeze":
        assert held.expires_at is not None
        return (
            f"the override's freeze holds until {iso_time(held.expires_at)}: still no "
            "change until then (`specd override clear` ends it)"
        )
    # As the daemon waits: for an open period with time left for the whole restart (an
    # open window's last minutes, or a window too short, hold none).
    waiting = held is not None and held.active(now) and held.mode == "pin" and pinned is not None
    needs_s = restart_needs_of(config, parse_setting(pinned) if waiting and pinned else None)
    window, usable = restart_window(config, at, needs_s)
    opens = None if usable is None else usable.timestamp()
    window += budget_note(config, restarts, now, opens)
    if held is not None and pinned is not None:
        what = f"the override pins {setting_text(pinned)}"
        if pinned == live:
            return f"{what}, which runs: no restart"
        if held.apply == "now":
            # As decide holds it: a pin applied now bounds its own restarts (`--retry-pin`
            # makes none once they are spent).
            control = Control(None, restart_times=tuple(restarts))
            spent = pin_restarts_spent(held, control, config, now)
            if spent is not None:
                return f"{what} with apply = now, but not again: {spent}"
            return f"{what} with apply = now: specd restarts SGLang into it at once"
        return f"{what}: specd restarts SGLang into it {window}"
    return f"specd decides by itself again; a change it wants restarts SGLang {window}"
