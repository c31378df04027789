"""specd's persistent state: /var/lib/specd/state.json, written atomically.

A specd restart must lose nothing (learned history, the last decision, an interrupted
restart's journal, the freeze), and a damaged file must never stop specd: it is moved
aside, and specd starts over with a fresh history and a one-line problem to report.
Plain JSON only (no pickles), so an operator can read it and nothing in it executes.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import stat
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard, TypeVar

from specd.core import outcome
from specd.core.decide import Control
from specd.core.history import History, HistorySettings, check_time
from specd.core.observation import MAX_STEPS
from specd.core.units import DAY_S
from specd.io import files

T = TypeVar("T")
E = TypeVar("E")

STATE_FILE = "state.json"
# The daemon writes state.json this often (and at each tick after it, the tick being
# longer); `specd status` takes a file much older, while specd runs, for writes failing.
STATE_SAVE_INTERVAL_S = 60.0
# What `specd unfreeze` writes beside the state file and the daemon reads at its next tick.
UNFREEZE_REQUEST = "unfreeze.json"
# Raised whenever a part is added or changes meaning, so that an older specd (a rollback)
# moves a newer file aside, frozen, instead of reading what it knows and dropping the rest
# unsaid at its next save. 2: explorations, avoided, verifying, gateway, the history's
# accept_seen and each restart's count, which version-1 readers dropped. Version 1 files
# are read as they are (each part they lack starts empty).
STATE_VERSION = 2
STATE_FILE_MODE = 0o640
# Weeks of history are ~100 KB; a state file 100x that is not one specd wrote.
MAX_STATE_BYTES = 16 * files.MIB
# What `specd status` shows of the latest tick (the last decision, what runs), written at
# each change of either; state.json, all specd learned (up to megabytes), is written once a
# minute. A decision flapping every tick (a scrape failing every other one) rewrote all of
# it at every tick before.
STATUS_FILE = "status.json"
MAX_STATUS_BYTES = 256 * files.KIB
# SGLang restarts one sequence makes at most: the change's and the rollback's.
MAX_SEQUENCE_RESTARTS = 2


def restart_count(entry: dict[str, Any]) -> int:
    """The SGLang restarts a recorded sequence made, which the daily budget counts: its
    ``restarts``. An entry from a specd before it counted them has none, and counts 1, as
    every entry did then."""
    count = entry.get("restarts")
    if isinstance(count, int) and not isinstance(count, bool):
        return count
    return 1


def atomic_write_json(path: str | Path, obj: Any, mode: int = 0o600) -> None:
    """Replace ``path`` with ``obj`` as JSON; readers see the old file or the new one.

    ``specd.io.files.write_atomic``: unique temporary file, fsync, rename, fsync of the
    directory, never through a symlink. Raises OSError, or ValueError for unserializable
    data (NaN and infinities included: they are not JSON).
    """
    files.write_atomic(path, encode_json(obj), mode=mode)


def encode_json(obj: Any) -> bytes:
    """``obj`` as the JSON specd writes: compact (the history makes state.json ~100 KB,
    rewritten every minute; jq reads it), keys sorted, no NaN (ValueError)."""
    return (json.dumps(obj, allow_nan=False, sort_keys=True, separators=(",", ":")) + "\n").encode()


def read_json(path: str | Path, max_bytes: int = MAX_STATE_BYTES) -> Any:
    """Parse the JSON file at ``path`` (a regular file, not a symlink, ≤ ``max_bytes``).

    Raises ``files.MissingFileError`` when absent, else ``files.FileReadError`` or
    ``files.ParseError`` (bad, too deep or absurd JSON); all are ValueErrors, one line.
    """
    # Text that is not Unicode (a lone surrogate some answer carried into a message) is
    # replaced, not a reason to start fresh: the file holds what specd learned.
    return files.parse_json(files.read_regular_file(path, max_bytes), replace_lone_surrogates=True)


class StateNotRead(ValueError):
    """state.json could not be read at all (permissions, not a regular file, too big): what
    it holds is unknown, unlike a file read and found invalid. ``os_errno``: the system
    refused to open or read it (EACCES, EIO), so the file itself may be fine."""

    def __init__(self, message: str, os_errno: int | None = None) -> None:
        super().__init__(message)
        self.os_errno = os_errno


class StateUnreadable(Exception):
    """state.json is there but the system will not let specd read it (a command run as root
    left it unreadable to the specd user, an I/O error): it may hold a freeze, a restart in
    flight and what was learned, so nothing may start over it or replace it."""


class StateFormatError(ValueError):
    """state.json parsed but does not hold a valid state; the message is one line.

    ``held``: what in it must still hold specd back though it cannot be read (a freeze, a
    restart journal: `_held`), as the daemon keeps it frozen for them; ``held_since``: when
    the freeze it holds began, if it says so (`_held_since`)."""

    held: str | None = None
    held_since: float | None = None


@dataclass
class State:
    """Everything specd keeps across its own restarts."""

    history: History = field(default_factory=History)
    # The latest Decision as the daemon logged it (t, target_steps, reason, message, ...).
    last_decision: dict[str, Any] = field(default_factory=dict)
    # The restart journal: defined and written by specd.apply, stored here opaquely.
    journal: dict[str, Any] | None = None
    # One entry per restart sequence: {t, from_steps, to_steps, result, restarts (the
    # SGLang restarts it made: `restart_count`), ...}.
    restarts: list[dict[str, Any]] = field(default_factory=list)
    # {since, reason} after a failed restart; only an operator clears it.
    frozen: dict[str, Any] | None = None
    # [t, steps] of recent policy recommendations, for the stabilization window.
    recommendations: list[list[float]] = field(default_factory=list)
    # [t, steps] of the explorations of the last week (specd.core.explore).
    explorations: list[list[float]] = field(default_factory=list)
    # The latest change whose outcome is being verified, and the step counts that
    # regressed (specd.core.outcome).
    verifying: outcome.ChangeSnapshot | None = None
    avoided: list[outcome.Avoided] = field(default_factory=list)
    sglang_started_at: float | None = None
    # What SGLang runs, per the latest observation or verified restart: {t, steps, source}
    # (steps null when the latest scrape failed). `specd status` shows it.
    live: dict[str, Any] | None = None
    # With a [gateway]: probe {t, problem, not_ready_replicas, replicas}, the latest look,
    # last_drain {t, result, duration_s, in_flight_at_restart, replicas, readd_problem,
    # readded_at}, and left_out {t, workers, tried_at, problem}: the workers a failed re-add
    # did not put back, which the daemon re-adds until the gateway routes them again.
    gateway: dict[str, Any] | None = None
    version: int = STATE_VERSION
    # Top-level parts this specd does not know (a newer specd's, run on this box before
    # going back to this one): written back as they were read, so going forward again
    # finds them, where dropping them at the first save lost them for good.
    unknown: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.unknown,
            "version": self.version,
            "history": self.history.to_dict(),
            "last_decision": self.last_decision,
            "journal": self.journal,
            "restarts": self.restarts,
            "frozen": self.frozen,
            "recommendations": self.recommendations,
            "explorations": self.explorations,
            "verifying": None
            if self.verifying is None
            else outcome.snapshot_to_dict(self.verifying, self.history.settings.half_life_s),
            "avoided": [outcome.avoided_to_dict(e) for e in self.avoided],
            "sglang_started_at": self.sglang_started_at,
            "live": self.live,
            "gateway": self.gateway,
        }

    @classmethod
    def from_dict(
        cls,
        data: Any,
        history_settings: HistorySettings | None = None,
        dropped: list[str] | None = None,
        *,
        now: float | None = None,
    ) -> State:
        """Rebuild from `to_dict`. Raises StateFormatError naming the bad field.

        With a ``dropped`` list, only a file that is no state at all (not an object, an
        unknown version) raises: every bad part is left out and named there, and every
        good part is kept — weeks of learning are not lost to one bad entry. An unusable
        history starts over; an unreadable freeze stays a freeze (``now`` dates it).
        """
        if not isinstance(data, dict):
            raise StateFormatError(f"expected a JSON object, got {type(data).__name__}")
        version = data.get("version")
        if isinstance(version, bool) or not isinstance(version, int):
            raise StateFormatError(f"version: expected an integer, got {version!r:.20}")
        if version > STATE_VERSION:
            raise StateFormatError(
                f"version {version} is newer than this specd understands ({STATE_VERSION})"
            )
        if version < 1:
            raise StateFormatError(f"version: {version} is not a valid schema version")
        strict = dropped is None
        notes: list[str] = [] if dropped is None else dropped
        # Where one field of a part is bad (a NaN), that field is dropped, not the part.
        fields = None if strict else notes

        def part(parse: Callable[[], T], fallback: Callable[[str], T]) -> T:
            try:
                return parse()
            except (StateFormatError, ValueError) as exc:
                if strict:
                    raise StateFormatError(str(exc)) from None
                notes.append(str(exc))
                return fallback(str(exc))

        history = part(
            lambda: History.from_dict(
                data.get("history"), history_settings, None if strict else notes, now=now
            ),
            lambda why: History(history_settings),
        )
        unreadable_journal: list[str] = []

        def journal_fallback(why: str) -> dict[str, Any] | None:
            unreadable_journal.append(why)
            return None  # the freeze below stands for it

        frozen = part(
            lambda: _frozen(data.get("frozen"), now, fields),
            # A freeze stops automatic restarts until an operator looks: one that
            # cannot be read must not be read as "not frozen".
            lambda why: _fallback_freeze(f"a freeze specd cannot read ({why})", now),
        )
        journal = part(lambda: _journal(data.get("journal")), journal_fallback)
        if unreadable_journal and frozen is None:
            # The restart it recorded may have been cut short anywhere: SGLang and the env
            # file are left as they are, as the applier leaves them for a journal it cannot
            # read, and nothing restarts until an operator looked.
            frozen = _fallback_freeze(
                f"a restart journal specd cannot read ({unreadable_journal[0]}); SGLang and "
                "the env file were left as they are",
                now,
            )
        return cls(
            history=history,
            last_decision=part(lambda: _last_decision(data, fields), lambda why: {}),
            journal=journal,
            restarts=_entries(data, "restarts", lambda i, e: _restart(i, e, fields), strict, notes),
            frozen=frozen,
            recommendations=_runs(
                _entries(data, "recommendations", _recommendation, strict, notes)
            ),
            explorations=_entries(data, "explorations", _exploration, strict, notes),
            verifying=part(
                lambda: _verifying(data.get("verifying"), history, None if strict else notes),
                lambda why: None,
            ),
            avoided=_entries(data, "avoided", _avoided, strict, notes),
            sglang_started_at=part(
                lambda: _optional_time(data, "sglang_started_at"), lambda why: None
            ),
            live=part(lambda: _live(data.get("live"), fields), lambda why: None),
            gateway=part(lambda: _gateway(data.get("gateway"), fields), lambda why: None),
            version=STATE_VERSION,
            unknown=part(lambda: _unknown(data, fields), lambda why: {}),
        )

    def control(self) -> Control:
        """The control state the brain carries from tick to tick (`specd.core.step`)."""
        return Control(
            current_steps=None,  # each tick's observation says what is live
            restart_times=self.restart_times(),
            frozen=self.frozen is not None,
            frozen_reason=self.frozen.get("reason") if self.frozen else None,
            recommendations=tuple((float(t), int(s)) for t, s in self.recommendations),
            explorations=tuple((float(t), int(s)) for t, s in self.explorations),
            verifying=self.verifying,
            avoided=tuple(self.avoided),
        )

    def restart_times(self) -> tuple[float, ...]:
        """One time per SGLang restart specd made (a rollback's two at its end, none for a
        sequence that restarted nothing), oldest first: what dwell and the budget count."""
        return tuple(sorted(float(r["t"]) for r in self.restarts for _ in range(restart_count(r))))

    def restarts_in_day(self, now: float) -> int:
        """SGLang restarts in the day before ``now``: what the daily restart budget counts."""
        return sum(1 for t in self.restart_times() if now - t < DAY_S)

    def adopt(self, control: Control) -> None:
        """Keep what `step` changed in the control state (restarts and the freeze are
        recorded by the daemon with their details)."""
        self.recommendations = _runs(control.recommendations)
        self.explorations = [[t, s] for t, s in control.explorations]
        self.verifying = control.verifying
        self.avoided = list(control.avoided)


def _object(data: dict[str, Any], key: str) -> dict[str, Any]:
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise StateFormatError(f"{key}: expected an object, got {type(value).__name__}")
    return value


def _list(data: dict[str, Any], key: str) -> list[Any]:
    value = data.get(key, [])
    if not isinstance(value, list):
        raise StateFormatError(f"{key}: expected a list, got {type(value).__name__}")
    return value


def _entries(
    data: dict[str, Any],
    key: str,
    parse: Callable[[int, Any], E],
    strict: bool,
    notes: list[str],
) -> list[E]:
    try:
        entries = _list(data, key)
    except StateFormatError as exc:
        if strict:
            raise
        notes.append(str(exc))
        return []
    kept: list[E] = []
    seen: set[str] = set()
    for index, entry in enumerate(entries):
        try:
            parsed = parse(index, entry)
            identity = json.dumps(parsed, sort_keys=True, default=repr)
            if identity in seen:
                # specd records each restart and exploration once: a copy would count twice
                # against the budget or the week's explorations.
                raise StateFormatError(f"{key}[{index}]: a second copy of {entry!r:.60}")
            seen.add(identity)
            kept.append(parsed)
        except StateFormatError as exc:
            if strict:
                raise
            notes.append(str(exc))
    return kept


def is_finite_number(value: Any) -> TypeGuard[int | float]:
    """An int or float that is finite (a bool is not a number here)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _scrub(value: T, where: str, notes: list[str] | None) -> T:
    """``value`` with every NaN or infinity in it made null, each named in ``notes``
    (StateFormatError instead when ``notes`` is None: a strict read).

    Python's json reads the literals NaN and Infinity; kept, they make every later save of
    the state fail (it writes JSON only): what specd learns after would never reach disk.
    """
    if isinstance(value, float) and not math.isfinite(value):
        problem = f"{where}: {value!r} is not a number JSON can hold"
        if notes is None:
            raise StateFormatError(problem)
        notes.append(f"{problem} (read as null)")
        return None  # type: ignore[return-value]
    if isinstance(value, dict):
        return {k: _scrub(v, f"{where}.{k}", notes) for k, v in value.items()}  # type: ignore[return-value]
    if isinstance(value, list):
        return [_scrub(v, f"{where}[{i}]", notes) for i, v in enumerate(value)]  # type: ignore[return-value]
    return value


