"""`specd install` → `specd doctor` → a step change in the next window → `specd uninstall`,
under a real systemd, on a unit shaped like the real deployment (the twin in SGLang's place);
and install → an on-call pin applied at once → uninstall → install for another unit, which
must not restart that unit (issue 11 item 1).
"""

from __future__ import annotations

import json
import re
import time
from datetime import datetime, timezone

import pytest
import tomli_w
from factories import tables
from nspawn import (
    REPO,
    SGLANG_UNIT,
    SPECD_UNIT,
    TWIN_URL,
    TWIN_WARMUP_S,
    VENV_SPECD,
    Container,
    exec_line,
)

from specd.io.files import parse_toml

pytestmark = [pytest.mark.systemd, pytest.mark.slow]

LOAD_UNIT = "specd-install-load.service"
DROPIN = f"{SGLANG_UNIT}.d/50-specd.conf"
POLKIT_RULE = "/etc/polkit-1/rules.d/50-specd.rules"
# From writing the config to the window's opening: install and its specd's first decision
# on the load (a few seconds, 13 s on a loaded machine) come before it.
WINDOW_LEAD_S = 20.0
# How long SGLang must keep its process after a reinstall, watched from specd's first tick:
# what restarted it (a leftover pin applied now, a leftover restart journal) acts at specd's
# start or first ticks (the issue saw it 5 s after install, install included). 10 ticks of
# 0.5 s; both restarts, with install's fix taken out, are seen within it.
QUIET_AFTER_INSTALL_S = 5.0


def deployment_unit() -> str:
    """systemd/examples/sglang.service's shape, with its speculative flags inline (as the
    operators' units are before specd) and the twin as the program."""
    command = exec_line(
        [
            str(VENV_SPECD),
            "twin",
            "--model-path",
            "/srv/sglang/models/Qwen3.5-122B-A10B-FP8",
            "--served-model-name",
            "Qwen/Qwen3.5-122B-A10B",
            "--host",
            "127.0.0.1",
            "--port",
            "30000",
            "--tp-size",
            "4",
            "--warmup-s",
            f"{TWIN_WARMUP_S:g}",
            "--enable-metrics",
            "--speculative-algorithm",
            "NEXTN",
            "--speculative-num-steps=3",
            "--speculative-eagle-topk",
            "1",
            "--speculative-num-draft-tokens",
            "4",
            "--load-time-s",
            "0.5",
        ]
    ).replace(" --", " \\\n    --")
    return (
        "[Unit]\nDescription=SGLang inference server (Qwen3.5-122B-A10B, MTP)\n"
        "After=network-online.target\n\n[Service]\nType=simple\nWorkingDirectory=/\n"
        "Environment=CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=0,1,2,3\n"
        "Environment=NCCL_IB_DISABLE=1 NCCL_P2P_LEVEL=PHB NCCL_CUMEM_ENABLE=0\n"
        "Environment=NCCL_DEBUG=WARN\n"
        "Environment=HF_HOME=/srv/sglang/hf HF_HUB_OFFLINE=1 SAFETENSORS_FAST_GPU=1\n"
        f"ExecStart={command}\n"
        # Like SGLang, the twin drains on SIGTERM with no deadline while the test's load keeps
        # coming: a short stop timeout keeps the restart inside the test's time budget.
        "TimeoutStopSec=3s\nKillMode=mixed\nRestart=on-failure\nRestartSec=1s\n"
        "LimitNOFILE=65536\n\n[Install]\nWantedBy=multi-user.target\n"
    )


def cron_at(ts: float, daily: bool = False) -> str:
    """A 6-field cron firing at the whole second ``ts`` (UTC): that day of the year, or
    every day at that time."""
    at = datetime.fromtimestamp(ts, tz=timezone.utc)
    day = "* *" if daily else f"{at.day} {at.month}"
    return f"{at.second} {at.minute} {at.hour} {day} *"


def operator_config(opens_at: float, daily: bool = False) -> str:
    """What the operator keeps in /etc/specd/specd.toml: short history, a window soon (once
    a year, or ``daily``); no [sglang] url / unit (install fills them in). The twin stops
    and starts in seconds: one restart (its 30 s stop timeout + a 10 s start) fits the
    window."""
    return tomli_w.dumps(
        tables(
            restart_cost_s=10.0,
            scrape_interval_s=0.5,
            stale_after_s=10.0,
            history_half_life_s=120.0,
            min_history_s=2.0,
            warmup_exclude_s=0.5,
            stabilization_window_s=1.5,
            min_dwell_s=0.0,
            quiet_concurrency_max=64,
            quiet_deadline_s=5.0,
            startup_timeout_s=30.0,
            metrics_port=9464,
            windows=[{"cron": cron_at(opens_at, daily), "duration_s": 120.0, "timezone": "UTC"}],
        )
    )


