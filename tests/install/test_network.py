"""specd.service is allowed to reach what specd.toml names beyond loopback (SGLang, gateway
replicas, etcd endpoints): the rendered unit as systemd-analyze reads it. Host names resolved
under a real systemd, with the container's own /etc/hosts: tests/systemd/test_install_repairs.py.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from install_views import BASE, FRESH, PYTHON, SPEC, SPECD, view_of

from specd.install.layout import SPECD_UNIT, UNITS_DIR, InstallError, Layout
from specd.install.network import reach
from specd.install.plan import FleetOptions, GatewayOptions, build_plan

SPECD_PATH = UNITS_DIR / SPECD_UNIT


def specd_service(plan_files: list) -> str:  # type: ignore[type-arg]
    return next(c for c in plan_files if c.path == SPECD_PATH).new.decode()


def allow_lines(unit_text: str) -> list[str]:
    return [line for line in unit_text.splitlines() if line.startswith("IPAddressAllow=")]


def test_the_endpoints_of_gateway_and_fleet_are_allowed(tmp_path: Path) -> None:
    plan = build_plan(
        view_of(f"{BASE} {SPEC}"),
        Layout(tmp_path),
        FRESH,
        add_metrics=False,
        specd_argv=SPECD,
        gateway=GatewayOptions(["http://10.0.0.3:30080", "http://[fd00::2]:30080"]),
        fleet=FleetOptions(["http://10.0.0.5:2379", "http://localhost:2379"], "g"),
    )
    text = specd_service(plan.files)
    # The shipped lines stay; one more, after them, with every address outside loopback.
    assert allow_lines(text) == [
        "IPAddressAllow=localhost",
        "IPAddressAllow=10.0.0.3 10.0.0.5 fd00::2",
    ]
    assert text.index("IPAddressDeny=any") < text.index("IPAddressAllow=10.0.0.3")
    # IP literals need no note; nothing to resolve, so no name server either.
    assert not [n for n in plan.notes if "IPAddressAllow" in n or "name servers" in n]
    verify(tmp_path / "verify", text)


def test_sglang_elsewhere_is_allowed_and_loopback_adds_nothing(tmp_path: Path) -> None:
    view = view_of(f"{PYTHON} --enable-metrics --port 31000 {SPEC}")
    plan = build_plan(view, Layout(tmp_path), FRESH, add_metrics=False, specd_argv=SPECD)
    assert allow_lines(specd_service(plan.files)) == ["IPAddressAllow=localhost"]
    # SGLang listening on an address of the machine beyond loopback.
    elsewhere = build_plan(
        view_of(f"{PYTHON} --enable-metrics --host 192.0.2.7 --port 31000 {SPEC}"),
        Layout(tmp_path),
        FRESH,
        add_metrics=False,
        specd_argv=SPECD,
    )
    assert allow_lines(specd_service(elsewhere.files))[1:] == ["IPAddressAllow=192.0.2.7"]


@pytest.mark.parametrize(
    ("url", "refused"),
    [
        ("http://127.0.0.1:31000", False),
        ("http://[::1]:31000", False),
        ("http://localhost:31000", False),
        # No address of this machine: specd would watch it and restart the unit here.
        ("http://192.0.2.7:31000", True),
        ("http://[2001:db8::7]:31000", True),
        # Not resolvable now: install warns of that (reach), and cannot tell.
        ("http://no-such-host.invalid:31000", False),
    ],
)
def test_an_url_on_another_machine_is_refused(tmp_path: Path, url: str, refused: bool) -> None:
    view = view_of(f"{PYTHON} --enable-metrics --port 31000 {SPEC}")

    def plan() -> object:
        return build_plan(
            view, Layout(tmp_path), FRESH, add_metrics=False, specd_argv=SPECD, url=url
        )

    if not refused:
        plan()
        return
    with pytest.raises(InstallError, match=r"is not an address of this machine, and specd"):
        plan()


def test_a_host_name_is_resolved_now_and_its_name_servers_allowed(tmp_path: Path) -> None:
    layout = Layout(tmp_path)
    resolv = layout.host(Path("/etc/resolv.conf"))
    resolv.parent.mkdir(parents=True)
    resolv.write_text("# ours\nnameserver 127.0.0.53\nnameserver 10.9.9.9\nsearch lan\n")
    # A name that does not resolve is said, and still needs the name servers at run time.
    config = (
        '[sglang]\nurl = "http://localhost:1"\n'
        '[fleet]\netcd_endpoints = ["http://no-such-host.invalid:2379"]\n'
    )
    found = reach(config, layout)
    assert found.addresses == ["10.9.9.9"]
    assert any("name servers of /etc/resolv.conf (10.9.9.9)" in n for n in found.notes)
    [warning] = found.warnings
    assert warning.startswith("etcd endpoint http://no-such-host.invalid:2379: cannot resolve")
    assert "run `specd install` again" in warning


def verify(root: Path, unit_text: str) -> None:
    """systemd-analyze reads the unit: unknown keys and bad values exit 0 but print."""
    units = root / "etc/systemd/system"
    units.mkdir(parents=True)
    (units / SPECD_UNIT).write_text(unit_text)
    program = root / SPECD[0].lstrip("/")
    program.parent.mkdir(parents=True)
    program.write_text("#!/bin/sh\nexit 0\n")
    program.chmod(0o755)
    kill = root / "bin/kill"
    kill.parent.mkdir(parents=True)
    shutil.copy(program, kill)
    if shutil.which("systemd-analyze") is None:
        pytest.fail("systemd-analyze not found: install systemd (scripts/install-system-deps)")
    argv = ["systemd-analyze", "verify", f"--root={root}", "--recursive-errors=no", "--man=no"]
    result = subprocess.run(
        [*argv, SPECD_UNIT],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        env={"LC_ALL": "C"},
    )
    assert (result.returncode, result.stderr) == (0, "")
