"""specd check-config's warnings for a window no restart fits in: what the config alone can
tell (restart_cost_s, systemd's default stop timeout), with an injected clock; for a key its
environment overrides; and what it says with no file named and none at the default path."""

from __future__ import annotations

import os
from datetime import datetime, timezone
from pathlib import Path

import pytest
from factories import run_specd, without_specd_env

from specd import cli
from specd.commands import check_config
from specd.commands.check_config import window_warnings
from specd.io import config as config_module
from specd.io.config import load_config

# 2026-12-02 11:00 UTC, a Wednesday.
NOW = datetime(2026, 12, 2, 11, tzinfo=timezone.utc)
CERTAIN = "shorter than restart_cost_s alone"


def config_text(windows: list[tuple[str, float]], extra: str = "") -> str:
    return extra + "".join(
        f'[[windows]]\ncron = "{cron}"\nduration_s = {duration_s}\ntimezone = "Europe/Berlin"\n'
        for cron, duration_s in windows
    )


@pytest.mark.parametrize(
    ("windows", "extra", "said"),
    [
        # Shorter than the start alone: never, whatever the unit's stop timeout.
        (
            [("0 3 * * *", 60.0)],
            "",
            [
                "windows[0].duration_s: warning: '0 3 * * *' (60 s) shorter than restart_cost_s "
                "alone, 100 s: specd never restarts there (one restart needs sglang.service's "
                "TimeoutStopSec= + restart_cost_s, 190 s with systemd's default stop timeout 90 s; "
                "`specd doctor` reads the unit's)"
            ],
        ),
        # Long enough only if the unit stops faster than systemd's default.
        (
            [("0 3 * * *", 150.0)],
            "",
            [
                "windows[0].duration_s: warning: '0 3 * * *' (150 s) shorter than one restart "
                "needs, 190 s (systemd's default stop timeout 90 s + restart_cost_s 100 s): specd "
                "never restarts there unless sglang.service's TimeoutStopSec= is at most 50 s "
                "(`specd doctor` reads it)"
            ],
        ),
        ([("0 3 * * *", 190.0)], "", []),
        ([("0 3 * * *", 95.0)], "[choose]\nrestart_cost_s = 5.0\n", []),
        # A stop is waited for restart_command_timeout_s at most.
        (
            [("0 3 * * *", 120.0)],
            "[restart]\nrestart_command_timeout_s = 20.0\n",
            [],
        ),
        (
            [("0 3 * * *", 120.0)],
            "[restart]\nrestart_command_timeout_s = 60.0\n",
            [
                "windows[0].duration_s: warning: '0 3 * * *' (120 s) shorter than one restart "
                "needs, 160 s (restart_command_timeout_s 60 s, the longest a stop is waited for "
                "+ restart_cost_s 100 s): specd never restarts there unless sglang.service's "
                "TimeoutStopSec= is at most 20 s (`specd doctor` reads it)"
            ],
        ),
        # One open period with the windows it touches: back to back minutes, or a minute
        # running into an hour; each short window on its own is named by its index.
        ([("* * * * *", 60.0)], "", []),
        ([("0 1 * * *", 60.0), ("1 1 * * *", 3600.0)], "", []),
        (
            [("0 3 * * *", 3600.0), ("0 5 * * *", 30.0), ("0 5 * * *", 30.0)],
            "",
            [f"windows[1].duration_s: warning: '0 5 * * *' (30 s) {CERTAIN}", "windows[2]"],
        ),
    ],
)
def test_a_window_no_restart_fits_in_is_warned_of(
    tmp_path: Path, windows: list[tuple[str, float]], extra: str, said: list[str]
) -> None:
    path = tmp_path / "specd.toml"
    path.write_text(config_text(windows, extra))
    lines = window_warnings(load_config(path), NOW)
    assert len(lines) == len(said), lines
    for line, expected in zip(lines, said, strict=True):
        assert line.startswith(expected), line