def _finite_json(value: Any, where: str) -> None:
    """Raise StateFormatError when ``value`` holds a NaN or an infinity anywhere."""
    _scrub(value, where, None)


def _time(value: Any, name: str) -> float:
    try:
        return check_time(value, name)
    except ValueError as exc:
        raise StateFormatError(str(exc)) from None


def _optional_time(data: dict[str, Any], key: str) -> float | None:
    value = data.get(key)
    return None if value is None else _time(value, key)


def _last_decision(data: dict[str, Any], notes: list[str] | None) -> dict[str, Any]:
    value = _object(data, "last_decision")
    if "t" in value:
        _time(value["t"], "last_decision.t")
    return _scrub(value, "last_decision", notes)


# The parts `State.to_dict` writes.
_KNOWN_PARTS = frozenset(State().to_dict())


def _unknown(data: dict[str, Any], notes: list[str] | None) -> dict[str, Any]:
    """The top-level parts of ``data`` this specd does not know, each as read (a NaN or an
    infinity in one, which no save could write, read as null and named)."""
    return {
        key: _scrub(value, key, notes) for key, value in data.items() if key not in _KNOWN_PARTS
    }


def _journal(value: Any) -> dict[str, Any] | None:
    # Stored opaquely: `specd.io.apply.Journal` judges the rest when it reconciles it.
    if value is not None and not isinstance(value, dict):
        raise StateFormatError(f"journal: expected an object or null, got {type(value).__name__}")
    _finite_json(value, "journal")
    return value


