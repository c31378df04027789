"""`specd status`: what specd is doing, from its state file, for the on-call.

Reads only: state.json (never moved aside or rewritten here), the config, the override
file, with a [fleet] who holds the group's slots in etcd, and SGLang's /server_info (for
which settings specd may choose there; one short request through the SGLang reader). Works
while the daemon runs, and when it does not.
"""

from __future__ import annotations

import argparse
import errno
import json
import stat
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from specd.commands.config_fallback import load_for_oncall
from specd.core import explore, windows
from specd.core.history import HistorySettings
from specd.core.model import MIN_ACCEPT_EVIDENCE_S, live_acceptance, restart_extra_s
from specd.core.observation import ScrapeError
from specd.core.outcome import heading, label
from specd.core.setting import SpecSetting, format_setting, traits_from_server_info
from specd.core.text import duration_text, iso_time, printable
from specd.core.units import DAY_S
from specd.io.apply import (
    Journal,
    JournalError,
    read_static_only,
    read_stop_timeout_s,
    restart_needs_s,
)
from specd.io.calibration import configured_offer
from specd.io.config import DEFAULT_CONFIG_PATH, Config, check_calibration
from specd.io.files import FileReadError, MissingFileError, read_regular_file_and_stat
from specd.io.fleet import Fleet, FleetUnavailable, same_instance
from specd.io.override import OverrideStatus, read_override
from specd.io.runner import SubprocessRunner
from specd.io.sglang import SGLangClient
from specd.io.state import (
    LOCK_FILE,
    STATE_FILE,
    STATE_SAVE_INTERVAL_S,
    STATUS_FILE,
    State,
    StateNotRead,
    held_freeze,
    is_finite_number,
    read_state,
    read_status,
    salvage_note,
    with_status,
)

# The kernel's table of file locks: who holds the `specd run` lock, read without taking it
# (a status holding it for a moment would make a daemon starting then refuse to run).
PROC_LOCKS = Path("/proc/locks")
# The lock file holds the daemon's pid and a newline; a bigger one is none specd wrote.
MAX_LOCK_FILE_BYTES = 64
# status must answer at once, also when SGLang is down or still loading.
SERVER_INFO_TIMEOUT_S = 2.0


def _name_of(steps: object) -> str | None:
    """A step count from the state file as a setting's name (0: off); None if not one."""
    if isinstance(steps, bool) or not isinstance(steps, int):
        return None
    return label(steps, None)


def _shown(name: object) -> str:
    return name if isinstance(name, str) and name else "?"


def setting_text(name: str) -> str:
    """A setting for a line: "4 steps", "off", "adaptive:3,4" (a bare number would not say
    what it counts)."""
    return f"{name} steps" if name.isdigit() else name


def override_text(ov: dict[str, Any], now: float) -> str:
    """The override line (`override_info`): what is in force, or why nothing in the file
    is; `specd doctor` says the same."""
    if not ov["valid"]:
        return f"INVALID, ignored (specd keeps its last good state): {printable(ov['problem'])}"
    mode = ov["mode"]
    if mode == "auto":
        return "auto: specd decides"
    what = f"pin {setting_text(ov['setting'] or '?')}" if mode == "pin" else "freeze"
    why = f": {printable(ov['reason'])}" if ov["reason"] else ""
    if ov["expired_s"] is not None:
        return (
            f"{what} EXPIRED {duration_text(ov['expired_s'])} ago ({ov['expires_at']}){why}; "
            "specd decides by itself: delete the file or `specd override clear`"
        )
    until = datetime.fromisoformat(ov["expires_at"]).timestamp()
    return f"{what} until {when_text(until, now, ov['expires_at'])}{why}"


def _mode(override: OverrideStatus, at: datetime) -> str | None:
    """What the override file puts in force: "pin", "freeze" or "auto"; None when the file
    is invalid: specd ignores it and keeps the last valid override it read since its start,
    which only the daemon knows (not "auto": that may be a freeze)."""
    if override.present and not override.valid:
        return None
    held = override.override
    return held.mode if held is not None and held.active(at) else "auto"


def _mode_text(mode: str | None) -> str:
    if mode is not None:
        return mode
    return (
        "unknown: the override file is invalid, so specd keeps the last valid override it "
        "read since it started, if any (the last decision says which)"
    )


def restart_needs_of(config: Config, setting: SpecSetting | None) -> float:
    """How long one restart into ``setting`` may take, as the daemon counts it: the unit's
    stop timeout (systemd's default where it cannot say), the start, an adaptive set's
    extra graphs (None: a change of the policy's, counted as a static one's)."""
    stop_s = read_stop_timeout_s(
        SubprocessRunner(), config.sglang.unit, config.restart.restart_command_timeout_s
    )
    extra_s = 0.0 if setting is None else restart_extra_s(setting, config)
    return restart_needs_s(stop_s, config.choose.restart_cost_s) + extra_s


