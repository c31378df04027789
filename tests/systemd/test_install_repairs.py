"""`specd install` / `specd uninstall` under a real systemd, in the situations an operator
audit found them wrong: an etcd endpoint named by host name (the shipped unit reaches
loopback only); uninstall after install migrated a drop-in of the older form; a step that
fails midway, and the run after it; uninstall once the SGLang unit is gone; a dry run
without root."""

from __future__ import annotations

import os
import stat

import pytest
from nspawn import SGLANG_UNIT, SPECD_UNIT, VENV_SPECD, Container
from test_install_systemd import deployment_unit, live_steps, operator_config

pytestmark = [pytest.mark.systemd, pytest.mark.slow]

SPECD = str(VENV_SPECD)
ETCD_ADDRESS = "10.1.2.3"
ETCD_HOST = "etcd-a.test"


def start_sglang(sd: Container) -> None:
    sd.write_unit(SGLANG_UNIT, deployment_unit())
    sd.daemon_reload()
    sd.systemctl("start", SGLANG_UNIT)
    sd.wait_http("/health")


def uninstall_left(sd: Container) -> None:
    """A test's cleanup: `specd uninstall` of what it left installed. Without install's
    manifest the command has nothing to do (and says only that): no process for it."""
    if (sd.config_dir / "install-manifest.json").exists():
        sd.sh(SPECD, "uninstall", check=False, timeout=90)


def no_window(sd: Container) -> str:
    """The operator's config with no window for a month: only a pin applied now restarts."""
    return operator_config(float(sd.sh("date", "+%s.%N").stdout) + 30 * 86400)


def test_an_etcd_endpoint_named_by_host_is_allowed_at_its_address(sd: Container) -> None:
    """The container's own /etc/hosts names the endpoint. What is checked is what systemd
    makes of the installed unit (`systemctl show -p IPAddressAllow`): this machine's kernel
    (gVisor) has no cgroup BPF, so systemd here does not enforce IPAddressDeny= at all, and
    a connection from specd.service cannot show the difference."""
    start_sglang(sd)
    (sd.config_dir / "specd.toml").write_text(no_window(sd))
    hosts = f"cp /etc/hosts /run/hosts.orig; echo '{ETCD_ADDRESS} {ETCD_HOST}' >> /etc/hosts"
    sd.sh("sh", "-c", hosts)
    installed = False
    try:
        done = sd.sh(
            SPECD,
            "install",
            "--unit",
            SGLANG_UNIT,
            "--etcd-endpoint",
            f"http://{ETCD_HOST}:2379",
            "--fleet-group",
            "g",
            "--allow-unreachable",  # no etcd runs there
            "--yes",
            timeout=90,
            check=False,
        )
        installed = True
        assert done.returncode == 0, done.stdout + done.stderr
        allowed = sd.show(SPECD_UNIT, "IPAddressAllow").split()
        assert f"{ETCD_ADDRESS}/32" in allowed, allowed
        # Said, with the address it was resolved to and what to do when it moves.
        assert f"{ETCD_HOST} is {ETCD_ADDRESS} now" in done.stdout, done.stdout
        assert "run `specd install` again if it changes" in done.stdout
    finally:
        if installed:
            uninstall_left(sd)
        sd.sh("sh", "-c", "cp /run/hosts.orig /etc/hosts", check=False)


def step_variable_dropin() -> str:
    """The drop-in of the older form (README's "by hand" of before): the two step variables
    in the unit's own command, read from specd's env file."""
    command = deployment_unit().split("ExecStart=", 1)[1].split("\nTimeoutStopSec", 1)[0]
    for written, variable in (
        ("--speculative-num-steps=3", "--speculative-num-steps=${SPECULATIVE_NUM_STEPS}"),
        ("--speculative-num-draft-tokens 4 ", "--speculative-num-draft-tokens "
         "${SPECULATIVE_NUM_DRAFT_TOKENS} "),
    ):  # fmt: skip
        assert written in command
        command = command.replace(written, variable)
    return (
        "[Service]\nEnvironment=SPECULATIVE_NUM_STEPS=3 SPECULATIVE_NUM_DRAFT_TOKENS=4\n"
        f"EnvironmentFile=-/var/lib/specd/sglang.env\nExecStart=\nExecStart={command}\n"
    )


