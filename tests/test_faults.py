"""Fault injection against the daemon, outside systemd (issue 6).

Real parts throughout: twin processes on 127.0.0.1, real HTTP, real files and tmpfs mounts,
a real `specd run` subprocess with real signals. The clock is injected where time matters
(windows, DST, clock steps), so a whole night of windows takes seconds.

The systemd-only faults (watchdog, SIGKILL mid-restart, polkit, rollback under systemd) live
in tests/systemd/; store-level corruption in tests/test_state.py; apply kill-points in
tests/test_apply.py.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, MutableMapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import pytest
import tomli_w
from factories import (
    EtcdProcess,
    Killed,
    LoopbackHTTP,
    NotifySocket,
    QuickStopSmg,
    QuietHandler,
    SmgGateway,
    StreamingLoad,
    make_observation,
    module_etcd,
    module_etcd_server,
    mounted_tmpfs,
    tables,
)
from pages import page_server
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs
from twin_zygote import ZYGOTE, ForkedProc, ForkedTwin, ForkedUnit

from specd.commands import status
from specd.core.decide import Reason
from specd.core.history import History, HistorySettings
from specd.core.observation import Observation
from specd.core.setting import traits_from_server_info
from specd.daemon import STATE_SAVE_INTERVAL_S, UNFREEZE_REQUEST, Daemon
from specd.io.config import Config, Window
from specd.io.fleet import Fleet
from specd.io.gateway import GatewayClient
from specd.io.notify import Notifier
from specd.io.runner import Runner, RunResult
from specd.io.state import STATE_FILE, State, StateStore
from specd.io.tls import verifying_context
from specd.twin.process import free_port
from specd.twin.standin import (  # noqa: F401 - re-exported: other tests import them from here
    FAST_TWIN,
    STANDIN,
    UNIT,
    StandIn,
    make_standin,
)
from specd.twin.unit import TwinUnitRunner

REPO = Path(__file__).resolve().parent.parent
# /health_generate answered in a tenth of a second rather than SGLang's one: each restart's
# health probe waited that second, and no test here is about it (tests/twin/ are).
QUICK_HEALTH = ("--health-first-look-s", "0.1")
QUICK_TWIN = (*FAST_TWIN, *QUICK_HEALTH)


def quick_standin(
    tmp_path: Path, port: int, extra: Sequence[str] = QUICK_TWIN, **options: Any
) -> StandIn:
    """``make_standin`` whose twins the twin zygote forks (tests/twin_zygote.py): each
    start of the unit a few hundredths of a second of CPU, not a new interpreter's ~0.3."""
    return make_standin(tmp_path, port, extra, spawn=ZYGOTE.ensure(), **options)


# 2026-03-29 / 2026-10-25 are the EU DST change days; 02:30 Berlin is missing / doubled.
BERLIN_0230 = Window(cron="30 2 * * mon-sun", duration_s=1800, timezone="Europe/Berlin")
# One etcd for the module, reset between its tests (factories.module_etcd).
etcd, etcd_server = module_etcd, module_etcd_server


def ts(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=timezone.utc).timestamp()