def _fallback_freeze(what: str, now: float | None) -> dict[str, Any]:
    return {
        "since": now if now is not None else 0.0,
        "reason": f"state.json held {what}; check, then run specd unfreeze",
    }


def _restart(index: int, entry: Any, notes: list[str] | None) -> dict[str, Any]:
    where = f"restarts[{index}]"
    if not isinstance(entry, dict):
        raise StateFormatError(f"{where}: expected an object with a numeric t")
    # Its time counts against dwell and the budget: a bad detail costs that detail only.
    _time(entry.get("t"), f"{where}.t")
    count = entry.get("restarts")
    if count is not None and (
        isinstance(count, bool)
        or not isinstance(count, int)
        or not 0 <= count <= MAX_SEQUENCE_RESTARTS
    ):
        problem = f"{where}.restarts: {count!r:.40} is no count of 0..{MAX_SEQUENCE_RESTARTS}"
        if notes is None:
            raise StateFormatError(problem)
        # Counted 1, as an entry without a count: never none, never a day's budget.
        notes.append(f"{problem} (counted 1)")
        entry = {k: v for k, v in entry.items() if k != "restarts"}
    return _scrub(entry, where, notes)


def _frozen(value: Any, now: float | None, notes: list[str] | None) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not is_finite_number(value.get("since")):
        raise StateFormatError("frozen: expected null or an object with a numeric since")
    since = _time(value["since"], "frozen.since")
    if now is not None and since > now:
        # The clock stepped back since: frozen as long ago as can be, not in the future.
        value = {**value, "since": now}
    reason = value.get("reason")
    if reason is not None and not isinstance(reason, str):
        raise StateFormatError(f"frozen.reason: expected text, got {reason!r:.40}")
    return _scrub(value, "frozen", notes)


