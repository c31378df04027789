"""`specd demo`, the README's main command, end to end as a user runs it."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest
from prometheus_client import CollectorRegistry

from specd.cli import main as specd_main
from specd.commands.demo import _summary
from specd.daemon import Daemon
from specd.io.notify import Notifier
from specd.io.state import State, StateStore
from specd.tools.demo import DemoRecord, demo_config


class Demo:
    """A `specd demo` child, its stdout and stderr read as they arrive (each line with the
    seconds since its start) so that the pipes never fill while another test runs."""

    def __init__(self, *args: str) -> None:
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "specd.cli", "demo", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.stdout: list[tuple[float, str]] = []
        self.stderr: list[tuple[float, str]] = []
        self.ended = 0.0  # seconds from the start to the end of its stdout
        assert self.proc.stdout is not None
        assert self.proc.stderr is not None
        self._readers = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self.stdout, True)),
            threading.Thread(target=self._read, args=(self.proc.stderr, self.stderr, False)),
        ]
        for reader in self._readers:
            reader.start()

    def _read(self, stream: IO[str], into: list[tuple[float, str]], is_stdout: bool) -> None:
        for line in stream:
            into.append((time.monotonic() - self.started, line))
        if is_stdout:
            self.ended = time.monotonic() - self.started

    def wait(self, timeout_s: float) -> int:
        code = self.proc.wait(timeout=timeout_s)
        for reader in self._readers:
            reader.join(timeout=10)
        return code

    @property
    def out(self) -> str:
        return "".join(line for _, line in self.stdout)

    @property
    def err(self) -> str:
        return "".join(line for _, line in self.stderr)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for reader in self._readers:
            reader.join(timeout=10)


@pytest.fixture(scope="module")
def demos(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Demo]]:
    """The module's `specd demo` children, started together by the first test that reads
    one: the two end-to-end runs are each a minute of load driven by the wall clock (a
    window every 20 s), not the CPU, so side by side they take one minute, not two. Each
    test still reads only its own run."""
    runs: dict[str, Demo] = {}
    with socket.socket() as taken:
        try:
            # A shorter day than the README's, same phases: quiet → burst → quiet.
            runs["json"] = Demo("--duration-s", "60", "--json")
            runs["piped"] = Demo("--duration-s", "45")
            # Its metrics port taken (held until the module ends).
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            workdir = tmp_path_factory.mktemp("port-taken")
            runs["port_taken"] = Demo("--metrics-port", str(port), "--workdir", str(workdir))
            yield runs
        finally:
            for run in runs.values():
                run.kill()


def test_demo_restarts_to_two_step_counts_and_exits_0(demos: dict[str, Demo]) -> None:
    demo = demos["json"]
    assert demo.wait(timeout_s=180) == 0, demo.err[-2000:]
    summary = json.loads(demo.out)
    assert set(summary["restarts_to_steps"]) == {3, 4}, summary
    assert all(r["result"] == "success" for r in summary["restarts"]), summary
    # Each restart says why: the decision that asked for it.
    assert all(r["reason"].startswith("change: ") for r in summary["restarts"]), summary
    assert summary["frozen"] is None
    assert summary["output_tokens"] > 0
    assert summary["decisions"].get("change", 0) >= 2
    # Every restart shows as time spent at both step counts.
    assert set(summary["seconds_at_steps"]) == {"3", "4"}


def test_demo_piped_prints_line_events_while_it_runs(demos: dict[str, Demo]) -> None:
    # Before: piped, the live view printed nothing until the end (CI logs, `| tee`).
    demo = demos["piped"]
    assert demo.wait(timeout_s=180) == 0, demo.err
    arrivals = [(at, line.rstrip("\n")) for at, line in demo.stdout]
    ended = demo.ended
    text = "\n".join(line for _, line in arrivals)
    assert "\x1b[" not in text  # no terminal control codes in a log
    during = [line for at, line in arrivals if at < ended - 15]
    assert any("load → 2 clients" in line for line in during), arrivals
    assert sum("clients; steps" in line for line in during) >= 3, arrivals  # status lines
    # A change is decided inside a window: a status line never pairs it with a closed one
    # (it showed the window as it was when printed, up to 10 s after the decision).
    changes = [line for _, line in arrivals if "decision change" in line]
    assert all("window open; decision change" in line for line in changes), changes
    restarts = [line for _, line in arrivals if " restart " in line and " → " in line]
    assert restarts, text
    assert all(" — change: " in line for line in restarts), restarts
    summary = text.split("summary", 1)[1]
    assert " — change: " in summary, summary


def test_demo_with_a_workdir_that_cannot_be_one_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # In process: the refusal comes before any child is started (the exit code and the
    # stream are the command's return and stderr; test_demo_whose_daemon_cannot_start_...
    # keeps a real process).
    afile = tmp_path / "afile"
    afile.write_text("")
    for workdir in (afile, afile / "sub"):
        assert specd_main(["demo", "--workdir", str(workdir)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"specd demo: --workdir {workdir}: "), err
        assert err.count("\n") == 1
        assert "Traceback" not in err


def test_demo_whose_daemon_cannot_start_says_so_at_once(demos: dict[str, Demo]) -> None:
    """Its metrics port taken, the daemon stops at start: the demo said nothing of it, ran
    its whole length showing "steps ?" and exited 0 with an empty summary."""
    demo = demos["port_taken"]
    code = demo.wait(timeout_s=120)
    assert code == 1, demo.out + demo.err
    assert demo.ended < 40  # not the demo's 45 s and more
    assert "specd demo: specd stopped at start (exit 1); its log: " in demo.err
    assert "metrics_listen_failed" in demo.err
    assert "Traceback" not in demo.err


def test_a_reused_workdir_summarises_this_run_only(tmp_path: Path) -> None:
    """The state of an earlier run in the same --workdir listed its restart as this run's
    ("3 → 4 … reason not seen")."""
    config = demo_config(tmp_path, 1, 2)
    earlier = {"t": 1.0, "from_steps": 3, "to_steps": 4, "result": "success", "duration_s": 6.0}
    assert StateStore(config.files.state_dir).save(State(restarts=[earlier])) is None
    daemon = Daemon(config, None, registry=CollectorRegistry(), notifier=Notifier(environ={}))
    before = len(daemon.state.restarts)
    assert before == 1
    now = {"t": 2.0, "from_steps": 4, "to_steps": 3, "result": "success", "duration_s": 8.0}
    daemon.state.restarts.append(now)
    record = DemoRecord(restart_reasons=["change: busy"])
    summary = _summary(daemon, record, 45.0, before)
    assert [(r["from_steps"], r["to_steps"], r["reason"]) for r in summary["restarts"]] == [
        (4, 3, "change: busy")
    ]
