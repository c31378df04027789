"""The README's Monitoring step 1 under a real systemd: specd's metrics on an address beyond
loopback, for a Prometheus elsewhere. specd.service accepts connections from loopback only
(IPAddressAllow=localhost, IPAddressDeny=any), so such a Prometheus never scraped specd
(SpecdDown), and `specd doctor` said ✓ specd-metrics (it asks from loopback).

What is checked is what systemd makes of the unit (`systemctl show`): this machine's kernel
has no cgroup BPF, so a connection from elsewhere cannot show the difference here."""

from __future__ import annotations

import pytest
import tomli_w
from factories import tables
from nspawn import SGLANG_UNIT, SPECD_UNIT, TWIN_URL, Container
from test_doctor_systemd import verdicts

pytestmark = [pytest.mark.systemd, pytest.mark.slow]


def test_doctor_fails_metrics_no_prometheus_elsewhere_may_scrape(sd: Container) -> None:
    config = tables(
        url=TWIN_URL,
        unit=SGLANG_UNIT,
        metrics_listen_address="0.0.0.0",  # what the README has one set for Prometheus
        metrics_port=9464,
        scrape_interval_s=0.5,
    )
    sd.install_twin_sglang()
    sd.systemctl("start", SGLANG_UNIT)
    sd.wait_http("/health")
    sd.install_specd(config_toml=tomli_w.dumps(config), watchdog_sec=20)
    sd.systemctl("start", SPECD_UNIT, timeout=60)
    _, found = verdicts(sd)
    check = found["specd-metrics"]
    assert not check["ok"], check
    assert check["detail"] == (
        "http://127.0.0.1:9464/metrics answers here, but specd listens on 0.0.0.0:9464 and "
        f"{SPECD_UNIT} lets only loopback connect (IPAddressAllow=localhost, "
        "IPAddressDeny=any): a Prometheus elsewhere cannot scrape it"
    )
    assert check["advice"].startswith(
        f"`systemctl edit {SPECD_UNIT}`: [Service] IPAddressAllow=PROMETHEUS_ADDRESS"
    )

    # The README's step, followed: Prometheus' address allowed in a drop-in of one's own.
    sd.write_unit(f"{SPECD_UNIT}.d/override.conf", "[Service]\nIPAddressAllow=10.0.0.7\n")
    sd.daemon_reload()
    sd.systemctl("restart", SPECD_UNIT, timeout=60)
    _, found = verdicts(sd)
    check = found["specd-metrics"]
    assert check["ok"], check
    assert check["notes"] == [
        f"specd listens on 0.0.0.0:9464; {SPECD_UNIT} lets connect loopback and 10.0.0.7/32 "
        "only (IPAddressAllow=): Prometheus must scrape from one of them"
    ]
