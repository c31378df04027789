"""Generate grafana/dashboards/specd.json, the specd dashboard, from code.

    python grafana/generate.py           # rewrite the committed JSON
    python grafana/generate.py --check   # exit 1 when the committed JSON is out of date

Built with grafana-foundation-sdk (pinned 1769699379!11.6.0: older builds emit JSON that
fails the official schema). Every query filters on the ``instance`` template variable; the
datasource is a template variable too, so file provisioning needs no ``__inputs``.

The ``instance`` label is the host, shared by the specd and the SGLang target of one box:
etc/prometheus/prometheus.example.yml relabels both targets that way, which is what lets
one variable select both exporters.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus as pb
from grafana_foundation_sdk.builders import stat, statetimeline, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm

DASHBOARD_PATH = Path(__file__).resolve().parent / "dashboards" / "specd.json"
UID = "specd-overview"
DS = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
# Regex matcher: the variable is multi-valued, with ".+" as its "All".
INST = 'instance=~"$instance"'
# SGLang's scheduler gauges, totals only: with priority scheduling each scheduler exports one
# series per priority beside its total (priority=""; the matcher also takes series without
# the label), and a sum over all of them counts every request twice.
SCHED = INST + ', priority=""'


def replicas(series: str) -> str:
    """One series per DP replica: with --enable-metrics-for-all-schedulers every TP (and
    PP, MoE-EP) rank of a replica exports the same batch, and a sum over ranks counts it
    once per rank."""
    return f"max without (tp_rank, pp_rank, moe_ep_rank) ({series})"


def per_host(series: str) -> str:
    """A count summed over a host's DP replicas, each counted once."""
    return f"sum by (instance) ({replicas(series)})"


# Bar panels count events, so their bars must add up to the events in the range at any
# zoom. increase() cannot: over $__rate_interval, always longer than the step, the windows
# overlap and one restart stood in up to 16 bars (15 s step, 1 m scrape); over $__interval
# the windows tile, but each sees only its own samples and is extrapolated to its edges, so
# one event read ~2 in one bar, or 0 when it fell between two windows, and a min interval
# does not change that. The counter's difference between two steps is exact instead: Grafana
# aligns a range query's steps to multiples of the step and sets $__interval to that step
# (pkg/promlib/models/query.go), so consecutive differences add up to the counter's change
# over the range, and a step without a new sample is a 0 bar (no min interval needed). The
# step in ms: $__interval is printed in one unit, truncated (a 90 s step would read "1m" and
# miss a third). A negative difference is specd restarting (its counters start at 0 again):
# the counter itself is then what happened since. No value a step before (Prometheus did not
# scrape for 5 minutes) is no bar: the counter's whole count there would be one tall bar.
def per_bar(series: str) -> str:
    """Events of ``series`` (a counter) between a bar's step and the step before it."""
    before = f"{series} offset ${{__interval_ms}}ms"
    return f"(({series} - {before}) >= 0 or ({series} < {before}))"


# Decision reasons the daemon exports (label `reason`), with the colour each gets in the
# state timeline: blue when specd acts, red when it is blocked by a safety rule.
REASON_COLORS: dict[str, str] = {
    "change": "blue",
    "explore": "dark-blue",
    "within_tolerance": "green",
    "no_data": "orange",
    "insufficient_data": "yellow",
    "stale_data": "orange",
    "stabilizing": "light-blue",
    "dwell_time": "purple",
    "window_closed": "text",
    "window_ending": "text",
    "fleet_unavailable": "orange",
    "restart_budget": "red",
    "override_pin": "super-light-purple",
    "frozen": "dark-red",
    "drain_unavailable": "red",
    "state_unsaved": "red",
    "regression": "dark-orange",
    "unsupported": "red",
}
STEPS_UNIT = "none"
TOKS_UNIT = "suffix: tok/s"
Panel = timeseries.Panel | stat.Panel | statetimeline.Panel


def q(expr: str, legend: str = "__auto", ref: str = "A", *, instant: bool = False) -> pb.Dataquery:
    query = pb.Dataquery().expr(expr).legend_format(legend).ref_id(ref).datasource(DS)
    return query.instant() if instant else query.range()


def thresholds(*steps: tuple[float | None, str]) -> db.ThresholdsConfig:
    return (
        db.ThresholdsConfig()
        .mode(dm.ThresholdsMode("absolute"))
        .steps([dm.Threshold(value=v, color=c) for v, c in steps])
    )


def value_text(mapping: dict[str, tuple[str, str]], nan: str = "unknown") -> list[dm.ValueMapping]:
    """Value -> (text, colour) mappings, plus NaN/null shown as ``nan``."""
    options = {
        value: dm.ValueMappingResult(text=text, color=color, index=i)
        for i, (value, (text, color)) in enumerate(mapping.items())
    }
    special = dm.SpecialValueMap(
        options=dm.DashboardSpecialValueMapOptions(
            match=dm.SpecialValueMatch("null+nan"),
            result=dm.ValueMappingResult(text=nan, color="text", index=len(options)),
        )
    )
    return [dm.ValueMap(options=options), special] if options else [special]


def legend_bottom() -> cb.VizLegendOptions:
    return (
        cb.VizLegendOptions()
        .display_mode(cm.LegendDisplayMode("list"))
        .placement(cm.LegendPlacement("bottom"))
        .show_legend(True)
    )


def tooltip_multi() -> cb.VizTooltipOptions:
    return cb.VizTooltipOptions().mode(cm.TooltipDisplayMode("multi")).sort(cm.SortOrder("desc"))


def ts(title: str, description: str, unit: str) -> timeseries.Panel:
    return (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(DS)
        .unit(unit)
        .legend(legend_bottom())
        .tooltip(tooltip_multi())
        .line_width(2)
        .fill_opacity(10)
        .show_points(cm.VisibilityMode("never"))
    )


def big(title: str, description: str, unit: str) -> stat.Panel:
    return (
        stat.Panel()
        .title(title)
        .description(description)
        .datasource(DS)
        .unit(unit)
        .graph_mode(cm.BigValueGraphMode("none"))
        .color_mode(cm.BigValueColorMode("background"))
        .reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    )


