"""The daemon loop's promises to the on-call (issue 11 items 2, 3, 4): an unknown live
setting is unknown, the state file follows every decision change and restart outcome at
once, it is readable by group specd and by `specd status` exactly as the daemon reads it,
and a restart starts only where the window leaves time for all of it."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import pytest
import tomli_w
from factories import (
    FAST_TWIN_VERSION_ARGS,
    LoopbackHTTP,
    QuietHandler,
    SmgGateway,
    make_observation,
    serve,
    tables,
)
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from specd.commands.status import collect
from specd.core import outcome
from specd.core.decide import Reason
from specd.core.history import History, HistorySettings
from specd.core.observation import Observation, ScrapeError
from specd.core.setting import SpecSetting, adaptive_config_name, format_setting, setting_key
from specd.core.setting import parse as parse_setting
from specd.daemon import (
    DECISION_RELOG_S,
    FLAPPING_OUTAGES,
    SCRAPE_FAILED_RELOG_S,
    STATE_SAVE_INTERVAL_S,
    Daemon,
    InFlight,
)
from specd.io import logs
from specd.io.apply import Applier as RealApplier
from specd.io.apply import ApplyOutcome, setting_steps
from specd.io.config import Config
from specd.io.metrics import Metrics
from specd.io.notify import Notifier
from specd.io.state import (
    STATE_FILE,
    STATUS_FILE,
    State,
    StateStore,
    read_state,
    read_status,
    with_status,
)
from specd.io.timespan import timespan_s
from specd.twin.process import TwinProcess, free_port

UTC = timezone.utc
REPO = Path(__file__).resolve().parents[1]
# Monday 2026-01-05 03:30 UTC: 30 minutes into the default daily 03:00 window.
IN_WINDOW = datetime(2026, 1, 5, 3, 30, tzinfo=UTC).timestamp()
WINDOW_CLOSES = datetime(2026, 1, 5, 4, 0, tzinfo=UTC).timestamp()


class Reader:
    """SGLang as a script: each observe() returns the next result (the last repeats);
    ``server_info``: what its /server_info said (None: not read yet)."""

    def __init__(
        self, results: list[Observation | ScrapeError], server_info: dict[str, Any] | None = None
    ) -> None:
        self.results = results
        self.last_server_info = server_info

    def observe(self) -> Observation | ScrapeError:
        return self.results.pop(0) if len(self.results) > 1 else self.results[0]

    def close(self) -> None:
        pass


class Applier:
    """Records what the daemon asked; the restart succeeds at once."""

    def __init__(self, stop_timeout_s: float = 0.0, static_only: str | None = None) -> None:
        self.calls: list[tuple[str, str | None]] = []
        self._stop_timeout_s = stop_timeout_s
        self._static_only = static_only

    def apply_setting(
        self,
        target: SpecSetting,
        current: SpecSetting | None,
        *,
        window_open: Callable[[], bool],
        force: bool = False,
        cancelled: Callable[[], str | None] | None = None,
    ) -> ApplyOutcome:
        was = format_setting(current) if current is not None else None
        self.calls.append((format_setting(target), was))
        return ApplyOutcome(
            "success",
            setting_steps(current),
            setting_steps(target),
            1.0,
            "verified",
            13,
            1,
            from_setting=was,
            to_setting=format_setting(target),
        )

    def reconcile(self, journal_data: Any) -> ApplyOutcome | None:
        return None

    def stop_timeout_s(self) -> float:
        return self._stop_timeout_s

    def read_stop_timeout(self) -> None:
        pass

    def read_wiring(self) -> str | None:
        return self._static_only

    def readd_left_out(self, drained: list[dict[str, Any]]) -> str | None:
        return None

    def retry_mark_in(self, *, serving: bool = False) -> str | None:
        return None


def _own_files(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    """The tables of `config(tmp_path, **extra)`, also for a config file."""
    defaults: dict[str, Any] = {
        "state_dir": str(tmp_path / "state"),
        "override_file": str(tmp_path / "override.toml"),
        "env_file": str(tmp_path / "sglang.env"),
        "min_history_s": 600,
        "stabilization_window_s": 0,
        "min_dwell_s": 0,
        "warmup_exclude_s": 0,
    }
    return tables(**{**defaults, **extra})


def config(tmp_path: Path, **extra: Any) -> Config:
    (tmp_path / "state").mkdir(exist_ok=True)
    return Config(**_own_files(tmp_path, **extra))


def obs(t: float, steps: int | None = 3, running: int = 1) -> Observation:
    return make_observation(t, steps=steps, running=running, accept_length=2.5)


def daemon(cfg: Config, reader: Reader, applier: Applier, clock: list[float]) -> Daemon:
    d = Daemon(
        cfg,
        registry=CollectorRegistry(),
        clock=lambda: clock[0],
        notifier=Notifier({}),
        reader=reader,
        applier=applier,
    )
    d.state.history = busy(cfg, clock[0], offered=1)  # the bands policy wants 4 steps
    return d


def busy(cfg: Config, end: float, offered: int) -> History:
    history = History(HistorySettings.from_config(cfg))
    for i in range(400):
        history.record(make_observation(end - 5 * (400 - i), running=offered, steps=None))
    return history


def saved(cfg: Config) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((Path(cfg.files.state_dir) / STATE_FILE).read_text())
    return data


def shown(cfg: Config) -> dict[str, Any]:
    """The last decision and what runs as `specd status` reads them: state.json's, and
    status.json's where newer."""
    state = read_state(Path(cfg.files.state_dir) / STATE_FILE)
    with_status(state, read_status(Path(cfg.files.state_dir) / STATUS_FILE))
    return {"last_decision": state.last_decision, "live": state.live}


def test_after_a_failed_scrape_the_live_setting_is_unknown_not_the_last_believed(
    tmp_path: Path,
) -> None:
    cfg = config(tmp_path)
    clock = [IN_WINDOW]
    reader = Reader([obs(IN_WINDOW, steps=4), ScrapeError("timeout", "no answer", IN_WINDOW)])
    applier = Applier()
    d = daemon(cfg, reader, applier, clock)
    d.tick()
    assert d.live_steps == 4
    clock[0] += 5
    d.tick()  # the scrape fails
    assert d.live_steps is None
    value = d.metrics.registry.get_sample_value("specd_steps_current")
    assert value is not None
    assert math.isnan(value)
    assert d._status_text().startswith("steps ?")
    assert shown(cfg)["live"]["steps"] is None
    # An on-call pin with apply = "now" is still obeyed, and the applier is told the
    # truth: the live setting is unknown (it used to hear "4" and abort, saying SGLang
    # already runs 4 steps while it ran 3).
    expires = datetime.fromtimestamp(IN_WINDOW + 3600, tz=UTC)
    override = {"mode": "pin", "steps": 4, "expires_at": expires, "reason": "incident"}
    Path(cfg.files.override_file).write_text(tomli_w.dumps({**override, "apply": "now"}))
    os.chmod(cfg.files.override_file, 0o600)
    clock[0] += 5
    decision = d.tick()
    assert decision.reason is Reason.OVERRIDE_PIN
    assert applier.calls == [("4", None)]


def test_while_scrapes_fail_the_offered_concurrency_is_unknown_not_the_last_seen(
    tmp_path: Path,
) -> None:
    """specd_offered_concurrency_current kept the last scrape's 12 requests through half an
    hour of failed scrapes, beside specd_steps_current NaN: a load no one measured."""
    cfg = config(tmp_path)
    clock = [IN_WINDOW - 7200]  # no window: nothing restarts
    reader = Reader(
        [
            make_observation(clock[0], steps=3, running=9, queued=3),
            ScrapeError("refused", "GET /metrics: cannot connect", clock[0]),
            make_observation(clock[0] + 1800, steps=3, running=2, queued=0),
        ]
    )
    d = daemon(cfg, reader, Applier(), clock)
    sample = d.metrics.registry.get_sample_value
    assert math.isnan(sample("specd_offered_concurrency_current") or 0.0)  # none yet
    d.tick()
    assert sample("specd_offered_concurrency_current") == 12
    clock[0] += 900
    d.tick()  # SGLang does not answer
    assert sample("specd_sglang_up") == 0
    assert math.isnan(sample("specd_offered_concurrency_current") or 0.0)
    clock[0] += 900
    d.tick()
    assert sample("specd_offered_concurrency_current") == 2


def test_the_tick_duration_is_the_decision_not_the_restart_it_made(tmp_path: Path) -> None:
    """specd_tick_duration_seconds ("one observe-record-decide tick", buckets up to 5 s)
    took in the whole restart sequence the tick began: minutes of model load, landing in
    +Inf; the sequence is specd_restart_duration_seconds'."""

    class Slow(Applier):
        def apply_setting(self, *args: Any, **kwargs: Any) -> ApplyOutcome:
            time.sleep(1.0)  # a (very quick) drain, restart and model load
            return super().apply_setting(*args, **kwargs)

    cfg = config(tmp_path)
    applier = Slow()
    d = daemon(cfg, Reader([obs(IN_WINDOW, steps=3)]), applier, [IN_WINDOW])
    assert d.tick().reason is Reason.CHANGE
    assert applier.calls == [("4", "3")]
    sample = d.metrics.registry.get_sample_value
    assert sample("specd_tick_duration_seconds_count") == 1
    assert (sample("specd_tick_duration_seconds_sum") or 0.0) < 0.5
    assert sample("specd_restart_duration_seconds_count") == 1


def test_a_pin_applied_now_whose_change_keeps_aborting_stops_at_its_own_budget(
    tmp_path: Path,
) -> None:
    """A pin applied now bypasses the budget; a change that ends aborted is not frozen (its
    setting never ran). Together they restarted SGLang at every tick, for as long as the
    pin lasted. The pin's own restarts since it was written now have a budget of their own
    (the daily one), and writing the pin again gives it a new one."""
    cfg = config(tmp_path, daily_restart_budget=3)
    clock = [IN_WINDOW]
    # Each change ends aborted: its start never ran SGLang (systemd could not set up the
    # process), the rollback's restart brought the previous setting back, verified.
    applier = Outcome(
        {
            "result": "aborted",
            "duration_s": 2.0,
            "message": "systemd could not start sglang.service's process (status 219/CGROUP: "
            "its own setup, before SGLang ran); 2 steps was never tried",
            "restarts_issued": 2,
            "not_started": 1,
        }
    )
    d = daemon(cfg, Reader([obs(IN_WINDOW, steps=3)]), applier, clock)
    path = Path(cfg.files.override_file)

    def pin_now() -> None:
        expires = datetime.fromtimestamp(clock[0] + 3600, tz=UTC)
        path.write_text(
            tomli_w.dumps({"mode": "pin", "steps": 2, "expires_at": expires,
                           "reason": "incident", "apply": "now"})
        )  # fmt: skip
        os.chmod(path, 0o600)
        os.utime(path, (clock[0], clock[0]))

    pin_now()
    reasons = []
    for _ in range(6):
        reasons.append(d.tick().reason)
        clock[0] += 5
    assert reasons == [Reason.OVERRIDE_PIN] * 3 + [Reason.RESTART_BUDGET] * 3
    assert applier.calls == [("2", "3")] * 3
    assert saved(cfg)["frozen"] is None
    assert "write the pin again" in d.tick().message
    pin_now()  # the on-call writes it again: a new budget of its own
    assert d.tick().reason is Reason.OVERRIDE_PIN
    assert len(applier.calls) == 4


STOPPED = (
    "sglang.service is stopped (inactive, no start queued): specd starts no server someone "
    "stopped; `systemctl start sglang.service` first"
)


def test_a_change_refused_before_anything_was_done_is_tried_again_a_minute_later(
    tmp_path: Path,
) -> None:
    """A pin applied now with SGLang stopped by the on-call is refused, and was refused
    again at every tick: a restart_begin and a restart_aborted every 5 s, each with a state
    write, and 2 s of rechecking the unit. The same change is tried again after a minute,
    the same refusal said again after DECISION_RELOG_S; another reason is said at once, and
    a decision that no longer wants the change forgets the refusal."""
    cfg = config(tmp_path, daily_restart_budget=3)
    clock = [IN_WINDOW]
    applier = Outcome(
        {"result": "aborted", "duration_s": 0.0, "message": STOPPED, "restarts_issued": 0}
    )
    d = daemon(cfg, Reader([obs(IN_WINDOW, steps=3)]), applier, clock)
    path = Path(cfg.files.override_file)

    def write(override: dict[str, Any] | None) -> None:
        if override is None:
            path.unlink()
            return
        path.write_text(tomli_w.dumps(override))
        os.chmod(path, 0o600)
        os.utime(path, (clock[0], clock[0]))

    expires = datetime.fromtimestamp(IN_WINDOW + 6 * 3600, tz=UTC)
    pin = {"mode": "pin", "steps": 2, "expires_at": expires, "reason": "x", "apply": "now"}
    write(pin)

    decisions: list[bool] = []  # each `decision` line logged: whether it said acts

    def ticks(seconds: float) -> list[str]:
        with capture_logs() as logged:
            end = clock[0] + seconds
            while clock[0] < end:
                assert d.tick().reason is Reason.OVERRIDE_PIN
                clock[0] += 5
        decisions.extend(e["acts"] for e in logged if e["event"] == "decision")
        return [e["event"] for e in logged if e["event"].startswith("restart_")]

    assert ticks(60) == ["restart_begin", "restart_aborted"]  # t = 0 .. 55 s
    # Logged as acting where it went to the applier, not at each tick it was held.
    assert decisions == [True], decisions
    assert len(applier.calls) == 1
    assert saved(cfg)["restarts"] == []
    # t = 60 s: tried again, refused for the same reason: not said again
    assert ticks(60) == ["restart_begin"]
    assert len(applier.calls) == 2
    assert decisions == [True, True], decisions
    # ... until DECISION_RELOG_S after it was said, with how many times in a row
    with capture_logs() as logged:
        while clock[0] < IN_WINDOW + DECISION_RELOG_S + 60:
            d.tick()
            clock[0] += 5
    [again] = [e for e in logged if e["event"] == "restart_aborted"]
    assert again["times"] == 11, again
    assert again["message"] == STOPPED, again
    calls = len(applier.calls)
    assert calls == 11
    # Another reason is said at its first refusal.
    applier.fields["message"] = "cannot verify a restart: SGLang refused the key"
    clock[0] += 60
    assert ticks(5) == ["restart_begin", "restart_aborted"]
    # A decision that no longer wants the change forgets it: wanted again, tried at once.
    write(None)
    assert d.tick().reason is not Reason.OVERRIDE_PIN
    clock[0] += 5
    write(pin)
    assert ticks(5) == ["restart_begin", "restart_aborted"]
    assert len(applier.calls) == calls + 2
    assert saved(cfg)["frozen"] is None


def test_the_gauges_say_what_a_restart_in_flight_is_for_and_when_its_window_closes(
    tmp_path: Path,
) -> None:
    """The gauges were updated after the restart sequence, which holds the loop for minutes
    (an hour at worst): through a pin applied now they said mode auto, no override file,
    target the last decision's; and a window that opened or closed meanwhile was not said
    until the sequence ended (a dashboard showing the window closed beside a restart in
    progress says specd restarted outside it)."""
    cfg = config(tmp_path, scrape_interval_s=0.001)
    clock = [IN_WINDOW + 29 * 60]  # the window closes at 04:00, a minute into the sequence
    seen: dict[str, float | None] = {}

    class Slow(Applier):
        def apply_setting(self, target: SpecSetting, *args: Any, **kwargs: Any) -> ApplyOutcome:
            value = d.metrics.registry.get_sample_value
            seen["mode_pin"] = value("specd_mode", {"mode": "pin"})
            seen["override_present"] = value("specd_override_present")
            seen["target"] = value("specd_setting_target", {"setting": "2"})
            seen["open_before"] = value("specd_window_open")
            clock[0] += 60  # the quiet wait, the restart: the window has closed meanwhile
            time.sleep(0.01)
            d._heartbeat()  # as each wait of the sequence beats
            seen["open_during"] = value("specd_window_open")
            return super().apply_setting(target, *args, **kwargs)

    d = daemon(cfg, Reader([obs(IN_WINDOW, steps=3)]), Slow(), clock)
    d.tick()  # 3 is learned as live, nothing wanted yet
    path = Path(cfg.files.override_file)
    expires = datetime.fromtimestamp(clock[0] + 3600, tz=UTC)
    pin = {"mode": "pin", "steps": 2, "expires_at": expires, "reason": "r", "apply": "now"}
    path.write_text(tomli_w.dumps(pin))
    os.chmod(path, 0o600)
    os.utime(path, (clock[0], clock[0]))
    assert d.tick().reason is Reason.OVERRIDE_PIN
    assert seen == {
        "mode_pin": 1.0,
        "override_present": 1.0,
        "target": 1.0,
        "open_before": 1.0,
        "open_during": 0.0,
    }


