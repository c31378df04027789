"""`specd status` and `specd doctor` with a [fleet], against a real etcd on loopback."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

# One etcd for the module (fixture etcd_server) beside conftest's one per test (etcd).
from factories import EtcdProcess, module_etcd_server  # noqa: F401
from in_process import specd_main
from test_doctor import doctor

from specd.commands.status import collect, render
from specd.core.settings import FleetSettings
from specd.core.text import utc_time
from specd.io.config import load_config
from specd.io.fleet import Fleet, default_instance, slot_key
from specd.io.state import State, StateStore
from specd.twin.process import free_port


def fleet_table(*endpoints: str) -> str:
    return (
        f'[fleet]\netcd_endpoints = {json.dumps(list(endpoints))}\ngroup = "g"\n'
        'holder_name = "box-a"\netcd_timeout_s = 1.0\n'
    )


def write_config(tmp_path: Path, extra: str) -> Path:
    path = tmp_path / "specd.toml"
    (tmp_path / "state").mkdir(exist_ok=True)
    path.write_text(
        f'[sglang]\nenv_file = "{tmp_path}/sglang.env"\n'
        f'[files]\nstate_dir = "{tmp_path}/state"\noverride_file = "{tmp_path}/override.toml"\n'
        + extra
    )
    return path


def test_status_shows_the_group_and_who_holds_which_slot(tmp_path: Path, etcd: EtcdProcess) -> None:
    path = write_config(tmp_path, fleet_table(etcd.url))
    config = load_config(path)
    now = time.time()
    info = collect(config, now)
    assert info["fleet"]["holders"] == []
    assert "fleet          group g, 1 slot(s): all free" in render(info, now)

    assert config.fleet is not None
    other = Fleet(config.fleet, "box-b sglang.service")
    assert other.try_acquire() is not None
    mine = Fleet(FleetSettings(**{**config.fleet.model_dump(), "slots": 2}), "box-a")
    assert mine.try_acquire() is not None
    # As a real process, the way the on-call runs it.
    proc = subprocess.run(
        [sys.executable, "-m", "specd.cli", "status", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("fleet "))
    assert line.startswith("fleet          group g, 1 slot(s): slot 0 held by box-b sglang.service")
    assert "slot 1 held by box-a (this specd) since " in line

    etcd.stop()
    info = collect(config, time.time())
    assert info["fleet"]["holders"] is None
    assert "cannot connect" in info["fleet"]["problem"]
    assert "etcd UNAVAILABLE (no restart until it answers)" in render(info, time.time())


@pytest.mark.parametrize(
    "since",
    [1e308, -1e20, 1.7e12, 1e19],  # out of any calendar; milliseconds; past 64-bit time_t
)
def test_status_shows_a_holder_whose_since_no_clock_can_show(
    tmp_path: Path, etcd_server: EtcdProcess, since: float
) -> None:
    """A slot key's `since` is another host's word (its clock, or whatever wrote the key):
    one no calendar can show made `specd status` die with a traceback, the fleet line and
    everything after it lost to the on-call. It is shown without a time."""
    path = write_config(tmp_path, fleet_table(etcd_server.reset().url))
    config = load_config(path)
    assert config.fleet is not None
    fleet = Fleet(config.fleet, "writer")
    assert fleet.holders() == []  # the etcd as a fresh one: no slot held
    lease = fleet.etcd.grant(60)
    try:
        value = json.dumps({"holder": "box-b", "since": since})
        assert fleet.etcd.put_if_absent(slot_key("g", 0), value, lease)
        proc = specd_main("status", "--config", str(path))
    finally:
        fleet.etcd.revoke(lease)  # its key goes with it
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("fleet "))
    assert line == "fleet          group g, 1 slot(s): slot 0 held by box-b"


def test_status_and_doctor_name_a_server_out_of_service_and_since_when(
    tmp_path: Path, etcd: EtcdProcess
) -> None:
    """box-b's specd died mid-restart: its slot lease ran out, its server is still out. The
    on-call sees it counted (it holds the group's one slot as far as restarts go), and since
    when; box-a's own restart in progress shows both its slot and its marker."""
    path = write_config(tmp_path, fleet_table(etcd.url))
    config = load_config(path)
    assert config.fleet is not None
    dead = Fleet(config.fleet, "box-b sglang.service")
    marker = dead.out_marker(time.time() - 120, 600)
    dead.mark_out(marker)
    asked = time.time()
    proc = specd_main("status", "--config", str(path))
    answered = time.time()
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("fleet "))
    assert line.startswith(
        "fleet          group g, 1 slot(s): box-b sglang.service OUT OF SERVICE since "
    )
    since = utc_time(marker.since)
    shown = re.search(
        rf"OUT OF SERVICE since {re.escape(since)} \((\d+\.\d) min ago\) "
        r"\(holds no slot; counted until ",
        line,
    )
    assert shown is not None, line
    # However long status took on a busy machine: the age it read, to a tenth of a minute.
    low, high = ((t - marker.since) / 60 for t in (asked, answered))
    assert round(low, 1) <= float(shown.group(1)) <= round(high, 1)
    assert line.endswith(" at the latest unless back sooner)")
    check = doctor(tmp_path, fleet_table(etcd.url)).check_fleet()
    assert check.ok, check.detail
    assert "box-b sglang.service out of service since " in check.detail
    assert "(holds no slot; counted until " in check.detail

    assert dead.mark_in(marker) is None
    mine = Fleet(config.fleet, "box-a")
    slot = mine.try_acquire()
    assert slot is not None
    mine.mark_out(mine.out_marker(time.time(), 600))
    info = collect(config, time.time())
    assert [o["name"] for o in info["fleet"]["out"]] == ["box-a"]
    line = next(x for x in render(info, time.time()).splitlines() if x.startswith("fleet "))
    assert "slot 0 held by box-a (this specd) since " in line
    assert "; box-a OUT OF SERVICE (this specd) since " in line
    assert "holds no slot" not in line