def restart_window(config: Config, at: datetime, needs_s: float) -> tuple[str, datetime | None]:
    """When a restart needing ``needs_s`` goes out as the daemon waits for it (an open
    period with that much left: `windows.holding`), as text for "restarts SGLang …", and
    that instant (None: never)."""
    usable = windows.holding(config.windows, needs_s, at)
    if usable is None:
        return "in no maintenance window: none ahead holds one restart", None
    if usable[0] == at:
        return "inside the open maintenance window", at
    opens = windows.next_open(config.windows, at)
    too_soon = f"too soon for one restart (up to {needs_s / 60:.1f} min)"
    shown = iso_time(windows.local_time(config.windows, usable[0]))
    if usable[0] != opens:
        first = iso_time(windows.local_time(config.windows, opens))
        return (
            f"in the first maintenance window with time for one restart ({shown}): the "
            f"next, at {first}, closes {too_soon}"
        ), usable[0]
    text = f"in the next maintenance window ({shown})"
    current = windows.current_window(config.windows, at)
    if current is not None:
        closes = iso_time(windows.local_time(config.windows, current[1]))
        text += f": the open one closes at {closes}, {too_soon}"
    return text, usable[0]


def budget_note(config: Config, restarts: list[float], now: float, opens: float | None) -> str:
    """ "; none before …" where the daily restart budget holds a change past ``opens`` (when
    the window would let it go out; None: never), as `decide` counts it from ``restarts``
    (when SGLang was restarted, once per restart); "" where it does not. A pin applied now
    is not held by it (`specd.core.decide.pin_restarts_spent` bounds that one)."""
    budget = config.restart.daily_restart_budget
    recent = sorted(t for t in restarts if now - DAY_S < t <= now)
    if len(recent) < budget:
        return ""
    # No restart until enough of these are a day old.
    free = recent[len(recent) - budget] + DAY_S if budget else None
    if free is not None and opens is not None and free <= opens:
        return ""
    after = f"none before {when_text(free, now)}" if free is not None else "none at all"
    return f"; {after} (restart budget: {len(recent)} restarts in 24 h, {budget} allowed)"


def when_text(ts: float | None, now: float, shown: str | None = None) -> str:
    """``ts`` in UTC as every time specd prints (ISO 8601 with its offset; or as
    ``shown``, a window's own clock), and how long before or after ``now``."""
    if ts is None:
        return "never"
    at = shown or iso_time(datetime.fromtimestamp(ts, tz=timezone.utc))
    delta = ts - now
    # As every span specd prints: "42 s", "7.5 min", "3.2 h" (doctor, override, decisions).
    human = duration_text(abs(delta))
    return f"{at} ({'in ' + human if delta > 0 else human + ' ago'})"


def daemon(state_dir: str | Path, locks: Path = PROC_LOCKS) -> dict[str, Any]:
    """Whether a `specd run` holds ``state_dir``'s lock: ``{"running": bool | None, "pid":
    int | None}``, running None when it cannot tell (no /proc/locks, the directory not
    searchable). The lock is the daemon's (`specd.io.state.lock_state_dir`): an flock held
    for its life, released when it ends, even killed; the pid is the kernel's.

    The lock file is read as specd reads any file it does not trust: no symlink followed,
    a regular file only, without blocking, at most `MAX_LOCK_FILE_BYTES` (a FIFO there
    hung every on-call command, a link to /dev/zero was read without end). Anything else
    there leaves it unable to tell: running None, and ``"problem"`` says why in one line."""
    path = Path(state_dir) / LOCK_FILE
    try:
        written_bytes, st = read_regular_file_and_stat(path, MAX_LOCK_FILE_BYTES)
    except MissingFileError:
        return {"running": False, "pid": None}  # no specd ever ran on this directory
    except FileReadError as exc:
        try:
            st = path.lstat()
        except OSError:
            return {"running": None, "pid": None}  # the directory not searchable
        if not stat.S_ISREG(st.st_mode):
            # No `specd run` takes it (`lock_state_dir`); one that ran before it was put
            # there holds a file no longer in the directory, found by no inode.
            return _lock_unknown(f"{exc}; `specd run` refuses to start with it there: remove it")
        if exc.os_errno not in (errno.EACCES, errno.EPERM):
            return _lock_unknown(str(exc))  # too big, or the read failed
        # 0640 root:specd: whoever may not read it still sees the lock, by its inode.
        written_bytes = b""
    written = written_bytes.decode("ascii", errors="replace").strip()
    inode = st.st_ino
    try:
        table = locks.read_text(encoding="ascii", errors="replace")
    except OSError:
        return {"running": None, "pid": None}
    for entry in table.splitlines():
        # "1: FLOCK  ADVISORY  WRITE 27467 fe:00:2205828 0 EOF"; "1: -> FLOCK ..." waits.
        fields = entry.split()
        if len(fields) < 6 or fields[1] != "FLOCK" or not fields[4].isdigit():
            continue
        pid, where = fields[4], fields[5].rsplit(":", 1)[-1]
        if where == str(inode) and (not written.isdigit() or written == pid):
            return {"running": True, "pid": int(pid)}
    return {"running": False, "pid": None}


