"""The twin served from a thread of the test process, for tests whose point is what the
twin answers over HTTP, not the process it is.

A ``specd twin`` process spends ~0.27 s of CPU and ~0.25 s of wall importing aiohttp and
the twin before it listens, and the twin tests start one or two per test. Here the test
process has imported them once; each twin is the same code (``specd.twin.server.run_until``
on the same resolved command line) on its own event loop in its own thread, listening on
its own port on 127.0.0.1: the same endpoints, pages, warm-up and timers.

What it is not: a process. It has the test process's pid, no log file, no signals and no
exit code of its own (``stop`` sets what SIGTERM sets, then waits for the drain). Tests of
those (exit codes, SIGTERM, a port closed by a restart, new pids per start, the log, the
environment read at start) keep ``specd.twin.process.TwinProcess``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import threading
from collections.abc import Mapping, Sequence
from types import TracebackType

from specd.twin import cli as twin_cli
from specd.twin.launch import TwinConfig, resolve
from specd.twin.process import HOST, free_port, wait_until_healthy
from specd.twin.server import run_until

# A twin that is up at once: the load and warm-up timers are what a test of them sets.
INSTANT = ("--load-time-s", "0", "--warmup-s", "0")


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """``specd twin ARGV`` read as the command reads it (that SGLang version's options)."""
    parser = argparse.ArgumentParser(prog="specd twin")
    twin_cli.configure(parser)
    return parser.parse_args(list(argv))


class TwinThread:
    """``specd twin ARGS --host 127.0.0.1 --port PORT`` on a thread of this process; the
    part of ``TwinProcess``'s interface that is not about the process."""

    def __init__(
        self,
        args: Sequence[str] = (),
        port: int | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.port = port if port is not None else free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.args = list(args)
        argv = [*self.args, "--host", HOST, "--port", str(self.port)]
        # A command line the twin refuses raises here (TwinConfigError, SystemExit).
        self.config: TwinConfig = resolve(parse(argv), argv=["specd", "twin", *argv], env=env)
        self.returncode: int | None = None
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._task: asyncio.Task[int] | None = None
        started = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(started,), name=f"twin-{self.port}", daemon=True
        )
        self._thread.start()
        started.wait()

    def _run(self, started: threading.Event) -> None:
        async def main() -> int:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            self._task = asyncio.current_task()  # type: ignore[assignment]
            started.set()
            return await run_until(self.config, self._stop)

        try:
            self.returncode = asyncio.run(main())
        except asyncio.CancelledError:
            self.returncode = -9  # kill(): whatever ran is lost, as with SIGKILL
        except BaseException as exc:  # re-raised in the test's thread (stop)
            self._error = exc
            self.returncode = 1
        finally:
            started.set()

    def poll(self) -> int | None:
        return None if self._thread.is_alive() else self.returncode

    def wait_healthy(self, timeout_s: float = 30.0) -> None:
        """Wait until /health answers 200; raise RuntimeError if the twin ends or times out."""

        def ended() -> str | None:
            if self._thread.is_alive():
                return None
            return f"twin ended with {self.returncode} before healthy: {self._error!r}"

        wait_until_healthy(self.url, timeout_s, ended, interval_s=0.01)

    def terminate(self) -> None:
        """What SIGTERM does to the twin: unhealthy, drain, end."""
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            with contextlib.suppress(RuntimeError):  # its loop just closed
                self._loop.call_soon_threadsafe(self._stop.set)

    def kill(self) -> None:
        """What SIGKILL does: the twin ends now, whatever runs is lost."""
        if self._loop is not None and self._task is not None and self._thread.is_alive():
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._task.cancel)

    def wait(self, timeout_s: float = 10.0) -> int:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"twin on {self.url} still running after {timeout_s:g} s")
        assert self.returncode is not None
        return self.returncode

    def stop(self, timeout_s: float = 10.0) -> int:
        """Terminate, wait; kill if it does not end; the exit code."""
        self.terminate()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self.kill()
        code = self.wait(timeout_s)
        if self._error is not None:
            raise RuntimeError(f"twin on {self.url} failed") from self._error
        return code

    def __enter__(self) -> TwinThread:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
