"""`specd demo`, the README's main command, end to end as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys


def test_demo_restarts_to_two_step_counts_and_exits_0() -> None:
    # A shorter day than the README's, same phases: quiet → burst → quiet.
    proc = subprocess.run(
        [sys.executable, "-m", "specd.cli", "demo", "--duration", "60", "--json"],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout)
    assert set(summary["restarts_to_steps"]) == {3, 4}, summary
    assert all(r["result"] == "success" for r in summary["restarts"]), summary
    assert summary["frozen"] is None
    assert summary["output_tokens"] > 0
    assert summary["decisions"].get("change", 0) >= 2
    # Every restart shows as time spent at both step counts.
    assert set(summary["seconds_at_steps"]) == {"3", "4"}