def test_uninstall_after_a_migration_gives_sglang_back_what_it_ran(sd: Container) -> None:
    sd.write_unit(SGLANG_UNIT, deployment_unit())
    sd.write_unit(f"{SGLANG_UNIT}.d/50-specd.conf", step_variable_dropin())
    env = sd.state_dir / "sglang.env"
    env_before = (
        b"# the step count specd chose\nSPECULATIVE_NUM_STEPS=4\nSPECULATIVE_NUM_DRAFT_TOKENS=5\n"
    )
    env.write_bytes(env_before)
    os.chown(sd.state_dir, 0, 0)
    sd.state_dir.chmod(0o755)
    sd.daemon_reload()
    sd.systemctl("start", SGLANG_UNIT)
    sd.wait_http("/health")
    assert live_steps(sd) == 4  # the env file's, not the drop-in's default 3
    (sd.config_dir / "specd.toml").write_text(no_window(sd))
    done = sd.sh(SPECD, "install", "--unit", SGLANG_UNIT, "--yes", timeout=90, check=False)
    try:
        assert done.returncode == 0, done.stdout + done.stderr
        assert "step variables" in done.stdout
        assert b"SPECD_SPECULATIVE_ARGS=" in env.read_bytes()
    finally:
        gone = sd.sh(SPECD, "uninstall", timeout=90, check=False)
    assert gone.returncode == 0, gone.stdout + gone.stderr
    info = sd.state_dir.stat()
    assert (stat.S_IMODE(info.st_mode), info.st_uid, info.st_gid) == (0o755, 0, 0), gone.stdout
    # The restored drop-in reads the env file it read before install, and so SGLang runs,
    # after its next restart, what it ran then.
    assert env.read_bytes() == env_before, gone.stdout
    sd.systemctl("restart", SGLANG_UNIT)
    sd.wait_http("/health")
    assert live_steps(sd) == 4


RULES_DIR = "/etc/polkit-1/rules.d"


def test_a_failed_step_names_its_path_and_a_second_run_finishes(sd: Container) -> None:
    start_sglang(sd)
    (sd.config_dir / "specd.toml").write_text(no_window(sd))
    # A read-only rules.d: install writes the drop-in and specd.service before the rule.
    sd.sh("mount", "-t", "tmpfs", "-o", "ro,mode=0755", "tmpfs", RULES_DIR)
    mounted = True
    try:
        failed = sd.sh(SPECD, "install", "--unit", SGLANG_UNIT, "--yes", timeout=90, check=False)
        assert failed.returncode == 1
        lines = failed.stderr.splitlines()
        assert lines[0] == (
            f"specd install: cannot write {RULES_DIR}/50-specd.rules: Read-only file system"
        ), failed.stderr
        assert lines[1] == (
            f"install stopped after: wrote /etc/systemd/system/{SGLANG_UNIT}.d/50-specd.conf; "
            f"wrote /etc/systemd/system/{SPECD_UNIT}"
        )
        assert "run `specd install` again" in lines[2]
        assert "`specd uninstall`" in lines[2]
        sd.sh("umount", RULES_DIR)
        mounted = False
        again = sd.sh(SPECD, "install", "--unit", SGLANG_UNIT, "--yes", timeout=90)
        # systemd has not read the drop-in written by the first run: this one reloads.
        assert "ran systemctl daemon-reload" in again.stdout, again.stdout
        assert sd.show(SGLANG_UNIT, "NeedDaemonReload") == "no"
        assert "50-specd.conf" in sd.show(SGLANG_UNIT, "DropInPaths")
        assert sd.active_state(SPECD_UNIT) == "active"
        nothing = sd.sh(SPECD, "install", "--unit", SGLANG_UNIT, "--yes", timeout=60)
        assert "nothing to do" in nothing.stdout, nothing.stdout
    finally:
        if mounted:
            sd.sh("umount", RULES_DIR, check=False)
        uninstall_left(sd)


