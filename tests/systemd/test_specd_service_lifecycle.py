"""specd.service's own start and stop while a restart of SGLang is in flight, under a real
systemd with short TimeoutStartSec=/TimeoutStopSec=/WatchdogSec= and a twin that loads for
longer than each (a 100B model loads for minutes; startup_timeout_s is 10 min by default):
its load is held (hold_next_start) until the test has seen specd outlast them.

systemd runs no watchdog while a unit starts or stops, only those timeouts: specd used to
replay an interrupted restart before READY=1 (killed by the start timeout mid-replay, and
again at the next start), start a pinned restart at its first tick before READY=1 (the
same), and finish a restart in flight on SIGTERM within a fixed TimeoutStopSec= shorter
than a restart and its rollback (SIGKILLed, the restart left to the next start). Then it
outlasted a 90 s TimeoutStopSec= only by extending it (EXTEND_TIMEOUT_USEC=), which systemd
forgets at a `systemctl daemon-reload`: SIGKILLed mid-restart by any daemon-reload (a
package upgrade, `specd install`) more than 90 s into the stop. The shipped unit's covers a
whole restart sequence now, and specd ends itself when its loop hangs while it stops.
Helpers from test_specd_service.py.
"""

from __future__ import annotations

import time

import pytest
from nspawn import REPO, SGLANG_UNIT, SPECD_UNIT, VENV_PYTHON, Container
from test_specd_service import (
    CONFIG_PATH,
    KILLED_CLEANUP,
    closed_window_config,
    env_steps,
    events_named,
    hold_next_start,
    journal_entries,
    journal_mark,
    pin_now,
    release,
    sglang_starts,
    sigkill_specd,
    specd_events,
    start_specd,
    start_twin,
    state,
    status_text,
    twin_live_steps,
    wait_or_dump,
)

pytestmark = [pytest.mark.systemd, pytest.mark.slow]

# systemd's timeouts, short; the twin's next start is held longer than any of them.
WATCHDOG_S = 4.0
START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 3.0
# Far longer than any held load: nothing below waits it out.
STARTUP_TIMEOUT_S = 60.0
# After the held twin is released: its own load, one health probe round, verification.
OUTCOME_S = 20.0
# specd.service's TimeoutStopSec= before it covered a restart sequence: a stop whose
# extensions a daemon-reload dropped was SIGKILLed this long after it began.
OLD_STOP_TIMEOUT_S = 90.0
HANG_STOP = REPO / "tests/systemd/hang_stop.py"
GUARD_TEST_STOP_TIMEOUT_S = 40.0


def hold_past(started: float, seconds: float) -> None:
    """Keep the held load going until ``seconds`` have passed since ``started``."""
    time.sleep(max(0.0, started + seconds + 0.5 - time.monotonic()))


def restart_in_flight(sd: Container, old_pid: int) -> int:
    """Wait until specd has restarted the twin, which is still loading: the new twin's pid."""

    def loading() -> int:
        if not (sd.state_dir / "state.json").exists():
            return 0  # a specd just started may not have saved any state yet
        journal = state(sd).get("journal") or {}
        pid = sd.main_pid(SGLANG_UNIT)
        return pid if journal.get("phase") == "restart_issued" and pid not in (0, old_pid) else 0

    pid = wait_or_dump(sd, loading, timeout=20, what="specd waiting on the restarted twin")
    assert sd.http_get("/health")["status"] != 200  # still loading
    return pid


def stop_while_restarting(sd: Container) -> str:
    """`systemctl stop specd` while a restart is in flight: STATUS= saying why it waits."""
    sd.systemctl("stop", "--no-block", SPECD_UNIT)
    text: str = wait_or_dump(
        sd,
        lambda: (t := status_text(sd)).startswith("stopping once the restart in flight ends") and t,
        timeout=5,
        what="STATUS= saying why the stop waits",
    )
    return text


def release_and_wait_stopped(sd: Container, loading_pid: int) -> None:
    """Let the held load finish; specd, stopping, ends once its restart has."""
    release(sd, loading_pid)
    wait_or_dump(
        sd,
        lambda: sd.active_state(SPECD_UNIT) == "inactive",
        timeout=OUTCOME_S,
        what="specd to stop once the restart ended",
    )


def kill_if_left(sd: Container) -> None:
    """A test that failed half-way may leave specd stopping (the twin held): SIGKILL it, so
    the container's reset is not held up by specd.service's TimeoutStopSec=."""
    if sd.active_state(SPECD_UNIT) in ("active", "activating", "deactivating", "reloading"):
        sd.systemctl("kill", "--signal=KILL", SPECD_UNIT, check=False)
        sd.wait_for(lambda: sd.active_state(SPECD_UNIT) in ("inactive", "failed"), timeout=60)


