"""The on-call's commands while the calibration table is broken (moved away, half written,
unreadable): the running daemon keeps its last good table, so a freeze, a pin, an unfreeze
and a look at status must work; they exited 2 on the table alone. check-config and a start
of specd still refuse it, and doctor fails its config check for it while the others run."""

from __future__ import annotations

from pathlib import Path

import pytest
from in_process import specd_main

from specd.twin.process import free_port

CALIBRATION = "steps,concurrency,output_tok_s\n3,1,230\n4,1,280\n"
BROKEN = {
    "missing": None,
    "no-rows-header-only": "steps,concurrency\n",
    "not-a-table": "\x00\x01garbage\n",
}


def _config(tmp_path: Path, table: str | None) -> Path:
    calibration = tmp_path / "cal.csv"
    if table is not None:
        calibration.write_text(table)
    (tmp_path / "state").mkdir()
    config = tmp_path / "specd.toml"
    config.write_text(
        f'[sglang]\nurl = "http://127.0.0.1:{free_port()}"\n'
        f'env_file = "{tmp_path}/sglang.env"\n'
        f'[files]\nstate_dir = "{tmp_path}/state"\noverride_file = "{tmp_path}/override.toml"\n'
        f'[choose]\ncalibration_file = "{calibration}"\n'
    )
    return config


@pytest.mark.parametrize("table", BROKEN.values(), ids=BROKEN.keys())
def test_the_oncall_commands_work_while_the_calibration_is_broken(
    tmp_path: Path, table: str | None
) -> None:
    config = str(_config(tmp_path, table))
    frozen = specd_main(
        "override", "freeze", "--for", "2h", "--reason", "incident 7", "--config", config
    )
    assert frozen.returncode == 0, frozen.stderr
    assert 'mode = "freeze"' in (tmp_path / "override.toml").read_text()
    shown = specd_main("override", "show", "--config", config)
    assert shown.returncode == 0, shown.stderr
    cleared = specd_main("override", "clear", "--config", config)
    assert cleared.returncode == 0, cleared.stderr
    status = specd_main("status", "--config", config)
    assert "config" not in status.stderr, status.stderr
    assert "calibration    UNUSABLE: choose.calibration_file: " in status.stdout, status.stdout
    assert "a running specd keeps the last good table it read" in status.stdout
    # What it may choose is not what no table offers (off and every set, rows unchecked):
    # the running daemon offers from its last good table.
    (choices,) = [line for line in status.stdout.splitlines() if line.startswith("choices ")]
    assert choices.startswith("choices        unknown while the calibration cannot be read ")
    assert "offered" not in status.stdout, status.stdout
    unfreeze = specd_main("unfreeze", "--reason", "fixed", "--config", config)
    assert "calibration" not in unfreeze.stderr, unfreeze.stderr
    assert unfreeze.returncode != 2, unfreeze.stderr
    # A start of specd refuses it, and so does check-config, one line.
    check = specd_main("check-config", config)
    assert check.returncode == 2
    assert "choose.calibration_file: " in check.stderr


def test_doctor_fails_the_config_check_for_the_table_and_runs_the_others(
    tmp_path: Path,
) -> None:
    config = str(_config(tmp_path, None))
    done = specd_main("doctor", "--config", config)
    assert done.returncode == 1
    lines = {line.split()[1]: line for line in done.stdout.splitlines() if line[:1] in "✓✗-"}
    assert lines["config"].startswith("✗ config "), done.stdout
    assert "choose.calibration_file: " in lines["config"]
    assert "skipped" not in lines["sglang"], done.stdout
    assert "a running specd keeps the last good table it read" in done.stdout
    mark, _, said = lines["choices"].split(None, 2)
    assert (mark, said[:44]) == ("✗", "unknown while the calibration cannot be read"), said


def test_a_good_table_is_no_line_in_status(tmp_path: Path) -> None:
    config = str(_config(tmp_path, CALIBRATION))
    status = specd_main("status", "--config", config)
    assert "calibration    " not in status.stdout, status.stdout
