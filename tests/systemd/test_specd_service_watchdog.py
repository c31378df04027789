"""specd.service under a real systemd: the watchdog. Split from test_specd_service.py,
whose helpers it uses, so the slow systemd tests spread over the xdist workers (each worker
boots its own container, see conftest.py).
"""

from __future__ import annotations

import time

import pytest
from nspawn import (
    CONTAINER_PATH,
    REPO,
    SPECD_UNIT,
    VENV_PYTHON,
    Container,
)
from test_specd_service import (
    CONFIG_PATH,
    SPECD_URL,
    closed_window_config,
    events_named,
    journal_entries,
    journal_mark,
    pin_now,
    start_specd,
    start_twin,
    state,
    twin_live_steps,
    wait_or_dump,
)

pytestmark = [pytest.mark.systemd, pytest.mark.slow]


# -- 5. the watchdog --------------------------------------------------------------------------


def test_watchdog_kills_a_specd_that_stops_pinging(sd: Container) -> None:
    since = journal_mark(sd)
    watchdog_s = 3.0
    # No SGLang needed: specd runs (and pings) with its scrapes failing.
    pid = start_specd(
        sd, closed_window_config(sd), watchdog_s=watchdog_s, overrides=("RestartSec=1s",)
    )
    # A live specd pings: it outlives two watchdog periods.
    time.sleep(2 * watchdog_s)
    assert sd.main_pid(SPECD_UNIT) == pid
    assert sd.show(SPECD_UNIT, "NRestarts") == "0"

    sd.sh("kill", "-STOP", str(pid))
    wait_or_dump(
        sd,
        lambda: (p := sd.main_pid(SPECD_UNIT)) not in (0, pid) and p,
        timeout=watchdog_s + 15,
        what="systemd to kill and restart the silent specd",
    )
    assert int(sd.show(SPECD_UNIT, "NRestarts")) >= 1
    systemd_lines = [
        e["MESSAGE"] for e in journal_entries(sd, SPECD_UNIT, since) if e.get("_PID") == "1"
    ]
    assert any("Watchdog timeout" in m for m in systemd_lines), systemd_lines
    assert any("result 'watchdog'" in m for m in systemd_lines), systemd_lines


def systemd_messages(sd: Container, since: int) -> list[str]:
    return [e["MESSAGE"] for e in journal_entries(sd, SPECD_UNIT, since) if e.get("_PID") == "1"]


HANG_LOOP = REPO / "tests/systemd/hang_loop.py"


def test_watchdog_kills_a_specd_whose_loop_hangs(sd: Container) -> None:
    # The process stays alive (its metrics thread answers); only the loop thread blocks.
    since = journal_mark(sd)
    watchdog_s = 3.0
    pid = start_specd(
        sd,
        closed_window_config(sd),
        watchdog_s=watchdog_s,
        overrides=("RestartSec=1s",),
        exec_start=[str(VENV_PYTHON), str(HANG_LOOP), "run", "--config", CONFIG_PATH],
    )
    time.sleep(2 * watchdog_s)
    assert (sd.main_pid(SPECD_UNIT), sd.show(SPECD_UNIT, "NRestarts")) == (pid, "0")

    (sd.state_dir / "hang-loop").write_text("")
    wait_or_dump(
        sd,
        lambda: not (sd.state_dir / "hang-loop").exists(),
        timeout=5,
        what="the loop to reach the hang",
    )
    hung_at = time.monotonic()
    # Hung loop, live process: the metrics server thread still answers.
    assert sd.http_get("/metrics", base=SPECD_URL)["status"] == 200
    assert sd.main_pid(SPECD_UNIT) == pid
    wait_or_dump(
        sd,
        lambda: (p := sd.main_pid(SPECD_UNIT)) not in (0, pid) and p,
        timeout=watchdog_s + 15,
        what="systemd to kill and restart the specd whose loop hangs",
    )
    # Killed by the watchdog, within about one WatchdogSec of the hang (plus the restart).
    assert time.monotonic() - hung_at < watchdog_s + 6
    assert int(sd.show(SPECD_UNIT, "NRestarts")) >= 1
    messages = systemd_messages(sd, since)
    assert any("Watchdog timeout" in m for m in messages), messages
    assert any("result 'watchdog'" in m for m in messages), messages
    # The specd systemd started again runs a loop that beats.
    wait_or_dump(sd, lambda: sd.active_state(SPECD_UNIT) == "active", timeout=15)
    restarted = sd.main_pid(SPECD_UNIT)
    time.sleep(2 * watchdog_s)
    assert sd.main_pid(SPECD_UNIT) == restarted


# How long bin/systemctl's `restart` waits before it restarts.
RESTART_DELAY_S = 7.5


def test_a_long_healthy_restart_keeps_beating_and_is_not_killed(sd: Container) -> None:
    # `systemctl restart` that takes 7.5 s (2.5 WatchdogSec): the loop waits in the runner,
    # which beats, so systemd leaves specd alone while the restart runs to success.
    since = journal_mark(sd)
    watchdog_s = 3.0
    start_twin(sd, steps=4)
    slow_path = f"{REPO / 'tests/systemd/bin'}:{CONTAINER_PATH}"
    pid = start_specd(
        sd,
        closed_window_config(sd, restart_command_timeout_s=40.0),
        watchdog_s=watchdog_s,
        overrides=(f"Environment=PATH={slow_path}",),
    )
    pin_now(sd, 3)
    wait_or_dump(
        sd, lambda: events_named(sd, since, "restart_begin"), timeout=15, what="restart_begin"
    )
    begun = time.monotonic()
    restarts = wait_or_dump(
        sd, lambda: state(sd)["restarts"], timeout=45, what="the slow restart's outcome"
    )
    assert time.monotonic() - begun >= RESTART_DELAY_S - 1  # the stand-in's wait happened
    assert [(r["from_steps"], r["to_steps"], r["result"]) for r in restarts] == [(4, 3, "success")]
    assert restarts[0]["duration_s"] >= RESTART_DELAY_S
    assert twin_live_steps(sd) == (3, 3.0)
    assert (sd.main_pid(SPECD_UNIT), sd.show(SPECD_UNIT, "NRestarts")) == (pid, "0")
    messages = systemd_messages(sd, since)
    assert not any("Watchdog timeout" in m for m in messages), messages
