"""The restart wiring under a real systemd: the twin as sglang.service with the repo's
drop-in, the env file specd writes, the repo's polkit rule, and specd.service's hardening.
"""

from __future__ import annotations

import json
import re

import pytest
from nspawn import (
    DROPIN_DEFAULT_STEPS,
    INSIDE_SCRIPT,
    REPO,
    SGLANG_UNIT,
    SPECD_UNIT,
    TWIN_URL,
    VENV_PYTHON,
    Container,
)
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.systemd

OTHER_UNIT = "other.service"
# What `specd run` loads (its runtime dependencies, native extensions included).
DAEMON_IMPORTS = (
    "specd",
    "httpx",
    "pydantic",
    "pydantic_settings",
    "prometheus_client",
    "sdnotify",
    "structlog",
    "apscheduler.schedulers.background",
    "tomli_w",
)
SLEEPER = "[Service]\nExecStart=/bin/sleep infinity\n"


def live_steps(sd: Container) -> tuple[int, int, float]:
    """(steps, draft tokens) from /server_info, and sglang:spec_num_steps from /metrics."""
    info = sd.twin_server_info()
    metrics = sd.http_get("/metrics")
    assert metrics["status"] == 200, metrics
    gauge = [
        sample.value
        for family in text_string_to_metric_families(metrics["body"])
        for sample in family.samples
        if sample.name == "sglang:spec_num_steps"
    ]
    assert gauge, "sglang:spec_num_steps missing from /metrics"
    return int(info["speculative_num_steps"]), int(info["speculative_num_draft_tokens"]), gauge[0]


def start_twin(sd: Container) -> int:
    sd.systemctl("start", SGLANG_UNIT)
    sd.wait_http("/health")
    return sd.main_pid(SGLANG_UNIT)


def test_dropin_defaults_apply_without_env_file(sd: Container) -> None:
    sd.install_twin_sglang()
    start_twin(sd)
    steps, draft, gauge = live_steps(sd)
    assert (steps, draft, gauge) == (DROPIN_DEFAULT_STEPS, DROPIN_DEFAULT_STEPS + 1, steps)


@pytest.mark.parametrize(("before", "after"), [(2, 3), (4, 1)])
def test_env_file_then_restart_by_specd_user_changes_steps(
    sd: Container, before: int, after: int
) -> None:
    sd.install_twin_sglang()
    sd.write_env_file(before)
    pid_before = start_twin(sd)
    assert live_steps(sd) == (before, before + 1, before)

    sd.write_env_file(after)
    # Exactly what specd's apply runs, as the specd user, through the polkit rule.
    sd.sh("systemctl", "--no-ask-password", "restart", SGLANG_UNIT, user="specd")
    sd.wait_http("/health")

    pid_after = sd.main_pid(SGLANG_UNIT)
    assert pid_after not in (0, pid_before)
    assert live_steps(sd) == (after, after + 1, after)


# (user, systemctl arguments, allowed). Allowed means: exit 0 and sglang.service got a new
# MainPID; denied means: non-zero exit, polkit named in the error, and no unit touched.
POLKIT_CASES = [
    ("specd", ["restart", SGLANG_UNIT], True),
    ("specd", ["try-restart", SGLANG_UNIT], True),
    ("specd", ["stop", SGLANG_UNIT], False),
    ("specd", ["start", SGLANG_UNIT], False),
    ("specd", ["reload-or-restart", SGLANG_UNIT], False),
    ("specd", ["kill", SGLANG_UNIT], False),
    ("specd", ["restart", OTHER_UNIT], False),
    ("specd", ["try-restart", OTHER_UNIT], False),
    ("specd", ["stop", OTHER_UNIT], False),
    ("specd", ["daemon-reload"], False),
    ("specd", ["set-property", SGLANG_UNIT, "CPUWeight=10"], False),
    ("specd", ["mask", "--runtime", OTHER_UNIT], False),
    ("nobody", ["restart", SGLANG_UNIT], False),
]