def test_check_config_warns_and_still_exits_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Valid (the daemon runs with it), so exit 0; but an operator hears before deploying
    # that specd would never change anything there.
    path = tmp_path / "specd.toml"
    path.write_text(config_text([("0 3 * * *", 60.0)]))
    assert cli.main(["check-config", str(path)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(
        f"{path}: windows[0].duration_s: warning: '0 3 * * *' (60 s) {CERTAIN}"
    )
    assert err[-1] == f"{path}: OK"
    path.write_text(config_text([("0 3 * * *", 3600.0)]))
    assert cli.main(["check-config", str(path), "--json"]) == 0
    assert capsys.readouterr().err.splitlines() == [f"{path}: OK"]


OVERRIDDEN = "an edit to it in the file does nothing while the variable is set"


def test_check_config_warns_of_each_key_its_environment_overrides(tmp_path: Path) -> None:
    """The environment wins over the file: an edit to such a key did nothing, and nothing
    said so. A real process, as an operator runs it, with variables of its own."""
    path = tmp_path / "specd.toml"
    path.write_text(
        "[choose]\nmax_steps = 6\n[restart]\nmin_dwell_s = 10.0\ndaily_restart_budget = 3\n"
        + config_text([("0 3 * * *", 3600.0)])
    )
    env = without_specd_env() | {
        "SPECD_CHOOSE__MAX_STEPS": "4",
        "SPECD_RESTART": '{"min_dwell_s": 60}',
        "SPECD_WINDOWS": '[{"cron": "0 4 * * sat", "duration_s": 3600}]',
        "SPECD_OBSERVE__SCRAPE_INTERVAL_S": "7",  # not in the file: overrides nothing
    }
    proc = run_specd("check-config", str(path), env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == [
        f"{path}: choose.max_steps: warning: overridden by the environment variable "
        f"SPECD_CHOOSE__MAX_STEPS: {OVERRIDDEN}",
        f"{path}: restart.min_dwell_s: warning: overridden by the environment variable "
        f"SPECD_RESTART: {OVERRIDDEN}",
        f"{path}: windows: warning: overridden by the environment variable SPECD_WINDOWS: "
        f"{OVERRIDDEN}",
        f"{path}: OK",
    ]
    # Without the variables: the same file, no warning.
    proc = run_specd("check-config", str(path), env=without_specd_env())
    assert (proc.returncode, proc.stderr.splitlines()) == (0, [f"{path}: OK"])


@pytest.mark.parametrize("extra", [[], ["--json"]], ids=["toml", "json"])
def test_check_config_with_no_file_named_and_none_at_the_default_path_fails(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
) -> None:
    """It said OK (on built-in defaults), while specd.service, which names that file, does
    not start without it."""
    absent = tmp_path / "specd.toml"
    monkeypatch.setattr(config_module, "DEFAULT_CONFIG_PATH", absent)
    monkeypatch.setattr(check_config, "DEFAULT_CONFIG_PATH", absent)
    for name in [n for n in os.environ if n.upper().startswith("SPECD_")]:
        monkeypatch.delenv(name)
    assert cli.main(["check-config", *extra]) == 2
    out, err = capsys.readouterr()
    assert (out, err.splitlines()) == (
        "",
        [
            f"{absent}: no such file: specd.service runs `specd run --config {absent}`, which "
            "does not start without it (`specd install` writes it; a file of comments only "
            "keeps every default); check another file with `specd check-config FILE`"
        ],
    )
    # A file named on the command line: as before, it must exist.
    assert cli.main(["check-config", str(absent), *extra]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"{absent}: cannot read: No such file or directory"
    ]
    absent.write_text("# every default\n")
    assert cli.main(["check-config", *extra]) == 0
    assert capsys.readouterr().err.splitlines() == [f"{absent}: OK"]


@pytest.mark.skipif(
    Path("/etc/specd/specd.toml").exists(), reason="this host has /etc/specd/specd.toml"
)
def test_check_config_with_no_file_is_not_ok_as_a_real_process() -> None:
    proc = run_specd("check-config", env=without_specd_env())
    assert proc.returncode == 2
    assert proc.stderr.startswith("/etc/specd/specd.toml: no such file: specd.service runs ")
    assert proc.stdout == ""
