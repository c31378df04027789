"""The restart sequence against what a real systemd does to the SGLang unit around it.

The twin runs as sglang.service with the repo's drop-in (see nspawn.py), specd as the repo's
specd.service; the test changes the SGLang unit the way operators' units and upgrades do,
and reads what systemd, the files and the twin say. Helpers from test_specd_service.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from nspawn import REPO, SGLANG_UNIT, SPECD_UNIT, SPLIT_ARGS, VENV_SPECD, Container, twin_command
from test_specd_service import (
    KILLED_CLEANUP,
    closed_window_config,
    env_steps,
    events_named,
    journal_entries,
    journal_mark,
    pin_now,
    sglang_starts,
    sigkill_specd,
    start_specd,
    state,
    status_text,
    twin_live_steps,
    wait_or_dump,
)

pytestmark = [pytest.mark.systemd, pytest.mark.slow]

TWIN_LOAD_S = 0.5
# Far longer than any wait below: a test that passes did not wait it out.
LONG_STARTUP_TIMEOUT_S = 300.0


def start_twin_unit(sd: Container, steps: int, extra: list[str], service_lines: str = "") -> int:
    """The twin as sglang.service, with extra [Service] lines of the operator's own."""
    sd.install_twin_sglang(load_time_s=TWIN_LOAD_S, extra_args=extra)
    if service_lines:
        sd.write_unit(f"{SGLANG_UNIT}.d/70-operator.conf", f"[Service]\n{service_lines}")
        sd.daemon_reload()
    sd.write_env_file(steps)
    sd.systemctl("start", SGLANG_UNIT)
    sd.wait_http("/health", timeout=TWIN_LOAD_S + 20)
    return sd.main_pid(SGLANG_UNIT)


# systemd's default RestartSec= (the unit crash-loops: one failed start every second or two)
# and the example unit's 30 s (the unit waits between starts, "activating (auto-restart)").
@pytest.mark.parametrize("restart_sec", ["100ms", "30s"])
def test_a_target_crash_looping_under_restart_on_failure_is_rolled_back_at_once(
    sd: Container, restart_sec: str
) -> None:
    """With Restart=on-failure (systemd/examples/sglang.service has it), a setting SGLang
    cannot start at never leaves the unit "failed": systemd starts it again and again and
    `systemctl is-active` says "activating" throughout. specd took that for a slow load
    and waited out startup_timeout_s (10 min by default) before rolling back."""
    start_twin_unit(
        sd,
        4,
        ["--fail-start-at-steps", "3"],
        f"Restart=on-failure\nRestartSec={restart_sec}\n",
    )
    start_specd(sd, closed_window_config(sd, startup_timeout_s=LONG_STARTUP_TIMEOUT_S))
    pinned = time.monotonic()
    pin_now(sd, 3)
    frozen = wait_or_dump(
        sd,
        lambda: state(sd).get("frozen"),
        timeout=60,
        what="the crash-looping restart rolled back and frozen",
    )
    assert time.monotonic() - pinned < 60
    restarts = state(sd)["restarts"]
    assert [(r["from_steps"], r["to_steps"], r["result"]) for r in restarts] == [
        (4, 3, "rolled_back")
    ], restarts
    message = restarts[0]["message"]
    assert f"{SGLANG_UNIT} failed while starting" in message, message
    assert "Restart=" in message, message
    assert "rolled back, verified 4 steps" in message, message
    assert "rolled_back" in frozen["reason"]
    # Back on the setting it ran, and it stays there: no more restarts by systemd.
    assert env_steps(sd) == 4
    assert twin_live_steps(sd) == (4, 4.0)
    settled = sd.main_pid(SGLANG_UNIT)
    restarted = sd.show(SGLANG_UNIT, "NRestarts")
    time.sleep(3)
    assert (sd.main_pid(SGLANG_UNIT), sd.show(SGLANG_UNIT, "NRestarts")) == (settled, restarted)
    assert sd.active_state(SGLANG_UNIT) == "active"


