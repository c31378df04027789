"""Apply a speculative setting to SGLang: env file + `systemctl restart`, verified, journalled.

The only module that touches systemd or SGLang's env file. One sequence::

    quiet moment? ─► planned ─► env_written ─► restart_issued ─► verifying ─► done
                                    │                │               │
                                    └───── any failure ──────────────┴─► rolling_back
                                                                             │
                                                          rolled_back ◄──────┴──► failed

With a ``[fleet]`` (specd/io/fleet.py) the sequence first takes one of the group's slots in
etcd (waiting, while the window stays open, for one to free up), keeps its lease alive
while it runs (the quiet moment is looked for once the slot is taken, not before the wait),
checks the lease still holds right before the restart (a specd cut off from
etcd may have lost it: then nothing is restarted), and releases it at every end. The
journal names the slot, so a specd killed in between releases it on its next start; the
slot frees itself anyway one lease TTL after the specd died. From the moment the sequence
takes the server out of service (the drain's first DELETE; without a gateway, right before
`systemctl restart`) until it serves again, an out-of-service marker in etcd counts it
against the group's slots too, under a lease nobody renews whose TTL bounds the rest of the
sequence (``out_of_service_bound_s``): a specd that dies mid-restart frees its slot after
one short lease TTL, but its server stays counted until it is back or that bound passed.

With a ``[gateway]`` the quiet moment gives way to a drain (specd/io/gateway.py)::

    planned ─► draining (on every replica; until SGLang has 0 running, 0 queued) ─► env_written …

and every end of the sequence (done, rolled back, failed, aborted) first re-adds the worker
where it was drained and waits until it is ready there. The journal lists the drained
workers, so a specd killed in between re-adds them on its next start (``reconcile``).

Before each step the journal (a JSON-able dict, see ``Journal``) is handed to ``persist``,
which the daemon stores atomically in state.json; a change whose plan or restart it cannot
save (disk full, read-only) is not restarted. A specd killed at any point finds on its
next start a journal saying what may have happened, and ``Applier.reconcile`` finishes the
sequence without a second restart of a server that may still be loading.

Contract with the caller: ``apply`` and ``reconcile`` leave the journal persisted in a
terminal phase (done, rolled_back, failed, aborted) and return the outcome; the caller
records the outcome and clears the journal (``persist(None)`` or the equivalent) in the same
state write. ``reconcile`` of a terminal journal only reports its outcome, so an outcome is
never lost, and is recorded twice only if the caller does not clear it.

One exception: the system shutting down while a restart is in flight (specd asked to stop,
and systemd says "stopping" or is gone from the bus). The sequence puts the env file back
on the previous setting, which SGLang starts on at boot, and returns at once with
``pending`` set, its journal persisted as it is (``shutdown`` says why): the caller keeps
it, and the next start's ``reconcile`` verifies what SGLang booted on.
"""

from __future__ import annotations

import base64
import binascii
import itertools
import json
import math
import os
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Protocol

from specd.core.history import LATEST_TIME
from specd.core.observation import MAX_RUNNING_REQUESTS, MAX_STEPS, Observation, ScrapeError
from specd.core.setting import (
    SpecSetting,
    adaptive_config_name,
    adaptive_config_text,
    describe_args,
    describe_server,
    format_setting,
    mismatch,
    outside_steps,
    sglang_args,
    static,
)
from specd.core.setting import off as setting_off
from specd.core.setting import parse as parse_setting
from specd.core.settings import (
    ChooseSettings,
    GatewaySettings,
    RestartSettings,
    Settings,
    SGLangSettings,
)
from specd.core.text import ascii_count, one_line, utc_time
from specd.io import files, logs
from specd.io.fleet import Fleet, FleetUnavailable, LeaseKeeper, OutMarker, Slot
from specd.io.gateway import GatewayClient, GatewayUnavailable, Worker
from specd.io.runner import Runner, RunResult
from specd.io.sglang import HealthStatus, ParsedMetrics
from specd.io.systemd import (
    DEFAULT_STOP_TIMEOUT_S,
    START_LIMIT_HIT,
    StartLimit,
    SystemctlError,
    UnitState,
    invocation_id,
    show,
    start_limit,
    unit_state,
)
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
    "draining",
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
# How a drain ended: SGLang idle (the restart went ahead), not idle within drain_timeout_s,
# cut short (window closed, stop requested), or a gateway that failed mid-drain.
DRAIN_RESULTS = ("idle", "timeout", "aborted", "error")
# Idle must hold on this many reads in a row: a request the gateway routed just before the
# drain may not be counted by SGLang's gauges yet.
IDLE_READS = 2


class SGLangProbe(Protocol):
    """What apply needs from ``specd.observe.SGLangClient``."""

    def observe(self) -> Observation | ScrapeError: ...

    def server_info(self) -> dict[str, Any] | ScrapeError: ...

    @property
    def info_path(self) -> str | None: ...

    @property
    def last_page(self) -> ParsedMetrics | None: ...

    @property
    def live_algorithm(self) -> str | None: ...

    @property
    def last_server_info(self) -> dict[str, Any] | None: ...

    def health_generate(self, timeout_s: float) -> HealthStatus: ...


def restart_argv(unit: str) -> list[str]:
    return ["systemctl", "--no-ask-password", "restart", unit]


def reset_failed_argv(unit: str) -> list[str]:
    """Clears the unit's failed state and systemd's count of its starts (its start limit):
    the one other verb specd's polkit rule allows, on this unit only."""
    return ["systemctl", "--no-ask-password", "reset-failed", unit]


# Waiting out a start limit: past the interval's end, by this much (systemd forgets the
# starts once more than the interval has passed since the first of them).
START_LIMIT_MARGIN_S = 1.0


def stop_timeout_argv(unit: str) -> list[str]:
    """Read-only: the unit's TimeoutStopSec= as systemd resolved it (e.g. '5min')."""
    return ["systemctl", "show", "--property=TimeoutStopUSec", "--value", unit]


def unit_state_argv(unit: str) -> list[str]:
    """Read-only (needs no polkit rule): prints active, activating, failed, ..."""
    return ["systemctl", "is-active", unit]


def system_state_argv() -> list[str]:
    """Read-only (needs no polkit rule): the system's state, "stopping" once a shutdown
    (poweroff, reboot, halt, kexec) has begun."""
    return ["systemctl", "is-system-running"]


# What systemctl says when it cannot reach systemd over the system bus. At shutdown the bus
# (dbus.service) stops beside specd, which is not ordered after it, and a specd that is not
# root has no other way to systemd: from then on every systemctl of specd's fails so.
BUS_GONE = ("Failed to connect to bus", "Transport endpoint is not connected")


# A unit found stopped is read again this much later before it counts as stopped outside
# specd: longer than a restart's passage through inactive, short beside a load.
STOPPED_RECHECK_S = 2.0

# A shutdown seen before specd's own stop: systemd stops specd at the shutdown's start
# (nothing is ordered to stop before it), so its SIGTERM follows within moments.
SHUTDOWN_STOP_WAIT_S = 10.0