def time_ago(title: str, description: str, metric: str) -> stat.Panel:
    """A stat of a Unix-time gauge shown as "3 hours ago"; none while it is NaN."""
    return (
        big(title, description, "dateTimeFromNow")
        .color_mode(cm.BigValueColorMode("none"))
        .with_target(q(f"{metric}{{{INST}}} * 1000", "{{instance}}", instant=True))
        .mappings(value_text({}, nan="none"))
    )


def dashed() -> list[dm.DynamicConfigValue]:
    return [
        dm.DynamicConfigValue(id_val="custom.lineStyle", value={"fill": "dash", "dash": [10, 10]})
    ]


# ---------------------------------------------------------------------------- panels
def lanes(
    title: str, description: str, targets: list[pb.Dataquery], text: str, color: str
) -> statetimeline.Panel:
    """A state timeline with one lane per series of 1s (``text`` where a series is 1)."""
    panel = statetimeline.Panel().title(title).unit("none").description(description)
    panel = panel.datasource(DS)
    for target in targets:
        panel = panel.with_target(target)
    return (
        panel.show_value(cm.VisibilityMode("never"))
        .merge_values(True)
        .row_height(0.8)
        .legend(cb.VizLegendOptions().show_legend(False))
        .mappings([dm.ValueMap(options={"1": dm.ValueMappingResult(text=text, index=0)})])
        .color_scheme(db.FieldColor().mode(dm.FieldColorModeId("fixed")).fixed_color(color))
    )


def steps_panels() -> list[tuple[Panel, int, int]]:
    steps_over_time = (
        ts(
            "Speculative steps: live, target, pinned",
            "Live = what SGLang runs now (specd's reading; SGLang's own sglang:spec_num_steps "
            "dashed). Target = specd's latest decision, applied in the next maintenance window. "
            "Pinned = the on-call override's steps (empty when no pin).",
            STEPS_UNIT,
        )
        .decimals(0)
        .min(0)
        .line_interpolation(cm.LineInterpolation("stepAfter"))
        .fill_opacity(0)
        .with_target(q(f"specd_steps_current{{{INST}}}", "live {{instance}}", "A"))
        .with_target(q(f"specd_steps_target{{{INST}}}", "target {{instance}}", "B"))
        .with_target(q(f"specd_steps_pinned{{{INST}}}", "pinned {{instance}}", "C"))
        .with_target(
            q(f"max by (instance) (sglang:spec_num_steps{{{INST}}})", "sglang {{instance}}", "D")
        )
        .override_by_regexp("^sglang .*", dashed())
    )
    now = (
        big(
            "Steps now",
            "Live and target step counts. They differ while a change waits for its window.",
            STEPS_UNIT,
        )
        .decimals(0)
        .color_mode(cm.BigValueColorMode("value"))
        .with_target(q(f"specd_steps_current{{{INST}}}", "live {{instance}}", "A", instant=True))
        .with_target(q(f"specd_steps_target{{{INST}}}", "target {{instance}}", "B", instant=True))
        .mappings(value_text({}))
        .thresholds(thresholds((None, "blue")))
    )
    reasons = lanes(
        "Decision reason",
        "The reason of specd's latest decision over time, one lane per reason: why it "
        "changed the target (change) or why it held still (tolerance, dwell time, "
        "budget, window closed, override, frozen, not enough data).",
        [
            q(
                f"max by (instance, reason) (specd_last_decision{{{INST}}} == 1)",
                "{{instance}} {{reason}}",
                "A",
            )
        ],
        "latest",
        "blue",
    )
    for reason, color in REASON_COLORS.items():
        # One lane per host and reason (several hosts selected): matched by the name's end.
        reasons = reasons.override_by_regexp(
            f"^(.* )?{reason}$",
            [dm.DynamicConfigValue(id_val="color", value={"mode": "fixed", "fixedColor": color})],
        )
    decisions = (
        ts(
            "Decisions by reason",
            "Decisions taken per bar, by reason: the bars add up to the decisions in the range.",
            "short",
        )
        .draw_style(cm.GraphDrawStyle("bars"))
        .fill_opacity(80)
        .stacking(cb.StackingConfig().mode(cm.StackingMode("normal")))
        .decimals(0)
        .with_target(
            q(
                "sum by (reason) " + per_bar(f"specd_decisions_total{{{INST}}}"),
                "{{reason}}",
            )
        )
    )
    kind = lanes(
        "Kind of setting",
        "What SGLang runs, one lane per kind: off (no speculation), static (one step "
        "count: see the steps panel), adaptive (SGLang switches among a candidate set per "
        "batch; the steps panel then shows its live tier), unknown (SGLang unreadable).",
        [
            q(
                f"max by (instance, kind) (specd_setting_kind{{{INST}}} == 1)",
                "{{instance}} {{kind}}",
                "A",
            )
        ],
        "live",
        "green",
    )
    setting = lanes(
        "Setting: live and target",
        "Which setting SGLang runs (live) and which specd's latest decision wants (target), "
        "as the operator writes it: a step count, off, or an adaptive set such as "
        "adaptive:3,4 (which has no one step count for the steps panel to show). They "
        "differ while a change waits for its window.",
        [
            q(
                f"max by (instance, setting) (specd_setting_live{{{INST}}} == 1)",
                "{{instance}} live {{setting}}",
                "A",
            ),
            q(
                f"max by (instance, setting) (specd_setting_target{{{INST}}} == 1)",
                "{{instance}} target {{setting}}",
                "B",
            ),
        ],
        "yes",
        "blue",
    )
    kind_changes = (
        ts(
            "Changes between kinds",
            "Verified restarts per bar by the kind before and after (static → static is a "
            "change of step count): the bars add up to the changes in the range.",
            "short",
        )
        .draw_style(cm.GraphDrawStyle("bars"))
        .fill_opacity(80)
        .stacking(cb.StackingConfig().mode(cm.StackingMode("normal")))
        .decimals(0)
        .with_target(
            q(
                "sum by (from_kind, to_kind) " + per_bar(f"specd_setting_changes_total{{{INST}}}"),
                "{{from_kind}} → {{to_kind}}",
            )
        )
    )
    return [
        (steps_over_time, 16, 8),
        (now, 8, 8),
        (reasons, 12, 8),
        (decisions, 12, 8),
        (kind, 12, 6),
        (kind_changes, 12, 6),
        (setting, 24, 6),
    ]


