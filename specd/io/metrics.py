"""Every metric specd exports, in one place, on an injectable registry.

Names carry the ``specd_`` prefix and base units (seconds, ratios); counters end in
``_total``. Labels are bounded: reasons, results, error kinds and modes are fixed
enums, and ``steps`` is bounded by the configured step range.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from specd import __version__
from specd.core.observation import CHECKED_FIELDS

# Fixed label values, so dashboards and alerts can rely on every series existing from
# the first scrape (a counter that appears only after its first increment breaks
# `increase()` and `absent()` based rules).
RESTART_RESULTS = ("success", "rolled_back", "failed")
SCRAPE_ERROR_KINDS = ("timeout", "refused", "http_status", "malformed", "missing")
MODES = ("auto", "pin", "freeze")
OFFERED_QUANTILES = ("0.5", "0.9", "0.99")
# Restarts of a 100B+ model take minutes; buckets reach 30 minutes.
RESTART_DURATION_BUCKETS = (15, 30, 60, 90, 120, 180, 240, 300, 450, 600, 900, 1800)


class Metrics:
    """specd's metrics. Pass a fresh ``CollectorRegistry`` in tests."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        reasons: Iterable[str] = (),
        steps: Iterable[int] = (),
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.build_info = Info("specd_build", "specd version.", registry=r)
        self.build_info.info({"version": __version__})

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
            "Step count pinned by an active override; NaN when no pin is active.",
            registry=r,
        )
        self.mode = Gauge(
            "specd_mode", "1 for the active mode (auto, pin, freeze), else 0.", ["mode"], registry=r
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
            "SGLang restarts specd performed, by result (success, rolled_back, failed).",
            ["result"],
            registry=r,
        )
        self.restart_duration = Histogram(
            "specd_restart_duration_seconds",
            "Time from `systemctl restart` to a verified, healthy SGLang.",
            buckets=RESTART_DURATION_BUCKETS,
            registry=r,
        )
        self.restart_in_progress = Gauge(
            "specd_restart_in_progress", "1 while a restart sequence runs.", registry=r
        )
        self.restart_budget_remaining = Gauge(
            "specd_restart_budget_remaining",
            "Restarts still allowed in the current 24 h budget.",
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
            "Quantiles of offered concurrency (running + queued) over the decision history.",
            ["quantile"],
            registry=r,
        )
        self.offered_concurrency_now = Gauge(
            "specd_offered_concurrency_current",
            "Offered concurrency (running + queued) at the latest scrape.",
            registry=r,
        )
        self.band_boundary = Gauge(
            "specd_band_boundary_concurrency",
            "Upper offered concurrency of the lightest policy band.",
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
            "Predicted mean output tokens/s over the coming epoch for each candidate step count.",
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
        self.regressions = Counter(
            "specd_regressions_total",
            "Changes specd took back: the step count it changed to served less than the one "
            "before it, beyond noise (decision reason regression), by the regressed step count.",
            ["steps"],
            registry=r,
        )
        self.sglang_up = Gauge(
            "specd_sglang_up", "1 when the latest scrape of SGLang succeeded.", registry=r
        )
        self.scrapes = Counter("specd_scrapes_total", "Scrapes of SGLang attempted.", registry=r)
        self.scrape_errors = Counter(
            "specd_scrape_errors_total",
            "Failed scrapes of SGLang, by kind (timeout, refused, http_status, malformed, "
            "missing).",
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
            "0 when the override file exists but is invalid, expired or unsafe (it is "
            "ignored); 1 otherwise.",
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
            "State files found corrupt or unreadable at start (history is rebuilt).",
            registry=r,
        )
        self.tick_duration = Histogram(
            "specd_tick_duration_seconds",
            "Wall time of one observe-record-decide tick.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
            registry=r,
        )

        for result in RESTART_RESULTS:
            self.restarts.labels(result=result)
        for kind in SCRAPE_ERROR_KINDS:
            self.scrape_errors.labels(kind=kind)
        for name in CHECKED_FIELDS:
            self.rejected_values.labels(field=name)
        for mode in MODES:
            self.mode.labels(mode=mode).set(1 if mode == "auto" else 0)
        for k in steps:
            self.regressions.labels(steps=str(k))
        for reason in reasons:
            self.decisions.labels(reason=reason)
            self.last_decision_reason.labels(reason=reason).set(0)
        self.steps_current.set(float("nan"))
        self.steps_pinned.set(float("nan"))
        self.override_expiry.set(float("nan"))
        self.override_valid.set(1)

    def set_mode(self, mode: str) -> None:
        for m in MODES:
            self.mode.labels(mode=m).set(1 if m == mode else 0)

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