class ShuttingDown(Exception):
    """The system shuts down while a restart is in flight (raised by the waits and the
    restart commands of the sequence, caught by ``apply_setting`` and ``reconcile``)."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


# -- the env file -------------------------------------------------------------------------


def render_env(steps: int) -> str:
    """The env file for ``steps`` with topk 1: draft tokens are always steps + 1."""
    return f"{ENV_HEADER}{ENV_STEPS}={steps}\n{ENV_DRAFT_TOKENS}={steps + 1}\n"


# The drop-in's ExecStart carries this unbraced ($NAME): systemd splits it into words, and an
# empty value (off) adds no argument at all.
ENV_ARGS = "SPECD_SPECULATIVE_ARGS"
ARGS_WORD = "$" + ENV_ARGS  # unbraced: systemd splits it into words, empty adds none
ADAPTIVE_CONFIG_MODE = 0o644
# A step variable in an ExecStart= line, braced or a whole word.
_STEP_VARIABLE = re.compile(
    rf"\$(?:\{{({ENV_STEPS}|{ENV_DRAFT_TOKENS})\}}|({ENV_STEPS}|{ENV_DRAFT_TOKENS})\b)"
)


def static_only_wiring(unit: str, exec_start: Sequence[str]) -> str | None:
    """Why ``unit`` can be given static step counts only, from its ExecStart= lines as
    ``systemctl show`` prints them: it reads the step variables (a drop-in from before
    `specd install` wrote ``$SPECD_SPECULATIVE_ARGS``), which cannot say "off" or an
    adaptive set. None when it reads ``$SPECD_SPECULATIVE_ARGS``, or neither (then nothing
    specd writes reaches SGLang, and a restart's verification says so)."""
    if any(ARGS_WORD in line.split() for line in exec_start):
        return None
    for line in exec_start:
        found = _STEP_VARIABLE.search(line)
        if found:
            name = found.group(1) or found.group(2)
            return (
                f"{unit}'s ExecStart= reads ${{{name}}}, not {ARGS_WORD}: static step counts "
                "only (`specd install` rewrites it)"
            )
    return None


def read_stop_timeout_s(
    runner: Runner, unit: str, restart_command_timeout_s: float
) -> float | None:
    """``unit``'s TimeoutStopSec= read from systemd now, None where it cannot say; an
    infinite one counts as the restart command's own timeout, which bounds a stop in
    practice."""
    result = runner(stop_timeout_argv(unit), timeout_s=UNIT_STATE_TIMEOUT_S)
    value = timespan_s(result.stdout) if result.returncode == 0 else None
    return None if value is None else min(value, restart_command_timeout_s)


def restart_needs_s(stop_timeout_s: float | None, restart_cost_s: float) -> float:
    """The longest one restart takes: the unit's stop timeout (systemd's default where it
    was not read) plus the start."""
    return (DEFAULT_STOP_TIMEOUT_S if stop_timeout_s is None else stop_timeout_s) + restart_cost_s


def read_static_only(runner: Runner, unit: str) -> str | None:
    """Why ``unit`` can be given static step counts only (`static_only_wiring`), read from
    systemd now; None also when systemd cannot say (a setting that does not reach SGLang is
    still caught by the restart's verification and rolled back)."""
    return read_wiring(runner, unit)[0]


def read_wiring(runner: Runner, unit: str) -> tuple[str | None, str | None]:
    """(`read_static_only`, why systemd could not say, one line, or None when it did): for
    a command that tells the operator what it checked."""
    try:
        props = show(runner, unit, ["ExecStart"], timeout_s=UNIT_STATE_TIMEOUT_S)
    except SystemctlError as exc:
        return None, one_line(exc, 200)
    return static_only_wiring(unit, props.get("ExecStart", [])), None


def _same_path(a: str, b: str) -> bool:
    return os.path.normpath(a) == os.path.normpath(b) or os.path.realpath(a) == os.path.realpath(b)


def env_file_unread(
    unit: str, env_file: Path | str, props: Mapping[str, Sequence[str]]
) -> str | None:
    """Why ``unit`` would start SGLang without reading ``env_file``, from ``systemctl show``
    of its LoadState and EnvironmentFiles: none of its EnvironmentFile= lines names it (the
    drop-in was removed: `systemctl revert`, an upgrade, config management). None when it
    does, or when systemd does not say the unit is loaded (it cannot tell; a unit that is
    not found fails the restart command, which changes nothing)."""
    if (props.get("LoadState") or [""])[-1] != "loaded":
        return None
    # "EnvironmentFiles=/var/lib/specd/sglang.env (ignore_errors=yes)", one line per file.
    listed = [v.rsplit(" (ignore_errors=", 1)[0] for v in props.get("EnvironmentFiles", []) if v]
    if any(_same_path(path, str(env_file)) for path in listed):
        return None
    return (
        f"{unit} does not read {env_file} (its EnvironmentFile= lines: "
        f"{', '.join(listed) or 'none'}; was its drop-in removed?): nothing specd writes "
        "would reach SGLang, so no restart (`specd install` puts the drop-in back)"
    )


def read_env_file_unread(runner: Runner, unit: str, env_file: Path | str) -> str | None:
    """`env_file_unread`, read from systemd now; None also when systemd cannot say."""
    try:
        props = show(
            runner, unit, ["LoadState", "EnvironmentFiles"], timeout_s=UNIT_STATE_TIMEOUT_S
        )
    except SystemctlError:
        return None
    return env_file_unread(unit, env_file, props)


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
    return ascii_count(parse_env(data.decode("utf-8", errors="replace")).get(ENV_STEPS, ""), 9)


def env_algorithm(data: bytes | None) -> str | None:
    """The --speculative-algorithm an env file of the setting form names; None without one
    (no file, the step-variable form, or "off")."""
    if data is None:
        return None
    words = parse_env(data.decode("utf-8", errors="replace")).get(ENV_ARGS, "").split()
    for word, following in itertools.pairwise(words):
        if word == "--speculative-algorithm":
            return following
    return None


def env_setting_words(data: bytes) -> list[str] | None:
    """The speculative words an env file of the setting form gives SGLang ([] for off);
    None when it is of the step-variable form or names no setting."""
    values = parse_env(data.decode("utf-8", errors="replace"))
    if ENV_ARGS in values:
        return values[ENV_ARGS].split()
    steps = values.get(ENV_STEPS, "")
    draft = values.get(ENV_DRAFT_TOKENS, "")
    if not (steps.isdigit() and draft.isdigit()):
        return None
    # The step-variable form under a drop-in of that form: the algorithm is the unit's.
    return [
        "--speculative-algorithm", "?",
        "--speculative-num-steps", steps,
        "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", draft,
    ]  # fmt: skip


def setting_steps(setting: SpecSetting | None) -> int | None:
    """The step count an outcome reports (the daemon still speaks steps): K for static, 0
    for off (no drafting), None for adaptive (SGLang picks among its candidates)."""
    if setting is None or setting.kind == "adaptive":
        return None
    return setting.steps if setting.kind == "static" else 0


def setting_of_steps(steps: int | None) -> SpecSetting | None:
    """A step count as a setting: 0 is no drafting (off); None or out of range: unknown."""
    if steps is None:
        return None
    if steps == 0:
        return setting_off()
    try:
        return static(steps)
    except ValueError:
        return None


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
    ``to_setting``/``from_setting`` are the settings in their text form (``format_setting``);
    a journal written before settings existed has only the step counts, read as static.
    ``written_env`` is the env file this sequence wrote, so a resumed sequence can tell
    whether the file still asks for the target.
    ``restarts_issued`` counts restart commands issued (or about to be: it is persisted
    first): 1 for the change, 2 once the rollback restart went out. ``not_started`` of them
    started no SGLang: the change's own, refused for the unit's start limit and backed out
    (``change_refused``) or dead in systemd's setup of the process (``setup_failed``), or one
    that reached nothing (SGLang found on its previous setting, healthy: "SGLang kept …").
    The rest are the SGLang restarts the daily budget counts, each a start (a model load)
    of SGLang; a restart refused for the start limit and made again (after `reset-failed`,
    or once the limit's interval passed) is one.
    ``attempt`` counts runs of this sequence: 1 by ``apply``, +1 each time ``reconcile``
    resumes it; 0 once a run left it cleanly for a shutdown (a reboot is no crash).
    """

    phase: str
    from_steps: int | None
    to_steps: int | None
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
    # The fleet slot taken for this sequence (fleet.Slot.to_dict), persisted before anything
    # else happens; ``fleet_released`` once it was given back.
    fleet_slot: dict[str, Any] | None = None
    fleet_released: bool = False
    # The out-of-service marker put when the server was taken out (fleet.OutMarker.to_dict),
    # persisted before it is put; ``fleet_out_removed`` once it was revoked (the server
    # serves again).
    fleet_out: dict[str, Any] | None = None
    fleet_out_removed: bool = False
    messages: list[str] = field(default_factory=list)
    # The gateway workers removed from routing (Worker.to_dict), persisted before each
    # DELETE; ``readded`` once they were added back (or the re-add was given up).
    drained: list[dict[str, Any]] = field(default_factory=list)
    readded: bool = False
    version: int = JOURNAL_VERSION
    from_setting: str | None = None
    to_setting: str | None = None
    written_env: str | None = None
    not_started: int = 0
    # The rollback's restart was refused for the unit's start limit, which specd may not
    # clear: it waits until this wall-clock time, then restarts once more. A specd killed
    # while it waits finds it here and does the rest at its next start.
    refused_until: float | None = None
    # systemd's start limit, used up before this change, refused the change's own start
    # (the new setting never ran) and specd may not clear it: the sequence goes back to the
    # previous setting and ends aborted, not rolled back: nothing is held against the target.
    change_refused: bool = False
    # The system shut down while the restart was in flight (why): the env file was put back
    # on the previous setting, which SGLang starts on at boot, and specd's next start
    # verifies it there (``_resume_after_shutdown``) instead of restarting SGLang.
    shutdown: str | None = None
    # ... before the target was either verified or found failing: the sequence ends
    # aborted, nothing held against the target (a load cut short, or failing while the
    # system goes down around SGLang, says nothing of the setting).
    no_verdict: bool = False
    # The change's own start died in systemd's setup of the process, before SGLang ran
    # (its exit status, "219/CGROUP"): backed out like ``change_refused``, ends aborted.
    setup_failed: str | None = None
    # The unit's InvocationID when the last restart was journalled as issued: one that is
    # still the unit's, with no job queued, at a resume means that restart never went out
    # (specd was killed between the journal and `systemctl restart`). None: not known.
    issued_from: str | None = None

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

        def opt_int(name: str, low: int = 0, high: int = MAX_RUNNING_REQUESTS) -> int | None:
            # A count, a step count or a capacity: what a sequence specd ran can hold (a
            # negative attempt count never reached the give-up; steps 99 became "live").
            value = data.get(name)
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, int):
                raise JournalError(f"restart journal {name} {value!r:.40} is not an integer")
            if not low <= value <= high:
                raise JournalError(f"restart journal {name} {value} is not in {low}..{high}")
            return value

        def opt_float(name: str) -> float | None:
            # A time: finite and one a clock shows (1e308 and -1e308 made a duration of
            # infinity, which no later save of the state could write).
            value = data.get(name)
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise JournalError(f"restart journal {name} {value!r:.40} is not a number")
            if not 0 <= value <= LATEST_TIME:
                raise JournalError(f"restart journal {name} {value!r:.40} is no time")
            return float(value)

        def text(name: str) -> str:
            value = data.get(name)
            if not isinstance(value, str):
                raise JournalError(f"restart journal {name} {value!r} is not a string")
            return value

        def opt_text(name: str) -> str | None:
            return None if data.get(name) is None else text(name)

        to_steps = opt_int("to_steps", high=MAX_STEPS)
        from_steps = opt_int("from_steps", high=MAX_STEPS)
        started_at = opt_float("started_at")
        to_setting = opt_text("to_setting")
        from_setting = opt_text("from_setting")
        if (to_steps is None and to_setting is None) or started_at is None:
            raise JournalError("restart journal lacks to_steps or started_at")
        restarts_issued = opt_int("restarts_issued") or 0
        not_started = opt_int("not_started") or 0
        if not_started > restarts_issued:
            raise JournalError(
                f"restart journal not_started {not_started} is more than its {restarts_issued} "
                "restarts issued"
            )
        for name, setting_text, steps in (
            ("to_setting", to_setting, to_steps),
            ("from_setting", from_setting, from_steps),
        ):
            if setting_text is None:
                continue
            try:
                setting = parse_setting(setting_text)
            except ValueError as exc:
                raise JournalError(f"restart journal {name}: {exc}") from None
            if steps is not None and setting_steps(setting) != steps:
                raise JournalError(
                    f"restart journal {name} {setting_text!r} contradicts its step count {steps}"
                )
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
        fleet_slot = data.get("fleet_slot")
        try:
            fleet_slot = None if fleet_slot is None else Slot.from_dict(fleet_slot).to_dict()
        except ValueError as exc:
            raise JournalError(f"restart journal {exc}") from None
        fleet_out = data.get("fleet_out")
        try:
            fleet_out = None if fleet_out is None else OutMarker.from_dict(fleet_out).to_dict()
        except ValueError as exc:
            raise JournalError(f"restart journal {exc}") from None
        messages = data.get("messages", [])
        if not isinstance(messages, list):
            raise JournalError("restart journal messages is not a list")
        drained = data.get("drained", [])
        if not isinstance(drained, list):
            raise JournalError("restart journal drained is not a list")
        try:
            workers = [Worker.from_dict(w).to_dict() for w in drained]
        except ValueError as exc:
            raise JournalError(f"restart journal {exc}") from None
        return cls(
            phase=str(phase),
            from_steps=from_steps,
            to_steps=to_steps,
            unit=text("unit"),
            env_file=text("env_file"),
            previous_env=previous,
            previous_env_encoding=encoding,
            started_at=started_at,
            # 0: the last start left it for a shutdown (`_leave_for_boot`).
            attempt=1 if (attempt := opt_int("attempt")) is None else attempt,
            restarts_issued=restarts_issued,
            not_started=not_started,
            refused_until=opt_float("refused_until"),
            change_refused=data.get("change_refused") is True,
            shutdown=opt_text("shutdown"),
            no_verdict=data.get("no_verdict") is True,
            setup_failed=opt_text("setup_failed"),
            issued_from=invocation_id(opt_text("issued_from")),
            restart_issued_at=opt_float("restart_issued_at"),
            rollback_reason=None
            if data.get("rollback_reason") is None
            else text("rollback_reason"),
            finished_at=opt_float("finished_at"),
            capacity=opt_int("capacity", low=1),
            fleet_slot=fleet_slot,
            fleet_released=data.get("fleet_released") is True,
            fleet_out=fleet_out,
            fleet_out_removed=data.get("fleet_out_removed") is True,
            messages=[str(m) for m in messages],
            from_setting=from_setting,
            to_setting=to_setting,
            written_env=opt_text("written_env"),
            drained=workers,
            readded=data.get("readded") is True,
        )

    def target(self) -> SpecSetting:
        """The setting asked for (from_dict has checked it parses)."""
        if self.to_setting is not None:
            return parse_setting(self.to_setting)
        assert self.to_steps is not None
        return static(self.to_steps)

    def previous(self) -> SpecSetting | None:
        """The setting SGLang ran before; None when unknown."""
        if self.from_setting is not None:
            return parse_setting(self.from_setting)
        return setting_of_steps(self.from_steps)

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
    # The settings in their text form (format_setting); from_steps/to_steps are their step
    # counts (setting_steps), for a caller that speaks steps.
    from_setting: str | None = None
    to_setting: str | None = None
    # With a gateway: {result (DRAIN_RESULTS; None for a re-add after specd restarted),
    # duration_s, in_flight_at_restart, replicas, readd_problem, left_out (the drained
    # workers, Worker.to_dict, a failed re-add did not put back)}; None: nothing drained.
    drain: dict[str, Any] | None = None
    # Of restarts_issued, those that started no SGLang (Journal.not_started).
    not_started: int = 0
    # The sequence is not over: the system shuts down, and its journal (persisted, not
    # terminal) is for specd's next start to finish. The caller keeps the journal and
    # records nothing; ``result`` and ``message`` only say how it was left.
    pending: bool = False

    @property
    def sglang_restarts(self) -> int:
        """The SGLang restarts this sequence made: what the daily restart budget counts (a
        rollback's two; none where SGLang was never restarted)."""
        return max(0, self.restarts_issued - self.not_started)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "sglang_restarts": self.sglang_restarts}


@dataclass(frozen=True)
class _Restarted:
    """How the unit's restart went: the command's result; why systemd may refuse to start
    the unit ("" when that is not the case, or not known); ``start_limit``: systemd's start
    limit, used up before a change, refused the change's start and specd may not clear it."""

    result: RunResult
    refused: str = ""
    start_limit: bool = False


@dataclass(frozen=True)
class _Health:
    """How a wait for SGLang's health ended: ``ok``, else ``why`` not; ``setup``: the unit's
    process died in systemd's own setup of it, before SGLang ran (its status, "219/CGROUP")."""

    ok: bool
    why: str
    setup: str | None = None
    # Stopped by someone (`systemctl stop`), not failed: never started again by specd.
    stopped: bool = False


@dataclass(frozen=True)
class _Live:
    """What a verification read of SGLang found."""

    ok: bool
    message: str
    capacity: int | None = None
    # SGLang answered and runs something else: re-reading will not change that.
    mismatch: bool = False


def _steps_or_none(value: Any) -> int | None:
    """A step count an unreadable journal names, if it is one SGLang runs (for the log)."""
    steps = _as_int(value)
    return steps if steps is not None and 0 <= steps <= MAX_STEPS else None


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
        persist: Callable[[dict[str, Any] | None], str | None],
        stop: threading.Event,
        *,
        quiet_poll_interval_s: float = 5.0,
        health_poll_interval_s: float = 2.0,
        verify_attempts: int = 3,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        config_dir: Path | None = None,
        fleet: Fleet | None = None,
        gateway: GatewaySettings | None = None,
        on_gateway_error: Callable[[str], None] | None = None,
    ) -> None:
        """``sglang``/``choose``/``restart`` are the config's tables; ``config_dir`` is where
        adaptive configs go (the state dir; by default beside the env file). The rest is
        pacing, not configuration: how often to look for a quiet moment (the daemon's scrape
        interval), how often to probe health, how many verification reads to make.
        ``fleet``: the [fleet] slots every restart takes first (None: no fleet)."""
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
        self.config_dir = Path(sglang.env_file).parent if config_dir is None else config_dir
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
        self.fleet = fleet
        self._slot: Slot | None = None
        self._keeper: LeaseKeeper | None = None
        self._out: OutMarker | None = None
        # A marker a sequence's end could not remove (etcd away then): tried again by
        # `retry_mark_in` between sequences, so the group is not held up to its bound.
        self.unremoved_out: OutMarker | None = None
        # Whether etcd was asked once for a marker of this server that no sequence of this
        # run holds (a run before it ended before it could remove it): `retry_mark_in`.
        self.stale_out_checked = False
        self._stale_out_logged = False
        # The marker to look for was kept while a gateway replica left the worker out (its
        # removal is the expected end, not a leftover of an earlier run).
        self._out_kept_for_gateway = False
        self.out_bound_s = out_of_service_bound_s(restart, gateway, verify_attempts)
        self.gateway_settings = gateway
        self.gateway: GatewayClient | None = None
        if gateway is not None:
            self.gateway = GatewayClient.from_settings(
                gateway,
                sglang.url,
                pause=self._pause,
                on_error=on_gateway_error,
                poll_s=health_poll_interval_s,
                beat=self._beat,
            )
        self._drain_report: dict[str, Any] | None = None
        self._cancelled: Callable[[], str | None] = lambda: None

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        client: SGLangProbe,
        runner: Runner,
        persist: Callable[[dict[str, Any] | None], str | None],
        stop: threading.Event,
        **pacing: Any,
    ) -> Applier:
        """An applier for the whole config: quiet moments are looked for once per scrape,
        a loading SGLang and the gateway every [restart] health_poll_interval_s."""
        pacing.setdefault("quiet_poll_interval_s", settings.observe.scrape_interval_s)
        pacing.setdefault("health_poll_interval_s", settings.restart.health_poll_interval_s)
        pacing.setdefault("config_dir", settings.files.state_dir)
        pacing.setdefault("gateway", settings.gateway)
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
        cancelled: Callable[[], str | None] | None = None,
    ) -> ApplyOutcome:
        """Change SGLang to ``target`` steps (static); ``apply_setting`` of ``static(target)``.
        ``current`` 0 is no drafting (off); None is unknown."""
        try:
            wanted = static(target)
        except ValueError:
            return self._aborted(
                setting_of_steps(current),
                None,
                f"target {target} outside {self.choose.min_steps}..{self.choose.max_steps}",
                to_steps=target,
            )
        return self.apply_setting(
            wanted,
            setting_of_steps(current),
            window_open=window_open,
            force=force,
            cancelled=cancelled,
        )

    def apply_setting(
        self,
        target: SpecSetting,
        current: SpecSetting | None,
        *,
        window_open: Callable[[], bool],
        force: bool = False,
        cancelled: Callable[[], str | None] | None = None,
    ) -> ApplyOutcome:
        """Change SGLang to ``target`` (off, static K or adaptive). ``force`` ignores the
        window (override now). ``current`` None: what SGLang runs is unknown.
        ``cancelled()``: why the change is no longer wanted (an on-call freeze written
        since it began), asked by every wait before the restart, force or not."""
        self._restart_started = None
        self._journal = None
        self._drain_report = None
        self._out = None
        self._cancelled = cancelled or (lambda: None)
        try:
            outcome = self._apply(target, current, window_open, force)
        except ShuttingDown as down:
            # Raised only once a restart went out, so with a journal.
            if self._journal is None:
                outcome = self._aborted(current, target, down.why)
            else:
                outcome = self._leave_for_boot(self._journal, down.why)
        except Exception as exc:  # a bug must still leave SGLang and the env file consistent
            self.log.exception("apply_internal_error")
            if self._journal is None:
                outcome = self._aborted(current, target, f"internal error: {exc!r}")
            else:
                outcome = self._recover(self._journal, exc)
        # A no-op when the sequence's end released the slot. Not in a `finally`: a specd
        # dying (SystemExit, a test's kill) leaves the slot to its lease TTL. A sequence left
        # for the next boot keeps its server marked out of service: it is.
        self._release_slot(self._journal, keep_out=outcome.pending)
        return outcome

    def _out_of_range(self, target: SpecSetting) -> str | None:
        # The rule a pin and the policy are held to: a listed set may go past the range.
        low, high = self.choose.min_steps, self.choose.max_steps
        if not outside_steps(target, low, high, self.choose.adaptive_candidate_sets):
            return None
        return f"target {format_setting(target)} outside {low}..{high}"

    def _render(self, target: SpecSetting, previous: bytes | None) -> bytes:
        """The env file for ``target``. The algorithm comes from the config, else from the
        setting-form env file in place (specd or install wrote it), else from the running
        SGLang; a static target with none keeps the step-variable form, which a drop-in of
        that form reads. Raises
        ValueError (one line) when the target cannot be written."""
        if target.kind == "off":
            return render_setting_env(target, algorithm="", config_dir=self.config_dir).encode()
        # The config (install sets it), else the env file specd last wrote, else what the
        # running SGLang says it uses.
        algorithm = (
            self.sglang.speculative_algorithm
            or env_algorithm(previous)
            or self.client.live_algorithm
        )
        if algorithm is None:
            if target.kind == "static":
                assert target.steps is not None
                return render_env(target.steps).encode()
            raise ValueError(
                f"cannot write {format_setting(target)}: the speculative algorithm is unknown "
                "(set [sglang] speculative_algorithm, as `specd install` does)"
            )
        return render_setting_env(target, algorithm=algorithm, config_dir=self.config_dir).encode()

    def _apply(
        self,
        target: SpecSetting,
        current: SpecSetting | None,
        window_open: Callable[[], bool],
        force: bool,
    ) -> ApplyOutcome:
        problem = self._out_of_range(target)
        if problem is not None:
            return self._aborted(current, target, problem)
        if target == current:
            return self._aborted(current, target, f"SGLang already runs {_describe(target)}")
        # A unit that does not read the env file would restart on its own command: the change
        # would fail verification, and so would the rollback, for two restarts of nothing.
        unread = read_env_file_unread(self.runner, self.sglang.unit, self.sglang.env_file)
        if unread is not None:
            return self._aborted(current, target, unread)
        left_stopped = self._stopped_now()
        if left_stopped is not None:
            return self._aborted(current, target, left_stopped)
        # A pin applied now reads nothing of SGLang first: one that refuses specd's key
        # (--api-key) would be restarted, and its verification (/server_info) fail twice.
        info = self.client.server_info()
        if isinstance(info, ScrapeError) and info.kind == "api_key":
            return self._aborted(current, target, f"cannot verify a restart: {info.reason}")
        if target.kind != "static":
            # A pin reaches here whatever the unit can take: a unit reading the step
            # variables would start at the old K, fail verification and freeze specd.
            static_only = self.read_wiring()
            if static_only is not None:
                return self._aborted(current, target, static_only)

        # The window check below (window_open) counts the unit's real stop timeout.
        self.read_stop_timeout()
        if self.fleet is not None:
            not_taken = self._take_slot(current, target, window_open, force)
            if not_taken is not None:
                return not_taken
        # After the fleet's turn came, not before: a quiet moment seen before a long wait for
        # a slot says nothing about the load once the slot is ours. (Any abort from here on
        # releases the slot: apply_setting does.)
        if self.gateway is None:
            why_not = self._wait_quiet(window_open, force)
            if why_not is not None:
                return self._aborted(current, target, why_not)

        env_path = self.sglang.env_file
        try:
            previous = _read_env_bytes(env_path)
        except (OSError, ValueError) as exc:
            return self._aborted(current, target, f"cannot back up env file: {exc}")
        try:
            new_env = self._render(target, previous)
        except ValueError as exc:
            return self._aborted(current, target, str(exc))
        prev_text, prev_encoding = encode_env(previous)
        journal = Journal(
            phase="planned",
            from_steps=setting_steps(current),
            to_steps=setting_steps(target),
            unit=self.sglang.unit,
            env_file=str(env_path),
            previous_env=prev_text,
            previous_env_encoding=prev_encoding,
            started_at=self._clock(),
            from_setting=None if current is None else format_setting(current),
            to_setting=format_setting(target),
            written_env=new_env.decode(),
            fleet_slot=None if self._slot is None else self._slot.to_dict(),
        )
        journal.note(f"{_describe(current)} → {_describe(target)}")
        # Who wins over a file edited by hand: the change (the file's header says every
        # change overwrites it; a pin is the way to choose by hand). Said first; the journal
        # keeps the bytes, which a rollback puts back.
        edited = self._env_edited(previous)
        if edited is not None:
            journal.note(
                f"{env_path} asks for {edited[0]}, SGLang runs {edited[1]} (edited by hand "
                "since specd wrote it?): the change overwrites it"
            )
        self._journal = journal
        unsaved = self._persist(journal)
        if unsaved is not None:
            # The journal is what finishes or rolls back a restart after a crash, and what
            # keeps the freeze after a failed one: none starts without it on disk.
            self._journal = None
            return self._aborted(
                current, target, f"cannot save the restart journal ({unsaved}): no restart"
            )
        if edited is not None:
            self.log.warning(
                "env_file_edited",
                env_file=str(env_path),
                env_file_asks=edited[0],
                sglang_runs=edited[1],
                message="the change to "
                f"{_describe(target)} overwrites it; `specd override pin` chooses by hand",
            )
        if self.gateway is not None:
            stopped = self._drain(journal, self.gateway, window_open, force)
            if stopped is not None:
                return stopped
        return self._forward(journal, previous, new_env)

    def _backed_up_again(self, journal: Journal, now_env: bytes | None, new_env: bytes) -> None:
        """The env file changed while the worker drained: its new bytes become the backup
        (a rollback's), said as an edit before the change is (``env_file_edited``)."""
        journal.previous_env, journal.previous_env_encoding = encode_env(now_env)
        journal.written_env = new_env.decode()
        edited = self._env_edited(now_env)
        asks = "" if edited is None else f" (it asks for {edited[0]}, SGLang runs {edited[1]})"
        why = f"{self.sglang.env_file} edited while the worker drained{asks}: backed up again"
        journal.note(f"{why}; the change overwrites it")
        self.log.warning(
            "env_file_edited",
            env_file=str(self.sglang.env_file),
            message=f"{why}; the change to {_describe(journal.target())} overwrites it",
        )
        self._persist(journal)

    def _env_edited(self, previous: bytes | None) -> tuple[str, str] | None:
        """(what the env file asks for, what SGLang runs) when they differ, as `specd
        doctor` words them; None when they agree or either is unknown (no file, no setting
        in it, /server_info not read or lacking the step count). Adaptive sets count as one
        kind: /server_info may not name the config a set runs."""
        info = self.client.last_server_info
        words = None if previous is None else env_setting_words(previous)
        if words is None or not isinstance(info, dict):
            return None
        asks, runs = describe_args(words), describe_server(info)
        if asks == runs or "?" in (asks + runs):  # "? steps": a field SGLang did not give
            return None
        if asks.startswith("adaptive") and runs.startswith("adaptive"):
            return None
        return asks, runs

    def reconcile(self, journal_data: Mapping[str, Any] | None) -> ApplyOutcome | None:
        """Finish a sequence a previous specd left unfinished (it was killed)."""
        if journal_data is None:
            return None
        self._restart_started = None
        self._drain_report = None
        self._out = None
        try:
            journal = Journal.from_dict(journal_data)
        except JournalError as exc:
            return self._reconcile_unreadable(journal_data, str(exc))
        if journal.phase in TERMINAL_RESULTS:
            message = journal.messages[-1] if journal.messages else journal.phase
            self._release_slot(journal)  # killed between the end and the release
            return self._outcome_from(journal, TERMINAL_RESULTS[journal.phase], message)
        if Path(journal.env_file) != Path(self.sglang.env_file):
            # Paths come from the config only: a journal (state.json) naming another file
            # must not make specd overwrite or delete it.
            return self._reconcile_unreadable(
                journal_data,
                f"restart journal names env file {journal.env_file!r}, not the configured "
                f"{str(self.sglang.env_file)!r}; not acting on it",
            )
        if journal.unit != self.sglang.unit:
            # Nor one naming another unit: its previous env file is that unit's, and this
            # unit was never restarted by it (a reinstall for another unit, the state
            # carried along).
            return self._reconcile_unreadable(
                journal_data,
                f"restart journal names unit {journal.unit!r}, not the configured "
                f"{self.sglang.unit!r}; not acting on it",
            )
        try:
            self._reattach_slot(journal)
            self._reattach_out(journal)
            outcome = self._resume(journal)
        except ShuttingDown as down:
            outcome = self._leave_for_boot(journal, down.why)
        except Exception as exc:
            self.log.exception("reconcile_internal_error")
            outcome = self._recover(journal, exc)
        self._release_slot(journal, keep_out=outcome.pending)
        return outcome

    def _recover(self, journal: Journal, exc: Exception) -> ApplyOutcome:
        reason = f"internal error: {exc!r}"
        try:
            return self._rollback(journal, reason, maybe_untouched=True)
        except Exception as again:
            self.log.exception("rollback_internal_error")
            problem = self._restore_env(journal)
            restored = "env file restored" if problem is None else f"env file: {problem}"
            readd = self._readd(journal)
            readded = "" if readd is None else f"; {readd}"
            return ApplyOutcome(
                "failed",
                journal.from_steps,
                journal.to_steps,
                0.0,
                f"{reason}; rollback failed too: {again!r}; {restored}{readded}",
                None,
                journal.restarts_issued,
                journal.from_setting,
                journal.to_setting,
                self._drain_report,
                journal.not_started,
            )

    # -- forward --------------------------------------------------------------------
    def _forward(self, journal: Journal, previous: bytes | None, new_env: bytes) -> ApplyOutcome:
        lost = self._halted("before the restart went out") or self._slot_lost()
        if lost is not None:
            return self._finish(journal, "aborted", f"{lost}; nothing was restarted")
        target = journal.target()
        if self.gateway is not None:
            # The drain may have taken minutes: an edit of the file by hand meanwhile is
            # what a rollback puts back, as one made before the change began.
            try:
                now_env = _read_env_bytes(self.sglang.env_file)
                if now_env != previous:
                    new_env = self._render(target, now_env)
            except (OSError, ValueError) as exc:
                return self._finish(
                    journal,
                    "aborted",
                    f"cannot back up env file again: {exc}; nothing was restarted",
                )
            if now_env != previous:
                self._backed_up_again(journal, now_env, new_env)
                previous = now_env
        if target.kind == "adaptive":
            # Before the env file names it: SGLang must never start on a half-written or
            # missing config. Content-addressed, so a config in use is never rewritten.
            try:
                path = write_adaptive_config(target, self.config_dir)
            except OSError as exc:
                return self._env_write_failed(journal, exc, what="the adaptive config")
            journal.note(f"wrote {path}")
        if new_env != previous:
            try:
                files.write_atomic(self.sglang.env_file, new_env, mode=ENV_FILE_MODE)
            except OSError as exc:
                return self._env_write_failed(journal, exc)
        self._set_phase(journal, "env_written", f"wrote {self.sglang.env_file}")
        # The last look before the restart: a stop (or freeze) that came during the slot
        # check or the writes above still ends the change with nothing restarted.
        halted = self._halted("before the restart went out") or self._stopped_now()
        if halted is not None:
            return self._unwind(journal, halted)
        if self.gateway is not None:
            routed = self._still_routed()
            if routed is not None:
                return self._unwind(journal, routed)
        if self.gateway is None:
            # Without a drain the restart itself takes the server out of service.
            unmarked = self._mark_out(journal)
            if unmarked is not None:
                return self._unwind(journal, unmarked)

        unsaved = self._issue_restart(journal, "restart_issued")
        if unsaved is not None:
            # A journal on disk that does not say the restart may have gone out would make a
            # specd killed while SGLang loads put the previous env file back and call the
            # change aborted, with SGLang on the new setting, unverified: no restart.
            journal.restarts_issued -= 1
            journal.restart_issued_at = None
            self._restart_started = None
            journal.phase = "env_written"
            return self._unwind(journal, f"cannot save the restart journal ({unsaved})")
        # Why systemd may refuse it, if it does, the rollback's own restart says.
        restarted = self._restart_unit(journal, rollback=False)
        result = restarted.result
        if restarted.start_limit:
            # Refused before the new setting ran: no evidence against it. Back to the
            # previous setting (systemd stopped SGLang first), and the change is aborted.
            journal.change_refused = True
            journal.not_started += 1
            return self._rollback(
                journal,
                f"{result.summary()}: the unit's start limit, used up before this change, "
                f"refused its start; {_describe(journal.target())} was never tried"
                f"{restarted.refused}",
                maybe_untouched=True,
            )
        if not result.ok:
            self._refused_by_shutdown(journal, result)
            # A unit whose start job waits for the exec (Type=exec, notify) fails the
            # command itself when systemd's setup of the process does.
            state = unit_state(self.runner, self.sglang.unit, UNIT_STATE_TIMEOUT_S)
            setup = None if state is None else state.setup_failure
            if setup is not None:
                return self._never_ran(journal, _Health(False, self._setup_text(setup), setup))
            # A failed `systemctl` may have changed nothing (not found, access denied):
            # then the old server still runs and the rollback needs no restart.
            return self._rollback(journal, result.summary(), maybe_untouched=True)
        journal.note(result.summary())
        return self._verify_forward(journal)

    def _verify_forward(self, journal: Journal) -> ApplyOutcome:
        health = self._wait_healthy()
        if health.stopped:
            return self._left_stopped(journal, health)
        if not health.ok:
            return self._never_ran(journal, health)
        self._set_phase(journal, "verifying", health.why)
        live = self._verify(journal.target())
        if not live.ok:
            return self._rollback(journal, live.message, maybe_untouched=False)
        journal.capacity = live.capacity
        return self._finish(journal, "done", live.message)

    def _left_stopped(self, journal: Journal, health: _Health, when: str = "") -> ApplyOutcome:
        """SGLang stopped outside specd while it started the target: left stopped (a
        rollback would start it), the previous env file put back so that whoever starts it
        again gets the previous setting, and the change aborted: nothing says the target
        cannot run, so no freeze."""
        problem = self._restore_env(journal)
        if problem is not None:
            return self._finish(
                journal,
                "failed",
                f"{when}{health.why}; restoring {self.sglang.env_file} failed: {problem}",
            )
        journal.no_verdict = True
        previous = _describe(journal.previous())
        return self._finish(
            journal,
            "aborted",
            f"{when}{health.why}: left stopped, not started again; {self.sglang.env_file} "
            f"holds {previous} again (`systemctl start {self.sglang.unit}` starts {previous})",
        )

    def _never_ran(self, journal: Journal, health: _Health, when: str = "") -> ApplyOutcome:
        """The change's start did not get healthy: rolled back, and held against the target
        unless systemd's own setup of the process failed, before SGLang ran (a cgroup, a
        working directory, the exec): then nothing says the target cannot run, and, like a
        start the unit's start limit refused, the change ends aborted once the previous
        setting is back, verified (not frozen; a rollback that fails too still freezes)."""
        if health.setup is None:
            return self._rollback(journal, f"{when}{health.why}", maybe_untouched=False)
        journal.setup_failed = health.setup
        journal.not_started += 1  # no SGLang ran: what the daily restart budget counts
        reason = f"{when}{health.why}; {_describe(journal.target())} was never tried"
        self.log.warning(
            "restart_setup_failed",
            unit=self.sglang.unit,
            status=health.setup,
            to_setting=journal.to_setting,
            message=reason,
        )
        return self._rollback(journal, reason, maybe_untouched=False)

    def _setup_text(self, setup: str) -> str:
        return (
            f"systemd could not start {self.sglang.unit}'s process "
            f"(status {setup}: its own setup, before SGLang ran)"
        )

    def _env_write_failed(
        self, journal: Journal, exc: OSError, what: str | None = None
    ) -> ApplyOutcome:
        return self._unwind(journal, f"writing {what or self.sglang.env_file} failed: {exc}")

    def _unwind(self, journal: Journal, problem: str) -> ApplyOutcome:
        # Nothing was restarted; only make sure the file is what it was.
        restored = self._restore_env(journal)
        if restored is not None:
            journal.note(problem)
            return self._finish(
                journal, "failed", f"{problem}; restoring {self.sglang.env_file} failed: {restored}"
            )
        return self._finish(journal, "aborted", f"{problem}; nothing was restarted")

    # -- rollback -------------------------------------------------------------------
    def _rollback(self, journal: Journal, reason: str, *, maybe_untouched: bool) -> ApplyOutcome:
        """Restore the previous env file and get SGLang verified on the previous steps.

        ``maybe_untouched``: the change may never have reached SGLang (the restart command
        failed, or specd died around it); if SGLang is healthy on the old steps, restoring
        the file is enough and a restart would only cost minutes of serving.
        """
        self.log.warning(
            "restart_rolling_back",
            reason=reason,
            to_steps=journal.to_steps,
            to_setting=journal.to_setting,
        )
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

        # Without the previous setting there is no telling the old server from the new one.
        if (
            maybe_untouched
            and journal.previous() is not None
            and self.client.health_generate(self._probe_timeout(None)) is HealthStatus.OK
        ):
            live = self._verify(journal.previous())
            if live.ok:
                journal.capacity = live.capacity
                if journal.restarts_issued == 1:
                    journal.not_started = 1  # the change's restart reached nothing
                return self._finish(
                    journal,
                    self._backed_out(journal),
                    f"{reason}; SGLang kept {live.message}, no restart",
                )

        if journal.restarts_issued < 2:
            self._issue_restart(journal, "rolling_back")
            return self._rollback_restart(journal, reason)
        return self._verify_rollback(journal, reason)

    def _rollback_restart(self, journal: Journal, reason: str) -> ApplyOutcome:
        """The rollback's restart (journalled as issued), then its verification."""
        restarted = self._restart_unit(journal, rollback=True)
        if not restarted.result.ok:
            self._refused_by_shutdown(journal, restarted.result)
            return self._finish(
                journal,
                "failed",
                f"{reason}; rollback restart: {restarted.result.summary()}{restarted.refused}",
            )
        journal.note(f"rollback: {restarted.result.summary()}")
        return self._verify_rollback(journal, reason)

    @staticmethod
    def _backed_out(journal: Journal) -> Literal["rolled_back", "aborted"]:
        """How a sequence back on its previous setting ends: rolled back (the target failed),
        or aborted where the target never ran (the start limit refused the change's start,
        systemd's setup of its process failed) or its load was cut short."""
        never_ran = journal.change_refused or journal.setup_failed is not None
        return "aborted" if never_ran or journal.no_verdict else "rolled_back"

    def _verify_rollback(self, journal: Journal, reason: str) -> ApplyOutcome:
        health = self._wait_healthy()
        if health.stopped:
            # The env file is back; what the target did stands (``reason``).
            return self._finish(
                journal,
                self._backed_out(journal),
                f"{reason}; after rollback {health.why}: left stopped, not started again",
            )
        if not health.ok:
            return self._finish(journal, "failed", f"{reason}; after rollback {health.why}")
        live = self._verify(journal.previous())
        if not live.ok:
            return self._finish(journal, "failed", f"{reason}; after rollback {live.message}")
        journal.capacity = live.capacity
        return self._finish(
            journal, self._backed_out(journal), f"{reason}; rolled back, {live.message}"
        )

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

        if journal.shutdown is not None:
            return self._resume_after_shutdown(journal)
        if journal.phase in ("planned", "draining", "env_written"):
            # No restart was issued: SGLang never saw the new file. Undo the file only.
            problem = self._restore_env(journal)
            if problem is not None:
                return self._finish(journal, "failed", f"restoring the env file failed: {problem}")
            return self._finish(
                journal, "aborted", f"interrupted in {journal.phase}; env file restored"
            )
        if journal.phase == "restart_issued" and self._never_went_out(journal):
            # Killed between journalling the change's restart and issuing it: SGLang was
            # never restarted, and the target never ran. Nothing to hold against it.
            journal.restarts_issued -= 1
            return self._unwind(
                journal, "specd was killed after journalling the restart, before it went out"
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
            if journal.refused_until is not None:
                # Killed while it waited out the unit's start limit: SGLang is down, its
                # rollback restart refused. Clear the limit (specd may by now), else wait
                # what is left of it, then restart.
                journal.note("its restart was refused for the unit's start limit: trying again")
                self._persist(journal)
                return self._rollback_restart(journal, reason)
            if self._never_went_out(journal):
                # Killed between journalling the rollback's restart and issuing it: waiting
                # for it would wait for nothing, and end "failed" with SGLang down.
                journal.note("its rollback restart never went out: issuing it now")
                journal.restarts_issued -= 1
                self._issue_restart(journal, "rolling_back")
                return self._rollback_restart(journal, reason)
            return self._verify_rollback(journal, reason)
        return self._rollback(journal, reason, maybe_untouched=True)

    def _resume_after_shutdown(self, journal: Journal) -> ApplyOutcome:
        """The first start after a shutdown that came mid-sequence (`_leave_for_boot`):
        SGLang was started at boot on the previous setting, and may still be loading. Wait
        for it and verify; only an SGLang that does not come up on it (no shutdown came
        after all, its start failed) is restarted, as a rollback."""
        reason = journal.shutdown or "the system shut down mid-restart"
        problem = self._restore_env(journal)
        if problem is not None:
            return self._finish(
                journal, "failed", f"{reason}; restoring the env file failed: {problem}"
            )
        health = self._wait_healthy()
        why = health.why
        if health.stopped:
            # Not started at boot (not enabled), or stopped since: left so.
            return self._finish(
                journal,
                self._backed_out(journal),
                f"{reason}; since then, {why}: left stopped, not started again; "
                f"{self.sglang.env_file} holds {_describe(journal.previous())}",
            )
        if health.ok:
            live = self._verify(journal.previous())
            if live.ok:
                journal.capacity = live.capacity
                return self._finish(
                    journal, self._backed_out(journal), f"{reason}; since then, {live.message}"
                )
            why = live.message
        reason = f"{reason}; since then, {why}"
        journal.rollback_reason = journal.rollback_reason or reason
        journal.note(reason)
        self._issue_restart(journal, "rolling_back")
        return self._rollback_restart(journal, reason)

    def _resume_forward(self, journal: Journal) -> ApplyOutcome:
        # The restart may be under way (SGLang loading); restarting again would throw that
        # load away. Wait for it, then look at what runs.
        health = self._wait_healthy()
        if health.stopped:
            return self._left_stopped(journal, health, when="after specd restarted: ")
        if not health.ok:
            return self._never_ran(journal, health, when="after specd restarted: ")
        env_problem = self._env_not_target(journal)
        live = self._verify(journal.target())
        if live.ok and env_problem is None:
            journal.capacity = live.capacity
            self._set_phase(journal, "verifying", "healthy after specd restarted")
            return self._finish(journal, "done", live.message)
        reason = live.message if not live.ok else (env_problem or "")
        return self._rollback(journal, f"after specd restarted: {reason}", maybe_untouched=True)

    def _env_not_target(self, journal: Journal) -> str | None:
        """Why the env file no longer asks for the target (None: it does). A journal from
        before ``written_env`` is compared by step count, as then."""
        if journal.written_env is None:
            env_steps = read_env_steps(self.sglang.env_file)
            return None if env_steps == journal.to_steps else f"env file says {env_steps}"
        try:
            current = _read_env_bytes(self.sglang.env_file)
        except (OSError, ValueError) as exc:
            return f"env file unreadable: {exc}"
        if current != journal.written_env.encode():
            return f"env file no longer asks for {_describe(journal.target())}"
        return None

    def _reconcile_unreadable(self, data: Any, problem: str) -> ApplyOutcome:
        # Without a trustworthy journal the previous env file is unknown: leave files and
        # SGLang alone and report a failure so the daemon freezes for an operator.
        to_steps = _steps_or_none(data.get("to_steps")) if isinstance(data, Mapping) else None
        from_steps = _steps_or_none(data.get("from_steps")) if isinstance(data, Mapping) else None
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
            halted = self._halted("while waiting for a quiet moment")
            if halted is not None:
                return halted
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

    def _wait_healthy(self) -> _Health:
        """Probe /health_generate until OK, the unit failed, or startup_timeout_s passes.

        Runs after a restart went out, so a stop request does not cut it short: leaving now
        would leave SGLang half-changed. It stays bounded, and keeps calling ``stop.wait``
        so a heartbeat-counting event still sees the loop alive.
        """
        deadline = self._mono() + self.restart.startup_timeout_s
        # Restart= counts its starts: one more than now is SGLang dying while it starts.
        before = unit_state(self.runner, self.sglang.unit, UNIT_STATE_TIMEOUT_S)
        while True:
            status = self.client.health_generate(self._probe_timeout(deadline))
            if status is HealthStatus.OK:
                return _Health(True, "/health_generate OK")
            if self._stop.is_set():
                # Asked to stop while SGLang loads: by the system's shutdown, the load is
                # thrown away (SGLang's own stop waits only for specd's), and what fails
                # meanwhile may be the shutdown's doing. Looked at before any verdict.
                self._leave_if_shutting_down()
            # An SGLang that crashed while loading (out of memory with more draft tokens)
            # will not get healthy: no need to wait out a startup timeout of minutes.
            failed = self._start_failed(before, status)
            if failed is not None:
                return failed
            left = deadline - self._mono()
            if left <= 0:
                return _Health(
                    False,
                    f"not healthy within {self.restart.startup_timeout_s:g} s "
                    f"(last /health_generate: {status.name})",
                )
            self._pause(min(self.health_poll_interval_s, left))

    # -- the system's shutdown --------------------------------------------------------
    def _shutting_down(self) -> str | None:
        """Why the system looks to be shutting down, or None: systemd says "stopping", or
        cannot be reached over the system bus any more. Only with specd asked to stop is
        that taken for a shutdown (the bus may go before specd's SIGTERM comes, or, on a
        running system, hiccup). Read-only; a stand-in that refuses the command is none."""
        result = self.runner(system_state_argv(), timeout_s=UNIT_STATE_TIMEOUT_S)
        words = result.stdout.split()
        state = words[-1] if words else ""
        if state == "stopping":
            return "the system is shutting down (`systemctl is-system-running`: stopping)"
        if state in ("", "unknown") and any(gone in result.stderr for gone in BUS_GONE):
            said = result.stderr.strip().splitlines()[0]
            return (
                "the system is shutting down (specd asked to stop, and systemd gone from the "
                f"system bus: {said})"
            )
        return None

    def _leave_if_shutting_down(self) -> None:
        """Once a stop is asked for: leave the sequence if the system shuts down."""
        why = self._shutting_down() if self._stop.is_set() else None
        if why is not None:
            raise ShuttingDown(why)

    def _refused_by_shutdown(self, journal: Journal, result: RunResult) -> None:
        """A restart command that failed while the system shuts down (systemd refuses jobs
        that would undo the shutdown's, or is off the bus) started nothing: the sequence is
        left for specd's next start. systemd stops specd as soon as the shutdown begins,
        so a shutdown seen before specd's SIGTERM is waited on for that, briefly."""
        why = self._shutting_down()
        if why is None:
            return
        if not self._stop.is_set():
            self._stop.wait(SHUTDOWN_STOP_WAIT_S)
            if not self._stop.is_set():
                return
        journal.not_started += 1
        raise ShuttingDown(f"{why}: {result.summary()}")

    def _pause_unless_shutting_down(self, seconds: float, journal: Journal) -> None:
        """``_pause``, looking (once a stop is asked for) whether the system shuts down: a
        wait for the unit's start limit to pass would only hold up the reboot, and the
        restart after it be refused. The restart refused before it started nothing."""
        end = self._mono() + seconds
        while (left := end - self._mono()) > 0:
            self._pause(min(left, self.health_poll_interval_s))
            why = self._shutting_down() if self._stop.is_set() else None
            if why is not None:
                journal.not_started += 1
                raise ShuttingDown(why)

    def _leave_for_boot(self, journal: Journal, why: str) -> ApplyOutcome:
        """The system shuts down with a restart in flight. Waiting on would hold up the
        shutdown for a load it throws away (SGLang is stopped once specd is), and a
        rollback's restart would be refused: put the env file back on the previous setting,
        which SGLang starts on at boot, and leave the journal for specd's next start, which
        verifies it there (nothing frozen, nothing held against an untried target). A
        drained worker stays out of routing until then."""
        problem = self._restore_env(journal)
        journal.refused_until = None
        previous = _describe(journal.previous())
        if problem is None:
            if journal.shutdown is None:  # a second shutdown (mid-replay) changes no verdict
                journal.no_verdict = journal.rollback_reason is None
            journal.shutdown = why
            # This start left cleanly: MAX_ATTEMPTS counts starts killed mid-sequence (a
            # crash loop), not reboots, of which a third gave up "failed" and froze specd
            # though SGLang booted healthy on the previous setting each time.
            journal.attempt = 0
            message = (
                f"{why}: {self.sglang.env_file} back on {previous}, which {journal.unit} "
                "starts on at boot; specd's next start verifies it"
            )
        else:
            # Left as a kill leaves it: the next start verifies what SGLang boots on.
            message = (
                f"{why}: restoring {self.sglang.env_file} failed ({problem}); specd's next "
                f"start verifies what {journal.unit} boots on"
            )
        journal.note(message)
        self._persist(journal)
        self.log.warning(
            "restart_left_for_next_start",
            phase=journal.phase,
            from_setting=journal.from_setting,
            to_setting=journal.to_setting,
            message=message,
        )
        outcome = self._outcome_from(journal, "aborted", message)
        return replace(outcome, pending=True)

    def stop_timeout_s(self) -> float:
        """How long systemd lets the unit stop (TimeoutStopSec=), as last read at a restart;
        systemd's default until then (specd forks nothing between restarts)."""
        return DEFAULT_STOP_TIMEOUT_S if self._stop_timeout_s is None else self._stop_timeout_s

    def read_stop_timeout(self) -> None:
        """Read the unit's TimeoutStopSec= (once per applier); an infinite one counts as the
        restart command's own timeout, which bounds a stop in practice."""
        if self._stop_timeout_s is not None:
            return
        self._stop_timeout_s = read_stop_timeout_s(
            self.runner, self.sglang.unit, self.restart.restart_command_timeout_s
        )

    def read_wiring(self) -> str | None:
        """Why the unit can be given static step counts only (`read_static_only`)."""
        return read_static_only(self.runner, self.sglang.unit)

    def _start_failed(self, before: UnitState | None, last: HealthStatus) -> _Health | None:
        """The unhealthy verdict where systemd says the unit's start failed (``last``: the
        last /health_generate answer, for the message), or None: any doubt means keep
        waiting. Under Restart= a start that dies never leaves the unit failed: it is
        "activating" again and again (SubState auto-restart between starts, NRestarts one
        more each time)."""

        def died(detail: str) -> _Health:
            return _Health(
                False,
                f"{self.sglang.unit} failed while starting "
                f"({detail}last /health_generate: {last.name})",
            )

        now = unit_state(self.runner, self.sglang.unit, UNIT_STATE_TIMEOUT_S)
        if now is None:
            # systemd cannot say more (or a stand-in does not): is-active alone.
            result = self.runner(unit_state_argv(self.sglang.unit), timeout_s=UNIT_STATE_TIMEOUT_S)
            said = result.stdout.strip()
            if said == "inactive":
                return self._stopped(last)
            return died("") if said == "failed" else None
        if now.stopped:
            return self._stopped(last)
        restarted = (
            0
            if before is None or before.restarts is None or now.restarts is None
            else now.restarts - before.restarts
        )
        # The change's own start only: one Restart= made since may follow a crash of SGLang
        # (evidence against the setting), and it resets the status. Either way the death is
        # taken for SGLang's own (rolled back, frozen), as it always was.
        setup = now.setup_failure
        dead = now.active == "failed" or now.sub == "auto-restart"
        if setup is not None and restarted == 0 and dead:
            return _Health(False, self._setup_text(setup), setup)
        if now.active == "failed":
            # systemd 252 keeps the crash's Result= (exit-code) when its start limit stops
            # Restart=: that the unit was restarted before it ended failed is the sign.
            if restarted > 0:
                return died(
                    f"it died, Restart= started it again {restarted}x, then gave up "
                    "(the unit's start limit); "
                )
            return died("")
        if restarted > 0:
            return died(f"it died, and Restart= started it again {restarted}x; ")
        if now.sub == "auto-restart":
            return died("it died, and Restart= starts it again; ")
        return None

    def _never_went_out(self, journal: Journal) -> bool:
        """The restart journalled last never reached systemd: the unit has not started
        since (the InvocationID the journal took is still its own) and none is queued. False
        where either is not known (a stand-in for systemd, a journal from before)."""
        if journal.issued_from is None:
            return False
        state = unit_state(self.runner, journal.unit, UNIT_STATE_TIMEOUT_S)
        return (
            state is not None
            and state.invocation == journal.issued_from
            and not state.job
            and state.active not in ("activating", "deactivating", "reloading")
        )

    def _is_stopped(self) -> bool:
        """The unit inactive with no job queued (`UnitState.stopped`); where systemd says
        no more, `systemctl is-active` saying inactive."""
        state = unit_state(self.runner, self.sglang.unit, UNIT_STATE_TIMEOUT_S)
        if state is not None:
            return state.stopped
        result = self.runner(unit_state_argv(self.sglang.unit), timeout_s=UNIT_STATE_TIMEOUT_S)
        return result.stdout.strip() == "inactive"

    def _stopped_now(self) -> str | None:
        """Why no restart may go out where the unit is stopped (inactive, no start queued),
        else None: `systemctl restart` would start a server someone stopped (a pin applied
        now needs no fresh reading of SGLang, so it reaches here with SGLang down)."""
        if not self._is_stopped():
            return None
        return (
            f"{self.sglang.unit} is stopped (inactive, no start queued): specd starts no "
            f"server someone stopped; `systemctl start {self.sglang.unit}` first"
        )

    def _stopped(self, last: HealthStatus) -> _Health | None:
        """The verdict where the unit is stopped and stays so (read again
        ``STOPPED_RECHECK_S`` later: a restart passes through inactive with its start
        queued, a boot before the unit's turn too): stopped outside specd, an on-call's
        `systemctl stop` (GPU trouble, say), which specd must never undo by starting it.
        None while it is not; ShuttingDown where the system's shutdown stopped it."""
        self._pause(STOPPED_RECHECK_S)
        if not self._is_stopped():
            return None
        shutdown = self._shutting_down()
        if shutdown is not None:
            if not self._stop.is_set():
                self._stop.wait(SHUTDOWN_STOP_WAIT_S)
            if self._stop.is_set():
                raise ShuttingDown(shutdown)
        return _Health(
            False,
            f"{self.sglang.unit} was stopped outside specd (inactive, no start queued; last "
            f"/health_generate: {last.name})",
            stopped=True,
        )

    def _probe_timeout(self, deadline: float | None) -> float:
        timeout = self.restart.health_probe_timeout_s
        if deadline is None:
            return timeout
        # The last probe may not overrun the deadline by a whole probe timeout.
        return max(0.5, min(timeout, deadline - self._mono()))

    def _beat(self) -> None:
        # A wait of no time on the daemon's stop event is its heartbeat.
        self._stop.wait(0)

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
    def _verify(self, expected: SpecSetting | None) -> _Live:
        """Does SGLang run ``expected``? Reads capacity too."""
        last = _Live(False, "no verification read")
        for attempt in range(self.verify_attempts):
            if attempt:
                self._pause(self.health_poll_interval_s)
            if expected is None or expected.kind == "static":
                last = self._read_live(None if expected is None else expected.steps)
            else:
                last = self._read_live_kind(expected)
            if last.ok or last.mismatch:
                return last
        return last

    def _read_live_kind(self, expected: SpecSetting) -> _Live:
        """Off or adaptive: /server_info must say which (``mismatch``), and the live
        ``sglang:spec_num_steps`` must be a step count the setting runs."""
        info = self.client.server_info()
        obs = self.client.observe()
        page = self.client.last_page if isinstance(obs, Observation) else None
        capacity = _capacity_from_info(info) if isinstance(info, dict) else None
        if isinstance(obs, Observation) and obs.max_running_requests is not None:
            capacity = obs.max_running_requests
        if isinstance(info, ScrapeError):
            return _Live(False, f"cannot verify {_describe(expected)}: {info.reason}")
        key = "speculative_algorithm" if expected.kind == "off" else "speculative_adaptive"
        if key not in info:
            return _Live(False, f"cannot verify {_describe(expected)}: /server_info lacks {key}")
        live_steps = None if page is None else page.steps
        # 0 is also a gauge not yet set; it counts only where the setting can run 0.
        if live_steps == 0 and expected.kind == "adaptive" and not expected.uses_slot_zero:
            live_steps = None
        wrong = mismatch(expected, info, live_steps)
        if wrong is not None:
            return _Live(False, "SGLang runs something else: " + wrong, capacity, mismatch=True)
        seen = [f"/server_info {key}={json.dumps(info.get(key))}"]
        if live_steps is not None:
            seen.append(f"metrics steps={live_steps}")
        return _Live(True, f"verified {_describe(expected)} ({', '.join(seen)})", capacity)

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
            if expected is not None and info.get("speculative_adaptive") is True:
                # SGLang switching among candidates is not the static count asked for.
                wrong.append(f"{info_source} speculative_adaptive=true")
            if expected is not None and info.get("speculative_algorithm", "x") in (None, ""):
                wrong.append("no speculative algorithm")
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

    # -- the restart command, through systemd's start limit ---------------------------
    def _restart_unit(self, journal: Journal, *, rollback: bool) -> _Restarted:
        """`systemctl restart` the unit: its result, and why systemd refuses to start the
        unit ("" when that is not the case, or not known).

        A setting SGLang cannot start at, under Restart=, uses up the unit's start limit
        (StartLimitBurst= starts in StartLimitIntervalSec=; 5 in 10 s by default): systemd
        leaves the unit failed and refuses every start, the rollback's too, until the
        interval has passed or `systemctl reset-failed`. systemd 252 does not say so (the
        unit's Result= stays the crash's exit-code), and the rollback's own start may be the
        one over the limit; so the failed state and the start count are cleared before every
        rollback restart, and before a change's when the unit is failed. Where that is
        refused (a polkit rule from before specd did it), a rollback whose restart leaves
        the unit failed waits for the limit's interval to pass, if it is no longer than
        startup_timeout_s, and restarts once more (``journal.refused_until`` says until when,
        for a specd killed meanwhile: ``refused_until`` given, only what is left of it).

        The limit may also be used up by starts before a change (an earlier crash loop, an
        operator's restarts): systemd then stops the active unit and refuses the change's
        start (Result=start-limit-hit). That says nothing of the new setting, which never
        ran: the count is cleared and the restart made again; where specd may not clear it,
        ``start_limit`` tells the caller to back out.
        """
        unit = self.sglang.unit
        # A restart is about to go out: a specd killed once it has must not make another
        # (SGLang may be loading), so the journal stops saying it waits.
        until, journal.refused_until = journal.refused_until, None
        if until is not None:
            self._persist(journal)
        state = unit_state(self.runner, unit, UNIT_STATE_TIMEOUT_S)
        # None: no systemd answers (a stand-in): it has no start limit to clear either.
        cleared = None
        if state is not None and (rollback or state.active == "failed"):
            cleared = self._reset_failed(journal, state)
        result = self._run_restart()
        if result.ok:
            return _Restarted(result)
        if not rollback and cleared is None:
            return self._refused_change(journal, result)
        if cleared is not False:
            return _Restarted(result)
        now = unit_state(self.runner, unit, UNIT_STATE_TIMEOUT_S)
        limit = start_limit(self.runner, unit, UNIT_STATE_TIMEOUT_S)
        if now is None or now.active != "failed" or limit is None:
            return _Restarted(result)
        refused = self._refused_text(limit)
        full_s = limit.interval_s + START_LIMIT_MARGIN_S
        if not rollback or full_s > self.restart.startup_timeout_s:
            return _Restarted(result, refused)
        # systemd counts the limit's interval from the first start it counts, which a
        # refused start does not move: a full interval from now always outlasts it. A specd
        # killed while it waited waits only what was left (unless its clock says that has
        # passed, and systemd still refuses).
        left = None if until is None else until - self._clock()
        wait_s = left if left is not None and 0 < left <= full_s else full_s
        journal.refused_until = self._clock() + wait_s
        journal.note(
            f"{result.summary()}{refused}; waiting {wait_s:g} s for the limit to pass, then "
            "restarting once more"
        )
        self._persist(journal)
        self.log.warning(
            "restart_waits_for_start_limit",
            unit=unit,
            wait_s=wait_s,
            start_limit_burst=limit.burst,
            start_limit_interval_s=limit.interval_s,
            refused=result.summary(),
        )
        self._pause_unless_shutting_down(wait_s, journal)
        # Persisted before it goes out: a specd killed from here on finds a restart issued,
        # and waits for SGLang rather than restart it again.
        journal.refused_until = None
        journal.note("the start limit's interval has passed: restarting once more")
        self._persist(journal)
        again = self._run_restart()
        return _Restarted(again, "" if again.ok else refused)

    def _refused_change(self, journal: Journal, result: RunResult) -> _Restarted:
        """The change's restart of a unit that was not failed did not go through: if
        systemd's start limit refused it, clear the count and restart once more."""
        unit = self.sglang.unit
        now = unit_state(self.runner, unit, UNIT_STATE_TIMEOUT_S)
        if now is None or now.active != "failed" or now.result != START_LIMIT_HIT:
            return _Restarted(result)
        limit = start_limit(self.runner, unit, UNIT_STATE_TIMEOUT_S)
        described = "" if limit is None else f" ({_limit_text(limit)})"
        self.log.warning(
            "restart_refused_by_start_limit",
            unit=unit,
            refused=result.summary(),
            message=f"systemd refused to start {unit}: its start limit{described} was used "
            f"up by starts before this change; not the fault of {_describe(journal.target())}"
            ", which never ran",
        )
        journal.note(
            f"{result.summary()}: the unit's start limit{described}, used up before this "
            "change, refused its start"
        )
        if self._reset_failed(journal, now):
            again = self._run_restart()
            journal.note(f"restarting once more: {again.summary()}")
            # Refused again, it is no longer the limit's doing: the rollback says what it is.
            return _Restarted(again)
        return _Restarted(
            result, "" if limit is None else self._refused_text(limit), start_limit=True
        )

    def _refused_text(self, limit: StartLimit) -> str:
        unit = self.sglang.unit
        return (
            f"; systemd may refuse to start {unit} until its start limit "
            f"({_limit_text(limit)}) has passed, "
            f"and specd may not clear it: run `specd install --unit {unit}` (its polkit rule "
            f"allows `{' '.join(reset_failed_argv(unit))}`), or that and `systemctl restart "
            f"{unit}` by hand"
        )

    def _run_restart(self) -> RunResult:
        return self.runner(
            restart_argv(self.sglang.unit), timeout_s=self.restart.restart_command_timeout_s
        )

    def _reset_failed(self, journal: Journal, state: UnitState) -> bool:
        """`systemctl reset-failed` the unit (its failed state, its start count); whether
        systemd did. A refusal is noted and logged; the restart goes ahead all the same."""
        unit = self.sglang.unit
        result = self.runner(reset_failed_argv(unit), timeout_s=UNIT_STATE_TIMEOUT_S)
        was = state.active if state.sub in ("", state.active) else f"{state.active} ({state.sub})"
        if result.ok:
            journal.note(
                f"{unit} was {was}: cleared its failed state and start count "
                f"(`{' '.join(reset_failed_argv(unit))}`)"
            )
            self.log.info("unit_reset_failed", unit=unit, was=was)
        else:
            journal.note(f"{unit} was {was}; clearing its start count: {result.summary()}")
            self.log.warning(
                "unit_reset_failed_refused",
                unit=unit,
                was=was,
                problem=result.summary(),
                advice=f"`specd install --unit {unit}` installs the polkit rule that allows it",
            )
        self._persist(journal)
        return result.ok

    # -- bookkeeping ----------------------------------------------------------------
    def _issue_restart(self, journal: Journal, phase: str) -> str | None:
        """Journal the restart as issued, before it is: why that could not be saved, or
        None. A change does not go out unsaved; a rollback does (SGLang needs it more)."""
        state = unit_state(self.runner, journal.unit, UNIT_STATE_TIMEOUT_S)
        journal.issued_from = None if state is None else state.invocation
        journal.restarts_issued += 1
        journal.restart_issued_at = self._clock()
        if self._restart_started is None:
            self._restart_started = self._mono()
        journal.phase = phase
        journal.note(f"issuing `{' '.join(restart_argv(journal.unit))}`")
        return self._persist(journal)

    def _set_phase(self, journal: Journal, phase: str, message: str) -> None:
        journal.phase = phase
        journal.note(message)
        self._persist(journal)

    def _persist(self, journal: Journal) -> str | None:
        """Save the journal; why it could not be saved, or None."""
        return self._persist_cb(journal.to_dict())

    def _finish(self, journal: Journal, phase: str, message: str) -> ApplyOutcome:
        # The worker goes back into routing before the sequence may end: a terminal journal
        # is cleared by the caller, and with it the record of what was drained.
        problem = self._readd(journal)
        if problem is not None:
            message = f"{message}; {problem}"
        journal.phase = phase
        journal.finished_at = self._clock()
        journal.note(message)
        self._persist(journal)
        self._release_slot(journal)
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
            journal.from_setting,
            journal.to_setting,
            self._drain_report,
            journal.not_started,
        )

    def _aborted(
        self,
        current: SpecSetting | None,
        target: SpecSetting | None,
        message: str,
        *,
        to_steps: int | None = None,
    ) -> ApplyOutcome:
        """Nothing was changed. ``to_steps`` stands in for a target that is no setting."""
        outcome = ApplyOutcome(
            "aborted",
            setting_steps(current),
            setting_steps(target) if target is not None else to_steps,
            0.0,
            message,
            None,
            0,
            None if current is None else format_setting(current),
            None if target is None else format_setting(target),
        )
        self.log.info(
            "restart_aborted",
            from_setting=outcome.from_setting,
            to_setting=outcome.to_setting,
            from_steps=outcome.from_steps,
            to_steps=outcome.to_steps,
            reason=message,
        )
        return outcome

    # -- the fleet: a slot before the restart, released after ------------------------
    def _take_slot(
        self,
        current: SpecSetting | None,
        target: SpecSetting,
        window_open: Callable[[], bool],
        force: bool,
    ) -> ApplyOutcome | None:
        """Wait for a slot of the fleet while the window stays open. None: taken (and kept
        alive from now on); else the aborted outcome."""
        assert self.fleet is not None

        def closed() -> str | None:
            return self._cancelled() or (None if force or window_open() else "window closed")

        try:
            slot, why = self.fleet.acquire(self._stop, closed)
        except FleetUnavailable as exc:
            return self._aborted(
                current, target, f"fleet unavailable: {exc}; nothing was restarted"
            )
        if slot is None:
            return self._aborted(current, target, f"{why}; nothing was restarted")
        self._slot, self._keeper = slot, self.fleet.keep_alive(slot)
        self.log.info("fleet_slot_taken", group=slot.group, slot=slot.index, detail=why)
        return None

    def _still_routed(self) -> str | None:
        """Why the drained server must not restart: a gateway replica routes it again (one
        restarted since the drain lists its configured workers anew) or under a name the
        drain did not take out (localhost beside 127.0.0.1), or cannot say. None: no
        replica routes it. A restart then would cut the requests routed to it."""
        assert self.gateway is not None
        try:
            routed = self.gateway.routing()
        except GatewayUnavailable as exc:
            return f"cannot confirm no gateway replica routes this server: {exc}; no restart"
        if not routed:
            return None
        return f"{'; '.join(routed)} since the drain: no restart"

    def _slot_lost(self) -> str | None:
        """Right before the restart: why the slot is no longer ours, or None (no fleet, or
        etcd confirms it)."""
        if self.fleet is None or self._slot is None:
            return None
        if self._keeper is not None and self._keeper.lost is not None:
            return f"lost the fleet slot: {self._keeper.lost}"
        problem = self.fleet.check(self._slot)
        return None if problem is None else f"lost the fleet slot: {problem}"

    def _halted(self, when: str) -> str | None:
        """Why the change must not go on ``when`` (a stop requested: no new restart may begin
        once specd is asked to stop; a freeze written since the change began), or None."""
        if self._stop.is_set():
            return f"stop requested {when}"
        cancelled = self._cancelled()
        return None if cancelled is None else f"{cancelled} {when}"

    def _reattach_slot(self, journal: Journal) -> None:
        """A resumed sequence keeps the slot its killed predecessor took, if it still holds;
        if not, it heals all the same: SGLang is already out of service, and a rollback
        must not wait for another server's turn."""
        if journal.fleet_slot is None or journal.fleet_released:
            return
        slot = Slot.from_dict(journal.fleet_slot)
        if self.fleet is None:
            journal.note(f"fleet slot {slot.index} in the journal but no [fleet] configured")
            return
        try:
            problem = self.fleet.holds(slot)
        except FleetUnavailable as exc:
            problem = f"etcd cannot say ({exc})"
        if problem is None:
            self._slot, self._keeper = slot, self.fleet.keep_alive(slot)
            journal.note(f"fleet slot {slot.index} still held: kept while healing")
        else:
            journal.note(f"fleet slot {slot.index} not held any more ({problem}): healing anyway")
        self._persist(journal)

    def _mark_out(self, journal: Journal) -> str | None:
        """Mark this server out of service in its group (no fleet: nothing to do) before the
        sequence takes it out. Why not (etcd did not take it: then no restart), or None."""
        if self.fleet is None or self._slot is None:
            return None
        try:
            marker = self.fleet.out_marker(self._clock(), self.out_bound_s)
            # In the journal before it is put: a specd killed from here on removes it.
            journal.fleet_out = marker.to_dict()
            self._out = marker
            self._persist(journal)
            # Only while the slot is still ours: checked before (`_slot_lost`), it may have
            # run out since, and another specd taken it.
            lost = self.fleet.mark_out(marker, self._slot)
        except FleetUnavailable as exc:
            return f"fleet unavailable: cannot mark this server out of service: {exc}"
        if lost is not None:
            return f"lost the fleet slot: {lost}"
        self.unremoved_out = None  # its key is on this marker's lease now
        if self._keeper is not None:
            self._keeper.watch_out(marker)  # put again should etcd lose it while out
        journal.note(
            f"marked out of service in fleet group {marker.group} for at most {marker.ttl_s} s"
        )
        self.log.info("fleet_marked_out", group=marker.group, bound_s=marker.ttl_s)
        return None

    def _reattach_out(self, journal: Journal) -> None:
        """A resumed sequence keeps its server marked out of service, under a fresh lease:
        the bound of this run counts from now (the marker its killed predecessor put may be
        about to run out, or gone, while SGLang still loads). Best effort: the heal never
        waits for etcd."""
        if journal.fleet_out is None or journal.fleet_out_removed or self.fleet is None:
            return
        old = OutMarker.from_dict(journal.fleet_out)
        try:
            marker = self.fleet.out_marker(old.since, self.out_bound_s)
        except FleetUnavailable as exc:
            self._out = old
            journal.note(f"cannot mark this server out of service again ({exc}): healing anyway")
            self._persist(journal)
            return
        journal.fleet_out = marker.to_dict()
        self._persist(journal)
        try:
            self.fleet.mark_out(marker)
            self.unremoved_out = None  # its key is on this marker's lease now
        except FleetUnavailable as exc:
            # The old marker, if it still lives, is the one to revoke at the end.
            self._out, journal.fleet_out = old, old.to_dict()
            journal.note(f"cannot mark this server out of service again ({exc}): healing anyway")
            self._persist(journal)
            return
        self._out = marker
        if self._keeper is not None:
            self._keeper.watch_out(marker)
        self.fleet.moved_off(old)
        journal.note(f"still out of service: marked again for at most {marker.ttl_s} s")
        self._persist(journal)

    def _mark_in(self, journal: Journal | None) -> None:
        """The server serves again (or the sequence ended): revoke its marker; idempotent.
        One etcd does not take frees itself at its TTL, as the log line says."""
        marker, self._out = self._out, None
        if marker is None and journal is not None and journal.fleet_out is not None:
            if journal.fleet_out_removed:
                return
            marker = OutMarker.from_dict(journal.fleet_out)
        if marker is None:
            return
        if self.fleet is None:
            message = (
                "an out-of-service marker in the journal but no [fleet] configured: it frees "
                f"itself by {utc_time(marker.until)} at the latest"
            )
            self.log.warning("fleet_marked_in", group=marker.group, detail=message)
        else:
            message = self._remove_marker(marker)
        if journal is not None and journal.fleet_out is not None:
            journal.fleet_out_removed = True
            journal.note(message)
            self._persist(journal)

    def take_over_out(self, old: Applier) -> OutMarker | None:
        """A reload's new applier, for the same fleet group, server and etcd: go on with
        the out-of-service marker ``old`` could not remove (and what it knew of leftover
        markers), or it would be forgotten while the group still counts this server out.
        The marker taken over, or None."""
        if self.fleet is None or old.fleet is None:
            return None
        same = (self.fleet.group, self.fleet.holder, self.fleet.instance) == (
            old.fleet.group,
            old.fleet.holder,
            old.fleet.instance,
        ) and self.fleet.settings.etcd_endpoints == old.fleet.settings.etcd_endpoints
        if not same:
            return None
        self.unremoved_out = old.unremoved_out
        self.stale_out_checked = old.stale_out_checked
        self._stale_out_logged = old._stale_out_logged
        self._out_kept_for_gateway = old._out_kept_for_gateway
        return self.unremoved_out

    def _remove_marker(self, marker: OutMarker) -> str:
        """Revoke ``marker``; one etcd does not take stays in ``unremoved_out`` for
        `retry_mark_in`. What happened, as logged."""
        assert self.fleet is not None
        problem = self.fleet.mark_in(marker)
        self.unremoved_out = None if problem is None else marker
        message = problem or f"marked back in service in fleet group {marker.group}"
        log = self.log.warning if problem else self.log.info
        log("fleet_marked_in", group=marker.group, detail=message)
        return message

    def retry_mark_in(self, *, serving: bool = False) -> str | None:
        """One more try to remove the marker a sequence's end could not (``unremoved_out``):
        while it lives the other servers of the group wait for it. None once removed (etcd
        revoked its lease, or says it is gone); else the problem. Also past its bound: etcd
        counts a lease's TTL only while it runs, and each start of etcd gives every lease its
        whole TTL again, so a marker past ``until`` by this clock may live a whole bound more
        after an etcd outage; it is counted (specd_fleet_marked_out) and tried until etcd
        confirms it gone. One etcd call, bounded by its timeout.

        With ``serving`` (no sequence pending, SGLang answers, no gateway replica leaves its
        worker out), also once per run of specd and once after each sequence that ended with
        the worker left out: a marker of this server in etcd is then one an earlier run could
        not remove (etcd away at its end, and specd restarted since, which forgot it) or one
        kept while the worker was left out: removed, else the group waits for this server,
        serving, up to the marker's bound. A marker with no lease was put by hand and is
        left to whoever put it."""
        marker = self.unremoved_out
        if self.fleet is None:
            return None
        if marker is None:
            return self._remove_stale_out() if serving and not self.stale_out_checked else None
        message = self._remove_marker(marker)
        if self.unremoved_out is not None:
            return message
        if self._clock() >= marker.until:
            # Given up late, after an etcd outage: look once more, when the server serves,
            # for a marker of this server's name (one a re-mark put under another lease).
            self.stale_out_checked = False
        return None

    def _remove_stale_out(self) -> str | None:
        assert self.fleet is not None
        try:
            found, clash = self.fleet.own_out()
            # One with no lease was put by hand: left to whoever put it.
            removable = found if found is not None and found.lease > 0 else None
            if removable is not None:
                self.fleet.remove_out(removable)
        except FleetUnavailable as exc:
            message = f"cannot look for an out-of-service marker an earlier run left: {exc}"
            if not self._stale_out_logged:  # once, not every minute of an etcd outage
                self.log.warning("fleet_marked_in", group=self.fleet.group, detail=message)
                self._stale_out_logged = True
            return message
        self.stale_out_checked = True
        if clash is not None:
            # Said at once, not only when a restart is due (`Fleet.probe` says it then).
            self.log.warning("fleet_name_clash", group=self.fleet.group, detail=clash)
        kept, self._out_kept_for_gateway = self._out_kept_for_gateway, False
        if removable is not None:
            since = "" if removable.since is None else f" (out since {utc_time(removable.since)})"
            if kept:
                detail = "every gateway replica routes the worker again"
            else:
                detail = "it serves and no restart of it is pending (an earlier run left it)"
            log = self.log.info if kept else self.log.warning
            log(
                "fleet_marked_in",
                group=self.fleet.group,
                detail=f"removed this server's out-of-service marker{since}: {detail}",
            )
        return None

    def _release_slot(self, journal: Journal | None, *, keep_out: bool = False) -> None:
        """Give the slot back (stop renewing, revoke the lease); idempotent. A release etcd
        does not take frees the slot one TTL after the renewals stopped. The server's
        out-of-service marker goes first, unless ``keep_out``: a sequence left for the next
        boot (its server is out until then, or until the marker's bound); nor while a
        gateway replica leaves the worker out after a failed re-add (the server serves no
        traffic there): `retry_mark_in` removes it once the daemon put it back."""
        if self._keeper is not None:
            # The marker as the keeper left it: under a fresh lease if it put it again (etcd
            # lost it mid-sequence), the one to remove.
            again = self._keeper.stop_watching_out()
            if again is not None and self._out is not None:
                self._out = again
        left_out = len((self._drain_report or {}).get("left_out") or []) if self.fleet else 0
        if left_out and not keep_out:
            # Found in etcd by its name and removed once the worker is back (a marker a
            # failed re-mark left under its old lease too).
            self.stale_out_checked, self._out_kept_for_gateway = False, True
            if self._out is not None and self.fleet is not None:
                self._out = None
                if journal is not None:
                    journal.note(
                        f"kept marked out of service: {left_out} gateway replica(s) leave the "
                        "worker out; removed once they route it again"
                    )
                    self._persist(journal)
                self.log.warning("fleet_kept_out", group=self.fleet.group, left_out=left_out)
        elif not keep_out:
            self._mark_in(journal)
        keeper, self._keeper = self._keeper, None
        if keeper is not None:
            keeper.stop()
        slot, self._slot = self._slot, None
        if slot is None and journal is not None and journal.fleet_slot is not None:
            if journal.fleet_released:
                return
            slot = Slot.from_dict(journal.fleet_slot)
        if slot is None:
            return
        if self.fleet is None:
            problem: str | None = (
                f"fleet slot {slot.index} in the journal but no [fleet] configured: "
                f"it frees itself within {slot.ttl_s} s"
            )
        else:
            problem = self.fleet.release(slot)
        lost = keeper.lost if keeper is not None else None
        message = problem or f"released fleet slot {slot.index} of group {slot.group}"
        if lost is not None:
            message = f"{message} (the lease was lost mid-sequence: {lost})"
        log = self.log.warning if problem or lost else self.log.info
        log("fleet_slot_released", group=slot.group, slot=slot.index, detail=message)
        if journal is not None and journal.fleet_slot is not None:
            journal.fleet_released = True
            journal.note(message)
            self._persist(journal)

    # -- the gateway: drain before the restart, re-add after ---------------------------
    def _drain(
        self,
        journal: Journal,
        gateway: GatewayClient,
        window_open: Callable[[], bool],
        force: bool,
    ) -> ApplyOutcome | None:
        """Take this server out of routing on every replica and wait until SGLang is idle.
        None: drained and idle, go ahead; else the (aborted) outcome, worker re-added."""
        assert self.gateway_settings is not None
        halted = self._halted("before the drain")
        if halted is not None:
            # Not taken out of routing only to be put back at once.
            return self._finish(journal, "aborted", f"{halted}; nothing was restarted")
        started = self._mono()
        report: dict[str, Any] = {
            "result": "error",
            "duration_s": 0.0,
            "in_flight_at_restart": None,
            "replicas": 0,
            "readd_problem": None,
            "left_out": [],
        }
        self._drain_report = report
        try:
            found = [w for w in gateway.find_all() if w is not None]
        except GatewayUnavailable as exc:
            return self._finish(journal, "aborted", f"cannot drain: {exc}; nothing was restarted")
        # Marked before the first DELETE takes the server out of routing (nothing drained yet
        # if it cannot be).
        unmarked = self._mark_out(journal)
        if unmarked is not None:
            return self._finish(journal, "aborted", f"{unmarked}; nothing was restarted")
        # Persisted before any DELETE: a specd killed now re-adds them on its next start.
        journal.drained = [w.to_dict() for w in found]
        report["replicas"] = len(found)
        self._set_phase(
            journal,
            "draining",
            f"draining on {len(found)} of {len(gateway.gateways)} gateway replicas",
        )
        try:
            for worker in found:
                gateway.remove(worker)
            # smg queues a removal: until it is done the replica still routes here.
            gateway.await_removed(found, self.gateway_settings.request_timeout_s)
        except GatewayUnavailable as exc:
            report["duration_s"] = self._mono() - started
            return self._finish(journal, "aborted", f"drain failed: {exc}; nothing was restarted")
        result, why, in_flight = self._wait_idle(started, window_open, force)
        report.update(result=result, duration_s=self._mono() - started)
        if result != "idle":
            return self._finish(journal, "aborted", f"{why}; nothing was restarted")
        report["in_flight_at_restart"] = in_flight
        journal.note(why)
        return None

    def _wait_idle(
        self, started: float, window_open: Callable[[], bool], force: bool
    ) -> tuple[str, str, int | None]:
        """Poll SGLang until it reports 0 running and 0 queued on IDLE_READS reads in a row,
        bounded by drain_timeout_s. Returns (DRAIN_RESULTS entry, message, in flight)."""
        assert self.gateway_settings is not None
        timeout_s = self.gateway_settings.drain_timeout_s
        deadline = started + timeout_s
        idle_reads, last = 0, "no observation yet"
        while True:
            halted = self._halted("while draining")
            if halted is not None:
                return "aborted", halted, None
            if not force and not window_open():
                return "aborted", f"window closed while draining ({last})", None
            obs = self.client.observe()
            if isinstance(obs, ScrapeError):
                idle_reads, last = 0, f"scrape failed: {obs.reason}"
            elif obs.offered == 0:
                idle_reads += 1
                if idle_reads >= IDLE_READS:
                    waited = self._mono() - started
                    return "idle", f"drained: SGLang idle after {waited:.1f} s", 0
            else:
                idle_reads, last = 0, f"{obs.running} running, {obs.queued} queued"
            left = deadline - self._mono()
            if left <= 0:
                return "timeout", f"SGLang not idle {timeout_s:g} s after the drain ({last})", None
            if self._stop.wait(min(self.quiet_poll_interval_s, left)):
                return "aborted", "stop requested while draining", None

    def _readd(self, journal: Journal) -> str | None:
        """Put drained workers back and wait until each replica has them ready (idempotent;
        a no-op without drained workers). Returns a problem (one line) or None."""
        if not journal.drained or journal.readded:
            return None
        gateway, settings = self.gateway, self.gateway_settings
        problem: str | None = None
        left_out: list[Worker] = []
        if gateway is None or settings is None:
            problem = (
                f"{len(journal.drained)} drained gateway worker(s) in the journal but no "
                "[gateway] configured: re-add them by hand"
            )
        else:
            workers = [Worker.from_dict(w) for w in journal.drained]
            problems = []
            # Replica by replica: one away does not keep the worker out of the others.
            failed = gateway.readd(workers, settings.ready_timeout_s)
            if failed:
                problems.append(_readd_failed(failed, len(workers)))
                left_out += [w for w, _ in failed]
            failed_at = {w.gateway_url for w, _ in failed}
            back = [w for w in workers if w.gateway_url not in failed_at]
            try:
                if back and not gateway.wait_ready(
                    settings.ready_timeout_s, [w.gateway_url for w in back]
                ):
                    problems.append(
                        f"worker re-added but not ready on every gateway replica within "
                        f"{settings.ready_timeout_s:g} s"
                    )
                    left_out += back
            except GatewayUnavailable as exc:
                problems.append(f"waiting for the re-added worker failed: {exc}")
                left_out += back
            problem = "; ".join(problems) or None
        journal.readded = True
        journal.note(problem or f"worker re-added, ready on {len(journal.drained)} replicas")
        if problem is not None:
            self.log.error("gateway_readd_failed", problem=problem)
        if self._drain_report is None:
            # Re-added by a specd restarted mid-sequence: no drain of its own to count.
            self._drain_report = {
                "result": None,
                "duration_s": 0.0,
                "in_flight_at_restart": None,
                "replicas": len(journal.drained),
                "readd_problem": None,
                "left_out": [],
            }
        self._drain_report["readd_problem"] = problem
        # What the daemon keeps re-adding once the journal is cleared (readd_left_out).
        self._drain_report["left_out"] = [w.to_dict() for w in left_out]
        self._persist(journal)
        return problem

    def readd_left_out(self, drained: Sequence[Mapping[str, Any]]) -> str | None:
        """One more try to put back workers an earlier re-add left out (``left_out`` of a
        drain report), on the replicas still configured; a replica that lists the worker
        again is left alone. Bounded by one call's timeout per replica (a draining entry is
        waited for that long): a try made between ticks must not hold up the loop. Returns
        the problem, or None when every replica took it back (ready is for the gateway
        probe to see)."""
        gateway, settings = self.gateway, self.gateway_settings
        if gateway is None or settings is None:
            return "no [gateway] configured: re-add the worker by hand"
        try:
            workers = [Worker.from_dict(w) for w in drained]
        except ValueError as exc:
            return f"cannot re-add: {exc}"
        workers = [w for w in workers if w.gateway_url in gateway.gateways]
        failed = gateway.readd(workers, settings.request_timeout_s)
        return _readd_failed(failed, len(workers)) if failed else None


