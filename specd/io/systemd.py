"""``systemctl show``: the one way specd asks systemd about a unit's properties.

Read-only (no polkit rule needed). ``systemctl show`` prints ``KEY=VALUE`` lines; a property
may repeat (one ``ExecStart=`` line per command), so each key maps to all its values.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from specd.core.text import ascii_count
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


# systemd's own exit statuses (src/basic/exit-status.h, as `systemd-analyze exit-status`
# lists them; 223 and 234 are retired): a service's main process that exits with one never
# ran its program, because systemd's setup of it between fork and exec failed (its working
# directory, user, cgroup, namespaces, the exec itself, ...).
SETUP_EXIT_STATUSES: dict[int, str] = {
    200: "CHDIR",
    201: "NICE",
    202: "FDS",
    203: "EXEC",
    204: "MEMORY",
    205: "LIMITS",
    206: "OOM_ADJUST",
    207: "SIGNAL_MASK",
    208: "STDIN",
    209: "STDOUT",
    210: "CHROOT",
    211: "IOPRIO",
    212: "TIMERSLACK",
    213: "SECUREBITS",
    214: "SETSCHEDULER",
    215: "CPUAFFINITY",
    216: "GROUP",
    217: "USER",
    218: "CAPABILITIES",
    219: "CGROUP",
    220: "SETSID",
    221: "CONFIRM",
    222: "STDERR",
    224: "PAM",
    225: "NETWORK",
    226: "NAMESPACE",
    227: "NO_NEW_PRIVILEGES",
    228: "SECCOMP",
    229: "SELINUX_CONTEXT",
    230: "PERSONALITY",
    231: "APPARMOR",
    232: "ADDRESS_FAMILIES",
    233: "RUNTIME_DIRECTORY",
    235: "CHOWN",
    236: "SMACK_PROCESS_LABEL",
    237: "KEYRING",
    238: "STATE_DIRECTORY",
    239: "CACHE_DIRECTORY",
    240: "LOGS_DIRECTORY",
    241: "CONFIGURATION_DIRECTORY",
    242: "NUMA_POLICY",
    243: "CREDENTIALS",
    244: "BPF",
    245: "KSM",
    246: "MEMORY_THP",
}
# ExecMainCode= of a main process that exited (waitid's CLD_EXITED); 2 and 3 are a signal's
# (ExecMainStatus= is then the signal's number), 0 no process has ended since the last start.
CLD_EXITED = 1


def setup_failure(code: int | None, status: int | None) -> str | None:
    """``"219/CGROUP"`` where a main process ended with ExecMainCode= ``code`` and
    ExecMainStatus= ``status`` is systemd's own setup failing before the program ran; None
    for the program's own exit or a signal (SGLang itself died), or nothing known."""
    if code != CLD_EXITED or status is None:
        return None
    name = SETUP_EXIT_STATUSES.get(status)
    return None if name is None else f"{status}/{name}"


@dataclass(frozen=True)
class UnitState:
    """Where a unit is, as ``systemctl show`` says: ``active`` (ActiveState: active,
    activating, failed, ...), ``sub`` (SubState: running, auto-restart, ...), ``restarts``
    (NRestarts: the starts Restart= made; None when systemd does not say), ``result``
    (Result: success, exit-code, start-limit-hit, ...; "" when systemd does not say), and
    how the main process of the unit's last start ended, ``exec_code`` (ExecMainCode:
    CLD_EXITED, 2 killed, 3 dumped; 0 still running or none) and ``exec_status``
    (ExecMainStatus: its exit status or signal); None where systemd does not say. systemd
    resets both at every start, Restart='s too. ``job``: the id of a job queued or running
    on the unit (a start, a restart), None when there is none or systemd does not say;
    ``invocation``: its InvocationID, which tells whether it was started since."""

    active: str
    sub: str
    restarts: int | None
    result: str = ""
    exec_code: int | None = None
    exec_status: int | None = None
    job: int | None = None
    # InvocationID: new at each start of the unit (Restart='s too), kept after it stops;
    # None when systemd does not say (or has never started it).
    invocation: str | None = None

    @property
    def stopped(self) -> bool:
        """Stopped and left so: inactive with no job to start it (a `systemctl stop`, or a
        process that ended cleanly where Restart= does not start it again)."""
        return self.active == "inactive" and not self.job

    @property
    def setup_failure(self) -> str | None:
        """The last start's main process never ran its program: systemd's status for why
        (``"219/CGROUP"``), else None."""
        return setup_failure(self.exec_code, self.exec_status)


# Result= of a unit whose start systemd refused for its start limit. systemd 252 sets it only
# where the unit's result was success (a unit stopped cleanly, e.g. by `systemctl restart`);
# after a crash it keeps the crash's (exit-code).
START_LIMIT_HIT = "start-limit-hit"

UNIT_STATE_PROPERTIES = (
    "ActiveState",
    "SubState",
    "NRestarts",
    "Result",
    "ExecMainCode",
    "ExecMainStatus",
    # Printed only while a job is queued or running (`Job=1234`).
    "Job",
    "InvocationID",
)


def unit_state(runner: Runner, unit: str, timeout_s: float = SHOW_TIMEOUT_S) -> UnitState | None:
    """The unit's state now; None when systemd cannot say (or a stand-in does not)."""
    try:
        props = last_values(show(runner, unit, UNIT_STATE_PROPERTIES, timeout_s))
    except SystemctlError:
        return None
    active = props.get("ActiveState", "")
    if not active:
        return None
    return UnitState(
        active,
        props.get("SubState", ""),
        _count(props.get("NRestarts", "")),
        props.get("Result", ""),
        _count(props.get("ExecMainCode", "")),
        _count(props.get("ExecMainStatus", "")),
        _count(props.get("Job", "")),
        invocation_id(props.get("InvocationID", "")),
    )


def invocation_id(value: str | None) -> str | None:
    """An InvocationID (128 bits in hex), else None: what systemd does not say is unknown."""
    if value is None:
        return None
    text = value.strip().lower()
    return text if len(text) == 32 and all(c in "0123456789abcdef" for c in text) else None


def _count(value: str) -> int | None:
    return ascii_count(value, 20)


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
