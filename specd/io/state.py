"""specd's persistent state: /var/lib/specd/state.json, written atomically.

A specd restart must lose nothing (learned history, the last decision, an interrupted
restart's journal, the freeze), and a damaged file must never stop specd: it is moved
aside, and specd starts over with a fresh history and a one-line problem to report.
Plain JSON only (no pickles), so an operator can read it and nothing in it executes.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from specd.core import outcome
from specd.core.decide import Control
from specd.core.history import History, HistorySettings
from specd.io import files

T = TypeVar("T")
E = TypeVar("E")

STATE_FILE = "state.json"
STATE_VERSION = 1
STATE_FILE_MODE = 0o640
# Weeks of history are ~100 KB; a state file 100x that is not one specd wrote.
MAX_STATE_BYTES = 16 * files.MIB


def atomic_write_json(path: str | Path, obj: Any, mode: int = 0o600) -> None:
    """Replace ``path`` with ``obj`` as JSON; readers see the old file or the new one.

    ``specd.io.files.write_atomic``: unique temporary file, fsync, rename, fsync of the
    directory, never through a symlink. Raises OSError, or ValueError for unserializable
    data (NaN and infinities included: they are not JSON).
    """
    # Compact: the history makes state.json ~100 KB, rewritten every minute (jq reads it).
    data = (json.dumps(obj, allow_nan=False, sort_keys=True, separators=(",", ":")) + "\n").encode()
    files.write_atomic(path, data, mode=mode)


def read_json(path: str | Path, max_bytes: int = MAX_STATE_BYTES) -> Any:
    """Parse the JSON file at ``path`` (a regular file, not a symlink, ≤ ``max_bytes``).

    Raises ``files.MissingFileError`` when absent, else ``files.FileReadError`` or
    ``files.ParseError`` (bad, too deep or absurd JSON); all are ValueErrors, one line.
    """
    return files.parse_json(files.read_regular_file(path, max_bytes))


class StateFormatError(ValueError):
    """state.json parsed but does not hold a valid state; the message is one line."""


@dataclass
class State:
    """Everything specd keeps across its own restarts."""

    history: History = field(default_factory=History)
    # The latest Decision as the daemon logged it (t, target_steps, reason, message, ...).
    last_decision: dict[str, Any] = field(default_factory=dict)
    # The restart journal: defined and written by specd.apply, stored here opaquely.
    journal: dict[str, Any] | None = None
    # One entry per restart: {t, from_steps, to_steps, result, ...}.
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
    # and last_drain {t, result, duration_s, in_flight_at_restart, replicas, readd_problem}.
    gateway: dict[str, Any] | None = None
    version: int = STATE_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {
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
                data.get("history"), history_settings, None if strict else notes
            ),
            lambda why: History(history_settings),
        )
        return cls(
            history=history,
            last_decision=part(lambda: _object(data, "last_decision"), lambda why: {}),
            journal=part(lambda: _optional_object(data, "journal"), lambda why: None),
            restarts=_entries(data, "restarts", _restart, strict, notes),
            frozen=part(
                lambda: _frozen(data.get("frozen")),
                # A freeze stops automatic restarts until an operator looks: one that
                # cannot be read must not be read as "not frozen".
                lambda why: {
                    "since": now if now is not None else 0.0,
                    "reason": f"state.json held a freeze specd cannot read ({why}); "
                    "check, then run specd unfreeze",
                },
            ),
            recommendations=_entries(data, "recommendations", _recommendation, strict, notes),
            explorations=_entries(data, "explorations", _exploration, strict, notes),
            verifying=part(
                lambda: _verifying(data.get("verifying"), history, None if strict else notes),
                lambda why: None,
            ),
            avoided=_entries(data, "avoided", _avoided, strict, notes),
            sglang_started_at=part(
                lambda: _optional_number(data, "sglang_started_at"), lambda why: None
            ),
            live=part(lambda: _live(data.get("live")), lambda why: None),
            gateway=part(lambda: _optional_object(data, "gateway"), lambda why: None),
            version=STATE_VERSION,
        )

    def control(self) -> Control:
        """The control state the brain carries from tick to tick (`specd.core.step`)."""
        return Control(
            current_steps=None,  # each tick's observation says what is live
            restart_times=tuple(float(r["t"]) for r in self.restarts),
            frozen=self.frozen is not None,
            frozen_reason=self.frozen.get("reason") if self.frozen else None,
            recommendations=tuple((float(t), int(s)) for t, s in self.recommendations),
            explorations=tuple((float(t), int(s)) for t, s in self.explorations),
            verifying=self.verifying,
            avoided=tuple(self.avoided),
        )

    def adopt(self, control: Control) -> None:
        """Keep what `step` changed in the control state (restarts and the freeze are
        recorded by the daemon with their details)."""
        self.recommendations = [[t, s] for t, s in control.recommendations]
        self.explorations = [[t, s] for t, s in control.explorations]
        self.verifying = control.verifying
        self.avoided = list(control.avoided)


def _object(data: dict[str, Any], key: str) -> dict[str, Any]:
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise StateFormatError(f"{key}: expected an object, got {type(value).__name__}")
    return value


def _optional_object(data: dict[str, Any], key: str) -> dict[str, Any] | None:
    value = data.get(key)
    if value is not None and not isinstance(value, dict):
        raise StateFormatError(f"{key}: expected an object or null, got {type(value).__name__}")
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
    for index, entry in enumerate(entries):
        try:
            kept.append(parse(index, entry))
        except StateFormatError as exc:
            if strict:
                raise
            notes.append(str(exc))
    return kept


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _optional_number(data: dict[str, Any], key: str) -> float | None:
    value = data.get(key)
    if value is None:
        return None
    if not _is_number(value):
        raise StateFormatError(f"{key}: expected a number or null, got {value!r:.40}")
    return float(value)


def _restart(index: int, entry: Any) -> dict[str, Any]:
    if not isinstance(entry, dict) or not _is_number(entry.get("t")):
        raise StateFormatError(f"restarts[{index}]: expected an object with a numeric t")
    return entry


def _frozen(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not _is_number(value.get("since")):
        raise StateFormatError("frozen: expected null or an object with a numeric since")
    return value


def _short_text_or_none(value: Any) -> bool:
    # A setting's name: "adaptive:1,3,5,7/1=1,3,5,7;8=0,1,3;32=0,1;64=0" is among the longest.
    return value is None or (isinstance(value, str) and len(value) <= 256)


def _live(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    steps = value.get("steps") if isinstance(value, dict) else None
    if (
        not isinstance(value, dict)
        or not _is_number(value.get("t"))
        or not (steps is None or (isinstance(steps, int) and not isinstance(steps, bool)))
        or not isinstance(value.get("source"), str)
        or not _short_text_or_none(value.get("setting"))
    ):
        raise StateFormatError(
            "live: expected null or an object with numeric t, steps, source (and setting)"
        )
    return value


def _recommendation(index: int, entry: Any) -> list[float]:
    if (
        not isinstance(entry, list)
        or len(entry) != 2
        or not _is_number(entry[0])
        or isinstance(entry[1], bool)
        or not isinstance(entry[1], int)
    ):
        raise StateFormatError(f"recommendations[{index}]: expected [t, steps], got {entry!r:.40}")
    return [float(entry[0]), entry[1]]


def _exploration(index: int, entry: Any) -> list[float]:
    if (
        not isinstance(entry, list)
        or len(entry) != 2
        or not _is_number(entry[0])
        or isinstance(entry[1], bool)
        or not isinstance(entry[1], int)
        or not 1 <= entry[1] <= 16
    ):
        raise StateFormatError(f"explorations[{index}]: expected [t, steps], got {entry!r:.40}")
    return [float(entry[0]), entry[1]]


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
    except ValueError as exc:  # not a regular file, too big, bad or absurdly deep JSON
        raise ValueError(f"unreadable ({_one_line(exc)})") from None
    try:
        return State.from_dict(data, history_settings, dropped, now=now)
    except StateFormatError as exc:
        raise StateFormatError(f"invalid ({_one_line(exc)})") from None


def salvage_note(dropped: list[str], limit: int = 3) -> str:
    """One line naming what a load left out: the first few, and how many in all."""
    shown = "; ".join(dropped[:limit])
    more = f"; and {len(dropped) - limit} more" if len(dropped) > limit else ""
    entries = "entry" if len(dropped) == 1 else "entries"
    return f"left out {len(dropped)} bad {entries} and kept the rest ({shown}{more})"


LOCK_FILE = "specd.lock"


class StateDirLocked(Exception):
    """Another process holds the state directory (another `specd run` on the same box)."""


def lock_state_dir(state_dir: str | Path) -> int:
    """Hold ``state_dir`` for this process (an advisory ``flock`` on its lock file, released
    when the process ends, even killed): two daemons on one state directory each restart
    SGLang and each overwrite what the other saved. Returns the descriptor to keep open.
    StateDirLocked (naming the holder's pid when it wrote one) if another process holds it;
    OSError if the directory cannot be made or the lock file opened."""
    directory = Path(state_dir)
    directory.mkdir(parents=True, exist_ok=True, mode=0o751)
    fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
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


class StateStore:
    """Loads and saves `State` in ``state_dir``/state.json; never raises."""

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
        file as it was goes to the same place.
        """
        dropped: list[str] = []
        try:
            state = read_state(self.path, self.history_settings, dropped, now=self._clock())
        except FileNotFoundError:
            return self.fresh(), None
        except ValueError as exc:
            return self.fresh(), self._set_aside(str(exc))
        if not dropped:
            return state, None
        return state, f"{self.path} {salvage_note(dropped)}; {self._copy_aside()}"

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

    def save(self, state: State) -> str | None:
        """Write ``state`` atomically; a one-line error (disk full, read-only, ...) or None."""
        try:
            # Group-readable: members of group specd (the on-call) run `specd status`.
            # Traversable by SGLang's user for the adaptive config (as StateDirectoryMode=).
            self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o751)
            atomic_write_json(self.path, state.to_dict(), mode=STATE_FILE_MODE)
        except (OSError, ValueError, TypeError) as exc:
            return f"cannot write {self.path}: {_one_line(exc)}"
        return None