def serve_with_no_window(sd: Container, unit: str, text: str) -> float:
    """SGLang's ``unit`` (``text``) started and answering, and the operator's specd.toml with
    no window for a month (its opening returned): only an override applied "now" could
    restart SGLang."""
    sd.write_unit(unit, text)
    sd.daemon_reload()
    sd.systemctl("start", unit)
    sd.wait_http("/health")
    closed = float(sd.sh("date", "+%s.%N").stdout) + 30 * 86400
    (sd.config_dir / "specd.toml").write_text(operator_config(closed))
    return closed


def live_steps(sd: Container) -> int:
    return int(sd.twin_server_info()["speculative_num_steps"])


def test_install_doctor_window_change_uninstall(sd: Container) -> None:
    sd.write_unit(SGLANG_UNIT, deployment_unit())
    sd.daemon_reload()
    sd.systemctl("start", SGLANG_UNIT)
    sd.wait_http("/health")
    cat_before = sd.systemctl("cat", "--no-pager", SGLANG_UNIT)
    sglang_pid = sd.main_pid(SGLANG_UNIT)
    assert live_steps(sd) == 3
    # A daily window: its next opening is at most a day away wherever doctor runs, before,
    # in or after it (a yearly one had to be still ahead, on a loaded CI core install and
    # doctor take well over 12 s). The load runs from before install, so specd has the
    # history for its change (4 steps) seconds after it starts, well before the window.
    opens_at = float(sd.sh("date", "+%s.%N").stdout) + WINDOW_LEAD_S
    original_config = operator_config(opens_at, daily=True)
    (sd.config_dir / "specd.toml").write_text(original_config)
    specd = str(VENV_SPECD)
    try:
        sd.sh(
            "systemd-run",
            f"--unit={LOAD_UNIT}",
            "--collect",
            "--quiet",
            specd,
            "load",
            "--url",
            TWIN_URL,
            "--concurrency",
            "2",
            "--duration",
            "60",
        )
        dry = sd.sh(specd, "install", "--unit", SGLANG_UNIT, "--dry-run")
        assert "+ExecStart=" in dry.stdout
        assert "$ systemctl enable --now specd.service" in dry.stdout
        assert not (sd.units_dir / DROPIN).exists()

        started = time.monotonic()
        done = sd.sh(specd, "install", "--unit", SGLANG_UNIT, "--yes", timeout=90, check=False)
        install_s = time.monotonic() - started
        assert done.returncode == 0, done.stdout + done.stderr + sd.journal(SPECD_UNIT)
        assert "SGLang is not restarted" in done.stdout, done.stdout
        assert sd.main_pid(SGLANG_UNIT) == sglang_pid  # never restarts SGLang
        assert sd.active_state(SPECD_UNIT) == "active"
        dropin = (sd.units_dir / DROPIN).read_text()
        assert "\n    $SPECD_SPECULATIVE_ARGS \\\n    --load-time-s 0.5\n" in dropin
        assert "--speculative-num-steps=" not in dropin.split("ExecStart=\nExecStart=")[1]
        assert (
            'Environment="SPECD_SPECULATIVE_ARGS=--speculative-algorithm NEXTN '
            "--speculative-num-steps 3 --speculative-eagle-topk 1 "
            '--speculative-num-draft-tokens 4"' in dropin
        )
        config = parse_toml((sd.config_dir / "specd.toml").read_text())
        assert config["sglang"] == {**config["sglang"], "url": TWIN_URL, "unit": SGLANG_UNIT}

        again = sd.sh(specd, "install", "--unit", SGLANG_UNIT, "--yes", timeout=60)
        assert "nothing to do" in again.stdout, again.stdout

        doctor = sd.sh(specd, "doctor", "--json", check=False, timeout=60)
        report = json.loads(doctor.stdout)
        failed = [c for c in report["checks"] if not c["ok"]]
        assert not failed, failed
        assert doctor.returncode == 0
        # Restart=on-failure, RestartSec=1s as systemd shows them: within two of specd's
        # looks (every 2 s), said beside the passing check.
        notes = {c["name"]: c["notes"] for c in report["checks"]}["drop-in"]
        assert len(notes) == 1, notes
        assert notes[0].startswith(
            f"{SGLANG_UNIT} starts again 1 s after it fails (Restart=on-failure): sooner than "
            "specd looks while a restart runs (every 2 s)"
        ), notes

        sd.wait_for(lambda: live_steps(sd) == 4, timeout=60, interval=0.5, what="steps 4")
        assert float(sd.sh("date", "+%s.%N").stdout) >= opens_at  # in the window, not before
        assert sd.main_pid(SGLANG_UNIT) != sglang_pid
        print(f"install {install_s:.1f} s, steps changed {time.monotonic() - started:.1f} s after")
    finally:
        sd.systemctl("stop", LOAD_UNIT, check=False)
        before_uninstall = time.monotonic()
        gone = sd.sh(specd, "uninstall", check=False, timeout=90)
        print(f"uninstall {time.monotonic() - before_uninstall:.1f} s")
    assert gone.returncode == 0, gone.stdout + gone.stderr
    assert "byte-for-byte" in gone.stdout, gone.stdout
    assert sd.systemctl("cat", "--no-pager", SGLANG_UNIT) == cat_before
    assert not (sd.units_dir / DROPIN).exists()
    assert not (sd.units_dir / SPECD_UNIT).exists()
    assert (sd.config_dir / "specd.toml").read_text() == original_config
    assert not (sd.config_dir / "install-manifest.json").exists()


