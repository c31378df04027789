"""`specd doctor` under a real systemd, on what an install leaves: --enable-metrics added by
install but not live until SGLang restarts, and a config naming another unit than the one
specd was installed for."""

from __future__ import annotations

import json
from typing import Any

import pytest
import tomli_w
from nspawn import SGLANG_UNIT, TWIN_URL, VENV_SPECD, Container
from test_install_systemd import deployment_unit, serve_with_no_window
from test_restart_sequence_systemd import rule_without_reset_failed

pytestmark = [pytest.mark.systemd, pytest.mark.slow]


def verdicts(sd: Container) -> tuple[int, dict[str, dict[str, Any]]]:
    doctor = sd.sh(str(VENV_SPECD), "doctor", "--json", check=False, timeout=60)
    return doctor.returncode, {c["name"]: c for c in json.loads(doctor.stdout)["checks"]}


def test_doctor_after_add_enable_metrics_and_for_another_unit(sd: Container) -> None:
    unit = SGLANG_UNIT
    text = deployment_unit().replace(" \\\n    --enable-metrics", "")
    assert "--enable-metrics" not in text
    serve_with_no_window(sd, unit, text)  # nothing here waits for specd
    specd = str(VENV_SPECD)
    try:
        sd.sh(specd, "install", "--unit", unit, "--add-enable-metrics", "--yes", timeout=90)
        # The drop-in has the flag; SGLang, not restarted, still serves no /metrics, and
        # specd (no_data on every tick) will not restart it.
        code, found = verdicts(sd)
        assert code == 1
        assert not found["metrics"]["ok"]
        assert found["metrics"]["advice"] == (
            f"{unit}'s command line has --enable-metrics, SGLang started without it: "
            f"`systemctl restart {unit}` now (specd cannot: it needs /metrics to act)"
        )
        assert not found["command"]["ok"]
        assert found["command"]["advice"].endswith(
            f"`systemctl restart {unit}` now (specd cannot: it needs the /metrics that "
            "--enable-metrics turns on)"
        )
        # The advice, followed, is the fix.
        sd.systemctl("restart", unit)
        sd.wait_http("/health")
        code, found = verdicts(sd)
        assert found["metrics"]["ok"], found["metrics"]
        assert found["command"]["ok"], found["command"]

        # A config that names a unit specd was not installed for: one line says so, rather
        # than a ✗ per check each advising an install that refuses.
        config = sd.config_dir / "specd.toml"
        installed = config.read_text()
        assert f'unit = "{unit}"' in installed
        config.write_text(installed.replace(f'unit = "{unit}"', 'unit = "dbus.service"'))
        code, found = verdicts(sd)
        config.write_text(installed)
        assert code == 1
        assert found["unit"]["detail"] == (
            f"[sglang] unit is dbus.service, but specd was installed for {unit} "
            "(/etc/specd/install-manifest.json)"
        )
        for name in ("drop-in", "command", "setting", "polkit"):
            assert found[name]["skipped"], found[name]
        advising = [n for n, c in found.items() if "install --unit dbus.service" in c["advice"]]
        assert advising == ["unit"]
        refused = sd.sh(specd, "install", "--unit", "dbus.service", "--dry-run", check=False)
        assert refused.returncode != 0
        assert f"specd is installed for {unit}" in refused.stderr
    finally:
        sd.sh(specd, "uninstall", check=False, timeout=90)


def test_doctor_says_a_polkit_rule_that_denies_reset_failed_is_not_enough(sd: Container) -> None:
    """A rollback clears the start limit a failed change used up (`systemctl reset-failed`),
    and a rule from before specd did that denies it: doctor said such a rule was fine."""
    (sd.config_dir / "specd.toml").write_text(
        tomli_w.dumps({"sglang": {"url": TWIN_URL, "unit": SGLANG_UNIT}})
    )
    _, found = verdicts(sd)
    assert found["polkit"]["ok"], found["polkit"]
    assert found["polkit"]["detail"] == (
        f"user specd may restart and reset-failed {SGLANG_UNIT}, nothing else"
    )
    with rule_without_reset_failed(sd):
        code, found = verdicts(sd)
    assert code == 1
    assert not found["polkit"]["ok"]
    assert found["polkit"]["detail"] == f"user specd: reset-failed {SGLANG_UNIT}: denied"
    assert f"`specd install --unit {SGLANG_UNIT}`" in found["polkit"]["advice"]


def test_doctor_fails_a_unit_named_by_an_alias(sd: Container) -> None:
    """systemd asks polkit about a unit by its own name. With [sglang] unit (and the rule)
    naming an alias, pkcheck for the alias said yes, doctor said ✓, and every restart specd
    issued was denied."""
    sd.write_unit(SGLANG_UNIT, "[Service]\nExecStart=/bin/sleep infinity\n")
    alias = sd.units_dir / "sglang-alias.service"
    alias.symlink_to(SGLANG_UNIT)  # relative: the directory is bind-mounted in the container
    try:
        sd.daemon_reload()
        (sd.config_dir / "specd.toml").write_text(
            tomli_w.dumps({"sglang": {"url": TWIN_URL, "unit": alias.name}})
        )
        code, found = verdicts(sd)
        assert code == 1
        assert not found["polkit"]["ok"]
        assert found["polkit"]["detail"] == (
            f"{alias.name} is an alias of {SGLANG_UNIT}: systemd asks polkit about "
            f"{SGLANG_UNIT}, which a rule for {alias.name} does not allow"
        )
        assert found["polkit"]["advice"] == (
            f'set [sglang] unit = "{SGLANG_UNIT}" and run `specd install --unit {SGLANG_UNIT}`'
        )
    finally:
        alias.unlink()
        sd.daemon_reload()
