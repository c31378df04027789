"""`specd run`: the daemon loop, observe → record → decide → apply → report.

One thread runs the loop; every wait in it is ``Event.wait`` so SIGTERM and SIGHUP
interrupt it at once. systemd's watchdog is fed only by that thread's heartbeat: it beats
on every tick and on every slice of every wait — between ticks, inside a restart sequence
(``BeatingEvent``), while a `systemctl restart` runs (the runner) and while a read from
SGLang waits (the reader). Each of those waits is bounded, so a loop stuck anywhere else
stops the beats and systemd kills and restarts specd within WatchdogSec=, while a long,
healthy restart of a 100B model is not killed.

A restart sequence (up to two SGLang loads of ``startup_timeout_s`` each) never runs inside
systemd's start or stop timeout unguarded. READY=1 goes out before any sequence begins —
the replay of an interrupted one at start, or one the first tick starts — so the start
timeout never cuts SGLang's load short; no decision is made until a replay ends. A stop
(SIGTERM) finishes a sequence in flight, within specd.service's TimeoutStopSec=, which is
as long as a whole sequence at the default timeouts; each heartbeat meanwhile extends that
timeout (EXTEND_TIMEOUT_USEC=) by one watchdog period, with STATUS= saying what it waits
for. systemd runs no watchdog while a unit stops, and forgets those extensions at a
`systemctl daemon-reload` (it re-arms the stop timeout from TimeoutStopSec= alone), so
specd watches itself instead (``StopGuard``): a loop that has not beaten for WatchdogSec=
while specd stops ends the process (SIGABRT, as systemd's watchdog would), its journal left
for the next start. At the system's shutdown the applier leaves the sequence instead
(``ApplyOutcome.pending``): its journal stays in state.json for the next start, after the
reboot, to finish.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from types import FrameType
from typing import Any, Protocol

from prometheus_client import CollectorRegistry

from specd.core import windows
from specd.core.choices import as_applied
from specd.core.decide import Decision, Reason, window_left_s
from specd.core.history import History, HistorySettings, Recorded
from specd.core.model import Calibration, restart_extra_s
from specd.core.observation import Observation, ScrapeError
from specd.core.override import Override
from specd.core.setting import (
    UNLISTED_SET,
    ServerTraits,
    SpecSetting,
    format_setting,
    outside_steps,
    static,
    traits_from_server_info,
)
from specd.core.setting import parse as parse_setting
from specd.core.step import StepContext, StepResult, step
from specd.core.text import iso_time, one_line, utc_time
from specd.core.units import DAY_S
from specd.io import config as config_io
from specd.io import files, logs
from specd.io.apply import (
    TERMINAL_RESULTS,
    Applier,
    ApplyOutcome,
    restart_needs_s,
    setting_of_steps,
)
from specd.io.calibration import CalibrationFile
from specd.io.config import Config, ConfigError, config_changes, load_config
from specd.io.fleet import Fleet, FleetHooks
from specd.io.gateway import IDLE_PROBE_S, GatewayClient, GatewayWatch
from specd.io.metrics import OFFERED_QUANTILES, Metrics
from specd.io.metrics_http import MetricsServer
from specd.io.notify import Notifier
from specd.io.override import OverrideStatus, read_override
from specd.io.runner import Runner, SubprocessRunner
from specd.io.sglang import SGLangClient
from specd.io.state import STATE_SAVE_INTERVAL_S, UNFREEZE_REQUEST, StateStore
from specd.io.writable import env_file_unwritable

# `specd unfreeze` writes a one-line JSON object; the reason is free text from the operator.
MAX_UNFREEZE_REQUEST_BYTES = 64 * 1024
# Re-log an unchanged decision this often, so the journal shows specd is alive and why
# it is not acting, without a line every scrape.
DECISION_RELOG_S = 600.0
# While SGLang cannot be scraped, say so again this often (with how long and how many
# failures), not every scrape: a 100 s restart or an hour-long outage is a few lines.
SCRAPE_FAILED_RELOG_S = 300.0
# A failure of a new kind or reason is said at once, up to this many per outage (a reason
# that carries a value changing every scrape must not bring the flood back).
SCRAPE_FAILED_MAX_DISTINCT = 8
# An SGLang that fails every other scrape began an outage at every other scrape, each said
# from its start (a line when it fails, one when it is back: 35,000 lines a day). Once this
# many began within SCRAPE_FAILED_RELOG_S, a failure goes on with the last one instead,
# said (and its recoveries) as rarely as a long outage.
FLAPPING_OUTAGES = 3
# The wait between ticks beats at least this often (and at least 4 times a watchdog period).
IDLE_SLICE_S = 1.0
# The wall clock moved this much more (or less) than the monotonic clock between two reads:
# it was stepped (NTP, `date -s`). Slewing moves it by milliseconds a minute.
CLOCK_STEP_S = 30.0
# How far one extension of systemd's stop timeout reaches while a stop waits for a restart
# in flight, when no WatchdogSec= gives the period the loop beats within (the shipped unit
# sets 60 s, and then that period is used).
STOP_EXTEND_S = 60.0
# A stop whose loop has not beaten for a watchdog period ends the process: how long its one
# line (and the threads' tracebacks) may take to be written before it ends anyway (a loop
# hung inside a write to the journal holds the log's lock).
STOP_HUNG_SAY_S = 5.0
# The longest wait after ticks that raised in a row (doubling from the scrape interval): an
# error that comes back every tick is logged a few times an hour, not every second.
TICK_BACKOFF_MAX_S = 300.0
# A change refused before anything was done (SGLang stopped by the on-call, a unit that no
# longer reads the env file, a key SGLang refuses) is refused again at the next tick: the
# same change is tried again this long after, and the same refusal said again after
# DECISION_RELOG_S, not a restart_begin and a restart_aborted every scrape.
REFUSED_RETRY_S = 60.0
# The journal phases in which SGLang is down on purpose: restarted by specd (the change or
# its rollback) and not yet verified (specd_sglang_restarting; SGLangDown keeps quiet).
RESTARTING_PHASES = frozenset({"restart_issued", "verifying", "rolling_back"})


def utc(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=timezone.utc)


class BeatingEvent(threading.Event):
    """A stop event whose waits prove the loop alive.

    The restart sequence in `apply` waits on this event for minutes (quiet moment,
    model load); each wait slice records a heartbeat, so the watchdog keeps being fed
    exactly as long as the loop keeps reaching its waits.
    """

    def __init__(self, beat: Callable[[], None], slice_s: float = 1.0) -> None:
        super().__init__()
        self._beat = beat
        self._slice_s = slice_s

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._beat()
            left = self._slice_s if deadline is None else deadline - time.monotonic()
            if left <= 0:
                return self.is_set()
            if super().wait(min(left, self._slice_s)):
                return True


class StopGuard:
    """systemd's watchdog for a stop, kept in the process: systemd runs none while a unit
    stops, and specd.service's TimeoutStopSec= is as long as a whole restart sequence (a
    stop finishes the one in flight, and an extension of that timeout does not survive a
    `systemctl daemon-reload`). A thread of its own looks every quarter period: once
    ``stopping()``, a loop silent for longer than ``period_s`` since ``beaten_at()`` (the
    time.monotonic() of its last beat) is ``hung(silent_s)``, once."""

    def __init__(
        self,
        period_s: float,
        *,
        beaten_at: Callable[[], float],
        stopping: Callable[[], bool],
        hung: Callable[[float], None],
    ) -> None:
        self.period_s = period_s
        self._beaten_at = beaten_at
        self._stopping = stopping
        self._hung = hung
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="specd-stop-guard", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        look_s = min(IDLE_SLICE_S, self.period_s / 4)
        while not self._closed.wait(look_s):
            if not self._stopping():
                continue
            silent = time.monotonic() - self._beaten_at()
            if silent > self.period_s:
                self._hung(silent)
                return

    def close(self) -> None:
        """The loop has ended (run() returns): nothing more to watch."""
        self._closed.set()
        self._thread.join()


class SGLangReader(Protocol):
    """What the loop needs of the SGLang reader (`specd.io.sglang.SGLangClient`)."""

    def observe(self) -> Observation | ScrapeError: ...

    def close(self) -> None: ...


class RestartApplier(Protocol):
    """What the loop needs of the applier (`specd.io.apply.Applier`)."""

    def apply_setting(
        self,
        target: SpecSetting,
        current: SpecSetting | None,
        *,
        window_open: Callable[[], bool],
        force: bool = False,
        cancelled: Callable[[], str | None] | None = None,
    ) -> ApplyOutcome: ...

    def reconcile(self, journal_data: Mapping[str, Any] | None) -> ApplyOutcome | None: ...

    def stop_timeout_s(self) -> float: ...

    def read_stop_timeout(self) -> None: ...

    def read_wiring(self) -> str | None: ...

    def readd_left_out(self, drained: list[dict[str, Any]]) -> str | None: ...

    def retry_mark_in(self, *, serving: bool = False) -> str | None: ...


@dataclass
class InFlight:
    """The restart sequence the loop is in: the change (settings as the operator writes
    them), whether it is the replay of one a previous specd left unfinished, the phase its
    journal was last saved in, and when systemd's stop timeout was last extended for it."""

    was: str
    wanted: str
    replay: bool = False
    phase: str | None = None
    extended_at: float | None = None  # time.monotonic()
    forced: bool = False  # a pin applied now: no window needed


@dataclass
class Refused:
    """The last change refused before anything was done: which, why, when it was last tried
    and said, and how many times in a row it was refused."""

    wanted: str
    message: str
    tried_at: float
    said_at: float
    times: int = 1


@dataclass
class ScrapeOutage:
    """SGLang cannot be scraped since ``since``: what the journal was told of it."""

    since: float
    failures: int = 0
    logged_at: float = 0.0
    said: set[tuple[str, str]] = field(default_factory=set)  # (kind, reason) logged
    ended_at: float | None = None  # the last good scrape since (an outage that may resume)
    recovered_said_at: float | None = None  # scrape_recovered last logged


def _boot_clock() -> Callable[[], float]:
    """Seconds since boot, counting suspend (where the system has such a clock): the
    clock a wall-clock step is told from time passing by."""
    boottime = getattr(time, "CLOCK_BOOTTIME", None)
    if boottime is None:
        return time.monotonic
    return functools.partial(time.clock_gettime, boottime)