def test_every_decision_change_and_restart_outcome_is_saved_at_once(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    clock = [IN_WINDOW]
    reader = Reader([obs(IN_WINDOW, steps=3)])
    applier = Applier()
    d = daemon(cfg, reader, applier, clock)
    d.tick()  # wants 4, changes: the restart outcome is saved with what now runs
    assert applier.calls == [("4", "3")]
    state = saved(cfg)
    live = {"t": IN_WINDOW, "steps": 4, "setting": "4", "source": "verified restart"}
    assert state["live"] == live
    sample = d.metrics.registry.get_sample_value
    assert sample("specd_setting_live", {"setting": "4"}) == 1
    assert sample("specd_setting_live", {"setting": "3"}) is None  # cleared, not 0: one lane
    assert state["restarts"][-1]["to_steps"] == 4
    # A few seconds later (well inside the 60 s save interval) the decision changes: shown
    # at once, from status.json; state.json, all specd learned, waits for its interval (a
    # decision flapping every tick rewrote it whole at every tick).
    reader.results = [obs(IN_WINDOW + 5, steps=4)]
    clock[0] += 5
    d.tick()
    state = shown(cfg)
    assert state["last_decision"]["t"] == IN_WINDOW + 5
    assert state["last_decision"]["reason"] == Reason.WITHIN_TOLERANCE.value
    assert state["live"]["steps"] == 4
    assert saved(cfg)["last_decision"]["t"] == IN_WINDOW
    # An unchanged decision waits for the save interval.
    clock[0] += 5
    d.tick()
    assert shown(cfg)["last_decision"]["t"] == IN_WINDOW + 5
    clock[0] = IN_WINDOW + STATE_SAVE_INTERVAL_S
    d.tick()
    assert saved(cfg)["last_decision"]["t"] == IN_WINDOW + STATE_SAVE_INTERVAL_S


def test_a_decision_flapping_every_tick_is_shown_at_once_without_rewriting_the_state(
    tmp_path: Path,
) -> None:
    """A scrape failing every other tick flips the decision at every tick. `specd status`
    shows each at once (status.json); state.json, all specd learned (up to megabytes),
    is written once a minute, where each flip rewrote it whole before."""
    cfg = config(tmp_path)
    now = WINDOW_CLOSES + 3600
    clock = [now]
    failing = ScrapeError("timeout", "no answer", now)
    reader = Reader([obs(now, steps=4)])
    d = daemon(cfg, reader, Applier(), clock)
    path = Path(cfg.files.state_dir) / STATE_FILE
    writes, inode, reasons = 0, None, []
    for tick in range(25):  # 120 s, a tick every 5 s
        clock[0] = now + 5 * tick
        reader.results = [failing if tick % 2 else obs(clock[0], steps=4)]
        reasons.append(d.tick().reason)
        assert shown(cfg)["last_decision"]["reason"] == reasons[-1].value
        assert shown(cfg)["last_decision"]["t"] == clock[0]
        if path.stat().st_ino != inode:  # each save is a new file renamed over the old
            writes, inode = writes + 1, path.stat().st_ino
    assert set(reasons) == {Reason.WITHIN_TOLERANCE, Reason.NO_DATA}, reasons
    assert writes == 3  # at 0, 60 and 120 s
    assert sorted(p.name for p in path.parent.iterdir()) == [STATE_FILE, STATUS_FILE]


ADAPTIVE_34 = "/var/lib/specd/" + adaptive_config_name(parse_setting("adaptive:3,4"))
# An SGLang that runs every kind of setting (its /server_info, as specd reads it).
SERVER_INFO = {"speculative_algorithm": "EAGLE", "speculative_eagle_topk": 1, "version": "0.5.23"}


@pytest.mark.parametrize(
    ("live", "pin", "call", "kind_after", "status"),
    [
        # (what SGLang runs: steps or an adaptive config file; the pin; what the applier is
        # asked: (target, live setting); the kind exported after; the status text's head)
        (3, "off", ("off", "3"), "off", "steps 0"),
        (3, "adaptive:3,4", ("adaptive:3,4", "3"), "adaptive", "adaptive"),
        # Under adaptive the live candidates are not known: the applier hears "unknown".
        (ADAPTIVE_34, "4", ("4", None), "static", "steps 4"),
        (0, "4", ("4", "off"), "static", "steps 4"),
        # The pinned adaptive config already runs (its content-addressed name): no restart.
        (ADAPTIVE_34, "adaptive:3,4", None, "adaptive", "adaptive"),
        (0, "off", None, "off", "steps 0"),
    ],
)
def test_a_pin_of_any_kind_is_applied_as_that_setting(
    tmp_path: Path,
    live: int | str,
    pin: str,
    call: tuple[str, str | None] | None,
    kind_after: str,
    status: str,
) -> None:
    cfg = config(tmp_path)
    clock = [IN_WINDOW]
    if isinstance(live, str):
        seen = make_observation(IN_WINDOW, steps=3, running=1, adaptive=True, adaptive_config=live)
    else:
        seen = obs(IN_WINDOW, steps=live)
    applier = Applier()
    d = daemon(cfg, Reader([seen]), applier, clock)
    expires = datetime.fromtimestamp(IN_WINDOW + 3600, tz=UTC)
    override = {"mode": "pin", "setting": pin, "expires_at": expires, "reason": "incident"}
    Path(cfg.files.override_file).write_text(tomli_w.dumps(override))
    os.chmod(cfg.files.override_file, 0o600)
    decision = d.tick()
    assert decision.reason is Reason.OVERRIDE_PIN, decision.message
    assert applier.calls == ([call] if call else [])
    registry = d.metrics.registry
    if call is None:
        live_kind = kind_after
    else:
        live_kind = parse_setting(call[0]).kind
        before = "adaptive" if isinstance(live, str) else "off" if live == 0 else "static"
        changes = registry.get_sample_value(
            "specd_setting_changes_total", {"from_kind": before, "to_kind": kind_after}
        )
        assert changes == (1.0 if call[1] is not None else 0.0)  # unknown → not counted
        assert saved(cfg)["restarts"][-1]["to_setting"] == call[0]
    # The next tick sees what the restart left (the script repeats its observation, so
    # only a restart-free case keeps its live kind): the kind gauge follows the live one.
    if call is None:
        assert registry.get_sample_value("specd_setting_kind", {"kind": live_kind}) == 1.0
        assert d._status_text().startswith(status)
    assert (
        sum(
            registry.get_sample_value("specd_setting_kind", {"kind": k}) or 0.0
            for k in ("off", "static", "adaptive", "unknown")
        )
        == 1.0
    )


def test_the_restart_sequence_counts_the_window_left_for_its_own_target(tmp_path: Path) -> None:
    """The quiet wait (and every wait before the restart) asks whether the window still
    holds one whole restart: into an adaptive set that is 20 s more per candidate beyond
    the first; it counted a static restart's time, so a set could start with too little."""
    cfg = config(tmp_path)
    own = "adaptive:1,3,5,7/1=1,3,5,7;8=0,1,3;32=0,1;64=0"  # listed by default; 60 s more
    clock = [WINDOW_CLOSES - 300]
    asked: list[Callable[[], bool]] = []

    class Asking(Applier):
        def apply_setting(self, *args: Any, **kwargs: Any) -> ApplyOutcome:
            asked.append(kwargs["window_open"])
            return super().apply_setting(*args, **kwargs)

    applier = Asking(stop_timeout_s=90.0)
    d = daemon(cfg, Reader([obs(clock[0], steps=3)]), applier, clock)
    expires = datetime.fromtimestamp(clock[0] + 86400, tz=UTC)
    pin = {"mode": "pin", "setting": own, "expires_at": expires, "reason": "try it"}
    Path(cfg.files.override_file).write_text(tomli_w.dumps(pin))
    os.chmod(cfg.files.override_file, 0o600)
    decision = d.tick()
    assert decision.reason is Reason.OVERRIDE_PIN, decision.message
    assert [call[0] for call in applier.calls] == [own]
    # 230 s left: a static restart (90 s stop + 100 s start) fits, the set's (+60 s) not.
    clock[0] = WINDOW_CLOSES - 230
    assert asked[0]() is False
    assert d._window_open(parse_setting("3")) is True
    assert d._window_open(parse_setting(own)) is False


@pytest.mark.parametrize(
    ("left_s", "stop_timeout_s", "reason"),
    [
        (1800.0, 90.0, Reason.CHANGE),
        # 100 s of start (restart_cost_s) + a 300 s stop timeout do not fit in 5 minutes.
        (300.0, 300.0, Reason.WINDOW_ENDING),
        (300.0, 0.0, Reason.CHANGE),
    ],
)
def test_a_restart_starts_only_when_the_window_leaves_time_for_all_of_it(
    tmp_path: Path, left_s: float, stop_timeout_s: float, reason: Reason
) -> None:
    cfg = config(tmp_path)
    now = WINDOW_CLOSES - left_s
    clock = [now]
    applier = Applier(stop_timeout_s=stop_timeout_s)
    d = daemon(cfg, Reader([obs(now, steps=3)]), applier, clock)
    decision = d.tick()
    assert decision.reason is reason, decision.message
    assert bool(applier.calls) is (reason is Reason.CHANGE)
    assert d._window_open() is (left_s >= stop_timeout_s + cfg.choose.restart_cost_s)
    if reason is Reason.WINDOW_ENDING:
        assert "one restart needs up to" in decision.message


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("5min", 300.0),
        ("1min 30s", 90.0),
        ("500ms", 0.5),
        ("90000000", 90.0),
        ("infinity", math.inf),
        ("1h 2min 3s", 3723.0),
        ("", None),
        ("5 parsecs", None),
        ("-1s", None),
        ("nans", None),
    ],
)
def test_systemd_timespans(text: str, seconds: float | None) -> None:
    assert timespan_s(text) == seconds


@pytest.fixture
def world_traversable() -> Iterator[Path]:
    """A directory other users can reach (pytest's own tmp tree is root's alone)."""
    path = Path(tempfile.mkdtemp(prefix="specd-status-"))
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def run_status(cfg_path: Path, *prefix: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECD_")}
    return subprocess.run(
        [*prefix, sys.executable, "-m", "specd.cli", "status", "--config", str(cfg_path)],
        capture_output=True,
        text=True,
        env=env,
        cwd="/",
        timeout=60,
        check=False,
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run status as another user")
def test_status_reads_as_group_specd_and_fails_loudly_when_it_cannot(
    world_traversable: Path,
) -> None:
    tmp_path = world_traversable
    cfg = config(tmp_path)
    clock = [IN_WINDOW]
    d = daemon(cfg, Reader([obs(IN_WINDOW, steps=4)]), Applier(), clock)
    d.tick()
    path = Path(cfg.files.state_dir) / STATE_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    cfg_path = tmp_path / "specd.toml"
    cfg_path.write_text(tomli_w.dumps(json.loads(cfg.model_dump_json(exclude_none=True))))
    os.chmod(cfg_path, 0o644)
    os.chmod(cfg.files.state_dir, 0o751)  # as StateDirectoryMode= makes it
    os.chown(cfg.files.state_dir, 0, 4242)
    gid = 4242  # stands for group specd: the file's group, and the on-call's
    os.chown(path, 0, gid)
    on_call = ("setpriv", "--reuid=65534", f"--regid={gid}", "--clear-groups")
    ok = run_status(cfg_path, *on_call)
    assert ok.returncode == 0, ok.stderr
    assert "steps live     4 (observation" in ok.stdout
    # Not in the group: permission denied is an error, not a status.
    stranger = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")
    denied = run_status(cfg_path, *stranger)
    assert denied.returncode == 1
    assert "Permission denied" in denied.stderr
    assert len(denied.stderr.strip().splitlines()) == 1
    # A bad part the daemon would leave out, status leaves out too (one validation for
    # both), shows the rest, and exits 1 naming it.
    path.write_text(json.dumps({**json.loads(path.read_text()), "restarts": 5}))
    bad = run_status(cfg_path)
    assert bad.returncode == 1
    assert "restarts" in bad.stderr
    assert "kept the rest" in bad.stderr
    assert "steps live     4 (observation" in bad.stdout
    assert "Traceback" not in bad.stderr + bad.stdout


def test_a_pin_applied_now_outside_a_window_waits_for_the_gateway_to_answer(
    tmp_path: Path,
) -> None:
    """The gateway must answer and list this server (a twin stands in for it there; the
    daemon reads its observations from the test): a pin applied now waits for both."""
    port = free_port()
    with TwinProcess(FAST_TWIN_VERSION_ARGS) as this, TwinProcess(FAST_TWIN_VERSION_ARGS) as other:
        cfg = config(
            tmp_path,
            urls=[f"http://127.0.0.1:{port}"],
            worker_url=this.url,
            request_timeout_s=2.0,
        )
        now = WINDOW_CLOSES + 3600  # no window open: only the pin makes specd ask the gateway
        clock = [now]
        applier = Applier()
        d = daemon(cfg, Reader([obs(now, steps=3)]), applier, clock)
        expires = datetime.fromtimestamp(now + 7200, tz=UTC)
        pin = {"mode": "pin", "steps": 4, "expires_at": expires, "reason": "incident",
               "apply": "now"}  # fmt: skip
        Path(cfg.files.override_file).write_text(tomli_w.dumps(pin))
        os.chmod(cfg.files.override_file, 0o600)
        decision = d.tick()
        assert decision.reason is Reason.DRAIN_UNAVAILABLE, decision.message
        assert "ConnectError" in decision.message
        assert applier.calls == []
        sample = d.metrics.registry.get_sample_value
        assert sample("specd_gateway_errors_total", {"kind": "connect"}) == 1
        this.wait_healthy()
        other.wait_healthy()
        # The gateway answers but routes only another server: a drain would remove nothing.
        with SmgGateway([other.url], port=port):
            clock[0] += 5
            d.client = Reader([obs(clock[0], steps=3)])
            decision = d.tick()
        assert decision.reason is Reason.DRAIN_UNAVAILABLE, decision.message
        assert f"does not list worker {this.url} (it lists {other.url})" in decision.message
        assert applier.calls == []
        assert sample("specd_gateway_worker_not_ready_replicas") == 1
        # It routes this server: the pin goes ahead.
        with SmgGateway([this.url, other.url], port=port):
            clock[0] += 5
            d.client = Reader([obs(clock[0], steps=3)])
            decision = d.tick()
    assert decision.reason is Reason.OVERRIDE_PIN, decision.message
    assert applier.calls == [("4", "3")]
    assert sample("specd_gateway_worker_not_ready_replicas") == 0


# Sunday 03:10: specd changed 3 → 4 (the bands want 4 at 2 requests) or to an adaptive set.
REGRESSED_CHANGE = IN_WINDOW - 86400 - 1200


def regressed(cfg: Config, to: SpecSetting | None) -> tuple[Daemon, Applier, History, list[float]]:
    """A daemon verifying the change of `REGRESSED_CHANGE` from 3 to ``to`` (None: 4 steps),
    which since served 5 % less than 3 did at the same 2 requests; JSON logs on stdout."""
    history = History(HistorySettings.from_config(cfg))
    serve(history, 3, REGRESSED_CHANGE - 3 * 3600, REGRESSED_CHANGE - 60, 2, 1000.0)
    until = outcome.verification_end(cfg, REGRESSED_CHANGE)
    key = 4 if to is None else setting_key(to)
    snap = outcome.snapshot(history, 3, key, 0.05, until, to_setting=to)
    runs = {} if to is None else {"adaptive_config": "/var/lib/specd/" + adaptive_config_name(to)}
    last = serve(history, 4, REGRESSED_CHANGE + 100, IN_WINDOW, 2, 950.0, **runs)
    clock = [last.t]
    applier = Applier()
    logs.configure("json", stream=sys.stdout)
    d = daemon(cfg, Reader([last]), applier, clock)
    d.state.history = history
    d.state.verifying = snap
    return d, applier, history, clock


def test_a_regression_goes_back_is_counted_logged_saved_and_not_repeated(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = config(tmp_path, scrape_interval_s=60)
    d, applier, history, clock = regressed(cfg, None)
    changed = REGRESSED_CHANGE
    d.state.restarts = [{"t": changed + 100, "from_steps": 3, "to_steps": 4, "result": "success"}]
    sample = d.metrics.registry.get_sample_value
    assert sample("specd_regressions_total", {"steps": "4"}) == 0  # there from the start
    assert d.tick().reason is Reason.REGRESSION
    assert applier.calls == [("3", "4")]
    assert sample("specd_regressions_total", {"steps": "4"}) == 1
    assert sample("specd_decisions_total", {"reason": "regression"}) == 1
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line]
    (logged,) = [e for e in events if e["event"] == "regression"]
    assert (logged["from_steps"], logged["to_steps"]) == (3, 4)
    assert (logged["from_setting"], logged["to_setting"]) == ("3", "4")
    assert logged["shortfall_ratio"] == pytest.approx(0.05, abs=1e-3)
    decision = next(e for e in events if e["event"] == "decision")
    assert decision["reason"] == "regression"
    assert "outcome of 3 → 4" in decision["outcome"]
    state = saved(cfg)
    assert state["verifying"] is None
    assert [(a["steps"], a["from_steps"]) for a in state["avoided"]] == [(4, 3)]
    # Back at 3, the bands want 4 again: avoided, so no restart (a restarted specd too).
    again = daemon(cfg, Reader([obs(clock[0] + 3600, steps=3, running=2)]), applier, clock)
    clock[0] += 3600
    again.state.history = history
    assert [a.steps for a in again.state.avoided] == [4]
    decision_again = again.tick()
    assert decision_again.reason is Reason.WITHIN_TOLERANCE
    assert "avoided" in decision_again.message
    assert applier.calls == [("3", "4")]


def test_an_adaptive_set_that_regressed_is_counted_and_logged_by_its_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = config(tmp_path, scrape_interval_s=60)
    target = parse_setting("adaptive:3,4")
    d, applier, _, _ = regressed(cfg, target)
    sample = d.metrics.registry.get_sample_value
    # There from the start (an `increase` sees the first), as every set specd may choose.
    assert sample("specd_regressions_total", {"steps": "adaptive:3,4"}) == 0
    assert sample("specd_regressions_total", {"steps": "off"}) == 0
    assert d.tick().reason is Reason.REGRESSION
    assert applier.calls == [("4", None)]  # the bands' pick for 2 requests
    assert sample("specd_regressions_total", {"steps": "adaptive:3,4"}) == 1
    assert sample("specd_regressions_total", {"steps": str(setting_key(target))}) is None
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line]
    (logged,) = [e for e in events if e["event"] == "regression"]
    assert (logged["from_setting"], logged["to_setting"]) == ("3", "adaptive:3,4")
    assert (logged["from_steps"], logged["to_steps"]) == (3, None)


def test_a_set_a_reload_leaves_out_leaves_no_series_unless_it_was_counted() -> None:
    """Each set a reload named made a specd_regressions_total series that stayed: a
    thousand reloads naming new sets were a thousand series. One left out goes where it is
    still 0; one counted stays (an `increase` over it must not see it vanish)."""
    metrics = Metrics(CollectorRegistry())
    sample = metrics.registry.get_sample_value
    metrics.declare_choices(range(1, 7), ["off", "adaptive:1,3", "adaptive:2,4"])
    metrics.regressions.labels(steps="adaptive:2,4").inc()
    metrics.declare_choices(range(1, 5), ["off", "adaptive:3,4"])
    assert sample("specd_regressions_total", {"steps": "adaptive:3,4"}) == 0
    assert sample("specd_regressions_total", {"steps": "adaptive:1,3"}) is None
    assert sample("specd_regressions_total", {"steps": "adaptive:2,4"}) == 1
    assert sample("specd_regressions_total", {"steps": "6"}) is None
    assert sample("specd_explorations_total", {"steps": "6"}) is None
    assert sample("specd_explorations_total", {"steps": "4"}) == 0
    for i in range(200):
        metrics.declare_choices(range(1, 7), [f"adaptive:{i},{i + 1}"])
    families = {f.name: f for f in metrics.registry.collect()}
    assert len(families["specd_regressions"].samples) <= 2 * (6 + 2)  # _total and _created


WIRED = (
    "sglang.service's ExecStart= reads ${SPECULATIVE_NUM_STEPS}, not $SPECD_SPECULATIVE_ARGS: "
    "static step counts only (`specd install` rewrites it)"
)


@pytest.mark.parametrize(("static_only", "target"), [(None, "off"), (WIRED, "1")])
def test_what_the_unit_can_be_given_bounds_what_specd_changes_to(
    tmp_path: Path, static_only: str | None, target: str
) -> None:
    # 48 requests on heavyoff's calibration: off serves ~1.8x what 3 steps do, 1 step ~1.6x.
    calibration = REPO / "bench" / "truth" / "heavyoff-calibration.csv"
    cfg = config(tmp_path, policy="model", calibration_file=str(calibration), scrape_interval_s=60)
    history = History(HistorySettings.from_config(cfg))
    last = serve(history, 3, IN_WINDOW - 6 * 3600, IN_WINDOW, 48, 730.0)
    applier = Applier(static_only=static_only)
    d = daemon(cfg, Reader([last]), applier, [last.t])
    d.state.history = history
    d._read_wiring()  # as run() does at start, and reload() at each reload
    decision = d.tick()
    assert decision.reason is Reason.CHANGE, decision.message
    assert applier.calls == [(target, "3")]


def test_every_candidate_setting_is_predicted_on_the_dashboard_and_in_the_log_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # heavyoff's calibration has rows for steps 0-7: off and every default adaptive set are
    # candidates beside the step counts, and are what specd picks there.
    calibration = REPO / "bench" / "truth" / "heavyoff-calibration.csv"
    cfg = config(tmp_path, policy="model", calibration_file=str(calibration), scrape_interval_s=60)
    history = History(HistorySettings.from_config(cfg))
    last = serve(history, 3, IN_WINDOW - 6 * 3600, IN_WINDOW, 48, 730.0)
    logs.configure("json", stream=sys.stdout)
    d = daemon(cfg, Reader([last], SERVER_INFO), Applier(), [last.t])
    d.state.history = history
    d.tick()
    names = {"1", "2", "3", "4", "5", "6", "off", *cfg.choose.adaptive_candidate_sets}
    exported: dict[str, dict[str, float]] = {}
    for metric in d.metrics.registry.collect():
        if metric.name.startswith("specd_predicted_throughput"):
            for sample in metric.samples:
                exported.setdefault(sample.labels["steps"], {})[sample.name] = sample.value
    assert set(exported) == names
    for name, values in exported.items():
        low, mid, high = (
            values[f"specd_predicted_throughput{part}_tokens_per_second"]
            for part in ("_low", "", "_high")
        )
        assert 0 < low <= mid <= high, name
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line]
    logged = next(e for e in events if e["event"] == "decision")
    assert set(logged["prediction_interval"]) == names
    assert logged["recommendation"] in names


