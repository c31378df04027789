"""`specd install` under a real systemd, on what an operator's box may already hold: a drop-in
written by hand at specd's path (with settings of the operator's own), one edited since
install, and an env file left by an earlier installation. Install must neither drop what the
operator wrote without saying so, nor let SGLang's next restart run a setting nobody chose."""

from __future__ import annotations

import re
import time

import pytest
import tomli_w
from nspawn import (
    SGLANG_UNIT,
    SPECD_UNIT,
    TWIN_WARMUP_S,
    VENV_PYTHON,
    VENV_SPECD,
    Container,
    static_args,
)
from test_doctor_systemd import verdicts
from test_install_repairs import no_window, start_sglang, uninstall_left
from test_install_systemd import QUIET_AFTER_INSTALL_S, deployment_unit, live_steps

from specd.io.apply import Journal
from specd.io.files import parse_toml
from specd.io.state import State, StateStore

pytestmark = [pytest.mark.systemd, pytest.mark.slow]

SPECD = str(VENV_SPECD)
DROPIN = f"{SGLANG_UNIT}.d/50-specd.conf"
GPUS = "Environment=CUDA_VISIBLE_DEVICES=0,1,2,3"


def by_hand_dropin() -> str:
    """README's "by hand" drop-in, with a line of the operator's own in it."""
    command = deployment_unit().split("ExecStart=", 1)[1].split("\nTimeoutStopSec", 1)[0]
    speculative = (
        "--speculative-algorithm NEXTN \\\n    --speculative-num-steps=3 \\\n    "
        "--speculative-eagle-topk 1 \\\n    --speculative-num-draft-tokens 4"
    )
    assert speculative in command
    command = command.replace(speculative, "$SPECD_SPECULATIVE_ARGS")
    return (
        "# specd by hand (alice, 2026-11)\n[Service]\n"
        'Environment="SPECD_SPECULATIVE_ARGS=--speculative-algorithm NEXTN '
        "--speculative-num-steps 3 --speculative-eagle-topk 1 "
        '--speculative-num-draft-tokens 4"\n'
        "EnvironmentFile=-/var/lib/specd/sglang.env\n"
        f"# GPUs 4-7 are the other team's\n{GPUS}\n"
        f"ExecStart=\nExecStart={command}\n"
    )


def environment(sd: Container) -> str:
    return sd.show(SGLANG_UNIT, "Environment")