@dataclass
class OverrideTracker:
    """The override: the last valid file content; invalid files are ignored.
    ``judged_by``: the path, step bounds and listed sets the file was last read with (a
    reload may change them, and with them what the same file means). ``lapsed``: its expiry has
    passed (said once); a clock stepped back before it puts it in force again. ``since``:
    when ``good`` was decided, from its file (`decided_at`), so a restart of specd reads the
    same time again. ``shift_s``: the wall clock's steps since the file was read, which
    move its decision time as they move every record (`Daemon._shift_records`): a pin
    applied now counts its own restarts from it."""

    good: Override | None = None
    since: float | None = None
    fingerprint: object = None
    status: OverrideStatus | None = None
    judged_by: object = None
    lapsed: bool = False
    shift_s: float = 0.0

    @property
    def in_force(self) -> Override | None:
        """The pin or freeze in force, or None."""
        good = self.good
        return None if good is None or good.mode == "auto" or self.lapsed else good


class Daemon:
    def __init__(
        self,
        config: Config,
        config_path: Path | None = None,
        *,
        registry: CollectorRegistry | None = None,
        runner: Runner | None = None,
        clock: Callable[[], float] = time.time,
        notifier: Notifier | None = None,
        allowed_override_uids: tuple[int, ...] | None = None,
        reader: SGLangReader | None = None,
        applier: RestartApplier | None = None,
        monotonic: Callable[[], float] | None = None,
    ) -> None:
        """``clock`` is the wall clock (unix time). ``monotonic`` only moves forward, to
        tell a step of the wall clock from time passing (`_now`); None: the boot clock when
        ``clock`` is the real `time.time`, else no step is looked for (an injected wall
        clock moves as its caller says)."""
        self.config = config
        self.config_path = _named(config_path)
        self.clock = clock
        if monotonic is None and clock is time.time:
            monotonic = _boot_clock()
        self.monotonic = monotonic
        self._clock_read: tuple[float, float] | None = None  # (wall, monotonic) last read
        self.log = logs.get_logger()
        self.metrics = Metrics(
            registry,
            reasons=[r.value for r in Reason],
            steps=range(config.choose.min_steps, config.choose.max_steps + 1),
            settings=_regressing_settings(config),
        )
        self.metrics.start_time.set(clock())
        self.notifier = notifier or Notifier()
        self.runner: Runner = runner or SubprocessRunner(beat=self._heartbeat)
        self.allowed_override_uids = allowed_override_uids or (0, os.getuid())

        self.stop_event = BeatingEvent(self._heartbeat)
        # The loop's last beat (time.monotonic()), for the StopGuard; and how the guard ends
        # a process whose loop hangs while it stops (tests replace it).
        self._beaten_at = time.monotonic()
        self._window_gauges_at = 0.0  # time.monotonic() of their last update
        self.end_process: Callable[[], None] = os.abort
        self._wake = threading.Event()
        self._reload_requested = threading.Event()
        self._signal_fd = -1  # the signal handlers' pipe (`install_signal_handlers`)
        self.metrics_port: int | None = None
        self._metrics_server: MetricsServer | None = None

        self.store = StateStore(
            Path(config.files.state_dir),
            history_settings=HistorySettings.from_config(config),
            clock=self.clock,
        )
        self.state, problem = self.store.load()
        if problem:
            self.metrics.state_load_errors.inc()
            self.log.error("state_load_failed", problem=problem)
        # The client stamps observations with the daemon's clock: decide compares that stamp
        # with `now`, and two different clocks would make every observation look stale.
        # Injected reader and applier (replay's proof, tests) are kept across reloads.
        self._injected = reader is not None, applier is not None
        self.client: SGLangReader = reader or SGLangClient(
            config.sglang.url,
            timeout_s=config.observe.scrape_timeout_s,
            clock=self.clock,
            beat=self._heartbeat,
            api_key=config.sglang.server_api_key_file,
        )
        self.applier: RestartApplier = applier or self._make_applier(config, self.client)
        self.gateway = self._make_gateway(config)
        self.calibration = CalibrationFile(config.choose.calibration_file)
        self.override = OverrideTracker()
        self.last_obs: Observation | None = None
        # When SGLang was last seen: a scrape that answered, or the end of a restart sequence
        # (the applier watches it meanwhile); at start, the history's last observation.
        self._seen_at: float | None = self.state.history.last_t
        self._outage: ScrapeOutage | None = None  # scrapes failing since, what was logged
        self._outages_began: deque[float] = deque(maxlen=FLAPPING_OUTAGES)
        self._rejected_logged: set[str] = set()
        self._calibration_problem: str | None = None  # the one last logged
        # What SGLang runs per the latest tick's observation; None after a failed scrape.
        self.live_steps: int | None = None
        self.live_adaptive = False  # SGLang runs its adaptive mode (live_steps is then None)
        self.live_name: str | None = None  # what it runs, as the operator writes it
        self._algorithm_seen: str | None = None  # the last speculative algorithm SGLang named
        self._static_only: str | None = None  # why the unit takes static K only (its wiring)
        self.last_decision: Decision | None = None
        self._last_logged: tuple[str, str | int | None] | None = None
        self._last_decision_key: object = None
        self._last_logged_at = 0.0
        self._last_saved_at = 0.0
        # The last save's error (None: it succeeded, or none was tried): while it stands,
        # no restart starts (reason state_unsaved).
        self._save_error: str | None = None
        self._ready_sent = False
        self._in_flight: InFlight | None = None
        self._refused: Refused | None = None
        # A worker left out of the gateway: when it was last re-added (_readd_left_out).
        self._readd_tried_at: float | None = None
        self._mark_in_tried_at: float | None = None
        self._gateway_changed = False  # what status shows of the gateway changed this tick
        # An unfreeze request honoured but not removable (a directory): (dev, inode, mtime),
        # so that it unfreezes once, not every later freeze at the next tick.
        self._unremovable_unfreeze: tuple[int, int, int] | None = None
        self._tick_failures = 0  # ticks that raised in a row (_guarded_tick's backoff)

    # -- wiring -------------------------------------------------------------------
    def _make_applier(self, config: Config, client: SGLangReader) -> Applier:
        assert isinstance(client, SGLangClient)
        return Applier.from_settings(
            config,
            client,
            self.runner,
            self._persist_journal,
            self.stop_event,
            clock=self.clock,
            fleet=self._make_fleet(config),
            on_gateway_error=self._gateway_error,
        )

    def _make_fleet(self, config: Config) -> Fleet | None:
        if config.fleet is None:
            return None
        m = self.metrics
        hooks = FleetHooks(
            error=lambda kind: m.fleet_etcd_errors.labels(kind=kind).inc(),
            held=lambda slot: m.set_fleet_slot(None if slot is None else slot.taken_at),
            waited=m.fleet_slot_wait.observe,
            out=lambda marked: m.fleet_marked_out.set(1 if marked else 0),
            clash=m.fleet_name_clashes.inc,
            beat=self._heartbeat,
        )
        return Fleet.from_settings(config.fleet, config.sglang.unit, hooks, clock=self.clock)

    @property
    def fleet(self) -> Fleet | None:
        """The applier's fleet (None: no [fleet], or an injected applier without one)."""
        fleet = getattr(self.applier, "fleet", None)
        return fleet if isinstance(fleet, Fleet) else None

    def _make_gateway(self, config: Config) -> GatewayWatch | None:
        if config.gateway is None:
            return None
        return GatewayWatch(
            GatewayClient.from_settings(
                config.gateway,
                config.sglang.url,
                on_error=self._gateway_error,
                beat=self._heartbeat,
            )
        )

    def _gateway_error(self, kind: str) -> None:
        self.metrics.gateway_errors.labels(kind=kind).inc()

    def _persist_journal(self, journal: dict[str, Any] | None) -> str | None:
        self.state.journal = journal
        self._show_restarting(journal)
        error = self._save_state(force=True)
        flight = self._in_flight
        if flight is not None and journal is not None:
            self._watch_window(flight, journal)
            # Each step is saved before it is taken: STATUS= follows the sequence.
            flight.phase = str(journal.get("phase"))
            self.notifier.status(self._flight_status(flight))
        return error

    def _watch_window(self, flight: InFlight, journal: Mapping[str, Any]) -> None:
        """specd's promise, watched where it is kept: a change's restart goes out inside a
        window (a pin applied now, a rollback and a sequence an earlier run left are not
        held to one). One that does not is a bug: counted and logged, for an alert."""
        issued = journal.get("phase") == "restart_issued" and flight.phase != "restart_issued"
        if not issued or flight.forced or flight.replay:
            return
        if windows.is_open(self.config.windows, utc(self.clock())):
            return
        self.metrics.restarts_outside_window.inc()
        self.log.error(
            "restart_outside_window",
            change=f"{flight.was} → {flight.wanted}",
            windows=[w.cron for w in self.config.windows],
        )

    def _show_restarting(self, journal: object) -> None:
        """specd_sglang_restarting from the journal's phase: SGLang down on purpose from the
        restart (or the rollback) on, not while the sequence waits with SGLang serving."""
        phase = journal.get("phase") if isinstance(journal, Mapping) else None
        self.metrics.sglang_restarting.set(1 if phase in RESTARTING_PHASES else 0)

    def _heartbeat(self) -> None:
        """The loop is alive: feeds systemd's watchdog (rate-limited by the notifier) and,
        while specd stops, the StopGuard; while a stop waits for a restart in flight, it
        extends the stop timeout too."""
        self._beaten_at = time.monotonic()
        self.notifier.beat()
        flight = self._in_flight
        if (
            flight is not None
            and self._beaten_at - self._window_gauges_at >= self.config.observe.scrape_interval_s
        ):
            # A window opens or closes while a sequence holds the loop: said as it happens
            # (a dashboard showing the window closed beside a restart in progress says
            # specd restarted outside it).
            self._window_gauges(self.clock())
        # Before its journal exists a sequence has restarted nothing, and a stop ends it at
        # once; from then on it may have a drained worker to re-add (ready_timeout_s) even
        # when the stop ends it before the restart, or a restart to finish.
        if flight is not None and flight.phase is not None and self.stop_event.is_set():
            self._extend_stop(flight)

    def _extend_stop(self, flight: InFlight) -> None:
        """Extend systemd's stop timeout by one watchdog period, every half period, while
        the loop beats: the stop lasts as long as the sequence (each of its waits bounded by
        the config), also past a TimeoutStopSec= shorter than that (longer timeouts than
        the defaults), as long as no daemon-reload comes (systemd forgets an extension
        there). A loop that hangs is ended by the StopGuard one period after its last beat
        (systemd only at TimeoutStopSec= or the extension's end, whichever is later)."""
        period = self.notifier.watchdog_period_s or STOP_EXTEND_S
        now = time.monotonic()
        first = flight.extended_at is None
        if flight.extended_at is not None and now - flight.extended_at < period / 2:
            return
        flight.extended_at = now
        status = self._flight_status(flight)
        if first:
            # SIGTERM from outside systemd (`kill`): STOPPING=1 gives the unit its stop
            # state, whose timeout the extension applies to.
            self.notifier.stopping(status)
            self.log.warning(
                "stop_waits_for_restart",
                from_setting=flight.was,
                to_setting=flight.wanted,
                phase=flight.phase,
                message=status,
            )
        self.notifier.extend_timeout(period, status)

    def _start_stop_guard(self) -> StopGuard | None:
        """The StopGuard for this run, where systemd gives a watchdog period (WatchdogSec=):
        without one the loop promises no beat, and nothing watches it."""
        period = self.notifier.watchdog_period_s
        if period is None:
            return None
        self._beaten_at = time.monotonic()
        return StopGuard(
            period,
            beaten_at=lambda: self._beaten_at,
            stopping=self.stop_event.is_set,
            hung=functools.partial(self._stop_hung, period),
        )

    def _stop_hung(self, period_s: float, silent_s: float) -> None:
        """specd stops and its loop has not beaten for a watchdog period: one line (and
        where each thread is, on stderr), then the process ends with SIGABRT, as systemd's
        watchdog ends a running specd whose loop hangs. A restart in flight stays in the
        journal, for the next start to finish."""
        flight = self._in_flight

        def say() -> None:
            if flight is not None and flight.phase is not None:
                waiting = (
                    f"while the stop waits for the restart in flight ({flight.was} → "
                    f"{flight.wanted}, {flight.phase}); specd's next start finishes it"
                )
            else:
                waiting = "while specd stops"
            self.log.error(
                "stop_hung",
                silent_s=round(silent_s, 1),
                watchdog_s=period_s,
                detail=f"the loop has not beaten for {silent_s:.0f} s (WatchdogSec= "
                f"{period_s:g} s) {waiting}: ending specd with SIGABRT, as systemd's "
                "watchdog would",
            )
            # Where the loop hangs; stderr may have no descriptor (outside systemd).
            with contextlib.suppress(Exception):
                faulthandler.dump_traceback(all_threads=True)

        # A loop hung inside a write to the journal holds the logger's lock: the line is
        # given a few seconds, and the process ends whether or not it went out.
        saying = threading.Thread(target=say, name="specd-stop-hung", daemon=True)
        saying.start()
        saying.join(STOP_HUNG_SAY_S)
        self.end_process()

    def _ready(self, status: str) -> None:
        """READY=1, once: after the first scrape, or before a restart sequence if one comes
        first (systemd's start timeout must not run while SGLang loads)."""
        if not self._ready_sent:
            self._ready_sent = True
            self.notifier.ready(status)

    def _flight_status(self, flight: InFlight) -> str:
        """STATUS= during a restart sequence: the change, what it waits for now and how
        long that may take, and why a stop or the start takes that long."""
        unit = self.config.sglang.unit
        restart = self.config.restart
        restarting = (
            f"waiting for {unit} to restart (up to {restart.restart_command_timeout_s:g} s) "
            f"and answer /health_generate (up to {restart.startup_timeout_s:g} s)"
        )
        phase = flight.phase
        doings: dict[str | None, str] = {
            None: "not restarted yet (waiting for a quiet moment or a fleet slot)",
            "planned": f"about to restart {unit}",
            "draining": f"draining {unit} at the gateway before its restart",
            "env_written": f"restarting {unit}",
            "restart_issued": restarting,
            "verifying": f"verifying what {unit} runs",
            "rolling_back": f"rolling back to {flight.was}: {restarting}",
            **{end: f"{end}; recording the outcome" for end in TERMINAL_RESULTS},
        }
        # A phase no sequence writes comes from a journal the applier refuses to act on.
        doing = doings.get(phase, "a journal it cannot read: failed, SGLang left as it is")
        change = f"{flight.was} → {flight.wanted}"
        if self.stop_event.is_set() and phase in ("planned", "draining", "env_written"):
            # The applier gives up a change whose restart has not gone out.
            return (
                f"stopping: the restart ({change}) had not gone out and will not; "
                "undoing what it began (env file, gateway drain, fleet slot)"
            )
        if self.stop_event.is_set() and phase in TERMINAL_RESULTS:
            return f"stopping: the restart sequence ({change}) ended {phase}; recording it"
        if self.stop_event.is_set():
            return (
                f"stopping once the restart in flight ends ({change}): {doing}; "
                "killed now, specd's next start finishes it"
            )
        if flight.replay:
            return (
                f"finishing the restart interrupted when specd stopped ({change}): {doing}; "
                "no decision until it ends"
            )
        return f"restarting SGLang: {change}: {doing}"

    def _idle(self, seconds: float) -> None:
        """Wait for the next tick or a signal, beating on every slice of the wait."""
        period = self.notifier.watchdog_period_s
        slice_s = IDLE_SLICE_S if period is None else min(IDLE_SLICE_S, period / 4)
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            self._heartbeat()
            if self._wake.wait(min(left, slice_s)):
                return

    def _now(self) -> float:
        """The wall clock, for what is recorded and decided. When it was stepped since the
        last read, every time specd keeps moves with it (`_shift_records`): each thing
        happened as long ago as it did, so dwell, the restart budget, the stabilization
        window, the avoid list and the outcome check count real time, and a day's step
        forward is no new budget. A time still ahead of the clock (stepped back while specd
        was stopped) is taken as now: it cannot have happened later than now."""
        now = self.clock()
        if self.monotonic is not None:
            mono = self.monotonic()
            last, self._clock_read = self._clock_read, (now, mono)
            if last is not None:
                stepped = (now - last[0]) - (mono - last[1])
                if abs(stepped) >= CLOCK_STEP_S:
                    self.log.warning(
                        "clock_stepped",
                        step_s=round(stepped, 1),
                        expected=utc(last[0] + mono - last[1]).isoformat(),
                        now=utc(now).isoformat(),
                    )
                    self._shift_records(stepped)
        self._clamp_records(now)
        return now

    def _shift_records(self, seconds: float) -> None:
        self._retime_records(lambda t: t + seconds)
        state = self.state
        frozen = state.frozen
        if frozen is not None and isinstance(frozen.get("since"), (int, float)):
            frozen["since"] = float(frozen["since"]) + seconds
        # The snapshot's cells are subtracted from the history's, decayed to one time: both
        # move, or the step would decay one and not the other.
        state.history.shift(seconds)
        if state.sglang_started_at is not None:
            state.sglang_started_at += seconds
        for part in (state.gateway or {}).values():  # a drain kept for `specd status`
            if isinstance(part, dict) and isinstance(part.get("t"), (int, float)):
                part["t"] = float(part["t"]) + seconds
        if self._outage is not None:
            outage = self._outage
            outage.since += seconds
            outage.logged_at += seconds
            if outage.ended_at is not None:
                outage.ended_at += seconds
            if outage.recovered_said_at is not None:
                outage.recovered_said_at += seconds
        self._outages_began = deque(
            (t + seconds for t in self._outages_began), maxlen=FLAPPING_OUTAGES
        )
        if self._seen_at is not None:
            self._seen_at += seconds
        # Stepped back, a pin applied now counted its restarts from a decision time now
        # after all of them: no bound on its restart loop until the clock caught up.
        self.override.shift_s += seconds

    def _clamp_records(self, now: float) -> None:
        state = self.state
        times = [
            *(float(r["t"]) for r in state.restarts),
            *(float(t) for t, _ in state.recommendations),
            *(float(t) for t, _ in state.explorations),
            *(a.t for a in state.avoided),
            *([state.verifying.t] if state.verifying is not None else []),
        ]
        ahead = max(times, default=now) - now
        if ahead <= 0:
            return
        self.log.warning(
            "records_ahead_of_clock", ahead_s=round(ahead, 1), taken_as=utc(now).isoformat()
        )
        self._retime_records(lambda t: min(t, now))

    def _retime_records(self, retime: Callable[[float], float]) -> None:
        """Each time of what dwell, the budget, stabilization, the avoid list and the
        outcome check count from, ``retime``d."""
        state = self.state
        for restart in state.restarts:
            restart["t"] = retime(float(restart["t"]))
        state.recommendations = [[retime(float(t)), k] for t, k in state.recommendations]
        state.explorations = [[retime(float(t)), k] for t, k in state.explorations]
        state.avoided = [replace(a, t=retime(a.t)) for a in state.avoided]
        snap = state.verifying
        if snap is not None:
            t = retime(snap.t)
            # The check ends as long after the change as it did, a change taken as made now
            # too: its end left behind, a clock that started a year behind and was then set
            # right moved it a year on (and one from 1970, past what the next start reads).
            until = None if snap.until is None else snap.until + (t - snap.t)
            state.verifying = replace(snap, t=t, until=until)

    def _save_status(self) -> None:
        """Write status.json: the last decision and what runs, for `specd status`."""
        self._report_write(self.store.save_status(self.state))

    def _report_write(self, error: str | None) -> None:
        """Count and log a write of state.json or status.json that failed (``error``)."""
        if error:
            self.metrics.state_write_errors.inc()
            self.log.error("state_write_failed", error=error)

    def _state_save_due(self) -> bool:
        """Whether `_save_state` writes state.json now unforced (its interval is over)."""
        return not 0 <= self.clock() - self._last_saved_at < STATE_SAVE_INTERVAL_S

    def _save_state(self, *, force: bool = False) -> str | None:
        """Write state.json (at most every STATE_SAVE_INTERVAL_S unless ``force``); why it
        could not be written, or None."""
        now = self.clock()
        # A clock stepped back (now before the last save) is no reason to stop saving.
        if not force and not self._state_save_due():
            return None
        error = self.store.save(self.state)
        self._last_saved_at = now
        self._save_error = error or None
        self._report_write(error)
        return error or None

    # -- signals ------------------------------------------------------------------
    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT stop, SIGHUP reloads. A handler runs in the loop's own thread,
        between two bytecodes — possibly inside ``Event.wait`` while that thread holds the
        event's lock — so it must take no lock: it writes one byte to a pipe, and a relay
        thread sets the events (an ``Event.set`` in the handler deadlocked the loop when a
        burst of SIGHUPs landed there)."""
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        self._signal_fd = write_fd
        threading.Thread(
            target=self._relay_signals, args=(read_fd,), name="specd-signals", daemon=True
        ).start()
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGHUP, self._on_signal)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        # Full (thousands pending): the relay has plenty to act on already.
        with contextlib.suppress(BlockingIOError):
            os.write(self._signal_fd, b"H" if signum == signal.SIGHUP else b"T")

    def _relay_signals(self, read_fd: int) -> None:
        while True:
            try:
                data = os.read(read_fd, 512)
            except OSError:
                return
            if not data:
                return
            if b"T" in data:
                self.stop_event.set()
            if b"H" in data:
                # Several SIGHUPs in a row collapse into one reload.
                self._reload_requested.set()
                flight = self._in_flight
                if flight is not None:
                    # Read between ticks, so after the sequence: said now, not in silence
                    # for the minutes a drain or a model load can take.
                    self.log.info(
                        "reload_deferred",
                        detail="the config is read again once the restart in flight ends: "
                        + self._flight_status(flight),
                    )
            self._wake.set()

    def request_stop(self) -> None:
        self.stop_event.set()
        self._wake.set()

    # -- reload -------------------------------------------------------------------
    def reload(self) -> None:
        """Re-read the config (SIGHUP). All or nothing: every part of the new config is
        built before any is swapped in, and a reload that fails for any reason keeps the
        running config, says why, and never stops the daemon."""
        self._reload_requested.clear()
        self.notifier.reloading()
        self.metrics.config_reload_time.set(self.clock())
        path = _named(self.config_path)  # a default file created since the start: named
        try:
            # Read once it stopped changing: a file caught mid-write may still be TOML.
            new = load_config(path, settle=self.stop_event.wait)
            parts = self._build_for(new)
        except ConfigError as exc:
            problems = exc.problems
        except Exception as exc:  # a reload must never take the daemon down
            problems = [one_line(f"{type(exc).__name__}: {exc}", 300)]
        else:
            problems = []
            if new.files.state_dir != self.config.files.state_dir:
                # Half applied, it split what runs from what `specd status` and the next
                # start read: the journal, the freeze and what specd learned stay behind.
                problems.append(
                    f"files.state_dir: {self.config.files.state_dir} → {new.files.state_dir} "
                    "needs a restart of specd (move state.json along; its journal, freeze "
                    "and learned history live there)"
                )
            if new.sglang.env_file != self.config.sglang.env_file:
                # Taken, every change would fail at its first write, window after window.
                problem = env_file_unwritable(new)
                if problem is not None:
                    problems.append(problem)
        if problems and self.stop_event.is_set():
            # SIGTERM cut the read short (its settle wait): no verdict on the file, which
            # the next start reads anyway; not a rejection for SpecdConfigReloadRejected.
            self.log.info("reload_abandoned", config=str(path), detail="specd is stopping")
            return
        if problems:
            self.metrics.config_reload_success.set(0)
            for problem in problems:
                self.log.error("reload_rejected", config=str(path), problem=problem)
            self.notifier.reloaded(self._status_text() + " (reload rejected, old config kept)")
            return
        self.config_path = path
        new = self._keep_running_address(new)
        old, old_applier, old_fleet = self.config, self.applier, self.fleet
        client, applier, calibration, history_settings = parts
        if client is not self.client:
            self.client.close()
        self.config, self.client, self.applier = new, client, applier
        if applier is not old_applier:
            applier.read_stop_timeout()
            kept = self._hand_over_marker(old_applier, applier)
            if isinstance(old_applier, Applier) and old_applier.gateway is not None:
                old_applier.gateway.close()  # its connections, reload after reload
            if old_fleet is not None and old_fleet is not self.fleet:
                old_fleet.close()
                # Its hooks set the fleet gauges; the new fleet knows of no marker or slot
                # but one it took over: a marker left to no fleet, kept at 1, fired
                # SpecdFleetMarkerLeftBehind until specd restarted, with no [fleet] at all
                # (`fleet_marker_left` says so once instead). No sequence runs during a
                # reload, so no slot is held.
                marked = 1 if kept else 0 if self.fleet is not None else float("nan")
                self.metrics.fleet_marked_out.set(marked)
                self.metrics.set_fleet_slot(None)
        self._read_wiring()
        before = self.gateway
        if before is not None:
            before.close()
        self.gateway = self._make_gateway(new)
        if (
            self.gateway is not None
            and before is not None
            and (new.gateway, new.sglang.url)
            == (
                old.gateway,
                old.sglang.url,
            )
        ):
            # The same gateway (its key file read again): what its last probe found goes
            # on, so an outage is not said again at each reload, nor probed sooner.
            self.gateway.last = before.last
        self.calibration = calibration
        if new.report.log_format != old.report.log_format:
            logs.configure(new.report.log_format)
        self.metrics.band_boundary.set(_band_boundary(new))
        self.metrics.scrape_interval.set(new.observe.scrape_interval_s)
        self.state.history.reconfigure(history_settings)
        self.metrics.config_reload_success.set(1)
        self.metrics.declare_choices(
            range(new.choose.min_steps, new.choose.max_steps + 1), _regressing_settings(new)
        )
        self._warn_shadowed()
        # The keys a reload changed, so the journal shows what took effect.
        changed = config_changes(old, new)
        self.log.info("reloaded", config=str(self.config_path), changed=changed)
        self.notifier.reloaded(self._status_text())

    def _warn_shadowed(self) -> None:
        """One warning per key of the config file a SPECD_* variable of specd's environment
        overrides: an edit to it changes nothing, and a reload would say nothing changed."""
        for shadowed in config_io.shadowed_in_file(self.config_path):
            self.log.warning(
                "config_key_shadowed",
                config=str(self.config_path or config_io.DEFAULT_CONFIG_PATH),
                key=shadowed.key,
                variable=shadowed.variable,
                detail=shadowed.warning(),
            )

    def _keep_running_address(self, new: Config) -> Config:
        """``new`` with the metrics address /metrics is served on: it moves with a restart
        of specd only. Taken into the config, the next reload compared the file with it and
        said nothing, and `reloaded` listed as changed what had not."""
        running, wanted = self.config.report, new.report
        keys = ("metrics_listen_address", "metrics_port")
        differ = [k for k in keys if getattr(wanted, k) != getattr(running, k)]
        if not differ:
            return new
        # Said at every reload while the file and what runs differ.
        self.log.warning(
            "reload_partial",
            detail="; ".join(
                f"report.{k}: {getattr(wanted, k)} in the file, {getattr(running, k)} running"
                for k in differ
            )
            + ": a metrics address change needs a restart of specd; the rest of the reload "
            "applies",
        )
        kept = wanted.model_copy(update={k: getattr(running, k) for k in keys})
        return new.model_copy(update={"report": kept})

    def _hand_over_marker(self, old: RestartApplier, new: RestartApplier) -> bool:
        """A reload that rebuilt the applier: the out-of-service marker the old one could
        not remove goes on with the new one (same group, server and etcd), else the old
        fleet tries once more to remove it, and says so where the marker stays behind: no
        specd retries it now, and the group counts this server out until its bound.
        Whether the new applier holds one."""
        if not isinstance(old, Applier) or old.unremoved_out is None:
            return False
        if isinstance(new, Applier) and new.take_over_out(old) is not None:
            return True
        marker = old.unremoved_out
        problem = old.retry_mark_in()
        if problem is not None and old.unremoved_out is not None:
            self.log.warning(
                "fleet_marker_left",
                group=marker.group,
                detail=f"the reloaded config no longer manages this server's out-of-service "
                f"marker {marker.key} ({problem}): the group counts this server out until "
                f"{utc_time(marker.until)} (later if etcd restarts meanwhile: each start "
                "gives a lease its whole TTL again); delete the key sooner by hand",
            )
        return False

    def _build_for(
        self, new: Config
    ) -> tuple[SGLangReader, RestartApplier, CalibrationFile, HistorySettings]:
        """What the loop would run with ``new``; raises if any part cannot be built."""
        reader_injected, applier_injected = self._injected
        old = self.config
        client = self.client
        if not reader_injected and (
            new.sglang.url != old.sglang.url
            or new.observe.scrape_timeout_s != old.observe.scrape_timeout_s
            or new.sglang.server_api_key_file != old.sglang.server_api_key_file
        ):
            client = SGLangClient(
                new.sglang.url,
                timeout_s=new.observe.scrape_timeout_s,
                clock=self.clock,
                beat=self._heartbeat,
                api_key=new.sglang.server_api_key_file,
            )
        applier = self.applier if applier_injected else self._make_applier(new, client)
        calibration = (
            self.calibration
            if new.choose.calibration_file == old.choose.calibration_file
            else CalibrationFile(new.choose.calibration_file)
        )
        return client, applier, calibration, HistorySettings.from_config(new)

    # -- the loop -----------------------------------------------------------------
    def start_metrics_server(self) -> None:
        server = MetricsServer(
            self.metrics.registry,
            self.config.report.metrics_listen_address,
            self.config.report.metrics_port,
        )
        self._metrics_server = server
        self.metrics_port = server.port
        self.log.info(
            "metrics_serving",
            url=f"http://{self.config.report.metrics_listen_address}:{self.metrics_port}/metrics",
        )

    def run(self) -> int:
        guard = self._start_stop_guard()
        try:
            return self._run()
        finally:
            if guard is not None:
                guard.close()

    def _run(self) -> int:
        # /metrics answers from here on, before the first tick ends (its scrape may wait a
        # timeout; a journal's resumption, minutes): serve what the saved state and the
        # override file say, not the defaults, or Prometheus reads a frozen specd as not
        # frozen (SpecdFrozen resolves, then pages again) and a pin as auto.
        now = self._now()
        self._update_gauges(now, self._refresh_override(now))
        try:
            self.start_metrics_server()
        except OSError as exc:
            # Port taken or address not local: one clear line, and systemd's Restart= retries.
            address = (
                f"{self.config.report.metrics_listen_address}:{self.config.report.metrics_port}"
            )
            self.log.error("metrics_listen_failed", address=address, error=str(exc))
            return 1
        self.metrics.band_boundary.set(_band_boundary(self.config))
        self.metrics.scrape_interval.set(self.config.observe.scrape_interval_s)
        self._warn_shadowed()
        self._reconcile_journal()
        # Once at start (and at each reload), never between: does a restart fit a window,
        # and which settings can the unit be given?
        self.applier.read_stop_timeout()
        self._read_wiring()
        if not self.stop_event.is_set():  # stopped during a replay: nothing more to decide
            self._guarded_tick()  # READY comes after the first scrape was attempted
            self._ready(self._status_text())
        while not self.stop_event.is_set():
            self._idle(self.config.observe.scrape_interval_s)
            self._wake.clear()
            self._heartbeat()
            if self.stop_event.is_set():
                break
            if self._reload_requested.is_set():
                self.reload()
            self._guarded_tick()
        self._heartbeat()  # the way out is the loop's too: the StopGuard watches it
        self.notifier.stopping("stopping")
        self._save_state(force=True)
        self.client.close()
        if self.gateway is not None:
            self.gateway.close()
        if self._metrics_server is not None:
            self._metrics_server.close()
        self.log.info("stopped")
        return 0

    def _guarded_tick(self) -> None:
        """One tick; an error no code of specd's handles (a bug, or input it does not
        expect) is logged with its traceback and counted, and the loop backs off and goes
        on: a daemon that exits on it restarts into the same input, and systemd's start
        limit leaves the box untuned. Except with a restart in flight (its journal kept):
        the next start's reconcile is what finishes one, so that error ends the run."""
        try:
            self.tick()
        except Exception as exc:
            if self.state.journal:
                raise
            self._tick_failures += 1
            backoff = min(
                self.config.observe.scrape_interval_s * 2**self._tick_failures, TICK_BACKOFF_MAX_S
            )
            self.metrics.tick_errors.inc()
            self.log.exception(
                "tick_failed",
                error=one_line(f"{type(exc).__name__}: {exc}", 300),
                failures_in_a_row=self._tick_failures,
                next_tick_in_s=backoff,
            )
            # The loop waits one scrape interval after this on its own.
            self._idle(backoff - self.config.observe.scrape_interval_s)
        else:
            self._tick_failures = 0

    def _reconcile_journal(self) -> None:
        journal = self.state.journal
        if not journal:
            return
        was, wanted = _journal_change(journal)
        phase = journal.get("phase") if isinstance(journal, Mapping) else None
        flight = InFlight(was, wanted, replay=True, phase=None if phase is None else str(phase))
        self._in_flight = flight
        # Ready before the replay, which may wait out SGLang's load twice (a rollback):
        # systemd's start timeout would kill specd mid-replay, and the next start would
        # resume it again. The loop makes no decision until it ends; the watchdog, now
        # running, watches it.
        self._ready(self._flight_status(flight))
        self.log.warning("reconciling_interrupted_restart", journal=journal)
        self.metrics.restart_in_progress.set(1)
        self._show_restarting(journal)
        try:
            outcome = self.applier.reconcile(journal)
            if outcome is not None:
                self._record_outcome(outcome, self._now())
            else:
                self.state.journal = None
                self._save_state(force=True)
        finally:
            self._in_flight = None
            self.metrics.restart_in_progress.set(0)
            self.metrics.sglang_restarting.set(0)

    def tick(self) -> Decision:
        while True:
            started = time.perf_counter()
            now = self._now()
            override, outcome = self._step(now)
            if not (outcome.acts and self._reload_requested.is_set()):
                break
            # A SIGHUP during this tick (its scrape, a gateway probe): read before the change
            # goes out, and decided again under the new config, rather than after a restart
            # it may forbid (a budget of 0, other windows, another unit).
            change = f"{outcome.live_name or 'unknown'} → {outcome.decision.target_name}"
            self.log.info(
                "reload_before_change",
                detail=f"a reload asked for during this tick is read before the change "
                f"({change}) goes out; then decided again",
            )
            self.reload()
        self.state.adopt(outcome.control)
        decision = outcome.decision
        self.last_decision = decision
        self.live_adaptive = outcome.control.live_adaptive
        self._note_live(outcome.current, now, "observation", outcome.live_name)
        self._report_predictions(outcome)
        # A change refused a moment ago is not tried, nor logged as acting, at every scrape.
        held = outcome.acts and self._refusal_stands(decision, now)
        changed = self._report_decision(decision, outcome, now, acts=outcome.acts and not held)
        applying_s = 0.0
        if not outcome.acts:
            self._refused = None
        elif held:
            pass  # tried again once REFUSED_RETRY_S have passed
        else:
            if decision.reason is Reason.EXPLORE:
                self._report_exploration(decision, outcome.current)
            if decision.reason is Reason.REGRESSION:
                self._report_regression(outcome)
            # The sequence blocks the loop for minutes (an hour at worst): what the gauges
            # say meanwhile is this tick's (mode, override, target), not the last one's.
            self._update_gauges(now, override)
            began = time.perf_counter()
            self._apply(decision, outcome, override, now)
            # specd_restart_duration_seconds times the sequence; the tick's own time is
            # observe-record-decide (and its reporting), not minutes of restart.
            applying_s = time.perf_counter() - began
        self._update_gauges(now, override)
        self.notifier.status(self._status_text())
        # What `specd status` shows must not lag a change of decision by a save interval,
        # nor a worker put back into routing (or tried). A decision's is written alone
        # (status.json, small): one flapping every tick rewrote all specd learned each time.
        if changed and not (self._gateway_changed or self._state_save_due()):
            self._save_status()
        self._save_state(force=self._gateway_changed)
        self._gateway_changed = False
        self.metrics.tick_duration.observe(time.perf_counter() - started - applying_s)
        return decision

    def _step(self, now: float) -> tuple[Override | None, StepResult]:
        """Observe, record and decide: the override in force and what `step` made of it."""
        self._heartbeat()
        self._check_unfreeze_request(now)
        result = self._observe(now)
        if isinstance(result, Observation):
            self._seen_again(now)
        override = self._refresh_override(now)
        calibration, calibration_problem = self.calibration.current()
        self._report_calibration(calibration, calibration_problem)
        self._readd_left_out(now, result)
        gateway_problem = self._probe_gateway(now, override)
        # After the probe: a worker it finds routed again is no longer left out.
        self._retry_mark_in(now, result)
        context = StepContext(
            config=self.config,
            history=self.state.history,
            override=override,
            control=self.state.control(),
            calibration=calibration,
            calibration_problem=calibration_problem,
            restart_needs_s=self._restart_needs_s(),
            gateway_problem=gateway_problem,
            traits=self._traits(),
            static_only=self._static_only,
        )
        outcome = step(context, result, now)
        if outcome.acts:
            # No restart without its journal on disk: while saves fail, the change waits
            # here, before a fleet slot is taken or a quiet moment awaited for nothing.
            unsaved = self._state_problem()
            if unsaved is not None:
                outcome = step(replace(context, state_problem=unsaved), result, now)
        if outcome.acts:
            # etcd is asked only when this tick would restart: no slot, no restart.
            problem = self._fleet_problem()
            if problem is not None:
                outcome = step(replace(context, fleet_problem=problem), result, now)
        return override, outcome

    # -- pieces of a tick ---------------------------------------------------------
    def _readd_left_out(self, now: float, result: Observation | ScrapeError) -> None:
        """Put back a worker a failed re-add left out of routing (a replica away at the end
        of a restart): at the first tick (a restart of specd) and then at most once a
        minute, while SGLang answers, until the gateway routes it again (`_probe_gateway`
        says so, whoever re-added it)."""
        kept = (self.state.gateway or {}).get("left_out")
        if not kept or self.gateway is None:
            return
        # Paced in memory, not by the state's tried_at: a specd restarted tries at once.
        tried_at = self._readd_tried_at
        if tried_at is not None and 0 <= now - tried_at < IDLE_PROBE_S:
            return
        if not isinstance(result, Observation):
            return  # not put back into routing while SGLang does not answer
        self._readd_tried_at = now
        self._gateway_changed = True
        workers = kept.get("workers")
        problem = self.applier.readd_left_out(workers if isinstance(workers, list) else [])
        if problem != kept.get("problem"):  # once per change, not every minute of an outage
            if problem is None:
                self.log.info("gateway_worker_readd_accepted", replicas=len(workers or []))
            else:
                self.log.error("gateway_worker_left_out", problem=problem)
        self.state.gateway = {
            **(self.state.gateway or {}),
            "left_out": {**kept, "tried_at": now, "problem": problem},
        }

    def _retry_mark_in(self, now: float, result: Observation | ScrapeError) -> None:
        """Remove the out-of-service marker a sequence's end could not (etcd away then), or
        one an earlier run of specd left, or one kept while a gateway replica left the
        worker out (looked for once SGLang answers, no restart is pending and no replica
        leaves it out): at most once a minute until etcd takes it or says it is gone (an
        etcd restarted meanwhile gives its lease the whole TTL again, so its bound alone
        does not end it), so the other servers of the group do not wait for this one, back
        in service, up to that bound."""
        if self.fleet is None:
            return
        tried_at = self._mark_in_tried_at
        if tried_at is not None and 0 <= now - tried_at < IDLE_PROBE_S:
            return
        self._mark_in_tried_at = now
        # Without a gateway (a reload removed it) no replica leaves the worker out.
        left_out = self.gateway is not None and (self.state.gateway or {}).get("left_out")
        serving = isinstance(result, Observation) and not self.state.journal and not left_out
        self.applier.retry_mark_in(serving=serving)  # logged there, as at a sequence's end

    def _left_out_replicas(self) -> float:
        """How many replicas the kept left-out record names (NaN without a gateway)."""
        if self.gateway is None:
            return float("nan")
        left_out = (self.state.gateway or {}).get("left_out")
        workers = left_out.get("workers") if isinstance(left_out, Mapping) else None
        return float(len(workers)) if isinstance(workers, list) else 0.0

    def _probe_gateway(self, now: float, override: Override | None) -> str | None:
        """Can the gateway drain this server? Asked every tick while specd may restart (a
        window open, a change pending, a pin) or a worker is left out; the applier asks
        again before draining."""
        if self.gateway is None:
            # No gateway (a reload may have removed it): no replica to leave this server out.
            # A count kept from before kept SpecdWorkerLeftOutOfGateway firing for good.
            self.metrics.gateway_worker_not_ready.set(float("nan"))
            return None
        d = self.last_decision
        left_out = (self.state.gateway or {}).get("left_out")
        needed = (
            windows.is_open(self.config.windows, utc(now))
            or (override is not None and override.mode == "pin")
            or (d is not None and d.target_steps is not None and d.target_steps != self.live_steps)
            or bool(left_out)
        )
        before = (self.gateway.last or {}).get("problem")
        problem = self.gateway.check(now, needed)
        last = self.gateway.last or {}
        self.state.gateway = {**(self.state.gateway or {}), "probe": last}
        not_ready = last.get("not_ready_replicas")
        if left_out and problem is None and not_ready == 0:
            # Every replica routes it again (specd's re-add, or one by hand).
            gateway = dict(self.state.gateway)
            del gateway["left_out"]
            if isinstance(gateway.get("last_drain"), dict):
                gateway["last_drain"] = {**gateway["last_drain"], "readded_at": now}
            self.state.gateway = gateway
            self._gateway_changed = True
            self.log.info("gateway_worker_readded", replicas=last.get("replicas"))
        self.metrics.gateway_worker_not_ready.set(
            float(not_ready) if isinstance(not_ready, int) else float("nan")
        )
        if problem != before:  # once per change, not every tick of an outage
            if problem is not None:
                self.log.warning("gateway_unavailable", problem=problem)
            else:
                self.log.info("gateway_available", replicas=last.get("replicas"))
        return problem

    def _observe(self, now: float) -> Observation | ScrapeError:
        self.metrics.scrapes.inc()
        result = self.client.observe()
        if isinstance(result, ScrapeError):
            self.metrics.sglang_up.set(0)
            self.metrics.scrape_errors.labels(kind=result.kind).inc()
            self._report_scrape_failure(result, now)
            return result
        if self._outage is not None and self._outage.ended_at is None:
            outage = self._outage
            outage.ended_at = now
            said = outage.recovered_said_at
            # An SGLang failing every other scrape ends an outage at every other scrape:
            # said once per SCRAPE_FAILED_RELOG_S, as its failures are.
            if said is None or not 0 <= now - said < SCRAPE_FAILED_RELOG_S:
                outage.recovered_said_at = now
                self.log.info(
                    "scrape_recovered",
                    failing_s=round(max(0.0, now - outage.since), 1),
                    failures=outage.failures,
                )
        self.metrics.sglang_up.set(1)
        self.metrics.last_scrape_success.set(result.t)
        self._report_rejected(result)
        if self.state.history.record(result) is Recorded.RESTART_DETECTED:
            # Counters went backwards or the step count changed: SGLang restarted behind
            # our back; its warm-up is excluded from the history.
            self.log.info("sglang_restart_detected")
            self.state.sglang_started_at = now
        self.last_obs = result
        return result

    def _seen_again(self, now: float) -> None:
        """SGLang answered at ``now``. After a longer gap than `stale_after_s` (and two
        scrape intervals) without seeing it (scrapes failing, specd stopped), what was
        recommended before the gap is no evidence that it held through it: the
        stabilization window starts over, instead of counting the gap as holding."""
        seen, self._seen_at = self._seen_at, now
        observe = self.config.observe
        gap = now - seen if seen is not None else 0.0
        if gap <= max(observe.stale_after_s, 2 * observe.scrape_interval_s):
            return
        if self.state.recommendations:
            self.log.info("stabilization_restarted", unobserved_s=round(gap, 1))
            self.state.recommendations = []

    def _flapping(self, now: float) -> bool:
        """Whether FLAPPING_OUTAGES outages began within SCRAPE_FAILED_RELOG_S of ``now``."""
        began = [t for t in self._outages_began if 0 <= now - t < SCRAPE_FAILED_RELOG_S]
        return len(began) >= FLAPPING_OUTAGES

    def _failing(self) -> bool:
        """Whether the latest scrape failed (an outage that has not ended)."""
        return self._outage is not None and self._outage.ended_at is None

    def _report_scrape_failure(self, error: ScrapeError, now: float) -> None:
        """Counted every scrape (metrics); logged at the first failure, at a failure of a new
        kind or reason, and every SCRAPE_FAILED_RELOG_S while it lasts; `scrape_recovered`
        ends it (`_observe`). specd's own restarts of SGLang are not seen here: the loop
        waits in the applier until SGLang is verified healthy, or rolled back."""
        outage = self._outage
        if outage is not None and outage.ended_at is not None:
            if self._flapping(now):
                outage.ended_at = None  # SGLang flaps: the same outage goes on
                self._outages_began.append(now)  # and flaps as long as this goes on
            else:
                outage = None
        if outage is None:
            outage = self._outage = ScrapeOutage(since=now)
            self._outages_began.append(now)
        outage.failures += 1
        said = (error.kind, error.reason)
        new_kind = error.kind not in {kind for kind, _ in outage.said}
        new = said not in outage.said and (
            new_kind or len(outage.said) < SCRAPE_FAILED_MAX_DISTINCT
        )
        since = now - outage.logged_at  # negative: the clock stepped back
        if not new and 0 <= since < SCRAPE_FAILED_RELOG_S:
            return
        outage.said.add(said)
        outage.logged_at = now
        self.log.warning(
            "scrape_failed",
            kind=error.kind,
            reason=error.reason,
            failing_s=round(max(0.0, now - outage.since), 1),
            failures=outage.failures,
        )

    def _report_calibration(self, calibration: Calibration | None, problem: str | None) -> None:
        # Once per change: a calibration file broken for a week is one line, and one more
        # when it is good again. Decisions name the problem meanwhile.
        if problem == self._calibration_problem:
            return
        if problem is not None:
            self.log.error(
                "calibration_unusable",
                problem=problem,
                kept="the last good calibration" if calibration is not None else "none",
            )
        else:
            self.log.info("calibration_usable", file=str(self.calibration.path))
        self._calibration_problem = problem

    def _report_rejected(self, obs: Observation) -> None:
        # Counted every scrape (the rate shows how often SGLang lies); logged once per
        # field until that field is sane again, so a stuck bad value is one line.
        for name in obs.rejected:
            self.metrics.rejected_values.labels(field=name).inc()
        for name, value in zip(obs.rejected, obs.rejected_values, strict=False):
            if name in self._rejected_logged:
                continue
            self.log.warning(
                "sglang_value_rejected",
                field=name,
                value=value,
                reason="SGLang cannot produce this value; taken as unknown, not learned",
            )
        self._rejected_logged = set(obs.rejected)

    def _read_override(self, now: float) -> OverrideStatus:
        """The override file as the daemon judges it (its config's step range, its uids)."""
        choose = self.config.choose
        return read_override(
            Path(self.config.files.override_file),
            choose.min_steps,
            choose.max_steps,
            utc(now),
            allowed_uids=self.allowed_override_uids,
            listed=choose.adaptive_candidate_sets,
        )

    def _refresh_override(self, now: float) -> Override | None:
        path = Path(self.config.files.override_file)
        choose = self.config.choose
        status = self._read_override(now)
        tracker = self.override
        judged_by = (path, choose.min_steps, choose.max_steps, choose.adaptive_candidate_sets)
        same_file = status.fingerprint == tracker.fingerprint
        before = tracker.status
        changed = (
            not same_file
            or judged_by != tracker.judged_by
            or (before is not None and status.valid != before.valid)
        )
        # The same file judged again under a reloaded config means what it meant: nothing
        # to say (a reload used to log the untouched override as loaded anew).
        if same_file and before is not None and _same_meaning(before, status):
            changed = False
        if changed:
            if not status.present:
                if tracker.in_force is not None:
                    self.log.info("override_removed")
                tracker.good, tracker.lapsed, tracker.since = None, False, None
            elif status.valid:
                if status.override != tracker.good:
                    tracker.lapsed = False
                if not same_file:
                    tracker.shift_s = 0.0  # its times are this clock's
                tracker.good, tracker.since = status.override, status.written_at
                loaded = status.override
                # One that has already expired is said below (override_expired).
                if loaded is None or loaded.mode == "auto" or loaded.active(utc(now)):
                    self.log.info(
                        "override_loaded",
                        mode=loaded.mode if loaded else None,
                        reason=loaded.reason if loaded else None,
                    )
            else:
                # Logged once per change of the file; the last good override holds.
                self.log.error("override_ignored", problem=status.problem, file=str(path))
        outside = _outside_range(
            tracker.good, choose.min_steps, choose.max_steps, choose.adaptive_candidate_sets
        )
        if outside is not None:
            # A reload narrowed the step range under the pin: clamped into it, it restarted
            # SGLang to a count nobody pinned, while specd said the override was ignored.
            assert tracker.good is not None
            self.log.warning(
                "override_dropped",
                mode=tracker.good.mode,
                reason=tracker.good.reason,
                problem=outside,
                effect="no longer in force: specd decides by itself (pin within the range "
                "to hold a setting)",
            )
            tracker.good, tracker.lapsed, tracker.since = None, False, None
        tracker.fingerprint = status.fingerprint
        tracker.judged_by = judged_by
        tracker.status = status
        good = tracker.good
        if good is None or good.mode == "auto":
            return None
        expires_at = good.expires_at.isoformat() if good.expires_at else None
        if good.active(utc(now)):
            if tracker.lapsed:
                # The wall clock was stepped back before its expiry: the file is in force
                # again, as `specd status` and `specd override show` say.
                self.log.warning("override_in_force_again", mode=good.mode, expires_at=expires_at)
                tracker.lapsed = False
            if tracker.shift_s and good.decided_at is not None:
                return replace(good, decided_at=good.decided_at + tracker.shift_s)
            return good
        if not tracker.lapsed:
            # Said once: at the tick it expires, or when a file already expired is read.
            self.log.info("override_expired", mode=good.mode, expired_at=expires_at)
            tracker.lapsed = True
        return None

    def _note_live(self, steps: int | None, now: float, source: str, name: str | None) -> None:
        """``steps``: the step count (None under adaptive or unknown); ``name``: the setting
        as the operator writes it, which `specd status` shows ("adaptive:3,4" has no K)."""
        self.live_steps, self.live_name = steps, name
        self.state.live = {"t": now, "steps": steps, "setting": name, "source": source}

    def _report_predictions(self, outcome: StepResult) -> None:
        m = self.metrics
        # Off and the adaptive sets too, by name: the chosen one is often among them.
        intervals = outcome.named_intervals
        m.set_by_setting(m.predicted_throughput, outcome.named_predictions)
        m.set_by_setting(m.predicted_throughput_low, {n: lo for n, (lo, _) in intervals.items()})
        m.set_by_setting(m.predicted_throughput_high, {n: hi for n, (_, hi) in intervals.items()})

    def _report_decision(
        self,
        decision: Decision,
        outcome: StepResult,
        now: float,
        *,
        acts: bool,
    ) -> bool:
        """Export and log the decision (``acts``: it goes to the applier this tick); True
        when it differs from the previous one."""
        current, pick = outcome.current, outcome.pick
        target = decision.target_steps
        self.metrics.record_decision(decision.reason.value, target, now)
        named = decision.target_name
        self.state.last_decision = {
            "t": now,
            "target_steps": target,
            # An adaptive target has no step count: `specd status` shows this.
            "target_setting": named,
            "reason": decision.reason.value,
            "message": decision.message,
            "current_steps": current,
            # The verdict on the change being verified (`specd status` shows it), or None.
            "outcome": outcome.verdict.why if outcome.verdict else None,
            # It went to the applier: the sequence's waits (a fleet slot, a quiet moment)
            # save nothing for up to their bounds; `specd status` allows for them.
            "acts": acts,
        }
        # By name: two adaptive sets (or one and none) share target_steps None.
        key = (decision.reason.value, named if named is not None else target)
        changed = (key, outcome.live_name) != self._last_decision_key
        self._last_decision_key = (key, outcome.live_name)
        # SGLang fails every other scrape (the scrape log says so every 5 minutes): the
        # no_data of each failure is not logged, nor the way back from it, or each scrape
        # would be a line. `specd status` still shows each (status.json).
        quiet = decision.reason is Reason.NO_DATA and not acts and self._flapping(now)
        since = now - self._last_logged_at  # negative: the clock stepped back
        if not quiet and (acts or key != self._last_logged or not 0 <= since < DECISION_RELOG_S):
            self.log.info(
                "decision",
                reason=decision.reason.value,
                target_steps=target,
                target_setting=named,
                current_steps=current,
                live_adaptive=outcome.control.live_adaptive,
                acts=acts,
                message=decision.message,
                recommendation=(
                    format_setting(pick.setting) if pick and pick.setting else pick.steps
                )
                if pick
                else None,
                recommendation_why=pick.why if pick else None,
                prediction_interval={
                    name: [round(lo, 1), round(hi, 1)]
                    for name, (lo, hi) in outcome.named_intervals.items()
                }
                if pick
                else None,
                outcome=outcome.verdict.why if outcome.verdict else None,
            )
            self._last_logged = key
            self._last_logged_at = now
        return changed

    def _read_wiring(self) -> None:
        """Which settings the unit can be given (`specd install` restarts specd after it
        rewrites the unit, so start and reload are when it can change)."""
        static_only = self.applier.read_wiring()
        if static_only is not None and static_only != self._static_only:
            self.log.warning("unit_static_only", message=static_only)
        self._static_only = static_only

    def _traits(self) -> ServerTraits | None:
        """What the running SGLang can run (`specd.core.choices.offer` reads it); None
        before /server_info was read. Off reports no algorithm: the one specd applies (the
        config's, else the last one SGLang reported) stands in, or specd could never leave
        off."""
        info = getattr(self.client, "last_server_info", None)
        if not isinstance(info, dict):
            return None
        traits = traits_from_server_info(info)
        if traits.algorithm is not None:
            self._algorithm_seen = traits.algorithm
            return traits
        return as_applied(traits, self.config.sglang.speculative_algorithm or self._algorithm_seen)

    def _state_problem(self) -> str | None:
        """Why the state cannot be saved now, or None: the last save's error, with a save
        tried again at most every STATE_SAVE_INTERVAL_S (each failure is logged and counted:
        not one a tick while a change waits)."""
        if self._save_error is None:
            return None
        if not self._state_save_due():
            return self._save_error
        return self._save_state(force=True)

    def _fleet_problem(self) -> str | None:
        """Why no fleet slot could be taken now (etcd unreachable, all slots busy), or None."""
        fleet = self.fleet
        if fleet is None:
            return None
        # Logged with the decision (reason fleet_unavailable), once per change of it.
        try:
            return fleet.probe()
        except Exception as exc:  # a bug on etcd's side of specd must not stop the loop
            self.log.exception("fleet_probe_failed")
            return f"fleet check failed: {exc!r}"

    def _report_exploration(self, decision: Decision, current: int | None) -> None:
        # Counted when begun, as `step` notes it in the control state: an attempt that
        # aborts still uses up that step count's exploration of the week.
        steps = decision.target_steps
        self.metrics.explorations.labels(steps=str(steps)).inc()
        self.log.info("exploration", from_steps=current, to_steps=steps, message=decision.message)

    def _report_regression(self, result: StepResult) -> None:
        # Counted when specd goes back, as `step` puts the step count on the avoid list.
        found = result.verdict
        assert found is not None
        # Named as the operator writes it: an adaptive set's key is a hash, not a name.
        self.metrics.regressions.labels(steps=found.to_name).inc()
        self.log.warning(
            "regression",
            # K (0: off) as before; None for an adaptive set, which *_setting names.
            from_steps=found.from_steps if found.from_setting is None else None,
            to_steps=found.to_steps if found.to_setting is None else None,
            from_setting=found.from_name,
            to_setting=found.to_name,
            observed_s=round(found.observed_s),
            observed_tok_s=round(found.observed_tok_s, 1),
            baseline_tok_s=round(found.baseline_tok_s, 1),
            margin_tok_s=round(found.margin_tok_s, 1),
            shortfall_ratio=round(found.shortfall_ratio, 4),
            message=found.why,
        )

    def _restart_needs_s(self) -> float:
        """The longest one restart takes: the unit's stop timeout plus the start."""
        return restart_needs_s(self.applier.stop_timeout_s(), self.config.choose.restart_cost_s)

    def _freeze_written(self) -> str | None:
        """Asked by the restart sequence's waits (a fleet slot, a quiet moment, a drain: up
        to half an hour with the tick blocked): an on-call freeze written since the change
        began ends it before the restart. The file only read, as the next tick reads it."""
        now = self.clock()
        status = self._read_override(now)
        found = status.override if status.valid else None
        if found is None or found.mode != "freeze" or not found.active(utc(now)):
            return None
        return f"an override freezes specd now ({found.reason or 'no reason given'})"

    def _window_open(self, target: SpecSetting | None = None, at: float | None = None) -> bool:
        """Open, with time left for one whole restart into ``target`` (an adaptive start
        takes longer; the quiet wait ends before that), now or ``at``."""
        left = window_left_s(self.config, utc(self.clock() if at is None else at))
        extra_s = 0.0 if target is None else restart_extra_s(target, self.config)
        return left is not None and left >= self._restart_needs_s() + extra_s

    def _apply(
        self, decision: Decision, outcome: StepResult, override: Override | None, now: float
    ) -> None:
        target = decision.target_setting
        assert target is not None  # Decision.acts() is never true without one
        # Under SGLang's adaptive mode its candidates are not known here: "unknown", so
        # the applier never takes SGLang for running the target already.
        current = outcome.current
        live = None if outcome.control.live_adaptive else setting_of_steps(current)
        force = (
            override is not None
            and override.mode == "pin"
            and override.apply == "now"
            and decision.reason is Reason.OVERRIDE_PIN
        )
        was = format_setting(live) if live is not None else "unknown"
        wanted = format_setting(target)
        # The first tick may restart (a pin applied now, a change already stable in an open
        # window): ready first, as before a replay.
        self._ready(self._status_text())
        # Saved with the decision that acts before the waits, which save nothing: `specd
        # status` tells them from writes failing by it.
        self._save_state(force=True)
        self.metrics.restart_in_progress.set(1)
        self._in_flight = InFlight(was, wanted, forced=force)
        self.notifier.status(self._flight_status(self._in_flight))
        self.log.info(
            "restart_begin",
            from_steps=current,
            to_steps=decision.target_steps,
            from_setting=was,
            to_setting=wanted,
            forced=force,
        )
        try:
            applied = self.applier.apply_setting(
                target,
                live,
                window_open=functools.partial(self._window_open, target),
                force=force,
                cancelled=self._freeze_written,
            )
            # Still in flight for a stop: the outcome's save ends the sequence.
            self._record_outcome(applied, self._now())
        finally:
            self.metrics.restart_in_progress.set(0)
            self.metrics.sglang_restarting.set(0)
            self._in_flight = None

    def _record_outcome(self, outcome: ApplyOutcome, now: float) -> None:
        self._seen_at = now  # the sequence watched SGLang: no gap in what specd saw
        log = self.log.bind(
            result=outcome.result,
            from_steps=outcome.from_steps,
            to_steps=outcome.to_steps,
            from_setting=outcome.from_setting,
            to_setting=outcome.to_setting,
            duration_s=round(outcome.duration_s, 1),
            message=outcome.message,
        )
        if outcome.pending:
            # The system shuts down mid-restart: the sequence is not over, and its journal
            # (the applier saved it) is for the next start to finish, after the reboot.
            log.warning("restart_pending_until_next_start")
            self._save_state(force=True)
            return
        # The outcome is recorded in the same state write that clears the journal, so a
        # specd restarted later neither loses it nor counts it twice.
        self.state.journal = None
        if outcome.result != "success":
            # The change never ran, or was rolled back: nothing of it to verify (`specd
            # status` said it verified a 4 that SGLang no longer ran).
            self.state.verifying = None
        if outcome.drain is not None:
            self._record_drain(outcome.drain, now)
        restarted = outcome.sglang_restarts
        if outcome.result == "aborted" and restarted == 0:
            self._note_refusal(outcome, now, log)
            return
        self._refused = None
        self.state.restarts.append(
            {
                "t": now,
                "from_steps": outcome.from_steps,
                "to_steps": outcome.to_steps,
                "from_setting": outcome.from_setting,
                "to_setting": outcome.to_setting,
                "result": outcome.result,
                "duration_s": outcome.duration_s,
                "message": outcome.message,
                # What the daily budget counts (state.restart_count): none where SGLang
                # was not restarted, two for a rollback.
                "restarts": restarted,
            }
        )
        self.state.restarts = [r for r in self.state.restarts if now - float(r["t"]) < 30 * DAY_S]
        self.metrics.restarts.labels(result=outcome.result).inc()
        if restarted:
            # SGLang started afresh: its warm-up stays out of what is learned, and a new
            # setting earns its stabilization window anew. A sequence that restarted nothing
            # ("SGLang kept …", a journal specd could not read) left SGLang serving as it
            # was: marking a start would throw its next observations away as warm-up.
            self.metrics.restart_duration.observe(outcome.duration_s)
            self.state.history.mark_sglang_start(now)
            self.state.sglang_started_at = now
            self.state.adopt(self.state.control().after_restart(now))
        if outcome.result in ("rolled_back", "aborted"):
            self._note_live(outcome.from_steps, now, "rollback", outcome.from_setting)
        elif outcome.result != "success":
            self._note_live(None, now, "failed restart", None)
        if outcome.result == "success":
            self._note_live(outcome.to_steps, now, "verified restart", outcome.to_setting)
            before, after = _kind_of(outcome.from_setting), _kind_of(outcome.to_setting)
            if before is not None and after is not None:
                self.metrics.setting_changes.labels(from_kind=before, to_kind=after).inc()
            log.info("restart_done", capacity=outcome.capacity)
        elif outcome.result == "aborted":
            # Backed out to the setting SGLang ran, for a cause that is not the target's
            # (systemd's start limit refused the change's start, or its setup of the
            # process failed before SGLang ran): nothing to freeze for.
            log.warning("restart_aborted", restarts=restarted)
        else:
            self.state.frozen = {
                "since": now,
                "reason": f"restart to {outcome.to_setting or outcome.to_steps} "
                f"{outcome.result}: {outcome.message}",
            }
            log.error("restart_failed_frozen")
        self._save_state(force=True)

    def _refusal_stands(self, decision: Decision, now: float) -> bool:
        """Whether the change ``decision`` wants was refused before anything was done less
        than REFUSED_RETRY_S ago (a clock stepped back counts as a wait over)."""
        refused = self._refused
        return (
            refused is not None
            and refused.wanted == decision.target_name
            and 0.0 <= now - refused.tried_at < REFUSED_RETRY_S
        )

    def _note_refusal(self, outcome: ApplyOutcome, now: float, log: Any) -> None:
        """A sequence that ended aborted with nothing restarted: said, and saved, when it is
        new (another change, another reason) or was last said DECISION_RELOG_S ago."""
        wanted = outcome.to_setting or str(outcome.to_steps)
        last = self._refused
        if (
            last is not None
            and last.wanted == wanted
            and last.message == outcome.message
            and 0.0 <= now - last.said_at < DECISION_RELOG_S
        ):
            last.tried_at, last.times = now, last.times + 1
            return
        times = 1 if last is None or last.wanted != wanted else last.times + 1
        log.info("restart_aborted", times=times, retry_in_s=REFUSED_RETRY_S)
        self._refused = Refused(wanted, outcome.message, tried_at=now, said_at=now, times=times)
        self._save_state(force=True)

    def _record_drain(self, drain: Mapping[str, Any], now: float) -> None:
        m = self.metrics
        if drain["result"] is not None:  # None: a re-add after a restart of specd
            m.drains.labels(result=drain["result"]).inc()
            m.drain_duration.observe(float(drain["duration_s"]))
        if drain["in_flight_at_restart"] is not None:
            m.requests_in_flight_at_restart.set(drain["in_flight_at_restart"])
        record = {k: v for k, v in drain.items() if k != "left_out"}
        gateway = {**(self.state.gateway or {}), "last_drain": {"t": now, **record}}
        if drain["readd_problem"] is not None:
            self.log.error("gateway_worker_left_out", problem=drain["readd_problem"])
        left_out = [w for w in drain.get("left_out") or [] if isinstance(w, dict)]
        if left_out:
            # Kept past the journal: re-added from the next tick on (_readd_left_out). One
            # entry per replica, this drain's over an older one's.
            kept = gateway.get("left_out") or {}
            older = [w for w in kept.get("workers") or [] if isinstance(w, dict)]
            mine = {w.get("gateway_url") for w in left_out}
            workers = [w for w in older if w.get("gateway_url") not in mine] + left_out
            gateway["left_out"] = {
                "t": kept.get("t", now),
                "workers": workers,
                "tried_at": now,
                "problem": drain["readd_problem"],
            }
            self._readd_tried_at = now
        self.state.gateway = gateway

    def _check_unfreeze_request(self, now: float) -> None:
        path = Path(self.config.files.state_dir) / UNFREEZE_REQUEST
        try:
            st = os.lstat(path)
        except OSError:
            return  # none (or the directory is unreadable: the state's own problem)
        mark = (st.st_dev, st.st_ino, st.st_mtime_ns)
        if mark == self._unremovable_unfreeze:
            return
        if st.st_uid not in self.allowed_override_uids:
            # Only root and specd's user may ask (`specd unfreeze` runs as one): anyone
            # else who could write here (a state_dir made writable by hand) may not lift a
            # freeze a failed restart set. Said once, ignored until it is replaced.
            self._unremovable_unfreeze = mark
            self.log.error(
                "unfreeze_request_refused",
                path=str(path),
                owner=st.st_uid,
                effect="not honoured: only root or specd's user may unfreeze (`sudo specd "
                "unfreeze`); ignored until it is replaced",
            )
            return
        try:
            request = files.parse_json(files.read_regular_file(path, MAX_UNFREEZE_REQUEST_BYTES))
            reason = str(request.get("reason", ""))
        except files.MissingFileError:
            return
        except (ValueError, AttributeError) as exc:  # files.FileReadError, files.ParseError
            reason = f"(unreadable request: {exc})"
        if self.state.frozen is not None:
            self.log.warning(
                "unfrozen",
                reason=reason,
                was=self.state.frozen.get("reason"),
                at=iso_time(utc(now)),
            )
            self.state.frozen = None
        try:
            path.unlink()
        except OSError as exc:
            self._unremovable_unfreeze = mark
            self.log.error(
                "unfreeze_request_not_removed",
                error=str(exc),
                effect="honoured once; ignored until it is replaced",
            )
        self._save_state(force=True)

    def _update_gauges(self, now: float, override: Override | None) -> None:
        cfg = self.config
        m = self.metrics
        obs = self.last_obs
        m.steps_current.set(self.live_steps if self.live_steps is not None else float("nan"))
        m.set_setting_kind(_live_kind(self.live_steps, self.live_adaptive))
        wanted = self.last_decision.target_name if self.last_decision is not None else None
        m.set_settings(self.live_name, wanted)
        # Unknown while SGLang does not answer, as steps_current: not the last value seen.
        m.offered_concurrency_now.set(
            # The latest scrape answered when no outage runs: last_obs is from it.
            obs.offered if obs is not None and not self._failing() else float("nan")
        )
        history: History = self.state.history
        for q in OFFERED_QUANTILES:
            value = history.quantile(float(q))
            m.offered_concurrency.labels(q=q).set(value if value is not None else 0.0)
        lengths: dict[str, float] = {}
        alphas: dict[str, float] = {}
        for k in range(cfg.choose.min_steps, cfg.choose.max_steps + 1):
            length = history.accept_length(k)
            if length is not None:
                lengths[str(k)] = length
                alpha = history.alpha(k)
                if alpha is not None:
                    alphas[str(k)] = alpha
        # Only the configured step counts: one a reload left out keeps no old value.
        m.set_by_setting(m.accept_length, lengths)
        m.set_by_setting(m.acceptance_alpha, alphas)
        self._window_gauges(now)
        spent = self.state.restarts_in_day(now)
        m.restart_budget.set(cfg.restart.daily_restart_budget)
        m.restart_budget_remaining.set(max(0, cfg.restart.daily_restart_budget - spent))
        m.frozen.set(1 if self.state.frozen is not None else 0)
        m.gateway_worker_left_out.set(self._left_out_replicas())

        status = self.override.status
        m.override_present.set(1 if status is not None and status.present else 0)
        m.override_valid.set(0 if status is not None and status.present and not status.valid else 1)
        shown = status.override if status is not None and status.override is not None else None
        expires = shown.expires_at if shown is not None else None
        m.override_expiry.set(expires.timestamp() if expires is not None else float("nan"))
        since = self.override.since if override is not None else None
        m.override_since.set(since if since is not None else float("nan"))
        frozen = self.state.frozen is not None
        if override is not None:
            # A freeze after a failed restart holds whatever the file says (`decide`).
            m.set_mode("freeze" if frozen else override.mode)
            m.set_override_info(override.mode, override.reason)
            # What is enforced: frozen, decide holds SGLang as it is, not at the pin.
            pinned = override.steps if override.mode == "pin" and not frozen else None
            m.steps_pinned.set(pinned if pinned is not None else float("nan"))
        else:
            m.set_mode("freeze" if frozen else "auto")
            m.set_override_info(None, "")
            m.steps_pinned.set(float("nan"))

    def _window_gauges(self, now: float) -> None:
        windows_ = self.config.windows
        at = utc(now)
        self._window_gauges_at = time.monotonic()
        self.metrics.window_open.set(1 if windows.is_open(windows_, at) else 0)
        self.metrics.window_next_open.set(windows.next_open(windows_, at).timestamp())
        self.metrics.window_next_close.set(windows.next_close(windows_, at).timestamp())

    def _status_text(self) -> str:
        d = self.last_decision
        live = self.live_steps
        if self.live_adaptive:
            parts = [self.live_name or "adaptive"]
        else:
            parts = [f"steps {live if live is not None else '?'}"]
        if d is not None:
            parts.append(f"target {d.target_name or d.target_steps}")
            parts.append(d.reason.value)
        in_force = self.override.in_force
        mode = in_force.mode if in_force is not None else "auto"
        parts.append(f"mode {mode}")
        if self.state.frozen is not None:
            parts.append("FROZEN")
        return ", ".join(parts)


