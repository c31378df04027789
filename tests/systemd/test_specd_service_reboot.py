"""A reboot while specd restarts SGLang, under a real systemd: a `systemctl poweroff` of a
container of its own (the session's container must outlive each test), then a second boot
of the same units, state and config directories.

At a shutdown SGLang's stop waits for specd's (specd.service is After= it), and specd's for
the restart in flight. The system bus (dbus.service, which specd is not ordered after)
stops beside specd, so a specd that is not root cannot reach systemd from then on: it could
not see SGLang's start fail, waited out startup_timeout_s, and its rollback's restart
failed ("Failed to connect to bus"): "failed", and specd came back frozen after the reboot,
though SGLang booted on its old setting. Helpers from test_specd_service.py.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from nspawn import SGLANG_UNIT, SPECD_UNIT, Container, machine_name
from test_specd_service import (
    closed_window_config,
    env_steps,
    pin_now,
    start_specd,
    start_twin,
    state,
    twin_live_steps,
    wait_or_dump,
)

pytestmark = [pytest.mark.systemd, pytest.mark.slow]

# The change's start loads this long, then fails (the twin fails a start at half its load
# time): far longer than the shutdown may take.
SLOW_FAILING_LOAD_S = 40.0
STARTUP_TIMEOUT_S = 90.0
# From `systemctl poweroff` to the container's end: specd leaves at its next health poll.
# (It used to wait out startup_timeout_s, the twin's failure unseen.)
SHUTDOWN_S = 25.0


@pytest.fixture
def box(tmp_path: Path) -> Iterator[Container]:
    """A container of this test's own, halted however the test ends."""
    container = Container(root=tmp_path / "box", machine=machine_name("reboot"))
    try:
        container.boot()
        yield container
    finally:
        container.halt()


def enable_at_boot(sd: Container, *units: str) -> None:
    """What `systemctl enable` does for a unit of multi-user.target (the twin's unit file
    has no [Install] section: the link is made by hand)."""
    wants = sd.units_dir / "multi-user.target.wants"
    wants.mkdir(exist_ok=True)
    for unit in units:
        (wants / unit).symlink_to(f"/etc/systemd/system/{unit}")


@pytest.mark.parametrize(
    ("unit_lines", "seen"),
    [
        pytest.param(
            (),
            "systemd gone from the system bus: ",
            id="the system bus stops beside specd (as shipped)",
        ),
        # Ordered after dbus.service, specd still reaches systemd while it stops: systemd
        # itself says the system is stopping.
        pytest.param(
            ("[Unit]", "After=dbus.service"),
            "`systemctl is-system-running`: stopping",
            id="the system bus kept until specd stopped",
        ),
    ],
)
def test_a_reboot_mid_restart_boots_sglang_on_the_old_setting_and_verifies_it(
    box: Container, tmp_path: Path, unit_lines: tuple[str, ...], seen: str
) -> None:
    sd = box
    start_twin(sd, steps=4)
    enable_at_boot(sd, SGLANG_UNIT, SPECD_UNIT)
    config = closed_window_config(sd, startup_timeout_s=STARTUP_TIMEOUT_S)
    start_specd(sd, config, overrides=unit_lines)
    # SGLang's next start (specd's restart to 3) loads for long and fails.
    sd.install_twin_sglang(
        load_time_s=SLOW_FAILING_LOAD_S, extra_args=["--fail-start-at-steps", "3"]
    )
    old_pid = sd.main_pid(SGLANG_UNIT)
    pin_now(sd, 3)

    def loading() -> bool:
        journal = state(sd).get("journal") if (sd.state_dir / "state.json").exists() else None
        return (
            bool(journal)
            and journal.get("phase") == "restart_issued"
            and (sd.main_pid(SGLANG_UNIT) not in (0, old_pid))
        )

    wait_or_dump(sd, loading, timeout=30, what="specd waiting on the restarted twin")
    assert env_steps(sd) == 3
    # The boot after: SGLang loads at once (the unit as it will be read at boot), and the
    # pin is lifted, so what specd does then is the journal's replay alone.
    sd.install_twin_sglang(load_time_s=0.5)
    (sd.config_dir / "override.toml").unlink()
    # (No journalctl -f into the container: a process entered from outside keeps its
    # systemd-shutdown waiting; what specd did is read from state.json, and its journal
    # goes with the container.)
    started = time.monotonic()
    sd.sh("systemctl", "poweroff", "--no-block")
    assert sd.nspawn is not None
    try:
        # Long enough to see the end of a shutdown that waits out startup_timeout_s.
        sd.nspawn.wait(timeout=STARTUP_TIMEOUT_S + 30)
        took: float | None = time.monotonic() - started
    except subprocess.TimeoutExpired:
        took = None
    sd.halt()
    saved = state(sd)
    journal = saved["journal"] or {}
    assert took is not None, ("the container never ended", saved)
    assert took < SHUTDOWN_S, (took, saved["journal"], saved["restarts"])
    # Left with the env file on 4, nothing frozen, the journal for the next start.
    assert env_steps(sd) == 4
    assert (saved["frozen"], saved["restarts"]) == (None, [])
    assert (journal["phase"], journal["no_verdict"]) == ("restart_issued", True)
    assert journal["shutdown"].startswith("the system is shutting down ("), journal
    assert seen in journal["shutdown"], journal
    assert journal["messages"][-1].endswith(
        "/var/lib/specd/sglang.env back on 4 steps, which sglang.service starts on at boot; "
        "specd's next start verifies it"
    ), journal["messages"]

    # The reboot: SGLang boots on 4, specd finishes the journal by verifying it.
    sd.boot()
    restarts = wait_or_dump(
        sd, lambda: state(sd)["restarts"], timeout=60, what="the replay's outcome after boot"
    )
    assert [(r["from_steps"], r["to_steps"], r["result"], r["restarts"]) for r in restarts] == [
        (4, 3, "aborted", 1)
    ]
    assert "since then, verified 4 steps" in restarts[0]["message"], restarts
    after = state(sd)
    assert (after["journal"], after["frozen"]) == (None, None)
    assert twin_live_steps(sd) == (4, 4.0)
    assert env_steps(sd) == 4
    assert sd.active_state(SPECD_UNIT) == "active"
    assert sd.show(SPECD_UNIT, "NRestarts") == "0"
    # Started once, at boot: specd restarted nothing.
    assert sd.show(SGLANG_UNIT, "NRestarts") == "0"