def systemd_says(sd: Container, since: int) -> list[str]:
    return [
        str(e["MESSAGE"]) for e in journal_entries(sd, SPECD_UNIT, since) if e.get("_PID") == "1"
    ]


def assert_finished_the_restart_and_exited_cleanly(
    sd: Container, since: str, loading_pid: int
) -> None:
    """specd stopped only once the restart in flight (4 → 3) was verified, with exit 0, and
    systemd neither timed it out nor killed it; SGLang kept the start that was loading."""
    assert sd.show(SPECD_UNIT, "Result") == "success"
    assert sd.show(SPECD_UNIT, "ExecMainStatus") == "0"
    saved = state(sd)
    assert saved["journal"] is None
    restarts = saved["restarts"]
    assert [(r["from_steps"], r["to_steps"], r["result"]) for r in restarts] == [(4, 3, "success")]
    assert sd.main_pid(SGLANG_UNIT) == loading_pid
    assert twin_live_steps(sd) == (3, 3.0)
    assert sglang_starts(sd, since) == 1
    said = systemd_says(sd, since)
    assert not any("timed out" in m or "Killing" in m for m in said), said


def test_a_replay_longer_than_the_start_timeout_runs_after_ready(sd: Container) -> None:
    """specd killed while SGLang loads: the next start is ready at once, says what it
    finishes, decides nothing until it has, and is neither timed out nor watchdog-killed."""
    old_pid = start_twin(sd, steps=4)
    config = closed_window_config(sd, startup_timeout_s=STARTUP_TIMEOUT_S)
    lines = (f"TimeoutStartSec={START_TIMEOUT_S:g}s", "Restart=no", KILLED_CLEANUP)
    specd_pid = start_specd(sd, config, watchdog_s=WATCHDOG_S, overrides=lines)
    hold_next_start(sd)
    pin_now(sd, 3)
    loading_pid = restart_in_flight(sd, old_pid)
    sigkill_specd(sd, specd_pid)
    sd.systemctl("reset-failed", SPECD_UNIT)

    since = journal_mark(sd)
    started = time.monotonic()
    sd.systemctl("start", SPECD_UNIT, timeout=60)  # Type=notify: returns at READY=1
    assert time.monotonic() - started < START_TIMEOUT_S
    assert sd.active_state(SPECD_UNIT) == "active"
    # Ready while the twin still loads, saying so.
    assert (state(sd).get("journal") or {}).get("phase") == "restart_issued"
    text = status_text(sd)
    assert text.startswith("finishing the restart interrupted when specd stopped (4 → 3): "), text
    assert "/health_generate" in text, text
    assert "no decision until it ends" in text, text

    hold_past(started, START_TIMEOUT_S + WATCHDOG_S)
    assert (state(sd).get("journal") or {}).get("phase") == "restart_issued"
    release(sd, loading_pid)
    restarts = wait_or_dump(
        sd, lambda: state(sd)["restarts"], timeout=OUTCOME_S, what="the replay's outcome"
    )
    assert time.monotonic() - started > START_TIMEOUT_S + WATCHDOG_S  # it outlasted both
    assert [(r["from_steps"], r["to_steps"], r["result"]) for r in restarts] == [(4, 3, "success")]
    assert state(sd)["journal"] is None
    # The twin specd was waiting on is the one serving, at 3 steps: no second restart.
    assert sd.main_pid(SGLANG_UNIT) == loading_pid
    assert env_steps(sd) == 3
    assert twin_live_steps(sd) == (3, 3.0)
    wait_or_dump(sd, lambda: status_text(sd).startswith("steps 3"), timeout=10)
    assert sd.active_state(SPECD_UNIT) == "active"
    assert sd.show(SPECD_UNIT, "NRestarts") == "0"
    said = systemd_says(sd, since)
    assert not any("timed out" in m or "Watchdog timeout" in m for m in said), said
    # The first decision comes after the replay's outcome.
    names = [e["event"] for _, e in specd_events(sd, since)]
    assert "restart_done" in names, names
    assert "decision" not in names[: names.index("restart_done")], names


