"""`specd override`: pin, freeze, clear or show the on-call override.

Its arguments are parsed with the standard library and specd.core alone: the config, the
windows (apscheduler), the override file's reader and the HTTP client are imported where
they are used, so that `--help` and a mistyped argument answer at once (~0.05 s of CPU,
not ~0.25 s).
"""

from __future__ import annotations

import argparse
import errno
import math
import sys
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specd.commands.args import Duration, quoted
from specd.commands.reason import operator, reason_type
from specd.core.choices import as_applied, cannot_run
from specd.core.override import _UTC, Apply, Override
from specd.core.setting import (
    UNLISTED_SET,
    SpecSetting,
    format_setting,
    outside_steps,
    traits_from_server_info,
)
from specd.core.setting import parse as parse_setting
from specd.core.text import duration_text, iso_time, printable

if TYPE_CHECKING:
    from specd.io.config import Config
    from specd.io.override import OverrideStatus

PERMISSION = (errno.EACCES, errno.EPERM)
# The command refuses longer overrides: weeks of pinning belong in the config's step range.
MAX_CLI_DURATION = timedelta(days=30)
PIN_FOR = Duration(MAX_CLI_DURATION, "for longer, change min_steps/max_steps in the config")
FREEZE_FOR = Duration(
    MAX_CLI_DURATION,
    "for longer, turn automatic restarts off in the config (restart.daily_restart_budget = 0)",
)


_reason = reason_type("say why: the next on-call reads it")


def _pin_setting(text: str) -> SpecSetting:
    """``pin``'s argument: ``K``, ``off`` or ``adaptive:K1,K2,...`` (argparse's type)."""
    try:
        return parse_setting(text.strip())
    except ValueError as exc:
        if len(text) <= 40:  # the parser's reason quotes the text whole
            raise argparse.ArgumentTypeError(str(exc)) from None
        raise argparse.ArgumentTypeError(
            f"expected K, off or adaptive:K1,K2,..., got {quoted(text)}"
        ) from None


_pin_setting.__name__ = "setting"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = "Read or write the on-call override file."
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--file", type=Path, default=None, help="override file (default: config)")
    common.add_argument("--config", type=Path, default=None, help="specd config file")
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    pin = sub.add_parser("pin", parents=[common], help="run exactly this setting until it expires")
    pin.add_argument(
        "setting",
        type=_pin_setting,
        metavar="SETTING",
        help="a step count K, off (no speculation) or adaptive:K1,K2,... (SGLang's own "
        "per-batch switching among those step counts)",
    )
    pin.add_argument("--for", dest="duration", type=PIN_FOR, required=True, help=PIN_FOR.spec)
    pin.add_argument("--reason", type=_reason, required=True)
    pin.add_argument(
        "--now", action="store_true", help="restart at once instead of at the next window"
    )
    freeze = sub.add_parser("freeze", parents=[common], help="make no changes until it expires")
    freeze.add_argument(
        "--for", dest="duration", type=FREEZE_FOR, required=True, help=FREEZE_FOR.spec
    )
    freeze.add_argument("--reason", type=_reason, required=True)
    clear = sub.add_parser("clear", parents=[common], help="back to automatic (mode = auto)")
    clear.add_argument("--reason", type=_reason, default="override cleared")
    sub.add_parser("show", parents=[common], help="say whether the file is valid and its effect")


