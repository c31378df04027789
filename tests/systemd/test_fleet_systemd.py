"""Issue 14's rolling change, the whole path under the real systemd: in ONE booted
container, three twin-backed SGLang units (each the repo's drop-in plus its own env file,
as install_twin_sglang sets one up), one specd per unit, and fleet_inside.py running a real
etcd, a real smg gateway (no retries) and streaming load through it. All three specds get
an on-call pin with apply = "now" at once (tests/test_faults_fleet.py and the plain-process
e2e cover the load-triggered path): each takes the one etcd slot, drains its worker at the
gateway, has systemd restart its unit through `systemctl`, re-adds the worker and releases.

The specds run as root units, not as three copies of specd.service: the shipped polkit
rule lets user specd restart exactly one unit (one server per host), and this container
plays three hosts. Everything asserted comes from systemd, journald, the gateway, the
twins, etcd and the state files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import tomli_w
from factories import SMG_ADMIN_KEY, tables
from nspawn import VENV_PYTHON, VENV_SPECD, Container, ContainerError, exec_line

from specd.io.state import StateStore

pytestmark = [pytest.mark.systemd, pytest.mark.slow]

NAMES = ("a", "b", "c")
HARNESS_UNIT = "specd-fleet-harness.service"
HARNESS_SCRIPT = Path(__file__).resolve().parent / "fleet_inside.py"
KEY_FILE = "/etc/specd/gateway.key"
FROM_STEPS, TO_STEPS = 3, 4  # the drop-in's default, the pin
ROLL_TIMEOUT_S = 75.0


def sglang_unit(name: str) -> str:
    return f"sglang-{name}.service"


def specd_unit(name: str) -> str:
    return f"specd-fleet-{name}.service"


def port(name: str) -> int:
    return 31000 + NAMES.index(name)


def worker_url(name: str) -> str:
    return f"http://127.0.0.1:{port(name)}"


def specd_config(name: str, etcd_url: str, gateway_url: str) -> str:
    return tomli_w.dumps(
        tables(
            url=worker_url(name),
            unit=sglang_unit(name),
            env_file=f"/var/lib/specd/{name}/sglang.env",
            state_dir=f"/var/lib/specd/{name}/state",
            override_file=f"/etc/specd/{name}-override.toml",
            metrics_port=9470 + NAMES.index(name),
            scrape_interval_s=0.5,
            health_probe_timeout_s=25,
            startup_timeout_s=30,
            log_format="json",
            urls=[gateway_url],
            worker_url=worker_url(name),
            api_key_file=KEY_FILE,
            drain_timeout_s=20.0,
            ready_timeout_s=30.0,
            etcd_endpoints=[etcd_url],
            group="g",
            lease_ttl_s=5,
            holder_name=f"box-{name}",
            slot_poll_interval_s=0.2,
        )
    )


def steps_at(sd: Container, name: str) -> int:
    return int(sd.http_json("/server_info", base=worker_url(name))["speculative_num_steps"])


def report(sd: Container) -> dict[str, Any]:
    path = sd.state_dir / "fleet-report.json"
    try:
        found: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return found


def invocations(sd: Container, unit: str) -> set[str]:
    """Every invocation of `unit` journald saw: systemd's own messages about it carry
    INVOCATION_ID, the service's output _SYSTEMD_INVOCATION_ID."""
    out = sd.sh("journalctl", "-u", unit, "-o", "json", "--no-pager", check=False).stdout
    found = set()
    for line in out.splitlines():
        entry = json.loads(line)
        for key in ("INVOCATION_ID", "_SYSTEMD_INVOCATION_ID"):
            if isinstance(entry.get(key), str):
                found.add(entry[key])
    return found


def holders(sd: Container, etcd_url: str) -> list[str]:
    code = (
        "import json; from specd.core.settings import FleetSettings; "
        "from specd.io.fleet import Fleet; "
        f"f = Fleet(FleetSettings(etcd_endpoints=[{etcd_url!r}], group='g'), 'observer'); "
        "print(json.dumps([h.name for h in f.holders()]))"
    )
    names: list[str] = json.loads(sd.python("-c", code).stdout)
    return names


def restarts(sd: Container, name: str) -> list[tuple[Any, Any, Any]]:
    state, problem = StateStore(sd.state_dir / name / "state").load()
    assert problem is None
    return [(r["from_steps"], r["to_steps"], r["result"]) for r in state.restarts]


def journal_is_clear(sd: Container, name: str) -> bool:
    return StateStore(sd.state_dir / name / "state").load()[0].journal is None