class Clock:
    """The injected wall clock: only the test moves it (forward or back)."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@dataclass
class RecordingRunner:
    """Records every command with the injected time; delegates to a real runner if given."""

    clock: Clock
    inner: Runner | None = None
    calls: list[tuple[float, tuple[str, ...]]] = field(default_factory=list)

    def __call__(self, argv: Sequence[str], *, timeout_s: float) -> RunResult:
        self.calls.append((self.clock(), tuple(argv)))
        if self.inner is not None:
            return self.inner(argv, timeout_s=timeout_s)
        return RunResult(tuple(argv), 1, "", "refused by the test", False, 0.0)

    @property
    def restarts(self) -> list[float]:
        return [t for t, argv in self.calls if "restart" in argv]


def twin_argv(steps: int, *extra: str) -> list[str]:
    return [
        "--speculative-algorithm", "NEXTN", "--speculative-num-steps", str(steps),
        "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(steps + 1),
        "--enable-metrics", *QUICK_TWIN, *extra,
    ]  # fmt: skip


def make_config(tmp_path: Path, port: int, **overrides: Any) -> Config:
    base: dict[str, Any] = {
        "url": f"http://127.0.0.1:{port}",
        "state_dir": tmp_path / "state",
        "env_file": tmp_path / "sglang.env",
        "override_file": tmp_path / "override.toml",
        "windows": [BERLIN_0230],
        "metrics_port": 0,
        "min_history_s": 600,
        "stabilization_window_s": 0,
        "min_dwell_s": 0,
        "warmup_exclude_s": 0,
        "daily_restart_budget": 2,
        "scrape_timeout_s": 1.0,
        "health_probe_timeout_s": 25,
        # A twin loads in a blink: a look every 2 s (the default, for SGLang's minutes)
        # made each restart, verification and re-add wait whole 2 s steps.
        "health_poll_interval_s": 0.2,
        "startup_timeout_s": 30,
    }
    (tmp_path / "state").mkdir(exist_ok=True)
    return Config(**tables(**{**base, **overrides}))


def make_daemon(config: Config, runner: Runner, clock: Clock) -> Daemon:
    return Daemon(
        config,
        None,
        registry=CollectorRegistry(),
        runner=runner,
        clock=clock,
        notifier=Notifier(environ={}),
    )


def synthetic_observation(t: float, offered: int) -> Observation:
    # steps=None: the history learns traffic only, so it never mistakes these for a restart
    # of the real twin the daemon scrapes in between.
    return make_observation(t, running=offered, steps=None, topk=None, algorithm=None, version=None)


def heavy_history(config: Config, offered: int, end: float, busy_s: float = 7200.0) -> History:
    """Two busy hours at ``offered`` concurrency ending at ``end``: far past min_history_s."""
    history = History(HistorySettings.from_config(config))
    step = config.observe.scrape_interval_s
    n = int(busy_s // step)
    for i in range(n):
        history.record(synthetic_observation(end - step * (n - i), offered))
    return history


def wanting(config: Config, steps: int, now: float) -> History:
    """A history whose band (default bands: <=4 -> 4, else 3) asks for ``steps``."""
    return heavy_history(config, offered=1 if steps == 4 else 20, end=now)


def sample(daemon: Daemon, name: str, labels: dict[str, str] | None = None) -> float:
    value = daemon.metrics.registry.get_sample_value(name, labels or {})
    return 0.0 if value is None else value


def scrape_errors(daemon: Daemon) -> dict[str, float]:
    return {
        kind: sample(daemon, "specd_scrape_errors_total", {"kind": kind})
        for kind in ("timeout", "refused", "http_status", "malformed", "missing")
    }


# ---- SGLang faults: no data, no restart, recovery -----------------------------------

OUTSIDE = ts("2026-06-10T12:00:00")  # no window (a Wednesday noon)
INSIDE = ts("2026-06-10T00:40:00")  # 02:40 CEST: inside the 02:30 Berlin window


@pytest.mark.parametrize(
    ("fault", "twin_flags", "config_overrides", "kind"),
    [
        ("down at start", None, {}, "refused"),
        ("killed mid-epoch", (), {}, "refused"),
        ("slower than scrape_timeout_s", ("--slow-s", "0.8"), {"scrape_timeout_s": 0.3}, "timeout"),
        ("/metrics 404", ("--metrics-404",), {}, "http_status"),
        ("garbage /metrics", ("--garbage-metrics",), {}, "malformed"),
    ],
)
def test_sglang_faults_hold_without_restart_and_recover(
    tmp_path: Path,
    fault: str,
    twin_flags: tuple[str, ...] | None,
    config_overrides: dict[str, Any],
    kind: str,
) -> None:
    port = free_port()
    config = make_config(tmp_path, port, **config_overrides)
    clock = Clock(INSIDE)
    runner = RecordingRunner(clock)
    twin = None if twin_flags is None else ForkedTwin(twin_argv(3, *twin_flags), port=port)
    with capture_logs() as captured:
        try:
            if twin is not None:
                # The slow twin answers /health only after --slow-s: that is the fault working.
                twin.wait_healthy(timeout_s=20)
            daemon = make_daemon(config, runner, clock)
            if fault == "killed mid-epoch":
                # Healthy first: observed, decided with data; then SGLang dies under us.
                clock.now = OUTSIDE
                daemon.state.history = wanting(config, 4, OUTSIDE)
                assert daemon.tick().reason is Reason.WINDOW_CLOSED
                assert twin is not None
                twin.proc.send_signal(signal.SIGKILL)
                twin.wait(timeout_s=10)
                clock.now = INSIDE
            # In the window, with a history that wants 4 while 3 runs: only the fault holds it.
            for i in range(3):
                clock.now = INSIDE + i * config.observe.scrape_interval_s
                daemon.state.history = wanting(config, 4, clock.now)
                decision = daemon.tick()
                assert decision.reason in (Reason.NO_DATA, Reason.STALE_DATA), decision
                assert not decision.acts(None if daemon.last_obs is None else daemon.last_obs.steps)
            errors = scrape_errors(daemon)
            assert errors[kind] == 3, errors
            assert sum(errors.values()) == 3, errors
            assert sample(daemon, "specd_sglang_up") == 0
            assert runner.calls == []
        finally:
            if twin is not None:
                twin.stop()
        # SGLang healthy again on the same port: the next tick sees it and decides with data.
        with ForkedTwin(twin_argv(3), port=port) as healthy:
            healthy.wait_healthy()
            clock.now = OUTSIDE + 3600
            daemon.state.history = wanting(config, 4, clock.now)
            decision = daemon.tick()
    assert (decision.reason, decision.target_steps) == (Reason.WINDOW_CLOSED, 4), decision
    assert sample(daemon, "specd_sglang_up") == 1
    assert daemon.last_obs is not None
    assert daemon.last_obs.steps == 3
    assert sum(scrape_errors(daemon).values()) == 3
    assert runner.calls == []
    # Counted every scrape; said when it starts and when it ends, not every scrape.
    said = [
        (e["event"], e.get("kind"), e["failures"])
        for e in captured
        if e["event"] in ("scrape_failed", "scrape_recovered")
    ]
    assert said == [("scrape_failed", kind, 1), ("scrape_recovered", None, 3)]


def test_server_info_missing_fields_degrades_to_metrics_only(tmp_path: Path) -> None:
    """/server_info without the spec and capacity fields is no scrape error: /metrics still
    shows the live step count (SGLang sets it at a decode log: one per batch here, so the
    warm-up's set it), so specd decides, with capacity unknown."""
    port = free_port()
    config = make_config(tmp_path, port)
    clock = Clock(OUTSIDE)
    runner = RecordingRunner(clock)
    missing = (
        "speculative_algorithm,speculative_num_steps,speculative_num_draft_tokens,"
        "speculative_eagle_topk,internal_states,max_running_requests,version"
    )
    argv = twin_argv(3, "--server-info-missing", missing, "--decode-log-interval", "1")
    with ForkedTwin(argv, port=port) as twin:
        twin.wait_healthy()
        daemon = make_daemon(config, runner, clock)
        daemon.state.history = wanting(config, 4, clock.now)
        decision = daemon.tick()
    assert (decision.reason, decision.target_steps) == (Reason.WINDOW_CLOSED, 4), decision
    obs = daemon.last_obs
    assert obs is not None
    assert (obs.steps, obs.draft_tokens, obs.max_running_requests, obs.version) == (
        3,
        4,
        None,
        None,
    )
    assert sum(scrape_errors(daemon).values()) == 0
    assert sample(daemon, "specd_sglang_up") == 1
    assert runner.calls == []


# ---- clock steps and DST: restarts only in windows, never beyond the budget ----------

# Each row: injected time (UTC), the reason the daemon must give, whether it restarts.
# The policy is made to want the other step count at EVERY tick, so only the window and
# the budget (2 per 24 h) can hold it back.
SPRING = [  # 2026-03-29: 02:30 CET does not exist; the window opens at 03:00 CEST = 01:00Z
    ("2026-03-29T00:50:00", Reason.WINDOW_CLOSED, False),
    ("2026-03-29T00:59:59", Reason.WINDOW_CLOSED, False),
    ("2026-03-29T01:00:00", Reason.CHANGE, True),
    ("2026-03-29T01:05:00", Reason.CHANGE, True),
    ("2026-03-29T01:10:00", Reason.RESTART_BUDGET, False),
    ("2026-03-29T00:10:00", Reason.WINDOW_CLOSED, False),  # clock stepped back 1 h
    # The two restarts "in the future" were taken as made at the step back: still 2 in 24 h.
    ("2026-03-29T01:02:00", Reason.RESTART_BUDGET, False),
    # 1 s before the close no restart fits (issue 11 item 2), budget or not.
    ("2026-03-29T01:29:59", Reason.WINDOW_ENDING, False),
    ("2026-03-29T01:30:00", Reason.WINDOW_CLOSED, False),
    ("2026-03-29T02:30:00", Reason.WINDOW_CLOSED, False),  # 04:30 CEST
]
SPRING_WINDOWS = [("2026-03-29T01:00:00", "2026-03-29T01:30:00")]
FALL = [  # 2026-10-25: 02:30 happens at 00:30Z (CEST) and again at 01:30Z (CET): one window
    ("2026-10-25T00:29:59", Reason.WINDOW_CLOSED, False),
    ("2026-10-25T00:30:00", Reason.CHANGE, True),
    ("2026-10-25T00:40:00", Reason.CHANGE, True),
    ("2026-10-25T00:50:00", Reason.RESTART_BUDGET, False),
    ("2026-10-25T01:00:00", Reason.WINDOW_CLOSED, False),
    ("2026-10-25T01:30:00", Reason.WINDOW_CLOSED, False),  # the repeated 02:30 opens nothing
    ("2026-10-25T01:45:00", Reason.WINDOW_CLOSED, False),
    ("2026-10-25T00:45:00", Reason.RESTART_BUDGET, False),  # stepped back into the window
    ("2026-10-26T01:30:00", Reason.CHANGE, True),  # next night, 02:30 CET: budget renewed
]
FALL_WINDOWS = [
    ("2026-10-25T00:30:00", "2026-10-25T01:00:00"),
    ("2026-10-26T01:30:00", "2026-10-26T02:00:00"),
]


@pytest.mark.parametrize(
    ("ticks", "windows"), [(SPRING, SPRING_WINDOWS), (FALL, FALL_WINDOWS)], ids=["spring", "fall"]
)
def test_clock_steps_and_dst_restart_only_in_windows_within_budget(
    tmp_path: Path,
    ticks: list[tuple[str, Reason, bool]],
    windows: list[tuple[str, str]],
) -> None:
    port = free_port()
    config = make_config(tmp_path, port)
    clock = Clock(ts(ticks[0][0]))
    unit = ForkedUnit(UNIT, config.sglang.env_file, port=port, extra_args=QUICK_TWIN)
    runner = RecordingRunner(clock, unit)
    unit.start().wait_healthy()
    try:
        daemon = make_daemon(config, runner, clock)
        seen = []
        for when, _reason, _restarts in ticks:
            clock.now = ts(when)
            live = int(unit.environment()["SPECULATIVE_NUM_STEPS"])
            daemon.state.history = wanting(config, 4 if live == 3 else 3, clock.now)
            before = len(runner.restarts)
            decision = daemon.tick()
            seen.append((when, decision.reason, len(runner.restarts) > before))
        assert seen == ticks
        intervals = [(ts(a), ts(b)) for a, b in windows]
        for t in runner.restarts:
            assert any(a <= t < b for a, b in intervals), f"restart outside a window at {t}"
        for a, b in intervals:
            assert sum(a <= t < b for t in runner.restarts) <= config.restart.daily_restart_budget
        results = [r["result"] for r in daemon.state.restarts]
        assert results == ["success"] * sum(r for _, _, r in ticks)
        # The env file, the twin and specd agree on what runs.
        live = int(unit.environment()["SPECULATIVE_NUM_STEPS"])
        assert unit.restarted_to[-1] == live
        assert daemon.client.server_info()["speculative_num_steps"] == live  # type: ignore[index]
    finally:
        unit.stop()


# ---- the gateway: stopped means no restart; a specd killed while drained heals -------


# The twins' gauges refresh this often (their default, 1 s, is a drain's idle reads' wait).
GAUGE_REFRESH = ("--report-interval-s", "0.2")
# A drain's idle reads are a scrape apart: still more than a gauge refresh.
GATEWAY_SCRAPE_S = 0.5
# The 4 clients' requests through the gateway: a round before the change and two after it
# (round robin reaches the re-added worker). A restart without a drain, or a worker not
# routed again, shows in the requests across the sequence and in the worker's status; 20
# before and 20 after (~5 s each of 200-token requests) added nothing to that.
LOAD_BEFORE, LOAD_AFTER = 4, 8


@contextlib.contextmanager
def gateway_fleet(
    tmp_path: Path,
    unit_args: Sequence[str] = (),
    unit_listed_as: str | None = "127.0.0.1",
    **overrides: Any,
) -> Iterator[tuple[TwinUnitRunner, SmgGateway, Config]]:
    """The unit the daemon restarts (with ``unit_args``) and a second twin behind one real
    smg (no retries: a restart without a drain reaches the clients), and the daemon's
    config for them (with ``overrides``). smg lists the unit under the host
    ``unit_listed_as`` (the daemon's URL says 127.0.0.1), or not at all (None)."""
    port = free_port()
    gateway = None
    unit = ForkedUnit(
        UNIT,
        tmp_path / "sglang.env",
        port=port,
        extra_args=[*QUICK_TWIN, *GAUGE_REFRESH, *unit_args],
    )
    with ForkedTwin(twin_argv(3, *GAUGE_REFRESH)) as other:
        unit.start().wait_healthy()
        try:
            other.wait_healthy()
            listed = [unit.url.replace("127.0.0.1", unit_listed_as)] if unit_listed_as else []
            gateway = QuickStopSmg([*listed, other.url], retries=False)
            gateway.wait_ready()
            config = make_config(
                tmp_path,
                port,
                urls=[gateway.url],
                drain_timeout_s=20.0,
                ready_timeout_s=30.0,
                request_timeout_s=2.0,
                # A drain waits for two idle reads in a row, one per scrape: at the default
                # 5 s the drain alone took 10 s of each test. Nothing here depends on the
                # interval (the clock is the test's own).
                scrape_interval_s=GATEWAY_SCRAPE_S,
                **overrides,
            )
            yield unit, gateway, config
        finally:
            if gateway is not None:
                gateway.stop()
            unit.stop()


def status_text(config: Config, now: float) -> str:
    """What `specd status` prints from the state file the daemon wrote."""
    return status.render(status.collect(config, now), now)


def worker_status(gateway_url: str, worker_url: str) -> str | None:
    client = GatewayClient([gateway_url], worker_url, timeout_s=2.0)
    try:
        found = client.find(gateway_url)
    finally:
        client.close()
    return None if found is None else found.status


def test_gateway_stopped_means_no_restart_and_resumes_once_it_is_back(tmp_path: Path) -> None:
    with gateway_fleet(tmp_path) as (unit, gateway, config):
        clock = Clock(INSIDE)
        runner = RecordingRunner(clock, unit)
        daemon = make_daemon(config, runner, clock)
        gateway.stop()
        daemon.state.history = wanting(config, 4, clock.now)
        decision = daemon.tick()
        assert decision.reason is Reason.DRAIN_UNAVAILABLE, decision
        assert "ConnectError" in decision.message
        assert runner.restarts == []
        assert sample(daemon, "specd_last_decision", {"reason": "drain_unavailable"}) == 1
        assert sample(daemon, "specd_gateway_errors_total", {"kind": "connect"}) >= 1
        assert math.isnan(sample(daemon, "specd_gateway_worker_not_ready_replicas"))
        state = json.loads((tmp_path / "state" / STATE_FILE).read_text())
        assert "ConnectError" in state["gateway"]["probe"]["problem"]
        assert "gateway        UNAVAILABLE: " in status_text(config, clock.now)

        # The gateway is back on the same address: the next tick drains and restarts.
        with (
            QuickStopSmg(
                [unit.url, *gateway.worker_urls[1:]], retries=False, port=gateway.port
            ) as back,
            StreamingLoad(back.url, 4, max_tokens=200) as load,
        ):
            load.wait_for(LOAD_BEFORE)
            clock.now += config.observe.scrape_interval_s
            daemon.state.history = wanting(config, 4, clock.now)
            decision = daemon.tick()
            load.wait_for(load.ok + LOAD_AFTER)
            status = worker_status(back.url, unit.url)
        assert decision.reason is Reason.CHANGE, decision
        assert load.failures == []
        assert len(runner.restarts) == 1
        assert unit.restarted_to == [4]
        assert status == "ready"
        assert [r["result"] for r in daemon.state.restarts] == ["success"]
        assert sample(daemon, "specd_drains_total", {"result": "idle"}) == 1
        assert sample(daemon, "specd_requests_in_flight_at_restart") == 0
        assert sample(daemon, "specd_drain_duration_seconds_count") == 1
        last = daemon.state.gateway["last_drain"] if daemon.state.gateway else {}
        assert (last["result"], last["readd_problem"]) == ("idle", None)
        shown = status_text(config, clock.now)
        assert "gateway        worker ready on all 1 replicas" in shown
        assert "last drain     idle after" in shown
        assert "0 in flight at the restart" in shown


def test_a_failed_restart_rolls_back_readds_the_worker_and_freezes(tmp_path: Path) -> None:
    with gateway_fleet(tmp_path, ["--fail-start-at-steps", "4"], startup_timeout_s=5.0) as (
        unit,
        gateway,
        config,
    ):
        clock = Clock(INSIDE)
        runner = RecordingRunner(clock, unit)
        daemon = make_daemon(config, runner, clock)
        daemon.state.history = wanting(config, 4, clock.now)
        # What specd_sglang_restarting said at each systemctl restart (the change's, then
        # the rollback's): SGLang down on purpose, so SGLangDown keeps quiet then.
        at_restarts: list[float | None] = []
        inner = runner.inner

        def restarting(argv: Sequence[str], *, timeout_s: float) -> RunResult:
            if "restart" in argv:
                at_restarts.append(sample(daemon, "specd_sglang_restarting"))
            assert inner is not None
            return inner(argv, timeout_s=timeout_s)

        runner.inner = restarting
        with StreamingLoad(gateway.url, 4, max_tokens=200) as load:
            load.wait_for(LOAD_BEFORE)
            daemon.tick()
            load.wait_for(load.ok + LOAD_AFTER)
        status = worker_status(gateway.url, unit.url)
    assert load.failures == []
    assert unit.restarted_to == [4, 3]
    assert at_restarts == [1.0, 1.0]
    assert sample(daemon, "specd_sglang_restarting") == 0
    # The change went out inside the window, the rollback wherever it had to.
    assert sample(daemon, "specd_restarts_outside_window_total") == 0
    assert [r["result"] for r in daemon.state.restarts] == ["rolled_back"]
    assert daemon.state.frozen is not None
    assert sample(daemon, "specd_frozen") == 1
    assert status == "ready"
    last = daemon.state.gateway["last_drain"] if daemon.state.gateway else {}
    assert (last["result"], last["readd_problem"]) == ("idle", None)


@pytest.mark.parametrize("unit_listed_as", ["localhost", None])
def test_a_worker_the_gateway_does_not_list_by_specds_url_is_never_restarted(
    tmp_path: Path, unit_listed_as: str | None
) -> None:
    """specd's worker URL (its SGLang URL by default) is not one the gateway lists: a drain
    would remove nothing. Listed under another URL of this host (smg knows SGLang by its LAN
    address), the gateway still routes it through a restart; listed nowhere, specd cannot
    tell that from a name it does not recognise. Either way no restart, and status and the
    log say which URL is missing and what the gateway lists instead."""
    with gateway_fleet(tmp_path, unit_listed_as=unit_listed_as) as (unit, gateway, config):
        clock = Clock(INSIDE)
        runner = RecordingRunner(clock, unit)
        daemon = make_daemon(config, runner, clock)
        daemon.state.history = wanting(config, 4, clock.now)
        listed = unit.url.replace("127.0.0.1", unit_listed_as or "")
        other = gateway.worker_urls[-1]
        if unit_listed_as is not None:
            problem = (
                f"gateway {gateway.url} lists this server as {listed}, not as {unit.url}: "
                f'set [gateway] worker_url = "{listed}"'
            )
        else:
            problem = (
                f"gateway {gateway.url} does not list worker {unit.url} (it lists {other}): "
                "add this server to the gateway, or set [gateway] worker_url to the URL the "
                "gateway routes it by"
            )
        with capture_logs() as logs:
            decision = daemon.tick()
            clock.now += config.observe.scrape_interval_s
            again = daemon.tick()
        assert decision.reason is Reason.DRAIN_UNAVAILABLE, decision
        assert again.reason is Reason.DRAIN_UNAVAILABLE, again
        assert problem in decision.message
        assert runner.restarts == []
        assert unit.restarted_to == []
        assert [e["problem"] for e in events(logs, "gateway_unavailable")] == [problem]
        # Listed under another URL it is routed, not left out: no SpecdWorkerLeftOutOfGateway.
        # Listed nowhere, it is out of routing as far as specd can tell: the alert's case.
        not_ready = sample(daemon, "specd_gateway_worker_not_ready_replicas")
        if unit_listed_as is not None:
            assert math.isnan(not_ready)
            assert worker_status(gateway.url, listed) == "ready"
        else:
            assert not_ready == 1
        assert sample(daemon, "specd_gateway_errors_total", {"kind": "malformed"}) == 0
        shown = status_text(config, clock.now)
        assert f"gateway        UNAVAILABLE: {problem} (" in shown
        assert "NOT READY" not in shown
        if unit_listed_as is None:
            return

        # The operator sets the URL the gateway lists: drained there, restarted, re-added.
        fixed = make_config(
            tmp_path,
            int(unit.url.rsplit(":", 1)[1]),
            urls=[gateway.url],
            worker_url=listed,
            request_timeout_s=2.0,
            scrape_interval_s=GATEWAY_SCRAPE_S,
        )
        daemon = make_daemon(fixed, runner, clock)
        daemon.state.history = wanting(fixed, 4, clock.now)
        with StreamingLoad(gateway.url, 4, max_tokens=200) as load:
            load.wait_for(LOAD_BEFORE)
            decision = daemon.tick()
            load.wait_for(load.ok + LOAD_AFTER)
        assert decision.reason is Reason.CHANGE, decision
        assert load.failures == []
        assert unit.restarted_to == [4]
        assert worker_status(gateway.url, listed) == "ready"
        assert "gateway        worker ready on all 1 replicas" in status_text(fixed, clock.now)


class KillAfterRestart:
    """Runs the unit's restart, then specd dies (SIGKILL right after `systemctl`)."""

    def __init__(self, unit: TwinUnitRunner) -> None:
        self.unit = unit

    def __call__(self, argv: Sequence[str], *, timeout_s: float) -> RunResult:
        result = self.unit(argv, timeout_s=timeout_s)
        if "restart" in argv:
            raise Killed("after systemctl restart")
        return result


def test_a_specd_killed_while_drained_readds_the_worker_at_its_next_start(
    tmp_path: Path,
) -> None:
    with gateway_fleet(tmp_path) as (unit, gateway, config):
        clock = Clock(INSIDE)
        daemon = make_daemon(config, KillAfterRestart(unit), clock)
        daemon.state.history = wanting(config, 4, clock.now)
        with pytest.raises(Killed):
            daemon.tick()
        assert worker_status(gateway.url, unit.url) in (None, "draining")
        stored = json.loads((tmp_path / "state" / STATE_FILE).read_text())
        assert stored["journal"]["phase"] == "restart_issued"
        assert [w["url"] for w in stored["journal"]["drained"]] == [unit.url]
        assert "gateway        DRAINED from 1 of 1 replicas" in status_text(config, clock.now)

        # The next specd, from the state file alone.
        again = make_daemon(config, RecordingRunner(clock, unit), clock)
        again._reconcile_journal()
        assert worker_status(gateway.url, unit.url) == "ready"
        assert again.state.journal is None
        assert [r["result"] for r in again.state.restarts] == ["success"]
        assert unit.restarted_to == [4]
        last = again.state.gateway["last_drain"] if again.state.gateway else {}
        assert (last["result"], last["readd_problem"]) == (None, None)
        # Only the drain of the sequence itself counts as one.
        assert (
            sum(
                sample(again, "specd_drains_total", {"result": r})
                for r in ("idle", "timeout", "aborted", "error")
            )
            == 0
        )


class FreezesTheGatewayOnRestart:
    """Runs the unit's commands; as SGLang restarts the gateway replica stops answering
    (SIGSTOP: a host that hangs, a network blip) and is still away at the re-add."""

    def __init__(self, clock: Clock, unit: TwinUnitRunner, gateway: SmgGateway) -> None:
        self.inner = RecordingRunner(clock, unit)
        self.gateway = gateway

    def __call__(self, argv: Sequence[str], *, timeout_s: float) -> RunResult:
        if "restart" in argv:
            os.kill(self.gateway.proc.pid, signal.SIGSTOP)
        return self.inner(argv, timeout_s=timeout_s)


def wait_for_status(gateway_url: str, worker_url: str, wanted: str | None) -> None:
    end = time.monotonic() + 30
    while (now := worker_status(gateway_url, worker_url)) != wanted:
        assert time.monotonic() < end, f"worker {now}, not {wanted}"
        time.sleep(0.2)


@pytest.mark.parametrize("restarted", [False, True], ids=["next-minute", "specd-restarted"])
def test_a_worker_a_failed_readd_left_out_is_put_back_once_the_gateway_answers(
    tmp_path: Path, restarted: bool
) -> None:
    """The re-add after a restart failed (the replica away): the journal that named the
    drained worker is cleared with the outcome, so nothing put it back and the fleet served a
    server short until someone re-added it by hand (restarting specd, as the alert's runbook
    said, did nothing). specd now keeps it and re-adds it, each minute and at its start."""
    with gateway_fleet(tmp_path) as (unit, gateway, config):
        clock = Clock(INSIDE)
        daemon = make_daemon(config, FreezesTheGatewayOnRestart(clock, unit, gateway), clock)
        daemon.state.history = wanting(config, 4, clock.now)
        try:
            daemon.tick()
        finally:
            os.kill(gateway.proc.pid, signal.SIGCONT)
        assert unit.restarted_to == [4]
        assert [r["result"] for r in daemon.state.restarts] == ["success"]
        last = daemon.state.gateway["last_drain"] if daemon.state.gateway else {}
        assert "no answer within 2 s" in last["readd_problem"]
        shown = status_text(config, clock.now)
        assert "WORKER LEFT OUT: re-adding the worker failed on 1 of 1 replicas" in shown
        assert "left out       worker out of routing on 1 replica(s) since " in shown
        assert sample(daemon, "specd_gateway_worker_left_out_replicas") == 1
        # Back, the replica runs the removal it had queued: out of routing for good.
        wait_for_status(gateway.url, unit.url, None)
        if not restarted:
            # Away again: what it routes is unknown, that it left the worker out is not
            # (SpecdWorkerLeftOutOfGateway read only the first, and kept quiet).
            os.kill(gateway.proc.pid, signal.SIGSTOP)
            try:
                clock.now += 5
                daemon.tick()
            finally:
                os.kill(gateway.proc.pid, signal.SIGCONT)
            assert math.isnan(sample(daemon, "specd_gateway_worker_not_ready_replicas"))
            assert sample(daemon, "specd_gateway_worker_left_out_replicas") == 1

        clock.now += GATEWAY_SCRAPE_S
        if restarted:
            daemon = make_daemon(config, RecordingRunner(clock, unit), clock)
        else:
            daemon.tick()  # within the minute: not tried again yet
            assert worker_status(gateway.url, unit.url) is None
            clock.now += 60
        with capture_logs() as logs:
            daemon.tick()
            wait_for_status(gateway.url, unit.url, "ready")
            clock.now += GATEWAY_SCRAPE_S
            daemon.tick()  # the probe sees it routed again
        # Re-added once; seen routed again once, by this tick's probe when smg's health
        # check ran before it (it did once under the full suite's load), else the next's.
        assert [e["event"] for e in logs if "gateway_worker" in e["event"]] == [
            "gateway_worker_readd_accepted",
            "gateway_worker_readded",
        ]
        assert daemon.state.gateway is not None
        assert "left_out" not in daemon.state.gateway
        assert sample(daemon, "specd_gateway_worker_not_ready_replicas") == 0
        assert sample(daemon, "specd_gateway_worker_left_out_replicas") == 0
        shown = status_text(config, clock.now)
        assert "WORKER LEFT OUT" not in shown
        assert "left out  " not in shown
        assert "; worker left out, routed again " in shown
        assert unit.restarted_to == [4]  # put back, never restarted again


# ---- the watchdog while the gateway or etcd takes its whole timeouts ---------------------

# A short watchdog: the daemon pings at most every half of it (the notifier's rate limit).
WATCHDOG_S = 2.0


def watched_daemon(
    config: Config,
    runner: Runner,
    clock: Clock,
    notify: NotifySocket,
    monkeypatch: pytest.MonkeyPatch,
) -> Daemon:
    """The daemon as systemd runs it with WatchdogSec=, pinging a real NOTIFY_SOCKET."""
    monkeypatch.setenv("NOTIFY_SOCKET", str(notify.path))
    environ = {"NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": str(int(WATCHDOG_S * 1e6))}
    return Daemon(
        config,
        None,
        registry=CollectorRegistry(),
        runner=runner,
        clock=clock,
        notifier=Notifier(environ=environ),
    )


def longest_silence(notify: NotifySocket, start: float, end: float) -> float:
    """The longest time between two WATCHDOG=1 from ``start`` to ``end`` (monotonic)."""
    times = [start, *(t for t in notify.times("WATCHDOG=1") if start < t < end), end]
    return max(b - a for a, b in itertools.pairwise(times))


class Slow(QuietHandler):
    """A gateway replica that answers just within request_timeout_s (a loaded one)."""

    delay_s = 0.5

    def do_GET(self) -> None:
        time.sleep(self.delay_s)
        self.send_body(200, b'{"workers": []}', "application/json")


def test_the_watchdog_is_fed_while_every_gateway_replica_answers_slowly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each replica a tick asks may take up to its request_timeout_s: with many replicas
    (or a long timeout) the tick outlasted WatchdogSec= and systemd killed specd, again at
    each tick while the gateway was slow (and, past the unit's start limit, for good)."""
    notify = NotifySocket(tmp_path / "notify.sock")
    replicas = [LoopbackHTTP(Slow) for _ in range(5)]
    try:
        with ForkedTwin(twin_argv(3)) as twin:
            twin.wait_healthy()
            config = make_config(
                tmp_path,
                int(twin.url.rsplit(":", 1)[1]),
                urls=[r.url for r in replicas],
                request_timeout_s=0.6,
            )
            clock = Clock(INSIDE)
            daemon = watched_daemon(config, RecordingRunner(clock), clock, notify, monkeypatch)
            daemon.state.history = wanting(config, 4, clock.now)
            daemon.notifier.beat()
            started = time.monotonic()
            decision = daemon.tick()
            ended = time.monotonic()
    finally:
        for replica in replicas:
            replica.close()
        notify.close()
    assert decision.reason is Reason.DRAIN_UNAVAILABLE, decision
    assert "no gateway replica lists worker" in decision.message
    assert ended - started >= 5 * Slow.delay_s
    assert longest_silence(notify, started, ended) < WATCHDOG_S


class SlowEtcd(QuietHandler):
    """A real etcd behind a proxy that answers each call late (a loaded etcd, disk stalls)."""

    upstream = ""
    delay_s = 0.8

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        time.sleep(self.delay_s)
        answer = httpx.post(self.upstream + self.path, content=body, timeout=5)
        self.send_body(answer.status_code, answer.content, "application/json")


class NotesTheRestart:
    """The unit's commands; notes when `systemctl restart` goes out."""

    def __init__(self, clock: Clock, unit: TwinUnitRunner) -> None:
        self.inner = RecordingRunner(clock, unit)
        self.restart_at: float | None = None

    def __call__(self, argv: Sequence[str], *, timeout_s: float) -> RunResult:
        if "restart" in argv and self.restart_at is None:
            self.restart_at = time.monotonic()
        return self.inner(argv, timeout_s=timeout_s)


def test_the_watchdog_is_fed_while_a_slow_etcd_hands_out_a_slot(
    tmp_path: Path, etcd: EtcdProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A try for a slot is a few etcd calls in a row (range, lease grant, txn), each up to
    etcd_timeout_s (10 s allowed, "well inside specd's watchdog"): with the heartbeat sent
    at most every half period, a slow etcd outlasted WatchdogSec= and systemd killed specd
    while it took its turn."""
    notify = NotifySocket(tmp_path / "notify.sock")

    class Proxy(SlowEtcd):
        upstream = etcd.url

    port = free_port()
    unit = ForkedUnit(UNIT, tmp_path / "sglang.env", port=port, extra_args=QUICK_TWIN)
    try:
        with LoopbackHTTP(Proxy) as proxy:
            unit.start().wait_healthy()
            config = make_config(
                tmp_path, port, etcd_endpoints=[proxy.url], group="g", etcd_timeout_s=3
            )
            clock = Clock(INSIDE)
            runner = NotesTheRestart(clock, unit)
            daemon = watched_daemon(config, runner, clock, notify, monkeypatch)
            daemon.state.history = wanting(config, 4, clock.now)
            daemon.notifier.beat()
            started = time.monotonic()
            decision = daemon.tick()
    finally:
        unit.stop()
        notify.close()
    assert decision.reason is Reason.CHANGE, decision
    assert [r["result"] for r in daemon.state.restarts] == ["success"]
    assert runner.restart_at is not None
    # From the tick's start to the restart: etcd's probe, the try for a slot, the check.
    assert runner.restart_at - started >= 5 * SlowEtcd.delay_s
    assert longest_silence(notify, started, runner.restart_at) < WATCHDOG_S


class RaceForTheSlot:
    """The unit's commands; at the first (the change has begun, etcd said a slot was free)
    another server takes the group's only slot, gives it back ``hold_s`` later, and the
    on-call freezes specd meanwhile."""

    def __init__(
        self, clock: Clock, unit: TwinUnitRunner, other: Fleet, freeze: Path, hold_s: float
    ) -> None:
        self.inner = RecordingRunner(clock, unit)
        self.other, self.freeze, self.hold_s = other, freeze, hold_s
        self.raced = False
        self.release = threading.Timer(hold_s, lambda: None)

    def __call__(self, argv: Sequence[str], *, timeout_s: float) -> RunResult:
        if not self.raced:
            self.raced = True
            slot = self.other.try_acquire()
            assert slot is not None
            self.release = threading.Timer(self.hold_s, self.other.release, args=(slot,))
            self.release.start()
            override = {"mode": "freeze", "expires_at": datetime.now(timezone.utc).replace(
                year=2100), "reason": "incident 4711"}  # fmt: skip
            self.freeze.write_text(tomli_w.dumps(override))
            os.chmod(self.freeze, 0o600)
        return self.inner(argv, timeout_s=timeout_s)


def test_an_oncall_freeze_written_while_specd_waits_for_a_fleet_slot_stops_the_restart(
    tmp_path: Path, etcd: EtcdProcess
) -> None:
    """A change that lost the race for the group's slot waits for it (up to slot_wait_max_s,
    half an hour by default), its tick blocked: a freeze the on-call wrote meanwhile was never
    read, and SGLang was restarted once the slot freed. The wait now gives up on a freeze."""
    port = free_port()
    unit = ForkedUnit(UNIT, tmp_path / "sglang.env", port=port, extra_args=QUICK_TWIN)
    try:
        unit.start().wait_healthy()
        config = make_config(
            tmp_path,
            port,
            etcd_endpoints=[etcd.url],
            group="g",
            slot_poll_interval_s=0.2,
        )
        assert config.fleet is not None
        other = Fleet(config.fleet, "box-b")
        clock = Clock(INSIDE)
        freeze = Path(config.files.override_file)
        runner = RaceForTheSlot(clock, unit, other, freeze, hold_s=2.0)
        daemon = make_daemon(config, runner, clock)
        daemon.state.history = wanting(config, 4, clock.now)
        started = time.monotonic()
        with capture_logs() as logs:
            decision = daemon.tick()
        took = time.monotonic() - started
    finally:
        unit.stop()
    assert runner.raced
    assert decision.reason is Reason.CHANGE, decision
    assert unit.restarted_to == []
    assert daemon.state.restarts == []
    [aborted] = [e for e in events(logs, "restart_aborted") if "result" in e]  # the daemon's
    assert aborted["message"] == (
        "an override freezes specd now (incident 4711) while waiting 0 s for a fleet slot "
        "(all 1 slot(s) of fleet group g busy); nothing was restarted"
    )
    assert took < 2.0  # given up at the next poll, not once the slot freed
    assert [h.name for h in other.holders()] == ["box-b"]  # never box-a's
    runner.release.join()
    assert daemon.tick().reason is Reason.FROZEN


# ---- state directory faults, at start and while running ------------------------------


def tmpfs(path: Path, size: str = "512k") -> contextlib.AbstractContextManager[Path]:
    return mounted_tmpfs(path, size)


def fill(directory: Path) -> Path:
    """Write zeros until the filesystem is full (ENOSPC); returns the filler file."""
    filler = directory / "filler"
    with contextlib.suppress(OSError), open(filler, "wb") as f:
        while True:
            f.write(b"\0" * 65536)
            f.flush()
            os.fsync(f.fileno())
    return filler


def remount(path: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(path)], check=True)


def valid_state_text(tmp_path: Path, config: Config) -> str:
    store = StateStore(tmp_path / "scratch")
    (tmp_path / "scratch").mkdir()
    state = store.fresh()
    state.history = heavy_history(config, 20, OUTSIDE)
    assert store.save(state) is None
    return (tmp_path / "scratch" / STATE_FILE).read_text()


def events(logs: Sequence[MutableMapping[str, Any]], name: str) -> list[MutableMapping[str, Any]]:
    return [e for e in logs if e.get("event") == name]


@pytest.mark.parametrize(
    "damage",
    [
        "truncated",
        "garbage bytes",
        "not an object",
        "a directory",
        "empty",
        "nested 100000 deep",
        "a FIFO",
        "a sparse 300 MB file",
        "a link to /dev/zero",
    ],
)
def test_a_damaged_state_at_start_is_rebuilt_and_counted(tmp_path: Path, damage: str) -> None:
    config = make_config(tmp_path, free_port())
    path = Path(config.files.state_dir) / STATE_FILE
    good = valid_state_text(tmp_path, config)
    if damage == "truncated":
        path.write_text(good[: len(good) // 2])
    elif damage == "garbage bytes":
        path.write_bytes(b"\xff\xfe\x00garbage\x00")
    elif damage == "not an object":
        path.write_text("[1, 2, 3]\n")
    elif damage == "a directory":
        path.mkdir()
    elif damage == "nested 100000 deep":
        path.write_text('{"version": 1, "history": ' + "[" * 100_000)
    elif damage == "a FIFO":
        os.mkfifo(path)
    elif damage == "a sparse 300 MB file":
        with path.open("wb") as handle:
            handle.truncate(300 * 1024**2)
    elif damage == "a link to /dev/zero":
        path.symlink_to("/dev/zero")
    else:
        path.write_text("")
    clock = Clock(OUTSIDE)
    with capture_logs() as logs:
        daemon = make_daemon(config, RecordingRunner(clock), clock)
        for i in range(3):  # SGLang is down too: the daemon still ticks
            clock.now = OUTSIDE + i * (STATE_SAVE_INTERVAL_S + 1)
            assert daemon.tick().reason is Reason.NO_DATA
    assert sample(daemon, "specd_state_load_errors_total") == 1
    assert sample(daemon, "specd_state_write_errors_total") == 0
    failed = events(logs, "state_load_failed")
    assert len(failed) == 1
    assert failed[0]["log_level"] == "error"
    assert "\n" not in failed[0]["problem"]
    assert failed[0]["problem"]
    assert daemon.state.history.busy_seconds == 0  # rebuilt from nothing
    state, problem = StateStore(Path(config.files.state_dir)).load()
    assert problem is None, problem  # the fresh state was written back, whole
    assert state.last_decision["reason"] == "no_data"


@pytest.mark.parametrize(
    ("request_kind", "logged"),
    [
        ("json", "fixed it"),
        ("fifo", "(unreadable request: "),
        ("dev-zero", "(unreadable request: "),
        ("deep", "(unreadable request: invalid JSON: nested deeper than"),
    ],
)
def test_an_unfreeze_request_is_read_bounded_and_never_hangs_the_loop(
    tmp_path: Path, request_kind: str, logged: str
) -> None:
    config = make_config(tmp_path, free_port())
    store = StateStore(Path(config.files.state_dir))
    assert store.save(State(frozen={"since": OUTSIDE - 60, "reason": "rollback"})) is None
    request = Path(config.files.state_dir) / UNFREEZE_REQUEST
    if request_kind == "json":
        request.write_text('{"reason": "fixed it"}')
    elif request_kind == "fifo":
        os.mkfifo(request)
    elif request_kind == "dev-zero":
        request.symlink_to("/dev/zero")
    else:
        request.write_text("[" * 60_000)  # deep, yet within the 64 KiB cap
    clock = Clock(OUTSIDE)
    daemon = make_daemon(config, RecordingRunner(clock), clock)
    assert daemon.state.frozen is not None
    started = time.monotonic()
    with capture_logs() as logs:
        daemon.tick()
    assert time.monotonic() - started < 3.0  # one scrape of a closed port, no read hang
    # Whatever the request holds, its presence is the operator's word (only root or specd
    # can write there); it is consumed, and what it said is logged in one line.
    assert daemon.state.frozen is None
    assert not os.path.lexists(request)
    unfrozen = events(logs, "unfrozen")
    assert len(unfrozen) == 1
    assert logged in unfrozen[0]["reason"]
    assert "\n" not in unfrozen[0]["reason"]
    # When, as every time specd logs: ISO 8601 text (a datetime reached the JSON log as
    # its Python repr, "datetime.datetime(2026, ...)").
    at = unfrozen[0]["at"]
    assert isinstance(at, str), at
    assert datetime.fromisoformat(at).utcoffset() is not None, at


def test_an_unfreeze_request_that_cannot_be_removed_unfreezes_once(tmp_path: Path) -> None:
    """A directory named unfreeze.json: honoured as the operator's word, but it cannot be
    consumed. It once cleared every later freeze (a failed restart's) at the next tick."""
    config = make_config(tmp_path, free_port())
    store = StateStore(Path(config.files.state_dir))
    assert store.save(State(frozen={"since": OUTSIDE - 60, "reason": "rollback"})) is None
    request = Path(config.files.state_dir) / UNFREEZE_REQUEST
    request.mkdir()
    (request / "keep").write_text("")  # not even an empty directory
    clock = Clock(OUTSIDE)
    daemon = make_daemon(config, RecordingRunner(clock), clock)
    with capture_logs() as logs:
        daemon.tick()
        assert daemon.state.frozen is None
        # A restart fails later: that freeze stands while the same directory stays.
        daemon.state.frozen = {"since": OUTSIDE + 5, "reason": "restart to 4 rolled_back"}
        for i in range(1, 4):
            clock.now = OUTSIDE + 5 * i
            daemon.tick()
        assert daemon.state.frozen is not None
        assert len(events(logs, "unfrozen")) == 1
        assert len(events(logs, "unfreeze_request_not_removed")) == 1
        # Replaced by a real request (the directory removed, `specd unfreeze` run): honoured.
        shutil.rmtree(request)
        request.write_text('{"reason": "fixed it"}')
        clock.now += 5
        daemon.tick()
    assert daemon.state.frozen is None
    assert not os.path.lexists(request)


def test_an_unfreeze_request_of_another_user_is_not_honoured(tmp_path: Path) -> None:
    """Only root and specd's user may lift a freeze (`specd unfreeze` runs as one): a
    request any other user could leave (a state directory made writable by hand) cleared
    the freeze a failed restart set. Said once, ignored until replaced by a request of
    root's or specd's."""
    if os.getuid() != 0:
        pytest.skip("a file of another owner needs root to make")
    config = make_config(tmp_path, free_port())
    store = StateStore(Path(config.files.state_dir))
    assert store.save(State(frozen={"since": OUTSIDE - 60, "reason": "rollback"})) is None
    request = Path(config.files.state_dir) / UNFREEZE_REQUEST
    request.write_text('{"reason": "not mine to say"}')
    os.chown(request, 4242, 4242)
    clock = Clock(OUTSIDE)
    daemon = make_daemon(config, RecordingRunner(clock), clock)
    with capture_logs() as logs:
        for i in range(3):
            clock.now = OUTSIDE + 5 * i
            daemon.tick()
        assert daemon.state.frozen is not None
        [refused] = events(logs, "unfreeze_request_refused")
        assert refused["owner"] == 4242
        assert not events(logs, "unfrozen")
        request.unlink()
        request.write_text('{"reason": "fixed it"}')  # `sudo specd unfreeze`
        clock.now += 5
        daemon.tick()
    assert daemon.state.frozen is None
    assert not os.path.lexists(request)


@pytest.mark.parametrize("fault", ["disk full", "read-only", "corrupted under us"])
@pytest.mark.parametrize("when", ["at start", "while running"])
def test_state_dir_faults_keep_the_daemon_running(tmp_path: Path, fault: str, when: str) -> None:
    with tmpfs(tmp_path / "state") as state_dir:
        config = make_config(tmp_path, free_port(), state_dir=state_dir)
        path = state_dir / STATE_FILE
        clock = Clock(OUTSIDE)
        filler: Path | None = None

        def inject() -> None:
            nonlocal filler
            if fault == "disk full":
                filler = fill(state_dir)
            elif fault == "read-only":
                remount(state_dir, "ro")
            else:
                path.write_text('{"version": 1, "history": {"trunc')

        if when == "at start":
            path.write_text(valid_state_text(tmp_path, config))
            inject()
        with capture_logs() as logs:
            daemon = make_daemon(config, RecordingRunner(clock), clock)
            loaded_errors = sample(daemon, "specd_state_load_errors_total")
            daemon.tick()
            if when == "while running":
                inject()
            for i in range(1, 4):
                clock.now = OUTSIDE + i * (STATE_SAVE_INTERVAL_S + 1)
                assert daemon.tick().reason is Reason.NO_DATA
            write_errors = sample(daemon, "specd_state_write_errors_total")
            # Repair: free the space / remount rw; the next save must succeed.
            if filler is not None:
                filler.unlink()
            if fault == "read-only":
                remount(state_dir, "rw")
            clock.now += STATE_SAVE_INTERVAL_S + 1
            daemon.tick()
        corrupt_at_start = fault == "corrupted under us" and when == "at start"
        assert loaded_errors == (1 if corrupt_at_start else 0)
        if fault == "corrupted under us":
            # The daemon never re-reads its own file: the next save replaces the damage.
            assert write_errors == 0
        else:
            # Every save attempt failed (the first tick's too when the fault came first).
            expected = 4 if when == "at start" else 3
            assert write_errors == expected
            failed = events(logs, "state_write_failed")
            assert len(failed) == expected
            assert all("\n" not in e["error"] for e in failed)
        assert sample(daemon, "specd_state_write_errors_total") == write_errors
        state, problem = StateStore(state_dir).load()
        assert problem is None, problem
        assert state.last_decision["t"] == clock.now
        if when == "at start" and not corrupt_at_start:
            assert daemon.state.history.busy_seconds > 0
        if not corrupt_at_start:
            # The history it started with survived the fault (it was never "rebuilt" away).
            assert state.history.busy_seconds == daemon.state.history.busy_seconds
        assert sorted(p.name for p in state_dir.iterdir() if p.name.startswith(".")) == []


@pytest.mark.parametrize("fault", ["disk full", "read-only"])
def test_a_state_that_cannot_be_saved_holds_a_change_before_anything_is_run(
    tmp_path: Path, fault: str
) -> None:
    """A restart goes out only with its journal on disk. While saves fail, a change due in
    an open window holds (reason state_unsaved) before anything is run for it (no systemctl,
    no fleet slot, no quiet moment awaited), tick after tick; the save is tried again once
    a minute, not at every tick; the first tick after one succeeds makes the change."""
    with tmpfs(tmp_path / "state") as state_dir, ForkedTwin(twin_argv(3)) as twin:
        twin.wait_healthy()
        config = make_config(tmp_path, int(twin.url.rsplit(":", 1)[1]), state_dir=state_dir)
        clock = Clock(INSIDE)
        runner = RecordingRunner(clock)
        filler = fill(state_dir) if fault == "disk full" else None
        if fault == "read-only":
            remount(state_dir, "ro")
        with capture_logs() as logs:
            daemon = make_daemon(config, runner, clock)
            first = daemon.tick()  # nothing to change yet; its save fails
            assert first.reason is Reason.INSUFFICIENT_DATA, first
            ran = len(runner.calls)
            daemon.state.history = wanting(config, 4, clock.now)
            held = []
            for _ in range(30):  # 150 s of ticks, 5 s apart
                clock.now += 5
                held.append(daemon.tick())
            assert {(d.reason, d.target_steps) for d in held} == {(Reason.STATE_UNSAVED, 4)}
            error = "No space left on device" if fault == "disk full" else "Read-only file system"
            assert error in held[-1].message, held[-1].message
            assert held[-1].message.endswith("3 → 4 waits"), held[-1].message
            assert sample(daemon, "specd_last_decision", {"reason": "state_unsaved"}) == 1
            assert runner.calls[ran:] == []
            assert events(logs, "restart_begin") == []
            # Tried again once a minute (and when the decision first held), not every tick.
            failed = len(events(logs, "state_write_failed"))
            assert 3 <= failed <= 5, failed
            assert sample(daemon, "specd_state_write_errors_total") == failed
            if filler is not None:
                filler.unlink()
            else:
                remount(state_dir, "rw")
            clock.now += STATE_SAVE_INTERVAL_S
            decision = daemon.tick()
        assert (decision.reason, decision.target_steps) == (Reason.CHANGE, 4), decision
        assert len(events(logs, "restart_begin")) == 1
        assert runner.calls[ran:], "the change went to the applier"
        assert len(events(logs, "state_write_failed")) == failed


# ---- a real `specd run` subprocess: signals ----------------------------------------


def wait_for(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1, verify=verifying_context()).status_code == 200
    except httpx.HTTPError:
        return False


def write_config(path: Path, tmp_path: Path, port: int, metrics_port: int, **extra: Any) -> None:
    path.write_text(config_text(tmp_path, port, metrics_port, **extra))


def config_text(tmp_path: Path, port: int, metrics_port: int, **extra: Any) -> str:
    values: dict[str, Any] = {
        "url": f"http://127.0.0.1:{port}",
        "state_dir": str(tmp_path / "state"),
        "env_file": str(tmp_path / "sglang.env"),
        "override_file": str(tmp_path / "override.toml"),
        "metrics_port": metrics_port,
        # A quarter second: a reload or a restart shows in the metrics at the next tick,
        # which the tests wait for (a tick of an idle daemon is ~3 ms of CPU here).
        "scrape_interval_s": 0.25,
        "health_probe_timeout_s": 25,
        "health_poll_interval_s": 0.2,  # as in make_config: the twin loads in a blink
        "startup_timeout_s": 30,
        "log_format": "json",
        **extra,
    }
    data = tables(**values)
    # [sglang] last: the file cut short before it names no server (a default one is taken).
    return tomli_w.dumps({key: data[key] for key in sorted(data, key=lambda key: key == "sglang")})


def daemon_env(standin: StandIn, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPECD_", "NOTIFY_"))}
    env["PATH"] = f"{standin.bin_dir}:{env.get('PATH', '/usr/bin:/bin')}"
    env["PYTHONUNBUFFERED"] = "1"
    return {**env, **extra}


def start_specd(
    config_path: Path, env: dict[str, str], log: Path, *, fresh: bool = False
) -> subprocess.Popen[bytes] | ForkedProc:
    """`specd run --config CONFIG_PATH` in ``env``, its output in ``log``: a process of its
    own, forked by the zygote (tests/twin_zygote.py) from an interpreter that imported the
    daemon once (~0.45 s of CPU each start otherwise), or with ``fresh`` a new interpreter
    (`python -m specd.cli`: the entry point itself, kept by the tests that own it)."""
    argv = ["run", "--config", str(config_path)]
    with open(log, "wb") as out:
        if fresh:
            return subprocess.Popen(
                [sys.executable, "-m", "specd.cli", *argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=REPO,
            )
    return ZYGOTE.spawn(argv[1:], str(log), command="run", env=env, cwd=str(REPO))


def log_events(log: Path) -> list[dict[str, Any]]:
    found = []
    for line in log.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            found.append(json.loads(line))
    return found


def metric(port: int, name: str) -> float | None:
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        text = httpx.get(url, timeout=5, verify=verifying_context()).text
    except httpx.HTTPError:
        return None  # not serving (yet)
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                stat = (entry / "stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
    return found


@pytest.fixture
def specd_setup(tmp_path: Path) -> Iterator[tuple[StandIn, Path, int]]:
    port, metrics_port = free_port(), free_port()
    # Started by the test at 3 steps, fast; specd's restart to 4 loads for 2.5 s, long
    # enough to signal specd while it waits for SGLang.
    standin = quick_standin(
        tmp_path,
        port,
        extra_by_steps={4: ("--load-time-s", "2.5", "--warmup-s", "0.1", *QUICK_HEALTH)},
    )
    (tmp_path / "state").mkdir()
    assert standin.systemctl("--no-ask-password", "restart", UNIT).returncode == 0
    try:
        wait_for(lambda: healthy(standin.url()), 20, "the twin unit")
        yield standin, tmp_path / "specd.toml", metrics_port
    finally:
        standin.stop()


def test_several_sighups_at_once_reload_once_and_keep_serving(
    tmp_path: Path, specd_setup: tuple[StandIn, Path, int]
) -> None:
    standin, config_path, metrics_port = specd_setup
    write_config(config_path, tmp_path, standin.port, metrics_port, daily_restart_budget=4)
    log = tmp_path / "specd.log"
    proc = start_specd(config_path, daemon_env(standin), log)
    try:
        wait_for(
            lambda: (
                metric(metrics_port, "specd_restart_budget_remaining") == 4
                if proc.poll() is None
                else True
            ),
            20,
            "specd's metrics",
        )
        assert proc.poll() is None, log.read_text()
        write_config(config_path, tmp_path, standin.port, metrics_port, daily_restart_budget=3)
        for _ in range(8):
            proc.send_signal(signal.SIGHUP)
        wait_for(
            lambda: metric(metrics_port, "specd_restart_budget_remaining") == 3, 10, "the reload"
        )
        time.sleep(1.0)  # a few more ticks: any late reload or crash would show now
        assert proc.poll() is None, log.read_text()
        # One process: nothing forked or left behind. A systemctl call of a restart in
        # progress is a child for a moment (CI caught one), so wait for the daemon to be idle;
        # a leaked or unreaped child would stay.
        wait_for(lambda: children_of(proc.pid) == [], 30, "no child process left")
        reloads = events_named(log, "reloaded")
        assert 1 <= len(reloads) <= 8
        assert reloads[0]["changed"] == {"restart.daily_restart_budget": 3}
        assert all(r["changed"] == {} for r in reloads[1:])
        assert metric(metrics_port, "specd_sglang_up") == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert standin.restarts == [3]  # only the test's own start of the unit


def events_named(log: Path, name: str) -> list[dict[str, Any]]:
    return [e for e in log_events(log) if e.get("event") == name]


def test_a_sighup_re_reads_the_override_but_says_it_loaded_only_when_it_changed(
    tmp_path: Path, specd_setup: tuple[StandIn, Path, int]
) -> None:
    """A reload re-judged the override file, rightly (the new bounds may change what it
    means), but logged `override_loaded` again for a file nobody touched: the on-call read
    it as a new override at every `systemctl reload specd`."""
    standin, config_path, metrics_port = specd_setup
    write_config(config_path, tmp_path, standin.port, metrics_port)
    override = tmp_path / "override.toml"
    freeze = 'mode = "freeze"\nexpires_at = 2099-01-01T00:00:00Z\nreason = "{}"\n'
    override.write_text(freeze.format("investigating"))
    override.chmod(0o600)
    log = tmp_path / "specd.log"
    proc = start_specd(config_path, daemon_env(standin), log)

    def reload_and_tick(reloads: int) -> None:
        proc.send_signal(signal.SIGHUP)
        wait_for(
            lambda: len(events_named(log, "reloaded")) == reloads or proc.poll() is not None,
            10,
            "the reload",
        )
        scrapes = metric(metrics_port, "specd_scrapes_total") or 0
        wait_for(
            lambda: (metric(metrics_port, "specd_scrapes_total") or 0) >= scrapes + 2,
            10,
            "two ticks after the reload",
        )

    try:
        wait_for(
            lambda: events_named(log, "override_loaded") or proc.poll() is not None,
            20,
            "the override",
        )
        assert proc.poll() is None, log.read_text()
        reload_and_tick(1)  # the same file, the same config
        write_config(config_path, tmp_path, standin.port, metrics_port, max_steps=5)
        reload_and_tick(2)  # new bounds, within which the freeze means the same
        override.write_text(freeze.format("still investigating"))
        reload_and_tick(3)  # a new file
        assert proc.poll() is None, log.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    loaded = [(e["mode"], e["reason"]) for e in events_named(log, "override_loaded")]
    assert loaded == [("freeze", "investigating"), ("freeze", "still investigating")]
    assert events_named(log, "override_ignored") == []


def test_sighup_and_sigterm_during_a_restart_finish_it_and_exit_0(
    tmp_path: Path, specd_setup: tuple[StandIn, Path, int]
) -> None:
    standin, config_path, metrics_port = specd_setup
    write_config(config_path, tmp_path, standin.port, metrics_port)
    # On-call pins 4 steps, now: the restart starts at specd's first tick.
    (tmp_path / "override.toml").write_text(
        'mode = "pin"\nsteps = 4\nexpires_at = 2099-01-01T00:00:00Z\n'
        'reason = "fault test"\napply = "now"\n'
    )
    log = tmp_path / "specd.log"
    # A new interpreter: `python -m specd.cli run`, as systemd starts it, takes the signals.
    proc = start_specd(config_path, daemon_env(standin), log, fresh=True)
    try:
        # The stand-in has restarted the unit: SGLang is loading (2.5 s) and specd waits.
        wait_for(lambda: standin.restarts == [3, 4] or proc.poll() is not None, 20, "restart")
        assert not healthy(standin.url())
        proc.send_signal(signal.SIGHUP)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=40) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    state, problem = StateStore(tmp_path / "state").load()
    assert problem is None
    assert state.journal is None
    assert [(r["from_steps"], r["to_steps"], r["result"]) for r in state.restarts] == [
        (3, 4, "success")
    ]
    assert "SPECULATIVE_NUM_STEPS=4" in standin.env_file.read_text()
    info = httpx.get(standin.url() + "/server_info", timeout=5).json()
    assert (info["speculative_num_steps"], info["speculative_num_draft_tokens"]) == (4, 5)
    assert standin.restarts == [3, 4]  # exactly one restart by specd, no rollback
    assert [e["event"] for e in log_events(log)][-1] == "stopped"


# ---- load: 8 DP ranks, a 5 MB page, scraped every second -----------------------------

LOAD_TICKS = 12


def test_eight_dp_ranks_and_a_five_megabyte_page_every_second(tmp_path: Path) -> None:
    port = free_port()
    config = make_config(tmp_path, port, scrape_interval_s=1.0, scrape_timeout_s=3.0)
    clock = Clock(0.0)
    runner = RecordingRunner(clock)
    flags = ("--dp-size", "8", "--metrics-pad-bytes", str(5_000_000))
    with ForkedTwin(twin_argv(3, *flags), port=port) as twin:
        twin.wait_healthy()
        info = httpx.get(twin.url + "/server_info", timeout=5).json()
        capacity = sum(s["effective_max_running_requests_per_dp"] for s in info["internal_states"])
        daemon = make_daemon(config, runner, clock)
        observations = []
        tick_cpu_s = []
        start = time.time()
        for i in range(LOAD_TICKS):
            # A scrape interval apart on the injected clock, back to back in real time:
            # what is asserted is each tick's own CPU, which no wait between them changes
            # (they slept out the rest of each real second: 12 s of the test's 13).
            clock.now = start + i * config.observe.scrape_interval_s
            cpu_before = time.thread_time()
            daemon.tick()
            tick_cpu_s.append(time.thread_time() - cpu_before)
            observations.append(daemon.last_obs)
        page = daemon.client.metrics_text()
    assert isinstance(page, str)
    assert len(page) > 5_000_000
    assert sample(daemon, "specd_scrapes_total") == LOAD_TICKS
    assert sum(scrape_errors(daemon).values()) == 0
    # Bounded: the work of every tick, page transfer and parse included, fits inside the
    # scrape interval. Counted in this thread's CPU time: wall time on a shared 2-core CI
    # box measures the other tests as well (bench/bench_observe.py measures wall and CPU).
    assert sample(daemon, "specd_tick_duration_seconds_count") == LOAD_TICKS
    assert max(tick_cpu_s) <= config.observe.scrape_interval_s, tick_cpu_s
    assert all(o is not None for o in observations)
    seen = {
        (o.dp_ranks, o.steps, o.draft_tokens, o.topk, o.max_running_requests)
        for o in observations
        if o is not None
    }
    assert seen == {(8, 3, 4, 1, capacity)}
    assert runner.calls == []


def _serving_with_budget(
    config_path: Path, standin: StandIn, metrics_port: int, log: Path, budget: int
) -> subprocess.Popen[bytes]:
    """A real `specd run` on ``config_path``, once its metrics show ``budget`` (the config's
    daily restart budget: which config it runs)."""
    proc = start_specd(config_path, daemon_env(standin), log)
    wait_for(
        lambda: (
            metric(metrics_port, "specd_restart_budget_remaining") == budget
            or proc.poll() is not None
        ),
        20,
        "specd's metrics",
    )
    assert proc.poll() is None, log.read_text()
    return proc


def _reload_rejected(proc: subprocess.Popen[bytes], metrics_port: int, log: Path) -> None:
    """SIGHUP, and wait for specd to say the reload was rejected; it must live on."""
    proc.send_signal(signal.SIGHUP)
    wait_for(
        lambda: metric(metrics_port, "specd_config_reload_success") == 0 or proc.poll() is not None,
        10,
        "the rejected reload",
    )
    assert proc.poll() is None, log.read_text()[-2000:]


@pytest.mark.parametrize(
    ("label", "bad", "said"),
    [
        ("unknown key", b"no_such_key = 1\n", "no_such_key: unknown key"),
        ("not TOML", b"this is = = not toml\n", "invalid TOML"),
        ("nested thousands deep", b"x = " + b"[" * 100_000 + b"\n", "invalid TOML"),
        ("not UTF-8", b"\xff\xfe = 1\n", "not UTF-8"),
        # What a reload reads in the middle of `cp new.toml specd.toml`: truncated, not
        # written yet. TOML reads it as no keys: it applied every default (another SGLang).
        ("empty", b"", "the file is empty (0 bytes)"),
        ("whitespace only", b"\n  \n", "the file is only whitespace (4 bytes)"),
        # Once logged `reloaded`; the next tick's os.open raised and ended specd.
        (
            "a NUL in a path",
            b'[files]\noverride_file = "/etc/specd/\\u0000.toml"\n',
            "files.override_file: holds a NUL character",
        ),
        # Python reads no integer of more than 4300 digits: a traceback at start.
        ("a 5000-digit integer", b"[observe]\nscrape_interval_s = " + b"1" * 5000, "invalid TOML"),
    ],
)
def test_a_rejected_reload_keeps_the_running_config_says_why_and_never_exits(
    tmp_path: Path, specd_setup: tuple[StandIn, Path, int], label: str, bad: bytes, said: str
) -> None:
    standin, config_path, metrics_port = specd_setup
    write_config(config_path, tmp_path, standin.port, metrics_port, daily_restart_budget=4)
    log = tmp_path / "specd.log"
    proc = _serving_with_budget(config_path, standin, metrics_port, log, 4)
    try:
        config_path.write_bytes(bad)
        _reload_rejected(proc, metrics_port, log)
        rejected = events_named(log, "reload_rejected")
        assert rejected, log.read_text()[-2000:]
        assert all("\n" not in str(e["problem"]) for e in rejected)
        assert said in rejected[0]["problem"], rejected
        assert metric(metrics_port, "specd_restart_budget_remaining") == 4  # old config
        assert (metric(metrics_port, "specd_config_reload_timestamp_seconds") or 0) > 0
        # The next good reload takes effect and clears the signal.
        write_config(config_path, tmp_path, standin.port, metrics_port, daily_restart_budget=3)
        proc.send_signal(signal.SIGHUP)
        wait_for(
            lambda: metric(metrics_port, "specd_restart_budget_remaining") == 3, 10, "the reload"
        )
        assert metric(metrics_port, "specd_config_reload_success") == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_an_impossible_calibration_stops_the_start_and_is_refused_at_reload(
    tmp_path: Path, specd_setup: tuple[StandIn, Path, int]
) -> None:
    standin, config_path, metrics_port = specd_setup
    cal = tmp_path / "cal.csv"
    cal.write_text("steps,concurrency,output_tok_s,accept_length\n1,1,100,50\n")
    problem = f"{cal}:2: accept_length 50 is more than steps + 1 = 2"
    write_config(config_path, tmp_path, standin.port, metrics_port, calibration_file=str(cal))
    log = tmp_path / "specd.log"
    proc = start_specd(config_path, daemon_env(standin), log)
    try:
        assert proc.wait(timeout=30) == 2
    finally:
        if proc.poll() is None:  # it started: not what this test wants, and not to leak
            proc.kill()
            proc.wait()
    assert [line for line in log.read_text().splitlines() if problem in line], log.read_text()
    # Running, it keeps its config when a reload brings the same table.
    write_config(config_path, tmp_path, standin.port, metrics_port, daily_restart_budget=4)
    proc = _serving_with_budget(config_path, standin, metrics_port, log, 4)
    try:
        write_config(
            config_path,
            tmp_path,
            standin.port,
            metrics_port,
            daily_restart_budget=3,
            calibration_file=str(cal),
        )
        _reload_rejected(proc, metrics_port, log)
        (rejected,) = events_named(log, "reload_rejected")
        assert problem in rejected["problem"]
        assert metric(metrics_port, "specd_restart_budget_remaining") == 4  # old config
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_reload_of_a_file_caught_mid_write_waits_for_it_and_applies_it_whole(
    tmp_path: Path, specd_setup: tuple[StandIn, Path, int]
) -> None:
    """`cp new.toml specd.toml` caught by the SIGHUP at a line: the half written file is
    still TOML, and specd applied it (here: no [sglang], so the default URL, another
    server). It now reads the file until it stops changing."""
    standin, config_path, metrics_port = specd_setup
    write_config(config_path, tmp_path, standin.port, metrics_port, daily_restart_budget=4)
    log = tmp_path / "specd.log"
    proc = _serving_with_budget(config_path, standin, metrics_port, log, 4)
    whole = config_text(tmp_path, standin.port, metrics_port, daily_restart_budget=3)
    try:
        config_path.write_text(whole[: whole.index("[sglang]")])
        proc.send_signal(signal.SIGHUP)
        time.sleep(0.15)  # well inside the 0.5 s specd waits before it reads again
        config_path.write_text(whole)
        wait_for(lambda: events_named(log, "reloaded") or proc.poll() is not None, 10, "the reload")
        assert proc.poll() is None, log.read_text()[-2000:]
        (reloaded,) = events_named(log, "reloaded")
        assert reloaded["changed"] == {"restart.daily_restart_budget": 3}
        assert events_named(log, "reload_rejected") == []
        # The gauges are published at the tick after the reload, not with its log line.
        wait_for(
            lambda: metric(metrics_port, "specd_restart_budget_remaining") == 3,
            10,
            "the new budget published",
        )
        assert metric(metrics_port, "specd_sglang_up") == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_reload_of_a_file_written_all_along_keeps_the_running_config_in_one_line(
    tmp_path: Path, specd_setup: tuple[StandIn, Path, int]
) -> None:
    """A file that never settles (rewritten every 50 ms: a tool in a loop, a slow copy) is
    not read at some moment of it: the running config stays, said once."""
    standin, config_path, metrics_port = specd_setup
    write_config(config_path, tmp_path, standin.port, metrics_port, daily_restart_budget=4)
    log = tmp_path / "specd.log"
    proc = _serving_with_budget(config_path, standin, metrics_port, log, 4)
    whole = config_text(tmp_path, standin.port, metrics_port, daily_restart_budget=3)
    done = threading.Event()

    def keep_writing() -> None:
        n = 0
        while not done.wait(0.05):
            n += 1
            config_path.write_text(f"{whole}# {n}\n")
        config_path.write_text(whole)

    writer = threading.Thread(target=keep_writing)
    writer.start()
    try:
        _reload_rejected(proc, metrics_port, log)
        done.set()
        writer.join()
        (rejected,) = events_named(log, "reload_rejected")
        assert rejected["problem"].startswith("still changing after 10 reads 0.5 s apart")
        assert metric(metrics_port, "specd_restart_budget_remaining") == 4  # old config
        # Written out, the next reload takes it.
        proc.send_signal(signal.SIGHUP)
        wait_for(
            lambda: metric(metrics_port, "specd_restart_budget_remaining") == 3, 10, "the reload"
        )
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        done.set()
        writer.join()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- values SGLang cannot produce: counted, logged once, never learned, no restart ----
def _lying_sglang(page_name: str, accept: str, **info_changes: Any) -> tuple[str, str]:
    fixtures = REPO / "tests" / "fixtures" / "metrics"
    info = json.loads((fixtures / "server_info-loaded.json").read_text())
    info.update(internal_states=[], **info_changes)
    # One request in flight, with an accept length no 4-step server can measure.
    values = {
        "sglang:num_running_reqs": "1.0",
        "sglang:num_queue_reqs": "0.0",
        "sglang:spec_accept_length": accept,
    }
    lines = []
    for line in (fixtures / page_name).read_text().splitlines():
        name = line.split("{", 1)[0]
        lines.append(f"{line.rsplit(' ', 1)[0]} {values[name]}" if name in values else line)
    return "\n".join(lines) + "\n", json.dumps(info)


@pytest.mark.parametrize(
    ("page_name", "accept", "info_changes", "rejected", "reason", "live"),
    [
        # The gauge still shows 4 steps: specd decides, on what it can trust.
        (
            "sglang-0.5.23-loaded.prom",
            "50.0",
            {"max_running_requests": -5, "speculative_num_steps": -3},
            {"max_running_requests", "steps", "accept_length"},
            Reason.WITHIN_TOLERANCE,
            4,
        ),
        # Before 0.5.13 /server_info is the only source: the live setting is unknown.
        (
            "pre-0.5.13.prom",
            "50.0",
            {"max_running_requests": -5, "speculative_num_steps": -3},
            # Steps unknown: 50 is within the widest bound, and never learned per step.
            {"max_running_requests", "steps"},
            Reason.NO_DATA,
            None,
        ),
        # A 0/0 accept length: that field unknown, SGLang still up (it failed the scrape).
        ("sglang-0.5.23-loaded.prom", "NaN", {}, {"accept_length"}, Reason.WITHIN_TOLERANCE, 4),
    ],
    ids=["0.5.23", "0.5.12", "accept-length-nan"],
)
def test_impossible_values_are_counted_never_learned_and_never_restart(
    tmp_path: Path,
    page_name: str,
    accept: str,
    info_changes: dict[str, Any],
    rejected: set[str],
    reason: Reason,
    live: int | None,
) -> None:
    metrics, info = _lying_sglang(page_name, accept, **info_changes)
    with page_server() as sglang:
        sglang.serve("/metrics", metrics)
        sglang.serve("/server_info", info)
        port = int(sglang.url.rsplit(":", 1)[1])
        config = make_config(tmp_path, port)
        clock = Clock(INSIDE)  # inside the window: only the values could cause a restart
        runner = RecordingRunner(clock)
        with capture_logs() as logs:
            daemon = make_daemon(config, runner, clock)
            daemon.state.history = wanting(config, 4, clock.now)
            learned = daemon.state.history.to_dict()
            ticks = 6
            for i in range(ticks):
                clock.now = INSIDE + 5 * i
                decision = daemon.tick()
                assert decision.reason is reason, decision
            daemon._save_state(force=True)
    assert runner.calls == []
    assert daemon.last_obs is not None
    assert daemon.last_obs.steps == live
    assert set(daemon.last_obs.rejected) == rejected
    for name in rejected:
        # Counted on every scrape, logged once with the value SGLang sent.
        assert sample(daemon, "specd_sglang_rejected_values_total", {"field": name}) == ticks
        lines = [e for e in events(logs, "sglang_value_rejected") if e["field"] == name]
        assert len(lines) == 1, lines
        assert lines[0]["value"] in ("-5", "-3", "50.0", "NaN")
    assert sum(scrape_errors(daemon).values()) == 0
    assert sample(daemon, "specd_sglang_up") == 1
    # Nothing impossible reached what specd keeps; the next start loads it all.
    state, problem = StateStore(Path(config.files.state_dir)).load()
    assert problem is None
    history = state.history
    assert all(v >= 1 for v in history.capacities.values())
    assert history.accept_length(4) == daemon.state.history.accept_length(4)
    assert (history.accept_length(4) or 0) < 5.0
    if "max_running_requests" in rejected:
        assert history.to_dict()["capacity"] == learned["capacity"]


@pytest.mark.parametrize(
    ("info_changes", "version"),
    [
        # int() refuses more than 4300 digits: it once ended specd at its first tick.
        ({"version": "0.5." + "9" * 5000}, "unknown"),
        # Valid JSON, no Unicode text: the history keyed the set by it and raised.
        (
            {"speculative_adaptive": True, "speculative_adaptive_config": "/x/\ud800.json"},
            "unread",
        ),
    ],
    ids=["5000-digit-version", "lone-surrogate-config-name"],
)
def test_server_info_no_version_or_text_could_hold_never_ends_the_daemon(
    tmp_path: Path, info_changes: dict[str, Any], version: str
) -> None:
    metrics, info = _lying_sglang("sglang-0.5.23-loaded.prom", "3.0", **info_changes)
    with page_server() as sglang:
        sglang.serve("/metrics", metrics)
        sglang.serve("/server_info", info)
        config = make_config(tmp_path, int(sglang.url.rsplit(":", 1)[1]))
        clock = Clock(INSIDE)
        runner = RecordingRunner(clock)
        daemon = make_daemon(config, runner, clock)
        daemon.state.history = wanting(config, 4, clock.now)
        for i in range(4):
            clock.now = INSIDE + 5 * i
            daemon.tick()
        daemon._save_state(force=True)
    assert runner.calls == []
    assert daemon.last_obs is not None
    # /metrics still tells the live step count; /server_info's version is unknown, or the
    # answer unread (malformed: read again at the next scrape).
    assert daemon.last_obs.steps == 4
    info_read = daemon.client.last_server_info
    if version == "unread":
        assert info_read is None
    else:
        assert info_read is not None
        assert traits_from_server_info(info_read).version is None
    _, problem = StateStore(Path(config.files.state_dir)).load()
    assert problem is None