# Slack over the timeouts: the unit-state queries (10 s each, a few per poll), journal writes
# and etcd requests between the bounded steps.
OUT_OF_SERVICE_SLACK_S = 300.0


def out_of_service_bound_s(
    restart: RestartSettings, gateway: GatewaySettings | None, verify_attempts: int = 3
) -> int:
    """How long a sequence can keep its server out of service, at most: the TTL of its
    out-of-service marker. From the drain's first DELETE: the wait for the removal and for
    SGLang to be idle; then up to four restart commands (the change's and the rollback's,
    each possibly made once more after systemd's start limit refused it), three start-up
    waits (the change's load, the rollback's, and the wait for the start limit to pass,
    never longer than one), two verifications (``verify_attempts`` reads each, a poll
    interval apart, each counted as long as a probe); then the re-add (the draining entry's
    wait, then ready). Plus a slack."""
    bound = (
        4 * restart.restart_command_timeout_s
        + 3 * restart.startup_timeout_s
        + 2 * verify_attempts * (restart.health_poll_interval_s + restart.health_probe_timeout_s)
        + OUT_OF_SERVICE_SLACK_S
    )
    if gateway is not None:
        bound += gateway.request_timeout_s + gateway.drain_timeout_s + 2 * gateway.ready_timeout_s
    return math.ceil(bound)


def _readd_failed(failed: Sequence[tuple[Worker, str]], of: int) -> str:
    return f"re-adding the worker failed on {len(failed)} of {of} replicas: " + "; ".join(
        why for _, why in failed
    )


def _limit_text(limit: StartLimit) -> str:
    interval = f"{limit.interval_s:g} s" if math.isfinite(limit.interval_s) else "infinity"
    return f"StartLimitBurst={limit.burst} in StartLimitIntervalSec={interval}"


def _describe(setting: SpecSetting | None) -> str:
    """A setting for messages: "4 steps", "off", "adaptive:3,4"; "unknown" for None."""
    if setting is None:
        return "unknown"
    if setting.kind == "static":
        return f"{setting.steps} steps"
    return format_setting(setting)