def test_rolling_pin_under_real_systemd_one_at_a_time_with_zero_errors(sd: Container) -> None:
    for name in NAMES:
        (sd.state_dir / name / "state").mkdir(parents=True)
        sd.install_twin_sglang(
            unit=sglang_unit(name),
            port=port(name),
            env_file=f"/var/lib/specd/{name}/sglang.env",
            # SGLang's default: smg's probes of /health each wait for a generation.
            health_generates=True,
        )
    sd.systemctl("start", *map(sglang_unit, NAMES))
    for name in NAMES:
        sd.wait_http("/health", base=worker_url(name))
        assert steps_at(sd, name) == FROM_STEPS
    before = {name: invocations(sd, sglang_unit(name)) for name in NAMES}
    assert all(len(ids) == 1 for ids in before.values()), before

    (sd.config_dir / "gateway.key").write_text(SMG_ADMIN_KEY + "\n")
    argv = [str(VENV_PYTHON), str(HARNESS_SCRIPT), "--report", "/var/lib/specd/fleet-report.json",
            "--dir", "/var/lib/specd/harness", *map(worker_url, NAMES)]  # fmt: skip
    (sd.state_dir / "harness").mkdir()
    sd.write_unit(
        HARNESS_UNIT,
        "[Unit]\nDescription=etcd, smg and streaming load for the fleet test\n\n"
        # KillMode=mixed: the stop's SIGTERM reaches the harness alone, which ends the load
        # and then stops smg. Sent to the whole cgroup, smg stopped listening while the load
        # still ran (the harness notices a stop between looks, and a look at SGLang's
        # generating /health takes a second): hundreds of refused connections at the end.
        f"[Service]\nType=simple\nExecStart={exec_line(argv)}\nKillMode=mixed\n"
        "TimeoutStopSec=60s\n",
    )
    for name in NAMES:
        argv = [str(VENV_SPECD), "run", "--config", f"/etc/specd/{name}.toml"]
        sd.write_unit(
            specd_unit(name),
            f"[Unit]\nDescription=specd for {sglang_unit(name)}\n\n"
            "[Service]\nType=notify\nNotifyAccess=main\nEnvironment=PYTHONUNBUFFERED=1\n"
            f"ExecStart={exec_line(argv)}\nTimeoutStopSec=60s\n",
        )
    sd.daemon_reload()
    sd.systemctl("start", HARNESS_UNIT)
    try:
        loaded = sd.wait_for(
            lambda: report(sd).get("phase") == "loaded" and report(sd),
            timeout=40,
            what="etcd, gateway and load inside the container",
        )
    except ContainerError as exc:
        raise ContainerError(f"{exc}\n{sd.journal(HARNESS_UNIT)}") from exc
    for name in NAMES:
        (sd.config_dir / f"{name}.toml").write_text(
            specd_config(name, loaded["etcd_url"], loaded["gateway_url"])
        )
        (sd.config_dir / f"{name}-override.toml").write_text(
            f'mode = "pin"\nsteps = {TO_STEPS}\nexpires_at = 2099-01-01T00:00:00Z\n'
            'reason = "rolling change"\napply = "now"\n'
        )
    # All three want the change at their first tick: they queue for the one slot.
    sd.systemctl("start", *map(specd_unit, NAMES), timeout=60)
    ok_at_start = report(sd)["ok"]

    def rolled() -> bool:
        for name in NAMES:
            assert sd.active_state(specd_unit(name)) == "active", sd.journal(specd_unit(name))
        return (
            all(restarts(sd, n) and journal_is_clear(sd, n) for n in NAMES)
            and report(sd).get("out") == []
        )

    try:
        sd.wait_for(rolled, timeout=ROLL_TIMEOUT_S, interval=0.5, what="the rolling change")
    except ContainerError as exc:
        journals = "\n".join(sd.journal(specd_unit(n), lines=20) for n in NAMES)
        raise ContainerError(f"{exc}\n{report(sd)}\n{journals}") from exc
    assert holders(sd, loaded["etcd_url"]) == []  # every slot released
    # Let the load run on the re-added workers for a moment before it stops.
    sd.wait_for(lambda: report(sd)["ok"] >= ok_at_start + 20, timeout=20, what="more load")
    sd.systemctl("stop", *map(specd_unit, NAMES), timeout=60)
    sd.systemctl("stop", HARNESS_UNIT, timeout=60)
    final = report(sd)
    assert final["phase"] == "stopped", sd.journal(HARNESS_UNIT)

    # With the gateway's own log: once, every failure was the gateway refusing connections.
    assert final["failure_count"] == 0, (final["failures"], final.get("gateway_log"))
    assert final["ok"] > ok_at_start + 20
    # One at a time, and each really was out (drained) while it restarted.
    assert final["most_out"] == 1, final["episodes"]
    assert all(final["episodes"][worker_url(n)] for n in NAMES), final["episodes"]
    for name in NAMES:
        assert restarts(sd, name) == [(FROM_STEPS, TO_STEPS, "success")]
        assert steps_at(sd, name) == TO_STEPS
        # systemd ran the unit exactly twice: the first start and specd's one restart.
        after = invocations(sd, sglang_unit(name))
        assert before[name] < after, (name, after)
        assert len(after) == 2, (name, after)
        assert sd.show(sglang_unit(name), "InvocationID").replace("-", "") not in before[name]
        assert sd.show(sglang_unit(name), "NRestarts") == "0"  # no crash restarts