def _lock_unknown(problem: str) -> dict[str, Any]:
    """`daemon`'s answer when its lock file says nothing it can trust: not known, and why
    (one line, as every command prints it)."""
    return {"running": None, "pid": None, "problem": printable(problem)}


def daemon_text(info: dict[str, Any]) -> str:
    """The `specd` line of status."""
    if info["running"]:
        return f"running (pid {info['pid']})"
    if info["running"] is None:
        why = f": {info['problem']}" if info.get("problem") else ""
        return f"? (cannot tell whether `specd run` holds its state directory's lock{why})"
    return (
        "NOT RUNNING: nothing decides or restarts; below is what it saved last "
        "(`systemctl start specd`; why it stopped: `journalctl -u specd`)"
    )


def server_info(config: Config) -> dict[str, Any] | str:
    """SGLang's /server_info, or why it did not answer (one line)."""
    with SGLangClient(
        config.sglang.url,
        timeout_s=SERVER_INFO_TIMEOUT_S,
        api_key=config.sglang.server_api_key_file,
    ) as client:
        info = client.server_info()
    if isinstance(info, ScrapeError):
        return f"{config.sglang.url} did not answer /server_info: {info.reason}"
    return info


def choices(
    config: Config, info: dict[str, Any] | str | None, static_only: str | None = None
) -> dict[str, Any]:
    """Which kinds of setting specd may choose on the server, and why not the others:
    as the daemon offers them, from the config, the calibration's rows, /server_info and
    the unit's wiring (``static_only``, `specd.io.apply.read_static_only`)."""
    traits = traits_from_server_info(info) if isinstance(info, dict) else None
    got, lines = configured_offer(
        config.choose, traits, static_only, config.sglang.speculative_algorithm
    )
    return {
        # Empty where the calibration cannot be read: ``lines`` says so.
        "kinds": {} if got is None else dict(got.kinds),
        "settings": [] if got is None else [format_setting(s) for s in got.settings],
        "refused": {} if got is None else dict(got.refused),
        # As doctor says them: how each swept set is predicted, and a sweep nothing reads.
        "lines": lines,
        "server_problem": info if isinstance(info, str) else None,
    }


def read_override_as_daemon(
    config: Config, at: datetime | float, path: Path | None = None
) -> OverrideStatus:
    """The override file (``path``, else the config's) judged as the daemon, running as
    user specd, finds it (its owner, mode, and whether that user can read it at all)."""
    return read_override(
        Path(config.files.override_file) if path is None else path,
        config.choose.min_steps,
        config.choose.max_steps,
        at,
        as_daemon=True,
        listed=config.choose.adaptive_candidate_sets,
    )


def override_info(config: Config, override: OverrideStatus, at: datetime) -> dict[str, Any]:
    """What the override file holds and whether it is in force, for `override_text` (and
    status's JSON)."""
    current = override.override if override.valid else None
    return {
        "file": str(config.files.override_file),
        "present": override.present,
        "valid": override.valid,
        "problem": override.problem,
        "mode": current.mode if current else None,
        "steps": current.steps if current else None,
        # What a pin holds as the operator writes it ("4", "off", "adaptive:3,4").
        "setting": current.pinned_name if current else None,
        "expires_at": iso_time(current.expires_at) if current and current.expires_at else None,
        # Seconds since a pin or freeze expired (still in the file, no longer in force).
        "expired_s": (
            (at - current.expires_at).total_seconds()
            if current and current.mode != "auto" and current.expires_at and not current.active(at)
            else None
        ),
        "reason": current.reason if current else None,
    }