def _describe(
    status: OverrideStatus,
    path: Path,
    now: datetime,
    windows_text: str,
    checked: str | None = None,
) -> str:
    """What the file says and what specd does with it; ``windows_text``: when a pin's
    restart goes out (`_when`); ``checked``: what `_can_run` found of the pin just written
    (None: not asked)."""
    if not status.present:
        return f"{path}: no override file; specd decides automatically."
    if not status.valid:
        return (
            f"INVALID: {printable(status.problem or '')}\n"
            "specd ignores this file and keeps its last good state; fix or run "
            "`specd override clear`."
        )
    override = status.override
    assert override is not None
    if override.mode == "auto":
        return f"{path}: valid, mode auto; specd decides automatically."
    assert override.expires_at is not None
    # Imported here, not for --help (see the module's docstring).
    from specd.io.override import expired  # noqa: PLC0415

    why = f" — reason: {printable(override.reason)}" if override.reason else ""
    ago = expired(override, now)
    if ago is not None:
        return (
            # EXPIRED, as `specd status` and `specd doctor` say it (an on-call greps for it).
            f"{path}: {override.mode} EXPIRED {ago} ago "
            f"({iso_time(override.expires_at)}){why}\n"
            "specd decides automatically again; delete the file or run "
            "`specd override clear`, so nobody takes it for the setting in force."
        )
    left = duration_text((override.expires_at - now).total_seconds())
    until = f"until {iso_time(override.expires_at)} ({left} from now)"
    if override.mode == "freeze":
        return f"{path}: valid, freeze {until}{why}\nspecd makes no step changes until then."
    when = windows_text
    if override.setting is not None:
        text = format_setting(override.setting)
        what = "no speculation" if text == "off" else f"SGLang's adaptive mode {text}"
        if checked is None:
            return (
                f"{path}: valid, pin {text} {until}{why}\n"
                f"specd runs {what}; if SGLang runs another setting it restarts {when}, once "
                "it has checked that this server supports it (`specd doctor` lists what it "
                "offers)."
            )
        return (
            f"{path}: valid, pin {text} {until}{why}\n"
            f"specd runs {what}; if SGLang runs another setting it restarts {when}.\n{checked}"
        )
    return (
        f"{path}: valid, pin {override.steps} steps {until}{why}\n"
        f"specd runs {override.steps} steps; if SGLang runs another count it restarts {when}."
        + (f"\n{checked}" if checked else "")
    )


def _can_run(cfg: Config, setting: SpecSetting) -> tuple[str | None, str]:
    """Why this server or its unit cannot run ``setting`` (None: it can, or cannot be
    asked), and what was checked, as the daemon judges a pin (`unsupported`): a pin it
    cannot run restarts nothing and holds every automatic change until it expires."""
    # Imported here, not for --help (see the module's docstring).
    from specd.commands.status import server_info  # noqa: PLC0415
    from specd.io.apply import read_wiring  # noqa: PLC0415
    from specd.io.runner import SubprocessRunner  # noqa: PLC0415

    static_only, unit_unread = read_wiring(SubprocessRunner(), cfg.sglang.unit)
    return pin_unrunnable(cfg, setting, server_info(cfg), static_only, unit_unread)


def pin_unrunnable(
    cfg: Config,
    setting: SpecSetting,
    info: dict[str, Any] | str,
    static_only: str | None,
    unit_unread: str | None = None,
) -> tuple[str | None, str]:
    """`_can_run`'s judgement from what was already read: SGLang's /server_info (or why it
    did not answer), why the unit takes static step counts only (None: any) and why systemd
    could not say (None: it did)."""
    traits = traits_from_server_info(info) if isinstance(info, dict) else None
    if traits is not None and traits.algorithm is None:
        # SGLang runs off and reports no algorithm: the one specd applies stands in, as
        # the daemon's own; without one configured the daemon's memory may know it.
        known = cfg.sglang.speculative_algorithm
        traits = None if known is None else as_applied(traits, known)
    why = cannot_run(traits, static_only, setting)
    if why is not None:
        return why, ""
    if traits is None:
        asked = info if isinstance(info, str) else "it runs no speculation"
        return None, (
            f"could not ask SGLang whether it can run it ({printable(asked)}): specd checks "
            "before it restarts and holds the pin (`unsupported`) if it cannot"
        )
    if unit_unread is not None:
        # Never "checked" for what was not read: a unit whose ExecStart= takes static step
        # counts only is caught by the restart's verification instead, and rolled back.
        return None, (
            f"checked: SGLang at {cfg.sglang.url} can run it; {cfg.sglang.unit} could not be "
            f"read ({printable(unit_unread)}): whether its command line takes it, the "
            "restart's verification tells (it rolls back if not)"
        )
    return None, f"checked: SGLang at {cfg.sglang.url} and {cfg.sglang.unit} can run it"


