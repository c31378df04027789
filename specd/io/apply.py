"""Apply a step count to SGLang: env file + `systemctl restart`, verified, journalled.

The only module that touches systemd or SGLang's env file. One sequence::

    quiet moment? ─► planned ─► env_written ─► restart_issued ─► verifying ─► done
                                    │                │               │
                                    └───── any failure ──────────────┴─► rolling_back
                                                                             │
                                                          rolled_back ◄──────┴──► failed

Before each step the journal (a JSON-able dict, see ``Journal``) is handed to ``persist``,
which the daemon stores atomically in state.json. A specd killed at any point finds on its
next start a journal saying what may have happened, and ``Applier.reconcile`` finishes the
sequence without a second restart of a server that may still be loading.

Contract with the caller: ``apply`` and ``reconcile`` leave the journal persisted in a
terminal phase (done, rolled_back, failed, aborted) and return the outcome; the caller
records the outcome and clears the journal (``persist(None)`` or the equivalent) in the same
state write. ``reconcile`` of a terminal journal only reports its outcome, so an outcome is
never lost, and is recorded twice only if the caller does not clear it.
"""

from __future__ import annotations

import base64
import binascii
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from specd.core.observation import Observation, ScrapeError
from specd.core.setting import SpecSetting, adaptive_config_name, adaptive_config_text, sglang_args
from specd.core.settings import ChooseSettings, RestartSettings, Settings, SGLangSettings
from specd.io import files, logs
from specd.io.runner import Runner
from specd.io.sglang import HealthStatus, ParsedMetrics
from specd.io.timespan import timespan_s

# The SGLang unit's drop-in reads these; they must not start with specd's SPECD_ settings
# prefix, so the two never mix in one environment.
ENV_STEPS = "SPECULATIVE_NUM_STEPS"
ENV_DRAFT_TOKENS = "SPECULATIVE_NUM_DRAFT_TOKENS"
ENV_HEADER = (
    "# Written by specd; every change is overwritten. The SGLang unit reads it through\n"
    "# EnvironmentFile= (see sglang.service.d/50-specd.conf). To choose steps by hand, use\n"
    "# `specd override pin K --for DURATION --reason TEXT` instead of editing this file.\n"
)
ENV_FILE_MODE = 0o644
# An env file is a few lines; anything bigger is not ours and is not backed up into state.
MAX_ENV_BYTES = 64 * 1024

JOURNAL_VERSION = 1
PHASES = (
    "planned",
    "env_written",
    "restart_issued",
    "verifying",
    "done",
    "rolling_back",
    "rolled_back",
    "failed",
    "aborted",
)
Result = Literal["success", "rolled_back", "failed", "aborted"]
TERMINAL_RESULTS: dict[str, Result] = {
    "done": "success",
    "rolled_back": "rolled_back",
    "failed": "failed",
    "aborted": "aborted",
}
# A journal resumed this many times without finishing means specd crashes while
# reconciling; stop touching SGLang and let an operator look.
MAX_ATTEMPTS = 3
MAX_JOURNAL_MESSAGES = 40
UNIT_STATE_TIMEOUT_S = 10.0


class SGLangProbe(Protocol):
    """What apply needs from ``specd.observe.SGLangClient``."""

    def observe(self) -> Observation | ScrapeError: ...

    def server_info(self) -> dict[str, Any] | ScrapeError: ...

    @property
    def info_path(self) -> str | None: ...

    @property
    def last_page(self) -> ParsedMetrics | None: ...

    def health_generate(self, timeout_s: float) -> HealthStatus: ...


def restart_argv(unit: str) -> list[str]:
    return ["systemctl", "--no-ask-password", "restart", unit]


def stop_timeout_argv(unit: str) -> list[str]:
    """Read-only: the unit's TimeoutStopSec= as systemd resolved it (e.g. '5min')."""
    return ["systemctl", "show", "--property=TimeoutStopUSec", "--value", unit]


# systemd's DefaultTimeoutStopSec=, assumed while the unit's own cannot be read.
DEFAULT_STOP_TIMEOUT_S = 90.0


def unit_state_argv(unit: str) -> list[str]:
    """Read-only (needs no polkit rule): prints active, activating, failed, ..."""
    return ["systemctl", "is-active", unit]


# -- the env file -------------------------------------------------------------------------