def collect(
    config: Config,
    now: float,
    info: dict[str, Any] | str | None = None,
    static_only: str | None = None,
) -> dict[str, Any]:
    """What the on-call needs, from the state file as the daemon validates it; ``info`` is
    SGLang's /server_info (or why it did not answer) and ``static_only`` why the unit takes
    static step counts only, for the choices."""
    state_path = Path(config.files.state_dir) / STATE_FILE
    state_problem: str | None = None
    unreadable = False
    unknown = False
    dropped: list[str] = []
    try:
        # As the daemon loads it: bad parts left out and named, good parts shown.
        state = read_state(state_path, HistorySettings.from_config(config), dropped, now=now)
        # The last decision and what runs, written at each change of either (state.json is
        # written once a minute).
        with_status(state, read_status(Path(config.files.state_dir) / STATUS_FILE))
        if dropped:
            # Shown as specd would load it, and still an error: what status shows is not
            # all the file holds, and specd rewrote it whole at its own start.
            state_problem = f"{state_path}: {salvage_note(dropped)} (as specd does at start)"
            unreadable = True
    except FileNotFoundError:
        state, state_problem = State(), "no state yet (specd has not run)"
    except (OSError, ValueError) as exc:
        detail = f"{exc.strerror or exc}" if isinstance(exc, OSError) else str(exc)
        state, state_problem, unreadable = State(), f"{state_path}: {detail}", True
        state.frozen = held_freeze(exc, now, detail)  # as the daemon's next start keeps it
        # Not read at all (permissions: not root nor in group specd): what it holds is
        # unknown, not the defaults an empty state would show ("frozen no").
        unknown = isinstance(exc, (OSError, StateNotRead))
    running = daemon(config.files.state_dir)
    if state_problem is None and running["running"] and state.journal is None:
        stale = _not_saved(state_path, config, now, state.last_decision)
        if stale is not None:
            state_problem, unreadable = stale, True
    at = datetime.fromtimestamp(now, tz=timezone.utc)
    override = read_override_as_daemon(config, at)
    restarts = [r for r in state.restarts if now - float(r["t"]) < DAY_S]
    # What the budget counts: SGLang restarts (a rollback's two), not sequences.
    restarted = state.restarts_in_day(now)
    opens = windows.next_open(config.windows, at)
    closes = windows.next_close(config.windows, at)
    decision = state.last_decision
    live = state.live or {}
    return {
        # Whether a `specd run` holds the state directory now: without one, what follows is
        # what it saved last, and nothing decides.
        "daemon": running,
        "state_file": str(state_path),
        "state_problem": state_problem,
        "state_unreadable": unreadable,
        # Not read at all: frozen, the last decision and the restarts are unknown.
        "state_unknown": unknown,
        "current_steps": live.get("steps"),
        # What runs as the operator writes it ("4", "off", "adaptive:3,4"); a state file
        # from before names only the step count.
        "current_setting": live.get("setting", _name_of(live.get("steps"))),
        "live_since": live.get("t"),
        "live_source": live.get("source"),
        "target_steps": decision.get("target_steps"),
        "target_setting": decision.get("target_setting", _name_of(decision.get("target_steps"))),
        "last_decision": decision,
        "mode": _mode(override, at),
        # What a start of specd would refuse; the running daemon keeps its last good table.
        "calibration_problem": next(iter(check_calibration(config)), None),
        "override": override_info(config, override, at),
        "frozen": state.frozen,
        # Step counts that regressed after a change, skipped by the policy until "until".
        "avoided": [
            {
                # K (0: off); None for an adaptive set, whose key is a hash: "setting" names it.
                "steps": e.steps if e.setting is None else None,
                "from_steps": e.from_steps if e.from_setting is None else None,
                "setting": e.name,
                "from_setting": e.from_name,
                "shortfall_ratio": e.shortfall_ratio,
                "since": e.t,
                "until": e.t + config.choose.regression_avoid_s,
                # The traffic it regressed under ([concurrency, share]): the policy tries it
                # again sooner where the traffic moves far from it (`outcome.avoided`).
                "mix": [list(pair) for pair in e.mix],
                "lift_mix_ratio": config.choose.regression_lift_mix_ratio,
            }
            for e in state.avoided
            if now - e.t < config.choose.regression_avoid_s
        ],
        "acceptance": _acceptance(state),
        "explorations": _explorations(config, state.explorations, now, live.get("steps")),
        "verifying": _verifying(config, state, now),
        "restart_in_progress": state.journal,
        "restarts_last_24h": restarts,
        "sglang_restarts_last_24h": restarted,
        "restart_budget_remaining": max(0, config.restart.daily_restart_budget - restarted),
        "gateway": _gateway_info(config, state),
        "window_open": windows.is_open(config.windows, at),
        "next_window_open": opens.timestamp(),
        "next_window_close": closes.timestamp(),
        # The same instants on the window's own clock, ISO 8601 with its offset (as the
        # cron reads them: 2026-12-07T03:00:00+01:00 for 03:00 in Europe/Berlin).
        "next_window_open_at": _local(config, opens),
        "next_window_close_at": _local(config, closes),
        # When a restart can go out (an open period with time for one static restart):
        # now, the next opening, or later where those are too short; None: never.
        "next_restart_possible_at": _restart_possible(config, at),
        "fleet": fleet_status(config),
        "choices": choices(config, info, static_only),
    }


def _not_saved(path: Path, config: Config, now: float, decision: dict[str, Any]) -> str | None:
    """Why what state.json holds is not what the running daemon holds: it saves the file
    every `STATE_SAVE_INTERVAL_S` (or each tick, when ticks are longer), so one far older
    says its writes fail (a full or read-only state directory); what status shows is then
    from before, and the daemon holds every restart (state_unsaved). None when recent.
    Not asked while a restart runs (its journal), and allowed its waits (a fleet slot, a
    quiet moment: nothing saved for up to their bounds) after a ``decision`` that acts."""
    try:
        saved = path.stat().st_mtime
    except OSError:
        return None
    every = max(STATE_SAVE_INTERVAL_S, config.observe.scrape_interval_s)
    bound = 3 * every + 60
    if decision.get("acts"):
        # Saved as a change began: its waits for a fleet slot and a quiet moment come
        # before the journal, and save nothing meanwhile.
        fleet = config.fleet.slot_wait_max_s if config.fleet is not None else 0.0
        bound += fleet + config.restart.quiet_deadline_s
    if now - saved <= bound:
        return None
    return (
        f"{path}: not saved since {when_text(saved, now)} while specd runs (it saves every "
        f"{duration_text(every)}): its writes fail (its log: state_write_failed; a full or "
        f"read-only {path.parent}?), and it holds every restart until they work; what "
        "follows is from then"
    )