@pytest.mark.parametrize(("user", "args", "allowed"), POLKIT_CASES)
def test_polkit_rule_lets_specd_restart_only_sglang(
    sd: Container, user: str, args: list[str], allowed: bool
) -> None:
    # polkit decides on the unit's name and the verb; a sleeper keeps restarts instant.
    sd.write_unit(SGLANG_UNIT, SLEEPER)
    sd.write_unit(OTHER_UNIT, SLEEPER)
    sd.daemon_reload()
    sd.systemctl("start", SGLANG_UNIT, OTHER_UNIT)
    pids = {unit: sd.main_pid(unit) for unit in (SGLANG_UNIT, OTHER_UNIT)}

    done = sd.sh("systemctl", "--no-ask-password", *args, user=user, check=False)

    after = {unit: sd.main_pid(unit) for unit in (SGLANG_UNIT, OTHER_UNIT)}
    if allowed:
        assert done.returncode == 0, done.stderr
        assert after[SGLANG_UNIT] not in (0, pids[SGLANG_UNIT])
        assert after[OTHER_UNIT] == pids[OTHER_UNIT]
    else:
        assert done.returncode != 0
        # "Access denied" is the rule's explicit NO; other users fall through to the
        # default (admin authentication), which --no-ask-password refuses.
        expected = "Access denied" if user == "specd" else "Interactive authentication required"
        assert expected in done.stderr, done.stderr
        assert after == pids
        assert sd.active_state(SGLANG_UNIT) == sd.active_state(OTHER_UNIT) == "active"
        assert sd.show(OTHER_UNIT, "LoadState") == "loaded"  # not masked


# A unit systemd refuses a second start within the hour: started, then restarted once, it is
# left failed by its start limit, as a setting SGLang cannot start at leaves sglang.service.
LIMITED_SLEEPER = "[Unit]\nStartLimitIntervalSec=1h\nStartLimitBurst=1\n" + SLEEPER