def traffic_panels() -> list[tuple[Panel, int, int]]:
    offered = (
        ts(
            "Offered concurrency vs band boundary",
            "Quantiles of offered concurrency (running + queued) over specd's decision "
            "history, the current value, and, under the bands policy, the upper edge of the "
            "lightest band (dashed): quantiles above the line pick the heavier band's step "
            "count. No line under the model policy (a calibration file set): it picks by "
            "predicted throughput, not by bands.",
            "short",
        )
        .min(0)
        .with_target(q(f"specd_offered_concurrency{{{INST}}}", "p{{q}} {{instance}}", "A"))
        .with_target(q(f"specd_offered_concurrency_current{{{INST}}}", "now {{instance}}", "B"))
        .with_target(
            q(f"specd_band_boundary_concurrency{{{INST}}}", "band boundary {{instance}}", "C")
        )
        .override_by_regexp("^band boundary.*", dashed())
    )
    gen = (
        ts(
            "SGLang generation throughput",
            "Output tokens/s: SGLang's gen_throughput gauge and the decode-token counter rate.",
            TOKS_UNIT,
        )
        .min(0)
        .with_target(
            q(
                per_host(f"sglang:gen_throughput{{{SCHED}}}"),
                "gauge {{instance}}",
                "A",
            )
        )
        .with_target(
            q(
                per_host(
                    f'rate(sglang:realtime_tokens_total{{{INST}, mode="decode"}}[$__rate_interval])'
                ),
                "decode rate {{instance}}",
                "B",
            )
        )
    )
    reqs = (
        ts(
            "SGLang running and queued requests",
            "Decode batch size and waiting requests. A queue that does not drain means the "
            "step count's capacity (max_running_requests) is too small for the load.",
            "short",
        )
        .min(0)
        .with_target(
            q(
                per_host(f"sglang:num_running_reqs{{{SCHED}}}"),
                "running {{instance}}",
                "A",
            )
        )
        .with_target(
            q(
                per_host(f"sglang:num_queue_reqs{{{SCHED}}}"),
                "queued {{instance}}",
                "B",
            )
        )
        .override_by_regexp(
            "^queued.*",
            [dm.DynamicConfigValue(id_val="color", value={"mode": "fixed", "fixedColor": "red"})],
        )
    )
    return [(offered, 8, 8), (gen, 8, 8), (reqs, 8, 8)]


def model_panels() -> list[tuple[Panel, int, int]]:
    accept = (
        ts(
            "Accept length by step count",
            "Tokens per verify step (bonus token included) that specd learned for each step "
            "count, and SGLang's live value weighted by running requests (dashed; only while "
            "requests run). Near 1 means speculation gains nothing.",
            "none",
        )
        .decimals(2)
        .min(1)
        .with_target(q(f"specd_accept_length{{{INST}}}", "K={{steps}} {{instance}}", "A"))
        .with_target(
            q(
                "sum by (instance) ("
                + replicas(f"sglang:spec_accept_length{{{SCHED}}}")
                + " * "
                + replicas(f"sglang:num_running_reqs{{{SCHED}}}")
                + ") / ("
                + per_host(f"sglang:num_running_reqs{{{SCHED}}}")
                + " > 0)",
                "sglang live {{instance}}",
                "B",
            )
        )
        .override_by_regexp("^sglang live.*", dashed())
        .thresholds(thresholds((None, "red"), (1.2, "green")))
        .thresholds_style(
            cb.GraphThresholdsStyleConfig().mode(cm.GraphThresholdsStyleMode("dashed"))
        )
    )
    alpha = (
        ts(
            "Acceptance α by step count",
            "Per-draft-token acceptance α inverted from the accept length, per step count.",
            "percentunit",
        )
        .min(0)
        .max(1)
        .with_target(q(f"specd_acceptance_alpha_ratio{{{INST}}}", "K={{steps}} {{instance}}", "A"))
    )
    predicted = (
        ts(
            "Predicted throughput per candidate setting",
            "The model policy's predicted mean output tokens/s over the coming epoch for each "
            "candidate setting (a step count, off, an adaptive set such as adaptive:3,4), with "
            "the low and high ends of its prediction interval. specd moves to the best one "
            "when its predicted gain over the epoch beats the restart and the interval.",
            TOKS_UNIT,
        )
        .min(0)
        .with_target(
            q(
                f"specd_predicted_throughput_tokens_per_second{{{INST}}}",
                "{{steps}} {{instance}}",
                "A",
            )
        )
        .with_target(
            q(
                f"specd_predicted_throughput_low_tokens_per_second{{{INST}}}",
                "{{steps}} low {{instance}}",
                "B",
            )
        )
        .with_target(
            q(
                f"specd_predicted_throughput_high_tokens_per_second{{{INST}}}",
                "{{steps}} high {{instance}}",
                "C",
            )
        )
    )
    return [(accept, 8, 8), (alpha, 8, 8), (predicted, 8, 8)]


