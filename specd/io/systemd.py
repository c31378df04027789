"""``systemctl show``: the one way specd asks systemd about a unit's properties.

Read-only (no polkit rule needed). ``systemctl show`` prints ``KEY=VALUE`` lines; a property
may repeat (one ``ExecStart=`` line per command), so each key maps to all its values.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from specd.io.runner import Runner
from specd.io.timespan import timespan_s

SHOW_TIMEOUT_S = 10.0
# systemd's DefaultTimeoutStopSec=, assumed while the unit's own cannot be read.
DEFAULT_STOP_TIMEOUT_S = 90.0


class SystemctlError(RuntimeError):
    """``systemctl show`` failed; the message is its one-line summary."""


def show_argv(unit: str, properties: Iterable[str]) -> list[str]:
    return ["systemctl", "show", *(f"--property={p}" for p in properties), unit]


def parse_show(text: str) -> dict[str, list[str]]:
    """``KEY=VALUE`` lines → every value of each key, in order (lines without ``=`` skipped)."""
    props: dict[str, list[str]] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            props.setdefault(key, []).append(value)
    return props


def last_values(props: dict[str, list[str]]) -> dict[str, str]:
    """The value in force of each key: the last one, as systemd applies them."""
    return {key: values[-1] for key, values in props.items() if values}


def show(
    runner: Runner, unit: str, properties: Iterable[str], timeout_s: float = SHOW_TIMEOUT_S
) -> dict[str, list[str]]:
    """Run ``systemctl show`` for ``properties`` of ``unit``. Raises ``SystemctlError``."""
    result = runner(show_argv(unit, properties), timeout_s=timeout_s)
    if not result.ok:
        raise SystemctlError(result.summary())
    return parse_show(result.stdout)


@dataclass(frozen=True)
class UnitState:
    """Where a unit is, as ``systemctl show`` says: ``active`` (ActiveState: active,
    activating, failed, ...), ``sub`` (SubState: running, auto-restart, ...), ``restarts``
    (NRestarts: the starts Restart= made; None when systemd does not say) and ``result``
    (Result: success, exit-code, start-limit-hit, ...; "" when systemd does not say)."""

    active: str
    sub: str
    restarts: int | None
    result: str = ""


# Result= of a unit whose start systemd refused for its start limit. systemd 252 sets it only
# where the unit's result was success (a unit stopped cleanly, e.g. by `systemctl restart`);
# after a crash it keeps the crash's (exit-code).
START_LIMIT_HIT = "start-limit-hit"

UNIT_STATE_PROPERTIES = ("ActiveState", "SubState", "NRestarts", "Result")


def unit_state(runner: Runner, unit: str, timeout_s: float = SHOW_TIMEOUT_S) -> UnitState | None:
    """The unit's state now; None when systemd cannot say (or a stand-in does not)."""
    try:
        props = last_values(show(runner, unit, UNIT_STATE_PROPERTIES, timeout_s))
    except SystemctlError:
        return None
    active = props.get("ActiveState", "")
    if not active:
        return None
    restarts = props.get("NRestarts", "")
    return UnitState(
        active,
        props.get("SubState", ""),
        int(restarts) if restarts.isdigit() else None,
        props.get("Result", ""),
    )


@dataclass(frozen=True)
class StartLimit:
    """The unit's start rate limit: systemd refuses a start (``Restart=``'s or anyone's
    `systemctl restart`) once ``burst`` starts were made within ``interval_s`` (math.inf:
    never forgotten), until the interval has passed or `systemctl reset-failed UNIT`."""

    interval_s: float
    burst: int


START_LIMIT_PROPERTIES = ("StartLimitIntervalUSec", "StartLimitBurst")


def start_limit(runner: Runner, unit: str, timeout_s: float = SHOW_TIMEOUT_S) -> StartLimit | None:
    """The unit's StartLimitIntervalSec= and StartLimitBurst= as systemd resolved them; None
    when it has none (either is 0) or systemd cannot say."""
    try:
        props = last_values(show(runner, unit, START_LIMIT_PROPERTIES, timeout_s))
    except SystemctlError:
        return None
    interval = timespan_s(props.get("StartLimitIntervalUSec", ""))
    burst = props.get("StartLimitBurst", "")
    if interval is None or not burst.isdigit() or interval == 0 or int(burst) == 0:
        return None
    return StartLimit(interval, int(burst))