def test_doctor_and_install_on_a_broken_setup(sd: Container) -> None:
    """No --enable-metrics, no drop-in, and a polkit rule that does not cover the unit."""
    unit = "llm.service"
    text = deployment_unit().replace(" \\\n    --enable-metrics", "")
    assert "--enable-metrics" not in text
    sd.write_unit(unit, text)
    sd.daemon_reload()
    sd.systemctl("start", unit)
    sd.wait_http("/health")
    (sd.config_dir / "specd.toml").write_text(
        tomli_w.dumps({"sglang": {"url": TWIN_URL, "unit": unit}})
    )
    specd = str(VENV_SPECD)

    doctor = sd.sh(specd, "doctor", "--json", check=False, timeout=60)
    assert doctor.returncode == 1
    verdicts = {c["name"]: c for c in json.loads(doctor.stdout)["checks"]}
    for passing in ("config", "sglang", "windows", "override"):
        assert verdicts[passing]["ok"], verdicts[passing]
    assert "--enable-metrics" in verdicts["metrics"]["advice"]
    assert not verdicts["metrics"]["ok"]
    assert not verdicts["drop-in"]["ok"]
    assert f"specd install --unit {unit}" in verdicts["drop-in"]["advice"]
    assert not verdicts["polkit"]["ok"]
    assert f"restart {unit}: denied" in verdicts["polkit"]["detail"]
    assert not verdicts["service"]["ok"]

    # A window shorter than one restart (the unit's TimeoutStopSec=3s, as systemd resolved
    # it, + restart_cost_s) never holds one: said, with the figures it was judged by.
    window = {"cron": "0 3 * * mon-sun", "duration_s": 50.0, "timezone": "UTC"}
    for cost_s, fits in ((40.0, True), (60.0, False)):
        (sd.config_dir / "specd.toml").write_text(
            tomli_w.dumps(
                {
                    "sglang": {"url": TWIN_URL, "unit": unit},
                    "choose": {"restart_cost_s": cost_s},
                    "windows": [window],
                }
            )
        )
        doctor = sd.sh(specd, "doctor", "--json", check=False, timeout=60)
        windows = {c["name"]: c for c in json.loads(doctor.stdout)["checks"]}["windows"]
        assert windows["ok"] is fits, windows
        if not fits:
            assert f"({unit}'s TimeoutStopSec= 3 s + restart_cost_s 60 s)" in windows["detail"]

    refused = sd.sh(specd, "install", "--unit", unit, "--yes", check=False)
    assert refused.returncode == 1
    assert "runs without --enable-metrics" in refused.stderr
    assert "--add-enable-metrics" in refused.stderr
    assert not (sd.units_dir / f"{unit}.d").exists()

    plan = sd.sh(specd, "install", "--unit", unit, "--dry-run", "--add-enable-metrics")
    assert "+    --enable-metrics" in plan.stdout
    # The polkit rule must be rendered for this unit, not the shipped sglang.service.
    assert '+    var SGLANG_UNIT = "llm.service";' in plan.stdout
    assert "does not answer" not in plan.stdout

    # Down at install: said (the URL read from its command line may be wrong, as for a
    # container that publishes its port under another number), not refused.
    sd.systemctl("stop", unit)
    down = sd.sh(specd, "install", "--unit", unit, "--dry-run", "--add-enable-metrics")
    assert (
        f"warning: SGLang at {TWIN_URL} (from {unit}'s --host/--port) does not answer now ("
        in down.stdout
    ), down.stdout
    assert "+    --enable-metrics" in down.stdout