def restart_panels() -> list[tuple[Panel, int, int]]:
    by_result = (
        big(
            "Restarts in range",
            "Restart sequences specd ran in the selected time range, by result. "
            "rolled_back: the new setting failed verification and the old one was restored "
            "(two SGLang restarts in one sequence); failed: even the rollback failed; "
            "aborted: the new setting's start was refused (systemd's start limit, or its own "
            "setup failed) and SGLang started again on the old one. Not SGLang restarts: "
            "the restart budget counts those.",
            "short",
        )
        .decimals(0)
        .text_mode(cm.BigValueTextMode("value_and_name"))
        .with_target(
            q(
                f"sum by (result) (increase(specd_restarts_total{{{INST}}}[$__range]))",
                "{{result}}",
                "A",
                instant=True,
            )
        )
        .thresholds(thresholds((None, "green")))
        .override_by_name(
            "rolled_back",
            [
                dm.DynamicConfigValue(
                    id_val="thresholds",
                    value={
                        "mode": "absolute",
                        "steps": [
                            {"value": None, "color": "green"},
                            {"value": 0.5, "color": "orange"},
                        ],
                    },
                )
            ],
        )
        .override_by_name(
            "failed",
            [
                dm.DynamicConfigValue(
                    id_val="thresholds",
                    value={
                        "mode": "absolute",
                        "steps": [
                            {"value": None, "color": "green"},
                            {"value": 0.5, "color": "red"},
                        ],
                    },
                )
            ],
        )
    )
    duration = (
        big(
            "Restart duration",
            "Time a restart sequence took, from `systemctl restart` to its end (verified, "
            "rolled back or failed): mean and 95th percentile over the selected range (no "
            "value when no restart happened).",
            "s",
        )
        .text_mode(cm.BigValueTextMode("value_and_name"))
        .with_target(
            q(
                f"sum by (instance) (increase(specd_restart_duration_seconds_sum{{{INST}}}"
                f"[$__range])) / (sum by (instance) (increase("
                f"specd_restart_duration_seconds_count{{{INST}}}[$__range])) > 0)",
                "{{instance}} mean",
                "A",
                instant=True,
            )
        )
        .with_target(
            q(
                "histogram_quantile(0.95, sum by (instance, le) (increase("
                f"specd_restart_duration_seconds_bucket{{{INST}}}[$__range])) and on (instance) "
                f"sum by (instance) (increase(specd_restart_duration_seconds_count{{{INST}}}"
                f"[$__range])) > 0)",
                "{{instance}} p95",
                "B",
                instant=True,
            )
        )
        .thresholds(thresholds((None, "green"), (300, "orange"), (600, "red")))
    )
    budget = (
        big(
            "Restart budget left",
            "Restarts still allowed in the rolling 24 h budget, and the daily budget itself. "
            "At 0 left specd cannot apply a change until an old restart ages out; a daily "
            "budget of 0 is automatic restarts turned off (SpecdRestartBudgetExhausted keeps "
            "quiet then).",
            "short",
        )
        .decimals(0)
        .with_target(
            q(f"specd_restart_budget_remaining{{{INST}}}", "left {{instance}}", instant=True)
        )
        .with_target(q(f"specd_restart_budget{{{INST}}}", "daily {{instance}}", "B", instant=True))
        .thresholds(thresholds((None, "red"), (1, "orange"), (2, "green")))
    )
    in_progress = (
        big(
            "Restart in progress",
            "waiting: a restart sequence runs and SGLang still serves (it waits for a fleet "
            "slot, a quiet moment, the drain); restarting: specd restarted SGLang (the "
            "change, or a rollback) and verifies it, SGLang down on purpose (SGLangDown "
            "keeps quiet then, not while it waits).",
            "none",
        )
        .with_target(
            q(
                f"specd_restart_in_progress{{{INST}}} + specd_sglang_restarting{{{INST}}}",
                "{{instance}}",
                instant=True,
            )
        )
        .mappings(
            value_text(
                {"0": ("idle", "green"), "1": ("waiting", "yellow"), "2": ("restarting", "orange")}
            )
        )
    )
    frozen = (
        big(
            "Frozen",
            "FROZEN after a failed restart: specd makes no automatic change until an operator "
            "clears it (see the runbook, SpecdFrozen).",
            "none",
        )
        .with_target(q(f"specd_frozen{{{INST}}}", "{{instance}}", instant=True))
        .mappings(value_text({"0": ("no", "green"), "1": ("FROZEN", "red")}))
    )
    restarts_over_time = (
        ts(
            "Restarts by result",
            "Restarts per bar, by result: the bars add up to the restarts in the range. "
            "outside window: a change's restart that went out with no window open (not a "
            "pin applied now, nor a rollback): specd promises none, so any is a bug "
            "(SpecdRestartedOutsideWindow).",
            "short",
        )
        .draw_style(cm.GraphDrawStyle("bars"))
        .fill_opacity(80)
        .decimals(0)
        .with_target(
            q(
                "sum by (result) " + per_bar(f"specd_restarts_total{{{INST}}}"),
                "{{result}}",
            )
        )
        .with_target(
            q(
                "sum " + per_bar(f"specd_restarts_outside_window_total{{{INST}}}"),
                "outside window",
                "B",
            )
        )
        .override_by_name(
            "outside window",
            [
                dm.DynamicConfigValue(
                    id_val="color", value={"mode": "fixed", "fixedColor": "purple"}
                )
            ],
        )
        .override_by_name(
            "failed",
            [dm.DynamicConfigValue(id_val="color", value={"mode": "fixed", "fixedColor": "red"})],
        )
        .override_by_name(
            "rolled_back",
            [
                dm.DynamicConfigValue(
                    id_val="color", value={"mode": "fixed", "fixedColor": "orange"}
                )
            ],
        )
        .override_by_name(
            "success",
            [dm.DynamicConfigValue(id_val="color", value={"mode": "fixed", "fixedColor": "green"})],
        )
    )
    return [
        (by_result, 6, 6),
        (duration, 5, 6),
        (budget, 4, 6),
        (in_progress, 4, 6),
        (frozen, 5, 6),
        (restarts_over_time, 24, 6),
    ]