def test_a_unit_that_no_longer_reads_the_env_file_is_not_restarted(sd: Container) -> None:
    """`systemctl revert` (or an upgrade, a config-management run) took the drop-in away:
    the unit starts SGLang with its own command again, whatever the env file says. specd
    restarted it twice for nothing (the change, then the rollback, neither of which the env
    file could reach) and left SGLang on the unit's own setting, frozen."""
    since = journal_mark(sd)
    pid = start_twin_unit(sd, 4, [])
    start_specd(sd, closed_window_config(sd))
    wait_or_dump(sd, lambda: status_text(sd).startswith("steps 4"), timeout=10)
    sd.systemctl("revert", SGLANG_UNIT)
    sd.daemon_reload()
    assert "sglang.env" not in sd.show(SGLANG_UNIT, "EnvironmentFiles")
    pin_now(sd, 3)
    aborted = wait_or_dump(
        sd,
        lambda: [e for _, e in events_named(sd, since, "restart_aborted") if "message" in e],
        timeout=20,
        what="the pinned restart refused",
    )
    message = aborted[0]["message"]
    assert f"{SGLANG_UNIT} does not read /var/lib/specd/sglang.env" in message, message
    assert "no restart" in message, message
    time.sleep(3)  # more ticks: each refuses again, none restarts
    assert sd.main_pid(SGLANG_UNIT) == pid
    assert sglang_starts(sd, since) == 1
    assert state(sd)["restarts"] == []
    assert state(sd)["frozen"] is None
    assert env_steps(sd) == 4
    assert twin_live_steps(sd) == (4, 4.0)


# The operator's own start limit (systemd's default is 5 starts in 10 s): the twin's start,
# specd's restart into a setting it cannot start at, and Restart='s first start again use
# it up, so systemd leaves the unit failed ("Start request repeated too quickly") before
# specd rolls back; an hour is longer than any wait here.
START_LIMIT = "[Unit]\nStartLimitIntervalSec=1h\nStartLimitBurst=2\n"
CRASH_LOOP = "Restart=on-failure\nRestartSec=100ms\n"
REPEATED_TOO_QUICKLY = "Start request repeated too quickly."


def sglang_journal_says(sd: Container, since: int, text: str) -> bool:
    return any(
        text in str(entry.get("MESSAGE", "")) for entry in journal_entries(sd, SGLANG_UNIT, since)
    )


def assert_rolled_back_to_four(sd: Container) -> None:
    restarts = state(sd)["restarts"]
    outcomes = [(r["from_steps"], r["to_steps"], r["result"]) for r in restarts]
    verified = len(restarts) == 1 and "rolled back, verified 4 steps" in restarts[0]["message"]
    rolled_back = outcomes == [(4, 3, "rolled_back")] and verified
    assert rolled_back, (
        f"{restarts}\n--- specd ---\n{sd.journal(SPECD_UNIT, lines=40)}"
        f"\n--- sglang ---\n{sd.journal(SGLANG_UNIT, lines=60)}"
    )


def assert_back_on_four_and_stays(sd: Container) -> None:
    assert env_steps(sd) == 4
    assert twin_live_steps(sd) == (4, 4.0)
    settled = sd.main_pid(SGLANG_UNIT)
    restarted = sd.show(SGLANG_UNIT, "NRestarts")
    time.sleep(3)
    assert (sd.main_pid(SGLANG_UNIT), sd.show(SGLANG_UNIT, "NRestarts")) == (settled, restarted)
    assert sd.active_state(SGLANG_UNIT) == "active"


# Alone: systemd's start limit counts starts made 100 ms apart against a rate; with
# three other workers loading both cores, the first run of each failed once.
@pytest.mark.alone
def test_a_target_that_uses_up_the_start_limit_is_still_rolled_back(sd: Container) -> None:
    """Under Restart=on-failure a setting SGLang cannot start at used up the unit's start
    limit: systemd left the unit failed and refused the rollback's `systemctl restart` until
    StartLimitIntervalSec= passed. The rollback failed, SGLang stayed down, specd frozen.
    specd now clears the unit's failed state and start count (`systemctl reset-failed`,
    which its polkit rule allows on this unit) before the rollback's restart."""
    since = journal_mark(sd)
    start_twin_unit(sd, 4, ["--fail-start-at-steps", "3"], CRASH_LOOP + START_LIMIT)
    start_specd(sd, closed_window_config(sd, startup_timeout_s=LONG_STARTUP_TIMEOUT_S))
    pin_now(sd, 3)
    frozen = wait_or_dump(
        sd,
        lambda: state(sd).get("frozen"),
        timeout=60,
        what="the restart that used up the start limit rolled back and frozen",
    )
    # systemd did refuse a start: the test is about what it claims.
    assert sglang_journal_says(sd, since, REPEATED_TOO_QUICKLY), sd.journal(SGLANG_UNIT)
    assert_rolled_back_to_four(sd)
    message = state(sd)["restarts"][0]["message"]
    assert f"{SGLANG_UNIT} failed while starting" in message, message
    assert "rolled_back" in frozen["reason"]
    cleared = events_named(sd, since, "unit_reset_failed")
    assert [e["unit"] for _, e in cleared] == [SGLANG_UNIT], cleared
    assert not events_named(sd, since, "unit_reset_failed_refused")
    assert_back_on_four_and_stays(sd)