def _restart_possible(config: Config, at: datetime) -> str | None:
    usable = windows.holding(config.windows, restart_needs_of(config, None), at)
    return None if usable is None else _local(config, usable[0])


def _local(config: Config, at: datetime) -> str:
    return windows.local_time(config.windows, at).isoformat(timespec="seconds")


def _local_at(config: Config, t: float | None) -> str | None:
    """Unix time ``t`` on the window's own clock (`_local`); None for None."""
    return None if t is None else _local(config, datetime.fromtimestamp(t, tz=timezone.utc))


def _acceptance(state: State) -> dict[str, Any]:
    """What specd measured of the box's acceptance, as the model reads it: the α that
    scales every step count's sweep row (None: the sweep's own), and per step count."""
    live = live_acceptance(state.history)
    return {
        "alpha": live.alpha,
        "measured_s": live.measured_s,
        "needed_s": MIN_ACCEPT_EVIDENCE_S,
        "per_steps": [
            {"steps": k, "accept_length": length, "measured_s": seconds}
            for k, length, seconds in live.lengths
        ],
    }


def _acceptance_line(acceptance: dict[str, Any]) -> str:
    per = ", ".join(
        f"{p['steps']} steps {p['accept_length']:.2f} tokens per verify over "
        f"{duration_text(p['measured_s'])}"
        for p in acceptance["per_steps"]
    )
    if acceptance["alpha"] is not None:
        return (
            f"acceptance     α {acceptance['alpha']:.3f} measured here ({per}): every step "
            "count is predicted with it"
        )
    measured = (
        f"{duration_text(acceptance['measured_s'])} measured of the "
        f"{duration_text(acceptance['needed_s'])} needed ({per})"
        if per
        else "none measured yet"
    )
    return f"acceptance     the sweep's: {measured}"


def _explorations(
    config: Config, explorations: list[list[float]], now: float, current: int | None
) -> dict[str, Any] | None:
    """The model policy's explorations of the rolling week (`specd.core.explore`): which
    step count, since when, until when its epoch runs, and whether it is being measured
    now (it runs, ``current``, in that epoch); None under the bands, which never explore.
    A step count that changed at an odd hour for no load change is one."""
    if config.choose.policy != "model":
        return None
    week = explore.this_week([(float(t), int(k)) for t, k in explorations], now)
    # As the daemon holds it: the latest, while its step count is live and its epoch runs.
    ongoing = explore.ongoing(week, current, config, now)
    recent = []
    for t, k in week:
        until = explore.epoch_end(config, t)
        recent.append(
            {
                "steps": k,
                "t": t,
                "until": until,
                # On the window's own clock, as the window line shows it.
                "until_at": _local_at(config, until),
                "measuring": ongoing is not None and (t, k) == week[-1],
            }
        )
    return {"max_per_week": config.choose.explore_max_per_week, "recent": recent}


def _verifying(config: Config, state: State, now: float) -> dict[str, Any] | None:
    """The change specd is verifying by its outcome (`specd.core.outcome`): what it changed
    from and to, when, what it predicted, and until when it goes back if that loses; None
    when none is, or its verification lapsed."""
    snap = state.verifying
    if snap is None or snap.lapsed(now):
        return None
    old, new = label(snap.from_steps, snap.from_setting), label(snap.to_steps, snap.to_setting)
    live = (state.live or {}).get("setting")
    if isinstance(live, str) and live != new:
        # Not what runs (a state file from before a rollback cleared it): the daemon's
        # verdict reads the live setting only, so nothing is verified.
        return None
    said = state.last_decision.get("outcome")
    # Only a verdict on this change (the tick that made it judged the one before, if any).
    if not isinstance(said, str) or not said.startswith(heading(snap)):
        said = None
    return {
        "from_setting": old,
        "to_setting": new,
        "since": snap.t,
        "predicted_gain_ratio": snap.predicted_gain_ratio,
        "until": snap.until,
        "until_at": _local_at(config, snap.until),
        # Per load band of its forecast: [band, predicted ratio new/old, share of the epoch].
        "predicted_bands": [list(entry) for entry in snap.predicted],
        # The daemon's verdict on it at its last decision (what it served so far), if any.
        "outcome": said,
    }


def _verifying_line(verifying: dict[str, Any], now: float) -> str:
    gain = verifying["predicted_gain_ratio"]
    predicted = "" if gain is None else f", predicted {gain * 100:+.1f}% for its epoch"
    until = verifying["until"]
    lasts = (
        ""
        if until is None
        else f", until the window closes {when_text(until, now, verifying['until_at'])}"
    )
    return (
        f"verifying      {verifying['from_setting']} → {verifying['to_setting']} "
        f"{when_text(verifying['since'], now)}{predicted}: goes back if it serves less beyond "
        f"noise{lasts}"
    )