def gateway_panels() -> list[tuple[Panel, int, int]]:
    """With a [gateway]: the drain before each restart and the worker's place in routing."""
    drains = (
        big(
            "Drains in range",
            "Drains at the gateway in the selected range, by result. idle: SGLang had no "
            "request left and the restart went ahead; timeout: not idle within "
            "drain_timeout_s, no restart; aborted: window closed or stop; error: a gateway "
            "replica failed. Empty without a [gateway].",
            "short",
        )
        .decimals(0)
        .text_mode(cm.BigValueTextMode("value_and_name"))
        .with_target(
            q(
                f"sum by (result) (increase(specd_drains_total{{{INST}}}[$__range]))",
                "{{result}}",
                instant=True,
            )
        )
        .thresholds(thresholds((None, "green")))
    )
    duration = (
        big(
            "Drain duration",
            "From removing the worker at the gateway to SGLang idle: mean and 95th percentile "
            "over the selected range (no value when no drain happened).",
            "s",
        )
        .text_mode(cm.BigValueTextMode("value_and_name"))
        .with_target(
            q(
                f"sum by (instance) (increase(specd_drain_duration_seconds_sum{{{INST}}}"
                f"[$__range])) / (sum by (instance) (increase("
                f"specd_drain_duration_seconds_count{{{INST}}}[$__range])) > 0)",
                "{{instance}} mean",
                "A",
                instant=True,
            )
        )
        .with_target(
            q(
                "histogram_quantile(0.95, sum by (instance, le) (increase("
                f"specd_drain_duration_seconds_bucket{{{INST}}}[$__range])) and on (instance) "
                f"sum by (instance) (increase(specd_drain_duration_seconds_count{{{INST}}}"
                f"[$__range])) > 0)",
                "{{instance}} p95",
                "B",
                instant=True,
            )
        )
        .thresholds(thresholds((None, "green"), (60, "orange"), (300, "red")))
    )
    in_flight = (
        big(
            "In flight at restart",
            "Running plus queued requests SGLang reported when the latest drained restart was "
            "issued. Must be 0: anything else is a request a client lost.",
            "short",
        )
        .decimals(0)
        .with_target(
            q(f"specd_requests_in_flight_at_restart{{{INST}}}", "{{instance}}", instant=True)
        )
        # NaN until the first drained restart, and for good without a [gateway].
        .mappings(value_text({}, nan="none yet"))
        .thresholds(thresholds((None, "green"), (0.5, "red")))
    )
    not_ready = (
        big(
            "Gateway replicas without this worker",
            "not ready: gateway replicas not routing this server as ready at specd's latest "
            "look (none: no gateway, or it could not be asked). left out: replicas a "
            "re-add after a restart left it out of, kept by specd until each routes it "
            "again, known also while such a replica cannot be asked. Either above 0 outside "
            "a restart: the worker is left out (SpecdWorkerLeftOutOfGateway).",
            "short",
        )
        .decimals(0)
        .with_target(
            q(
                f"specd_gateway_worker_not_ready_replicas{{{INST}}}",
                "not ready {{instance}}",
                instant=True,
            )
        )
        .with_target(
            q(
                f"specd_gateway_worker_left_out_replicas{{{INST}}}",
                "left out {{instance}}",
                "B",
                instant=True,
            )
        )
        .mappings(value_text({}, nan="none"))
        .thresholds(thresholds((None, "green"), (0.5, "red")))
    )
    errors = (
        ts(
            "Gateway errors by kind",
            "Failed calls to a gateway replica's admin API per bar (connect, timeout, "
            "http_status, malformed, api_key): the bars add up to the failures in the range. "
            "While any fail, specd does not restart (reason drain_unavailable).",
            "short",
        )
        .draw_style(cm.GraphDrawStyle("bars"))
        .fill_opacity(80)
        .decimals(0)
        .with_target(
            q(
                "sum by (kind) " + per_bar(f"specd_gateway_errors_total{{{INST}}}"),
                "{{kind}}",
            )
        )
    )
    return [
        (drains, 6, 6),
        (duration, 6, 6),
        (in_flight, 6, 6),
        (not_ready, 6, 6),
        (errors, 24, 6),
    ]


def window_override_panels() -> list[tuple[Panel, int, int]]:
    window = (
        big("Maintenance window", "Whether specd may restart SGLang now.", "none")
        .with_target(q(f"specd_window_open{{{INST}}}", "{{instance}}", instant=True))
        .mappings(value_text({"0": ("closed", "text"), "1": ("OPEN", "blue")}))
    )
    next_window = (
        big(
            "Next window",
            "When the next maintenance window opens, and when the current (or next) one closes.",
            "dateTimeFromNow",
        )
        .color_mode(cm.BigValueColorMode("none"))
        .text_mode(cm.BigValueTextMode("value_and_name"))
        .with_target(
            q(
                f"specd_window_next_open_timestamp_seconds{{{INST}}} * 1000",
                "{{instance}} opens",
                "A",
                instant=True,
            )
        )
        .with_target(
            q(
                f"specd_window_next_close_timestamp_seconds{{{INST}}} * 1000",
                "{{instance}} closes",
                "B",
                instant=True,
            )
        )
    )
    mode = (
        big(
            "Mode",
            "auto: specd decides. pin: an override holds a setting. freeze: no automatic "
            "change — an override freeze, or a failed restart (Frozen: until specd unfreeze).",
            "none",
        )
        .text_mode(cm.BigValueTextMode("name"))
        .with_target(q(f"specd_mode{{{INST}}} == 1", "{{mode}}", instant=True))
        .thresholds(thresholds((None, "green")))
        .override_by_name(
            "pin",
            [dm.DynamicConfigValue(id_val="color", value={"mode": "fixed", "fixedColor": "blue"})],
        )
        .override_by_name(
            "freeze",
            [
                dm.DynamicConfigValue(
                    id_val="color", value={"mode": "fixed", "fixedColor": "orange"}
                )
            ],
        )
    )
    expiry = (
        big(
            "Override expires",
            "Expiry of the override in the file (also when it already expired: then delete "
            "the file). none: no override.",
            "dateTimeFromNow",
        )
        .color_mode(cm.BigValueColorMode("none"))
        .with_target(
            q(
                f"specd_override_expiry_timestamp_seconds{{{INST}}} * 1000",
                "{{instance}}",
                instant=True,
            )
        )
        .mappings(value_text({}, nan="none"))
    )
    decided = time_ago(
        "Override decided",
        "When the pin or freeze in force was decided: the time `specd override` wrote in "
        "the file (a hand edit keeps it), else the file's mtime. SpecdOverrideActiveTooLong "
        "fires once it is a day old. none: no override in force.",
        "specd_override_since_timestamp_seconds",
    )
    override_file = (
        big(
            "Override file",
            "in effect: a valid override file. ignored: the file exists but is invalid or "
            "unsafe; specd ignores it and keeps its last good state. expired: its expires_at "
            "passed; specd decides by itself again (delete the file or specd override clear).",
            "none",
        )
        .with_target(
            # An expired file is still a valid one (specd_override_valid 1): its expiry
            # tells it apart, or the panel said "in effect" for a pin specd ignores.
            q(
                f"specd_override_present{{{INST}}} + 2 * (1 - specd_override_valid{{{INST}}})"
                f" + 4 * (time() >= bool specd_override_expiry_timestamp_seconds{{{INST}}})",
                "{{instance}}",
                instant=True,
            )
        )
        .mappings(
            value_text(
                {
                    "0": ("none", "green"),
                    "1": ("in effect", "blue"),
                    "2": ("ignored", "red"),
                    "3": ("ignored", "red"),
                    "5": ("expired", "orange"),
                }
            )
        )
    )
    reason = (
        big("Override reason", "The on-call's reason written in the override.", "none")
        .color_mode(cm.BigValueColorMode("none"))
        .text_mode(cm.BigValueTextMode("name"))
        .no_value("no override")
        .with_target(q(f"specd_override_info{{{INST}}}", "{{mode}}: {{reason}}", instant=True))
    )
    return [
        (window, 3, 5),
        (next_window, 4, 5),
        (mode, 3, 5),
        (expiry, 3, 5),
        (decided, 3, 5),
        (override_file, 3, 5),
        (reason, 5, 5),
    ]


