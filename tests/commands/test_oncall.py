"""The on-call commands against a real `specd run` on the twin, read as the on-call reads
them at 3 a.m.: `specd status`, `specd override`, `specd unfreeze`, the daemon's decisions.

Real parts throughout: the twin "unit" behind the stand-in systemctl of tests/test_faults.py
(one for the module, put back to 3 steps and healthy before each test), a `specd run`
subprocess per test, real files and signals. The commands run through specd.cli.main in
the test's interpreter (tests/commands/in_process.py), a few as real processes; the tests
wait on the state file the daemon writes and on its tick count, not on sleeps.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from factories import run_specd
from in_process import specd_main
from test_faults import (
    UNIT,
    config_text,
    daemon_env,
    events_named,
    healthy,
    make_standin,
    metric,
    start_specd,
    wait_for,
)

from specd.io.state import STATE_FILE, STATUS_FILE, UNFREEZE_REQUEST, read_status
from specd.twin.process import free_port
from specd.twin.standin import FAST_TWIN, StandIn

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ZONE = "Europe/Berlin"
# The twin at this step count never gets healthy: a restart into it fails and rolls back.
NEVER_HEALTHY = 6
# A tick every quarter second: "a few ticks" (the unfreeze request read, the override
# re-read, nothing restarted meanwhile) cost that much wall time, not seconds.
SCRAPE_INTERVAL_S = 0.25
TICKS = "specd_tick_duration_seconds_count"


@dataclass
class Oncall:
    """The twin unit at 3 steps, a `specd run` deciding for it, and its files."""

    tmp_path: Path
    standin: StandIn
    config: Path
    log: Path
    metrics_port: int
    restarts_before: int
    proc: subprocess.Popen[bytes] | None = None

    @property
    def override(self) -> Path:
        return self.tmp_path / "override.toml"

    @property
    def state_dir(self) -> Path:
        return self.tmp_path / "state"

    @property
    def restarts(self) -> list[int]:
        """The unit's restarts since this test began (the shared unit's earlier ones not)."""
        return self.standin.restarts[self.restarts_before :]

    def env(self) -> dict[str, str]:
        return daemon_env(self.standin)

    def start(self) -> None:
        self.proc = start_specd(self.config, self.env(), self.log)
        wait_for(lambda: self.saved().get("last_decision"), 20, "the first decision")

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

    def specd(self, *args: str, process: bool = False) -> subprocess.CompletedProcess[str]:
        """`specd ARGS --config CONFIG` with the daemon's environment: in-process, or as a
        real process with ``process``."""
        argv = [*args, "--config", str(self.config)]
        if not process:
            return specd_main(*argv, env=self.env())
        return run_specd(*argv, env=self.env(), cwd=REPO)

    def status_json(self) -> dict[str, Any]:
        done = self.specd("status", "--json")
        try:
            return json.loads(done.stdout)  # type: ignore[no-any-return]
        except ValueError:
            raise AssertionError(done.stdout + done.stderr) from None

    def saved(self) -> dict[str, Any]:
        """The state file as the daemon last saved it (what `specd status` reads); {} before
        the first save. It is replaced whole (a rename), never seen half-written."""
        with contextlib.suppress(FileNotFoundError):
            return json.loads((self.state_dir / STATE_FILE).read_text())  # type: ignore[no-any-return]
        return {}

    def decision(self) -> dict[str, Any]:
        """The last decision as `specd status` reads it: status.json's (written at each
        change of decision) where newer than the state file's (written once a minute)."""
        saved: dict[str, Any] = self.saved().get("last_decision") or {}
        shown: dict[str, Any] = read_status(self.state_dir / STATUS_FILE).get("last_decision") or {}
        return shown if shown.get("t", -1) > saved.get("t", -1) else saved

    def wait_decision(self, predicate: Callable[[dict[str, Any]], bool], what: str) -> None:
        wait_for(lambda: predicate(self.decision()), 60, what)

    def wait_frozen(self, frozen: bool, timeout_s: float, what: str) -> None:
        wait_for(lambda: (self.saved().get("frozen") is not None) is frozen, timeout_s, what)

    def ticks(self, n: int) -> None:
        """Until the daemon has ended ``n`` more ticks."""
        before = metric(self.metrics_port, TICKS)
        assert before is not None, "the daemon serves no metrics"
        wait_for(lambda: (metric(self.metrics_port, TICKS) or 0) >= before + n, 30, f"{n} ticks")


