from __future__ import annotations

import math
from collections.abc import Sequence

import pytest

from specd.io import systemd
from specd.io.runner import RunResult, SubprocessRunner

SHOW = (
    "LoadState=loaded\n"
    "ExecStart={ path=/bin/a ; argv[]=/bin/a --x ; }\n"
    "ExecStart={ path=/bin/b ; argv[]=/bin/b ; }\n"
    "Environment=A=1 B=2\n"
    "Description=one = two\n"
    "garbage line\n"
    "WatchdogUSec=\n"
)


def test_parse_show_keeps_every_value_in_order() -> None:
    props = systemd.parse_show(SHOW)
    assert props["ExecStart"] == [
        "{ path=/bin/a ; argv[]=/bin/a --x ; }",
        "{ path=/bin/b ; argv[]=/bin/b ; }",
    ]
    assert props["Environment"] == ["A=1 B=2"]
    assert props["Description"] == ["one = two"]  # only the first "=" splits
    assert props["WatchdogUSec"] == [""]
    assert "garbage line" not in props
    last = systemd.last_values(props)
    assert last["ExecStart"] == "{ path=/bin/b ; argv[]=/bin/b ; }"
    assert last["LoadState"] == "loaded"


def test_show_argv() -> None:
    assert systemd.show_argv("sglang.service", ["LoadState", "ExecStart"]) == [
        "systemctl",
        "show",
        "--property=LoadState",
        "--property=ExecStart",
        "sglang.service",
    ]


class FakeSystemctl:
    """A real process standing in for systemctl: prints what it is given to print."""

    def __init__(self, stdout: str, code: int) -> None:
        self.stdout = stdout
        self.code = code
        self.argv: list[str] = []

    def __call__(self, argv: Sequence[str], *, timeout_s: float) -> RunResult:
        self.argv = list(argv)
        script = f"import sys; sys.stdout.write({self.stdout!r}); sys.exit({self.code})"
        return SubprocessRunner()(["python3", "-c", script], timeout_s=timeout_s)


def test_show_runs_systemctl_and_parses_it() -> None:
    runner = FakeSystemctl(SHOW, 0)
    props = systemd.show(runner, "sglang.service", ["LoadState"])
    assert runner.argv == ["systemctl", "show", "--property=LoadState", "sglang.service"]
    assert props["LoadState"] == ["loaded"]


def test_a_failed_show_is_one_line() -> None:
    with pytest.raises(systemd.SystemctlError) as info:
        systemd.show(FakeSystemctl("", 3), "sglang.service", ["LoadState"])
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("stdout", "code", "expected"),
    [
        # As systemd 252 prints them (in its own order) for a unit between two starts of
        # Restart=, and for one that gave up.
        (
            "NRestarts=2\nActiveState=activating\nSubState=auto-restart\n",
            0,
            systemd.UnitState("activating", "auto-restart", 2),
        ),
        ("ActiveState=failed\nSubState=failed\n", 0, systemd.UnitState("failed", "failed", None)),
        # systemd 252 after it stopped an active unit for `systemctl restart` and refused the
        # start for its start limit (a crash's Result= would have been kept instead).
        (
            "ActiveState=failed\nSubState=failed\nNRestarts=0\nResult=start-limit-hit\n",
            0,
            systemd.UnitState("failed", "failed", 0, systemd.START_LIMIT_HIT),
        ),
        # systemd 252 between Restart='s starts after it could not put the process into its
        # cgroup ("code=exited, status=219/CGROUP"), and after a SIGKILL ("code=killed").
        (
            "NRestarts=0\nActiveState=activating\nSubState=auto-restart\nResult=exit-code\n"
            "ExecMainCode=1\nExecMainStatus=219\n",
            0,
            systemd.UnitState("activating", "auto-restart", 0, "exit-code", 1, 219),
        ),
        (
            "ActiveState=failed\nSubState=failed\nResult=signal\nExecMainCode=2\n"
            "ExecMainStatus=9\n",
            0,
            systemd.UnitState("failed", "failed", None, "signal", 2, 9),
        ),
        # Running: no main process has ended since the start.
        (
            "ActiveState=active\nSubState=running\nNRestarts=0\nResult=success\n"
            "ExecMainCode=0\nExecMainStatus=0\n",
            0,
            systemd.UnitState("active", "running", 0, "success", 0, 0),
        ),
        # Not numbers: not known (never a crash of specd).
        (
            "ActiveState=failed\nSubState=failed\nNRestarts=-1\nExecMainCode=exited\n"
            "ExecMainStatus=\u00b2\n",
            0,
            systemd.UnitState("failed", "failed", None, "", None, None),
        ),
        # Stopped (`systemctl stop`): no job. Between the stop and the start of a restart,
        # or at boot before its turn: inactive, with the start job queued.
        (
            "ActiveState=inactive\nSubState=dead\nNRestarts=0\nResult=success\n",
            0,
            systemd.UnitState("inactive", "dead", 0, "success"),
        ),
        (
            "ActiveState=inactive\nSubState=dead\nNRestarts=0\nResult=success\nJob=4711\n",
            0,
            systemd.UnitState("inactive", "dead", 0, "success", job=4711),
        ),
        (
            "ActiveState=inactive\nSubState=dead\nJob=\n",
            0,
            systemd.UnitState("inactive", "dead", None),
        ),
        # Each start's InvocationID, kept once it stopped; anything else is not one.
        (
            "ActiveState=active\nSubState=running\nInvocationID=0F3A9C2E5B7D41A8B6C0D2E4F6A8B0C1\n",
            0,
            systemd.UnitState(
                "active", "running", None, invocation="0f3a9c2e5b7d41a8b6c0d2e4f6a8b0c1"
            ),
        ),
        (
            "ActiveState=inactive\nSubState=dead\nInvocationID=\n",
            0,
            systemd.UnitState("inactive", "dead", None),
        ),
        (
            "ActiveState=active\nSubState=running\nInvocationID=0f3a-not-hex-0000000000000000000\n",
            0,
            systemd.UnitState("active", "running", None),
        ),
        # systemd cannot say, or something in its place says nothing of it: unknown.
        ("", 1, None),
        ("ExecStart=x\n", 0, None),
    ],
)
def test_unit_state_reads_active_sub_state_and_restarts(
    stdout: str, code: int, expected: systemd.UnitState | None
) -> None:
    runner = FakeSystemctl(stdout, code)
    assert systemd.unit_state(runner, "sglang.service") == expected
    assert runner.argv == [
        "systemctl",
        "show",
        "--property=ActiveState",
        "--property=SubState",
        "--property=NRestarts",
        "--property=Result",
        "--property=ExecMainCode",
        "--property=ExecMainStatus",
        "--property=Job",
        "--property=InvocationID",
        "sglang.service",
    ]
    if expected is not None:
        assert expected.stopped == (expected.active == "inactive" and expected.job is None)