@pytest.mark.parametrize(
    ("server", "live"),
    [
        (SERVER_INFO, "adaptive:3,4"),
        # /server_info not read yet: no set is offered, so the file names it.
        (None, f"adaptive ({ADAPTIVE_34.rsplit('/', 1)[-1]})"),
    ],
)
def test_an_adaptive_set_live_is_named_in_the_state_and_the_status(
    tmp_path: Path, server: dict[str, Any] | None, live: str
) -> None:
    cfg = config(tmp_path)
    seen = make_observation(
        IN_WINDOW, steps=3, running=1, adaptive=True, adaptive_config=ADAPTIVE_34
    )
    d = daemon(cfg, Reader([seen], server), Applier(), [IN_WINDOW])
    expires = datetime.fromtimestamp(IN_WINDOW + 3600, tz=UTC)
    pin = {"mode": "pin", "setting": "adaptive:3,4", "expires_at": expires, "reason": "incident"}
    Path(cfg.files.override_file).write_text(tomli_w.dumps(pin))
    os.chmod(cfg.files.override_file, 0o600)
    assert d.tick().reason is Reason.OVERRIDE_PIN
    d._save_state(force=True)
    state = saved(cfg)
    assert (state["live"]["steps"], state["live"]["setting"]) == (None, live)
    assert state["last_decision"]["target_setting"] == "adaptive:3,4"
    assert d._status_text().startswith(f"{live}, target adaptive:3,4, override_pin")
    # Grafana too: one sample each, by name (the steps gauges have no number for a set).
    exported = {
        (s.name, s.labels["setting"])
        for m in d.metrics.registry.collect()
        if m.name in ("specd_setting_live", "specd_setting_target")
        for s in m.samples
        if s.value == 1
    }
    assert exported == {("specd_setting_live", live), ("specd_setting_target", "adaptive:3,4")}


def test_a_new_adaptive_target_is_logged_and_saved_at_once_though_no_step_count_changed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = config(tmp_path)
    now = WINDOW_CLOSES + 3600  # no window: each pin waits for the next, for the same reason
    clock = [now]
    logs.configure("json", stream=sys.stdout)
    d = daemon(cfg, Reader([obs(now, steps=3)], SERVER_INFO), Applier(), clock)
    expires = datetime.fromtimestamp(now + 86400, tz=UTC)
    reasons = []
    for setting in ("adaptive:3,4", "adaptive:2,4"):
        pin = {"mode": "pin", "setting": setting, "expires_at": expires, "reason": "incident"}
        Path(cfg.files.override_file).write_text(tomli_w.dumps(pin))
        os.chmod(cfg.files.override_file, 0o600)
        reasons.append(d.tick().reason)
        # Saved at once (well inside the 60 s save interval), as any change of decision.
        assert shown(cfg)["last_decision"]["target_setting"] == setting
        clock[0] += 5
    assert reasons[0] is reasons[1], reasons
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line]
    logged = [e["target_setting"] for e in events if e["event"] == "decision"]
    assert logged == ["adaptive:3,4", "adaptive:2,4"]


def test_a_reload_declares_the_counters_of_the_settings_it_adds(tmp_path: Path) -> None:
    d = daemon(config(tmp_path), Reader([obs(IN_WINDOW)]), Applier(), [IN_WINDOW])
    sample = d.metrics.registry.get_sample_value
    assert sample("specd_regressions_total", {"steps": "adaptive:2,5"}) is None
    assert sample("specd_explorations_total", {"steps": "7"}) is None
    fields = {
        "state_dir": str(tmp_path / "state"),
        "override_file": str(tmp_path / "override.toml"),
        "env_file": str(tmp_path / "sglang.env"),
        "max_steps": 7,
        "adaptive_candidate_sets": ["adaptive:2,5"],
    }
    d.config_path = tmp_path / "specd.toml"
    d.config_path.write_text(tomli_w.dumps(tables(**fields)))
    d.reload()
    assert sample("specd_config_reload_success") == 1
    # There before the first one, as at start: the dashboard's increase() sees it.
    assert sample("specd_regressions_total", {"steps": "adaptive:2,5"}) == 0
    assert sample("specd_regressions_total", {"steps": "7"}) == 0
    assert sample("specd_explorations_total", {"steps": "7"}) == 0


def test_a_reload_that_narrows_the_step_range_takes_its_accept_lengths_off_the_page(
    tmp_path: Path,
) -> None:
    """specd_accept_length and specd_acceptance_alpha_ratio kept the last value of a step
    count a reload took out of [choose]: a panel went on showing K=6 as learned."""
    fields = {
        "state_dir": str(tmp_path / "state"),
        "override_file": str(tmp_path / "override.toml"),
        "env_file": str(tmp_path / "sglang.env"),
    }
    history = History(HistorySettings.from_config(config(tmp_path)))
    t = IN_WINDOW - 6 * 3600
    for k in (3, 5, 6):  # half an hour of fresh acceptance at each
        for _ in range(30):
            last = make_observation(t, steps=k, running=4, accept_length=2.5)
            history.record(last)
            t += 60
    d = daemon(config(tmp_path), Reader([last]), Applier(), [last.t])
    d.state.history = history
    d.tick()

    def shown() -> dict[str, set[str]]:
        return {
            name: {
                s.labels["steps"]
                for m in d.metrics.registry.collect()
                if m.name == name
                for s in m.samples
            }
            for name in ("specd_accept_length", "specd_acceptance_alpha_ratio")
        }

    assert shown() == {n: {"3", "5", "6"} for n in shown()}
    d.config_path = tmp_path / "specd.toml"
    d.config_path.write_text(tomli_w.dumps(tables(**fields, max_steps=5)))
    d.reload()
    d.tick()
    assert shown() == {n: {"3", "5"} for n in shown()}


@pytest.mark.parametrize(
    "pinned",
    [
        pytest.param({"steps": 6}, id="a step count"),
        pytest.param({"setting": "adaptive:3,6"}, id="an adaptive set"),
    ],
)
def test_a_pin_a_reload_puts_outside_the_step_range_is_dropped_not_clamped(
    tmp_path: Path, pinned: dict[str, Any]
) -> None:
    """[choose] max_steps 6 → 4 while a pin holds 6: specd logged override_ignored and
    exported specd_override_valid 0, yet went on enforcing the pin clamped to 4, restarting
    SGLang "pinned to 4 by override" (a count nobody pinned), with specd_steps_pinned at 6.
    Ignored, the pin drives nothing: at 48 requests the bands keep the 3 SGLang runs."""
    cfg = config(tmp_path, max_steps=6)
    clock = [IN_WINDOW - 7200]  # the window closed: the pin waits for it
    applier = Applier()
    d = daemon(cfg, Reader([obs(IN_WINDOW, steps=3, running=48)]), applier, clock)
    d.state.history = busy(cfg, IN_WINDOW, offered=48)
    expires = datetime.fromtimestamp(IN_WINDOW + 86400, tz=UTC)
    pin = {"mode": "pin", **pinned, "expires_at": expires, "reason": "deep drafts"}
    Path(cfg.files.override_file).write_text(tomli_w.dumps(pin))
    os.chmod(cfg.files.override_file, 0o600)
    assert d.tick().reason is Reason.WINDOW_CLOSED
    sample = d.metrics.registry.get_sample_value
    assert sample("specd_mode", {"mode": "pin"}) == 1
    d.config_path = tmp_path / "specd.toml"
    d.config_path.write_text(tomli_w.dumps(_own_files(tmp_path, max_steps=4)))
    clock[0] = IN_WINDOW
    with capture_logs() as logged:
        d.reload()
        decisions = [d.tick() for _ in range(2)]
    assert [x.reason for x in decisions] == [Reason.WITHIN_TOLERANCE] * 2, decisions
    assert applier.calls == []
    events = [e["event"] for e in logged if e["event"].startswith("override_")]
    assert events == ["override_ignored", "override_dropped"]
    (dropped,) = [e for e in logged if e["event"] == "override_dropped"]
    assert dropped["log_level"] == "warning"
    assert "outside the configured range 1..4" in dropped["problem"]
    assert sample("specd_override_valid") == 0
    assert math.isnan(sample("specd_steps_pinned") or 0.0)
    assert sample("specd_mode", {"mode": "auto"}) == 1
    assert d.override.in_force is None
    # Widened again, the same file is in force again, as specd status says.
    d.config_path.write_text(tomli_w.dumps(_own_files(tmp_path, max_steps=6)))
    with capture_logs() as logged:
        d.reload()
        d.tick()
    assert [e["event"] for e in logged if e["event"].startswith("override_")] == ["override_loaded"]
    assert sample("specd_mode", {"mode": "pin"}) == 1
    assert applier.calls == [(format_setting(parse_setting(str(pin.get("setting", 6)))), "3")]


def test_a_pin_of_a_listed_set_past_the_range_holds_until_a_reload_unlists_it(
    tmp_path: Path,
) -> None:
    """A set listed in adaptive_candidate_sets may go past max_steps (the policy chooses
    it; SGLang's own reaches 7), so a pin of it is in force; a reload that drops it from the
    list drops the pin, as one that narrows the range under a pinned step count."""
    sets = ["adaptive:3,6", "adaptive:3,4"]
    cfg = config(tmp_path, max_steps=4, kinds=["static", "adaptive"], adaptive_candidate_sets=sets)
    d = daemon(
        cfg, Reader([obs(IN_WINDOW - 7200, steps=3, running=2)]), Applier(), [IN_WINDOW - 7200]
    )
    expires = datetime.fromtimestamp(IN_WINDOW + 86400, tz=UTC)
    pin = {"mode": "pin", "setting": "adaptive:3,6", "expires_at": expires, "reason": "deep"}
    Path(cfg.files.override_file).write_text(tomli_w.dumps(pin))
    os.chmod(cfg.files.override_file, 0o600)
    sample = d.metrics.registry.get_sample_value
    d.tick()
    assert sample("specd_mode", {"mode": "pin"}) == 1
    assert d.override.in_force is not None
    d.config_path = tmp_path / "specd.toml"
    unlisted = _own_files(
        tmp_path, max_steps=4, kinds=["static", "adaptive"], adaptive_candidate_sets=sets[1:]
    )
    d.config_path.write_text(tomli_w.dumps(unlisted))
    with capture_logs() as logged:
        d.reload()
        d.tick()
    (dropped,) = [e for e in logged if e["event"] == "override_dropped"]
    assert dropped["problem"] == (
        "pin adaptive:3,6: 6 outside the configured range 1..4, and the set is not one of "
        "[choose] adaptive_candidate_sets"
    ), dropped["problem"]
    assert sample("specd_mode", {"mode": "auto"}) == 1
    assert d.override.in_force is None


def test_the_pinned_step_count_exported_is_the_one_enforced(tmp_path: Path) -> None:
    """Frozen after a failed restart, specd holds SGLang as it runs whatever the file pins:
    specd_steps_pinned said 4 beside specd_mode{mode="freeze"} 1."""
    cfg = config(tmp_path)
    d = daemon(cfg, Reader([obs(IN_WINDOW, steps=3)]), Applier(), [IN_WINDOW])
    _pinned(d.state, cfg)
    sample = d.metrics.registry.get_sample_value
    d.tick()
    assert sample("specd_steps_pinned") == 4
    d.state.frozen = {"since": IN_WINDOW, "reason": "restart to 4 rolled_back: OOM"}
    assert d.tick().reason is Reason.FROZEN
    assert sample("specd_mode", {"mode": "freeze"}) == 1
    assert math.isnan(sample("specd_steps_pinned") or 0.0)