# A polkit rule installed by a specd from before it cleared the start limit.
RULE = "/etc/polkit-1/rules.d/50-specd.rules"
RESET_FAILED_ALLOWED = ' || verb === "reset-failed"'
# A start limit's interval the tests below wait out (each in full, once). Long enough for
# what must happen inside it, alone on the machine: the crash loop's or the operator's
# starts up to specd's last refused restart (2.1-2.8 s after the first counted start,
# also with both cores busy), and, after specd is killed while waiting it out, its start
# again (READY in 0.4 s; TimeoutStartSec= is half the interval) with more of the wait
# still left than that timeout (6.4 s of the 7 s).
SHORT_START_LIMIT_S = 6


@contextmanager
def rule_without_reset_failed(sd: Container) -> Iterator[None]:
    shipped = (REPO / "etc/polkit-1/rules.d/50-specd.rules").read_text()
    assert RESET_FAILED_ALLOWED in shipped
    older = shipped.replace(RESET_FAILED_ALLOWED, "")
    sd.sh("sh", "-c", "cat > /run/specd-older.rules", input_text=older)
    # Over the container's bind of the repo's rule; polkitd reads rules when it starts.
    sd.sh("mount", "--bind", "/run/specd-older.rules", RULE)
    sd.systemctl("restart", "polkit.service")
    try:
        yield
    finally:
        sd.sh("umount", RULE, check=False)
        sd.systemctl("restart", "polkit.service")


# Alone: systemd's start limit counts starts made 100 ms apart against a rate; with
# three other workers loading both cores, the first run of each failed once.
@pytest.mark.alone
def test_a_rollback_specd_may_not_reset_failed_waits_out_the_start_limit(sd: Container) -> None:
    """With a polkit rule from before specd cleared the start limit (specd upgraded, `specd
    install` not run again), `systemctl reset-failed` is refused: the rollback waits until
    the unit's StartLimitIntervalSec= has passed, restarts then, and gets SGLang back
    (rather than failing at once and leaving it down)."""
    since = journal_mark(sd)
    limit = f"[Unit]\nStartLimitIntervalSec={SHORT_START_LIMIT_S}s\nStartLimitBurst=2\n"
    start_twin_unit(sd, 4, ["--fail-start-at-steps", "3"], CRASH_LOOP + limit)
    with rule_without_reset_failed(sd):
        refused = sd.sh(
            "systemctl", "--no-ask-password", "reset-failed", SGLANG_UNIT, user="specd", check=False
        )
        assert "Access denied" in refused.stderr, refused.stderr
        start_specd(sd, closed_window_config(sd, startup_timeout_s=LONG_STARTUP_TIMEOUT_S))
        pinned = time.monotonic()
        pin_now(sd, 3)
        wait_or_dump(
            sd,
            lambda: state(sd).get("frozen"),
            timeout=60 + SHORT_START_LIMIT_S,
            what="the rollback after the start limit's interval",
        )
        took = time.monotonic() - pinned
    assert sglang_journal_says(sd, since, REPEATED_TOO_QUICKLY), sd.journal(SGLANG_UNIT)
    assert_rolled_back_to_four(sd)
    assert events_named(sd, since, "unit_reset_failed_refused")
    waited = events_named(sd, since, "restart_waits_for_start_limit")
    assert [e["wait_s"] for _, e in waited] == [SHORT_START_LIMIT_S + 1.0], waited
    assert took >= SHORT_START_LIMIT_S
    assert_back_on_four_and_stays(sd)


