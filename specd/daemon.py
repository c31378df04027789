"""`specd run`: the daemon loop, observe → record → decide → apply → report.

One thread runs the loop; every wait in it is ``Event.wait`` so SIGTERM and SIGHUP
interrupt it at once. A second thread only feeds systemd's watchdog, and only while
the loop is demonstrably alive (it beats on every tick and on every wait inside a
restart sequence), so a hung loop is killed by systemd while a long, healthy restart
of a 100B model is not.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import FrameType
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server

from specd.core import windows
from specd.core.decide import Control, Decision, Reason, decide, recommend
from specd.core.history import History, HistorySettings, Recorded
from specd.core.model import predicted_throughput
from specd.core.observation import Observation, ScrapeError
from specd.core.override import Override
from specd.io import logs
from specd.io.apply import Applier, ApplyOutcome
from specd.io.config import Config, ConfigError, config_changes, load_config
from specd.io.metrics import OFFERED_QUANTILES, Metrics
from specd.io.notify import Notifier
from specd.io.override import OverrideStatus, read_override
from specd.io.runner import Runner, SubprocessRunner
from specd.io.sglang import SGLangClient
from specd.io.state import StateStore

UNFREEZE_REQUEST = "unfreeze.json"
# Re-log an unchanged decision this often, so the journal shows specd is alive and why
# it is not acting, without a line every scrape.
DECISION_RELOG_S = 600.0
STATE_SAVE_INTERVAL_S = 60.0
DAY_S = 86400.0


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


@dataclass
class OverrideTracker:
    """The override in force: the last valid file content; invalid files are ignored."""

    good: Override | None = None
    fingerprint: object = None
    status: OverrideStatus | None = None


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
    ) -> None:
        self.config = config
        self.config_path = config_path
        self.clock = clock
        self.log = logs.get_logger()
        self.metrics = Metrics(registry, reasons=[r.value for r in Reason])
        self.notifier = notifier or Notifier()
        self.runner: Runner = runner or SubprocessRunner()
        self.allowed_override_uids = allowed_override_uids or (0, os.getuid())

        self._last_beat = time.monotonic()
        self.stop_event = BeatingEvent(self._heartbeat)
        self._wake = threading.Event()
        self._reload_requested = threading.Event()
        self.metrics_port: int | None = None
        self._metrics_server: Any = None

        self.store = StateStore(
            Path(config.files.state_dir), history_settings=HistorySettings.from_config(config)
        )
        self.state, problem = self.store.load()
        if problem:
            self.metrics.state_load_errors.inc()
            self.log.error("state_load_failed", problem=problem, action="history rebuilt")
        # The client stamps observations with the daemon's clock: decide compares that stamp
        # with `now`, and two different clocks would make every observation look stale.
        self.client = SGLangClient(
            config.sglang.url, timeout_s=config.observe.scrape_timeout_s, clock=self.clock
        )
        self.applier = self._make_applier()
        self.override = OverrideTracker()
        self.last_obs: Observation | None = None
        self.last_decision: Decision | None = None
        self._last_logged: tuple[str, int | None] | None = None
        self._last_logged_at = 0.0
        self._last_saved_at = 0.0

    # -- wiring -------------------------------------------------------------------
    def _make_applier(self) -> Applier:
        return Applier.from_settings(
            self.config,
            self.client,
            self.runner,
            self._persist_journal,
            self.stop_event,
            clock=self.clock,
        )

    def _persist_journal(self, journal: dict[str, Any] | None) -> None:
        self.state.journal = journal
        self._save_state(force=True)

    def _heartbeat(self) -> None:
        self._last_beat = time.monotonic()

    def _save_state(self, *, force: bool = False) -> None:
        now = self.clock()
        if not force and now - self._last_saved_at < STATE_SAVE_INTERVAL_S:
            return
        error = self.store.save(self.state)
        self._last_saved_at = now
        if error:
            self.metrics.state_write_errors.inc()
            self.log.error("state_write_failed", error=error)

    # -- signals ------------------------------------------------------------------
    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self._on_sigterm)
        signal.signal(signal.SIGINT, self._on_sigterm)
        signal.signal(signal.SIGHUP, self._on_sighup)

    def _on_sigterm(self, _signum: int, _frame: FrameType | None) -> None:
        self.stop_event.set()
        self._wake.set()

    def _on_sighup(self, _signum: int, _frame: FrameType | None) -> None:
        # Several SIGHUPs in a row collapse into one reload.
        self._reload_requested.set()
        self._wake.set()

    def request_stop(self) -> None:
        self.stop_event.set()
        self._wake.set()

    # -- reload -------------------------------------------------------------------
    def reload(self) -> None:
        self._reload_requested.clear()
        self.notifier.reloading()
        try:
            new = load_config(self.config_path)
        except ConfigError as exc:
            for problem in exc.problems:
                self.log.error("reload_rejected", problem=problem)
            self.notifier.reloaded(self._status_text() + " (reload rejected, old config kept)")
            return
        old = self.config
        self.config = new
        if (new.report.metrics_listen_address, new.report.metrics_port) != (
            old.report.metrics_listen_address,
            old.report.metrics_port,
        ):
            self.log.warning(
                "reload_partial", detail="metrics address changes need a restart of specd"
            )
        if (
            new.sglang.url != old.sglang.url
            or new.observe.scrape_timeout_s != old.observe.scrape_timeout_s
        ):
            self.client.close()
            self.client = SGLangClient(
                new.sglang.url, timeout_s=new.observe.scrape_timeout_s, clock=self.clock
            )
        self.applier = self._make_applier()
        self.state.history.reconfigure(HistorySettings.from_config(new))
        self.override.fingerprint = None  # re-read the override file too
        # The keys a reload changed, so the journal shows what took effect.
        changed = config_changes(old, new)
        self.log.info("reloaded", config=str(self.config_path), changed=changed)
        self.notifier.reloaded(self._status_text())

    # -- the loop -----------------------------------------------------------------
    def start_metrics_server(self) -> None:
        server, _thread = start_http_server(
            self.config.report.metrics_port,
            addr=self.config.report.metrics_listen_address,
            registry=self.metrics.registry,
        )
        self._metrics_server = server
        self.metrics_port = int(server.server_port)
        self.log.info(
            "metrics_serving",
            url=f"http://{self.config.report.metrics_listen_address}:{self.metrics_port}/metrics",
        )

    def run(self) -> int:
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
        self._reconcile_journal()
        self.tick()  # READY comes after the first scrape was attempted
        self.notifier.ready(self._status_text())
        watchdog = threading.Thread(target=self._watchdog_loop, name="watchdog", daemon=True)
        watchdog.start()
        while not self.stop_event.is_set():
            self._wake.wait(self.config.observe.scrape_interval_s)
            self._wake.clear()
            self._heartbeat()
            if self.stop_event.is_set():
                break
            if self._reload_requested.is_set():
                self.reload()
            self.tick()
        self.notifier.stopping("stopping")
        self._save_state(force=True)
        self.client.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        self.log.info("stopped")
        return 0

    def _watchdog_loop(self) -> None:
        period = self.notifier.watchdog_period_s
        if period is None:
            return
        # The longest single blocking call in the loop is a `systemctl restart` or a health
        # probe; past that without a beat, the loop is stuck and systemd should kill us.
        stall_limit = (
            max(
                self.config.restart.restart_command_timeout_s,
                self.config.restart.health_probe_timeout_s,
            )
            + 30
        )
        while True:
            if time.monotonic() - self._last_beat < stall_limit:
                self.notifier.watchdog()
            time.sleep(period / 2)

    def _reconcile_journal(self) -> None:
        if not self.state.journal:
            return
        self.log.warning("reconciling_interrupted_restart", journal=self.state.journal)
        outcome = self.applier.reconcile(self.state.journal)
        if outcome is not None:
            self._record_outcome(outcome, self.clock())
        else:
            self.state.journal = None
            self._save_state(force=True)

    def tick(self) -> Decision:
        started = time.perf_counter()
        now = self.clock()
        self._heartbeat()
        self._check_unfreeze_request(now)
        result = self._observe(now)
        override = self._refresh_override(now)
        current = result.steps if isinstance(result, Observation) else None
        rec = recommend(self.state.history, self.config, current)
        if rec is not None and isinstance(result, Observation):
            self.state.note_recommendation(now, rec[0], self.config.choose.stabilization_window_s)
        decision = decide(self.state.history, result, self.config, override, now, self._control())
        self.last_decision = decision
        if self.config.choose.policy == "model":
            self._report_predictions(current)
        self._report_decision(decision, current, now, rec)
        if decision.acts(current):
            self._apply(decision, current, override, now)
        self._update_gauges(now, override)
        self.notifier.status(self._status_text())
        self._save_state()
        self.metrics.tick_duration.observe(time.perf_counter() - started)
        return decision

    # -- pieces of a tick ---------------------------------------------------------
    def _observe(self, now: float) -> Observation | ScrapeError:
        self.metrics.scrapes.inc()
        result = self.client.observe()
        if isinstance(result, ScrapeError):
            self.metrics.sglang_up.set(0)
            self.metrics.scrape_errors.labels(kind=result.kind).inc()
            self.log.warning("scrape_failed", kind=result.kind, reason=result.reason)
            return result
        self.metrics.sglang_up.set(1)
        self.metrics.last_scrape_success.set(result.t)
        if self.state.history.record(result) is Recorded.RESTART_DETECTED:
            # Counters went backwards or the step count changed: SGLang restarted behind
            # our back; its warm-up is excluded from the history.
            self.log.info("sglang_restart_detected")
            self.state.sglang_started_at = now
        self.last_obs = result
        return result

    def _refresh_override(self, now: float) -> Override | None:
        path = Path(self.config.files.override_file)
        status = read_override(
            path,
            self.config.choose.min_steps,
            self.config.choose.max_steps,
            utc(now),
            allowed_uids=self.allowed_override_uids,
        )
        tracker = self.override
        changed = status.fingerprint != tracker.fingerprint or (
            tracker.status is not None and status.valid != tracker.status.valid
        )
        if changed:
            if not status.present:
                if tracker.good is not None:
                    self.log.info("override_removed")
                tracker.good = None
            elif status.valid:
                tracker.good = status.override
                self.log.info(
                    "override_loaded",
                    mode=status.override.mode if status.override else None,
                    reason=status.override.reason if status.override else None,
                )
            else:
                # Logged once per change of the file; the last good override holds.
                self.log.error("override_ignored", problem=status.problem, file=str(path))
            tracker.fingerprint = status.fingerprint
        tracker.status = status
        good = tracker.good
        if good is not None and not good.active(utc(now)):
            if changed or tracker.good is not None:
                self.log.info("override_expired", mode=good.mode)
            tracker.good = None
            good = None
        return good

    def _control(self) -> Control:
        frozen = self.state.frozen
        return Control(
            current_steps=self.last_obs.steps if self.last_obs else None,
            restart_times=tuple(
                float(r["t"]) for r in self.state.restarts if r.get("result") != "aborted"
            ),
            frozen=frozen is not None,
            frozen_reason=frozen.get("reason") if frozen else None,
            recommendations=tuple((float(t), int(s)) for t, s in self.state.recommendations),
        )

    def _report_predictions(self, current: int | None) -> None:
        predictions = predicted_throughput(self.state.history, self.config, current)
        gauge = self.metrics.predicted_throughput
        gauge.clear()  # a step count that left the candidates must not keep a stale value
        for steps, tok_s in predictions.items():
            gauge.labels(steps=str(steps)).set(tok_s)

    def _report_decision(
        self,
        decision: Decision,
        current: int | None,
        now: float,
        rec: tuple[int, str] | None,
    ) -> None:
        target = decision.target_steps
        self.metrics.record_decision(decision.reason.value, target, now)
        self.state.last_decision = {
            "t": now,
            "target_steps": target,
            "reason": decision.reason.value,
            "message": decision.message,
            "current_steps": current,
        }
        key = (decision.reason.value, target)
        acts = decision.acts(current)
        if acts or key != self._last_logged or now - self._last_logged_at >= DECISION_RELOG_S:
            self.log.info(
                "decision",
                reason=decision.reason.value,
                target_steps=target,
                current_steps=current,
                acts=acts,
                message=decision.message,
                recommendation=rec[0] if rec else None,
                recommendation_why=rec[1] if rec else None,
            )
            self._last_logged = key
            self._last_logged_at = now

    def _window_open(self) -> bool:
        return windows.is_open(self.config.windows, utc(self.clock()))

    def _apply(
        self, decision: Decision, current: int | None, override: Override | None, now: float
    ) -> None:
        assert decision.target_steps is not None
        force = (
            override is not None
            and override.mode == "pin"
            and override.apply == "now"
            and decision.reason is Reason.OVERRIDE_PIN
        )
        self.metrics.restart_in_progress.set(1)
        self.notifier.status(f"restarting SGLang: steps {current} → {decision.target_steps}")
        self.log.info(
            "restart_begin", from_steps=current, to_steps=decision.target_steps, forced=force
        )
        try:
            outcome = self.applier.apply(
                decision.target_steps,
                current if current is not None else decision.target_steps,
                window_open=self._window_open,
                force=force,
            )
        finally:
            self.metrics.restart_in_progress.set(0)
        self._record_outcome(outcome, self.clock())

    def _record_outcome(self, outcome: ApplyOutcome, now: float) -> None:
        log = self.log.bind(
            result=outcome.result,
            from_steps=outcome.from_steps,
            to_steps=outcome.to_steps,
            duration_s=round(outcome.duration_s, 1),
            message=outcome.message,
        )
        # The outcome is recorded in the same state write that clears the journal, so a
        # specd restarted later neither loses it nor counts it twice.
        self.state.journal = None
        if outcome.result == "aborted":
            log.info("restart_aborted")
            self._save_state(force=True)
            return
        self.state.restarts.append(
            {
                "t": now,
                "from_steps": outcome.from_steps,
                "to_steps": outcome.to_steps,
                "result": outcome.result,
                "duration_s": outcome.duration_s,
                "message": outcome.message,
            }
        )
        self.state.restarts = [r for r in self.state.restarts if now - float(r["t"]) < 30 * DAY_S]
        self.metrics.restarts.labels(result=outcome.result).inc()
        self.metrics.restart_duration.observe(outcome.duration_s)
        self.state.history.mark_sglang_start(now)
        self.state.sglang_started_at = now
        self.state.recommendations = []
        if outcome.result == "success":
            log.info("restart_done", capacity=outcome.capacity)
        else:
            self.state.frozen = {
                "since": now,
                "reason": f"restart to {outcome.to_steps} {outcome.result}: {outcome.message}",
            }
            log.error("restart_failed_frozen")
        self._save_state(force=True)

    def _check_unfreeze_request(self, now: float) -> None:
        path = Path(self.config.files.state_dir) / UNFREEZE_REQUEST
        if not path.exists():
            return
        try:
            request = json.loads(path.read_text())
            reason = str(request.get("reason", ""))
        except (OSError, ValueError, AttributeError) as exc:
            reason = f"(unreadable request: {exc})"
        if self.state.frozen is not None:
            self.log.warning(
                "unfrozen", reason=reason, was=self.state.frozen.get("reason"), at=utc(now)
            )
            self.state.frozen = None
        try:
            path.unlink()
        except OSError as exc:
            self.log.error("unfreeze_request_not_removed", error=str(exc))
        self._save_state(force=True)

    def _update_gauges(self, now: float, override: Override | None) -> None:
        cfg = self.config
        m = self.metrics
        obs = self.last_obs
        m.steps_current.set(
            obs.steps if obs is not None and obs.steps is not None else float("nan")
        )
        if obs is not None:
            m.offered_concurrency_now.set(obs.offered)
        history: History = self.state.history
        for q in OFFERED_QUANTILES:
            value = history.quantile(float(q))
            m.offered_concurrency.labels(quantile=q).set(value if value is not None else 0.0)
        for k in range(cfg.choose.min_steps, cfg.choose.max_steps + 1):
            length = history.accept_length(k)
            if length is not None:
                m.accept_length.labels(steps=str(k)).set(length)
                alpha = history.alpha(k)
                if alpha is not None:
                    m.acceptance_alpha.labels(steps=str(k)).set(alpha)
        at = utc(now)
        m.window_open.set(1 if windows.is_open(cfg.windows, at) else 0)
        m.window_next_open.set(windows.next_open(cfg.windows, at).timestamp())
        m.window_next_close.set(windows.next_close(cfg.windows, at).timestamp())
        recent = [r for r in self.state.restarts if now - float(r["t"]) < DAY_S]
        m.restart_budget_remaining.set(max(0, cfg.restart.daily_restart_budget - len(recent)))
        m.frozen.set(1 if self.state.frozen is not None else 0)

        status = self.override.status
        m.override_present.set(1 if status is not None and status.present else 0)
        m.override_valid.set(0 if status is not None and status.present and not status.valid else 1)
        shown = status.override if status is not None and status.override is not None else None
        expires = shown.expires_at if shown is not None else None
        m.override_expiry.set(expires.timestamp() if expires is not None else float("nan"))
        if override is not None:
            m.set_mode(override.mode)
            m.set_override_info(override.mode, override.reason)
            m.steps_pinned.set(
                override.steps if override.mode == "pin" and override.steps else float("nan")
            )
        else:
            m.set_mode("freeze" if self.state.frozen is not None else "auto")
            m.set_override_info(None, "")
            m.steps_pinned.set(float("nan"))

    def _status_text(self) -> str:
        obs = self.last_obs
        d = self.last_decision
        parts = [f"steps {obs.steps if obs else '?'}"]
        if d is not None:
            parts.append(f"target {d.target_steps}")
            parts.append(d.reason.value)
        mode = self.override.good.mode if self.override.good else "auto"
        parts.append(f"mode {mode}")
        if self.state.frozen is not None:
            parts.append("FROZEN")
        return ", ".join(parts)


def _band_boundary(config: Config) -> float:
    first = config.bands[0].max_concurrency if config.bands else None
    return float(first) if first is not None else float("nan")