def unsupported_pin_text(cannot: str) -> str:
    """What a pin in force that the server cannot run (``cannot``: why) does, and the way
    out: as `override show` and `specd doctor` say it."""
    return (
        f"this server cannot run it: {printable(cannot)}; specd restarts nothing "
        "and holds every automatic change (`unsupported`) until it expires: "
        "`specd override clear`, or pin a setting `specd doctor` lists"
    )


def pinned_setting(override: Override) -> SpecSetting:
    """The setting a pin holds (a static K is written as ``steps``)."""
    return override.setting or SpecSetting("static", steps=override.steps)


def _in_force(path: Path, cfg: Config, now: datetime) -> str | None:
    """The pin or freeze in force in ``path`` that writing replaces, and who wrote it (the
    next on-call may not know a colleague's freeze is there): None when none is."""
    # Imported here, not for --help (see the module's docstring).
    from specd.commands.status import (  # noqa: PLC0415
        read_override_as_daemon,
        setting_text,
        when_text,
    )
    from specd.io.override import written_by  # noqa: PLC0415

    status = read_override_as_daemon(cfg, now, path)
    held = status.override
    if held is None or not held.active(now) or held.expires_at is None:
        return None
    name = held.pinned_name
    what = f"the pin {setting_text(name)}" if name is not None else f"the {held.mode}"
    until = when_text(held.expires_at.timestamp(), now.timestamp(), iso_time(held.expires_at))
    why = f": {printable(held.reason)}" if held.reason else ""
    who = written_by(path)
    return f"{what} in force until {until}{why}" + (f" — written by {who}" if who else "")


# The decisions held by something other than the pin: a pin applied now waits for them
# too (`specd.core.decide.decide`), while its last one is this recent.
HOLDS_EVERY_RESTART = frozenset({"drain_unavailable", "fleet_unavailable", "state_unsaved"})
HOLD_FRESH_S = 600.0


def _when(cfg: Config, pin: Override, now: datetime, needs_s: float | None = None) -> str:
    """When the restart into ``pin`` goes out as the daemon holds it: at once (apply =
    now) unless the pin has spent its own restarts; else once a window holds the whole
    restart (``needs_s`` long, read here where None) and the daily budget allows one."""
    # Imported here, not for --help (see the module's docstring).
    from specd.commands.status import (  # noqa: PLC0415
        budget_note,
        restart_needs_of,
        restart_window,
        when_text,
    )
    from specd.commands.unfreeze import read_freeze  # noqa: PLC0415
    from specd.core.decide import Control, pin_restarts_spent  # noqa: PLC0415

    at = now.timestamp()
    found = read_freeze(cfg, at)
    restarts = found.restarts
    if pin.apply == "now":
        spent = pin_restarts_spent(pin, Control(None, restart_times=tuple(restarts)), cfg, at)
        if spent is not None:
            return f"not at once: {spent}"
        # What holds every restart, a pin applied now too (the gateway cannot drain, etcd
        # does not answer, the state cannot be saved), as the daemon's last decision found.
        last = found.last_decision
        held = last.get("reason") in HOLDS_EVERY_RESTART
        # state_unsaved keeps its time: what would move it on is a save.
        fresh = last.get("reason") == "state_unsaved" or (
            isinstance(last.get("t"), (int, float)) and at - last["t"] < HOLD_FRESH_S
        )
        if held and fresh:
            return (
                f"at once (apply = now) once what held specd's last decision clears: "
                f"{last['reason']} ({when_text(last['t'], at)}; `specd status` says what)"
            )
        return "at once (apply = now)"
    if needs_s is None:
        needs_s = restart_needs_of(cfg, pinned_setting(pin))
    text, opens = restart_window(cfg, now, needs_s)
    text = "now, inside the open maintenance window" if opens == now else text
    return text + budget_note(cfg, restarts, at, None if opens is None else opens.timestamp())


