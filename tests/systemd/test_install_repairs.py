"""`specd install` / `specd uninstall` under a real systemd, in the situations an operator
audit found them wrong: an etcd endpoint named by host name (the shipped unit reaches
loopback only)."""

from __future__ import annotations

import pytest
from nspawn import SGLANG_UNIT, SPECD_UNIT, VENV_SPECD, Container
from test_install_systemd import deployment_unit, operator_config

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