def _short_text_or_none(value: Any) -> bool:
    # A setting's name: "adaptive:1,3,5,7/1=1,3,5,7;8=0,1,3;32=0,1;64=0" is among the longest.
    return value is None or (isinstance(value, str) and len(value) <= 256)


def _steps_or_none(value: Any) -> bool:
    return value is None or (
        isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_STEPS
    )


def _live(value: Any, notes: list[str] | None) -> dict[str, Any] | None:
    if value is None:
        return None
    if (
        not isinstance(value, dict)
        or not is_finite_number(value.get("t"))
        or not _steps_or_none(value.get("steps"))
        or not isinstance(value.get("source"), str)
        or not _short_text_or_none(value.get("setting"))
    ):
        raise StateFormatError(
            "live: expected null or an object with numeric t, steps, source (and setting)"
        )
    _time(value["t"], "live.t")
    return _scrub(value, "live", notes)


# The gateway's record, as `specd status` reads it: each part an object, its times times.
_GATEWAY_PARTS = ("probe", "last_drain", "left_out")


def _gateway(value: Any, notes: list[str] | None) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise StateFormatError(f"gateway: expected an object or null, got {type(value).__name__}")
    value = _scrub(value, "gateway", notes)
    for name in _GATEWAY_PARTS:
        part = value.get(name)
        if part is None:
            continue
        if not isinstance(part, dict):
            raise StateFormatError(f"gateway.{name}: expected an object, got {part!r:.40}")
        for key in ("t", "tried_at", "readded_at"):  # times status shows
            if part.get(key) is not None:
                _time(part[key], f"gateway.{name}.{key}")
        duration = part.get("duration_s")
        if duration is not None and not is_finite_number(duration):
            raise StateFormatError(f"gateway.{name}.duration_s: expected a number")
    return value