def test_a_pin_the_unit_cannot_take_is_held_with_no_restart(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    applier = Applier(static_only=WIRED)
    d = daemon(cfg, Reader([obs(IN_WINDOW, steps=3)]), applier, [IN_WINDOW])
    d._read_wiring()
    expires = datetime.fromtimestamp(IN_WINDOW + 3600, tz=UTC)
    override = {"mode": "pin", "setting": "off", "expires_at": expires, "reason": "incident"}
    Path(cfg.files.override_file).write_text(tomli_w.dumps({**override, "apply": "now"}))
    os.chmod(cfg.files.override_file, 0o600)
    decision = d.tick()
    assert decision.reason is Reason.UNSUPPORTED, decision.message
    assert decision.message.endswith(f"; not applied: {WIRED}")
    assert applier.calls == []
    sample = d.metrics.registry.get_sample_value
    assert sample("specd_decisions_total", {"reason": "unsupported"}) == 1


@pytest.mark.parametrize(
    ("signum", "stops", "reloads"),
    [(signal.SIGHUP, False, True), (signal.SIGTERM, True, False), (signal.SIGINT, True, False)],
)
def test_a_signal_landing_while_the_loop_holds_an_events_lock_never_deadlocks(
    tmp_path: Path, signum: int, stops: bool, reloads: bool
) -> None:
    # A handler runs in the loop's thread between two bytecodes, possibly inside
    # Event.wait while that thread holds the event's (non-reentrant) lock: a handler that
    # called Event.set there never returned (CI: the loop stopped after a burst of
    # SIGHUPs). The handler only writes to a pipe; the relay thread sets the events.
    previous = {s: signal.getsignal(s) for s in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT)}
    d = daemon(config(tmp_path), Reader([obs(1000.0)]), Applier(), [1000.0])
    try:
        d.install_signal_handlers()
        for event in (d._wake, d.stop_event, d._reload_requested):
            with event._cond:  # as Event.wait holds it
                d._on_signal(signum, None)  # returns: it takes no lock
        assert d._wake.wait(5)
        time.sleep(0.2)  # the relay has set all it will
        assert d.stop_event.is_set() is stops
        assert d._reload_requested.is_set() is reloads
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def test_an_override_that_expires_is_said_once_and_its_expiry_stays_exported(
    tmp_path: Path,
) -> None:
    """The file stays as the on-call wrote it: valid, no longer in force, its expiry still
    exported (so SpecdOverrideExpiredInFile can fire and SpecdOverrideInvalid does not)."""
    cfg = config(tmp_path)
    clock = [IN_WINDOW]
    d = daemon(cfg, Reader([obs(IN_WINDOW, steps=4)]), Applier(), clock)
    expires = IN_WINDOW + 10
    freeze = {
        "mode": "freeze",
        "expires_at": datetime.fromtimestamp(expires, tz=UTC),
        "reason": "incident",
    }
    Path(cfg.files.override_file).write_text(tomli_w.dumps(freeze))
    os.chmod(cfg.files.override_file, 0o600)
    sample = d.metrics.registry.get_sample_value
    with capture_logs() as logged:
        assert d.tick().reason is Reason.FROZEN
        assert sample("specd_mode", {"mode": "freeze"}) == 1
        assert sample("specd_override_info", {"mode": "freeze", "reason": "incident"}) == 1
        for _ in range(3):  # expired from the first of these ticks on
            clock[0] += 10
            assert d.tick().reason is not Reason.FROZEN
    assert sample("specd_mode", {"mode": "auto"}) == 1
    assert (sample("specd_override_present"), sample("specd_override_valid")) == (1, 1)
    assert sample("specd_override_expiry_timestamp_seconds") == expires
    assert sample("specd_override_info", {"mode": "freeze", "reason": "incident"}) is None
    events = [e["event"] for e in logged if e["event"].startswith("override_")]
    assert events == ["override_loaded", "override_expired"]

    # Read already expired (a restart of specd): said once, as expired, never as loaded.
    restarted = daemon(cfg, Reader([obs(clock[0], steps=4)]), Applier(), clock)
    with capture_logs() as logged:
        restarted.tick()
        clock[0] += 10
        restarted.tick()
    events = [e["event"] for e in logged if e["event"].startswith("override_")]
    assert events == ["override_expired"]


def test_a_clock_stepped_back_does_not_stop_the_state_saves(tmp_path: Path) -> None:
    """What specd learned is saved every minute; after the clock steps back an hour it must
    not wait for the clock to catch up (a crash in that hour lost the hour's learning)."""
    cfg = config(tmp_path)
    back = [IN_WINDOW - 3600 + 61 * i for i in range(1, 4)]  # a minute apart, an hour back
    clock = [IN_WINDOW]
    d = daemon(cfg, Reader([obs(t, steps=4) for t in [IN_WINDOW, *back]]), Applier(), clock)
    assert d.tick().reason is Reason.WITHIN_TOLERANCE
    state_file = Path(cfg.files.state_dir) / STATE_FILE
    writes = []
    for t in back:
        clock[0] = t
        state_file.unlink()
        assert d.tick().reason is Reason.WITHIN_TOLERANCE  # no change: no forced save
        writes.append(state_file.exists())
    assert writes == [True, True, True]


class Outcome(Applier):
    """The applier's sequence, from the live setting to the target, ends as the test says
    (the live setting stays as it was)."""

    def __init__(self, fields: dict[str, Any]) -> None:
        super().__init__()
        self.fields = fields

    def apply_setting(
        self,
        target: SpecSetting,
        current: SpecSetting | None,
        *,
        window_open: Callable[[], bool],
        force: bool = False,
        cancelled: Callable[[], str | None] | None = None,
    ) -> ApplyOutcome:
        super().apply_setting(
            target, current, window_open=window_open, force=force, cancelled=cancelled
        )
        return ApplyOutcome(
            from_steps=setting_steps(current),
            to_steps=setting_steps(target),
            capacity=13,
            from_setting=None if current is None else format_setting(current),
            to_setting=format_setting(target),
            **self.fields,
        )


@pytest.mark.parametrize(
    ("fields", "counted", "frozen"),
    [
        pytest.param(
            {"result": "success", "duration_s": 90.0, "message": "verified", "restarts_issued": 1},
            1,
            False,
            id="a change: one restart",
        ),
        pytest.param(
            {
                "result": "rolled_back",
                "duration_s": 200.0,
                "message": "not healthy; rolled back, verified 3 steps",
                "restarts_issued": 2,
            },
            2,
            True,
            id="a change and its rollback: two",
        ),
        pytest.param(
            {
                "result": "rolled_back",
                "duration_s": 0.0,
                "message": "Access denied; SGLang kept verified 3 steps, no restart",
                "restarts_issued": 1,
                "not_started": 1,
            },
            0,
            True,
            id="the restart command reached nothing: none",
        ),
        pytest.param(
            {
                "result": "failed",
                "duration_s": 0.0,
                "message": "restart journal phase 'x' unknown; SGLang and the env file left",
                "restarts_issued": 0,
            },
            0,
            True,
            id="a journal specd cannot read: none",
        ),
        pytest.param(
            {
                "result": "aborted",
                "duration_s": 20.0,
                "message": "the unit's start limit, used up before this change, refused its "
                "start; 4 steps was never tried; rolled back, verified 3 steps",
                "restarts_issued": 2,
                "not_started": 1,
            },
            1,
            False,
            id="the start limit refused the change, SGLang started again on 3: one, no freeze",
        ),
        pytest.param(
            {
                "result": "aborted",
                "duration_s": 0.0,
                "message": "window closed while waiting for a quiet moment",
            },
            None,
            False,
            id="aborted before any restart: nothing recorded",
        ),
    ],
)
def test_the_restart_budget_counts_the_sglang_restarts_a_sequence_made(
    tmp_path: Path, fields: dict[str, Any], counted: int | None, frozen: bool
) -> None:
    """The daily budget counted restart sequences: a rollback (two SGLang restarts) was
    one, and sequences that restarted nothing (a journal it could not read, SGLang found
    untouched on its old setting) counted all the same. It counts SGLang restarts now."""
    cfg = config(tmp_path, daily_restart_budget=4)
    clock = [IN_WINDOW]
    applier = Outcome(fields)
    d = daemon(cfg, Reader([obs(IN_WINDOW, steps=3)]), applier, clock)
    d.tick()  # the bands want 4: the change is applied, its outcome recorded
    assert applier.calls == [("4", "3")]
    left = d.metrics.registry.get_sample_value("specd_restart_budget_remaining")
    assert left == 4 - (counted or 0)
    # What decide counts for dwell and the budget: one time per SGLang restart.
    assert d.state.control().restart_times == (IN_WINDOW,) * (counted or 0)
    entries = saved(cfg)["restarts"]
    if counted is None:
        assert entries == []
    else:
        assert [(e["result"], e["restarts"]) for e in entries] == [(fields["result"], counted)]
    assert (saved(cfg)["frozen"] is not None) is frozen
    # specd_restarts_total counts the sequence (every one recorded); the warm-up and the
    # restart's duration only where SGLang was restarted: a sequence that left it serving
    # must not have its next observations thrown away as an SGLang start's.
    sample = d.metrics.registry.get_sample_value
    assert sample("specd_restarts_total", {"result": fields["result"]}) == (
        0 if counted is None else 1
    )
    assert sample("specd_restart_duration_seconds_count") == (1 if counted else 0)
    started = IN_WINDOW if counted else None
    assert (d.state.sglang_started_at, d.state.history.sglang_started_at) == (started, started)
    assert saved(cfg)["sglang_started_at"] == started


SHUT_DOWN = "the system is shutting down (`systemctl is-system-running`: stopping)"


class RebootedMidRestart(Applier):
    """The system shuts down while SGLang loads the change: the applier leaves the journal
    (env file back on 3) for the next start and says so (``pending``), as
    `Applier._leave_for_boot` does; the next start's replay verifies 3 and ends aborted."""

    def __init__(self) -> None:
        super().__init__()
        self.daemon: Daemon | None = None
        self.replayed: list[Any] = []

    def apply_setting(self, target: SpecSetting, *args: Any, **kwargs: Any) -> ApplyOutcome:
        super().apply_setting(target, *args, **kwargs)
        assert self.daemon is not None
        journal = {"phase": "restart_issued", "from_setting": "3", "to_setting": "4"}
        self.daemon._persist_journal(journal)
        self.daemon.stop_event.set()  # the shutdown's SIGTERM
        self.daemon._persist_journal({**journal, "shutdown": SHUT_DOWN, "no_verdict": True})
        message = f"{SHUT_DOWN}: sglang.env back on 3 steps, which sglang.service starts on at boot"
        return ApplyOutcome("aborted", 3, 4, 5.0, message, None, 1, "3", "4", pending=True)

    def reconcile(self, journal_data: Any) -> ApplyOutcome | None:
        if journal_data is None:
            return None
        self.replayed.append(journal_data)
        message = f"{SHUT_DOWN}; since then, verified 3 steps"
        return ApplyOutcome("aborted", 3, 4, 100.0, message, 13, 1, "3", "4")


def test_a_restart_the_shutdown_interrupted_is_left_for_the_next_start_to_verify(
    tmp_path: Path,
) -> None:
    """The daemon recorded whatever outcome the applier returned and cleared the journal: a
    sequence the system's shutdown cut short would be over before SGLang was seen on its
    setting again. Now the journal stays for the next start (after the reboot), which
    verifies the previous setting and records the sequence then: no freeze either time."""
    cfg = config(tmp_path, metrics_listen_address="127.0.0.1", metrics_port=0)
    clock = [IN_WINDOW]
    applier = RebootedMidRestart()
    first = daemon(cfg, Reader([obs(IN_WINDOW, steps=3)]), applier, clock)
    applier.daemon = first
    with capture_logs() as logs:
        assert first.run() == 0  # the change, then the stop it brought
    assert applier.calls == [("4", "3")]
    left = saved(cfg)
    assert left["journal"] == {
        "phase": "restart_issued",
        "from_setting": "3",
        "to_setting": "4",
        "shutdown": SHUT_DOWN,
        "no_verdict": True,
    }
    assert (left["restarts"], left["frozen"], left["sglang_started_at"]) == ([], None, None)
    assert first.metrics.registry.get_sample_value(
        "specd_restarts_total", {"result": "aborted"}
    ) in (None, 0.0)
    [pending] = [e for e in logs if e["event"] == "restart_pending_until_next_start"]
    assert pending["message"].startswith(SHUT_DOWN)

    clock[0] = IN_WINDOW + 300  # after the reboot
    second = daemon(cfg, Reader([obs(IN_WINDOW + 300, steps=3)]), RebootedMidRestart(), clock)
    replay = second.applier
    assert isinstance(replay, RebootedMidRestart)
    assert second.state.journal == left["journal"]  # loaded from state.json
    second._reconcile_journal()
    assert replay.replayed == [left["journal"]]
    after = saved(cfg)
    assert after["journal"] is None
    assert [(r["result"], r["restarts"]) for r in after["restarts"]] == [("aborted", 1)]
    assert after["frozen"] is None


class LiveReader(Reader):
    """SGLang serving ``offered`` concurrent requests at the step count it was last started
    with; every scrape stamped with the daemon's wall clock."""

    def __init__(self, wall: list[float], steps: int, offered: int) -> None:
        super().__init__([])
        self.wall, self.steps, self.offered = wall, steps, offered

    def observe(self) -> Observation | ScrapeError:
        return obs(self.wall[0], steps=self.steps, running=self.offered)


class RestartingApplier(Applier):
    def __init__(self, reader: LiveReader) -> None:
        super().__init__()
        self.reader = reader

    def apply_setting(self, target: SpecSetting, *args: Any, **kwargs: Any) -> ApplyOutcome:
        done = super().apply_setting(target, *args, **kwargs)
        self.reader.steps = target.steps or 0
        return done


# Monday 2026-01-05 02:00 UTC, inside a window open 01:00-07:00 every day.
STEP_T0 = datetime(2026, 1, 5, 2, 0, tzinfo=UTC).timestamp()
SIX_HOURS_DAILY = [{"cron": "0 1 * * *", "duration_s": 6 * 3600, "timezone": "UTC"}]


@pytest.mark.parametrize(
    ("settings", "restart", "first_tick", "step", "stopped", "after", "expected"),
    [
        pytest.param(
            {"min_dwell_s": 1800, "daily_restart_budget": 4},
            True,
            600,
            86400,
            False,
            60,
            Reason.DWELL_TIME,
            id="forward a day 10 min after a restart: 30 min dwell still holds",
        ),
        pytest.param(
            {"min_dwell_s": 1800, "daily_restart_budget": 1},
            True,
            2400,
            86400,
            False,
            60,
            Reason.RESTART_BUDGET,
            id="forward a day 40 min after a restart: a budget of 1 is used up",
        ),
        pytest.param(
            {"min_dwell_s": 0, "stabilization_window_s": 1800},
            False,
            0,
            86400,
            False,
            300,
            Reason.STABILIZING,
            id="forward a day: wanted for 5 min of a 30 min stabilization window",
        ),
        pytest.param(
            {"min_dwell_s": 1800, "daily_restart_budget": 4},
            True,
            600,
            -3600,
            False,
            1860,
            Reason.CHANGE,
            id="back an hour: 41 min after a restart the 30 min dwell is over",
        ),
        pytest.param(
            {"min_dwell_s": 1800, "daily_restart_budget": 4},
            True,
            60,
            -86400,
            True,
            1860,
            Reason.CHANGE,
            id="back a day while specd was stopped: dwell counts from its start",
        ),
        pytest.param(
            {"min_dwell_s": 1800, "daily_restart_budget": 1},
            True,
            60,
            -86400,
            True,
            25 * 3600,
            Reason.CHANGE,
            id="back a day while specd was stopped: the budget frees a day after its start",
        ),
        # Further back than a day (an RTC that lost its battery, a box set right after a
        # year ahead): every saved time was dropped, and the restart with it.
        pytest.param(
            {"min_dwell_s": 0, "daily_restart_budget": 1},
            True,
            60,
            -3 * 86400,
            True,
            60,
            Reason.RESTART_BUDGET,
            id="back three days while specd was stopped: the restart still counts",
        ),
        pytest.param(
            {"min_dwell_s": 0, "daily_restart_budget": 1},
            True,
            60,
            -365 * 86400,
            True,
            60,
            Reason.RESTART_BUDGET,
            id="back a year while specd was stopped: the restart still counts",
        ),
    ],
)
def test_a_stepped_wall_clock_leaves_dwell_budget_and_stabilization_in_real_time(
    tmp_path: Path,
    settings: dict[str, Any],
    restart: bool,
    first_tick: float,
    step: float,
    stopped: bool,
    after: float,
    expected: Reason,
) -> None:
    """SGLang runs 4 steps, the traffic wants 3, a window is open all along. The wall clock
    is stepped (NTP, `date -s`) between two ticks, or while specd was stopped. Dwell, the
    daily budget and the stabilization window guard against restart loops in real time: a
    day's step forward used to be a new budget, a passed dwell and a held recommendation;
    one back, or a restart stamped a day ahead, held them up to two days."""
    cfg = config(tmp_path, windows=SIX_HOURS_DAILY, **settings)
    wall, mono = [STEP_T0], [1000.0]
    reader = LiveReader(wall, steps=4, offered=12)

    def start() -> Daemon:
        d = stepping(cfg, reader, wall, mono, RestartingApplier(reader))
        d.state.history = busy(cfg, wall[0], offered=12)  # the bands want 3 steps
        return d

    d = start()
    if restart:  # SGLang was restarted into 4 steps just now
        d.state.restarts.append({"t": STEP_T0, "from_steps": 3, "to_steps": 4})
    wall[0] += first_tick
    mono[0] += first_tick
    with capture_logs() as logged:
        if not stopped:
            d.tick()
            wall[0] += step  # the wall clock alone moves
        else:
            d.tick()
            d._save_state(force=True)
            wall[0] += step
            mono[0] = 50.0  # a new process: its own monotonic reading
            d = start()
            d.tick()  # at start
        wall[0] += after
        mono[0] += after
        decision = d.tick()
    assert decision.reason is expected, decision.message
    said = [e for e in logged if e["event"] in ("clock_stepped", "records_ahead_of_clock")]
    if stopped:
        assert [e["event"] for e in said] == ["records_ahead_of_clock"]
        assert said[0]["ahead_s"] == -step  # the last tick's recommendation, a day ahead
    else:
        assert [(e["event"], e["step_s"]) for e in said] == [("clock_stepped", step)]


