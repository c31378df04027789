"""The one way specd runs a program: argv only, no shell, bounded in time, never raising.

In the daemon, the applier (specd/io/apply.py) is the only caller that changes anything:
``systemctl --no-ask-password restart UNIT`` and ``systemctl --no-ask-password reset-failed
UNIT`` (clearing the unit's start limit before a rollback's restart, or when systemd refused a
start for it), the two verbs specd's polkit rule allows, on that unit only. Everything else
run through it only reads: ``systemctl show`` and ``is-active`` (the applier, the daemon,
`specd status`, `doctor`, `override`, `recommend`), ``pkcheck`` (`doctor`). `specd install`
and `uninstall`, run by root, use it for their own systemctl commands, `specd sweep` for the
applier's. Tests swap in any callable with the same signature (the ``Runner`` protocol).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

# Directories a service manager's tools live in; appended to the inherited PATH so that a
# daemon started with an empty or odd PATH still finds systemctl, while a PATH that puts a
# stand-in first (a developer laptop without systemd) keeps working.
SANE_PATH_DIRS = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
# Variables passed through from specd's own environment: the bus address lets systemctl reach
# a non-default bus; nothing else from the daemon's environment should leak into children.
PASSTHROUGH_ENV = ("DBUS_SYSTEM_BUS_ADDRESS", "SYSTEMD_LOG_LEVEL", "HOME")
# Output kept per stream; systemctl prints a few lines, anything longer is noise.
MAX_OUTPUT_CHARS = 64 * 1024
# After killing a timed-out process group, how long to wait for its pipes to close.
REAP_TIMEOUT_S = 2.0
# While a program runs, ``beat`` is called at least this often: a `systemctl restart` that
# waits minutes for SGLang to stop is the daemon's loop waiting, not a hung loop.
WAIT_SLICE_S = 1.0

EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127


@dataclass(frozen=True)
class RunResult:
    """What a program did. ``returncode`` is negative (-signal) when it was killed."""

    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    duration_s: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def summary(self) -> str:
        """One line for logs and journals: the command, how it ended, its last stderr line."""
        cmd = " ".join(self.argv) or "<empty command>"
        if self.timed_out:
            how = f"timed out after {self.duration_s:.1f} s"
        elif self.returncode < 0:
            how = f"killed by signal {-self.returncode}"
        else:
            how = f"exit {self.returncode}"
        lines = [line.strip() for line in self.stderr.splitlines() if line.strip()]
        detail = f": {lines[-1]}" if lines else ""
        return f"`{cmd}` {how}{detail}"


class Runner(Protocol):
    def __call__(self, argv: Sequence[str], *, timeout_s: float) -> RunResult: ...


def sane_path(inherited: str | None) -> str:
    parts = [p for p in (inherited or "").split(os.pathsep) if p]
    parts += [d for d in SANE_PATH_DIRS if d not in parts]
    return os.pathsep.join(parts)


def child_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment children get: C locale (parseable, untranslated output), sane PATH."""
    source = os.environ if base is None else base
    env = {name: source[name] for name in PASSTHROUGH_ENV if name in source}
    env["PATH"] = sane_path(source.get("PATH"))
    env["LC_ALL"] = "C"
    env["LANG"] = "C"
    return env


def _decode(data: bytes | None) -> str:
    text = (data or b"").decode("utf-8", errors="replace")
    if len(text) > MAX_OUTPUT_CHARS:
        return text[:MAX_OUTPUT_CHARS] + "\n[output truncated]"
    return text


class SubprocessRunner:
    """Runs argv with a timeout; on timeout kills the whole process group. Never raises.

    ``beat``, when given, is called on every ``WAIT_SLICE_S`` slice of the wait.
    """

    def __init__(
        self,
        env: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        beat: Callable[[], None] | None = None,
    ) -> None:
        self._env = child_env(env)
        self._clock = clock
        self._beat = beat

    def __call__(self, argv: Sequence[str], *, timeout_s: float) -> RunResult:
        args = tuple(str(a) for a in argv)
        started = self._clock()
        if not args:
            return RunResult(args, EXIT_NOT_FOUND, "", "empty command", False, 0.0)
        try:
            # A session of its own makes the child a process-group leader, so a timeout can
            # kill everything it spawned, and a terminal's Ctrl-C aimed at specd spares it.
            # stdin is /dev/null rather than a closed fd 0: a closed fd 0 would be reused by
            # the child's first open() and confuse programs that read stdin.
            proc = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=self._env,
                start_new_session=True,
                close_fds=True,
            )
        except FileNotFoundError:
            return self._failed(args, EXIT_NOT_FOUND, f"command not found: {args[0]}", started)
        except PermissionError:
            return self._failed(args, EXIT_NOT_EXECUTABLE, f"permission denied: {args[0]}", started)
        except (OSError, ValueError) as exc:
            return self._failed(args, EXIT_NOT_EXECUTABLE, f"cannot run {args[0]}: {exc}", started)

        try:
            out, err = self._communicate(proc, max(timeout_s, 0.0))
        except subprocess.TimeoutExpired:
            self._kill_group(proc)
            try:
                out, err = proc.communicate(timeout=REAP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                # A descendant left the group and holds the pipes open: stop reading.
                for stream in (proc.stdout, proc.stderr):
                    if stream is not None:
                        stream.close()
                proc.wait()
                out, err = b"", b""
            return RunResult(
                args,
                proc.returncode,
                _decode(out),
                _decode(err),
                True,
                self._clock() - started,
            )
        return RunResult(
            args, proc.returncode, _decode(out), _decode(err), False, self._clock() - started
        )

    def _communicate(self, proc: subprocess.Popen[bytes], timeout_s: float) -> tuple[bytes, bytes]:
        """communicate() within ``timeout_s``, in slices that beat; TimeoutExpired past it."""
        if self._beat is None:
            return proc.communicate(timeout=timeout_s)
        end = time.monotonic() + timeout_s
        while True:
            self._beat()
            left = end - time.monotonic()
            try:
                # communicate() may be called again after a TimeoutExpired: the output read
                # so far is kept.
                return proc.communicate(timeout=max(0.0, min(left, WAIT_SLICE_S)))
            except subprocess.TimeoutExpired:
                if left <= WAIT_SLICE_S:
                    raise

    @staticmethod
    def _kill_group(proc: subprocess.Popen[bytes]) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        except PermissionError:
            proc.kill()

    def _failed(self, args: tuple[str, ...], code: int, message: str, started: float) -> RunResult:
        return RunResult(args, code, "", message, False, self._clock() - started)
