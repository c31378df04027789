"""specd check-config's warnings for a window no restart fits in: what the config alone can
tell (restart_cost_s, systemd's default stop timeout), with an injected clock."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import pytest

from specd import cli
from specd.commands.check_config import window_warnings
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