def stepping(
    cfg: Config,
    reader: Reader,
    wall: list[float],
    mono: list[float],
    applier: Applier | None = None,
) -> Daemon:
    """A daemon on a wall clock the test steps and a boot clock that only moves forward."""
    return Daemon(
        cfg,
        registry=CollectorRegistry(),
        clock=lambda: wall[0],
        monotonic=lambda: mono[0],
        notifier=Notifier({}),
        reader=reader,
        applier=applier if applier is not None else Applier(),
    )


# 4 served 5 % less than 3 at one request; specd went back to 3.
AVOIDED_4 = outcome.Avoided(steps=4, t=0.0, mix=((1, 1.0),), shortfall_ratio=0.05, from_steps=3)
# A window open all day, every day: only the avoid list stands between 3 and 4.
ALL_DAY = [{"cron": "0 3 * * *", "duration_s": 86400, "timezone": "UTC"}]


@pytest.mark.parametrize(
    ("avoided_ago", "step", "stopped", "after", "expected"),
    [
        pytest.param(
            3600,
            86400,
            False,
            60,
            Reason.WITHIN_TOLERANCE,
            id="forward a day an hour after going back from 4: 4 stays avoided its 3 h",
        ),
        pytest.param(
            0,
            -43200,
            True,
            3 * 3600 + 60,
            Reason.CHANGE,
            id="back 12 h while specd was stopped: 4 is avoided 3 h from the start, no more",
        ),
    ],
)
def test_a_stepped_wall_clock_leaves_the_avoid_list_in_real_time(
    tmp_path: Path,
    avoided_ago: float,
    step: float,
    stopped: bool,
    after: float,
    expected: Reason,
) -> None:
    """SGLang runs 3, the bands want 4 at one request, but 4 regressed: it is avoided for
    `regression_avoid_s` (3 h). The avoid list kept its wall-clock time through a step: a
    day forward expired it at once and specd changed back to the setting it had found
    worse; an entry stamped 12 h ahead (stepped back while stopped) held 15 h."""
    cfg = config(tmp_path, windows=ALL_DAY, regression_avoid_s=3 * 3600)
    wall, mono = [IN_WINDOW], [1000.0]
    reader = LiveReader(wall, steps=3, offered=1)

    def start() -> Daemon:
        d = stepping(cfg, reader, wall, mono)
        d.state.history = busy(cfg, wall[0], offered=1)
        return d

    d = start()
    d.state.avoided = [replace(AVOIDED_4, t=wall[0] - avoided_ago)]
    assert d.tick().reason is Reason.WITHIN_TOLERANCE
    d._save_state(force=True)
    wall[0] += step
    if stopped:
        mono[0] = 50.0  # a new process: its own boot clock reading
        d = start()
        d.tick()
    wall[0] += after
    mono[0] += after
    decision = d.tick()
    assert decision.reason is expected, decision.message


def test_a_clock_step_mid_verification_still_finds_the_regression_and_goes_back(
    tmp_path: Path,
) -> None:
    """specd changed 3 → 4 yesterday; 4 served 5 % less. The wall clock is stepped a day
    forward before the next scrape: the outcome check lapsed at once (its end stayed on the
    old clock) and specd kept the regressed 4. Moved with the history it is subtracted
    from, it finds the regression and goes back."""
    cfg = config(tmp_path, scrape_interval_s=60)
    d, applier, _, clock = regressed(cfg, None)
    last = d.client.observe()
    assert isinstance(last, Observation)
    mono = [1000.0]
    d.monotonic = lambda: mono[0]
    clock[0] = last.t + 30
    after = replace(
        last,
        t=last.t + 60 + 86400,
        decode_tokens_total=(last.decode_tokens_total or 0) + 950.0 * 60,
        generation_tokens_total=(last.generation_tokens_total or 0) + 950.0 * 60,
    )
    d.client = Reader([ScrapeError("timeout", "no answer", clock[0]), after])
    assert d.tick().reason is Reason.NO_DATA  # the scrape fails: nothing decided yet
    clock[0], mono[0] = after.t, mono[0] + 30
    decision = d.tick()
    assert decision.reason is Reason.REGRESSION, decision.message
    assert applier.calls == [("3", "4")]


@pytest.mark.parametrize(
    ("step", "stopped"),
    [
        pytest.param(86400.0, False, id="forward a day"),
        pytest.param(-86400.0, False, id="back a day"),
        pytest.param(-43200.0, True, id="back 12 h while specd was stopped"),
    ],
)
def test_every_time_specd_keeps_moves_with_a_stepped_wall_clock(
    tmp_path: Path, step: float, stopped: bool
) -> None:
    """What specd counts from (a restart, the avoid list, the outcome check and its end, the
    history, SGLang's start, a freeze, a drain, an outage) stays as long ago as it was;
    stepped back while specd was stopped, a time ahead of the clock is taken as now."""
    cfg = config(tmp_path)
    t0 = IN_WINDOW
    wall, mono = [t0], [1000.0]
    reader = Reader([ScrapeError("refused", "connection refused", t0)])  # nothing new learned

    def start() -> Daemon:
        d = stepping(cfg, reader, wall, mono)
        if not stopped or d.state.history.last_t is None:
            d.state.history = busy(cfg, t0, offered=1)
        return d

    d = start()
    state = d.state
    state.history.mark_sglang_start(t0 - 600)
    state.sglang_started_at = t0 - 600
    state.restarts = [{"t": t0 - 600, "from_steps": 4, "to_steps": 3, "result": "success"}]
    state.avoided = [replace(AVOIDED_4, t=t0 - 3600)]
    state.verifying = outcome.ChangeSnapshot(t0 - 7200, 4, 3, until=t0 + 3600)
    state.frozen = {"since": t0 - 300, "reason": "the on-call froze it"}
    state.gateway = {"last_drain": {"t": t0 - 600, "result": "idle"}}
    learned = state.history.last_t
    d.tick()
    d._save_state(force=True)
    wall[0] += step + 5
    mono[0] += 5
    if stopped:
        mono[0] = 50.0
        d = start()
    d.tick()
    now, state = wall[0], d.state
    assert state.verifying is not None
    if stopped:
        # Nothing can have happened after now; the check lasts as long after the change as
        # it did (3 h), not also as long as it was ahead (its end kept, it lasted 15 h).
        assert (state.avoided[0].t, state.verifying.t) == (now, now)
        assert state.verifying.until == now + 3 * 3600
        assert state.history.last_t == now
        return
    assert state.frozen is not None
    assert state.gateway is not None
    moved = {  # what: (now, before the step)
        "restart": (state.restarts[0]["t"], t0 - 600),
        "avoided": (state.avoided[0].t, t0 - 3600),
        "change verified": (state.verifying.t, t0 - 7200),
        "verified until": (state.verifying.until, t0 + 3600),
        "history": (state.history.last_t, learned),
        "history's SGLang start": (state.history.sglang_started_at, t0 - 600),
        "SGLang start": (state.sglang_started_at, t0 - 600),
        "frozen": (state.frozen["since"], t0 - 300),
        "drain": (state.gateway["last_drain"]["t"], t0 - 600),
        "scrapes failing": (d._outage.since if d._outage else None, t0),
    }
    assert {what: now - before for what, (now, before) in moved.items()} == dict.fromkeys(
        moved, step
    )


@pytest.mark.parametrize(
    "booted_at",
    [
        pytest.param(IN_WINDOW - 365 * 86400, id="a year behind (RTC battery dead)"),
        pytest.param(30.0, id="at 1970 (no RTC)"),
    ],
)
def test_an_outcome_check_started_on_a_clock_behind_still_lasts_as_long(
    tmp_path: Path, booted_at: float
) -> None:
    """specd changed 3 → 4 ten minutes ago, to be checked for a day. The box reboots on a
    clock behind and specd starts before NTP sets it: the change was taken as made now,
    but the check's end stayed where it was, and the clock's step forward then moved it
    by the whole step: a one-day check lasted a year, and from 1970 ended past what the
    next start reads, which dropped it (and logged the state damaged)."""
    cfg = config(tmp_path)
    t0 = IN_WINDOW
    wall, mono = [t0], [1000.0]
    reader = Reader([ScrapeError("refused", "connection refused", t0)])
    d = stepping(cfg, reader, wall, mono)
    d.state.verifying = outcome.ChangeSnapshot(t0 - 600, 3, 4, until=t0 + 86400)
    d._save_state(force=True)
    wall[0], mono[0] = booted_at, 20.0  # the reboot
    d = stepping(cfg, reader, wall, mono)
    d.tick()
    wall[0], mono[0] = t0 + 600, mono[0] + 60  # NTP sets the clock
    d.tick()
    check = d.state.verifying
    assert check is not None
    assert check.until is not None
    assert check.until - check.t == 86400 + 600  # as long after the change as it was
    assert not check.lapsed(wall[0])
    d._save_state(force=True)
    mono[0] = 5.0  # specd restarted: it reads the check as it was saved
    again = stepping(cfg, reader, wall, mono)
    assert again.metrics.registry.get_sample_value("specd_state_load_errors_total") == 0
    assert again.state.verifying is not None
    assert again.state.verifying.until == check.until