def health_panels() -> list[tuple[Panel, int, int]]:
    up = (
        big(
            "Targets up",
            "Prometheus' own view: are the specd and SGLang exporters being scraped?",
            "none",
        )
        .text_mode(cm.BigValueTextMode("value_and_name"))
        .with_target(q(f"up{{{INST}}}", "{{instance}} {{job}}", instant=True))
        .mappings(value_text({"0": ("DOWN", "red"), "1": ("up", "green")}))
    )
    sglang_up = (
        big("specd → SGLang", "Did specd's latest scrape of SGLang succeed?", "none")
        .with_target(q(f"specd_sglang_up{{{INST}}}", "{{instance}}", instant=True))
        .mappings(value_text({"0": ("FAILING", "red"), "1": ("ok", "green")}))
    )
    age = (
        big(
            "Last good SGLang scrape",
            "Age of specd's latest successful scrape of SGLang, and beside it (every) the "
            "interval specd scrapes at (observe.scrape_interval_s): between two good scrapes "
            "the age grows to one interval. The colours are for intervals of a few seconds "
            "(the default 5 s): at a longer interval compare the age with it. "
            "SpecdNotScrapingSGLang takes an age past 5 minutes or three intervals, "
            "whichever is longer, for a stuck loop. never: no good scrape since specd "
            "started (SGLang still loading, or unreachable: see specd → SGLang).",
            "s",
        )
        .with_target(
            q(
                # The gauge is 0 until the first good scrape: not 56 years ago.
                f"time() - (specd_last_scrape_success_timestamp_seconds{{{INST}}} > 0) or on "
                f"(instance) (specd_last_scrape_success_timestamp_seconds{{{INST}}} == 0) * NaN",
                "{{instance}}",
                instant=True,
            )
        )
        .with_target(
            q(f"specd_scrape_interval_seconds{{{INST}}}", "every {{instance}}", "B", instant=True)
        )
        .mappings(value_text({}, nan="never"))
        .thresholds(thresholds((None, "green"), (30, "orange"), (60, "red")))
        # The interval is a setting, not a state: no threshold colours it.
        .override_by_regexp(
            "^every .*",
            [dm.DynamicConfigValue(id_val="color", value={"mode": "fixed", "fixedColor": "text"})],
        )
    )
    errors = (
        ts(
            "Scrape errors by kind",
            "Failed scrapes of SGLang per second by kind, against all scrapes attempted, and "
            "values SGLang sent that it cannot produce (rejected, by field).",
            "reqps",
        )
        .min(0)
        .with_target(
            q(
                f"sum by (kind) (rate(specd_scrape_errors_total{{{INST}}}[$__rate_interval]))",
                "{{kind}}",
                "A",
            )
        )
        .with_target(
            q(
                f"sum (rate(specd_scrapes_total{{{INST}}}[$__rate_interval]))",
                "attempted",
                "B",
            )
        )
        .with_target(
            q(
                "sum by (field) "
                f"(rate(specd_sglang_rejected_values_total{{{INST}}}[$__rate_interval]))",
                "rejected {{field}}",
                "C",
            )
        )
        .override_by_name("attempted", dashed())
    )
    tick = (
        ts(
            "Tick duration, tick and state-file errors",
            "p99 wall time of one observe-record-decide tick; per bar (red, right axis; the "
            "bars add up to the failures in the range) failed state-file writes and ticks "
            "that ended in an error specd has no handling for (its log: tick_failed, with "
            "the traceback). SpecdTicksFailing fires after 10 minutes of either.",
            "s",
        )
        .with_target(
            q(
                "histogram_quantile(0.99, sum by (instance, le) (rate("
                f"specd_tick_duration_seconds_bucket{{{INST}}}[$__rate_interval])))",
                "tick p99 {{instance}}",
                "A",
            )
        )
        .with_target(
            q(
                per_bar(f"specd_state_write_errors_total{{{INST}}}"),
                "state write errors {{instance}}",
                "B",
            )
        )
        .with_target(
            q(
                per_bar(f"specd_tick_errors_total{{{INST}}}"),
                "tick errors {{instance}}",
                "C",
            )
        )
        .override_by_regexp(
            "^(state write|tick) errors.*",
            [
                dm.DynamicConfigValue(id_val="unit", value="short"),
                dm.DynamicConfigValue(id_val="custom.drawStyle", value="bars"),
                dm.DynamicConfigValue(id_val="custom.fillOpacity", value=80),
                dm.DynamicConfigValue(id_val="custom.axisPlacement", value="right"),
                dm.DynamicConfigValue(id_val="color", value={"mode": "fixed", "fixedColor": "red"}),
            ],
        )
    )
    reload = (
        big(
            "Config reload",
            "Did the latest reload (SIGHUP) take effect? A rejected one keeps the running "
            "config; specd's log says why.",
            "none",
        )
        .with_target(q(f"specd_config_reload_success{{{INST}}}", "{{instance}}", instant=True))
        .mappings(value_text({"0": ("REJECTED", "red"), "1": ("ok", "green")}))
    )
    version = (
        big("specd version", "From specd_build_info.", "none")
        .color_mode(cm.BigValueColorMode("none"))
        .text_mode(cm.BigValueTextMode("name"))
        .with_target(q(f"specd_build_info{{{INST}}}", "{{version}}", instant=True))
    )
    starts = (
        big(
            "specd starts in 1 h",
            "Times specd started in the last hour (specd_start_time_seconds changed): a "
            "crash, its watchdog or an OOM kill brings it back within seconds, which `up` "
            "hardly shows. SpecdRestartingOften fires at 3.",
            "short",
        )
        .decimals(0)
        .with_target(
            q(f"changes(specd_start_time_seconds{{{INST}}}[1h])", "{{instance}}", instant=True)
        )
        .thresholds(thresholds((None, "green"), (1, "orange"), (3, "red")))
    )
    return [
        (up, 4, 6),
        (sglang_up, 3, 6),
        (age, 3, 6),
        (reload, 3, 6),
        (version, 3, 6),
        (starts, 3, 6),
        (errors, 4, 6),
        (tick, 4, 6),
    ]


