"""A real `specd run` with a [fleet], SIGKILLed while it holds the slot mid-restart: the
lease expires, another server gets its turn, and the killed specd heals on its next start
and gives the slot back. Real etcd on loopback, the stand-in systemctl of test_faults."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest
from factories import EtcdProcess
from test_faults import (
    UNIT,
    StandIn,
    daemon_env,
    healthy,
    log_events,
    specd_setup,  # noqa: F401 - the fixture
    start_specd,
    wait_for,
    write_config,
)

from specd.core.settings import FleetSettings
from specd.io.fleet import Fleet
from specd.io.state import StateStore

pytestmark = pytest.mark.slow

TTL_S = 5
HOLDER = "specd-under-test"


def test_sigkill_mid_restart_frees_the_slot_and_the_next_start_heals(
    tmp_path: Path,
    specd_setup: tuple[StandIn, Path, int],  # noqa: F811
    etcd: EtcdProcess,
) -> None:
    standin, config_path, metrics_port = specd_setup
    fleet_keys = {
        "etcd_endpoints": [etcd.url],
        "group": "g",
        "lease_ttl_s": TTL_S,
        "holder_name": HOLDER,
        "slot_poll_interval_s": 0.2,
    }
    write_config(config_path, tmp_path, standin.port, metrics_port, **fleet_keys)
    other = Fleet(
        FleetSettings(**{**fleet_keys, "holder_name": None, "slot_poll_interval_s": 0.1}),
        "box-b " + UNIT,
    )
    (tmp_path / "override.toml").write_text(
        'mode = "pin"\nsteps = 4\nexpires_at = 2099-01-01T00:00:00Z\n'
        'reason = "fleet fault test"\napply = "now"\n'
    )
    log = tmp_path / "specd.log"
    proc = start_specd(config_path, daemon_env(standin), log)
    try:
        # specd took the slot and restarted the unit; SGLang loads for 2.5 s: kill it now.
        wait_for(lambda: standin.restarts == [3, 4] or proc.poll() is not None, 20, "restart")
        assert proc.poll() is None, log.read_text()
        assert [h.name for h in other.holders()] == [HOLDER]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    journal = StateStore(tmp_path / "state").load()[0].journal
    assert journal is not None
    assert journal["phase"] == "restart_issued"
    assert journal["fleet_slot"]["key"] == "/specd/g/slots/0"

    # Nothing renews the lease any more: another server gets the slot within one TTL.
    slot, why = other.acquire(threading.Event(), lambda: None)
    assert slot is not None, why
    assert other.release(slot) is None

    log2 = tmp_path / "specd2.log"
    proc = start_specd(config_path, daemon_env(standin), log2)
    try:
        wait_for(
            lambda: (
                StateStore(tmp_path / "state").load()[0].journal is None or proc.poll() is not None
            ),
            40,
            "the journal healed",
        )
        assert proc.poll() is None, log2.read_text()
        wait_for(lambda: healthy(standin.url()), 20, "SGLang")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=40) == 0, log2.read_text()
    state, problem = StateStore(tmp_path / "state").load()
    assert problem is None
    assert [(r["from_steps"], r["to_steps"], r["result"]) for r in state.restarts] == [
        (3, 4, "success")
    ]
    assert standin.restarts == [3, 4]  # healed without a second restart
    released = [e for e in log_events(log2) if e.get("event") == "fleet_slot_released"]
    assert len(released) == 1
    assert released[0]["detail"] == "released fleet slot 0 of group g"
    assert other.holders() == []