@pytest.mark.parametrize(
    ("down_s", "stopped", "waited"),
    [
        pytest.param(7200, False, 1800, id="SGLang unobservable 2 h: the 30 min start over"),
        pytest.param(7200, True, 1800, id="specd stopped 2 h: the 30 min start over"),
        pytest.param(120, False, 1800 - 300 - 180, id="two scrapes failed: held across them"),
    ],
)
def test_a_recommendation_holds_only_while_sglang_is_observed(
    tmp_path: Path, down_s: float, stopped: bool, waited: float
) -> None:
    """SGLang runs 3, the bands want 4, and a change needs 30 min of wanting it. After 5 min
    of it SGLang cannot be scraped for 2 h (or specd is stopped): the gap counted as 2 h of
    holding, and specd restarted SGLang at the first scrape after it, on the 5 min of
    evidence from before. A gap of at most stale_after_s (3 min) is bridged."""
    cfg = config(
        tmp_path,
        windows=ALL_DAY,
        stabilization_window_s=1800,
        scrape_interval_s=60,
        stale_after_s=180,
    )
    wall, mono = [IN_WINDOW], [1000.0]
    live = LiveReader(wall, steps=3, offered=1)
    down = Reader([ScrapeError("refused", "connection refused", IN_WINDOW)])

    def start() -> Daemon:
        d = stepping(cfg, live, wall, mono)
        if d.state.history.last_t is None:  # what a restarted specd learned is its file's
            d.state.history = busy(cfg, wall[0], offered=1)
        return d

    def later(seconds: float) -> None:
        wall[0] += seconds
        mono[0] += seconds

    d = start()
    for _ in range(6):  # 0 to 5 min of wanting 4
        assert d.tick().reason is Reason.STABILIZING
        later(60)
    later(-60)
    if stopped:
        d._save_state(force=True)
        later(down_s + 60)
        mono[0] = 50.0
        d = start()
    else:
        d.client = down
        for _ in range(int(down_s // 60)):
            later(60)
            assert d.tick().reason is Reason.NO_DATA
        d.client = live
        later(60)
    back = wall[0]
    with capture_logs() as logged:
        while (decision := d.tick()).reason is Reason.STABILIZING:
            later(60)
    assert decision.reason is Reason.CHANGE, decision.message
    assert wall[0] - back == waited
    said = [e["unobserved_s"] for e in logged if e["event"] == "stabilization_restarted"]
    assert said == ([down_s + 60] if down_s > 180 else [])


@pytest.mark.parametrize(
    ("override", "in_force"),
    [
        ({"mode": "freeze"}, Reason.FROZEN),
        ({"mode": "pin", "steps": 3}, Reason.OVERRIDE_PIN),
    ],
)
def test_an_override_lapsed_by_a_clock_running_ahead_is_in_force_again_when_it_steps_back(
    tmp_path: Path, override: dict[str, Any], in_force: Reason
) -> None:
    """The clock ran 15 min ahead past the override's expiry, then NTP stepped it back: by
    the clock the file is in force again, and `specd status` and `specd override show` say
    so. The daemon had dropped it for good at the expiry and decided by itself (a change
    in the middle of an on-call freeze) until its own restart read the file again."""
    cfg = config(tmp_path, daily_restart_budget=10)
    wall = [IN_WINDOW]
    d = daemon(cfg, LiveReader(wall, steps=3, offered=1), Applier(), wall)  # bands want 4
    expires = datetime.fromtimestamp(IN_WINDOW + 600, tz=UTC)
    body = {**override, "expires_at": expires, "reason": "incident"}
    Path(cfg.files.override_file).write_text(tomli_w.dumps(body))
    os.chmod(cfg.files.override_file, 0o600)
    with capture_logs() as logged:
        assert d.tick().reason is in_force
        wall[0] = IN_WINDOW + 900  # running ahead: past the expiry
        assert d.tick().reason is Reason.CHANGE
        assert "mode auto" in d._status_text()
        wall[0] = IN_WINDOW + 300  # stepped back: five minutes before it
        assert d.tick().reason is in_force
        assert f"mode {override['mode']}" in d._status_text()
        wall[0] = IN_WINDOW + 700
        assert d.tick().reason is Reason.CHANGE
    events = [e["event"] for e in logged if e["event"].startswith("override_")]
    assert events == [
        "override_loaded",
        "override_expired",
        "override_in_force_again",
        "override_expired",
    ]


def test_a_reload_that_moves_the_state_dir_is_rejected_whole(tmp_path: Path) -> None:
    """Accepted, it was half applied: the daemon kept writing the old directory while
    `specd status`, `specd unfreeze` and the next start read the new, empty one."""
    cfg = config(tmp_path)
    d = daemon(cfg, Reader([obs(IN_WINDOW)]), Applier(), [IN_WINDOW])
    moved = {
        "state_dir": str(tmp_path / "elsewhere"),
        "override_file": str(tmp_path / "override.toml"),
        "env_file": str(tmp_path / "sglang.env"),
        "max_steps": 5,
    }
    d.config_path = tmp_path / "specd.toml"
    d.config_path.write_text(tomli_w.dumps(tables(**moved)))
    with capture_logs() as logged:
        d.reload()
    assert d.metrics.registry.get_sample_value("specd_config_reload_success") == 0
    assert d.config is cfg  # the running config, whole
    (rejected,) = [e for e in logged if e["event"] == "reload_rejected"]
    assert rejected["problem"].startswith(f"files.state_dir: {tmp_path / 'state'} → ")
    assert "needs a restart of specd" in rejected["problem"]


REFUSED = "GET /metrics: cannot connect to http://127.0.0.1:30000: [Errno 111] Connection refused"
STARTING = "GET /metrics: 503 Service Unavailable"
DOWN_HOUR = [(30.0 * i, "refused") for i in range(120)] + [(3600.0, None)]
FLAPPING = [
    (10.0 * i, e)
    for i, e in enumerate(["refused", "refused", "starting", "starting", "refused", "starting"])
] + [(60.0, None), (70.0, None)]
GARBAGE = [(10.0 * i, "garbage") for i in range(20)] + [(200.0, "refused"), (210.0, None)]


def scripted(
    tmp_path: Path, script: list[tuple[float, ScrapeError | None]]
) -> tuple[Daemon, list[Any]]:
    """A daemon ticking at IN_WINDOW + each time of ``script``, its scrape failing with the
    error given there or answering (steps 4) where None; it, and what it logged."""
    reader = Reader([obs(IN_WINDOW + t, steps=4) if e is None else e for t, e in script])
    clock = [IN_WINDOW]
    d = daemon(config(tmp_path), reader, Applier(), clock)
    with capture_logs() as captured:
        for t, _ in script:
            clock[0] = IN_WINDOW + t
            d.tick()
    return d, captured


def test_an_sglang_failing_every_other_scrape_is_said_as_rarely_as_a_long_outage(
    tmp_path: Path,
) -> None:
    """Each failure after a good scrape began a new outage, said from its start, and each
    good scrape ended one: an SGLang failing every other scrape (5 s apart) was a
    scrape_failed and a scrape_recovered line every 10 s, 17,000 of each a day. After
    FLAPPING_OUTAGES outages within SCRAPE_FAILED_RELOG_S the same one goes on, said every
    SCRAPE_FAILED_RELOG_S; a failure after a quiet spell is a new outage, said at once."""
    hour = [(5.0 * i, i % 2 == 0) for i in range(720)]  # fails at even ticks
    later = [(3600.0 + 600.0, False), (3600.0 + 605.0, True)]  # quiet 10 min, then one fails
    script = hour + later
    d, captured = scripted(
        tmp_path,
        [(t, ScrapeError("refused", REFUSED, 0.0) if fails else None) for t, fails in script],
    )
    said = [(e["event"], e["failing_s"]) for e in captured if e["event"].startswith("scrape_")]
    failed = [at for event, at in said if event == "scrape_failed"]
    recovered = [at for event, at in said if event == "scrape_recovered"]
    # The first outages said as before, then one line each every 5 minutes for the hour.
    assert len(failed) <= FLAPPING_OUTAGES + 3600 / SCRAPE_FAILED_RELOG_S + 1, said
    assert len(recovered) <= FLAPPING_OUTAGES + 3600 / SCRAPE_FAILED_RELOG_S + 1, said
    assert said[-1] == ("scrape_failed", 0.0), said  # after the quiet spell: a new one
    # Nor a decision line at each no_data and the way back (status.json shows each).
    decisions = [e for e in captured if e["event"] == "decision"]
    assert len(decisions) <= 2 * (FLAPPING_OUTAGES + 3600 / DECISION_RELOG_S + 2), decisions
    sample = d.metrics.registry.get_sample_value
    assert sample("specd_scrape_errors_total", {"kind": "refused"}) == 361  # each counted


@pytest.mark.parametrize(
    ("script", "logged"),
    [
        pytest.param(
            [(10.0 * i, "refused") for i in range(10)] + [(100.0, None)],
            [("scrape_failed", "refused", 0.0, 1), ("scrape_recovered", None, 100.0, 10)],
            id="a 100 s restart of SGLang: one line when it goes, one when it is back",
        ),
        pytest.param(
            DOWN_HOUR,
            [("scrape_failed", "refused", 300.0 * i, 10 * i + 1) for i in range(12)]
            + [("scrape_recovered", None, 3600.0, 120)],
            id="an hour down: a reminder every 5 minutes, with how long and how many",
        ),
        pytest.param(
            FLAPPING,
            [
                ("scrape_failed", "refused", 0.0, 1),
                ("scrape_failed", "http_status", 20.0, 3),  # a new failure: said at once
                ("scrape_recovered", None, 60.0, 6),  # one already said is not said again
            ],
            id="a new kind of failure is said at once, a failure already said is not",
        ),
        pytest.param(
            GARBAGE,
            [("scrape_failed", "malformed", 10.0 * i, i + 1) for i in range(8)]
            + [("scrape_failed", "refused", 200.0, 21), ("scrape_recovered", None, 210.0, 21)],
            id="a reason that changes every scrape: 8 lines, then a new kind only",
        ),
        pytest.param(
            [(0.0, "refused"), (10.0, "refused"), (-3590.0, "refused"), (-3580.0, "refused")],
            [("scrape_failed", "refused", 0.0, 1), ("scrape_failed", "refused", 0.0, 3)],
            id="the clock stepped back an hour: said again",
        ),
        pytest.param(
            [(0.0, None), (10.0, "refused"), (20.0, None), (30.0, "refused"), (40.0, "refused")],
            [
                ("scrape_failed", "refused", 0.0, 1),
                ("scrape_recovered", None, 10.0, 1),
                ("scrape_failed", "refused", 0.0, 1),  # a new outage is said from its start
            ],
            id="each outage is said from its start",
        ),
    ],
)
def test_an_sglang_outage_is_logged_when_it_starts_changes_lasts_and_ends(
    tmp_path: Path,
    script: list[tuple[float, str | None]],
    logged: list[tuple[str, str | None, float, int]],
) -> None:
    """Every failed scrape was a warning: an hour-long outage, scraped every 10 s, was 360
    identical lines in the journal. The metrics still count every scrape."""
    errors = {
        "refused": lambda _: ScrapeError("refused", REFUSED, 0.0),
        "starting": lambda _: ScrapeError("http_status", STARTING, 0.0),
        "garbage": lambda i: ScrapeError("malformed", f"GET /metrics: x is -{i}", 0.0),
    }
    d, captured = scripted(
        tmp_path, [(t, None if e is None else errors[e](i)) for i, (t, e) in enumerate(script)]
    )
    said = [
        (e["event"], e.get("kind"), e.get("failing_s"), e.get("failures"))
        for e in captured
        if e["event"] in ("scrape_failed", "scrape_recovered")
    ]
    assert said == logged
    failed = [e for e in captured if e["event"] == "scrape_failed"]
    assert all(e["log_level"] == "warning" and e["reason"] for e in failed)
    assert all(e["log_level"] == "info" for e in captured if e["event"] == "scrape_recovered")
    sample = d.metrics.registry.get_sample_value
    counted = {kind: sample("specd_scrape_errors_total", {"kind": kind}) or 0.0 for kind in
               ("refused", "http_status", "malformed")}  # fmt: skip
    assert counted == {
        "refused": sum(e == "refused" for _, e in script),
        "http_status": sum(e == "starting" for _, e in script),
        "malformed": sum(e == "garbage" for _, e in script),
    }
    assert sample("specd_sglang_up") == (1 if script[-1][1] is None else 0)


@pytest.mark.parametrize(
    ("override", "reloaded", "said"),
    [
        pytest.param({"mode": "pin", "steps": 4}, {}, [], id="the same file and config"),
        pytest.param({"mode": "pin", "steps": 4}, {"max_steps": 5}, [], id="bounds it fits"),
        pytest.param(
            {"mode": "pin", "steps": 2},
            {"min_steps": 3},
            ["override_ignored", "override_dropped"],  # not clamped to 3: no longer in force
            id="now outside",
        ),
        pytest.param(
            {"mode": "pin", "steps": 7}, {"max_steps": 7}, ["override_loaded"], id="now inside"
        ),
        pytest.param(
            {"mode": "pin", "steps": 9}, {"max_steps": 7}, ["override_ignored"], id="new problem"
        ),
        pytest.param(
            {"mode": "pin", "steps": 4, "colour": "red"}, {"max_steps": 5}, [], id="same problem"
        ),
        pytest.param({"mode": "freeze", "expires_in_s": -10}, {}, [], id="expired"),
    ],
)
def test_a_reload_says_what_it_changed_in_the_override_and_nothing_else(
    tmp_path: Path, override: dict[str, Any], reloaded: dict[str, Any], said: list[str]
) -> None:
    """A reload re-judges the untouched override file under the new bounds; it said
    `override_loaded` (or `override_expired`) again though nothing about it changed."""
    cfg = config(tmp_path)
    clock = [IN_WINDOW]
    d = daemon(cfg, Reader([obs(IN_WINDOW, steps=4)]), Applier(), clock)
    expires = datetime.fromtimestamp(IN_WINDOW + override.pop("expires_in_s", 3600), tz=UTC)
    Path(cfg.files.override_file).write_text(
        tomli_w.dumps({**override, "expires_at": expires, "reason": "incident"})
    )
    os.chmod(cfg.files.override_file, 0o600)
    d.tick()
    fields = {
        "state_dir": str(cfg.files.state_dir),
        "override_file": str(cfg.files.override_file),
        "env_file": str(cfg.sglang.env_file),
        "min_history_s": 600,
        "stabilization_window_s": 0,
        "min_dwell_s": 0,
        "warmup_exclude_s": 0,
        **reloaded,
    }
    d.config_path = tmp_path / "specd.toml"
    d.config_path.write_text(tomli_w.dumps(tables(**fields)))
    with capture_logs() as logged:
        d.reload()
        for _ in range(2):
            clock[0] += 10
            d.tick()
    assert d.metrics.registry.get_sample_value("specd_config_reload_success") == 1
    assert [e["event"] for e in logged if e["event"].startswith("override_")] == said


@pytest.mark.parametrize(
    "broken",
    [
        "removed",
        "truncated",  # a `cp` caught half way: the header only
        "garbage",
        "impossible",  # an accept length no server measures
    ],
)
def test_a_calibration_broken_under_the_daemon_keeps_the_last_good_one(
    tmp_path: Path, broken: str
) -> None:
    # Outside the window: each tick says what it would change to, and changes nothing.
    # Without a calibration specd would decide on the bands (3 for 48 requests) and go on to
    # explore from them: a broken file must not undo what the good one said (off).
    calibration = tmp_path / "cal.csv"
    shutil.copy(REPO / "bench" / "truth" / "heavyoff-calibration.csv", calibration)
    good = calibration.read_bytes()
    cfg = config(tmp_path, policy="model", calibration_file=str(calibration), scrape_interval_s=60)
    history = History(HistorySettings.from_config(cfg))
    outside = IN_WINDOW + 3 * 3600
    last = serve(history, 3, outside - 6 * 3600, outside, 48, 730.0)
    clock = [last.t]
    applier = Applier()
    fresh = [replace(last, t=last.t + 60 * i) for i in range(5)]
    d = daemon(cfg, Reader(fresh), applier, clock)
    d.state.history = history
    with capture_logs() as logged:
        first = d.tick()
        assert first.target_name == "off", first.message
        if broken == "removed":
            calibration.unlink()
        elif broken == "truncated":
            calibration.write_bytes(good[: good.index(b"\n") + 1])
        elif broken == "garbage":
            calibration.write_bytes(b"\x00\xff" * 5000)
        else:
            calibration.write_bytes(good + b"1,1,100,50\n")
        for _ in range(3):
            clock[0] += 60
            kept = d.tick()
            assert kept.target_name == "off", kept.message
            assert "calibration unusable, the last good one kept: " in kept.message
        calibration.write_bytes(good)
        clock[0] += 60
        again = d.tick()
    assert again.target_name == "off"
    assert "calibration unusable" not in again.message
    assert applier.calls == []
    said = [(e["event"], e.get("kept")) for e in logged if e["event"].startswith("calibration_")]
    assert said == [
        ("calibration_unusable", "the last good calibration"),
        ("calibration_usable", None),
    ]


# -- a state.json damaged by hand -------------------------------------------------------


def _damaged(part: str, value: Callable[[float], Any]) -> Callable[[dict[str, Any], float], None]:
    def damage(data: dict[str, Any], t: float) -> None:
        data[part] = value(t)

    return damage


def _learned(damage: Callable[[dict[str, Any]], object]) -> Callable[[dict[str, Any], float], None]:
    def learned(data: dict[str, Any], t: float) -> None:
        damage(data["history"])

    return learned


# Each a state.json that is still JSON (NaN and Infinity included: Python reads them), with
# one part no specd wrote. The daemon starts, leaves that part out with one line, decides
# on the rest, restarts nothing, and saves.
DAMAGED_STATE = [
    # A freeze whose reason is no text crashed every tick.
    pytest.param(_damaged("frozen", lambda t: {"since": t, "reason": 5}), "frozen", id="freeze-5"),
    pytest.param(
        _damaged("frozen", lambda t: {"since": t, "reason": math.nan}), "frozen", id="freeze-nan"
    ),
    # A time no clock shows crashed every tick (datetime overflow) under the model policy.
    pytest.param(
        _damaged("explorations", lambda t: [[1e308, 4]]), "explorations[0]", id="explored-1e308"
    ),
    pytest.param(
        _damaged("explorations", lambda t: [[-1e308, 4]]), "explorations[0]", id="explored-1e-308"
    ),
    pytest.param(
        _damaged(
            "verifying",
            lambda t: {
                "t": 1e308,
                "from_steps": 3,
                "to_steps": 4,
                "cells": {"ref_t": t, "cells": []},
                "until": None,
            },
        ),
        "verifying",
        id="verifying-1e308",
    ),
    # A NaN kept made every later save fail: nothing learned after reached disk.
    pytest.param(
        _damaged(
            "restarts", lambda t: [{"t": t - 86400, "result": "success", "duration_s": math.nan}]
        ),
        "restarts[0].duration_s",
        id="restart-duration-nan",
    ),
    pytest.param(
        _damaged("gateway", lambda t: {"probe": {"t": t, "problem": math.inf}}),
        "gateway.probe.problem",
        id="gateway-infinity",
    ),
    # A weight no time that passed holds: 3 steps "measured" at 1000 tok/s for 1e9 s made
    # the model change to 3 and restart; 1e12 s at 64 requests in every hour seen made the
    # coming epoch heavy, and it explored (restarted) twice.
    pytest.param(
        _learned(lambda h: h["throughput"]["cells"].append([[3, 2], 1e9, 1e12])),
        "history.throughput[1]: 1e+09 s of weight",
        id="throughput-1e9-s",
    ),
    pytest.param(
        _learned(
            lambda h: [hour["cells"].append([64, 1e12]) for hour in h["hourly"] if hour is not None]
        ),
        "s of weight is more time than it can hold",
        id="hours-1e12-s",
    ),
]


@pytest.mark.parametrize(("damage", "named"), DAMAGED_STATE)
def test_a_damaged_state_file_costs_its_bad_part_only(
    tmp_path: Path, damage: Callable[[dict[str, Any], float], None], named: str
) -> None:
    # The model policy on the seed's calibration, 4 steps live and best for 2 requests.
    calibration = REPO / "bench" / "truth" / "seed-calibration.csv"
    cfg = config(
        tmp_path,
        policy="model",
        calibration_file=str(calibration),
        scrape_interval_s=60,
        kinds=["static"],
    )
    history = History(HistorySettings.from_config(cfg))
    last = serve(history, 4, IN_WINDOW - 3 * 86400, IN_WINDOW, 2, 400.0)
    data = State(history=history).to_dict()
    damage(data, last.t)
    path = Path(cfg.files.state_dir) / STATE_FILE
    path.write_text(json.dumps(data))
    clock = [last.t]
    served = last.decode_tokens_total or 0.0
    fresh = [
        replace(last, t=last.t + 60 * i, decode_tokens_total=served + 400.0 * 60 * i)
        for i in range(1, 4)
    ]
    applier = Applier()
    with capture_logs() as logged:
        d = Daemon(
            cfg,
            registry=CollectorRegistry(),
            clock=lambda: clock[0],
            notifier=Notifier({}),
            reader=Reader(fresh),
            applier=applier,
        )
        for _ in fresh:
            clock[0] += 60
            d.tick()
        d._save_state(force=True)
    problems = [e["problem"] for e in logged if e["event"] == "state_load_failed"]
    assert len(problems) == 1
    assert named in problems[0]
    assert [e for e in logged if e["event"] == "state_write_failed"] == []
    assert applier.calls == []
    # What was learned is kept, and the file it saves is one the next start reads whole.
    assert d.state.history.busy_seconds == pytest.approx(history.busy_seconds, rel=0.01)
    assert StateStore(Path(cfg.files.state_dir), clock=lambda: clock[0]).load()[1] is None


# ---- what specd exports before its first tick ----------------------------------------


class HeldReader(Reader):
    """SGLang that does not answer until released: the first tick waits in its scrape."""

    def __init__(self, entered: threading.Event, release: threading.Event) -> None:
        super().__init__([ScrapeError("timeout", "no answer", IN_WINDOW)])
        self.entered, self.release = entered, release

    def observe(self) -> Observation | ScrapeError:
        self.entered.set()
        self.release.wait(30)
        return super().observe()


class HeldApplier(Applier):
    """A restart journal whose resumption (waiting for SGLang to load) lasts until released."""

    def __init__(self, entered: threading.Event, release: threading.Event) -> None:
        super().__init__()
        self.entered, self.release = entered, release

    def reconcile(self, journal_data: Any) -> ApplyOutcome | None:
        if journal_data is None:
            return None
        self.entered.set()
        self.release.wait(30)
        return None


def _frozen(state: State, _cfg: Config) -> None:
    state.frozen = {"since": IN_WINDOW - 300, "reason": "restart to 4 rolled_back: OOM"}
    rollback = {"t": IN_WINDOW - 600, "from_steps": 3, "to_steps": 4, "result": "rolled_back"}
    state.restarts = [rollback]


def _pinned(state: State, cfg: Config) -> None:
    expires = datetime.fromtimestamp(IN_WINDOW + 7200, tz=UTC)
    pin = {"mode": "pin", "steps": 4, "expires_at": expires, "reason": "incident 42"}
    Path(cfg.files.override_file).write_text(tomli_w.dumps(pin))
    os.chmod(cfg.files.override_file, 0o644)


def _frozen_pinned(state: State, cfg: Config) -> None:
    """A pin whose restart failed: the freeze wins over the pin the file still holds."""
    _frozen(state, cfg)
    _pinned(state, cfg)


def _mid_restart(state: State, _cfg: Config) -> None:
    state.journal = {"phase": "restart_issued", "from_steps": 3, "to_steps": 4}


@pytest.mark.parametrize(
    ("setup", "expected"),
    [
        pytest.param(
            _frozen,
            {
                ("specd_frozen", ()): 1.0,
                ("specd_mode", (("mode", "freeze"),)): 1.0,
                ("specd_mode", (("mode", "auto"),)): 0.0,
                ("specd_restart_budget_remaining", ()): 3.0,
                ("specd_restart_budget", ()): 4.0,  # the config's; 3 left after a rollback
                # Each start is one (SpecdRestartingOften counts the changes).
                ("specd_start_time_seconds", ()): IN_WINDOW,
            },
            id="frozen",
        ),
        pytest.param(
            _pinned,
            {
                ("specd_mode", (("mode", "pin"),)): 1.0,
                ("specd_override_info", (("mode", "pin"), ("reason", "incident 42"))): 1.0,
                ("specd_override_present", ()): 1.0,
                ("specd_frozen", ()): 0.0,
            },
            id="pinned",
        ),
        pytest.param(
            _frozen_pinned,
            {
                ("specd_frozen", ()): 1.0,
                ("specd_mode", (("mode", "freeze"),)): 1.0,
                ("specd_mode", (("mode", "pin"),)): 0.0,
                # The file's override is still shown for what it is.
                ("specd_override_info", (("mode", "pin"), ("reason", "incident 42"))): 1.0,
            },
            id="frozen with a pin in the file",
        ),
        pytest.param(
            _mid_restart,
            # SGLangDown keeps quiet on the second: the journal says SGLang was restarted.
            {("specd_restart_in_progress", ()): 1.0, ("specd_sglang_restarting", ()): 1.0},
            id="resuming an interrupted restart",
        ),
    ],
)
def test_first_metrics_page_tells_the_saved_state(
    tmp_path: Path,
    setup: Callable[[State, Config], None],
    expected: dict[tuple[str, tuple[tuple[str, str], ...]], float],
) -> None:
    """A restarted specd serves /metrics before its first tick ends (that tick may wait a
    whole scrape timeout for SGLang; resuming an interrupted restart may wait minutes for
    SGLang to load). Prometheus scraping it then must read what the saved state says: a
    specd_frozen 0 there resolved SpecdFrozen and paged again a tick later, an override
    pin read as auto reset SpecdOverrideActiveTooLong's day, and a resumed restart read
    as none let SGLangDown page for the load specd was waiting for."""
    cfg = config(tmp_path, metrics_listen_address="127.0.0.1", metrics_port=0)
    clock = [IN_WINDOW]
    first = daemon(cfg, Reader([obs(IN_WINDOW)]), Applier(), clock)
    setup(first.state, cfg)
    first._save_state(force=True)

    entered, release = threading.Event(), threading.Event()
    d = Daemon(
        cfg,
        registry=CollectorRegistry(),
        clock=lambda: clock[0],
        notifier=Notifier({}),
        reader=HeldReader(entered, release),
        applier=HeldApplier(entered, release),
    )
    runner = threading.Thread(target=d.run, daemon=True)
    runner.start()
    try:
        assert entered.wait(10), "specd never reached its first scrape or the journal"
        assert d.metrics_port is not None
        page = httpx.get(f"http://127.0.0.1:{d.metrics_port}/metrics", timeout=5).text
    finally:
        release.set()
        d.request_stop()
        runner.join(10)
    assert not runner.is_alive()
    served = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(page)
        for s in family.samples
    }
    assert {key: served.get(key) for key in expected} == expected


def test_a_reload_that_removes_the_gateway_clears_its_not_ready_count(tmp_path: Path) -> None:
    """specd_gateway_worker_not_ready_replicas is what the latest probe found. A reload that
    removed [gateway] (say, the on-call gave up on a broken one) stopped the probes but left
    the last count: SpecdWorkerLeftOutOfGateway paged on for a gateway specd no longer has."""

    class ListsAnotherWorker(QuietHandler):
        def do_GET(self) -> None:
            worker = {"id": "w-9", "url": "http://10.0.0.9:30000", "status": "ready"}
            self.send_body(200, json.dumps({"workers": [worker]}).encode(), "application/json")

    fields = {
        "state_dir": str(tmp_path / "state"),
        "override_file": str(tmp_path / "override.toml"),
        "env_file": str(tmp_path / "sglang.env"),
    }
    with LoopbackHTTP(ListsAnotherWorker) as gateway:
        cfg = config(tmp_path, urls=[gateway.url], worker_url="http://127.0.0.1:30000")
        clock = [IN_WINDOW]
        d = daemon(cfg, Reader([obs(IN_WINDOW, steps=3)]), Applier(), clock)
        d.tick()
    sample = d.metrics.registry.get_sample_value
    assert sample("specd_gateway_worker_not_ready_replicas") == 1
    d.config_path = tmp_path / "specd.toml"
    d.config_path.write_text(tomli_w.dumps(tables(**fields)))
    d.reload()
    assert sample("specd_config_reload_success") == 1
    assert d.gateway is None
    clock[0] += 5
    d.tick()
    value = sample("specd_gateway_worker_not_ready_replicas")
    assert value is not None
    assert math.isnan(value)


def test_a_reload_closes_the_gateway_client_of_the_applier_it_replaces(tmp_path: Path) -> None:
    """Each reload that built a new applier left the old one's gateway client (its HTTP
    connection pool) open, reload after reload."""
    worker = "http://127.0.0.1:30000"
    cfg = config(tmp_path, urls=["http://127.0.0.1:9"], worker_url=worker)
    d = Daemon(
        cfg,
        registry=CollectorRegistry(),
        clock=lambda: IN_WINDOW,
        notifier=Notifier({}),
    )
    replaced = []
    for port in (10, 11, 12):
        before = d.applier
        assert isinstance(before, RealApplier)
        assert before.gateway is not None
        d.config_path = tmp_path / "specd.toml"
        urls = [f"http://127.0.0.1:{port}"]
        d.config_path.write_text(tomli_w.dumps(_own_files(tmp_path, urls=urls, worker_url=worker)))
        d.reload()
        assert d.metrics.registry.get_sample_value("specd_config_reload_success") == 1
        assert d.applier is not before
        replaced.append(before.gateway)
    assert all(gateway._http.is_closed for gateway in replaced)
    d.client.close()


def test_a_reload_keeping_the_gateway_does_not_say_its_outage_again(tmp_path: Path) -> None:
    """Every reload built the gateway watch anew: an outage was logged again after each
    one (and probed again at once), as if it had just begun."""
    with LoopbackHTTP(QuietHandler) as gateway:  # 501 to every GET: unusable
        fields = {
            "state_dir": str(tmp_path / "state"),
            "override_file": str(tmp_path / "override.toml"),
            "env_file": str(tmp_path / "sglang.env"),
            "urls": [gateway.url],
            "worker_url": "http://127.0.0.1:30000",
        }
        cfg = config(tmp_path, urls=[gateway.url], worker_url="http://127.0.0.1:30000")
        clock = [IN_WINDOW]
        d = daemon(cfg, Reader([obs(IN_WINDOW, steps=3)] * 8), Applier(), clock)
        d.config_path = tmp_path / "specd.toml"
        d.config_path.write_text(tomli_w.dumps(tables(**fields, max_steps=5)))
        with capture_logs() as logged:
            for _ in range(3):
                d.tick()
                clock[0] += 5
                d.reload()
            d.tick()
    said = [e for e in logged if e["event"] == "gateway_unavailable"]
    assert len(said) == 1, said


DECIDED = IN_WINDOW - 3 * 86400  # three days before "now"


def _override_text(
    header_at: str | None, steps: int = 3, expires: float = IN_WINDOW + 7 * 86400
) -> str:
    body = {
        "mode": "pin",
        "steps": steps,
        "expires_at": datetime.fromtimestamp(expires, tz=UTC),
        "reason": "incident 42",
    }
    header = (
        f"# written by `specd override pin` as alice (sudo) at {header_at}\n"
        if header_at is not None
        else ""
    )
    return header + tomli_w.dumps(body)


def _write_override(cfg: Config, text: str, mtime: float) -> None:
    path = Path(cfg.files.override_file)
    path.write_text(text)
    os.chmod(path, 0o600)
    os.utime(path, (mtime, mtime))


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, tz=UTC).isoformat()