# A setting key: K, 0 (off) or an adaptive set's (negative, 48 bits; `setting_key`).
_MIN_SETTING_KEY = -(2**48)


def _recommendation(index: int, entry: Any) -> list[float]:
    if (
        not isinstance(entry, list)
        or len(entry) != 2
        or not is_finite_number(entry[0])
        or isinstance(entry[1], bool)
        or not isinstance(entry[1], int)
        or not _MIN_SETTING_KEY <= entry[1] <= MAX_STEPS
    ):
        raise StateFormatError(f"recommendations[{index}]: expected [t, steps], got {entry!r:.40}")
    return [_time(entry[0], f"recommendations[{index}].t"), entry[1]]


def _runs(recommendations: Iterable[Sequence[float]]) -> list[list[float]]:
    """The recommendations in time order, each only where it differs from the one before.

    What the stabilization window reads of them (`specd.core.decide`): since when the
    latest recommendation has held, and whether it held when the window began; the entries
    in between say nothing more. The step appends one at every tick and drops them only
    past the window, so a week's window at one scrape a second kept 600,000 of them.
    """
    kept: list[list[float]] = []
    for t, steps in sorted((float(t), int(s)) for t, s in recommendations):
        if not kept or kept[-1][1] != steps:
            kept.append([t, steps])
    return kept


def _exploration(index: int, entry: Any) -> list[float]:
    if (
        not isinstance(entry, list)
        or len(entry) != 2
        or not is_finite_number(entry[0])
        or isinstance(entry[1], bool)
        or not isinstance(entry[1], int)
        or not 1 <= entry[1] <= 16
    ):
        raise StateFormatError(f"explorations[{index}]: expected [t, steps], got {entry!r:.40}")
    return [_time(entry[0], f"explorations[{index}].t"), entry[1]]


