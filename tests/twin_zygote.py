"""Twins (and `specd run`) forked from one interpreter that imported them once (a "zygote").

A twin started as ``python -m specd.cli twin`` spends ~0.3 s of CPU importing aiohttp and
the twin before it listens, a ``specd run`` ~0.45 s importing the daemon; the apply, fault
and fleet tests start hundreds of twins (every restart of a twin "unit" is a start) and
dozens of daemons. Forked from a process that has done those imports, a start costs
~0.03 s. What the tests talk to is the same: a process of its own running
``specd.cli.main([COMMAND, ...])``, with its own pid, port, log, environment, signals and
exit code (reported back by the zygote, which is its parent and reaps it).

Run as a script, this file is the zygote: it listens on a Unix socket for one JSON line per
connection, ``{"argv": [...], "log": PATH, "session": bool, "cwd": DIR|null, "command":
"twin"|"run", "env": {...}|null}``, forks, and answers ``{"pid": N}``, then ``{"exit":
CODE}`` (Popen's returncode) when that process ends, if the connection is still open. It
exits, killing its children, when its stdin closes (the test process that started it is
gone).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from specd.twin.process import TwinProcess
from specd.twin.unit import TwinUnitRunner

CLI_PATH = str(Path(__file__).resolve().parents[1] / "specd" / "cli.py")


class ForkedProc:
    """The part of ``subprocess.Popen`` the twin helpers use, for a twin the zygote forked:
    its exit code comes over the connection that asked for it."""

    def __init__(self, conn: socket.socket, pid: int) -> None:
        self._conn = conn
        self._buffer = b""
        self._lock = threading.Lock()
        self.pid = pid
        self.returncode: int | None = None

    def _read(self, timeout: float | None) -> None:
        if self.returncode is not None:
            return
        self._conn.settimeout(timeout)
        try:
            while b"\n" not in self._buffer:
                data = self._conn.recv(4096)
                if not data:  # the zygote is gone: so are its twins
                    self.returncode = -signal.SIGKILL
                    return
                self._buffer += data
        except (BlockingIOError, TimeoutError):
            return
        self.returncode = int(json.loads(self._buffer.split(b"\n", 1)[0])["exit"])
        self._conn.close()

    def poll(self) -> int | None:
        # Another thread in wait() holds the lock: the code is not in yet, or is being read.
        if self._lock.acquire(blocking=False):
            try:
                self._read(0.0)
            finally:
                self._lock.release()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self._lock:
            self._read(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"twin {self.pid}", timeout or 0.0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The zygote process of this test process, started on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self.socket_path = ""

    def ensure(self) -> str:
        """The zygote's socket, the zygote started first if it is not running."""
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                return self.socket_path
            directory = tempfile.mkdtemp(prefix="specd-zygote-")
            self.socket_path = os.path.join(directory, "sock")
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            self._proc = subprocess.Popen(
                [sys.executable, __file__, self.socket_path],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
            )
            assert self._proc.stdout is not None
            ready = self._proc.stdout.readline()  # the imports done, the socket bound
            if ready.strip() != b"ready":
                raise RuntimeError(f"twin zygote did not start: {ready!r}")
            return self.socket_path

    def spawn(
        self,
        argv: Sequence[str],
        log: str,
        *,
        session: bool = False,
        cwd: str | None = None,
        command: str = "twin",
        env: Mapping[str, str] | None = None,
    ) -> ForkedProc:
        """Fork ``specd COMMAND ARGV`` (twin or run) with stdout and stderr appended to
        ``log``, in ``env`` (None: the zygote's, which is this process's)."""
        path = self.ensure()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(path)
        request = {
            "argv": list(argv),
            "log": log,
            "session": session,
            "cwd": cwd,
            "command": command,
            "env": None if env is None else dict(env),
        }
        conn.sendall(json.dumps(request).encode() + b"\n")
        answer = b""
        while not answer.endswith(b"\n"):
            data = conn.recv(4096)
            if not data:
                raise RuntimeError("twin zygote closed the connection")
            answer += data
        return ForkedProc(conn, int(json.loads(answer)["pid"]))

    def close(self) -> None:
        with self._lock:
            if self._proc is not None:
                assert self._proc.stdin is not None
                self._proc.stdin.close()  # the zygote kills its twins and exits
                try:
                    self._proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
                self._proc = None
            if self.socket_path:
                with contextlib.suppress(OSError):
                    os.unlink(self.socket_path)
                    os.rmdir(os.path.dirname(self.socket_path))