@pytest.mark.parametrize(
    ("header_at", "mtime", "since"),
    [
        # `specd override` wrote it; the reason was reworded by hand a day later: the same
        # decision.
        (_iso(DECIDED), DECIDED + 86400, DECIDED),
        # Written by hand: its mtime.
        (None, DECIDED + 60, DECIDED + 60),
        # A header claiming a time after the file was written is not believed.
        (_iso(IN_WINDOW + 3600), DECIDED, DECIDED),
        # Not a time: the mtime.
        ("yesterday", DECIDED, DECIDED),
    ],
    ids=["header", "hand-written", "header-in-the-future", "header-unreadable"],
)
def test_the_override_in_force_exports_since_when_from_its_file(
    tmp_path: Path, header_at: str | None, mtime: float, since: float
) -> None:
    """SpecdOverrideActiveTooLong reads this time: its `for: 1d` over specd_override_info
    started over at every failed scrape and in practice never fired."""
    cfg = config(tmp_path)
    _write_override(cfg, _override_text(header_at), mtime)
    d = daemon(cfg, Reader([obs(IN_WINDOW)]), Applier(), [IN_WINDOW])
    assert d.tick().reason is Reason.OVERRIDE_PIN
    assert d.metrics.registry.get_sample_value("specd_override_since_timestamp_seconds") == since


def test_the_override_time_survives_a_restart_follows_a_repin_and_goes_with_the_override(
    tmp_path: Path,
) -> None:
    cfg = config(tmp_path)
    clock = [IN_WINDOW]

    def since(d: Daemon) -> float | None:
        value: float | None = d.metrics.registry.get_sample_value(
            "specd_override_since_timestamp_seconds"
        )
        return value

    d = daemon(cfg, Reader([obs(IN_WINDOW, steps=3)]), Applier(), clock)
    d.tick()
    nan = since(d)
    assert nan is not None
    assert math.isnan(nan)

    _write_override(cfg, _override_text(_iso(DECIDED)), DECIDED)
    assert d.tick().reason is Reason.OVERRIDE_PIN
    assert since(d) == DECIDED

    # specd restarted (an upgrade) a day later: the time comes back from the file.
    clock[0] += 86400
    restarted = daemon(cfg, Reader([obs(clock[0], steps=3)]), Applier(), clock)
    restarted.tick()
    assert since(restarted) == DECIDED

    # Pinned again with `specd override pin` (a fresh decision): its new time.
    repinned = clock[0] - 60
    _write_override(cfg, _override_text(_iso(repinned), steps=4), repinned)
    assert restarted.tick().reason is Reason.OVERRIDE_PIN
    assert since(restarted) == repinned

    # A bad edit is ignored: the last good pin holds, and so does its time.
    _write_override(cfg, _override_text(_iso(clock[0]), steps=99), clock[0])
    clock[0] += 10
    assert restarted.tick().reason is Reason.OVERRIDE_PIN
    assert since(restarted) == repinned

    # Expired: no longer in force, NaN (SpecdOverrideExpiredInFile's case now).
    clock[0] = IN_WINDOW + 8 * 86400
    restarted.tick()
    expired = since(restarted)
    assert expired is not None
    assert math.isnan(expired)

    # Cleared (file deleted): NaN.
    pinned = clock[0]
    _write_override(cfg, _override_text(_iso(pinned), expires=pinned + 86400), pinned)
    clock[0] += 10
    restarted.tick()
    assert since(restarted) == pinned
    Path(cfg.files.override_file).unlink()
    clock[0] += 10
    restarted.tick()
    cleared = since(restarted)
    assert cleared is not None
    assert math.isnan(cleared)
    assert restarted.metrics.registry.get_sample_value("specd_mode", {"mode": "auto"}) == 1


class FailingFirst(Reader):
    """Ticks that raise (a bug, or input no code of specd's handles) ``failures`` times, then
    SGLang as usual; stops the daemon after ``ticks`` observations in all."""

    def __init__(self, t: float, failures: int, ticks: int) -> None:
        super().__init__([obs(t, steps=3)])
        self.failures, self.ticks, self.calls = failures, ticks, 0
        self.stop: threading.Event | None = None

    def observe(self) -> Observation | ScrapeError:
        self.calls += 1
        if self.calls >= self.ticks and self.stop is not None:
            self.stop.set()
        if self.calls <= self.failures:
            raise RuntimeError(f"unexpected input #{self.calls}")
        return super().observe()


def test_a_tick_that_raises_is_logged_counted_and_backed_off_and_the_loop_goes_on(
    tmp_path: Path,
) -> None:
    """It ended the daemon (exit 1): systemd restarted it into the same input until its
    start limit left the box untuned, with no line saying which tick failed how."""
    usual = config(tmp_path, metrics_listen_address="127.0.0.1", metrics_port=0)
    fast = usual.observe.model_copy(update={"scrape_interval_s": 0.05})
    clock = [IN_WINDOW]
    reader = FailingFirst(IN_WINDOW, failures=3, ticks=5)
    applier = Applier()
    d = daemon(usual.model_copy(update={"observe": fast}), reader, applier, clock)
    d.state.history = busy(usual, clock[0], offered=1)  # as learned at the usual interval
    reader.stop = d.stop_event
    started = time.monotonic()
    with capture_logs() as logs:
        assert d.run() == 0
    took = time.monotonic() - started
    failed = [e for e in logs if e["event"] == "tick_failed"]
    assert [e["failures_in_a_row"] for e in failed] == [1, 2, 3]
    assert [e["next_tick_in_s"] for e in failed] == [0.1, 0.2, 0.4]  # doubling
    assert failed[0]["error"] == "RuntimeError: unexpected input #1"
    assert failed[0]["exc_info"] is True  # the traceback goes to the journal
    assert took >= 0.7  # it waited out each backoff
    assert d.metrics.registry.get_sample_value("specd_tick_errors_total") == 3
    # The ticks after decide as ever: the bands' change is made (the script's SGLang stays
    # on 3, so the next tick asks again).
    assert applier.calls[0] == ("4", "3")


def test_a_tick_that_raises_with_a_restart_in_flight_ends_the_run(tmp_path: Path) -> None:
    """The next start's reconcile finishes a restart whose journal is kept: going on past
    the error would leave it unfinished until then."""
    cfg = config(tmp_path, metrics_listen_address="127.0.0.1", metrics_port=0)
    clock = [IN_WINDOW]
    d = daemon(cfg, FailingFirst(IN_WINDOW, failures=1, ticks=99), Applier(), clock)
    d.state.journal = {"phase": "restart_issued", "from_setting": "3", "to_setting": "4"}
    d._reconcile_journal = lambda: None  # type: ignore[method-assign]  # the journal stays
    with pytest.raises(RuntimeError, match="unexpected input #1"):
        d.run()


def test_the_decision_that_acts_is_saved_before_the_sequence_waits(tmp_path: Path) -> None:
    """The waits for a fleet slot and a quiet moment come before the restart's journal and
    save nothing: state.json kept the decision before them, so `specd status` could not
    tell a change waiting for a quiet moment from writes failing."""
    cfg = config(tmp_path)
    seen: list[dict[str, Any]] = []

    class Looking(Applier):
        def apply_setting(self, *args: Any, **kwargs: Any) -> ApplyOutcome:
            seen.append(saved(cfg)["last_decision"])
            return super().apply_setting(*args, **kwargs)

    d = daemon(cfg, Reader([obs(IN_WINDOW, steps=3)]), Looking(), [IN_WINDOW])
    assert d.tick().reason is Reason.CHANGE
    ((decision),) = seen
    assert (decision["reason"], decision["acts"], decision["t"]) == ("change", True, IN_WINDOW)


@pytest.mark.parametrize(
    ("result", "restarts", "verifying"),
    [
        ("success", 1, True),
        # SGLang is back on 3: nothing of 4 runs to verify (`specd status` said "verifying
        # 3 → 4 … goes back if it serves less" beside FROZEN).
        ("rolled_back", 2, False),
        ("failed", 2, False),
        ("aborted", 1, False),
    ],
)
def test_only_a_change_that_went_live_is_verified(
    tmp_path: Path, result: str, restarts: int, verifying: bool
) -> None:
    class Ending(Applier):
        def apply_setting(self, *args: Any, **kwargs: Any) -> ApplyOutcome:
            done = super().apply_setting(*args, **kwargs)
            return replace(done, result=result, restarts_issued=restarts)

    cfg = config(tmp_path)
    d = daemon(cfg, Reader([obs(IN_WINDOW, steps=3)]), Ending(), [IN_WINDOW])
    assert d.tick().reason is Reason.CHANGE
    assert (d.state.verifying is not None) is verifying
    shown = collect(cfg, IN_WINDOW + 5, "down")
    assert (shown["verifying"] is not None) is verifying


@pytest.mark.parametrize(
    ("phase", "restarting"),
    [
        # The sequence waits, SGLang serving: a crash now is no restart of specd's.
        ("planned", 0.0),
        ("draining", 0.0),
        ("env_written", 0.0),
        # specd restarted it (or rolls back): down on purpose.
        ("restart_issued", 1.0),
        ("verifying", 1.0),
        ("rolling_back", 1.0),
        ("done", 0.0),
        ("rolled_back", 0.0),
        (None, 0.0),
    ],
)
def test_sglang_restarting_follows_the_journal_phase(
    tmp_path: Path, phase: str | None, restarting: float
) -> None:
    """specd_restart_in_progress covers the whole sequence, its waits for a fleet slot (30
    minutes) and a quiet moment (10) included: SGLangDown, masked by it, kept quiet for a
    SGLang that crashed while specd only waited."""
    cfg = config(tmp_path)
    d = daemon(cfg, Reader([obs(IN_WINDOW)]), Applier(), [IN_WINDOW])
    d.metrics.sglang_restarting.set(1)
    journal = None if phase is None else {"phase": phase, "from_setting": "3", "to_setting": "4"}
    d._persist_journal(journal)
    assert d.metrics.registry.get_sample_value("specd_sglang_restarting") == restarting