def closed_window(opens_in_h: int = 6) -> dict[str, Any]:
    """A daily one-hour window in Berlin that is closed now."""
    hour = (datetime.now(ZoneInfo(ZONE)).hour + opens_in_h) % 24
    return {"cron": f"0 {hour} * * *", "duration_s": 3600, "timezone": ZONE}


@pytest.fixture(scope="module")
def unit(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandIn]:
    """The twin "unit" the module's tests share: specd restarts it only into 6 (which never
    gets healthy) and back, so each test finds it at 3 steps again (see `oncall`)."""
    standin = make_standin(
        tmp_path_factory.mktemp("unit"),
        free_port(),
        FAST_TWIN,
        extra_by_steps={NEVER_HEALTHY: ("--load-time-s", "1000")},
    )
    try:
        yield standin
    finally:
        standin.stop()


def at_three_steps(standin: StandIn) -> None:
    """The unit as a fresh one starts: no env file (3 steps, the drop-in's default), the
    twin at 3 steps and healthy; restarted into that unless it is so already."""
    standin.env_file.unlink(missing_ok=True)
    if standin.restarts[-1:] != [3] or not healthy(standin.url()):
        assert standin.systemctl("--no-ask-password", "restart", UNIT).returncode == 0
        wait_for(lambda: healthy(standin.url()), 20, "the twin unit")


@pytest.fixture
def oncall(tmp_path: Path, unit: StandIn) -> Iterator[Oncall]:
    at_three_steps(unit)
    metrics_port = free_port()
    (tmp_path / "state").mkdir()
    config = tmp_path / "specd.toml"
    config.write_text(
        config_text(
            tmp_path,
            unit.port,
            metrics_port,
            env_file=str(unit.env_file),
            scrape_interval_s=SCRAPE_INTERVAL_S,
            startup_timeout_s=3,
            windows=[closed_window()],
        )
    )
    world = Oncall(tmp_path, unit, config, tmp_path / "specd.log", metrics_port, len(unit.restarts))
    try:
        yield world
    finally:
        world.stop()


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
    oncall.ticks(2)  # specd still decides under the last good override
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
    oncall.wait_frozen(True, 60, "the failed restart to freeze specd")
    assert oncall.status_json()["frozen"]
    restarts = list(oncall.restarts)
    assert restarts[-2:] == [NEVER_HEALTHY, 3]  # tried, rolled back

    # The refusal as the on-call's shell gets it: exit status 2, the reason on stderr.
    refused = oncall.specd("unfreeze", "--reason", "looked at it", process=True)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "nothing written" in refused.stderr
    assert "specd override clear" in refused.stderr
    assert "--retry-pin" in refused.stderr
    assert f"{NEVER_HEALTHY} steps" in refused.stderr
    assert not (oncall.state_dir / UNFREEZE_REQUEST).exists()
    oncall.ticks(4)  # still frozen, nothing restarted
    assert oncall.status_json()["frozen"]
    assert oncall.restarts == restarts

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
    oncall.wait_frozen(False, 20, "the daemon to clear the freeze")
    assert not oncall.status_json()["frozen"]
    oncall.ticks(2)
    assert oncall.restarts == restarts


def test_status_says_whether_specd_runs(oncall: Oncall) -> None:
    """With specd stopped, status showed what it saved last as if it were deciding still:
    `mode pin`, the last decision, `frozen no`; only the ages hinted that nothing ran."""
    never = oncall.specd("status")
    assert line(never.stdout, "specd").startswith("specd          NOT RUNNING"), never.stdout
    oncall.start()
    assert oncall.proc is not None
    running = oncall.specd("status", process=True)
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
    oncall.wait_frozen(True, 60, "the failed restart to freeze specd")
    assert oncall.specd("override", "clear").returncode == 0
    oncall.stop()
    done = oncall.specd("unfreeze", "--reason", "pin cleared")
    assert done.returncode == 0, done.stderr
    assert "within one tick" not in done.stdout
    assert "specd is not running: it clears the freeze when it starts" in done.stdout
    oncall.start()
    oncall.wait_frozen(False, 20, "the start to clear the freeze")
    assert not oncall.status_json()["frozen"]


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
    assert oncall.restarts == []  # nothing restarted the unit
