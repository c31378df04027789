"""Run the twin as a real subprocess on 127.0.0.1 (tests, the demo, colleagues' tools)."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import httpx

from specd.io.tls import verifying_context

HOST = "127.0.0.1"


# Ports free_port() handed out in this process: nothing holds one until its server binds
# it, and the kernel's bind(0) can offer the same port again meanwhile (two specds of one
# fleet test once got the same metrics port, and the second failed to listen).
_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()


@dataclass(frozen=True)
class _OwnPorts:
    ports: tuple[int, ...]
    owner_pid: int


_own: _OwnPorts | None = None


def use_ports(ports: Iterable[int]) -> None:
    """Hand out ports from ``ports`` in this process (not in children it forks, which use
    the kernel's choice), drawn at random. For processes that each run servers side by side
    (the test workers): give each its own ports below the kernel's ephemeral range, and no
    other is offered one a process has handed out but not yet bound, nor does an outgoing
    connection take it meanwhile; drawn at random, two runs side by side seldom meet."""
    global _own
    chosen = tuple(dict.fromkeys(ports))
    if not chosen or not all(0 < port < 65536 for port in chosen):
        raise ValueError(f"bad ports to hand out: {len(chosen)}, from {min(chosen, default=0)}")
    _own = _OwnPorts(chosen, os.getpid())


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def _from_own(own: _OwnPorts) -> int | None:
    left = [port for port in own.ports if port not in _handed_out]
    random.shuffle(left)  # spreads, not secret
    return next((port for port in left if _bindable(port)), None)


def _from_kernel() -> int:
    for _ in range(1000):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((HOST, 0))
            port = int(sock.getsockname()[1])
        if port not in _handed_out:
            return port
    raise RuntimeError("the kernel offered only ports this process has handed out already")


def free_port() -> int:
    """A port nothing listens on right now and that this process has not handed out before:
    from this process's own ports (``use_ports``) while one is left, else the kernel's
    choice (bind port 0)."""
    with _handed_out_lock:
        port = None
        if _own is not None and _own.owner_pid == os.getpid():
            port = _from_own(_own)
        if port is None:
            port = _from_kernel()
        _handed_out.add(port)
        return port


def stop_process(
    proc: subprocess.Popen[Any], grace_s: float = 10.0, kill_wait_s: float = 10.0
) -> int:
    """A graceful stop: SIGTERM, up to ``grace_s`` for it to exit, then SIGKILL and up to
    ``kill_wait_s`` more; returns the exit code. A process already gone is only reaped."""
    if proc.poll() is None:
        proc.terminate()
        try:
            return proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait(timeout=kill_wait_s)


def wait_until_healthy(
    url: str, timeout_s: float, ended: Callable[[], str | None], interval_s: float
) -> None:
    """Poll ``url``/health until it answers 200. RuntimeError with ``ended()``'s reason as
    soon as it gives one (the twin is gone), or once ``timeout_s`` has passed."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0, verify=verifying_context()) as client:
        while time.monotonic() < deadline:
            why = ended()
            if why is not None:
                raise RuntimeError(why)
            with contextlib.suppress(httpx.HTTPError):
                if client.get(url + "/health").status_code == 200:
                    return
            time.sleep(interval_s)
    raise RuntimeError(f"twin on {url} not healthy after {timeout_s:g} s")


class TwinProcess:
    """``specd twin ARGS --host 127.0.0.1 --port PORT`` as a child process.

    stdout/stderr go to ``.log_path`` (a temp file) so a chatty twin never blocks on a full
    pipe; ``.log()`` reads it back.
    """

    def __init__(
        self,
        args: Sequence[str] = (),
        port: int | None = None,
        env: Mapping[str, str] | None = None,
        log_path: str | None = None,
    ) -> None:
        self.port = port if port is not None else free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.args = list(args)
        # A log we made ourselves is removed on stop(); one the caller named is kept.
        self._own_log = log_path is None
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="specd-twin-", suffix=".log")
            os.close(fd)
        self.log_path = log_path
        self._log = open(log_path, self._LOG_MODE)  # noqa: SIM115  (closed in stop())
        self.proc = self._spawn([*self.args, "--host", HOST, "--port", str(self.port)], env)
        self.pid = self.proc.pid

    # How the log is opened: a fresh child writes it from the start.
    _LOG_MODE = "wb"

    def _spawn(self, twin_args: list[str], env: Mapping[str, str] | None) -> Any:
        """Start ``specd twin TWIN_ARGS``, its output to the log; the process (a Popen, or
        what a subclass starts it with: poll, wait, pid, send_signal)."""
        full_env = dict(os.environ if env is None else env)
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        argv = [sys.executable, "-m", "specd.cli", "twin", *twin_args]
        return subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=full_env)

    def log(self) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as fh:
                return fh.read()
        except FileNotFoundError:
            return ""

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait_healthy(self, timeout_s: float = 30.0) -> None:
        """Wait until /health answers 200; raise RuntimeError if the twin exits or times out."""

        def exited() -> str | None:
            if self.proc.poll() is None:
                return None
            tail = self.log().strip()[-500:]
            return f"twin exited with {self.proc.returncode} before healthy: {tail}"

        wait_until_healthy(self.url, timeout_s, exited, interval_s=0.05)

    def wait(self, timeout_s: float = 10.0) -> int:
        return self.proc.wait(timeout=timeout_s)

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM, wait, SIGKILL if it does not go; returns the exit code."""
        code = stop_process(self.proc, timeout_s, timeout_s)
        self._log.close()
        if self._own_log:
            with contextlib.suppress(OSError):
                os.unlink(self.log_path)
        return code

    def __enter__(self) -> TwinProcess:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