def test_an_operators_settings_in_the_dropin_are_refused_not_dropped(sd: Container) -> None:
    """A drop-in at specd's path with a setting of the operator's own: install replaced the
    file whole, and SGLang's next restart (specd's, in a window) ran without the setting.
    Now install refuses, naming it, and keeps a copy of whatever else it replaces."""
    sd.write_unit(SGLANG_UNIT, deployment_unit())
    path = sd.write_unit(DROPIN, by_hand_dropin())
    sd.daemon_reload()
    sd.systemctl("start", SGLANG_UNIT)
    sd.wait_http("/health")
    assert "CUDA_VISIBLE_DEVICES=0,1,2,3" in environment(sd)
    (sd.config_dir / "specd.toml").write_text(no_window(sd))
    before = path.read_bytes()
    try:
        refused = sd.sh(SPECD, "install", "--unit", SGLANG_UNIT, "--yes", timeout=90, check=False)
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert f"/etc/systemd/system/{DROPIN} has settings of its own" in refused.stderr
        assert GPUS in refused.stderr
        assert f"`systemctl edit {SGLANG_UNIT}`" in refused.stderr
        assert path.read_bytes() == before
        assert not (sd.units_dir / SPECD_UNIT).exists()
        assert not (sd.config_dir / "install-manifest.json").exists()

        # Moved where the advice says (`systemctl edit` writes override.conf), install goes
        # on, and keeps the file it replaces whole, as it was.
        path.write_text(by_hand_dropin().replace(f"{GPUS}\n", ""))
        hand_written = path.read_bytes()
        sd.write_unit(f"{SGLANG_UNIT}.d/override.conf", f"[Service]\n{GPUS}\n")
        sd.daemon_reload()
        done = sd.sh(SPECD, "install", "--unit", SGLANG_UNIT, "--yes", timeout=90, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        kept = re.search(
            rf"kept /etc/systemd/system/{re.escape(DROPIN)} \(not written by specd install\) "
            r"as (/var/backups/specd/install-\S+)$",
            done.stdout,
            re.MULTILINE,
        )
        assert kept, done.stdout
        assert sd.sh("cat", kept.group(1)).stdout.encode() == hand_written

        # Edited since install: a setting is refused again, a comment is kept.
        installed = path.read_text()
        path.write_text(installed + "LimitMEMLOCK=infinity\n")
        again = sd.sh(SPECD, "install", "--unit", SGLANG_UNIT, "--yes", timeout=90, check=False)
        assert again.returncode == 1, again.stdout + again.stderr
        assert "would drop: LimitMEMLOCK=infinity." in again.stderr
        path.write_text(installed.replace("# Written by", "# (checked by bob) Written by"))
        edited = path.read_bytes()
        again = sd.sh(SPECD, "install", "--unit", SGLANG_UNIT, "--yes", timeout=90)
        kept = re.search(r"\(not written by specd install\) as (\S+)$", again.stdout, re.M)
        assert kept, again.stdout
        assert sd.sh("cat", kept.group(1)).stdout.encode() == edited
        assert path.read_text() == installed
        nothing = sd.sh(SPECD, "install", "--unit", SGLANG_UNIT, "--yes", timeout=60)
        assert "nothing to do" in nothing.stdout, nothing.stdout

        sd.systemctl("restart", SGLANG_UNIT)
        sd.wait_http("/health")
        assert "CUDA_VISIBLE_DEVICES=0,1,2,3" in environment(sd)
        assert live_steps(sd) == 3
    finally:
        uninstall_left(sd)
    # Uninstall gives back the file as it was before the first install.
    assert path.read_bytes() == hand_written


def test_a_fresh_install_moves_aside_an_env_file_the_unit_does_not_read(sd: Container) -> None:
    """An earlier installation's env file (5 steps) in /var/lib/specd: install wired the unit
    to it and said SGLang's next restart changes nothing; that restart ran 5 steps, which
    this specd never chose or verified, and doctor advised the restart."""
    start_sglang(sd)
    (sd.config_dir / "specd.toml").write_text(no_window(sd))
    env = sd.state_dir / "sglang.env"
    left = (
        b"SPECD_SPECULATIVE_ARGS=--speculative-algorithm NEXTN --speculative-num-steps 5 "
        b"--speculative-eagle-topk 1 --speculative-num-draft-tokens 6\n"
    )
    env.write_bytes(left)
    try:
        done = sd.sh(SPECD, "install", "--unit", SGLANG_UNIT, "--yes", timeout=90, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        moved = re.search(r"^moved /var/lib/specd/sglang.env to (\S+) \(", done.stdout, re.M)
        assert moved, done.stdout
        assert sd.sh("cat", moved.group(1)).stdout.encode() == left
        assert not env.exists()
        sd.systemctl("restart", SGLANG_UNIT)
        sd.wait_http("/health")
        assert live_steps(sd) == 3  # today's, as install said
    finally:
        uninstall_left(sd)


def test_the_dropin_reads_the_env_file_the_config_names(sd: Container) -> None:
    """specd.toml names another env file ([sglang] env_file): the drop-in install wrote read
    /var/lib/specd/sglang.env all the same, so a pin restarted SGLang into the step count it
    had, failed its verification and rolled back (a second restart), and doctor saw nothing
    wrong."""
    start_sglang(sd)
    config = parse_toml(no_window(sd))
    config.setdefault("sglang", {})["env_file"] = "/var/lib/specd/llm.env"
    (sd.config_dir / "specd.toml").write_text(tomli_w.dumps(config))
    try:
        sd.sh(SPECD, "install", "--unit", SGLANG_UNIT, "--yes", timeout=90)
        assert "/var/lib/specd/llm.env" in sd.show(SGLANG_UNIT, "EnvironmentFiles")
        _, found = verdicts(sd)
        assert found["drop-in"]["ok"], found["drop-in"]
        sd.sh(SPECD, "override", "pin", "4", "--for", "2h", "--reason", "on-call", "--now")
        sd.wait_for(lambda: live_steps(sd) == 4, timeout=45, interval=0.5, what="pinned 4")
        assert "frozen         no" in sd.sh(SPECD, "status").stdout

        # The operator moves the env file in the config, not in the unit: doctor says so.
        text = (sd.config_dir / "specd.toml").read_text()
        (sd.config_dir / "specd.toml").write_text(text.replace("llm.env", "other.env"))
        code, found = verdicts(sd)
        assert code == 1
        assert not found["drop-in"]["ok"]
        assert found["drop-in"]["detail"].startswith(
            f"{SGLANG_UNIT} does not read [sglang] env_file /var/lib/specd/other.env (it "
            "reads /var/lib/specd/llm.env): no setting specd writes would reach SGLang"
        ), found["drop-in"]
        assert f"`specd install --unit {SGLANG_UNIT}`" in found["drop-in"]["advice"]
        (sd.config_dir / "specd.toml").write_text(text)
    finally:
        uninstall_left(sd)


OTHER_SGLANG = "other-sglang.service"


def test_an_url_that_is_not_the_units_server_is_refused(sd: Container) -> None:
    """`--url` naming another server (another box of the fleet, or another SGLang of this
    one): install wired specd to watch it and restart this unit, so every change failed its
    verification, restarted the unit again to roll back, and froze specd."""
    start_sglang(sd)
    (sd.config_dir / "specd.toml").write_text(no_window(sd))
    sd.sh(
        "systemd-run", f"--unit={OTHER_SGLANG}", "--quiet", SPECD, "twin", "--port", "31000",
        "--enable-metrics", "--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2",
        "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "3",
        "--load-time-s", "0.5", "--warmup-s", f"{TWIN_WARMUP_S:g}",
    )  # fmt: skip
    try:
        sd.wait_http("/health", base="http://127.0.0.1:31000")
        for url, says in (
            (
                "http://10.1.2.3:30000",
                f"--url http://10.1.2.3:30000: 10.1.2.3 is not an address of this machine, "
                f"and specd restarts {SGLANG_UNIT} on this one",
            ),
            (
                "http://127.0.0.1:31000",
                f"--url http://127.0.0.1:31000: the SGLang there runs --port 31000, but "
                f"{SGLANG_UNIT} runs --port 30000: that is another server",
            ),
        ):
            refused = sd.sh(
                SPECD, "install", "--unit", SGLANG_UNIT, "--url", url, "--yes",
                timeout=90, check=False,
            )  # fmt: skip
            assert refused.returncode == 1, refused.stdout + refused.stderr
            assert says in refused.stderr, refused.stderr
            assert not (sd.units_dir / DROPIN).exists()
            assert not (sd.units_dir / SPECD_UNIT).exists()
        # Its own server, named explicitly, is fine.
        done = sd.sh(
            SPECD, "install", "--unit", SGLANG_UNIT, "--url", "http://127.0.0.1:30000", "--yes",
            timeout=90, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        _, found = verdicts(sd)
        assert found["sglang"]["ok"], found["sglang"]

        # The config pointed at the other server after install: doctor says which.
        config = sd.config_dir / "specd.toml"
        text = config.read_text()
        config.write_text(text.replace("http://127.0.0.1:30000", "http://127.0.0.1:31000"))
        code, found = verdicts(sd)
        config.write_text(text)
        assert code == 1
        assert found["sglang"]["detail"] == (
            "http://127.0.0.1:31000 answers /server_info, but it runs --port 31000, "
            f"{SGLANG_UNIT} --port 30000: specd would watch that server and restart "
            f"{SGLANG_UNIT} (every change fails its verification)"
        ), found["sglang"]
        assert "set [sglang] url to the URL" in found["sglang"]["advice"]
    finally:
        sd.systemctl("stop", OTHER_SGLANG, check=False)
        uninstall_left(sd)


def test_a_fresh_install_acts_on_no_restart_journal_left_by_an_earlier_one(sd: Container) -> None:
    """An earlier installation, killed in the middle of a restart (4 → 5 steps) and removed
    by hand, left its state.json in /var/lib/specd. The new specd, started by install, found
    its journal and rolled that restart back: it restarted SGLang into 4 steps at install."""
    start_sglang(sd)
    (sd.config_dir / "specd.toml").write_text(no_window(sd))
    old_env = "SPECD_SPECULATIVE_ARGS=" + " ".join(static_args("4", "5")) + "\n"
    journal = Journal(
        phase="restart_issued",
        from_steps=4,
        to_steps=5,
        unit=SGLANG_UNIT,
        env_file="/var/lib/specd/sglang.env",
        previous_env=old_env,
        previous_env_encoding="utf-8",
        started_at=time.time() - 86400,
        restarts_issued=1,
        restart_issued_at=time.time() - 86400,
        from_setting="4",
        to_setting="5",
    )
    assert StateStore(sd.state_dir).save(State(journal=journal.to_dict())) is None
    pid = sd.main_pid(SGLANG_UNIT)
    try:
        done = sd.sh(SPECD, "install", "--unit", SGLANG_UNIT, "--yes", timeout=90, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        assert re.search(r"^moved /var/lib/specd/state.json to \S+ \(", done.stdout, re.M), (
            done.stdout
        )
        sd.wait_for(
            lambda: "steps" in sd.show(SPECD_UNIT, "StatusText"), timeout=30, what="specd ticks"
        )
        watched_until = time.monotonic() + QUIET_AFTER_INSTALL_S
        while time.monotonic() < watched_until:
            assert sd.main_pid(SGLANG_UNIT) == pid, sd.journal(SPECD_UNIT)
            time.sleep(0.5)
        assert live_steps(sd) == 3
    finally:
        uninstall_left(sd)


def test_doctor_fails_a_specd_that_does_not_start_at_boot(sd: Container) -> None:
    """`systemctl disable specd` (or an install by hand that only started it): doctor said
    ✓ service, and the next reboot ended the tuning."""
    start_sglang(sd)
    (sd.config_dir / "specd.toml").write_text(no_window(sd))
    try:
        sd.sh(SPECD, "install", "--unit", SGLANG_UNIT, "--yes", timeout=90)
        _, found = verdicts(sd)
        assert found["service"]["ok"], found["service"]
        sd.systemctl("disable", SPECD_UNIT)
        code, found = verdicts(sd)
        assert code == 1
        assert found["service"]["detail"] == (
            f"{SPECD_UNIT} is active/running but disabled: it does not start at boot"
        ), found["service"]
        assert found["service"]["advice"] == f"`systemctl enable {SPECD_UNIT}`"
    finally:
        uninstall_left(sd)


def test_an_uninstall_that_cannot_disable_specd_stops_it_first(sd: Container) -> None:
    """A read-only /etc/systemd/system: `systemctl disable --now` failed (and so stopped
    nothing), and uninstall went on moving the running specd's state and lock away and
    restoring the config from under it, until it failed at the drop-in: specd ran on,
    restarting SGLang in its windows, with no state."""
    start_sglang(sd)
    (sd.config_dir / "specd.toml").write_text(no_window(sd))
    cat_before = sd.systemctl("cat", "--no-pager", SGLANG_UNIT)
    sd.sh(SPECD, "install", "--unit", SGLANG_UNIT, "--yes", timeout=90)
    sd.sh("mount", "-o", "remount,ro,bind", "/etc/systemd/system")
    read_only = True
    try:
        failed = sd.sh(SPECD, "uninstall", timeout=90, check=False)
        assert failed.returncode == 1, failed.stdout + failed.stderr
        assert "failed: `systemctl disable --now specd.service` exit 1" in failed.stdout
        assert "ran `systemctl stop specd.service` exit 0" in failed.stdout, failed.stdout
        assert sd.active_state(SPECD_UNIT) == "inactive"
        sd.sh("mount", "-o", "remount,rw,bind", "/etc/systemd/system")
        read_only = False
        done = sd.sh(SPECD, "uninstall", timeout=90, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        assert sd.systemctl("cat", "--no-pager", SGLANG_UNIT) == cat_before
        assert not (sd.units_dir / SPECD_UNIT).exists()
    finally:
        if read_only:
            sd.sh("mount", "-o", "remount,rw,bind", "/etc/systemd/system", check=False)
        uninstall_left(sd)


def test_uninstall_after_specd_failed_leaves_no_failed_unit(sd: Container) -> None:
    """Install stopped at `enable --now` (specd's metrics port held by another process), then
    uninstall: specd.service stayed listed as failed, the system "degraded"."""
    start_sglang(sd)
    (sd.config_dir / "specd.toml").write_text(no_window(sd))
    blocker = "specd-port-blocker.service"
    sd.sh(
        "systemd-run", f"--unit={blocker}", "--quiet", str(VENV_PYTHON), "-m", "http.server",
        "9464", "--bind", "127.0.0.1",
    )  # fmt: skip
    try:
        failed = sd.sh(SPECD, "install", "--unit", SGLANG_UNIT, "--yes", timeout=90, check=False)
        assert failed.returncode == 1, failed.stdout + failed.stderr
        assert "`systemctl enable --now specd.service` exit 1" in failed.stderr

        def gave_up() -> bool:
            # Each start fails at once; past StartLimitBurst= systemd stops retrying.
            sd.systemctl("restart", SPECD_UNIT, check=False, timeout=60)
            return sd.active_state(SPECD_UNIT) == "failed"

        sd.wait_for(gave_up, timeout=90, interval=0.2, what="specd.service failed")
        done = sd.sh(SPECD, "uninstall", timeout=90, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        assert sd.systemctl("list-units", "--failed", "--no-legend", "--plain") == ""
        assert sd.sh("systemctl", "is-system-running", check=False).stdout.strip() == "running"
    finally:
        sd.systemctl("stop", blocker, check=False)
        uninstall_left(sd)