# Shorter than what is left of the start limit's interval when specd starts again.
START_TIMEOUT = f"TimeoutStartSec={SHORT_START_LIMIT_S // 2}s"


# Alone: systemd's start limit counts starts against a rate (as above).
@pytest.mark.alone
def test_a_specd_killed_while_waiting_out_the_start_limit_finishes_the_rollback(
    sd: Container,
) -> None:
    """As above, but specd is killed while its rollback waits out the start limit. Its next
    start ended the sequence failed at once and left SGLang down. It now finishes the
    rollback from its journal: `reset-failed` again (refused again here), what is left of
    the limit's interval, the restart on 4 steps, verified. It waits longer than the unit's
    start timeout here (TimeoutStartSec=, 90 s by default, less than a long start limit or a
    model load), which ended a start that finished the rollback before READY=1; specd is
    ready first, and then finishes it."""
    since = journal_mark(sd)
    limit = f"[Unit]\nStartLimitIntervalSec={SHORT_START_LIMIT_S}s\nStartLimitBurst=2\n"
    start_twin_unit(sd, 4, ["--fail-start-at-steps", "3"], CRASH_LOOP + limit)
    with rule_without_reset_failed(sd):
        config = closed_window_config(sd, startup_timeout_s=LONG_STARTUP_TIMEOUT_S)
        specd_pid = start_specd(sd, config, overrides=("Restart=no", START_TIMEOUT, KILLED_CLEANUP))
        pin_now(sd, 3)
        wait_or_dump(
            sd,
            lambda: events_named(sd, since, "restart_waits_for_start_limit"),
            timeout=60,
            what="the rollback waiting out the start limit",
        )
        sigkill_specd(sd, specd_pid)
        journal = state(sd)["journal"]
        assert (journal["phase"], journal["restarts_issued"]) == ("rolling_back", 2), journal
        assert sd.active_state(SGLANG_UNIT) == "failed"  # SGLang down, its restart refused
        # Type=notify: returns once specd is READY, after it reconciled the journal.
        sd.systemctl("start", SPECD_UNIT, timeout=60 + SHORT_START_LIMIT_S)
        frozen = wait_or_dump(
            sd, lambda: state(sd).get("frozen"), timeout=30, what="the rollback finished"
        )
    assert events_named(sd, since, "reconciling_interrupted_restart")
    assert_rolled_back_to_four(sd)
    assert "rolled_back" in frozen["reason"]
    assert state(sd)["restarts"][0]["restarts"] == 2  # the change's and the rollback's
    waited = [e["wait_s"] for _, e in events_named(sd, since, "restart_waits_for_start_limit")]
    # The whole interval first; after the kill, only what was left of it.
    assert len(waited) == 2, waited
    assert waited[0] == SHORT_START_LIMIT_S + 1.0
    assert 0 < waited[1] < waited[0]
    assert_back_on_four_and_stays(sd)


def use_up_start_limit_by_hand(sd: Container) -> None:
    """An operator's two `systemctl restart`s (or crashes Restart= recovered from): the
    unit's start limit (StartLimitBurst=2) used up, SGLang running. After specd started:
    systemd 252 forgets the starts it counted at a daemon-reload, which installing specd's
    unit makes."""
    for _ in range(2):
        sd.systemctl("restart", SGLANG_UNIT)
        sd.wait_http("/health", timeout=TWIN_LOAD_S + 20)


# specd probes a restarted SGLang every [restart] health_poll_interval_s (2 s by default): the
# twin is healthy about 1 s after its start. Only where no crash loop runs: there the 2 s
# first look is what lets Restart= use up the start limit before specd looks (and at 0.5 s
# it would race it).
HEALTH_POLL_S = 0.5


def outcomes(sd: Container) -> list[tuple[int, int, str, int]]:
    return [
        (r["from_steps"], r["to_steps"], r["result"], r.get("restarts"))
        for r in state(sd)["restarts"]
    ]