def test_a_pinned_restart_at_the_first_tick_runs_after_ready(sd: Container) -> None:
    """A pin applied now, waiting when specd starts: the first tick restarts SGLang, and
    `systemctl start` returns before that restart's load, not at its end (or its timeout)."""
    old_pid = start_twin(sd, steps=4)
    hold_next_start(sd)
    config = closed_window_config(sd, startup_timeout_s=STARTUP_TIMEOUT_S)
    lines = (f"TimeoutStartSec={START_TIMEOUT_S:g}s", "Restart=no")
    sd.install_specd(config_toml=config, watchdog_sec=WATCHDOG_S, service_overrides=lines)
    pin_now(sd, 3)  # specd is not running yet: read at its first tick

    since = journal_mark(sd)
    started = time.monotonic()
    sd.systemctl("start", SPECD_UNIT, timeout=60)
    assert time.monotonic() - started < START_TIMEOUT_S
    loading_pid = restart_in_flight(sd, old_pid)
    wait_or_dump(
        sd,
        lambda: status_text(sd).startswith("restarting SGLang: 4 → 3: waiting for sglang"),
        timeout=5,
        what="STATUS= saying what the restart waits for",
    )

    # The load outlasts the start timeout and a watchdog period, as a model's does.
    hold_past(started, START_TIMEOUT_S + WATCHDOG_S)
    assert state(sd)["restarts"] == []
    release(sd, loading_pid)
    restarts = wait_or_dump(
        sd, lambda: state(sd)["restarts"], timeout=OUTCOME_S, what="the pinned restart"
    )
    assert [(r["from_steps"], r["to_steps"], r["result"]) for r in restarts] == [(4, 3, "success")]
    assert twin_live_steps(sd) == (3, 3.0)
    assert sd.active_state(SPECD_UNIT) == "active"
    assert sd.show(SPECD_UNIT, "NRestarts") == "0"
    said = systemd_says(sd, since)
    assert not any("timed out" in m or "Watchdog timeout" in m for m in said), said


def test_a_stop_waits_for_the_restart_in_flight_past_the_stop_timeout(sd: Container) -> None:
    """`systemctl stop specd` while SGLang loads: specd finishes the restart (verified) and
    exits cleanly long after TimeoutStopSec=, saying why meanwhile; nothing is left for the
    next start, and SGLang is not restarted again."""
    old_pid = start_twin(sd, steps=4)
    config = closed_window_config(sd, startup_timeout_s=STARTUP_TIMEOUT_S)
    lines = (f"TimeoutStopSec={STOP_TIMEOUT_S:g}s", "Restart=no")
    start_specd(sd, config, watchdog_s=WATCHDOG_S, overrides=lines)
    hold_next_start(sd)
    since = journal_mark(sd)
    pin_now(sd, 3)
    loading_pid = restart_in_flight(sd, old_pid)

    stopped = time.monotonic()
    text = stop_while_restarting(sd)
    assert "(4 → 3): waiting for sglang.service to restart" in text, text
    assert "killed now, specd's next start finishes it" in text, text
    # Past TimeoutStopSec= and a watchdog period, still finishing.
    hold_past(stopped, STOP_TIMEOUT_S + WATCHDOG_S)
    assert sd.active_state(SPECD_UNIT) == "deactivating"

    release_and_wait_stopped(sd, loading_pid)
    assert time.monotonic() - stopped > STOP_TIMEOUT_S + WATCHDOG_S
    assert_finished_the_restart_and_exited_cleanly(sd, since, loading_pid)
    waits = events_named(sd, since, "stop_waits_for_restart")
    assert [e["phase"] for _, e in waits] == ["restart_issued"], waits
    assert events_named(sd, since, "stopped")


def test_a_daemon_reload_while_a_stop_waits_for_the_restart_does_not_kill_specd(
    sd: Container,
) -> None:
    """`systemctl stop specd` while SGLang loads, then `systemctl daemon-reload` (config
    management, a package upgrade, `specd install`) early in the stop and again past the
    old 90 s TimeoutStopSec=: systemd re-arms the stop timeout from TimeoutStopSec= alone,
    forgetting every EXTEND_TIMEOUT_USEC=. specd is not killed: it finishes the restart
    (verified) and exits cleanly, with the shipped TimeoutStopSec=."""
    old_pid = start_twin(sd, steps=4)
    # The load is held past the old stop timeout: no rollback meanwhile.
    config = closed_window_config(sd, startup_timeout_s=OLD_STOP_TIMEOUT_S + 120)
    start_specd(sd, config, watchdog_s=WATCHDOG_S, overrides=("Restart=no",))
    try:
        hold_next_start(sd)
        since = journal_mark(sd)
        pin_now(sd, 3)
        loading_pid = restart_in_flight(sd, old_pid)
        specd_pid = sd.main_pid(SPECD_UNIT)

        stopped = time.monotonic()
        stop_while_restarting(sd)
        sd.daemon_reload()  # early: the stop timeout is re-armed, the extension dropped
        # Past the old TimeoutStopSec= (and a watchdog period), still finishing.
        while time.monotonic() < stopped + OLD_STOP_TIMEOUT_S + 2 * WATCHDOG_S:
            assert sd.active_state(SPECD_UNIT) == "deactivating", systemd_says(sd, since)
            time.sleep(5)
        sd.daemon_reload()  # late: a stop older than the old timeout
        time.sleep(2)
        assert sd.active_state(SPECD_UNIT) == "deactivating", systemd_says(sd, since)
        assert sd.main_pid(SPECD_UNIT) == specd_pid
        assert (state(sd).get("journal") or {}).get("phase") == "restart_issued"

        release_and_wait_stopped(sd, loading_pid)
    finally:
        kill_if_left(sd)
    assert_finished_the_restart_and_exited_cleanly(sd, since, loading_pid)
    assert not events_named(sd, since, "stop_hung")
    assert events_named(sd, since, "stopped")