ZYGOTE = Zygote()
atexit.register(ZYGOTE.close)


class ForkedTwin(TwinProcess):
    """``TwinProcess`` (same arguments and methods) whose process the zygote forks."""

    # The forked child opens the log itself; this handle only keeps stop()'s close.
    _LOG_MODE = "ab"

    def __init__(
        self,
        args: Sequence[str] = (),
        port: int | None = None,
        env: Mapping[str, str] | None = None,
        log_path: str | None = None,
    ) -> None:
        if env is not None:
            raise ValueError("a forked twin runs in the zygote's environment")
        super().__init__(args, port, None, log_path)

    def _spawn(self, twin_args: list[str], env: Mapping[str, str] | None) -> Any:
        return ZYGOTE.spawn(twin_args, self.log_path)


class ForkedUnit(TwinUnitRunner):
    """``TwinUnitRunner`` (a twin restarted like a unit) whose every start is forked."""

    def start(self) -> TwinProcess:
        with self._lock:
            self.process = ForkedTwin(self.argv(), port=self.port)
            return self.process


# -- the zygote itself ----------------------------------------------------------------------


def _child(request: dict[str, Any], closing: list[Any]) -> None:
    """In the forked child: become ``python -m specd.cli COMMAND ARGV``, never return."""
    code = 1
    command = request.get("command") or "twin"
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for thing in closing:
            if isinstance(thing, int):
                os.close(thing)
            else:
                thing.close()
        if request.get("session"):
            os.setsid()
        if request.get("cwd"):
            os.chdir(request["cwd"])
        if request.get("env") is not None:
            os.environ.clear()
            os.environ.update(request["env"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(null)
        os.close(log)
        import random  # noqa: PLC0415

        random.seed()  # not the zygote's sequence in every twin
        from specd import cli  # noqa: PLC0415

        sys.argv = [CLI_PATH, command, *request["argv"]]
        try:
            code = cli.main([command, *request["argv"]])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback  # noqa: PLC0415

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def serve(socket_path: str) -> None:
    # What `specd twin` imports before it listens. (The twin sets SSL_CERT_FILE first, to
    # spare aiohttp's import the CA bundle: imported once here, that is paid once, and each
    # twin still sets it; a forked `specd run` gets the environment it asks for.)
    import specd.cli  # noqa: PLC0415
    import specd.twin.cli  # noqa: PLC0415
    import specd.twin.server  # noqa: PLC0415

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(wake_r, selectors.EVENT_READ, "child")
    selector.register(sys.stdin, selectors.EVENT_READ, "parent")
    waiting: dict[socket.socket, bytes] = {}
    children: dict[int, socket.socket] = {}
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        for key, _ in selector.select():
            if key.data == "parent":  # the test process is gone (or done): so are we
                for pid in children:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                for pid in children:
                    with contextlib.suppress(ChildProcessError):
                        os.waitpid(pid, 0)
                return
            if key.data == "accept":
                conn, _ = listener.accept()
                waiting[conn] = b""
                selector.register(conn, selectors.EVENT_READ, "request")
            elif key.data == "request":
                conn = key.fileobj  # type: ignore[assignment]
                data = conn.recv(65536)
                waiting[conn] += data
                if not data or b"\n" in waiting[conn]:
                    selector.unregister(conn)
                    line = waiting.pop(conn)
                    if not data and b"\n" not in line:
                        conn.close()
                        continue
                    request = json.loads(line.split(b"\n", 1)[0])
                    if request.get("command") == "run":
                        # The daemon's imports, once, before the first `specd run` forks.
                        import specd.commands.run  # noqa: F401, PLC0415
                    closing = [listener, selector, wake_r, wake_w, *waiting, *children.values()]
                    pid = os.fork()
                    if pid == 0:
                        _child(request, [*closing, conn])
                    children[pid] = conn
                    with contextlib.suppress(OSError):
                        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            else:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
                while children:
                    try:
                        pid, status = os.waitpid(-1, os.WNOHANG)
                    except ChildProcessError:
                        break
                    if pid == 0:
                        break
                    conn = children.pop(pid, None)
                    if conn is not None:
                        with contextlib.suppress(OSError):
                            code = os.waitstatus_to_exitcode(status)
                            conn.sendall(json.dumps({"exit": code}).encode() + b"\n")
                        conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