@pytest.mark.parametrize(
    ("at", "forced", "replay", "counted"),
    [
        (IN_WINDOW, False, False, 0),
        # The window closed before the restart went out: the promise broken, a bug.
        (WINDOW_CLOSES + 60, False, False, 1),
        # A pin applied now needs no window; a run finishing what an earlier run left
        # finishes it whenever it starts.
        (WINDOW_CLOSES + 60, True, False, 0),
        (WINDOW_CLOSES + 60, False, True, 0),
    ],
)
def test_a_change_restarted_outside_a_window_is_counted_and_logged(
    tmp_path: Path, at: float, forced: bool, replay: bool, counted: int
) -> None:
    cfg = config(tmp_path)
    clock = [IN_WINDOW]
    d = daemon(cfg, Reader([obs(IN_WINDOW)]), Applier(), clock)
    d._in_flight = InFlight("3", "4", replay=replay, forced=forced)
    journal = {"phase": "planned", "from_setting": "3", "to_setting": "4"}
    with capture_logs() as logs:
        d._persist_journal(journal)
        clock[0] = at
        d._persist_journal({**journal, "phase": "restart_issued"})
        d._persist_journal({**journal, "phase": "verifying"})  # no second count
    sample = d.metrics.registry.get_sample_value("specd_restarts_outside_window_total")
    assert sample == counted
    assert len([e for e in logs if e["event"] == "restart_outside_window"]) == counted


def test_a_reload_applies_the_log_format_and_the_band_boundary(tmp_path: Path) -> None:
    """Both were read once at start: a reload listed them as changed ("reloaded") and kept
    JSON lines, and the band-boundary gauge (the Grafana panel an operator moving a band
    watches) at the old boundary."""
    import structlog  # noqa: PLC0415 - its config is what a reload changes here

    cfg = config(tmp_path)
    d = daemon(cfg, Reader([obs(IN_WINDOW)]), Applier(), [IN_WINDOW])
    d.config_path = tmp_path / "specd.toml"
    before = structlog.get_config()
    try:
        logs.configure("json")
        new = tables(
            state_dir=str(tmp_path / "state"),
            override_file=str(tmp_path / "override.toml"),
            env_file=str(tmp_path / "sglang.env"),
            log_format="console",
            bands=[{"max_concurrency": 16, "steps": 4}, {"steps": 3}],
        )
        d.config_path.write_text(tomli_w.dumps(new))
        d.reload()
        assert d.metrics.registry.get_sample_value("specd_config_reload_success") == 1
        renderer = structlog.get_config()["processors"][-1]
        line = renderer(None, "info", {"event": "probe", "level": "info"})
        assert "probe" in line
        assert not line.lstrip().startswith("{"), line  # console, not JSON
    finally:
        structlog.configure(**before)
    assert d.metrics.registry.get_sample_value("specd_band_boundary_concurrency") == 16


def test_a_reload_names_each_file_key_a_specd_variable_overrides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The environment wins over the file: an edit to a key specd.service sets by
    Environment= changed nothing, and the reload said `reloaded changed: {}`, success."""
    monkeypatch.setenv("SPECD_CHOOSE__MAX_STEPS", "4")
    cfg = config(tmp_path)
    d = daemon(cfg, Reader([obs(IN_WINDOW)]), Applier(), [IN_WINDOW])
    d.config_path = tmp_path / "specd.toml"
    d.config_path.write_text(tomli_w.dumps(_own_files(tmp_path, max_steps=6)))
    with capture_logs() as logs:
        d.reload()
    shadowed = [e for e in logs if e["event"] == "config_key_shadowed"]
    assert [(e["key"], e["variable"]) for e in shadowed] == [
        ("choose.max_steps", "SPECD_CHOOSE__MAX_STEPS")
    ]
    assert "an edit to it in the file does nothing" in shadowed[0]["detail"]
    assert d.config.choose.max_steps == 4
    monkeypatch.delenv("SPECD_CHOOSE__MAX_STEPS")
    with capture_logs() as logs:
        d.reload()
    assert [e for e in logs if e["event"] == "config_key_shadowed"] == []
    assert d.config.choose.max_steps == 6


def test_a_reload_that_moves_the_metrics_address_keeps_it_and_says_so_each_time(
    tmp_path: Path,
) -> None:
    """The new port went into the running config while /metrics went on being served on the
    old one: `reloaded` listed it as changed, and the next reload, comparing the file with
    that config, said nothing of a port nothing listened on."""
    cfg = config(tmp_path, metrics_listen_address="127.0.0.1", metrics_port=0)
    d = daemon(cfg, Reader([obs(IN_WINDOW)]), Applier(), [IN_WINDOW])
    d.config_path = tmp_path / "specd.toml"
    d.start_metrics_server()
    served = f"http://127.0.0.1:{d.metrics_port}/metrics"
    moved = free_port()
    try:
        said = []
        for extra in (
            {"metrics_port": moved},
            {"metrics_port": moved, "scrape_interval_s": 7.0},
            {"metrics_port": 0, "scrape_interval_s": 7.0},
        ):
            d.config_path.write_text(tomli_w.dumps(_own_files(tmp_path, **extra)))
            with capture_logs() as logged:
                d.reload()
            (reloaded,) = [e for e in logged if e["event"] == "reloaded"]
            partial = [e["detail"] for e in logged if e["event"] == "reload_partial"]
            said.append((reloaded["changed"], partial))
            assert d.config.report.metrics_port == 0  # what runs: the one served
            assert httpx.get(served, timeout=5).status_code == 200
    finally:
        assert d._metrics_server is not None
        d._metrics_server.close()
    warned = [f"report.metrics_port: {moved} in the file, 0 running: a metrics address change "
              "needs a restart of specd; the rest of the reload applies"]  # fmt: skip
    assert said == [
        ({}, warned),
        ({"observe.scrape_interval_s": 7.0}, warned),  # said again, while they differ
        ({}, []),
    ]
    assert d.metrics.registry.get_sample_value("specd_config_reload_success") == 1


def test_a_reload_reads_the_default_file_specd_started_from_and_rejects_it_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without --config, a reload while /etc/specd/specd.toml was absent (`rm` then `cp`,
    a configuration manager's dangling link) applied every default: another SGLang URL,
    unit, windows and budget, logged as a successful reload."""
    import specd.io.config as config_io  # noqa: PLC0415 - its default path is what moves

    default = tmp_path / "etc" / "specd.toml"
    monkeypatch.setattr(config_io, "DEFAULT_CONFIG_PATH", default)
    for name, value in (
        ("FILES__STATE_DIR", tmp_path / "state"),
        ("FILES__OVERRIDE_FILE", tmp_path / "override.toml"),
        ("SGLANG__ENV_FILE", tmp_path / "sglang.env"),
    ):
        monkeypatch.setenv(f"SPECD_{name}", str(value))
    own = {"url": "http://127.0.0.1:31000", "unit": "mine.service", "daily_restart_budget": 1}

    def success(d: Daemon) -> float | None:
        return d.metrics.registry.get_sample_value("specd_config_reload_success")

    # Started from the default file, as `specd run` without --config: it goes missing.
    default.parent.mkdir()
    default.write_text(tomli_w.dumps(tables(**own)))
    cfg = config_io.load_config(None)
    d = daemon(cfg, Reader([obs(IN_WINDOW)]), Applier(), [IN_WINDOW])
    default.unlink()
    with capture_logs() as logged:
        d.reload()
    assert d.config is cfg
    assert success(d) == 0
    (rejected,) = [e for e in logged if e["event"] == "reload_rejected"]
    assert rejected["config"] == str(default)
    assert not [e for e in logged if e["event"] == "reloaded"]

    # Started with none (defaults): a reload takes defaults, as the start did, until one
    # is written; from then on that file is the config, and missing, a rejected reload.
    cfg = config_io.load_config(None)
    d = daemon(cfg, Reader([obs(IN_WINDOW)]), Applier(), [IN_WINDOW])
    d.reload()
    assert success(d) == 1
    default.write_text(tomli_w.dumps(tables(**own)))
    d.reload()
    assert (d.config.sglang.unit, success(d)) == ("mine.service", 1)
    default.unlink()
    d.reload()
    assert (d.config.sglang.unit, success(d)) == ("mine.service", 0)


def test_a_stop_during_a_reloads_settle_wait_abandons_it_and_rejects_nothing(
    tmp_path: Path,
) -> None:
    """SIGTERM while a reload waits for the file to settle was logged reload_rejected
    ('not read: specd is stopping') and set specd_config_reload_success 0: an error line,
    and SpecdConfigReloadRejected's condition, for a file nothing was wrong with."""
    cfg = config(tmp_path)
    read_fd, write_fd = os.pipe()
    daemons: list[Daemon] = []

    class StoppedWhileReloading(Notifier):
        def reloading(self) -> None:
            super().reloading()
            os.write(write_fd, b"T")  # `systemctl stop specd`, as the signal relay gets it
            assert daemons[0].stop_event.wait(10)

    cfg_path = tmp_path / "specd.toml"
    cfg_path.write_text(tomli_w.dumps(_own_files(tmp_path, max_steps=5)))
    d = Daemon(
        cfg,
        cfg_path,
        registry=CollectorRegistry(),
        clock=lambda: IN_WINDOW,
        notifier=StoppedWhileReloading({}),
        reader=Reader([obs(IN_WINDOW)]),
        applier=Applier(),
    )
    daemons.append(d)
    relay = threading.Thread(target=d._relay_signals, args=(read_fd,), daemon=True)
    relay.start()
    try:
        with capture_logs() as logged:
            d.reload()
    finally:
        os.close(write_fd)
        relay.join(10)
        os.close(read_fd)
    assert [(e["event"], e["log_level"]) for e in logged] == [("reload_abandoned", "info")]
    assert d.metrics.registry.get_sample_value("specd_config_reload_success") == 1
    assert d.config is cfg


def test_a_rejected_reload_names_every_problem_at_once(tmp_path: Path) -> None:
    """state_dir and env_file were checked one or the other: the operator fixed one,
    reloaded, and only then heard of the next."""
    cfg = config(tmp_path)
    d = daemon(cfg, Reader([obs(IN_WINDOW)]), Applier(), [IN_WINDOW])
    d.config_path = tmp_path / "specd.toml"
    blocked = tmp_path / "blocked"
    blocked.write_text("a file, not a directory\n")
    new = tables(
        state_dir=str(tmp_path / "elsewhere"),
        override_file=str(tmp_path / "override.toml"),
        env_file=str(blocked / "sglang.env"),
    )
    d.config_path.write_text(tomli_w.dumps(new))
    with capture_logs() as logged:
        d.reload()
    assert d.config is cfg
    problems = [e["problem"] for e in logged if e["event"] == "reload_rejected"]
    assert len(problems) == 2, problems
    assert problems[0].startswith("files.state_dir: ")
    assert "sglang.env_file" in problems[1] or str(blocked) in problems[1], problems[1]


def test_a_reload_asked_for_during_a_restart_says_it_waits(tmp_path: Path) -> None:
    """SIGHUP is acted on between ticks, so after a restart in flight (a drain, a fleet
    slot, SGLang's load: minutes): said at once, not in silence until it ends."""
    cfg = config(tmp_path)
    d = daemon(cfg, Reader([obs(IN_WINDOW)]), Applier(), [IN_WINDOW])
    d._in_flight = InFlight("3", "4", phase="waiting_quiet")
    read_fd, write_fd = os.pipe()
    relay = threading.Thread(target=d._relay_signals, args=(read_fd,))
    with capture_logs() as logged:
        relay.start()
        os.write(write_fd, b"H")
        os.close(write_fd)
        relay.join(10)
    os.close(read_fd)
    assert d._reload_requested.is_set()
    (deferred,) = [e for e in logged if e["event"] == "reload_deferred"]
    waits = "the config is read again once the restart in flight ends: "
    assert deferred["detail"].startswith(waits)
    assert "3 → 4" in deferred["detail"]
    # Without a restart in flight: no such line, the next tick's start reloads.
    d._in_flight = None
    read_fd, write_fd = os.pipe()
    relay = threading.Thread(target=d._relay_signals, args=(read_fd,))
    with capture_logs() as logged:
        relay.start()
        os.write(write_fd, b"H")
        os.close(write_fd)
        relay.join(10)
    os.close(read_fd)
    assert not [e for e in logged if e["event"] == "reload_deferred"]


def test_a_reload_asked_for_during_a_tick_is_read_before_its_change_goes_out(
    tmp_path: Path,
) -> None:
    """The on-call sets daily_restart_budget = 0 and reloads as a window opens; the SIGHUP
    lands while the tick reads SGLang. It was read only after that tick's restart, made
    under the old budget of 4, with no reload_deferred said (none was in flight yet)."""
    cfg = config(tmp_path)
    cfg_path = tmp_path / "specd.toml"
    cfg_path.write_text(tomli_w.dumps(_own_files(tmp_path)))
    read_fd, write_fd = os.pipe()
    daemons: list[Daemon] = []

    class HupDuringScrape(Reader):
        def observe(self) -> Observation | ScrapeError:
            if daemons[0].config.restart.daily_restart_budget != 0:
                cfg_path.write_text(tomli_w.dumps(_own_files(tmp_path, daily_restart_budget=0)))
                os.write(write_fd, b"H")  # `systemctl reload specd`, as the signal relay gets it
                requested = daemons[0]._reload_requested
                deadline = time.monotonic() + 10
                while not requested.is_set() and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert requested.is_set()
            return super().observe()

    applier = Applier()
    d = daemon(cfg, HupDuringScrape([obs(IN_WINDOW, steps=3)]), applier, [IN_WINDOW])
    d.config_path = cfg_path
    daemons.append(d)
    relay = threading.Thread(target=d._relay_signals, args=(read_fd,), daemon=True)
    relay.start()
    try:
        with capture_logs() as logged:
            decision = d.tick()
    finally:
        os.close(write_fd)
        relay.join(10)
        os.close(read_fd)
    assert applier.calls == []
    assert decision.reason is Reason.RESTART_BUDGET, decision.message
    assert d.config.restart.daily_restart_budget == 0
    assert not d._reload_requested.is_set()
    events = [e["event"] for e in logged if e["event"].startswith(("reload", "restart"))]
    assert events == ["reload_before_change", "reloaded"]
    (before,) = [e for e in logged if e["event"] == "reload_before_change"]
    assert "(3 → 4)" in before["detail"]
    sample = d.metrics.registry.get_sample_value
    assert sample("specd_decisions_total", {"reason": "change"}) == 0
    assert sample("specd_decisions_total", {"reason": "restart_budget"}) == 1


def test_a_clock_stepped_back_keeps_a_pin_applied_now_to_its_own_restart_bound(
    tmp_path: Path,
) -> None:
    """A pin applied now whose change keeps ending aborted (systemd cannot set up SGLang's
    process) stops at its own restart bound. Its restarts are counted from the time it was
    decided; a clock stepped back an hour moved every restart record back, not that time,
    and for that hour every tick restarted SGLang twice, outside any window."""
    cfg = config(tmp_path, daily_restart_budget=3)
    wall, mono = [IN_WINDOW], [1000.0]
    applier = Outcome(
        {
            "result": "aborted",
            "duration_s": 2.0,
            "message": "status 219/CGROUP",
            "restarts_issued": 2,
            "not_started": 1,
        }
    )

    class Live(Reader):
        def observe(self) -> Observation:
            return obs(wall[0], steps=3)

    d = Daemon(
        cfg,
        registry=CollectorRegistry(),
        clock=lambda: wall[0],
        monotonic=lambda: mono[0],
        notifier=Notifier({}),
        reader=Live([]),
        applier=applier,
    )
    d.state.history = busy(cfg, wall[0], offered=1)
    path = Path(cfg.files.override_file)
    expires = datetime.fromtimestamp(wall[0] + 6 * 3600, tz=timezone.utc)
    pin = {"mode": "pin", "steps": 2, "expires_at": expires, "reason": "incident", "apply": "now"}
    path.write_text(tomli_w.dumps(pin))
    path.chmod(0o600)
    os.utime(path, (wall[0], wall[0]))

    def ticks(n: int) -> list[Reason]:
        reasons = []
        for _ in range(n):
            reasons.append(d.tick().reason)
            wall[0] += 5
            mono[0] += 5
        return reasons

    assert ticks(5) == [Reason.OVERRIDE_PIN] * 3 + [Reason.RESTART_BUDGET] * 2
    wall[0] -= 3600  # NTP: the box ran an hour fast
    assert set(ticks(20)) == {Reason.RESTART_BUDGET}
    assert len(applier.calls) == 3
