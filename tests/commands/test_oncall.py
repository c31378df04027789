"""The on-call commands against a real `specd run` on the twin, read as the on-call reads
them at 3 a.m.: `specd status`, `specd override`, `specd unfreeze`, the daemon's decisions.

Real parts throughout: the twin "unit" behind the stand-in systemctl of tests/test_faults.py,
`specd run` and every command as subprocesses, real files and signals.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from test_faults import (
    UNIT,
    config_text,
    daemon_env,
    events_named,
    healthy,
    make_standin,
    start_specd,
    wait_for,
)

from specd.daemon import UNFREEZE_REQUEST
from specd.twin.process import free_port
from specd.twin.standin import FAST_TWIN, StandIn

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ZONE = "Europe/Berlin"
# The twin at this step count never gets healthy: a restart into it fails and rolls back.
NEVER_HEALTHY = 6


@dataclass
class Oncall:
    """A twin unit at 3 steps, a `specd run` deciding for it, and its files."""

    tmp_path: Path
    standin: StandIn
    config: Path
    log: Path
    metrics_port: int
    proc: subprocess.Popen[bytes] | None = None

    @property
    def override(self) -> Path:
        return self.tmp_path / "override.toml"

    @property
    def state_dir(self) -> Path:
        return self.tmp_path / "state"

    def env(self) -> dict[str, str]:
        return daemon_env(self.standin)

    def start(self) -> None:
        self.proc = start_specd(self.config, self.env(), self.log)
        wait_for(lambda: self.status_json()["last_decision"] != {}, 20, "the first decision")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        assert proc.returncode == 0, self.log.read_text()

    def specd(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "specd.cli", *args, "--config", str(self.config)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env=self.env(),
            cwd=REPO,
        )

    def status_json(self) -> dict[str, Any]:
        done = self.specd("status", "--json")
        try:
            return json.loads(done.stdout)  # type: ignore[no-any-return]
        except ValueError:
            raise AssertionError(done.stdout + done.stderr) from None

    def wait_decision(self, predicate: Callable[[dict[str, Any]], bool], what: str) -> None:
        wait_for(lambda: predicate(self.status_json()["last_decision"]), 60, what)


def closed_window(opens_in_h: int = 6) -> dict[str, Any]:
    """A daily one-hour window in Berlin that is closed now."""
    hour = (datetime.now(ZoneInfo(ZONE)).hour + opens_in_h) % 24
    return {"cron": f"0 {hour} * * *", "duration_s": 3600, "timezone": ZONE}


@pytest.fixture
def oncall(tmp_path: Path) -> Iterator[Oncall]:
    port, metrics_port = free_port(), free_port()
    standin = make_standin(
        tmp_path, port, FAST_TWIN, extra_by_steps={NEVER_HEALTHY: ("--load-time-s", "1000")}
    )
    (tmp_path / "state").mkdir()
    config = tmp_path / "specd.toml"
    config.write_text(
        config_text(
            tmp_path,
            port,
            metrics_port,
            startup_timeout_s=3,
            windows=[closed_window()],
        )
    )
    assert standin.systemctl("--no-ask-password", "restart", UNIT).returncode == 0
    world = Oncall(tmp_path, standin, config, tmp_path / "specd.log", metrics_port)
    try:
        wait_for(lambda: healthy(standin.url()), 20, "the twin unit")
        yield world
    finally:
        try:
            world.stop()
        finally:
            standin.stop()  # the twin even when specd did not stop cleanly


def line(text: str, name: str) -> str:
    return next(x for x in text.splitlines() if x.startswith(name + " "))


def test_the_last_decision_and_the_window_line_name_the_same_opening(oncall: Oncall) -> None:
    """status's last decision said `next opens 2026-12-07T02:00Z` right above its window
    line's `next opens 2026-12-07T03:00:00+01:00`: one opening, two times to a tired eye."""
    oncall.start()
    pin = oncall.specd("override", "pin", "4", "--for", "1d", "--reason", "batch eval tonight")
    assert pin.returncode == 0, pin.stderr
    oncall.wait_decision(lambda d: d.get("reason") == "window_closed", "the pin to wait")
    text = oncall.specd("status").stdout
    said = re.findall(r"next opens ([^\s)]+)", line(text, "last decision"))
    shown = re.findall(r"next opens (\S+) \(in ", line(text, "window"))
    assert said == shown, text
    assert shown[0].endswith(("+01:00", "+02:00")), text
    # The daemon's own log line says it the same way.
    (logged,) = {e["message"] for e in events_named(oncall.log, "decision")} & {
        oncall.status_json()["last_decision"]["message"]
    }
    assert f"next opens {shown[0]})" in logged


@pytest.mark.parametrize(
    ("in_force", "holds"),
    [
        (["freeze", "--for", "2h"], "frozen"),
        (["pin", "4", "--for", "1d"], "window_closed"),
    ],
    ids=["freeze", "pin"],
)
@pytest.mark.parametrize(
    "broken",
    ['mode = "frez"\n', 'mode = "pin"\nsteps = 4\nexpires_at = 2099-01-01T00:00:00\n'],
    ids=["typo", "no-offset"],
)
def test_status_never_says_auto_while_specd_holds_the_last_good_override(
    oncall: Oncall, in_force: list[str], holds: str, broken: str
) -> None:
    """A freeze in force, then a hand edit that breaks the file: specd keeps the freeze
    (its last good state), and `specd status` said `mode auto`, in text and JSON."""
    oncall.start()
    done = oncall.specd("override", *in_force, "--reason", "investigating latency")
    assert done.returncode == 0, done.stderr
    oncall.wait_decision(lambda d: d.get("reason") == holds, "the override in force")
    oncall.override.write_text(broken)
    wait_for(lambda: events_named(oncall.log, "override_ignored"), 20, "specd to ignore it")
    time.sleep(1.0)  # a few ticks: specd still decides under the last good override
    assert oncall.status_json()["last_decision"]["reason"] == holds
    status = oncall.specd("status")
    mode = line(status.stdout, "mode")
    assert "auto" not in mode, status.stdout
    assert "unknown" in mode
    assert "last decision" in mode  # where to look instead
    assert oncall.status_json()["mode"] is None


