"""`specd demo`, the README's main command, end to end as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
import time


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