LEFT_OUT = {
    "t": 1.0,
    "workers": [{"gateway_url": "http://127.0.0.1:9", "worker_id": "w", "url": "http://x"}],
    "tried_at": 1.0,
    "problem": "GET /workers: ConnectError",
}


@pytest.mark.parametrize(
    ("journal", "gateway", "why"),
    [
        pytest.param(None, None, ": no restart of it runs (a removal etcd refused)", id="behind"),
        pytest.param(None, {"left_out": LEFT_OUT},
                     ": kept while a gateway replica leaves the worker out", id="left-out"),
        # Its restart runs (killed mid-way, the journal waits for the next start): no why.
        pytest.param({"phase": "restart_issued"}, None, None, id="restarting"),
    ],
)  # fmt: skip
def test_status_says_why_this_servers_marker_is_there_between_restarts(
    tmp_path: Path,
    etcd: EtcdProcess,
    journal: dict[str, Any] | None,
    gateway: dict[str, Any] | None,
    why: str | None,
) -> None:
    """SpecdFleetMarkerLeftBehind's first look: the other servers wait for this one, and
    status on this host says whether it is meant to be so."""
    gateway_table = '[gateway]\nurls = ["http://127.0.0.1:9"]\nworker_url = "http://x"\n'
    config = load_config(write_config(tmp_path, fleet_table(etcd.url) + gateway_table))
    assert config.fleet is not None
    saved = State(journal=journal, gateway=gateway)
    assert StateStore(config.files.state_dir).save(saved) is None
    mine = Fleet(config.fleet, "box-a")
    mine.mark_out(mine.out_marker(time.time(), 600))
    line = next(
        x for x in render(collect(config, time.time()), time.time()).splitlines()
        if x.startswith("fleet ")
    )  # fmt: skip
    assert " OUT OF SERVICE (this specd) since " in line
    if why is None:
        assert line.endswith(" at the latest unless back sooner)"), line
    else:
        assert why in line, line


def test_status_without_a_fleet_has_no_fleet_line(tmp_path: Path) -> None:
    config = load_config(write_config(tmp_path, ""))
    info = collect(config, time.time())
    assert info["fleet"] is None
    assert "fleet" not in render(info, time.time())


def test_doctor_checks_every_etcd_endpoint_answers(tmp_path: Path, etcd: EtcdProcess) -> None:
    assert doctor(tmp_path).check_fleet().ok  # none configured: nothing to check
    check = doctor(tmp_path, fleet_table(etcd.url)).check_fleet()
    assert check.ok, check.detail
    assert f"{etcd.url} (etcd 3." in check.detail
    assert "group g, 1 slot(s): all free; this specd is 'box-a'" in check.detail

    dead = f"http://127.0.0.1:{free_port()}"
    check = doctor(tmp_path, fleet_table(etcd.url, dead)).check_fleet()
    assert not check.ok
    assert check.detail.startswith(f"etcd {dead} POST /v3/maintenance/status: cannot connect")
    assert "fleet_unavailable" in check.advice

    etcd.stop()
    check = doctor(tmp_path, fleet_table(etcd.url)).check_fleet()
    assert not check.ok
    assert "reading the slots of group g" in check.detail


def test_status_and_doctor_say_when_another_specd_uses_this_ones_holder_name(
    tmp_path: Path, etcd: EtcdProcess
) -> None:
    """box-a's config copied to another box as it was: that box's slot is not this specd's,
    and both commands say why this one restarts nothing until the name is changed."""
    path = write_config(tmp_path, fleet_table(etcd.url))
    config = load_config(path)
    assert config.fleet is not None
    copy = "fedcba9876543210fedcba9876543210 sglang.service"
    assert Fleet(config.fleet, "box-a", instance=copy).try_acquire() is not None
    clash = (
        f"another specd of fleet group g ({copy}) also calls itself 'box-a' (this one: "
        f"{default_instance('sglang.service')}): each needs its own [fleet] holder_name"
    )
    proc = specd_main("status", "--config", str(path))
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("fleet "))
    assert line.startswith("fleet          group g, 1 slot(s): slot 0 held by box-a since ")
    assert "(this specd)" not in line
    assert f"; HOLDER NAME CLASH (no restart until it is fixed): {clash}" in line

    check = doctor(tmp_path, fleet_table(etcd.url)).check_fleet()
    assert not check.ok
    assert check.detail.startswith(clash), check.detail
    assert "set [fleet] holder_name to a name no other specd of the group uses" in check.advice