def test_unfreeze_after_a_failed_pin_now_does_not_retry_it_unasked(oncall: Oncall) -> None:
    """`pin 6 --now` fails and freezes specd. `specd unfreeze` wrote its request, then said
    "if that is what failed, clear the override first": by then the daemon had unfrozen and
    was restarting SGLang into 6 again, outside any window."""
    oncall.start()
    pin = oncall.specd(
        "override", "pin", str(NEVER_HEALTHY), "--for", "1h", "--now", "--reason", "try"
    )
    assert pin.returncode == 0, pin.stderr
    wait_for(lambda: oncall.status_json()["frozen"], 60, "the failed restart to freeze specd")
    restarts = list(oncall.standin.restarts)
    assert restarts[-2:] == [NEVER_HEALTHY, 3]  # tried, rolled back

    refused = oncall.specd("unfreeze", "--reason", "looked at it")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "nothing written" in refused.stderr
    assert "specd override clear" in refused.stderr
    assert "--retry-pin" in refused.stderr
    assert f"{NEVER_HEALTHY} steps" in refused.stderr
    assert not (oncall.state_dir / UNFREEZE_REQUEST).exists()
    time.sleep(2.0)  # ticks: still frozen, nothing restarted
    assert oncall.status_json()["frozen"]
    assert oncall.standin.restarts == restarts

    assert oncall.specd("override", "clear", "--reason", "6 does not fit").returncode == 0
    done = oncall.specd("unfreeze", "--reason", "pin cleared")
    assert done.returncode == 0, done.stderr
    # What it cleared (since when, and why), and what happens next.
    frozen_line, *rest = done.stdout.splitlines()
    assert re.match(
        r"frozen since \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00 \(\d+ s ago\): restart to 6",
        frozen_line,
    ), done.stdout
    assert any(x.startswith("then: specd decides by itself") for x in rest), done.stdout
    wait_for(lambda: not oncall.status_json()["frozen"], 20, "the daemon to clear the freeze")
    time.sleep(1.0)
    assert oncall.standin.restarts == restarts


def test_status_says_whether_specd_runs(oncall: Oncall) -> None:
    """With specd stopped, status showed what it saved last as if it were deciding still:
    `mode pin`, the last decision, `frozen no`; only the ages hinted that nothing ran."""
    never = oncall.specd("status")
    assert line(never.stdout, "specd").startswith("specd          NOT RUNNING"), never.stdout
    oncall.start()
    assert oncall.proc is not None
    running = oncall.specd("status")
    assert line(running.stdout, "specd") == f"specd          running (pid {oncall.proc.pid})"
    assert oncall.status_json()["daemon"] == {"running": True, "pid": oncall.proc.pid}
    pin = oncall.specd("override", "pin", "4", "--for", "1d", "--reason", "batch eval")
    assert "not running" not in pin.stdout + pin.stderr
    oncall.stop()
    stopped = oncall.specd("status")
    assert stopped.returncode == 0
    said = line(stopped.stdout, "specd")
    assert said.startswith("specd          NOT RUNNING: nothing decides or restarts"), said
    assert "systemctl start specd" in said
    assert oncall.status_json()["daemon"] == {"running": False, "pid": None}
    # Written while it is down, the override says it waits for specd.
    freeze = oncall.specd("override", "freeze", "--for", "2h", "--reason", "while it is down")
    assert freeze.returncode == 0, freeze.stderr
    assert "specd is not running: nothing reads this file until it starts" in freeze.stdout


def test_unfreeze_while_specd_is_down_says_when_the_freeze_clears(oncall: Oncall) -> None:
    oncall.start()
    pin = oncall.specd(
        "override", "pin", str(NEVER_HEALTHY), "--for", "1h", "--now", "--reason", "t"
    )
    assert pin.returncode == 0, pin.stderr
    wait_for(lambda: oncall.status_json()["frozen"], 60, "the failed restart to freeze specd")
    assert oncall.specd("override", "clear").returncode == 0
    oncall.stop()
    done = oncall.specd("unfreeze", "--reason", "pin cleared")
    assert done.returncode == 0, done.stderr
    assert "within one tick" not in done.stdout
    assert "specd is not running: it clears the freeze when it starts" in done.stdout
    oncall.start()
    wait_for(lambda: not oncall.status_json()["frozen"], 20, "the start to clear the freeze")


@pytest.mark.parametrize("setting", ["off", "adaptive:3,4"])
def test_override_show_and_the_daemon_agree_on_a_pin_the_unit_cannot_run(
    oncall: Oncall, setting: str
) -> None:
    """Written by hand (the command refuses it), a pin the unit cannot be given: specd holds
    it `unsupported`; show said specd would run it once it had checked."""
    oncall.start()
    oncall.override.write_text(
        f'mode = "pin"\nsetting = "{setting}"\nexpires_at = 2099-01-01T00:00:00Z\n'
        'reason = "by hand"\napply = "now"\n'
    )
    oncall.override.chmod(0o644)
    oncall.wait_decision(lambda d: d.get("reason") == "unsupported", "specd to refuse it")
    show = oncall.specd("override", "show")
    assert show.returncode == 0, show.stderr
    assert "BUT this server cannot run it: " in show.stdout
    assert "static step counts only" in show.stdout
    assert oncall.standin.restarts == [3]  # only the test's own start