def render_env(steps: int) -> str:
    """The env file for ``steps`` with topk 1: draft tokens are always steps + 1."""
    return f"{ENV_HEADER}{ENV_STEPS}={steps}\n{ENV_DRAFT_TOKENS}={steps + 1}\n"


# The drop-in's ExecStart carries this unbraced ($NAME): systemd splits it into words, and an
# empty value (off) adds no argument at all.
ENV_ARGS = "SPECD_SPECULATIVE_ARGS"
ADAPTIVE_CONFIG_MODE = 0o644


def render_setting_env(setting: SpecSetting, *, algorithm: str, config_dir: Path | str) -> str:
    """The env file for any setting. Static keeps the step variables of render_env so the
    journal, rollback and read_env_steps read it exactly as before."""
    path = None
    if setting.kind == "adaptive":
        path = str(Path(config_dir) / adaptive_config_name(setting))
    words = " ".join(sglang_args(setting, algorithm=algorithm, config_path=path))
    text = f"{ENV_HEADER}{ENV_ARGS}={words}\n"
    if setting.kind == "static":
        assert setting.steps is not None
        text += f"{ENV_STEPS}={setting.steps}\n{ENV_DRAFT_TOKENS}={setting.steps + 1}\n"
    return text


def write_adaptive_config(setting: SpecSetting, config_dir: Path | str) -> Path:
    """Write the adaptive config SGLang will read, atomically, BEFORE the env file names it.

    Content-addressed name: a config in use is never rewritten in place. files.write_atomic
    sets the mode explicitly and replaces (never writes through) a symlink at the target.
    """
    path = Path(config_dir) / adaptive_config_name(setting)
    files.write_text_atomic(path, adaptive_config_text(setting), mode=ADAPTIVE_CONFIG_MODE)
    return path


def parse_env(text: str) -> dict[str, str]:
    """KEY=VALUE lines as systemd's EnvironmentFile= reads them (comments, quotes)."""
    values: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;" or "=" not in line:
            continue
        key, _, value = line.partition("=")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        values[key.strip()] = value
    return values


def read_env_steps(path: Path | str) -> int | None:
    """Steps the env file asks for; None when absent, unreadable or not a count."""
    try:
        data = files.read_regular_file(path, MAX_ENV_BYTES)
    except files.FileReadError:
        return None
    value = parse_env(data.decode("utf-8", errors="replace")).get(ENV_STEPS, "")
    if not value.isdigit():
        return None
    return int(value)


def _read_env_bytes(path: Path) -> bytes | None:
    """The env file's bytes, None when it does not exist. Raises ``files.FileReadError``.

    Never through a symlink: what a link points at may be a secret, and the backup goes
    into state.json and back onto disk as a rollback.
    """
    try:
        return files.read_regular_file(path, MAX_ENV_BYTES)
    except files.MissingFileError:
        return None


def encode_env(data: bytes | None) -> tuple[str | None, str]:
    if data is None:
        return None, "utf-8"
    try:
        return data.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        return base64.b64encode(data).decode("ascii"), "base64"


def decode_env(text: str | None, encoding: str) -> bytes | None:
    if text is None:
        return None
    if encoding == "base64":
        return base64.b64decode(text.encode("ascii"), validate=True)
    return text.encode("utf-8")


# -- the journal --------------------------------------------------------------------------


class JournalError(ValueError):
    """A persisted journal that cannot be understood (one-line reason)."""


