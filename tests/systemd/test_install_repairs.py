"""`specd install` / `specd uninstall` under a real systemd, in the situations an operator
audit found them wrong: an etcd endpoint named by host name (the shipped unit reaches
loopback only); uninstall after install migrated a drop-in of the older form."""

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
            sd.sh(SPECD, "uninstall", check=False, timeout=90)
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