def _restart_note(info: dict[str, Any], now: float) -> str:
    """Where the open window's last minutes, or the next window, hold no restart: when one
    can go out (the daemon says window_ending, or waits, until then)."""
    possible = info.get("next_restart_possible_at")
    if possible is None:
        return "; no window ahead holds one restart"
    at = datetime.fromisoformat(possible).timestamp()
    if at <= now or (not info["window_open"] and at == info["next_window_open"]):
        return ""
    return f"; a restart can go out from {when_text(at, now, possible)} (too short before)"


def _avoided_mix(entry: dict[str, Any]) -> str:
    """Under what traffic it is avoided: the policy tries it again, even before "until",
    where the traffic's mix moves far from the one it regressed under."""
    mix = sorted(entry.get("mix") or [], key=lambda pair: -pair[1])
    if not mix:
        return ""
    shown = ", ".join(f"{int(c)} ({share * 100:.0f}%)" for c, share in mix[:3])
    return (
        f", for traffic like it regressed under (offered {shown}): where the mix moves more "
        f"than regression_lift_mix_ratio {entry['lift_mix_ratio']:g} from it, specd may run "
        "it again"
    )


def _explored_line(explored: dict[str, Any], now: float) -> str:
    recent = explored["recent"]
    most = explored["max_per_week"]
    if not recent:
        return f"explored       none in the last 7 days (at most {most} a week, one per step count)"
    shown = [
        f"{e['steps']} steps {when_text(e['t'], now)}"
        + (
            f", measured until the window {when_text(e['until'], now, e['until_at'])}"
            if e["measuring"] and e["until"] is not None
            # Rolled back, or changed from since: the daemon measures it no more.
            else f", no longer runs: measured no more (its epoch ends {when_text(e['until'], now)})"
            if e["until"] is not None and e["until"] > now
            else ""
        )
        for e in recent
    ]
    return f"explored       {len(recent)} of {most} in the last 7 days: {'; '.join(shown)}"


def fleet_status(config: Config) -> dict[str, Any] | None:
    """The group, this specd's name in it, who holds which slot and which servers are out
    of service for a restart (etcd asked once)."""
    if config.fleet is None:
        return None
    fleet = Fleet.from_settings(config.fleet, config.sglang.unit)
    info: dict[str, Any] = {
        "group": fleet.group,
        "slots": fleet.slots,
        "this_holder": fleet.holder,
        "this_instance": fleet.instance,
        "endpoints": config.fleet.etcd_endpoints,
        "holders": None,
        "out": None,
        "problem": None,
        "clash": None,
    }
    try:
        busy = fleet.busy()
        info["holders"] = [h.to_dict() for h in busy.holders]
        info["out"] = [o.to_dict() for o in busy.out]
        info["clash"] = fleet.clash(busy)
    except FleetUnavailable as exc:
        info["problem"] = str(exc)
    finally:
        fleet.close()
    return info


def _fleet_line(
    fleet: dict[str, Any], now: float, *, restarting: bool = False, left_out: bool = False
) -> str:
    """``restarting``: a restart of this server runs (its journal); ``left_out``: a gateway
    replica leaves its worker out: why this server's own marker is there between restarts."""
    head = f"fleet          group {fleet['group']}, {fleet['slots']} slot(s)"
    if fleet["problem"] is not None:
        return f"{head}: etcd UNAVAILABLE (no restart until it answers): {fleet['problem']}"

    def mine(key: dict[str, Any]) -> bool:
        return key["name"] == fleet["this_holder"] and same_instance(
            key.get("instance"), fleet.get("this_instance")
        )

    held = [
        f"slot {h['slot']} held by {h['name']}"
        + (" (this specd)" if mine(h) else "")
        + (f" since {when_text(h['since'], now)}" if h["since"] is not None else "")
        for h in fleet["holders"]
    ]
    holding = {h["name"] for h in fleet["holders"]}
    # Servers out for a restart; one whose holder holds no slot any more (its specd died or
    # lost etcd mid-restart) still counts against the slots until it is back.
    out = [
        f"{o['name']} OUT OF SERVICE"
        + (" (this specd)" if mine(o) else "")
        + (f" since {when_text(o['since'], now)}" if o["since"] is not None else "")
        + (
            ""
            if o["name"] in holding
            else " (holds no slot; counted"
            + (f" until {when_text(o['until'], now)} at the latest" if o["until"] else "")
            + " unless back sooner)"
        )
        + (
            _own_marker_why(left_out)
            if mine(o) and o["name"] not in holding and not restarting
            else ""
        )
        for o in fleet["out"] or []
    ]
    line = f"{head}: " + ("; ".join(held + out) if held or out else "all free")
    if fleet.get("clash"):
        return f"{line}; HOLDER NAME CLASH (no restart until it is fixed): {fleet['clash']}"
    return line