def test_polkit_rule_lets_specd_reset_failed_only_sglang(sd: Container) -> None:
    """The rollback after a change that used up the start limit clears it first (systemctl
    reset-failed, polkit verb "reset-failed"): allowed on sglang.service only, never on
    another unit nor on every unit at once, nor for another user."""
    sd.write_unit(SGLANG_UNIT, LIMITED_SLEEPER)
    sd.write_unit(OTHER_UNIT, LIMITED_SLEEPER)
    sd.daemon_reload()
    sd.systemctl("start", SGLANG_UNIT, OTHER_UNIT)
    for unit in (SGLANG_UNIT, OTHER_UNIT):
        refused = sd.systemctl("restart", unit, check=False)
        assert sd.show(unit, "Result") == "start-limit-hit", refused
    # A restart is refused all the same, also to specd.
    again = sd.sh(
        "systemctl", "--no-ask-password", "restart", SGLANG_UNIT, user="specd", check=False
    )
    assert "attempted too often" in again.stderr, again.stderr

    denied = [
        ("specd", ["reset-failed", OTHER_UNIT], "Access denied"),
        ("specd", ["reset-failed"], "Access denied"),  # every unit at once
        ("nobody", ["reset-failed", SGLANG_UNIT], "Interactive authentication required"),
    ]
    for user, args, why in denied:
        done = sd.sh("systemctl", "--no-ask-password", *args, user=user, check=False)
        assert done.returncode != 0, (user, args)
        assert why in done.stderr, (user, args, done.stderr)
        assert sd.active_state(SGLANG_UNIT) == sd.active_state(OTHER_UNIT) == "failed"

    done = sd.sh("systemctl", "--no-ask-password", "reset-failed", SGLANG_UNIT, user="specd",
                 check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (sd.active_state(SGLANG_UNIT), sd.show(SGLANG_UNIT, "Result")) == ("inactive", "success")
    assert sd.active_state(OTHER_UNIT) == "failed"
    # The start count is gone with it: specd's restart starts the unit again.
    sd.sh("systemctl", "--no-ask-password", "restart", SGLANG_UNIT, user="specd")
    assert sd.active_state(SGLANG_UNIT) == "active"
    assert sd.main_pid(SGLANG_UNIT) != 0


def test_specd_unit_hardening_keeps_what_the_daemon_needs(sd: Container) -> None:
    """The shipped specd.service, with only its command swapped for a probe: it can load
    the daemon's libraries, reach SGLang on loopback, listen on 127.0.0.1, restart
    sglang.service (and nothing else), and write only its state directory, with
    restrictive modes."""
    sd.install_twin_sglang()
    twin_pid = start_twin(sd)
    sd.write_unit(OTHER_UNIT, SLEEPER)
    sd.daemon_reload()
    sd.systemctl("start", OTHER_UNIT)
    other_pid = sd.main_pid(OTHER_UNIT)
    report = sd.state_dir / "probe.json"
    sd.install_specd(
        exec_start=[
            str(VENV_PYTHON),
            str(INSIDE_SCRIPT),
            "probe",
            f"{TWIN_URL}/server_info",
            "--report",
            "/var/lib/specd/probe.json",
            "--restart",
            SGLANG_UNIT,
            "--restart",
            OTHER_UNIT,
            *(arg for module in DAEMON_IMPORTS for arg in ("--import", module)),
        ],
        watchdog_sec=None,
        # oneshot: `systemctl start` returns when the probe has finished.
        service_overrides=["Type=oneshot", "Restart=no", "WatchdogSec=0"],
    )
    sd.systemctl("start", SPECD_UNIT, timeout=60)
    findings = json.loads(report.read_text())

    assert findings["uid"] != 0
    assert findings["imports"] == dict.fromkeys(DAEMON_IMPORTS, "ok")
    assert findings["url"]["status"] == 200, findings["url"]
    assert findings["listen_loopback"] is True
    assert findings["restart"][SGLANG_UNIT]["rc"] == 0, findings["restart"]
    assert findings["restart"][OTHER_UNIT]["rc"] != 0
    assert "Access denied" in findings["restart"][OTHER_UNIT]["stderr"]
    # Type=simple: MainPID can read 0 for a moment while the restarted twin is forked.
    sd.wait_for(
        lambda: sd.main_pid(SGLANG_UNIT) not in (0, twin_pid),
        what=f"a new MainPID of {SGLANG_UNIT}:\n{sd.journal(SGLANG_UNIT)}",
    )
    assert sd.main_pid(OTHER_UNIT) == other_pid
    assert findings["writable"] == {
        "/etc/specd": False,
        "/usr/local": False,
        "/tmp": True,  # PrivateTmp: its own
        "/var/tmp": True,
        "/var/lib/specd": True,
    }
    assert findings["created_mode"] == "0640"
    state_mode = sd.sh("stat", "-c", "%a %U %G", "/var/lib/specd").stdout.split()
    # Others may pass through to the adaptive config SGLang reads, not list the directory.
    assert state_mode == ["751", "specd", "specd"]


def test_restarting_sglang_leaves_specd_running(sd: Container) -> None:
    """specd.service is only ordered After= sglang.service: restarting SGLang (what specd
    itself does) must not stop or restart specd."""
    sd.install_twin_sglang()
    start_twin(sd)
    sd.install_specd(
        exec_start=["/bin/sleep", "infinity"],
        watchdog_sec=None,
        service_overrides=["Type=exec", "WatchdogSec=0"],
    )
    sd.systemctl("start", SPECD_UNIT)
    specd_pid = sd.main_pid(SPECD_UNIT)
    sd.systemctl("restart", SGLANG_UNIT)
    sd.systemctl("stop", SGLANG_UNIT)
    assert sd.active_state(SPECD_UNIT) == "active"
    assert sd.main_pid(SPECD_UNIT) == specd_pid
    assert sd.show(SPECD_UNIT, "NRestarts") == "0"


def test_installed_specd_unit_as_the_manager_sees_it(sd: Container) -> None:
    sd.install_specd()
    props = dict(
        line.split("=", 1)
        for line in sd.systemctl(
            "show",
            SPECD_UNIT,
            "-p",
            "LoadState,Type,NotifyAccess,User,After,Requires,BindsTo,PartOf,Restart,"
            "StateDirectoryMode,UMask,ExecReload,TimeoutStopUSec",
        ).splitlines()
    )
    assert props["LoadState"] == "loaded"
    assert (props["Type"], props["NotifyAccess"], props["User"]) == ("notify", "main", "specd")
    assert SGLANG_UNIT in props["After"].split()
    for strong in ("Requires", "BindsTo", "PartOf"):
        assert SGLANG_UNIT not in props[strong].split(), strong
    assert props["Restart"] == "on-failure"
    assert (props["StateDirectoryMode"], props["UMask"]) == ("0751", "0027")
    assert re.search(r"path=/bin/kill ; argv\[\]=/bin/kill -HUP \$MAINPID", props["ExecReload"])
    # A whole restart sequence's bound: a daemon-reload forgets the extensions specd's
    # beats make (tests/test_daemon_lifecycle.py derives it).
    assert props["TimeoutStopUSec"] == "1h 20min"


def test_security_score_of_the_loaded_unit(sd: Container) -> None:
    sd.install_file(SPECD_UNIT, REPO / "systemd/specd.service")
    sd.daemon_reload()
    out = sd.sh("systemd-analyze", "security", "--no-pager", SPECD_UNIT).stdout
    match = re.search(r"Overall exposure level for specd\.service: (\d+\.\d+)", out)
    assert match, out
    assert float(match.group(1)) <= 2.5, out