@pytest.mark.parametrize(
    ("code", "status", "expected"),
    [
        # systemd's own statuses: its setup of the process failed, the program never ran.
        (1, 200, "200/CHDIR"),
        (1, 203, "203/EXEC"),
        (1, 217, "217/USER"),
        (1, 219, "219/CGROUP"),
        (1, 226, "226/NAMESPACE"),
        (1, 244, "244/BPF"),
        (1, 246, "246/MEMORY_THP"),
        # The program's own exit statuses, among them those systemd retired (223, 234), its
        # EXCEPTION (255, also any program's exit(-1)) and none past its range.
        (1, 0, None),
        (1, 1, None),
        (1, 199, None),
        (1, 223, None),
        (1, 234, None),
        (1, 247, None),
        (1, 255, None),
        # A signal (killed, dumped): ExecMainStatus= is its number, whatever it is.
        (2, 9, None),
        (2, 219, None),
        (3, 6, None),
        # No process ended since the start, or nothing known.
        (0, 0, None),
        (None, 219, None),
        (1, None, None),
    ],
)
def test_setup_failure_is_an_exit_with_one_of_systemds_own_statuses(
    code: int | None, status: int | None, expected: str | None
) -> None:
    assert systemd.setup_failure(code, status) == expected
    assert systemd.UnitState("failed", "failed", 0, "exit-code", code, status).setup_failure == (
        expected
    )


@pytest.mark.parametrize(
    ("stdout", "code", "expected"),
    [
        # As systemd 252 prints them: its default (DefaultStartLimitIntervalSec=10s,
        # DefaultStartLimitBurst=5), an operator's, one that is never forgotten.
        ("StartLimitIntervalUSec=10s\nStartLimitBurst=5\n", 0, systemd.StartLimit(10.0, 5)),
        ("StartLimitIntervalUSec=1h\nStartLimitBurst=2\n", 0, systemd.StartLimit(3600.0, 2)),
        (
            "StartLimitIntervalUSec=infinity\nStartLimitBurst=3\n",
            0,
            systemd.StartLimit(math.inf, 3),
        ),
        # No limit (StartLimitIntervalSec=0 or StartLimitBurst=0), or nothing said of it.
        ("StartLimitIntervalUSec=0\nStartLimitBurst=5\n", 0, None),
        ("StartLimitIntervalUSec=10s\nStartLimitBurst=0\n", 0, None),
        ("StartLimitIntervalUSec=soon\nStartLimitBurst=5\n", 0, None),
        ("", 1, None),
        ("ExecStart=x\n", 0, None),
    ],
)
def test_start_limit_reads_the_units_interval_and_burst(
    stdout: str, code: int, expected: systemd.StartLimit | None
) -> None:
    runner = FakeSystemctl(stdout, code)
    assert systemd.start_limit(runner, "sglang.service") == expected
    assert runner.argv == [
        "systemctl",
        "show",
        "--property=StartLimitIntervalUSec",
        "--property=StartLimitBurst",
        "sglang.service",
    ]