def fleet_panels() -> list[tuple[Panel, int, int]]:
    """[fleet]: the etcd slots servers of a group restart in turn with (empty without one)."""
    held = (
        ts(
            "Fleet slot held, server marked out",
            "slot: 1 while this host's specd holds one of its group's restart slots in etcd: "
            "at most `slots` hosts of a group at once. SpecdFleetSlotHeldTooLong fires after "
            "90 minutes. out: 1 while this server's out-of-service marker is in etcd (from the "
            "drain, or the restart, until it serves again): the group counts it even "
            "without a slot. Between restarts it stays while a gateway replica leaves the "
            "worker out (SpecdWorkerLeftOutOfGateway), else it is one etcd refused to "
            "remove: SpecdFleetMarkerLeftBehind fires after 10 minutes.",
            "none",
        )
        .min(0)
        .max(1)
        .with_target(q(f"specd_fleet_slot_held{{{INST}}}", "slot {{instance}}", "A"))
        .with_target(q(f"specd_fleet_marked_out{{{INST}}}", "out {{instance}}", "B"))
    )
    taken = time_ago(
        "Fleet slot taken",
        "When this specd took the slot it holds (kept across a restart of specd). none: "
        "it holds none.",
        "specd_fleet_slot_taken_timestamp_seconds",
    )
    wait = (
        ts(
            "Fleet slot wait",
            "p50 and the largest time a restart waited for a free slot of its group (another "
            "host restarting meanwhile); both read off the histogram's buckets (upper bounds, "
            "the last one 1 h).",
            "s",
        )
        .min(0)
        .with_target(
            q(
                "histogram_quantile(0.5, sum by (instance, le) (rate("
                f"specd_fleet_slot_wait_seconds_bucket{{{INST}}}[$__rate_interval])))",
                "p50 {{instance}}",
                "A",
            )
        )
        .with_target(
            q(
                "histogram_quantile(1, sum by (instance, le) (rate("
                f"specd_fleet_slot_wait_seconds_bucket{{{INST}}}[$__rate_interval])))",
                "max (bucket bound) {{instance}}",
                "B",
            )
        )
    )
    errors = (
        ts(
            "etcd errors by kind, holder name clashes",
            "Failed etcd calls per second (connect, timeout, http, protocol; lost = a held "
            "slot's lease found gone). While etcd cannot be asked no restart happens "
            "(reason fleet_unavailable). holder name clash: this specd found its holder_name "
            "on a slot or marker another specd wrote, and restarts nothing until the names "
            "differ (SpecdFleetHolderNameClash).",
            "reqps",
        )
        .min(0)
        .with_target(
            q(
                f"sum by (kind) (rate(specd_fleet_etcd_errors_total{{{INST}}}[$__rate_interval]))",
                "{{kind}}",
            )
        )
        .with_target(
            q(
                f"sum(rate(specd_fleet_name_clashes_total{{{INST}}}[$__rate_interval]))",
                "holder name clash",
                "B",
            )
        )
    )
    return [(held, 7, 7), (taken, 3, 7), (wait, 7, 7), (errors, 7, 7)]


ROWS: tuple[tuple[str, Callable[[], list[tuple[Panel, int, int]]]], ...] = (
    ("Step count and decisions", steps_panels),
    ("Traffic (SGLang)", traffic_panels),
    ("Acceptance and model", model_panels),
    ("Restarts and safety", restart_panels),
    ("Fleet: gateway drain", gateway_panels),
    ("Maintenance windows and override", window_override_panels),
    ("Scrape health", health_panels),
    ("Fleet (etcd slots)", fleet_panels),
)


# Keys Grafana's Prometheus data source reads from an annotation query beside `expr`. The
# official schema's AnnotationQuery predates data-source annotations and has none of them;
# tests/test_grafana.py validates the rest against it and these against this list.
PROMETHEUS_ANNOTATION_KEYS = ("expr", "step", "titleFormat", "textFormat", "useValueForTime")


class Annotation(NamedTuple):
    """A Prometheus-backed annotation: every series ``expr`` returns marks its time span."""

    name: str
    color: str
    expr: str
    title: str
    text: str


# Grafana evaluates an annotation at every ANNOTATION_STEP; an event's counter steps between
# two scrapes, which straddle a step boundary as often as not. A window of one step holds
# only the samples inside that step and missed such a step (every one at a 1 m scrape): the
# window is a step plus the longest scrape interval (1 m, Prometheus' default), so the two
# samples around every step are inside one window.
ANNOTATION_STEP = "1m"
EVENT_WINDOW = "2m"

