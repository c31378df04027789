"""SubprocessRunner with real processes: environment, stdin, exit codes, timeouts."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from specd.io.runner import (
    EXIT_NOT_EXECUTABLE,
    EXIT_NOT_FOUND,
    RunResult,
    SubprocessRunner,
    child_env,
    sane_path,
)

PY = sys.executable


@pytest.mark.parametrize(
    ("code", "expect_out", "expect_err", "expect_rc"),
    [
        ("import os; print(os.environ['LC_ALL'])", "C\n", "", 0),
        ("import os; print(os.environ['LANG'])", "C\n", "", 0),
        ("import os; print('/usr/bin' in os.environ['PATH'].split(':'))", "True\n", "", 0),
        ("import os; print('SPECD_RUNNER_SECRET' in os.environ)", "False\n", "", 0),
        # stdin is /dev/null: a read sees end of file at once instead of blocking.
        ("import sys; print(repr(sys.stdin.read()))", "''\n", "", 0),
        ("import sys; sys.stderr.write('bad unit\\n'); sys.exit(5)", "", "bad unit\n", 5),
        ("import sys; sys.stdout.buffer.write(b'\\xff\\n')", "\ufffd\n", "", 0),
        ("import os; os.kill(os.getpid(), 9)", "", "", -signal.SIGKILL),
    ],
)
def test_child_sees_c_locale_devnull_stdin_and_exit_status(
    code: str, expect_out: str, expect_err: str, expect_rc: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPECD_RUNNER_SECRET", "1")
    monkeypatch.setenv("LC_ALL", "de_DE.UTF-8")
    result = SubprocessRunner()([PY, "-c", code], timeout_s=20)
    assert (result.stdout, result.stderr, result.returncode) == (
        expect_out,
        expect_err,
        expect_rc,
    )
    assert not result.timed_out
    assert result.ok == (expect_rc == 0)
    assert result.argv == (PY, "-c", code)


@pytest.mark.parametrize(
    ("argv", "file_mode", "expect_rc", "expect_in_stderr"),
    [
        (["/nonexistent/systemctl", "restart", "x"], None, EXIT_NOT_FOUND, "command not found"),
        (["specd-no-such-binary-xyz"], None, EXIT_NOT_FOUND, "command not found"),
        ([], None, EXIT_NOT_FOUND, "empty command"),
        (["bad\0arg"], None, EXIT_NOT_EXECUTABLE, "cannot run"),
        # A script without any execute bit: even root gets EACCES.
        (["{file}"], 0o644, EXIT_NOT_EXECUTABLE, "permission denied"),
        # Executable but not a program: ENOEXEC.
        (["{file}"], 0o755, EXIT_NOT_EXECUTABLE, "cannot run"),
    ],
)
def test_unrunnable_commands_become_results_not_exceptions(
    argv: list[str], file_mode: int | None, expect_rc: int, expect_in_stderr: str, tmp_path: Path
) -> None:
    target = tmp_path / "not-a-program"
    if file_mode is not None:
        target.write_bytes(b"\x00\x01garbage")
        target.chmod(file_mode)
    argv = [a.replace("{file}", str(target)) for a in argv]
    result = SubprocessRunner()(argv, timeout_s=5)
    assert result.returncode == expect_rc
    assert expect_in_stderr in result.stderr
    assert not result.ok
    assert "\n" not in result.summary()


def test_timeout_kills_the_whole_process_group(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    # The child starts a grandchild that would outlive it, then hangs.
    code = (
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen([{PY!r}, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(60)\n"
    )
    started = time.monotonic()
    result = SubprocessRunner()([PY, "-c", code], timeout_s=1.0)
    elapsed = time.monotonic() - started
    assert result.timed_out
    assert result.returncode == -signal.SIGKILL
    assert elapsed < 10
    assert "timed out" in result.summary()
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        # The grandchild is re-parented to init (or us, as subreaper); reap if it is ours.
        with contextlib.suppress(ChildProcessError):
            os.waitpid(grandchild, os.WNOHANG)
        time.sleep(0.05)
    else:
        pytest.fail(f"grandchild {grandchild} survived the timeout")


def test_a_long_run_beats_on_every_slice_and_keeps_its_output() -> None:
    # A `systemctl restart` waiting minutes for SGLang to stop: the daemon's loop is
    # waiting, not hung, so the runner keeps beating while it waits.
    beats: list[float] = []
    code = (
        "import sys, time\n"
        "print('stopping', flush=True)\n"
        "time.sleep(3.2)\n"
        "print('started'); sys.stderr.write('done\\n')\n"
    )
    runner = SubprocessRunner(beat=lambda: beats.append(time.monotonic()))
    started = time.monotonic()
    result = runner([PY, "-c", code], timeout_s=20)
    assert result.ok, result.summary()
    # Output read in one slice is kept when the next slice finishes the read.
    assert (result.stdout, result.stderr) == ("stopping\nstarted\n", "done\n")
    assert len(beats) >= 3
    gaps = [b - a for a, b in zip([started, *beats], [*beats, time.monotonic()], strict=True)]
    assert max(gaps) < 1.6, gaps


def test_beating_runner_still_kills_at_its_timeout() -> None:
    beats: list[float] = []
    runner = SubprocessRunner(beat=lambda: beats.append(time.monotonic()))
    started = time.monotonic()
    result = runner([PY, "-c", "import time; time.sleep(60)"], timeout_s=2.5)
    elapsed = time.monotonic() - started
    assert result.timed_out
    assert result.returncode == -signal.SIGKILL
    assert 2.4 <= elapsed < 5
    assert 2 <= len(beats) <= 4


@pytest.mark.parametrize(
    ("inherited", "expected_prefix", "must_contain"),
    [
        (None, "/usr/local/sbin", "/bin"),
        ("", "/usr/local/sbin", "/usr/bin"),
        ("/opt/stand-in", "/opt/stand-in:", "/usr/sbin"),
        ("/usr/bin:/opt/x", "/usr/bin:/opt/x:", "/sbin"),
    ],
)
def test_sane_path_keeps_inherited_order_and_adds_system_dirs(
    inherited: str | None, expected_prefix: str, must_contain: str
) -> None:
    path = sane_path(inherited)
    assert path.startswith(expected_prefix)
    parts = path.split(":")
    assert must_contain in parts
    assert len(parts) == len(set(parts))


@pytest.mark.parametrize(
    ("base", "expected"),
    [
        ({"PATH": "/x", "LC_ALL": "fr_FR", "SECRET": "s"}, {"PATH", "LC_ALL", "LANG"}),
        (
            {"HOME": "/root", "DBUS_SYSTEM_BUS_ADDRESS": "unix:path=/b"},
            {"PATH", "LC_ALL", "LANG", "HOME", "DBUS_SYSTEM_BUS_ADDRESS"},
        ),
    ],
)
def test_child_env_passes_only_what_children_need(base: dict[str, str], expected: set[str]) -> None:
    env = child_env(base)
    assert set(env) == expected
    assert env["LC_ALL"] == "C"


@pytest.mark.parametrize(
    ("result", "expected"),
    [
        (
            RunResult(("systemctl", "restart", "u"), 0, "", "", False, 0.1),
            "`systemctl restart u` exit 0",
        ),
        (
            RunResult(
                ("systemctl",), 1, "", "warn\nFailed to restart u: Access denied\n", False, 0.1
            ),
            "`systemctl` exit 1: Failed to restart u: Access denied",
        ),
        (RunResult(("x",), -9, "", "", True, 2.04), "`x` timed out after 2.0 s"),
        (RunResult(("x",), -15, "", "", False, 1.0), "`x` killed by signal 15"),
    ],
)
def test_summary_is_one_readable_line(result: RunResult, expected: str) -> None:
    assert result.summary() == expected