def _verifying(
    value: Any, history: History, dropped: list[str] | None
) -> outcome.ChangeSnapshot | None:
    if value is None:
        return None
    # Its cells decay as the history's do.
    return outcome.snapshot_from_dict(value, history.settings.half_life_s, dropped)


def _avoided(index: int, entry: Any) -> outcome.Avoided:
    try:
        return outcome.avoided_from_dict(index, entry)
    except ValueError as exc:
        raise StateFormatError(str(exc)) from None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def read_status(path: str | Path) -> dict[str, Any]:
    """The parts of status.json (``STATUS_FILE``) that are valid: ``last_decision`` and
    ``live``, as state.json holds them; none of a file that is absent, damaged or hostile
    (state.json has them too, a minute older at most)."""
    try:
        data = files.parse_json(files.read_regular_file(path, MAX_STATUS_BYTES))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    found: dict[str, Any] = {}
    with contextlib.suppress(StateFormatError, ValueError):
        decision = data.get("last_decision")
        if isinstance(decision, dict) and is_finite_number(decision.get("t")):
            found["last_decision"] = _last_decision(data, None)
    with contextlib.suppress(StateFormatError, ValueError):
        live = _live(data.get("live"), None)
        if live is not None:
            found["live"] = live
    return found


def with_status(state: State, status: Mapping[str, Any]) -> None:
    """Take status.json's parts (`read_status`) into ``state`` where they are newer."""
    decision = status.get("last_decision")
    if decision is not None and decision["t"] > state.last_decision.get("t", -math.inf):
        state.last_decision = decision
    live = status.get("live")
    if live is not None and (state.live is None or live["t"] > state.live["t"]):
        state.live = live


def read_state(
    path: str | Path,
    history_settings: HistorySettings | None = None,
    dropped: list[str] | None = None,
    *,
    now: float | None = None,
) -> State:
    """The state at ``path``, validated as the daemon validates it (status, recommend and
    the daemon share this). Raises FileNotFoundError when absent, else ValueError (one
    line: unreadable, or invalid as a state). With ``dropped``, bad parts are left out
    and named there instead (see `State.from_dict`)."""
    try:
        data = read_json(path)
    except FileNotFoundError:
        raise
    except files.FileReadError as exc:  # no permission, not a regular file, too big
        raise StateNotRead(f"unreadable ({_one_line(exc)})", exc.os_errno) from None
    except ValueError as exc:  # bad or absurdly deep JSON
        raise ValueError(f"unreadable ({_one_line(exc)})") from None
    try:
        return State.from_dict(data, history_settings, dropped, now=now)
    except StateFormatError as exc:
        error = StateFormatError(f"invalid ({_one_line(exc)})")
        error.held = _held(data)
        error.held_since = _held_since(data)
        raise error from None


def salvage_note(dropped: list[str], limit: int = 3) -> str:
    """One line naming what a load left out: the first few, and how many in all."""
    shown = "; ".join(dropped[:limit])
    more = f"; and {len(dropped) - limit} more" if len(dropped) > limit else ""
    entries = "entry" if len(dropped) == 1 else "entries"
    return f"left out {len(dropped)} bad {entries} and kept the rest ({shown}{more})"


def held_freeze(
    exc: BaseException, now: float | None, why: str | None = None
) -> dict[str, Any] | None:
    """The freeze specd keeps for what a state it could not read (``exc``, a
    `StateFormatError`) held, or None when it held none; ``why``: the problem as shown."""
    held = getattr(exc, "held", None)
    if not held:
        return None
    why = str(exc) if why is None else why
    # Since the freeze the file holds began, where it says (a newer specd's freeze): read
    # as "now", every `specd status` showed it begun 0 s ago.
    since = getattr(exc, "held_since", None)
    if since is None or (now is not None and since > now):
        since = now
    return _fallback_freeze(f"{held} in a file specd cannot read ({why}; it is kept aside)", since)