def test_a_loop_hung_while_a_stop_waits_for_the_restart_ends_specd(sd: Container) -> None:
    """With TimeoutStopSec= as long as a restart sequence, systemd would leave a specd whose
    loop hangs mid-stop deactivating for over an hour: specd's stop guard ends it (SIGABRT)
    about one WatchdogSec= after its last beat, saying why, its journal left for the next
    start, which finishes the restart."""
    old_pid = start_twin(sd, steps=4)
    config = closed_window_config(sd, startup_timeout_s=STARTUP_TIMEOUT_S)
    hang_stop = [str(VENV_PYTHON), str(HANG_STOP), "run", "--config", CONFIG_PATH]
    # Far past the guard's one watchdog period (systemd's own kill would come only then),
    # and not the shipped 80 min: a systemd that misses the cgroup's end after a kill (see
    # KILLED_CLEANUP) holds the unit deactivating that long.
    specd_pid = start_specd(
        sd,
        config,
        watchdog_s=WATCHDOG_S,
        overrides=("Restart=no", "LimitCORE=0", f"TimeoutStopSec={GUARD_TEST_STOP_TIMEOUT_S:g}s"),
        exec_start=hang_stop,
    )
    try:
        hold_next_start(sd)
        since = journal_mark(sd)
        pin_now(sd, 3)
        loading_pid = restart_in_flight(sd, old_pid)

        stop_while_restarting(sd)
        (sd.state_dir / "hang-stop").write_text("")
        wait_or_dump(
            sd,
            lambda: not (sd.state_dir / "hang-stop").exists(),
            timeout=5,
            what="the loop to reach the hang",
        )
        hung_at = time.monotonic()
        wait_or_dump(
            sd,
            lambda: sd.active_state(SPECD_UNIT) != "deactivating",
            timeout=WATCHDOG_S + 15,
            what="specd to end itself",
        )
        ended_in = time.monotonic() - hung_at
    finally:
        kill_if_left(sd)
    # About one watchdog period after the last beat (the guard looks every second).
    assert WATCHDOG_S - 1 < ended_in < WATCHDOG_S + 6, ended_in
    assert sd.active_state(SPECD_UNIT) == "failed"
    assert sd.show(SPECD_UNIT, "Result") in ("signal", "core-dump")
    assert sd.show(SPECD_UNIT, "ExecMainStatus") == "6"  # SIGABRT
    said = systemd_says(sd, since)  # (a child of specd's left in the cgroup is killed)
    assert not any("timed out" in m for m in said), said
    hung = events_named(sd, since, "stop_hung")
    assert [p for p, _ in hung] == [3], hung  # one line, an error
    detail = hung[0][1]["detail"]
    waiting = "while the stop waits for the restart in flight (4 → 3, restart_issued)"
    assert f"(WatchdogSec= {WATCHDOG_S:g} s) {waiting}" in detail, detail
    assert not events_named(sd, since, "stopped")
    assert sd.main_pid(SGLANG_UNIT) == loading_pid
    assert (state(sd).get("journal") or {}).get("phase") == "restart_issued"

    # Its next start finishes the restart from the journal.
    sd.systemctl("start", SPECD_UNIT, timeout=60)
    assert sd.main_pid(SPECD_UNIT) != specd_pid
    release(sd, loading_pid)
    restarts = wait_or_dump(
        sd, lambda: state(sd)["restarts"], timeout=OUTCOME_S, what="the replay's outcome"
    )
    assert [(r["from_steps"], r["to_steps"], r["result"]) for r in restarts] == [(4, 3, "success")]
    assert state(sd)["journal"] is None
    assert twin_live_steps(sd) == (3, 3.0)
    assert sglang_starts(sd, since) == 1