# Alone: systemd's start limit counts starts against a rate (as above).
@pytest.mark.alone
def test_a_change_refused_for_a_start_limit_used_up_before_it_clears_it_and_goes_ahead(
    sd: Container,
) -> None:
    """SGLang runs 4, healthy, its start limit used up by earlier starts (an operator's
    restarts: 2 in an hour). systemd stopped it for the change's restart and
    refused the start (Result=start-limit-hit); the rollback got 4 back and specd froze as
    if 3 had failed, though 3 never ran. specd now clears the count (`reset-failed`, which
    its polkit rule allows) and restarts again: SGLang runs 3, nothing frozen."""
    since = journal_mark(sd)
    start_twin_unit(sd, 4, [], START_LIMIT)
    start_specd(sd, closed_window_config(sd, health_poll_interval_s=HEALTH_POLL_S))
    use_up_start_limit_by_hand(sd)
    pin_now(sd, 3)
    wait_or_dump(sd, lambda: state(sd)["restarts"], timeout=60, what="the change's outcome")
    assert sglang_journal_says(sd, since, REPEATED_TOO_QUICKLY), sd.journal(SGLANG_UNIT)
    assert outcomes(sd) == [(4, 3, "success", 1)], sd.journal(SPECD_UNIT, lines=40)
    assert state(sd)["frozen"] is None
    refused = events_named(sd, since, "restart_refused_by_start_limit")
    assert len(refused) == 1, refused
    assert "not the fault of 3 steps, which never ran" in refused[0][1]["message"]
    assert [e["unit"] for _, e in events_named(sd, since, "unit_reset_failed")] == [SGLANG_UNIT]
    assert env_steps(sd) == 3
    assert twin_live_steps(sd) == (3, 3.0)
    assert sd.active_state(SGLANG_UNIT) == "active"


# Alone: systemd's start limit counts starts against a rate (as above).
@pytest.mark.alone
def test_a_change_refused_for_a_start_limit_specd_may_not_clear_is_aborted_not_frozen(
    sd: Container,
) -> None:
    """As above with a polkit rule that refuses `reset-failed`: the change is given up
    without blame (aborted, not frozen), SGLang started again on 4 once the limit's interval
    passed, and the pin that wanted 3 gets it at the next tick, the limit allowing."""
    since = journal_mark(sd)
    limit = f"[Unit]\nStartLimitIntervalSec={SHORT_START_LIMIT_S}s\nStartLimitBurst=2\n"
    start_twin_unit(sd, 4, [], limit)
    with rule_without_reset_failed(sd):
        config = closed_window_config(
            sd, startup_timeout_s=LONG_STARTUP_TIMEOUT_S, health_poll_interval_s=HEALTH_POLL_S
        )
        start_specd(sd, config)
        use_up_start_limit_by_hand(sd)
        pin_now(sd, 3)
        wait_or_dump(
            sd,
            lambda: state(sd)["restarts"] or state(sd).get("frozen"),
            timeout=60 + SHORT_START_LIMIT_S,
            what="the refused change backed out",
        )
        first = state(sd)["restarts"]
        assert outcomes(sd)[:1] == [(4, 3, "aborted", 1)], first
        assert "3 steps was never tried" in first[0]["message"], first
        assert "rolled back, verified 4 steps" in first[0]["message"], first
        wait_or_dump(
            sd, lambda: len(state(sd)["restarts"]) == 2, timeout=60, what="the pin applied"
        )
    assert sglang_journal_says(sd, since, REPEATED_TOO_QUICKLY), sd.journal(SGLANG_UNIT)
    assert outcomes(sd) == [(4, 3, "aborted", 1), (4, 3, "success", 1)]
    assert state(sd)["frozen"] is None
    aborted = [e for _, e in events_named(sd, since, "restart_aborted") if "message" in e]
    assert aborted, events_named(sd, since, "restart_aborted")
    assert "start limit" in aborted[0]["message"], aborted
    assert env_steps(sd) == 3
    assert twin_live_steps(sd) == (3, 3.0)


# The twin's launcher as the test unit's ExecStart= names it: a link its ExecStopPost= takes
# away while ARMED exists (taking ARMED too), and puts back otherwise. So the start after
# the stop that finds ARMED, and only that one, dies in systemd's setup of the process
# (status=203/EXEC: the exec found no file), before the twin ever runs; the ExecStopPost=
# after that failed start puts the link back for every later start. (A missing
# WorkingDirectory= fails the same way, 200/CHDIR, but ExecStopPost= runs in it too, so
# nothing would put it back.)
LAUNCHER_DIR = "/run/sglang-launcher"
# Arming tries: see the test (the arming ExecStopPost= itself may die in this container).
ARMING_TRIES = 3
LAUNCHER = f"{LAUNCHER_DIR}/specd"
ARMED = "/run/sglang-launcher.armed"
LAUNCHER_LINES = (
    f"ExecStart=\nExecStart={LAUNCHER} "
    + twin_command([SPLIT_ARGS], load_time_s=TWIN_LOAD_S).split(" ", 1)[1]
    + f"\nExecStopPost=/bin/sh -c 'if rm {ARMED} 2>/dev/null; then rm -f {LAUNCHER}; else "
    f"mkdir -p {LAUNCHER_DIR} && ln -sfn {VENV_SPECD} {LAUNCHER}; fi'\n"
)