def _held_since(data: Any) -> float | None:
    """When the freeze in a file specd cannot read as a state began, if it says so as a
    time a clock shows."""
    frozen = data.get("frozen") if isinstance(data, dict) else None
    since = frozen.get("since") if isinstance(frozen, dict) else None
    try:
        return check_time(since, "frozen.since")
    except ValueError:
        return None


def _held(data: Any) -> str | None:
    """What in a file that is no state this specd can read must still hold specd back."""
    if not isinstance(data, dict):
        return None
    held = [
        what
        for key, what in (("frozen", "a freeze"), ("journal", "a restart journal"))
        if data.get(key) is not None
    ]
    return " and ".join(held) or None


LOCK_FILE = "specd.lock"


class StateDirLocked(Exception):
    """Another process holds the state directory (another `specd run` on the same box)."""


class LockFileUnusable(Exception):
    """The state directory's lock file is one specd must not or cannot open: a symbolic
    link (followed, its target was truncated), a file another user owns (a `specd run`
    as root made it), or no regular file at all (a FIFO, a directory, a device, a socket:
    refused before as a state directory specd may not write). The message says which, and
    the fix."""


def _lock_kind(mode: int) -> str | None:
    """What is at the lock file's path when it is no regular file (None: it is one)."""
    return None if stat.S_ISREG(mode) else files.file_kind(mode)


def _not_a_lock_file(path: Path, kind: str) -> LockFileUnusable:
    return LockFileUnusable(
        f"{path} is {kind}, not a regular file: specd keeps its lock in a regular file it "
        "makes there; remove it"
    )


def lock_state_dir(state_dir: str | Path) -> int:
    """Hold ``state_dir`` for this process (an advisory ``flock`` on its lock file, released
    when the process ends, even killed): two daemons on one state directory each restart
    SGLang and each overwrite what the other saved. Returns the descriptor to keep open.
    StateDirLocked (naming the holder's pid when it wrote one) if another process holds it;
    LockFileUnusable if what is there is no file specd may take (a symbolic link, a FIFO,
    a directory, another user's file); OSError if the directory cannot be made or the lock
    file opened."""
    directory = Path(state_dir)
    directory.mkdir(parents=True, exist_ok=True, mode=0o751)
    path = directory / LOCK_FILE
    # Named before it is opened: opening a device may act on it, and a directory or a
    # socket fails to open with an error that read as a state directory specd cannot write.
    with contextlib.suppress(OSError):
        there = path.lstat().st_mode
        if not stat.S_ISLNK(there) and (kind := _lock_kind(there)) is not None:
            raise _not_a_lock_file(path, kind)
    # O_NONBLOCK: a FIFO put there since must not block the open (refused below).
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
    try:
        fd = os.open(path, flags, 0o640)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise LockFileUnusable(
                f"{path} is a symbolic link: specd does not follow it (it would truncate what "
                "it points to); remove it"
            ) from None
        if exc.errno in (errno.EACCES, errno.EPERM) and path.exists():
            owner = path.lstat().st_uid
            raise LockFileUnusable(
                f"{path} belongs to uid {owner}, and specd (uid {os.geteuid()}) cannot open "
                f"it: a command run as another user made it; chown specd:specd {path}"
            ) from None
        raise
    try:
        kind = _lock_kind(os.fstat(fd).st_mode)
    except OSError:
        os.close(fd)
        raise
    if kind is not None:
        # Put there since the look above: truncating a FIFO to write the pid failed with
        # "Invalid argument", and a lock on it is no lock on the state directory.
        os.close(fd)
        raise _not_a_lock_file(path, kind)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        os.close(fd)
        who = f" (pid {holder})" if holder.isdigit() else ""
        raise StateDirLocked(f"another specd runs with state directory {directory}{who}") from None
    except OSError:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


# Errors opening state.json that say no file of specd's is there to keep (the state
# directory is a file, the path is too long or loops, a socket or device sits there):
# set aside and started fresh, as for any other thing that is not a regular file.
_NO_FILE_THERE = frozenset(
    {errno.ENOTDIR, errno.ENAMETOOLONG, errno.ELOOP, errno.ENXIO, errno.ENODEV}
)