def _never_applies(
    override: Override, cfg: Config, now: datetime, needs_s: float
) -> tuple[datetime, timedelta, datetime | None] | None:
    """A pin waiting for a window that expires before one opens with time for its restart
    (``needs_s``: the unit's stop timeout and the start): (when the next window opens, the
    shortest --for that reaches it, when the open window closes where one is open but
    closes too soon). None when it can apply."""
    # Imported here, not for --help (see the module's docstring).
    from specd.core import windows  # noqa: PLC0415

    if override.mode != "pin" or override.apply == "now" or override.expires_at is None:
        return None
    # The daemon starts no restart the window cannot hold (window_ending): in an open
    # window's last minutes, or a next window too short, the pin waits for a longer one.
    usable = windows.holding(cfg.windows, needs_s, now)
    if usable is None:
        return None
    opens = usable[0]
    if opens == now or override.expires_at > opens:
        return None
    current = windows.current_window(cfg.windows, now)
    # Into the window by one restart's worth, rounded up to the hour.
    reach = opens - now + timedelta(seconds=needs_s)
    closes = None if current is None else current[1]
    return opens, timedelta(hours=math.ceil(reach.total_seconds() / 3600)), closes


def _frozen_note(cfg: Config, pin: Override, now: datetime) -> str | None:
    """The line saying that specd, frozen, holds ``pin`` too, and how to let it run; None
    when specd is not frozen. A pin does not lift a freeze: the restart that failed
    froze it, and only the on-call's `specd unfreeze` says that is dealt with."""
    from specd.commands.status import when_text  # noqa: PLC0415
    from specd.commands.unfreeze import read_freeze  # noqa: PLC0415

    found = read_freeze(cfg, now.timestamp())
    if found.unknown is not None:
        return f"note: {found.unknown}; a freeze holds this pin until `specd unfreeze`"
    if found.frozen is None:
        return None
    since = found.frozen.get("since")
    # As `specd unfreeze` and `specd status` say it: the time and how long ago.
    when = (
        f" since {when_text(float(since), now.timestamp())}"
        if isinstance(since, (int, float))
        else ""
    )
    retry = " --retry-pin" if pin.apply == "now" else ""
    return (
        f"note: specd is FROZEN{when} ({printable(str(found.frozen.get('reason')))}): it "
        f"changes nothing, this pin included, until unfrozen: `specd unfreeze{retry} "
        '--reason "..."` once the failed restart is dealt with'
    )


def _window_time(cfg: Config, at: datetime) -> str:
    """A window's opening on its own clock, as `specd status` and the decisions say it."""
    # Imported here, not for --help (see the module's docstring).
    from specd.core import windows  # noqa: PLC0415

    return iso_time(windows.local_time(cfg.windows, at))