@dataclass
class Journal:
    """The restart sequence's own record, persisted before each step.

    ``previous_env`` is the env file before specd wrote it (None: there was none), so a
    rollback restores it byte for byte; non-UTF-8 content is kept in base64.
    ``restarts_issued`` counts restart commands issued (or about to be: it is persisted
    first): 1 for the change, 2 once the rollback restart went out. ``attempt`` counts runs
    of this sequence: 1 by ``apply``, +1 each time ``reconcile`` resumes it.
    """

    phase: str
    from_steps: int | None
    to_steps: int
    unit: str
    env_file: str
    previous_env: str | None
    previous_env_encoding: str
    started_at: float
    attempt: int = 1
    restarts_issued: int = 0
    restart_issued_at: float | None = None
    rollback_reason: str | None = None
    finished_at: float | None = None
    capacity: int | None = None
    messages: list[str] = field(default_factory=list)
    version: int = JOURNAL_VERSION

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Journal:
        if not isinstance(data, Mapping):
            raise JournalError(f"restart journal is a {type(data).__name__}, not an object")
        if data.get("version") != JOURNAL_VERSION:
            raise JournalError(f"restart journal version {data.get('version')!r} unknown")
        phase = data.get("phase")
        if phase not in PHASES:
            raise JournalError(f"restart journal phase {phase!r} unknown")

        def opt_int(name: str) -> int | None:
            value = data.get(name)
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, int):
                raise JournalError(f"restart journal {name} {value!r} is not an integer")
            return value

        def opt_float(name: str) -> float | None:
            value = data.get(name)
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise JournalError(f"restart journal {name} {value!r} is not a number")
            return float(value)

        def text(name: str) -> str:
            value = data.get(name)
            if not isinstance(value, str):
                raise JournalError(f"restart journal {name} {value!r} is not a string")
            return value

        to_steps = opt_int("to_steps")
        started_at = opt_float("started_at")
        if to_steps is None or started_at is None:
            raise JournalError("restart journal lacks to_steps or started_at")
        previous = data.get("previous_env")
        if previous is not None and not isinstance(previous, str):
            raise JournalError("restart journal previous_env is not a string")
        encoding = text("previous_env_encoding")
        if encoding not in ("utf-8", "base64"):
            raise JournalError(f"restart journal previous_env_encoding {encoding!r} unknown")
        try:
            decode_env(previous, encoding)
        except (ValueError, binascii.Error) as exc:
            raise JournalError(f"restart journal previous_env undecodable: {exc}") from None
        messages = data.get("messages", [])
        if not isinstance(messages, list):
            raise JournalError("restart journal messages is not a list")
        return cls(
            phase=str(phase),
            from_steps=opt_int("from_steps"),
            to_steps=to_steps,
            unit=text("unit"),
            env_file=text("env_file"),
            previous_env=previous,
            previous_env_encoding=encoding,
            started_at=started_at,
            attempt=opt_int("attempt") or 1,
            restarts_issued=opt_int("restarts_issued") or 0,
            restart_issued_at=opt_float("restart_issued_at"),
            rollback_reason=None
            if data.get("rollback_reason") is None
            else text("rollback_reason"),
            finished_at=opt_float("finished_at"),
            capacity=opt_int("capacity"),
            messages=[str(m) for m in messages],
        )

    def previous_bytes(self) -> bytes | None:
        return decode_env(self.previous_env, self.previous_env_encoding)

    def note(self, message: str) -> None:
        self.messages.append(f"{self.phase}: {message}")
        del self.messages[:-MAX_JOURNAL_MESSAGES]


@dataclass(frozen=True)
class ApplyOutcome:
    result: Result
    from_steps: int | None
    to_steps: int | None
    # From the first `systemctl restart` to the end of the sequence; 0 when none was issued.
    duration_s: float
    message: str
    capacity: int | None
    restarts_issued: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class _Live:
    """What a verification read of SGLang found."""

    ok: bool
    message: str
    capacity: int | None = None
    # SGLang answered and runs something else: re-reading will not change that.
    mismatch: bool = False


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _capacity_from_info(info: Mapping[str, Any]) -> int | None:
    """Effective max_running_requests: the per-DP values SGLang settled on after memory
    profiling (internal_states), else the launch argument."""
    states = info.get("internal_states")
    if isinstance(states, list) and states:
        per_dp = [
            _as_int(state.get("effective_max_running_requests_per_dp"))
            if isinstance(state, dict)
            else None
            for state in states
        ]
        if all(v is not None and v > 0 for v in per_dp):
            return sum(v for v in per_dp if v is not None)
    return _as_int(info.get("max_running_requests"))


# -- the sequence -------------------------------------------------------------------------


