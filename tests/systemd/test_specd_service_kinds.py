"""specd.service under a real systemd: every kind of setting (static, adaptive, off), each
verified or rolled back. Split from test_specd_service.py, whose helpers it uses, so the
slow systemd tests spread over the xdist workers (each worker boots its own container, see
conftest.py).
"""

from __future__ import annotations

from typing import Any

import pytest
from nspawn import (
    SGLANG_UNIT,
    TWIN_URL,
    VENV_SPECD,
    Container,
)
from test_specd_service import (
    CONFIG_PATH,
    SPECD_URL,
    clear_override,
    closed_window_config,
    pin_now,
    samples,
    start_specd,
    start_twin,
    state,
    status_text,
    wait_or_dump,
)

pytestmark = [pytest.mark.systemd, pytest.mark.slow]


# -- 4b. every kind of setting: static, adaptive, off, each verified or rolled back ---------

FAIL_DROPIN = f"{SGLANG_UNIT}.d/70-fail.conf"
SHOWN = "EAGLE"  # SGLang runs NEXTN as EAGLE and says so in /server_info


def fail_settings(sd: Container, *settings: str) -> None:
    """Tell the twin to fail to start with these settings (none: start with any)."""
    path = sd.units_dir / FAIL_DROPIN
    if settings:
        path.parent.mkdir(parents=True, exist_ok=True)
        listed = " ".join(settings)  # the twin's list is whitespace-separated
        path.write_text(f'[Service]\nEnvironment="SPECD_TWIN_FAIL_SETTINGS={listed}"\n')
    else:
        path.unlink(missing_ok=True)
    sd.daemon_reload()  # the test's: specd never reloads systemd


def twin_setting(sd: Container) -> tuple[str | None, bool, int | None, float | None]:
    """(algorithm, adaptive on, /server_info steps, sglang:spec_num_steps) of the twin."""
    info = sd.twin_server_info()
    gauges = [v for k, v in samples(sd, TWIN_URL).items() if k.startswith("sglang:spec_num_steps")]
    return (
        info.get("speculative_algorithm"),
        info.get("speculative_adaptive") is True,
        info.get("speculative_num_steps"),
        gauges[0] if gauges else None,
    )


def env_args(sd: Container) -> str:
    for line in (sd.state_dir / "sglang.env").read_text().splitlines():
        key, _, value = line.partition("=")
        if key == "SPECD_SPECULATIVE_ARGS":
            return value
    raise AssertionError("SPECD_SPECULATIVE_ARGS missing from sglang.env")


def test_static_to_adaptive_to_off_and_back_each_verified_or_rolled_back(sd: Container) -> None:
    """Issue 15's "Done when": static 4 → adaptive {3,4} → off → 4 under the real systemd,
    each verified; each rolled back (and frozen) when the twin is told to fail it."""
    start_twin(sd, steps=4)
    start_specd(sd, closed_window_config(sd, speculative_algorithm="NEXTN"))
    wait_or_dump(sd, lambda: status_text(sd).startswith("steps 4"), timeout=15)
    outcomes: list[tuple[str | None, str | None, str]] = []

    def change(setting: str, result: str) -> dict[str, Any]:
        count = len(state(sd)["restarts"])
        pin_now(sd, setting)
        restarts = wait_or_dump(
            sd,
            lambda: (r := state(sd)["restarts"])[count:] and r,
            timeout=60,
            what=f"the restart to {setting}",
        )
        done = restarts[-1]
        outcomes.append((done["from_setting"], done["to_setting"], done["result"]))
        # SGLang's journal says why a start failed or passed when the test expected not.
        assert (done["to_setting"], done["result"]) == (setting, result), (
            f"{done}\n--- sglang ---\n{sd.journal(SGLANG_UNIT, lines=40)}"
        )
        sd.wait_http("/health", timeout=30)
        if result != "success":
            assert state(sd)["frozen"] is not None
            # The pin would be tried again once unfrozen: back to auto (the window is closed).
            clear_override(sd)
            sd.sh(str(VENV_SPECD), "unfreeze", "--config", CONFIG_PATH, "--reason", "test")
            wait_or_dump(sd, lambda: state(sd).get("frozen") is None, what="unfrozen")
        return done

    # Told to fail adaptive {3,4} and off: each attempt is rolled back to static 4.
    fail_settings(sd, "adaptive:3,4", "off")
    change("adaptive:3,4", "rolled_back")
    assert twin_setting(sd) == (SHOWN, False, 4, 4.0)
    change("off", "rolled_back")
    assert twin_setting(sd) == (SHOWN, False, 4, 4.0)
    assert "--speculative-num-steps 4" in env_args(sd)  # the env file is restored too

    fail_settings(sd)
    change("adaptive:3,4", "success")
    algorithm, adaptive, _, live = twin_setting(sd)
    assert (algorithm, adaptive) == (SHOWN, True)
    assert live in (3.0, 4.0)  # the live tier is one of the candidates
    config_path = sd.twin_server_info().get("speculative_adaptive_config")
    assert config_path is not None
    assert config_path.startswith("/var/lib/specd/")
    assert f"--speculative-adaptive-config {config_path}" in env_args(sd)
    wait_or_dump(sd, lambda: status_text(sd).startswith("adaptive"), timeout=10)
    assert samples(sd, SPECD_URL)["specd_setting_kind{kind=adaptive}"] == 1

    # From adaptive, off fails once (rolled back to the same adaptive config), then runs.
    fail_settings(sd, "off")
    change("off", "rolled_back")
    assert twin_setting(sd)[:2] == (SHOWN, True)
    assert sd.twin_server_info().get("speculative_adaptive_config") == config_path
    fail_settings(sd)
    change("off", "success")
    assert twin_setting(sd)[:2] == (None, False)
    assert env_args(sd) == ""
    wait_or_dump(sd, lambda: status_text(sd).startswith("steps 0"), timeout=10)

    # And back: 4 fails once from off, then runs.
    fail_settings(sd, "4")
    change("4", "rolled_back")
    assert twin_setting(sd)[:2] == (None, False)
    fail_settings(sd)
    change("4", "success")
    assert twin_setting(sd) == (SHOWN, False, 4, 4.0)
    assert outcomes == [
        ("4", "adaptive:3,4", "rolled_back"),
        ("4", "off", "rolled_back"),
        ("4", "adaptive:3,4", "success"),
        (None, "off", "rolled_back"),  # under adaptive the live candidates are unknown
        (None, "off", "success"),
        ("off", "4", "rolled_back"),
        ("off", "4", "success"),
    ]
    metrics = samples(sd, SPECD_URL)
    assert metrics["specd_restarts_total{result=rolled_back}"] == 4
    assert metrics["specd_restarts_total{result=success}"] == 3
    assert metrics["specd_setting_changes_total{from_kind=static,to_kind=adaptive}"] == 1
    assert metrics["specd_setting_changes_total{from_kind=off,to_kind=static}"] == 1
