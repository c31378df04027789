"""A real `specd run` with a [fleet], SIGKILLed while it holds the slot mid-restart: the
slot's lease expires, but its server, still out of service, keeps counting against the
group's slots (its out-of-service marker) until the killed specd heals on its next start,
marks it back in service and gives the slot back; then another server gets its turn. Real
etcd on loopback, the stand-in systemctl of test_faults."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from factories import EtcdProcess, module_etcd, module_etcd_server
from test_faults import (
    QUICK_HEALTH,
    UNIT,
    StandIn,
    daemon_env,
    healthy,
    log_events,
    quick_standin,
    specd_setup,  # noqa: F401 - the fixture
    start_specd,
    wait_for,
    write_config,
)

from specd.core.settings import FleetSettings
from specd.io.fleet import Fleet, default_instance
from specd.io.state import StateStore
from specd.twin.process import free_port

pytestmark = pytest.mark.slow

TTL_S = 5
HOLDER = "specd-under-test"
# One etcd for the module, reset between its tests (factories.module_etcd).
etcd, etcd_server = module_etcd, module_etcd_server


def test_sigkill_mid_restart_keeps_the_server_counted_until_the_next_start_heals_it(
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

    # Nothing renews the lease any more: the slot is gone within one TTL. Its server is
    # still out (it loads, and nobody verifies it): another server must not go yet, which
    # it did before the marker.
    wait_for(lambda: other.holders() == [], TTL_S + 5, "the killed specd's slot lease expired")
    waiter: list[tuple[object, str]] = []
    threading.Thread(
        target=lambda: waiter.append(other.acquire(threading.Event(), lambda: None)), daemon=True
    ).start()
    time.sleep(1.0)  # it tries every 0.1 s
    assert waiter == []
    probe = other.probe()
    assert probe is not None
    assert f"{HOLDER} out of service since " in probe

    # A fresh metrics port: the killed specd's was free for the seconds above, and a server
    # of another test running beside this one may listen on it by now.
    write_config(config_path, tmp_path, standin.port, free_port(), **fleet_keys)
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
    marked_in = [e for e in log_events(log2) if e.get("event") == "fleet_marked_in"]
    assert [e["detail"] for e in marked_in] == ["marked back in service in fleet group g"]
    # Back in service: the other server's turn came.
    wait_for(lambda: waiter != [], 10, "the other server's turn")
    slot, why = waiter[0]
    assert slot is not None, why
    assert [h.name for h in other.holders()] == ["box-b " + UNIT]
    assert other.busy().out == []


ANOTHER_BOX = "fedcba9876543210fedcba9876543210 " + UNIT


@pytest.mark.parametrize(
    "earlier_instance",
    [
        None,  # written by a specd that signed nothing (an older one)
        "this",  # this specd's own instance: its machine id and unit
        ANOTHER_BOX,  # another box given the same holder_name: not this one's to remove
    ],
)
def test_a_marker_an_earlier_run_left_is_removed_at_the_next_start(
    tmp_path: Path,
    specd_setup: tuple[StandIn, Path, int],  # noqa: F811
    etcd: EtcdProcess,
    earlier_instance: str | None,
) -> None:
    """A specd restarted after etcd refused its marker's removal no longer remembers it: the
    group's other servers waited for this one, serving, up to the marker's bound (an hour).
    A marker of its name that another specd signed stays, and the clash is said at once."""
    standin, config_path, metrics_port = specd_setup
    fleet_keys = {"etcd_endpoints": [etcd.url], "group": "g", "holder_name": HOLDER}
    write_config(config_path, tmp_path, standin.port, metrics_port, **fleet_keys)
    instance = default_instance(UNIT) if earlier_instance == "this" else earlier_instance
    earlier = Fleet(FleetSettings(**fleet_keys), HOLDER, instance=instance)
    earlier.mark_out(earlier.out_marker(time.time() - 300, 3600))
    other = Fleet(FleetSettings(**{**fleet_keys, "holder_name": None}), "box-b " + UNIT)
    assert [o.name for o in other.busy().out] == [HOLDER]
    log = tmp_path / "specd.log"
    looked = ("fleet_marked_in", "fleet_name_clash")
    proc = start_specd(config_path, daemon_env(standin), log)
    try:
        wait_for(
            lambda: (
                any(e.get("event") in looked for e in log_events(log)) or proc.poll() is not None
            ),
            20,
            "the look for a marker an earlier run left",
        )
        assert proc.poll() is None, log.read_text()
        page = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=40) == 0, log.read_text()
    # SpecdFleetHolderNameClash's counter: the start's look found it, or nothing.
    clashes = 1.0 if earlier_instance == ANOTHER_BOX else 0.0
    assert f"\nspecd_fleet_name_clashes_total {clashes}\n" in page
    said = [e for e in log_events(log) if e.get("event") in looked]
    assert standin.restarts == [3]  # its start only: no restart
    if earlier_instance == ANOTHER_BOX:
        assert [o.name for o in other.busy().out] == [HOLDER]  # still counted
        assert [(e["event"], e["level"]) for e in said] == [("fleet_name_clash", "warning")]
        assert said[0]["detail"].startswith(
            f"another specd of fleet group g ({ANOTHER_BOX}) also calls itself {HOLDER!r}"
        )
        return
    assert other.probe() is None  # the other server may go
    (removed,) = said
    assert removed["event"] == "fleet_marked_in"
    assert "removed this server's out-of-service marker" in removed["detail"]


def test_three_specds_whose_pins_act_together_restart_one_at_a_time(
    tmp_path: Path, etcd: EtcdProcess
) -> None:
    names = ("a", "b", "c")
    standins: dict[str, StandIn] = {}
    procs = {}
    try:
        for name in names:
            home = tmp_path / name
            (home / "state").mkdir(parents=True)
            standins[name] = quick_standin(
                home,
                free_port(),
                extra_by_steps={4: ("--load-time-s", "1.0", "--warmup-s", "0.1", *QUICK_HEALTH)},
            )
            assert standins[name].systemctl("--no-ask-password", "restart", UNIT).returncode == 0
        for name in names:
            wait_for(lambda s=standins[name]: healthy(s.url()), 20, f"twin {name}")
        for name in names:
            home = tmp_path / name
            write_config(
                home / "specd.toml",
                home,
                standins[name].port,
                free_port(),
                etcd_endpoints=[etcd.url],
                group="g",
                lease_ttl_s=TTL_S,
                holder_name=f"box-{name}",
                slot_poll_interval_s=0.2,
            )
            (home / "override.toml").write_text(
                'mode = "pin"\nsteps = 4\nexpires_at = 2099-01-01T00:00:00Z\n'
                'reason = "rolling change"\napply = "now"\n'
            )
        # All three want the change at their first tick: they queue for the one slot.
        for name in names:
            home = tmp_path / name
            procs[name] = start_specd(
                home / "specd.toml", daemon_env(standins[name]), home / "specd.log"
            )
        most_out = 0
        done = False
        deadline = time.monotonic() + 120
        while not done:
            assert time.monotonic() < deadline, [s.restarts for s in standins.values()]
            out = [n for n in names if not healthy(standins[n].url())]
            most_out = max(most_out, len(out))
            done = all(s.restarts == [3, 4] for s in standins.values()) and not out
            for name, proc in procs.items():
                assert proc.poll() is None, (tmp_path / name / "specd.log").read_text()
            # A restart keeps its twin down for over a second (it loads for one): looks
            # 50 ms apart see every one. Back to back, they cost a core for nothing.
            time.sleep(0.05)
        assert most_out == 1  # one at a time, and each really was out while it restarted
    finally:
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            proc.wait(40)
        for standin in standins.values():
            standin.stop()
    for name in names:
        state, problem = StateStore(tmp_path / name / "state").load()
        assert problem is None
        assert [(r["to_steps"], r["result"]) for r in state.restarts] == [(4, "success")]
    assert Fleet(FleetSettings(etcd_endpoints=[etcd.url], group="g"), "observer").holders() == []