# What explains a throughput dip: every restart specd made, every rollback, every
# exploration, every pin, every change specd took back.
ANNOTATIONS: tuple[Annotation, ...] = (
    Annotation(
        "Restarts",
        "blue",
        "sum by (instance) "
        f'(increase(specd_restarts_total{{{INST}, result="success"}}[{EVENT_WINDOW}])) > 0',
        "specd restarted SGLang",
        "verified restart on {{instance}}",
    ),
    Annotation(
        "Rollbacks and failed restarts",
        "red",
        "sum by (instance, result) "
        f'(increase(specd_restarts_total{{{INST}, result!="success"}}[{EVENT_WINDOW}])) > 0',
        "restart {{result}}",
        "a restart on {{instance}} ended {{result}}: see specd_frozen",
    ),
    Annotation(
        "Changes of kind",
        "green",
        # Every pair but static → static (a change of step count: the restarts' annotation).
        "sum by (instance, from_kind, to_kind) (increase(specd_setting_changes_total"
        f'{{{INST}, from_kind!="static"}}[{EVENT_WINDOW}])) > 0 '
        "or sum by (instance, from_kind, to_kind) (increase(specd_setting_changes_total"
        f'{{{INST}, to_kind!="static"}}[{EVENT_WINDOW}])) > 0',
        "{{from_kind}} → {{to_kind}}",
        "SGLang on {{instance}} changed from {{from_kind}} to {{to_kind}}",
    ),
    Annotation(
        "Explorations",
        "green",
        "sum by (instance, steps) "
        f"(increase(specd_explorations_total{{{INST}}}[{EVENT_WINDOW}])) > 0",
        "exploring {{steps}} steps",
        "specd on {{instance}} runs one epoch at {{steps}} steps to measure it",
    ),
    Annotation(
        "Override pins",
        "orange",
        f'max by (instance) (specd_mode{{{INST}, mode="pin"}}) == 1',
        "pinned by override",
        "an on-call pin on {{instance}} holds the step count",
    ),
    # Two freezes, cleared two ways: an on-call's (the override file) and specd's own after
    # a failed restart (specd_frozen; `specd unfreeze`). specd_mode says "freeze" for both.
    Annotation(
        "Override freezes",
        "purple",
        f'max by (instance) (specd_override_info{{{INST}, mode="freeze"}}) == 1',
        "frozen by override",
        "an on-call freeze on {{instance}} forbids automatic changes (specd override clear)",
    ),
    Annotation(
        "Freezes after a failed restart",
        "dark-purple",
        f"max by (instance) (specd_frozen{{{INST}}}) == 1",
        "frozen after a failed restart",
        "a restart failed on {{instance}}: specd rolled back and changes nothing until "
        "specd unfreeze",
    ),
    Annotation(
        "Regressions",
        "dark-orange",
        "sum by (instance, steps) "
        f"(increase(specd_regressions_total{{{INST}}}[{EVENT_WINDOW}])) > 0",
        "{{steps}} regressed",
        "specd on {{instance}} went back: {{steps}} (a step count, off or an adaptive set) "
        "served less than the setting before (see the decision log's outcome)",
    ),
)


def annotation_query(a: Annotation) -> db.AnnotationQuery:
    return db.AnnotationQuery().name(a.name).datasource(DS).enable(True).icon_color(a.color)


def _prometheus_annotation_fields(a: Annotation) -> dict[str, Any]:
    return {
        "expr": a.expr,
        "step": ANNOTATION_STEP,
        "titleFormat": a.title,
        "textFormat": a.text,
        "useValueForTime": False,
    }


def build() -> dict[str, Any]:
    """The dashboard as a JSON-ready dict."""
    dash = (
        db.Dashboard("specd — speculative decoding tuner")
        .uid(UID)
        .description(
            "specd keeps SGLang's --speculative-num-steps tuned to its traffic. One row per "
            "question: what runs and why, what the traffic is, what specd has learned, is it "
            "safe, when can it act, is it healthy."
        )
        .tags(["specd", "sglang", "llm-inference"])
        .editable()
        .tooltip(dm.DashboardCursorSync.CROSSHAIR)
        .refresh("30s")
        .time("now-24h", "now")
        .timezone("browser")
        .link(
            db.DashboardLink("Runbook")
            .type(dm.DashboardLinkType("link"))
            .url("https://github.com/specd/specd#monitoring")
            .icon("doc")
            .target_blank(True)
        )
        .with_variable(db.DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(
            db.QueryVariable("instance")
            .label("Host")
            .description("The host label shared by a box's specd and SGLang targets.")
            .datasource(DS)
            .query({"query": "label_values(specd_build_info, instance)", "refId": "instance"})
            .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(dm.VariableSort.ALPHABETICAL_ASC)
            .multi(True)
            .include_all(True)
            .all_value(".+")
        )
    )
    for annotation in ANNOTATIONS:
        dash = dash.annotation(annotation_query(annotation))
    y = 0
    panel_id = 1
    for title, make in ROWS:
        dash = dash.with_row(db.Row(title).id(panel_id).grid_pos(dm.GridPos(h=1, w=24, x=0, y=y)))
        panel_id += 1
        y += 1
        x = 0
        row_height = 0
        for panel, width, height in make():
            if x + width > 24:
                x, y, row_height = 0, y + row_height, 0
            panel.id(panel_id).grid_pos(dm.GridPos(h=height, w=width, x=x, y=y))
            dash = dash.with_panel(panel)
            panel_id += 1
            x += width
            row_height = max(row_height, height)
        y += row_height
    encoded: dict[str, Any] = json.loads(json.dumps(dash.build(), cls=JSONEncoder))
    for query, annotation in zip(encoded["annotations"]["list"], ANNOTATIONS, strict=True):
        query.update(_prometheus_annotation_fields(annotation))
    # The SDK writes the interval-variable keys on every variable; the official schema
    # (additionalProperties: false) rejects them elsewhere, and Grafana ignores them.
    for variable in encoded["templating"]["list"]:
        if variable["type"] != "interval":
            for key in ("auto", "auto_count", "auto_min"):
                variable.pop(key, None)
    return encoded


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--check", action="store_true", help="exit 1 when the committed JSON differs"
    )
    parser.add_argument("--output", type=Path, default=DASHBOARD_PATH)
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.output.read_text(encoding="utf-8") if args.output.exists() else ""
        if current != text:
            print(f"{args.output} is out of date: run python grafana/generate.py", file=sys.stderr)
            return 1
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