def _own_marker_why(left_out: bool) -> str:
    """Why this server's marker is in etcd though no restart of it runs."""
    if left_out:
        return (
            ": kept while a gateway replica leaves the worker out (see gateway); removed "
            "once every replica routes it"
        )
    return (
        ": no restart of it runs (a removal etcd refused): the running specd removes it once "
        "SGLang answers and etcd takes it (SpecdFleetMarkerLeftBehind)"
    )


def _gateway_info(config: Config, state: State) -> dict[str, Any] | None:
    """The drain state: the latest probe, the latest drain, and what is out of routing now
    (the restart journal's drained workers not yet re-added)."""
    if config.gateway is None:
        return None
    kept = state.gateway or {}
    journal = state.journal or {}
    drained = journal.get("drained") if not journal.get("readded") else None
    return {
        "urls": list(config.gateway.urls),
        "probe": kept.get("probe"),
        "last_drain": kept.get("last_drain"),
        "drained_now": [w.get("gateway_url") for w in drained or [] if isinstance(w, dict)],
        "left_out": kept.get("left_out"),
    }


def _gateway_lines(gateway: dict[str, Any], now: float) -> list[str]:
    replicas = len(gateway["urls"])
    lines = []
    probe = gateway["probe"]
    if gateway["drained_now"]:
        head = f"DRAINED from {len(gateway['drained_now'])} of {replicas} replicas (restart)"
    elif not probe:
        head = f"{replicas} replicas, not asked yet"
    elif probe.get("problem"):
        head = f"UNAVAILABLE: {probe['problem']} ({when_text(probe.get('t'), now)})"
    elif probe.get("not_ready_replicas"):
        head = (
            f"worker NOT READY on {probe['not_ready_replicas']} of {replicas} replicas "
            f"({when_text(probe.get('t'), now)})"
        )
    else:
        head = f"worker ready on all {replicas} replicas ({when_text(probe.get('t'), now)})"
    lines.append(f"gateway        {head}")
    drain = gateway["last_drain"]
    if drain:
        what = (
            f"{drain.get('result')} after {float(drain.get('duration_s') or 0):.1f} s"
            if drain.get("result")
            else "re-add after specd restarted"
        )
        if drain.get("in_flight_at_restart") is not None:
            what += f", {drain['in_flight_at_restart']} in flight at the restart"
        if drain.get("readd_problem") and drain.get("readded_at") is not None:
            what += f"; worker left out, routed again {when_text(drain['readded_at'], now)}"
        elif drain.get("readd_problem"):
            what += f"; WORKER LEFT OUT: {drain['readd_problem']}"
        lines.append(f"last drain     {what} ({when_text(drain.get('t'), now)})")
    left_out = gateway.get("left_out")
    if isinstance(left_out, dict):
        replicas = len(left_out.get("workers") or [])
        tried = left_out.get("problem") or "the gateway took it, not routed as ready yet"
        lines.append(
            f"left out       worker out of routing on {replicas} replica(s) since "
            f"{when_text(left_out.get('t'), now)}: specd re-adds it each minute while SGLang "
            f"answers (last try {when_text(left_out.get('tried_at'), now)}: {tried})"
        )
    return lines


def _journal_number(journal: dict[str, Any], key: str) -> float | None:
    value = journal.get(key)
    return float(value) if is_finite_number(value) else None


def _restart_line(journal: dict[str, Any], daemon: dict[str, Any], now: float) -> str:
    """The restart a journal records: the change, where it stands, and who finishes it. A
    bare phase read "restart_issued" for a restart a shutdown cut short, which the next
    start only verifies, and said nothing of a rollback waiting out the start limit."""
    old = setting_text(
        printable(str(journal.get("from_setting") or _name_of(journal.get("from_steps")) or "?"))
    )
    new = setting_text(
        printable(str(journal.get("to_setting") or _name_of(journal.get("to_steps")) or "?"))
    )
    change = f"{old} → {new}"
    try:
        Journal.from_dict(journal)
    except JournalError as exc:
        # As specd's start reads it: not a restart it can finish, so a freeze (it was
        # shown as a restart in progress that the next start finishes).
        return (
            f"restart        UNUSABLE journal ({printable(str(exc))}; {change}): specd's "
            "next start cannot finish it and freezes; check what SGLang runs "
            "(`specd doctor`), then `specd unfreeze --reason ...` once specd has started"
        )
    phase = printable(str(journal.get("phase")))
    started = when_text(_journal_number(journal, "started_at"), now)
    shutdown = journal.get("shutdown")
    if isinstance(shutdown, str):
        return (
            f"restart        {change} cut short by a shutdown (started {started}; "
            f"{printable(shutdown)}): the env file is back on {old}, which "
            "SGLang boots on; specd's next start verifies it, restarting nothing"
        )
    line = f"restart        IN PROGRESS: {change}, {phase} (started {started})"
    until = _journal_number(journal, "refused_until")
    if until is not None:
        line += (
            f"; the rollback waits out {printable(str(journal.get('unit')))}'s start limit "
            f"until {when_text(until, now)}"
        )
    if daemon.get("running") is False:
        line += "; specd is not running: its next start finishes it"
    return line


