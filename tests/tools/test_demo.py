"""`specd demo`, the README's main command, end to end as a user runs it."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

from prometheus_client import CollectorRegistry

from specd.commands.demo import _summary
from specd.daemon import Daemon
from specd.io.notify import Notifier
from specd.io.state import State, StateStore
from specd.tools.demo import DemoRecord, demo_config


def test_demo_restarts_to_two_step_counts_and_exits_0() -> None:
    # A shorter day than the README's, same phases: quiet → burst → quiet.
    proc = subprocess.run(
        [sys.executable, "-m", "specd.cli", "demo", "--duration-s", "60", "--json"],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout)
    assert set(summary["restarts_to_steps"]) == {3, 4}, summary
    assert all(r["result"] == "success" for r in summary["restarts"]), summary
    # Each restart says why: the decision that asked for it.
    assert all(r["reason"].startswith("change: ") for r in summary["restarts"]), summary
    assert summary["frozen"] is None
    assert summary["output_tokens"] > 0
    assert summary["decisions"].get("change", 0) >= 2
    # Every restart shows as time spent at both step counts.
    assert set(summary["seconds_at_steps"]) == {"3", "4"}


def test_demo_piped_prints_line_events_while_it_runs() -> None:
    # Before: piped, the live view printed nothing until the end (CI logs, `| tee`).
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "specd.cli", "demo", "--duration-s", "45"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    arrivals: list[tuple[float, str]] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            arrivals.append((time.monotonic() - started, line.rstrip("\n")))
        assert proc.wait(timeout=180) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        proc.kill()
    ended = time.monotonic() - started
    text = "\n".join(line for _, line in arrivals)
    assert "\x1b[" not in text  # no terminal control codes in a log
    during = [line for at, line in arrivals if at < ended - 15]
    assert any("load → 2 clients" in line for line in during), arrivals
    assert sum("clients; steps" in line for line in during) >= 3, arrivals  # status lines
    restarts = [line for _, line in arrivals if " restart " in line and " → " in line]
    assert restarts, text
    assert all(" — change: " in line for line in restarts), restarts
    summary = text.split("summary", 1)[1]
    assert " — change: " in summary, summary


def test_demo_with_a_workdir_that_cannot_be_one_says_so(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    for workdir in (afile, afile / "sub"):
        proc = subprocess.run(
            [sys.executable, "-m", "specd.cli", "demo", "--workdir", str(workdir)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert proc.returncode == 2
        assert proc.stderr.startswith(f"specd demo: --workdir {workdir}: "), proc.stderr
        assert proc.stderr.count("\n") == 1
        assert "Traceback" not in proc.stderr


def test_demo_whose_daemon_cannot_start_says_so_at_once(tmp_path: Path) -> None:
    """Its metrics port taken, the daemon stops at start: the demo said nothing of it, ran
    its whole length showing "steps ?" and exited 0 with an empty summary."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "specd.cli", "demo", "--metrics-port", str(port),
             "--workdir", str(tmp_path)],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert time.monotonic() - started < 40  # not the demo's 45 s and more
    assert "specd demo: specd stopped at start (exit 1); its log: " in proc.stderr
    assert "metrics_listen_failed" in proc.stderr
    assert "Traceback" not in proc.stderr


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