def test_a_reinstall_that_stopped_midway_reloads_systemd_when_run_again(sd: Container) -> None:
    """specd is installed and running; a reinstall that changes specd.service stops before
    its daemon-reload. Run again, it finds the unit files right but systemd still on the old
    specd.service, and must reload before it restarts specd."""
    start_sglang(sd)
    config = "/etc/specd/specd.toml"
    (sd.config_dir / "specd.toml").write_text(no_window(sd))
    sd.sh(SPECD, "install", "--unit", SGLANG_UNIT, "--yes", timeout=90)
    fleet = ["--etcd-endpoint", "http://10.1.2.3:2379", "--fleet-group", "g"]
    # The config cannot be replaced (a mount point), after specd.service was rewritten.
    sd.sh("mount", "--bind", "-o", "ro", config, config)
    mounted = True
    try:
        failed = sd.sh(
            SPECD, "install", "--unit", SGLANG_UNIT, *fleet, "--allow-unreachable", "--yes",
            timeout=90, check=False,
        )  # fmt: skip
        assert failed.returncode == 1
        lines = failed.stderr.splitlines()
        assert lines[0] == f"specd install: cannot write {config}: Device or resource busy"
        assert lines[1] == f"install stopped after: wrote /etc/systemd/system/{SPECD_UNIT}"
        sd.sh("umount", config)
        mounted = False
        again = sd.sh(
            SPECD, "install", "--unit", SGLANG_UNIT, *fleet, "--allow-unreachable", "--yes",
            timeout=90,
        )  # fmt: skip
        assert "ran systemctl daemon-reload" in again.stdout, again.stdout
        assert sd.show(SPECD_UNIT, "NeedDaemonReload") == "no"
        assert "10.1.2.3/32" in sd.show(SPECD_UNIT, "IPAddressAllow").split()
    finally:
        if mounted:
            sd.sh("umount", config, check=False)
        uninstall_left(sd)


def test_uninstall_after_the_sglang_unit_was_deleted_succeeds(sd: Container) -> None:
    start_sglang(sd)
    (sd.config_dir / "specd.toml").write_text(no_window(sd))
    sd.sh(SPECD, "install", "--unit", SGLANG_UNIT, "--yes", timeout=90)
    sd.systemctl("stop", SGLANG_UNIT)
    (sd.units_dir / SGLANG_UNIT).unlink()
    sd.daemon_reload()
    gone = sd.sh(SPECD, "uninstall", "--restart-sglang", timeout=90, check=False)
    assert gone.returncode == 0, gone.stdout + gone.stderr
    assert (
        f"note: {SGLANG_UNIT} no longer exists (no unit file): nothing to compare or restart"
        in (gone.stdout)
    )
    assert gone.stderr == ""
    assert not (sd.units_dir / SPECD_UNIT).exists()
    assert not (sd.config_dir / "install-manifest.json").exists()


def test_a_dry_run_needs_no_root_and_an_install_says_it_does(sd: Container) -> None:
    start_sglang(sd)
    config = sd.config_dir / "specd.toml"
    config.write_text(no_window(sd))
    config.chmod(0o640)  # root's and its group's, as an operator may keep it
    # Debian's polkit keeps its rules directory to itself.
    mode = sd.sh("stat", "-c", "%a", RULES_DIR).stdout.strip()
    sd.sh("chmod", "0700", RULES_DIR)
    try:
        dry = sd.sh(SPECD, "install", "--unit", SGLANG_UNIT, "--dry-run", user="nobody",
                    timeout=60, check=False)  # fmt: skip
        assert dry.returncode == 0, dry.stdout + dry.stderr
        for unreadable in (f"{RULES_DIR}/50-specd.rules", "/etc/specd/specd.toml"):
            assert f"note: cannot read {unreadable} as this user (Permission denied)" in (
                dry.stdout
            ), dry.stdout
        # What it can read it still shows.
        assert f"+++ /etc/systemd/system/{SGLANG_UNIT}.d/50-specd.conf (new, 0644)" in dry.stdout
        done = sd.sh(SPECD, "install", "--unit", SGLANG_UNIT, "--yes", user="nobody",
                     timeout=60, check=False)  # fmt: skip
        assert (done.returncode, done.stdout) == (1, "")
        assert done.stderr == (
            "specd install: must run as root (writes /etc, runs systemctl); see --dry-run\n"
        )
    finally:
        sd.sh("chmod", mode, RULES_DIR)