def render(info: dict[str, Any], now: float) -> str:
    d = info["last_decision"]
    unknown = "UNKNOWN: the state file could not be read (below)"
    lines = [
        f"specd          {daemon_text(info['daemon'])}",
        f"steps live     {_shown(info['current_setting'])}"
        + (
            f" ({info['live_source']}, {when_text(info['live_since'], now)})"
            if info["live_since"]
            else ""
        ),
        f"target         {_shown(info['target_setting'])}",
        f"mode           {_mode_text(info['mode'])}"
        # A freeze after a failed restart holds a pin too, until `specd unfreeze` (the
        # daemon's mode gauge and STATUS= say freeze).
        + (
            " (held: specd is FROZEN, see below)"
            if info["frozen"] and info["mode"] == "pin"
            else ""
        ),
        "last decision  "
        + (
            unknown
            if info.get("state_unknown")
            else f"{printable(str(d.get('reason', '-')))}: "
            f"{printable(str(d.get('message', '-')))} "
            f"({when_text(d.get('t'), now) if d.get('t') else 'never'})"
        ),
        "frozen         "
        + (
            f"YES, FROZEN since {when_text(info['frozen'].get('since'), now)}: "
            f"{printable(str(info['frozen'].get('reason')))}"
            "  (clear: specd unfreeze --reason ...)"
            if info["frozen"]
            else unknown
            if info.get("state_unknown")
            # Not by a failed restart; the on-call's freeze is the mode above.
            else "no failed restart; the override freezes specd (mode freeze)"
            if info["mode"] == "freeze"
            else "no"
        ),
        f"window         {'OPEN' if info['window_open'] else 'closed'}; next opens "
        f"{when_text(info['next_window_open'], now, info['next_window_open_at'])}, closes "
        f"{when_text(info['next_window_close'], now, info['next_window_close_at'])}"
        + _restart_note(info, now),
        "restarts 24h   "
        + (
            unknown
            if info.get("state_unknown")
            else f"{info['sglang_restarts_last_24h']} "
            f"(budget left {info['restart_budget_remaining']})"
        ),
    ]
    if info.get("calibration_problem"):
        lines.append(
            f"calibration    UNUSABLE: {printable(str(info['calibration_problem']))} (a running "
            "specd keeps the last good table it read; its next start refuses this one)"
        )
    ov = info["override"]
    if ov["present"]:
        lines.append(f"override       {override_text(ov, now)}")
    for e in info["avoided"]:
        lines.append(
            f"avoided        {setting_text(e['setting'])}: served "
            f"{e['shortfall_ratio'] * 100:.1f}% less than {e['from_setting']} (regression "
            f"{when_text(e['since'], now)}), until "
            f"{when_text(e['until'], now)}{_avoided_mix(e)}"
        )
    lines.append(_acceptance_line(info["acceptance"]))
    if info.get("explorations") is not None:
        lines.append(_explored_line(info["explorations"], now))
    if info.get("verifying") is not None:
        lines.append(_verifying_line(info["verifying"], now))
        if info["verifying"]["outcome"]:
            lines.append(f"               {printable(info['verifying']['outcome'])}")
    picks = info["choices"]
    lines.append(f"choices        {picks['lines'][0]}")
    lines += [f"               {line}" for line in picks["lines"][1:]]
    if picks["server_problem"]:
        lines.append(f"               ({picks['server_problem']})")
    if info["fleet"] is not None:
        gateway = info["gateway"] or {}
        lines.append(
            _fleet_line(
                info["fleet"],
                now,
                restarting=bool(info["restart_in_progress"]),
                left_out=bool(gateway.get("left_out")),
            )
        )
    if info["gateway"] is not None:
        lines.extend(_gateway_lines(info["gateway"], now))
    if info["restart_in_progress"]:
        lines.append(_restart_line(info["restart_in_progress"], info["daemon"], now))
    if info["state_problem"]:
        lines.append(f"state          {info['state_problem']}")
    return "\n".join(lines)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, default=None, help=f"default {DEFAULT_CONFIG_PATH}")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    now = time.time()
    # Without the calibration: an on-call command must work while the table is broken; a
    # file with problems (a reload rejected it: the daemon runs on its last good config)
    # gives its valid parts, said on stderr, or refuses where [files] is among them.
    loaded = load_for_oncall("specd status", args.config)
    if loaded is None:
        return 2
    config = loaded.config
    static_only = read_static_only(SubprocessRunner(), config.sglang.unit)
    info = collect(config, now, server_info(config), static_only)
    info["config"] = loaded.to_json()
    print(json.dumps(info, indent=2, default=str) if args.json else render(info, now))
    if info["state_unreadable"]:
        # Unreadable (permissions: run as root or a member of group specd), invalid, or
        # with parts left out: scripts and the on-call must not take the output above for
        # all of specd's state.
        print(f"specd status: {info['state_problem']}", file=sys.stderr)
        return 1
    return 0