class StateStore:
    """Loads and saves `State` in ``state_dir``/state.json; never raises, but for a file
    the system will not let it read (`StateUnreadable`)."""

    def __init__(
        self,
        state_dir: str | Path,
        *,
        history_settings: HistorySettings | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.state_dir = Path(state_dir)
        self.path = self.state_dir / STATE_FILE
        self.history_settings = history_settings
        self._clock = clock

    def fresh(self) -> State:
        return State(history=History(self.history_settings))

    def load(self) -> tuple[State, str | None]:
        """The saved state, or a fresh one and a one-line problem when it is unusable.

        A missing file is not a problem (first start). One that is no state at all is
        moved aside to state.json.corrupt-<unix> for a post-mortem, so the next save
        cannot destroy it. One with bad parts keeps its good parts, and a copy of the
        file as it was goes to the same place. One the system will not let specd read
        raises StateUnreadable, and stays where it is.
        """
        dropped: list[str] = []
        now = self._clock()
        try:
            state = read_state(self.path, self.history_settings, dropped, now=now)
        except FileNotFoundError:
            return self.fresh(), None
        except StateNotRead as exc:
            if exc.os_errno is not None and exc.os_errno not in _NO_FILE_THERE:
                raise StateUnreadable(f"{self.path} {exc}") from None
            return self._started_over(exc, now)
        except ValueError as exc:
            return self._started_over(exc, now)
        if not dropped:
            return state, None
        return state, f"{self.path} {salvage_note(dropped)}; {self._copy_aside()}"

    def _started_over(self, exc: ValueError, now: float) -> tuple[State, str]:
        fresh, problem = self.fresh(), self._set_aside(str(exc))
        # A newer specd's file, rolled back to this one: its freeze (or the restart it was
        # in) still stands; what it learned waits in the file set aside.
        fresh.frozen = held_freeze(exc, now)
        if fresh.frozen is not None:
            problem += f"; it held {getattr(exc, 'held', '')}: frozen until specd unfreeze"
        return fresh, problem

    def _aside_path(self) -> Path:
        stamp = int(self._clock())
        aside = self.path.with_name(f"{STATE_FILE}.corrupt-{stamp}")
        n = 1
        while os.path.lexists(aside):
            aside = self.path.with_name(f"{STATE_FILE}.corrupt-{stamp}.{n}")
            n += 1
        return aside

    def _copy_aside(self) -> str:
        aside = self._aside_path()
        try:
            data = files.read_regular_file(self.path, MAX_STATE_BYTES)
            files.write_atomic(aside, data, mode=STATE_FILE_MODE)
        except (OSError, ValueError) as exc:
            return f"could not keep a copy: {_one_line(exc)}"
        return f"the file as it was is in {aside.name}"

    def _set_aside(self, why: str) -> str:
        aside = self._aside_path()
        try:
            os.replace(self.path, aside)
        except OSError as exc:
            return f"{self.path} {why}; could not move it aside: {_one_line(exc)}; starting fresh"
        return f"{self.path} {why}; moved to {aside.name}; starting fresh"

    def save_status(self, state: State) -> str | None:
        """Write what `specd status` shows of the latest tick (``STATUS_FILE``: the last
        decision and what runs) atomically; a one-line error or None."""
        status = {"last_decision": state.last_decision, "live": state.live}
        return self._write(self.state_dir / STATUS_FILE, status, MAX_STATUS_BYTES, "status reads")

    def save(self, state: State) -> str | None:
        """Write ``state`` atomically; a one-line error (disk full, read-only, ...) or None."""
        return self._write(self.path, state.to_dict(), MAX_STATE_BYTES, "a start reads")

    def _write(self, path: Path, obj: Any, max_bytes: int, reader: str) -> str | None:
        """``obj`` as JSON at ``path``, atomically, unless bigger than the ``max_bytes``
        its ``reader`` reads: that one would set it all aside (for state.json what was
        learned, a freeze, a restart's journal), so the last file that fit stays. A
        one-line error or None."""
        try:
            data = encode_json(obj)
            if len(data) > max_bytes:
                return (
                    f"cannot write {path}: {files.size_text(len(data))} of state, over the "
                    f"{files.size_text(max_bytes)} {reader}; the file keeps the last state "
                    "that fit"
                )
            # Group-readable: members of group specd (the on-call) run `specd status`.
            # Traversable by SGLang's user for the adaptive config (as StateDirectoryMode=).
            self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o751)
            files.write_atomic(path, data, mode=STATE_FILE_MODE)
        except (OSError, ValueError, TypeError) as exc:
            return f"cannot write {path}: {_one_line(exc)}"
        return None