def _hours(delta: timedelta) -> str:
    """Whole hours as --for takes them: ``20h``, ``1d``, ``1d4h``."""
    days, hours = divmod(int(delta.total_seconds() // 3600), 24)
    return (f"{days}d" if days else "") + (f"{hours}h" if hours or not days else "")


def run(args: argparse.Namespace) -> int:
    # Imported here, not for --help (see the module's docstring).
    from specd.commands.config_fallback import load_for_oncall  # noqa: PLC0415
    from specd.commands.status import (  # noqa: PLC0415
        daemon,
        read_override_as_daemon,
        restart_needs_of,
    )
    from specd.io.override import (  # noqa: PLC0415
        check_override_text,
        render_override,
        write_override,
    )

    # Without the calibration: a freeze or a pin must not wait for a fixed table. A file
    # with problems (a reload rejected it: the daemon runs on its last good config) gives
    # its valid parts, said on stderr, or refuses where [files] is among them.
    loaded = load_for_oncall("specd override", args.config)
    if loaded is None:
        return 2
    cfg = loaded.config
    path: Path = args.file if args.file is not None else cfg.files.override_file
    now = datetime.now(_UTC).replace(microsecond=0)
    replaced: str | None = None
    # How long the restart into the pin written may take (`status.restart_needs_of`, a
    # `systemctl show`): read once, for the check before writing and the text after.
    needs_s: float | None = None
    checked: str | None = None
    if args.action != "show":
        user = operator()
        if args.action == "clear":
            override = Override("auto", None, None, args.reason, "next-window")
        else:
            duration: timedelta = args.duration
            pinned: SpecSetting | None = args.setting if args.action == "pin" else None
            low, high = cfg.choose.min_steps, cfg.choose.max_steps
            listed = cfg.choose.adaptive_candidate_sets
            outside = () if pinned is None else outside_steps(pinned, low, high, listed)
            if outside:
                adaptive = pinned is not None and pinned.kind == "adaptive"
                unlisted = f", and {UNLISTED_SET}" if adaptive else ""
                print(
                    f"specd override: {', '.join(map(str, outside))} steps is outside the "
                    f"configured range {low}..{high}{unlisted}",
                    file=sys.stderr,
                )
                return 2
            apply: Apply = "now" if getattr(args, "now", False) else "next-window"
            steps = pinned.steps if pinned is not None and pinned.kind == "static" else None
            other = pinned if pinned is not None and pinned.kind != "static" else None
            override = Override(args.action, steps, now + duration, args.reason, apply, other)
            if pinned is not None:
                cannot, checked = _can_run(cfg, pinned)
                if cannot is not None:
                    print(
                        f"specd override: this server cannot run {format_setting(pinned)}: "
                        f"{printable(cannot)}; specd would restart nothing and hold every "
                        "automatic change until the pin expired (`specd doctor` lists what "
                        "it offers); nothing written",
                        file=sys.stderr,
                    )
                    return 2
        if args.action == "pin" and override.apply != "now":
            needs_s = restart_needs_of(cfg, pinned)
        late = _never_applies(override, cfg, now, needs_s or 0.0)
        if late is not None:
            opens, reach, closes = late
            assert override.expires_at is not None  # a pin that expires, or not late
            ending = (
                ""
                if closes is None
                else f"the open maintenance window closes at {_window_time(cfg, closes)}, "
                f"too soon for one restart (up to {(needs_s or 0.0) / 60:.1f} min), and "
            )
            print(
                f"specd override: {ending}the pin expires at {iso_time(override.expires_at)}, "
                f"before the next maintenance window opens ({_window_time(cfg, opens)}): it "
                f"would never apply. Restart at once with --now, or pin --for {_hours(reach)} "
                "or more; nothing written",
                file=sys.stderr,
            )
            return 2
        header = f"written by `specd override {args.action}` as {user} at {iso_time(now)}"
        text = render_override(override, header)
        # Checked as specd will read it before it replaces what is there: a file specd
        # would ignore must not take the place of one it obeys.
        refused = check_override_text(
            text,
            cfg.choose.min_steps,
            cfg.choose.max_steps,
            now,
            listed=cfg.choose.adaptive_candidate_sets,
        )
        if refused is not None:
            print(f"specd override: {refused}; nothing written", file=sys.stderr)
            return 2
        replaced = _in_force(path, cfg, now)
        try:
            write_override(path, text)
        except OSError as exc:
            hint = " (run it as root: sudo specd override ...)" if exc.errno in PERMISSION else ""
            print(
                f"specd override: cannot write {path}: {exc.strerror or exc}{hint}",
                file=sys.stderr,
            )
            return 1
    status = read_override_as_daemon(cfg, now, path)
    held = status.override
    if args.action == "show" and held is not None and held.active(now) and held.mode == "pin":
        # What the daemon does with it: a pin it cannot run is held `unsupported`.
        pinned = pinned_setting(held)
        cannot, checked = _can_run(cfg, pinned)
        if cannot is not None:
            checked = f"BUT {unsupported_pin_text(cannot)}"
    when = "" if held is None or held.mode != "pin" else _when(cfg, held, now, needs_s)
    print(_describe(status, path, now, when, checked))
    if replaced is not None:
        print(f"replaces {replaced}")
    if held is not None and held.mode == "pin" and held.active(now):
        frozen = _frozen_note(cfg, held, now)
        if frozen is not None:
            print(frozen)
    running = daemon(cfg.files.state_dir)
    if running["running"] is False:
        print(
            "note: specd is not running: nothing reads this file until it starts "
            "(`systemctl start specd`)"
        )
    elif running.get("problem"):
        print(f"note: cannot tell whether specd runs: {running['problem']}")
    return 0 if status.valid else 1