class Applier:
    """Runs restart sequences. Never raises; every path ends in an ``ApplyOutcome``."""

    def __init__(
        self,
        sglang: SGLangSettings,
        choose: ChooseSettings,
        restart: RestartSettings,
        client: SGLangProbe,
        runner: Runner,
        persist: Callable[[dict[str, Any] | None], None],
        stop: threading.Event,
        *,
        quiet_poll_interval_s: float = 5.0,
        health_poll_interval_s: float = 2.0,
        verify_attempts: int = 3,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        """``sglang``/``choose``/``restart`` are the config's tables. The rest is pacing,
        not configuration: how often to look for a quiet moment (the daemon's scrape
        interval), how often to probe health, how many verification reads to make."""
        if not (quiet_poll_interval_s > 0 and health_poll_interval_s > 0 and verify_attempts > 0):
            raise ValueError("poll intervals and verify_attempts must be > 0")
        self.sglang = sglang
        self.choose = choose
        self.restart = restart
        self.quiet_poll_interval_s = quiet_poll_interval_s
        self.health_poll_interval_s = health_poll_interval_s
        self.verify_attempts = verify_attempts
        self.client = client
        self.runner = runner
        self._persist_cb = persist
        self._stop = stop
        self._clock = clock
        # Deadlines run on the monotonic clock so a wall-clock step cannot cut a wait short
        # or stretch it; the wall clock only stamps the journal.
        self._mono = monotonic
        self._restart_started: float | None = None
        self._journal: Journal | None = None
        self._stop_timeout_s: float | None = None
        self.log = logs.get_logger(component="apply")

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        client: SGLangProbe,
        runner: Runner,
        persist: Callable[[dict[str, Any] | None], None],
        stop: threading.Event,
        **pacing: Any,
    ) -> Applier:
        """An applier for the whole config: quiet moments are looked for once per scrape."""
        pacing.setdefault("quiet_poll_interval_s", settings.observe.scrape_interval_s)
        return cls(
            settings.sglang,
            settings.choose,
            settings.restart,
            client,
            runner,
            persist,
            stop,
            **pacing,
        )

    # -- public ---------------------------------------------------------------------
    def apply(
        self,
        target: int,
        current: int | None,
        *,
        window_open: Callable[[], bool],
        force: bool = False,
    ) -> ApplyOutcome:
        """Change SGLang to ``target`` steps. ``force`` ignores the window (override now)."""
        self._restart_started = None
        self._journal = None
        try:
            return self._apply(target, current, window_open, force)
        except Exception as exc:  # a bug must still leave SGLang and the env file consistent
            self.log.exception("apply_internal_error")
            if self._journal is None:
                return self._aborted(current, target, f"internal error: {exc!r}")
            return self._recover(self._journal, exc)

    def _apply(
        self, target: int, current: int | None, window_open: Callable[[], bool], force: bool
    ) -> ApplyOutcome:
        if not self.choose.min_steps <= target <= self.choose.max_steps:
            return self._aborted(
                current,
                target,
                f"target {target} outside {self.choose.min_steps}..{self.choose.max_steps}",
            )
        if target == current:
            return self._aborted(current, target, f"SGLang already runs {target} steps")

        # The window check below (window_open) counts the unit's real stop timeout.
        self.read_stop_timeout()
        why_not = self._wait_quiet(window_open, force)
        if why_not is not None:
            return self._aborted(current, target, why_not)

        env_path = self.sglang.env_file
        try:
            previous = _read_env_bytes(env_path)
        except (OSError, ValueError) as exc:
            return self._aborted(current, target, f"cannot back up env file: {exc}")
        prev_text, prev_encoding = encode_env(previous)
        journal = Journal(
            phase="planned",
            from_steps=current,
            to_steps=target,
            unit=self.sglang.unit,
            env_file=str(env_path),
            previous_env=prev_text,
            previous_env_encoding=prev_encoding,
            started_at=self._clock(),
        )
        journal.note(f"{current} → {target} steps")
        self._journal = journal
        self._persist(journal)
        return self._forward(journal, previous)

    def reconcile(self, journal_data: Mapping[str, Any] | None) -> ApplyOutcome | None:
        """Finish a sequence a previous specd left unfinished (it was killed)."""
        if journal_data is None:
            return None
        self._restart_started = None
        try:
            journal = Journal.from_dict(journal_data)
        except JournalError as exc:
            return self._reconcile_unreadable(journal_data, str(exc))
        if journal.phase in TERMINAL_RESULTS:
            message = journal.messages[-1] if journal.messages else journal.phase
            return self._outcome_from(journal, TERMINAL_RESULTS[journal.phase], message)
        if Path(journal.env_file) != Path(self.sglang.env_file):
            # Paths come from the config only: a journal (state.json) naming another file
            # must not make specd overwrite or delete it.
            return self._reconcile_unreadable(
                journal_data,
                f"restart journal names env file {journal.env_file!r}, not the configured "
                f"{str(self.sglang.env_file)!r}; not acting on it",
            )
        try:
            return self._resume(journal)
        except Exception as exc:
            self.log.exception("reconcile_internal_error")
            return self._recover(journal, exc)

    def _recover(self, journal: Journal, exc: Exception) -> ApplyOutcome:
        reason = f"internal error: {exc!r}"
        try:
            return self._rollback(journal, reason, maybe_untouched=True)
        except Exception as again:
            self.log.exception("rollback_internal_error")
            problem = self._restore_env(journal)
            restored = "env file restored" if problem is None else f"env file: {problem}"
            return ApplyOutcome(
                "failed",
                journal.from_steps,
                journal.to_steps,
                0.0,
                f"{reason}; rollback failed too: {again!r}; {restored}",
                None,
                journal.restarts_issued,
            )

    # -- forward --------------------------------------------------------------------
    def _forward(self, journal: Journal, previous: bytes | None) -> ApplyOutcome:
        new_env = render_env(journal.to_steps).encode()
        if new_env != previous:
            try:
                files.write_atomic(self.sglang.env_file, new_env, mode=ENV_FILE_MODE)
            except OSError as exc:
                return self._env_write_failed(journal, exc)
        self._set_phase(journal, "env_written", f"wrote {self.sglang.env_file}")

        self._issue_restart(journal, "restart_issued")
        result = self.runner(
            restart_argv(self.sglang.unit), timeout_s=self.restart.restart_command_timeout_s
        )
        if not result.ok:
            # A failed `systemctl` may have changed nothing (not found, access denied):
            # then the old server still runs and the rollback needs no restart.
            return self._rollback(journal, result.summary(), maybe_untouched=True)
        journal.note(result.summary())
        return self._verify_forward(journal)

    def _verify_forward(self, journal: Journal) -> ApplyOutcome:
        healthy, why = self._wait_healthy()
        if not healthy:
            return self._rollback(journal, why, maybe_untouched=False)
        self._set_phase(journal, "verifying", why)
        live = self._verify(journal.to_steps)
        if not live.ok:
            return self._rollback(journal, live.message, maybe_untouched=False)
        journal.capacity = live.capacity
        return self._finish(journal, "done", live.message)

    def _env_write_failed(self, journal: Journal, exc: OSError) -> ApplyOutcome:
        # Nothing was restarted; only make sure the file is what it was.
        problem = f"writing {self.sglang.env_file} failed: {exc}"
        restored = self._restore_env(journal)
        if restored is not None:
            journal.note(problem)
            return self._finish(journal, "failed", f"{problem}; restoring it failed: {restored}")
        return self._finish(journal, "aborted", f"{problem}; nothing was restarted")

    # -- rollback -------------------------------------------------------------------
    def _rollback(self, journal: Journal, reason: str, *, maybe_untouched: bool) -> ApplyOutcome:
        """Restore the previous env file and get SGLang verified on the previous steps.

        ``maybe_untouched``: the change may never have reached SGLang (the restart command
        failed, or specd died around it); if SGLang is healthy on the old steps, restoring
        the file is enough and a restart would only cost minutes of serving.
        """
        self.log.warning("restart_rolling_back", reason=reason, to_steps=journal.to_steps)
        journal.phase = "rolling_back"
        journal.rollback_reason = reason
        journal.note(reason)
        self._persist(journal)
        problem = self._restore_env(journal)
        if problem is not None:
            return self._finish(
                journal, "failed", f"{reason}; restoring {self.sglang.env_file} failed: {problem}"
            )
        journal.note("env file restored")
        self._persist(journal)

        # Without the previous steps there is no telling the old server from the new one.
        if (
            maybe_untouched
            and journal.from_steps is not None
            and self.client.health_generate(self._probe_timeout(None)) is HealthStatus.OK
        ):
            live = self._verify(journal.from_steps)
            if live.ok:
                journal.capacity = live.capacity
                return self._finish(
                    journal, "rolled_back", f"{reason}; SGLang kept {live.message}, no restart"
                )

        if journal.restarts_issued < 2:
            self._issue_restart(journal, "rolling_back")
            result = self.runner(
                restart_argv(self.sglang.unit), timeout_s=self.restart.restart_command_timeout_s
            )
            if not result.ok:
                return self._finish(
                    journal, "failed", f"{reason}; rollback restart: {result.summary()}"
                )
            journal.note(f"rollback: {result.summary()}")
        return self._verify_rollback(journal, reason)

    def _verify_rollback(self, journal: Journal, reason: str) -> ApplyOutcome:
        healthy, why = self._wait_healthy()
        if not healthy:
            return self._finish(journal, "failed", f"{reason}; after rollback {why}")
        live = self._verify(journal.from_steps)
        if not live.ok:
            return self._finish(journal, "failed", f"{reason}; after rollback {live.message}")
        journal.capacity = live.capacity
        return self._finish(journal, "rolled_back", f"{reason}; rolled back, {live.message}")

    def _restore_env(self, journal: Journal) -> str | None:
        """Put the previous env file back (idempotent). Returns a problem or None.

        The configured path only (``reconcile`` refuses a journal naming another), and
        never through a symlink: one planted there is replaced, its target left alone.
        """
        path = self.sglang.env_file
        try:
            previous = journal.previous_bytes()
            if previous is None:
                files.remove_durably(path)
                return None
            try:
                current = _read_env_bytes(path)
            except files.FileReadError:
                current = None  # a link, a FIFO, ...: replaced below, never read through
            if current != previous:
                files.write_atomic(path, previous, mode=ENV_FILE_MODE)
        except (OSError, ValueError) as exc:
            return str(exc)
        return None

    # -- reconcile ------------------------------------------------------------------
    def _resume(self, journal: Journal) -> ApplyOutcome:
        journal.attempt += 1
        journal.note(f"specd restarted mid-sequence; resuming (attempt {journal.attempt})")
        self.log.warning("restart_resuming", phase=journal.phase, attempt=journal.attempt)
        if journal.attempt > MAX_ATTEMPTS:
            problem = self._restore_env(journal)
            extra = f"; restoring the env file failed: {problem}" if problem else ""
            return self._finish(
                journal,
                "failed",
                f"gave up after {journal.attempt - 1} interrupted attempts "
                f"(phase {journal.phase}){extra}",
            )
        self._persist(journal)
        if journal.restart_issued_at is not None:
            # Duration counts from the original restart, across the specd restart.
            self._restart_started = self._mono() - max(
                0.0, self._clock() - journal.restart_issued_at
            )

        if journal.phase in ("planned", "env_written"):
            # No restart was issued: SGLang never saw the new file. Undo the file only.
            problem = self._restore_env(journal)
            if problem is not None:
                return self._finish(journal, "failed", f"restoring the env file failed: {problem}")
            return self._finish(
                journal, "aborted", f"interrupted in {journal.phase}; env file restored"
            )
        if journal.phase in ("restart_issued", "verifying"):
            return self._resume_forward(journal)
        # rolling_back: the env file may or may not be restored, the rollback restart may or
        # may not have been issued (restarts_issued says if it may have been).
        reason = journal.rollback_reason or "interrupted rollback"
        if journal.restarts_issued >= 2:
            problem = self._restore_env(journal)
            if problem is not None:
                return self._finish(journal, "failed", f"restoring the env file failed: {problem}")
            return self._verify_rollback(journal, reason)
        return self._rollback(journal, reason, maybe_untouched=True)

    def _resume_forward(self, journal: Journal) -> ApplyOutcome:
        # The restart may be under way (SGLang loading); restarting again would throw that
        # load away. Wait for it, then look at what runs.
        healthy, why = self._wait_healthy()
        if not healthy:
            return self._rollback(journal, f"after specd restarted: {why}", maybe_untouched=False)
        env_steps = read_env_steps(self.sglang.env_file)
        live = self._verify(journal.to_steps)
        if live.ok and env_steps == journal.to_steps:
            journal.capacity = live.capacity
            self._set_phase(journal, "verifying", "healthy after specd restarted")
            return self._finish(journal, "done", live.message)
        why = live.message if not live.ok else f"env file says {env_steps}"
        return self._rollback(journal, f"after specd restarted: {why}", maybe_untouched=True)

    def _reconcile_unreadable(self, data: Any, problem: str) -> ApplyOutcome:
        # Without a trustworthy journal the previous env file is unknown: leave files and
        # SGLang alone and report a failure so the daemon freezes for an operator.
        to_steps = _as_int(data.get("to_steps")) if isinstance(data, Mapping) else None
        from_steps = _as_int(data.get("from_steps")) if isinstance(data, Mapping) else None
        self.log.error("restart_journal_unreadable", problem=problem)
        return ApplyOutcome(
            "failed",
            from_steps,
            to_steps,
            0.0,
            f"{problem}; SGLang and {self.sglang.env_file} left as they are",
            None,
        )

    # -- waiting --------------------------------------------------------------------
    def _wait_quiet(self, window_open: Callable[[], bool], force: bool) -> str | None:
        """Wait for offered ≤ quiet max. Returns why to abort, or None to go ahead."""
        deadline = self._mono() + self.restart.quiet_deadline_s
        last = "no observation yet"
        while True:
            if self._stop.is_set():
                return "stop requested while waiting for a quiet moment"
            if not force and not window_open():
                return f"window closed while waiting for a quiet moment ({last})"
            obs = self.client.observe()
            if isinstance(obs, ScrapeError):
                last = f"scrape failed: {obs.reason}"
            elif obs.offered <= self.restart.quiet_concurrency_max:
                return None
            else:
                last = f"offered concurrency {obs.offered} > {self.restart.quiet_concurrency_max}"
            left = deadline - self._mono()
            if left <= 0:
                self.log.warning(
                    "no_quiet_moment", waited_s=self.restart.quiet_deadline_s, last=last
                )
                return None
            if self._stop.wait(min(self.quiet_poll_interval_s, left)):
                return "stop requested while waiting for a quiet moment"

    def _wait_healthy(self) -> tuple[bool, str]:
        """Probe /health_generate until OK, the unit failed, or startup_timeout_s passes.

        Runs after a restart went out, so a stop request does not cut it short: leaving now
        would leave SGLang half-changed. It stays bounded, and keeps calling ``stop.wait``
        so a heartbeat-counting event still sees the loop alive. Returns (healthy, why not).
        """
        deadline = self._mono() + self.restart.startup_timeout_s
        while True:
            status = self.client.health_generate(self._probe_timeout(deadline))
            if status is HealthStatus.OK:
                return True, "/health_generate OK"
            # An SGLang that crashed while loading (out of memory with more draft tokens)
            # will not get healthy: no need to wait out a startup timeout of minutes.
            if self._unit_failed():
                return (
                    False,
                    f"{self.sglang.unit} failed while starting "
                    f"(last /health_generate: {status.name})",
                )
            left = deadline - self._mono()
            if left <= 0:
                return False, (
                    f"not healthy within {self.restart.startup_timeout_s:g} s "
                    f"(last /health_generate: {status.name})"
                )
            self._pause(min(self.health_poll_interval_s, left))

    def stop_timeout_s(self) -> float:
        """How long systemd lets the unit stop (TimeoutStopSec=), as last read at a restart;
        systemd's default until then (specd forks nothing between restarts)."""
        return DEFAULT_STOP_TIMEOUT_S if self._stop_timeout_s is None else self._stop_timeout_s

    def read_stop_timeout(self) -> None:
        """Read the unit's TimeoutStopSec= (once per applier); an infinite one counts as the
        restart command's own timeout, which bounds a stop in practice."""
        if self._stop_timeout_s is not None:
            return
        result = self.runner(stop_timeout_argv(self.sglang.unit), timeout_s=UNIT_STATE_TIMEOUT_S)
        value = timespan_s(result.stdout) if result.returncode == 0 else None
        if value is not None:
            self._stop_timeout_s = min(value, self.restart.restart_command_timeout_s)

    def _unit_failed(self) -> bool:
        """True only when systemd says the unit failed; any doubt means keep waiting."""
        result = self.runner(unit_state_argv(self.sglang.unit), timeout_s=UNIT_STATE_TIMEOUT_S)
        return result.stdout.strip() == "failed"

    def _probe_timeout(self, deadline: float | None) -> float:
        timeout = self.restart.health_probe_timeout_s
        if deadline is None:
            return timeout
        # The last probe may not overrun the deadline by a whole probe timeout.
        return max(0.5, min(timeout, deadline - self._mono()))

    def _pause(self, seconds: float) -> None:
        end = self._mono() + seconds
        while (left := end - self._mono()) > 0:
            if not self._stop.is_set():
                self._stop.wait(left)
                continue
            # Once stop is set, stop.wait() returns at once: sleep in slices, still calling
            # it so the daemon's watchdog heartbeat keeps beating.
            self._stop.wait(0)
            time.sleep(min(left, 0.5))

    # -- verification ---------------------------------------------------------------
    def _verify(self, expected: int | None) -> _Live:
        """Does SGLang run ``expected`` steps (topk 1, draft tokens + 1)? Reads capacity."""
        last = _Live(False, "no verification read")
        for attempt in range(self.verify_attempts):
            if attempt:
                self._pause(self.health_poll_interval_s)
            last = self._read_live(expected)
            if last.ok or last.mismatch:
                return last
        return last

    def _read_live(self, expected: int | None) -> _Live:
        info = self.client.server_info()
        obs = self.client.observe()
        if isinstance(info, ScrapeError) and isinstance(obs, ScrapeError):
            return _Live(False, f"cannot read SGLang: {info.reason}; {obs.reason}")
        seen: list[str] = []
        wrong: list[str] = []

        def check(source: str, name: str, value: int | None, want: int | None) -> None:
            # 0 / absent means the source does not know (a gauge not yet set), not a mismatch.
            if value is None or value == 0 or want is None:
                return
            if value == want:
                seen.append(f"{source} {name}={value}")
            else:
                wrong.append(f"{source} {name}={value} ≠ {want}")

        draft_want = expected + 1 if expected is not None else None
        capacity: int | None = None
        # Named as the endpoint that answered: /get_server_info on SGLang before 0.5.6.
        info_source = self.client.info_path or "/server_info"
        if isinstance(info, dict):
            check(info_source, "steps", _as_int(info.get("speculative_num_steps")), expected)
            topk = _as_int(info.get("speculative_eagle_topk"))
            if topk in (None, 1):
                draft = _as_int(info.get("speculative_num_draft_tokens"))
                check(info_source, "draft_tokens", draft, draft_want)
            capacity = _capacity_from_info(info)
        if isinstance(obs, Observation):
            # The page's own gauges (0.5.13+): an Observation's steps may be /server_info's
            # again, which is no second witness.
            page = self.client.last_page
            if page is not None:
                check("metrics", "steps", page.steps, expected)
                if obs.topk in (None, 1):
                    check("metrics", "draft_tokens", page.draft_tokens, draft_want)
            if obs.max_running_requests is not None:
                capacity = obs.max_running_requests
        if wrong:
            return _Live(False, "SGLang runs " + ", ".join(wrong), capacity, mismatch=True)
        if expected is None:
            return _Live(True, "healthy (previous steps unknown)", capacity)
        if not any(item.startswith((f"{info_source} steps", "metrics steps")) for item in seen):
            return _Live(False, f"cannot verify steps: neither {info_source} nor metrics show them")
        return _Live(True, f"verified {expected} steps ({', '.join(seen)})", capacity)

    # -- bookkeeping ----------------------------------------------------------------
    def _issue_restart(self, journal: Journal, phase: str) -> None:
        journal.restarts_issued += 1
        journal.restart_issued_at = self._clock()
        if self._restart_started is None:
            self._restart_started = self._mono()
        journal.phase = phase
        journal.note(f"issuing `{' '.join(restart_argv(journal.unit))}`")
        self._persist(journal)

    def _set_phase(self, journal: Journal, phase: str, message: str) -> None:
        journal.phase = phase
        journal.note(message)
        self._persist(journal)

    def _persist(self, journal: Journal) -> None:
        self._persist_cb(journal.to_dict())

    def _finish(self, journal: Journal, phase: str, message: str) -> ApplyOutcome:
        journal.phase = phase
        journal.finished_at = self._clock()
        journal.note(message)
        self._persist(journal)
        result = TERMINAL_RESULTS[phase]
        outcome = self._outcome_from(journal, result, message)
        log = self.log.error if result == "failed" else self.log.info
        log("restart_sequence_end", **outcome.to_dict())
        return outcome

    def _outcome_from(self, journal: Journal, result: Result, message: str) -> ApplyOutcome:
        duration = 0.0
        if self._restart_started is not None:
            duration = self._mono() - self._restart_started
        elif journal.restart_issued_at is not None and journal.finished_at is not None:
            duration = max(0.0, journal.finished_at - journal.restart_issued_at)
        return ApplyOutcome(
            result,
            journal.from_steps,
            journal.to_steps,
            duration,
            message,
            journal.capacity,
            journal.restarts_issued,
        )

    def _aborted(self, current: int | None, target: int, message: str) -> ApplyOutcome:
        self.log.info("restart_aborted", from_steps=current, to_steps=target, reason=message)
        return ApplyOutcome("aborted", current, target, 0.0, message, None, 0)