# With the example unit's Restart=on-failure, RestartSec=30s (the unit waits, "activating
# (auto-restart)") and without Restart= (the unit is left failed).
@pytest.mark.parametrize(
    "restart", ["Restart=on-failure\nRestartSec=30s\n", ""], ids=["auto-restart", "no-restart"]
)
def test_a_change_whose_start_systemd_could_not_set_up_is_aborted_not_frozen(
    sd: Container, restart: str
) -> None:
    """The change's start died in systemd's own setup of the process, before SGLang ran
    (status=219/CGROUP where it was seen; 203/EXEC here): specd said SGLang "failed while
    starting", rolled back and froze, holding 4 until `specd unfreeze`, though 3 never ran.
    Now it names systemd's status, rolls back to 4 (verified) and ends the change aborted:
    nothing frozen, and the pin that wanted 3 gets it at a later tick."""
    sd.sh("mkdir", "-p", LAUNCHER_DIR)
    sd.sh("ln", "-sfn", str(VENV_SPECD), LAUNCHER)
    try:
        start_twin_unit(sd, 4, [], LAUNCHER_LINES + restart)
        start_specd(sd, closed_window_config(sd, health_poll_interval_s=HEALTH_POLL_S))
        for _ in range(ARMING_TRIES):
            since, done = journal_mark(sd), len(state(sd)["restarts"])
            sd.sh("touch", ARMED)
            pin_now(sd, 3)
            wait_or_dump(
                sd,
                lambda d=done: len(state(sd)["restarts"]) > d,
                timeout=60,
                what="the pin's first restart",
            )
            if outcomes(sd)[done] != (4, 3, "success", 1) or not sglang_journal_says(
                sd, since, "Control process exited, code=exited, status=219/CGROUP"
            ):
                break
            # This container's systemd (252, on a cgroup v1 host) now and then cannot put a
            # process into its cgroup: the ExecStopPost= that takes the launcher away died so
            # (status=219/CGROUP), and the change simply went through. Back to 4, arm again.
            sd.sh("rm", "-f", ARMED)
            pin_now(sd, 4)
            wait_or_dump(sd, lambda d=done: len(state(sd)["restarts"]) > d + 1, timeout=60)
        wait_or_dump(
            sd,
            lambda d=done: len(state(sd)["restarts"]) == d + 2 or state(sd).get("frozen"),
            timeout=60,
            what="the change backed out, then the pin applied",
        )
        assert sglang_journal_says(sd, since, "status=203/EXEC"), sd.journal(SGLANG_UNIT)
        assert outcomes(sd)[done:] == [(4, 3, "aborted", 1), (4, 3, "success", 1)], sd.journal(
            SPECD_UNIT, lines=40
        )
        assert state(sd)["frozen"] is None
        message = state(sd)["restarts"][done]["message"]
        assert (
            f"systemd could not start {SGLANG_UNIT}'s process (status 203/EXEC: its own "
            "setup, before SGLang ran); 3 steps was never tried"
        ) in message, message
        assert "rolled back, verified 4 steps" in message, message
        failed = events_named(sd, since, "restart_setup_failed")
        assert [e["status"] for _, e in failed] == ["203/EXEC"], failed
        assert env_steps(sd) == 3
        assert twin_live_steps(sd) == (3, 3.0)
        assert sd.active_state(SGLANG_UNIT) == "active"
    finally:
        # Stopped first: the ExecStopPost= of the fixture's stop would put the link back.
        sd.systemctl("stop", SPECD_UNIT, SGLANG_UNIT, check=False, timeout=60)
        sd.sh("rm", "-rf", LAUNCHER_DIR, ARMED)