def _journal_change(journal: object) -> tuple[str, str]:
    """(from, to) of a persisted journal for STATUS=, as the operator writes settings; it
    may be one the applier cannot read, so nothing about it is trusted but its text."""
    if not isinstance(journal, Mapping):
        return "unknown", "unknown"

    def named(end: str) -> str:
        value = journal.get(f"{end}_setting")
        if value is None:
            value = journal.get(f"{end}_steps")
        return "unknown" if value is None else " ".join(str(value).split())[:40]

    return named("from"), named("to")


def _same_meaning(a: OverrideStatus, b: OverrideStatus) -> bool:
    """Two readings of one override file that say the same: in force or ignored alike."""
    return (a.valid, a.override, a.problem) == (b.valid, b.override, b.problem)


def _named(config_path: Path | None) -> Path | None:
    """The config file a start or reload reads: ``config_path``, else the default file
    where it exists. Named from then on, a reload that finds it missing is rejected,
    not taken as every default (another SGLang, unit, windows)."""
    if config_path is None and config_io.DEFAULT_CONFIG_PATH.exists():
        return config_io.DEFAULT_CONFIG_PATH
    return config_path


def _outside_range(
    override: Override | None, low: int, high: int, listed: Sequence[str]
) -> str | None:
    """Why a pin holds a step count outside ``low``..``high`` (a set not one of
    ``listed``, adaptive_candidate_sets: `specd.core.setting.outside_steps`), or None."""
    if override is None or override.mode != "pin":
        return None
    pinned = override.setting or (static(override.steps) if override.steps is not None else None)
    if pinned is None:
        return None
    outside = outside_steps(pinned, low, high, listed)
    if not outside:
        return None
    unlisted = f", and {UNLISTED_SET}"
    return (
        f"pin {override.pinned_name}: {', '.join(map(str, outside))} outside the configured "
        f"range {low}..{high}" + (unlisted if pinned.kind == "adaptive" else "")
    )


def _regressing_settings(config: Config) -> list[str]:
    """The regressions counter's labels beyond the step counts: off and the adaptive sets
    the policy may change to."""
    kinds = config.choose.kinds
    return (["off"] if "off" in kinds else []) + (
        list(config.choose.adaptive_candidate_sets) if "adaptive" in kinds else []
    )


def _band_boundary(config: Config) -> float:
    """The lightest band's upper offered concurrency; NaN under the model policy (which
    picks without bands: a boundary shown would be one nothing decides by)."""
    if config.choose.policy == "model":
        return float("nan")
    first = config.bands[0].max_concurrency if config.bands else None
    return float(first) if first is not None else float("nan")


def _live_kind(steps: int | None, adaptive: bool) -> str:
    """The kind label of what SGLang runs: steps 0 is no drafting."""
    if adaptive:
        return "adaptive"
    if steps is None:
        return "unknown"
    return "off" if steps == 0 else "static"


def _kind_of(text: str | None) -> str | None:
    """The kind of a setting in its text form (the applier's outcome), None if unknown."""
    if text is None:
        return None
    try:
        return parse_setting(text).kind
    except ValueError:
        return None
