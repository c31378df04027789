"""Every metric specd exports, in one place, on an injectable registry.

Names carry the ``specd_`` prefix and base units (seconds, ratios); counters end in
``_total``. Labels are bounded: reasons, results, error kinds and modes are fixed
enums, and ``steps`` is bounded by the configured step range.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from specd import __version__
from specd.core.observation import CHECKED_FIELDS
from specd.io.apply import DRAIN_RESULTS
from specd.io.fleet import ERROR_KINDS as FLEET_ETCD_ERROR_KINDS
from specd.io.gateway import ERROR_KINDS as GATEWAY_ERROR_KINDS

# Fixed label values, so dashboards and alerts can rely on every series existing from
# the first scrape (a counter that appears only after its first increment breaks
# `increase()` and `absent()` based rules).
# aborted: only those that restarted SGLang all the same (systemd's start limit refused the
# change's start, and SGLang was started again on the setting it ran).
RESTART_RESULTS = ("success", "rolled_back", "failed", "aborted")
SCRAPE_ERROR_KINDS = ("timeout", "refused", "http_status", "malformed", "missing", "api_key")
MODES = ("auto", "pin", "freeze")
# The kind of speculative setting SGLang runs (specd.core.setting.Kind) or "unknown".
SETTING_KINDS = ("off", "static", "adaptive", "unknown")
CHANGE_KINDS = ("off", "static", "adaptive")
OFFERED_QUANTILES = ("0.5", "0.9", "0.99")
# A drain waits for requests in flight to end: seconds to minutes.
DRAIN_DURATION_BUCKETS = (0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# Restarts of a 100B+ model take minutes; buckets reach 30 minutes.
RESTART_DURATION_BUCKETS = (15, 30, 60, 90, 120, 180, 240, 300, 450, 600, 900, 1800)
# A slot is free at once or after one server's restart (minutes), or a window later.
SLOT_WAIT_BUCKETS = (0.1, 1, 5, 15, 30, 60, 120, 300, 600, 900, 1800, 3600)


class Metrics:
    """specd's metrics. Pass a fresh ``CollectorRegistry`` in tests."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        reasons: Iterable[str] = (),
        steps: Iterable[int] = (),
        settings: Iterable[str] = (),
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        # The ``steps`` values each gauge of set_by_setting shows now, by gauge.
        self._by_setting: dict[int, set[str]] = {}
        self.build_info = Info("specd_build", "specd version.", registry=r)
        self.build_info.info({"version": __version__})
        self.start_time = Gauge(
            "specd_start_time_seconds",
            "Unix time this specd process started: each change is a start (a crash, the "
            "watchdog, a deploy), which a specd back within a scrape or two hides from up.",
            registry=r,
        )

        self.steps_current = Gauge(
            "specd_steps_current",
            "Speculative step count SGLang runs now (from sglang:spec_num_steps or "
            "/server_info); NaN when unknown.",
            registry=r,
        )
        self.steps_target = Gauge(
            "specd_steps_target", "Step count of specd's latest decision.", registry=r
        )
        self.steps_pinned = Gauge(
            "specd_steps_pinned",
            "Step count an override's pin holds SGLang at now; NaN when none does (no pin in "
            "force, a pin of off or an adaptive set, or frozen after a failed restart).",
            registry=r,
        )
        self.mode = Gauge(
            "specd_mode",
            "1 for the active mode, else 0: auto (specd decides), pin (an override holds a "
            "setting), freeze (no automatic change: an override freeze, or specd_frozen after "
            "a failed restart).",
            ["mode"],
            registry=r,
        )
        self.setting_kind = Gauge(
            "specd_setting_kind",
            "1 for the kind of speculative setting SGLang runs now (off, static, adaptive, "
            "unknown), else 0.",
            ["kind"],
            registry=r,
        )
        # Which setting, not only its kind: under adaptive there is no step count to show.
        self.setting_live = Gauge(
            "specd_setting_live",
            "1 for the speculative setting SGLang runs now, as the operator writes it "
            '("4", "off", "adaptive:3,4"; an adaptive config specd does not offer: '
            '"adaptive (its file)"); no sample while unknown.',
            ["setting"],
            registry=r,
        )
        self.setting_target = Gauge(
            "specd_setting_target",
            "1 for the setting of specd's latest decision, as the operator writes it; no "
            "sample while it names none.",
            ["setting"],
            registry=r,
        )
        self.setting_changes = Counter(
            "specd_setting_changes_total",
            "Verified restarts by the kind of setting before and after (static to static is a "
            "change of step count).",
            ["from_kind", "to_kind"],
            registry=r,
        )
        self.decisions = Counter(
            "specd_decisions_total", "Decisions taken, by reason.", ["reason"], registry=r
        )
        self.last_decision_time = Gauge(
            "specd_last_decision_timestamp_seconds",
            "Unix time of the latest decision.",
            registry=r,
        )
        self.last_decision_reason = Gauge(
            "specd_last_decision",
            "1 for the reason of the latest decision, 0 for the others.",
            ["reason"],
            registry=r,
        )
        self.restarts = Counter(
            "specd_restarts_total",
            "Restart sequences specd ended, by result: success, rolled_back, failed (each "
            "with 0, 1 or 2 SGLang restarts: a rollback is one sequence of two), aborted only "
            "where it restarted SGLang all the same. Not SGLang restarts: the daily budget "
            "counts those (specd_restart_budget_remaining).",
            ["result"],
            registry=r,
        )
        self.restart_duration = Histogram(
            "specd_restart_duration_seconds",
            "Time from a sequence's first `systemctl restart` to its end (verified, rolled "
            "back or failed), for sequences that restarted SGLang.",
            buckets=RESTART_DURATION_BUCKETS,
            registry=r,
        )
        self.sglang_restarting = Gauge(
            "specd_sglang_restarting",
            "1 from the moment specd restarts SGLang (a change's restart or a rollback's) "
            "until the sequence ends: SGLang is down on purpose. 0 while a sequence only "
            "waits (for a fleet slot, a quiet moment, the drain), SGLang still serving.",
            registry=r,
        )
        self.restart_in_progress = Gauge(
            "specd_restart_in_progress", "1 while a restart sequence runs.", registry=r
        )
        self.restart_budget = Gauge(
            "specd_restart_budget",
            "SGLang restarts the config allows in a rolling 24 h (restart.daily_restart_budget; "
            "0: automatic restarts off, as the operator chose).",
            registry=r,
        )
        self.restart_budget_remaining = Gauge(
            "specd_restart_budget_remaining",
            "SGLang restarts still allowed in the rolling 24 h budget (a rollback uses two).",
            registry=r,
        )
        self.frozen = Gauge(
            "specd_frozen",
            "1 when automatic changes are frozen after a failed restart, until an operator "
            "clears it.",
            registry=r,
        )
        self.window_open = Gauge(
            "specd_window_open", "1 while a maintenance window is open.", registry=r
        )
        self.window_next_open = Gauge(
            "specd_window_next_open_timestamp_seconds",
            "Unix time the next maintenance window opens.",
            registry=r,
        )
        self.window_next_close = Gauge(
            "specd_window_next_close_timestamp_seconds",
            "Unix time the current (or next) maintenance window closes.",
            registry=r,
        )
        self.offered_concurrency = Gauge(
            "specd_offered_concurrency",
            "Quantiles of offered concurrency (running + queued) over the decision history, by "
            'q ("0.5", "0.9", "0.99").',
            # Not "quantile": Prometheus reserves it for summaries (promtool check metrics).
            ["q"],
            registry=r,
        )
        self.offered_concurrency_now = Gauge(
            "specd_offered_concurrency_current",
            "Offered concurrency (running + queued) at the latest scrape; NaN when it failed "
            "(or none was made yet).",
            registry=r,
        )
        self.band_boundary = Gauge(
            "specd_band_boundary_concurrency",
            "Upper offered concurrency of the lightest policy band; NaN under the model "
            "policy, which picks by predicted throughput, not by this boundary.",
            registry=r,
        )
        # For SpecdNotScrapingSGLang: the last good scrape is as old as one interval between
        # scrapes, so its staleness bound follows observe.scrape_interval_s (up to an hour).
        self.scrape_interval = Gauge(
            "specd_scrape_interval_seconds",
            "Seconds between specd's scrapes of SGLang (observe.scrape_interval_s, as "
            "configured at start or the latest reload that took effect).",
            registry=r,
        )
        self.accept_length = Gauge(
            "specd_accept_length",
            "Accept length (tokens per verify step, bonus token included) learned per step count.",
            ["steps"],
            registry=r,
        )
        self.acceptance_alpha = Gauge(
            "specd_acceptance_alpha_ratio",
            "Per-draft-token acceptance alpha inverted from the accept length, per step count.",
            ["steps"],
            registry=r,
        )
        self.predicted_throughput = Gauge(
            "specd_predicted_throughput_tokens_per_second",
            "Predicted mean output tokens/s over the coming epoch for each candidate setting: "
            'steps is a step count, "off" or an adaptive set ("adaptive:3,4").',
            ["steps"],
            registry=r,
        )
        self.predicted_throughput_low = Gauge(
            "specd_predicted_throughput_low_tokens_per_second",
            "Lower end of the prediction interval of each candidate's mean output tokens/s.",
            ["steps"],
            registry=r,
        )
        self.predicted_throughput_high = Gauge(
            "specd_predicted_throughput_high_tokens_per_second",
            "Upper end of the prediction interval of each candidate's mean output tokens/s.",
            ["steps"],
            registry=r,
        )
        self.explorations = Counter(
            "specd_explorations_total",
            "Safe explorations begun: one epoch at a step count the evidence could not judge "
            "or specd never observed (decision reason explore), by step count.",
            ["steps"],
            registry=r,
        )
        self.regressions = Counter(
            "specd_regressions_total",
            "Changes specd took back: the setting it changed to served less than the one "
            "before it, beyond noise (decision reason regression), by the regressed setting "
            'as the operator writes it (a step count, "off" or "adaptive:3,4").',
            ["steps"],
            registry=r,
        )
        self.sglang_up = Gauge(
            "specd_sglang_up", "1 when the latest scrape of SGLang succeeded.", registry=r
        )
        self.restarts_outside_window = Counter(
            "specd_restarts_outside_window_total",
            "Restarts of a change that went out while no maintenance window was open (a pin "
            "applied now, a rollback and a restart an earlier run left are not counted): "
            "specd promises none, so each is a bug, logged as restart_outside_window.",
            registry=r,
        )
        self.tick_errors = Counter(
            "specd_tick_errors_total",
            "Ticks that ended in an error specd has no handling for (a bug, or input it does "
            "not expect): logged with its traceback as tick_failed; specd keeps its setting "
            "and backs off, up to 5 minutes between ticks.",
            registry=r,
        )
        self.scrapes = Counter("specd_scrapes_total", "Scrapes of SGLang attempted.", registry=r)
        self.scrape_errors = Counter(
            "specd_scrape_errors_total",
            "Failed scrapes of SGLang, by kind (timeout, refused, http_status, malformed, "
            "missing, api_key: SGLang refused specd's key, or it has none to send).",
            ["kind"],
            registry=r,
        )
        self.rejected_values = Counter(
            "specd_sglang_rejected_values_total",
            "Values SGLang reported that it cannot produce (a negative capacity, an accept "
            "length past steps + 1, ...), by field; each was taken as unknown, never learned.",
            ["field"],
            registry=r,
        )
        self.last_scrape_success = Gauge(
            "specd_last_scrape_success_timestamp_seconds",
            "Unix time of the latest successful scrape of SGLang.",
            registry=r,
        )
        self.override_valid = Gauge(
            "specd_override_valid",
            "0 when the override file exists but is invalid or unsafe (it is ignored); 1 "
            "otherwise, also for an expired one (see specd_override_expiry_timestamp_seconds).",
            registry=r,
        )
        self.override_present = Gauge(
            "specd_override_present", "1 when the override file exists.", registry=r
        )
        self.override_expiry = Gauge(
            "specd_override_expiry_timestamp_seconds",
            "Unix time the override in the file expires (also when it already has); NaN when "
            "there is none.",
            registry=r,
        )
        # For SpecdOverrideActiveTooLong: an age from a time specd exports survives a failed
        # scrape, where a `for: 1d` over specd_override_info started over at each one.
        self.override_since = Gauge(
            "specd_override_since_timestamp_seconds",
            "Unix time the pin or freeze in force was decided: the time in the header "
            "`specd override` writes (kept by a hand edit), else the file's mtime; NaN when "
            "none is in force.",
            registry=r,
        )
        # One series at a time (cleared on change), so the free-text reason cannot grow
        # the series count.
        self.override_info = Gauge(
            "specd_override_info",
            "The override in effect: its mode and the on-call's reason (truncated).",
            ["mode", "reason"],
            registry=r,
        )
        self.state_write_errors = Counter(
            "specd_state_write_errors_total",
            "Failed writes of the state file (disk full, read-only, ...).",
            registry=r,
        )
        self.config_reload_success = Gauge(
            "specd_config_reload_success",
            "1 if the latest reload (SIGHUP) took effect, 0 if it was rejected and the "
            "running config kept; 1 before any reload.",
            registry=r,
        )
        self.config_reload_success.set(1)
        self.config_reload_time = Gauge(
            "specd_config_reload_timestamp_seconds",
            "Unix time of the latest reload attempt; 0 before any.",
            registry=r,
        )
        self.state_load_errors = Counter(
            "specd_state_load_errors_total",
            "1 when this run of specd found its state.json damaged at start: the parts named "
            "in its state_load_failed log line were left out (the history, if unusable, "
            "starts over), a copy kept as state.json.corrupt-<unix>.",
            registry=r,
        )
        self.drains = Counter(
            "specd_drains_total",
            "Drains at the gateway before a restart, by result (idle: the restart went "
            "ahead; timeout: SGLang not idle within drain_timeout_s; aborted: window closed "
            "or stop; error: a gateway replica failed).",
            ["result"],
            registry=r,
        )
        self.drain_duration = Histogram(
            "specd_drain_duration_seconds",
            "Time from removing the worker at the gateway to SGLang idle (or giving up).",
            buckets=DRAIN_DURATION_BUCKETS,
            registry=r,
        )
        self.requests_in_flight_at_restart = Gauge(
            "specd_requests_in_flight_at_restart",
            "Running plus queued requests SGLang reported when the latest drained restart "
            "was issued (must be 0).",
            registry=r,
        )
        self.gateway_errors = Counter(
            "specd_gateway_errors_total",
            "Failed calls to a gateway replica's admin API, by kind (connect, timeout, "
            "http_status, malformed, api_key).",
            ["kind"],
            registry=r,
        )
        self.gateway_worker_not_ready = Gauge(
            "specd_gateway_worker_not_ready_replicas",
            "Gateway replicas not routing this server as ready at the latest probe (NaN: "
            "unknown, no gateway or it could not be asked).",
            registry=r,
        )
        self.gateway_worker_left_out = Gauge(
            "specd_gateway_worker_left_out_replicas",
            "Gateway replicas a re-add after a restart left this server out of, as specd "
            "keeps them until every replica routes it again (known when the replica cannot "
            "be asked, unlike specd_gateway_worker_not_ready_replicas; NaN: no gateway).",
            registry=r,
        )
        self.tick_duration = Histogram(
            "specd_tick_duration_seconds",
            "Wall time of one tick's observe-record-decide and its reporting; without the "
            "restart sequence it may begin (specd_restart_duration_seconds) or a reload it "
            "reads first.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
            registry=r,
        )
        self.fleet_slot_held = Gauge(
            "specd_fleet_slot_held",
            "1 while this specd holds one of its [fleet] group's restart slots in etcd.",
            registry=r,
        )
        self.fleet_slot_taken = Gauge(
            "specd_fleet_slot_taken_timestamp_seconds",
            "Unix time this specd took the [fleet] slot it holds (from its journal after a "
            "restart of specd); NaN while it holds none.",
            registry=r,
        )
        self.fleet_marked_out = Gauge(
            "specd_fleet_marked_out",
            "1 while this server's out-of-service marker is in its [fleet] group's etcd, as far "
            "as this specd knows: from before a restart takes the server out until it serves "
            "again and etcd took the marker back, or said it is gone; the group's other servers "
            "count it.",
            registry=r,
        )
        self.fleet_name_clashes = Counter(
            "specd_fleet_name_clashes",
            "Times this specd found its [fleet] holder_name on a slot or out-of-service marker "
            "another specd wrote (at its start's look, and at each tick a restart was due and "
            "held back for it): two specds of one name would take each other's marker for "
            "their own.",
            registry=r,
        )
        self.fleet_etcd_errors = Counter(
            "specd_fleet_etcd_errors_total",
            "Failed etcd calls of the [fleet] semaphore, by kind (connect, timeout, http, "
            "protocol; lost = a held slot's lease was found gone).",
            ["kind"],
            registry=r,
        )
        self.fleet_slot_wait = Histogram(
            "specd_fleet_slot_wait_seconds",
            "Time a restart waited for a [fleet] slot before taking one.",
            buckets=SLOT_WAIT_BUCKETS,
            registry=r,
        )

        for result in RESTART_RESULTS:
            self.restarts.labels(result=result)
        for kind in SCRAPE_ERROR_KINDS:
            self.scrape_errors.labels(kind=kind)
        for kind in FLEET_ETCD_ERROR_KINDS:
            self.fleet_etcd_errors.labels(kind=kind)
        for result in DRAIN_RESULTS:
            self.drains.labels(result=result)
        for kind in GATEWAY_ERROR_KINDS:
            self.gateway_errors.labels(kind=kind)
        for name in CHECKED_FIELDS:
            self.rejected_values.labels(field=name)
        for mode in MODES:
            self.mode.labels(mode=mode).set(1 if mode == "auto" else 0)
        self.set_setting_kind("unknown")
        for before in CHANGE_KINDS:
            for after in CHANGE_KINDS:
                self.setting_changes.labels(from_kind=before, to_kind=after)
        self.declare_choices(steps, settings)
        for reason in reasons:
            self.decisions.labels(reason=reason)
            self.last_decision_reason.labels(reason=reason).set(0)
        self.steps_current.set(float("nan"))
        self.offered_concurrency_now.set(float("nan"))
        self.steps_pinned.set(float("nan"))
        self.requests_in_flight_at_restart.set(float("nan"))
        self.gateway_worker_not_ready.set(float("nan"))
        self.override_expiry.set(float("nan"))
        self.override_since.set(float("nan"))
        self.fleet_slot_taken.set(float("nan"))
        self.override_valid.set(1)

    def declare_choices(self, steps: Iterable[int], settings: Iterable[str] = ()) -> None:
        """Per-setting counters at 0 for every step count and every other setting (off,
        adaptive sets) specd may choose: there before the first event, so that `increase`
        sees it. At start and at each reload; one a reload left out goes where it is still
        0 (a thousand reloads naming new sets made a thousand series), and stays once
        counted."""
        step_labels = [str(k) for k in steps]
        for counter, labels in (
            (self.explorations, step_labels),
            (self.regressions, [*step_labels, *settings]),
        ):
            for label in labels:
                counter.labels(steps=label)
            for label in _zero_labels(counter) - set(labels):
                counter.remove(label)

    def set_mode(self, mode: str) -> None:
        for m in MODES:
            self.mode.labels(mode=m).set(1 if m == mode else 0)

    def set_setting_kind(self, kind: str) -> None:
        for k in SETTING_KINDS:
            self.setting_kind.labels(kind=k).set(1 if k == kind else 0)

    def set_settings(self, live: str | None, target: str | None) -> None:
        """One sample each (or none): the live setting's and the target's names."""
        for gauge, name in ((self.setting_live, live), (self.setting_target, target)):
            gauge.clear()
            if name:
                gauge.labels(setting=name[:80]).set(1)

    def set_by_setting(self, gauge: Gauge, values: Mapping[str, float]) -> None:
        """Exactly ``values`` on a gauge labelled ``steps``: each set, then the series no
        longer in it removed (a step count a reload took out of the range, a setting that
        left the candidates), so none keeps its last value and a scrape in between never
        finds the gauge empty."""
        for name, value in values.items():
            gauge.labels(steps=name).set(value)
        shown = self._by_setting.setdefault(id(gauge), set())
        for name in shown - values.keys():
            gauge.remove(name)
        shown.clear()
        shown.update(values)

    def set_fleet_slot(self, taken_at: float | None) -> None:
        """A slot held since ``taken_at``, or none (None)."""
        self.fleet_slot_held.set(0 if taken_at is None else 1)
        self.fleet_slot_taken.set(float("nan") if taken_at is None else taken_at)

    def set_override_info(self, mode: str | None, reason: str) -> None:
        self.override_info.clear()
        if mode is not None:
            self.override_info.labels(mode=mode, reason=reason[:80]).set(1)

    def record_decision(self, reason: str, target_steps: int | None, now: float) -> None:
        self.decisions.labels(reason=reason).inc()
        for child_reason in list(self._reason_labels()):
            self.last_decision_reason.labels(reason=child_reason).set(
                1 if child_reason == reason else 0
            )
        self.last_decision_reason.labels(reason=reason).set(1)
        self.steps_target.set(target_steps if target_steps is not None else float("nan"))
        self.last_decision_time.set(now)

    def _reason_labels(self) -> Iterable[str]:
        for metric in self.last_decision_reason.collect():
            for sample in metric.samples:
                yield sample.labels["reason"]


def _zero_labels(counter: Counter) -> set[str]:
    """The ``steps`` labels of ``counter`` whose count is 0."""
    return {
        sample.labels["steps"]
        for family in counter.collect()
        for sample in family.samples
        if sample.name.endswith("_total") and sample.value == 0
    }