def test_reinstall_for_another_unit_acts_on_no_override_of_the_last(sd: Container) -> None:
    closed = serve_with_no_window(sd, SGLANG_UNIT, deployment_unit())
    specd = str(VENV_SPECD)
    other = "llm.service"
    rebound = uninstalled = False
    try:
        sd.sh(specd, "install", "--unit", SGLANG_UNIT, "--yes", timeout=90)
        before_pin = sd.main_pid(SGLANG_UNIT)
        sd.sh(specd, "override", "pin", "4", "--for", "2h", "--reason", "on-call", "--now")
        sd.wait_for(lambda: live_steps(sd) == 4, timeout=45, interval=0.5, what="pinned 4")
        assert sd.main_pid(SGLANG_UNIT) != before_pin

        gone = sd.sh(specd, "uninstall", timeout=90)
        found = re.search(
            r"archived specd's own files in (/var/backups/specd/uninstall-\S+)/:", gone.stdout
        )
        assert found, gone.stdout
        archived = found.group(1) + "/etc/specd/override.toml"
        assert f"/etc/specd/override.toml → {archived}" in gone.stdout
        assert 'mode = "pin"' in sd.sh("cat", archived).stdout
        assert not (sd.config_dir / "override.toml").exists()
        assert not list(sd.state_dir.iterdir())  # state and env file archived too
        assert "state.json" in sd.sh("ls", found.group(1) + "/var/lib/specd").stdout

        # An older specd's uninstall left its pin behind: put it back, as it would be.
        sd.sh("cp", archived, "/etc/specd/override.toml")
        sd.systemctl("stop", SGLANG_UNIT)
        sd.write_unit(other, deployment_unit())
        sd.daemon_reload()
        sd.systemctl("start", other)
        sd.wait_http("/health")
        # The container binds the repo's rule (for sglang.service) over this path; a rule
        # for another unit must be writable.
        sd.sh("umount", POLKIT_RULE)
        rebound = True
        pid = sd.main_pid(other)
        restarts = sd.show(other, "NRestarts")
        again = sd.sh(specd, "install", "--unit", other, "--yes", timeout=90)
        moved = re.search(r"moved /etc/specd/override.toml to (\S+) \(", again.stdout)
        assert moved, again.stdout
        assert 'mode = "pin"' in sd.sh("cat", moved.group(1)).stdout
        assert not (sd.config_dir / "override.toml").exists()
        sd.wait_for(
            lambda: "steps" in sd.show(SPECD_UNIT, "StatusText"), timeout=30, what="specd ticks"
        )
        watched_until = time.monotonic() + QUIET_AFTER_INSTALL_S
        while time.monotonic() < watched_until:
            assert sd.main_pid(other) == pid, sd.journal(SPECD_UNIT)
            time.sleep(0.5)
        assert sd.show(other, "NRestarts") == restarts
        assert live_steps(sd) == 3

        # Issue 11 item 5: an operator's edit of specd.toml survives uninstall.
        config = sd.config_dir / "specd.toml"
        config.write_text(config.read_text() + "# on-call: window moved for the launch\n")
        last = sd.sh(specd, "uninstall", timeout=90)
        uninstalled = True
        kept = re.search(
            r"/etc/specd/specd.toml was edited since install: kept it as (\S+)", last.stdout
        )
        assert kept, last.stdout
        backup = sd.config_dir / kept.group(1).rsplit("/", 1)[1]
        assert backup.read_text().endswith("# on-call: window moved for the launch\n")
        assert config.read_text() == operator_config(closed)  # the file as before install
    finally:
        if not uninstalled:
            sd.sh(specd, "uninstall", check=False, timeout=90)
        if rebound:
            sd.sh(
                "mount",
                "-o",
                "bind,ro",
                str(REPO / "etc/polkit-1/rules.d/50-specd.rules"),
                POLKIT_RULE,
            )
            # polkitd sees rule files change through inotify, which a mount over the file
            # does not trigger: it would keep the rules it read last (none for specd once
            # uninstalled) and a later test's restart as specd would be refused.
            sd.systemctl("restart", "polkit.service")
