"""`step`: the one decision of a tick, as a pure function of values.

The daemon, `specd replay`, `specd recommend` and the demo call this and nothing else to
decide, so what replay proves is what the daemon does. Everything it needs comes in as a
value — the settings, the learned history (already holding this tick's observation), the
override in force, the control state carried from the previous tick, and the calibration
*table* (read by io, never here) — and everything it changes goes out in the result: no
clock, no file, no network, no cache outliving the call.

One tick: the live step count comes from this tick's observation only (a failed scrape
means "unknown", never the last value believed); the policy's pick is computed once and
both recorded for the stabilization window and handed to `decide`, with the exploration
`specd.core.explore` proposes from it (or the one whose epoch runs; without a
calibration the bands' step count is where it starts); an exploration that acts is noted
in the control state. In the epoch after an exploration, the pick goes back to the best
measured step count when the explored one is not it (`specd.core.explore.settle`). The
outcome of the latest change (`specd.core.outcome.verdict`, judged for the traffic the
policy expects) goes to `decide` too; the policy skips the step counts on the avoid list.
A regression found puts the regressed step count on the avoid list; a change that acts is
snapshotted for its verification.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from specd.core import explore, outcome
from specd.core.choices import cannot_run, offer, table_steps
from specd.core.decide import Control, Decision, Pick, Reason, band_steps, choose, decide
from specd.core.model import OBSERVED_PIVOT_S, Calibration, Plan, restart_extra_s
from specd.core.observation import Observation, ScrapeError
from specd.core.setting import SpecSetting, format_setting, runs_adaptive_config, setting_key

if TYPE_CHECKING:
    from specd.core.history import History
    from specd.core.override import Override
    from specd.core.setting import ServerTraits
    from specd.core.settings import Settings


@dataclass(frozen=True)
class StepContext:
    """Everything a decision reads besides the observation and the time."""

    config: Settings
    history: History
    override: Override | None
    control: Control
    calibration: Calibration | None = None
    # Why a configured calibration could not be used (one line), for the decision's message.
    calibration_problem: str | None = None
    # The longest one restart of the unit takes (its stop timeout + the start): a change
    # waits for a window with that much time left.
    restart_needs_s: float = 0.0
    # Why no slot of the configured fleet can be taken (one line, found by io this tick);
    # None: one can, or no fleet is configured.
    fleet_problem: str | None = None
    # Why the configured gateway cannot drain this server (one line, found by io this tick);
    # None: it can, or no gateway is configured.
    gateway_problem: str | None = None
    # Why specd's state could not be saved (one line, the last save's error, tried again by
    # io before a restart); None: it was.
    state_problem: str | None = None
    # What the server can run (`specd.core.setting.traits_from_server_info`, with the
    # algorithm specd applies); None until /server_info was read: static K and off only.
    traits: ServerTraits | None = None
    # Why the unit can be given static K only (its ExecStart= reads specd's step variables,
    # not the setting's; found by io at start and on reload); None: any setting.
    static_only: str | None = None


@dataclass(frozen=True)
class StepResult:
    """The decision, what it was based on, and the control state for the next tick."""

    decision: Decision
    current: int | None  # the step count live at SGLang per this tick's observation
    pick: Pick | None
    control: Control
    predictions: Mapping[int, float] = field(default_factory=dict)
    intervals: Mapping[int, tuple[float, float]] = field(default_factory=dict)
    # The outcome of the latest change while its step count is live (specd.core.outcome).
    verdict: outcome.Verdict | None = None
    # What SGLang runs per this tick's observation, as the operator writes it ("4", "off",
    # "adaptive:3,4"; an adaptive config specd does not offer by its file); None: unknown.
    live_name: str | None = None

    @property
    def named_predictions(self) -> dict[str, float]:
        """Every candidate's predicted mean tok/s by its operator form ("4", "off",
        "adaptive:3,4"): ``predictions`` keys off as 0 and leaves the sets to the pick."""
        sets = self.pick.setting_predictions if self.pick is not None else {}
        return {outcome.label(k, None): v for k, v in self.predictions.items()} | dict(sets)

    @property
    def named_intervals(self) -> dict[str, tuple[float, float]]:
        """``named_predictions``' prediction intervals (low, high)."""
        sets = self.pick.setting_intervals if self.pick is not None else {}
        return {outcome.label(k, None): v for k, v in self.intervals.items()} | dict(sets)

    @property
    def acts(self) -> bool:
        """True iff the caller should apply ``decision.target_steps`` now."""
        return self.decision.acts(
            self.current,
            live_adaptive=self.control.live_adaptive,
            live_config=self.control.live_adaptive_config,
        )


def step(ctx: StepContext, observation: Observation | ScrapeError | None, now: float) -> StepResult:
    """Decide for ``now``; see the module docstring."""
    config = ctx.config
    seen = observation if isinstance(observation, Observation) else None
    # Under SGLang's adaptive mode the steps gauge follows the tier of the moment: it is
    # not a setting specd could hold or compare with.
    adaptive = seen is not None and seen.adaptive
    current = seen.steps if seen is not None and not adaptive else None
    control = Control(
        current_steps=current,
        restart_times=ctx.control.restart_times,
        frozen=ctx.control.frozen,
        frozen_reason=ctx.control.frozen_reason,
        recommendations=ctx.control.recommendations,
        live_adaptive=adaptive,
        live_adaptive_config=seen.adaptive_config if seen is not None and adaptive else None,
        explorations=ctx.control.explorations,
        verifying=None
        if ctx.control.verifying is None or ctx.control.verifying.lapsed(now)
        else ctx.control.verifying,
        avoided=outcome.current_entries(ctx.control.avoided, now, config),
    )
    avoid = functools.partial(outcome.avoided, control.avoided, now, config)
    offered = offer(config.choose, ctx.traits, table_steps(ctx.calibration), ctx.static_only)
    pick = choose(
        ctx.history,
        config,
        current,
        ctx.calibration,
        avoid,
        offer=offered,
        live_adaptive_config=control.live_adaptive_config,
    )
    if pick is not None and ctx.calibration_problem:
        kept = ", the last good one kept" if ctx.calibration is not None else ""
        pick = replace(
            pick, why=f"{pick.why} (calibration unusable{kept}: {ctx.calibration_problem})"
        )
    coming = pick.mix if pick is not None else ctx.history.offered_weights()
    model = pick.plan.model if pick is not None and pick.plan is not None else None
    verdict = outcome.verdict(
        control.verifying,
        ctx.history,
        config,
        current,
        ctx.calibration,
        coming,
        model,
        control.live_adaptive_config,
    )
    if verdict is not None and verdict.beyond_noise:
        # Remembered as soon as it is found, for whatever traffic it regressed under.
        entry = outcome.avoid_entry(verdict, now)
        control = replace(
            control, avoided=outcome.with_avoided(control.avoided, entry, now, config)
        )
    # The adaptive set live, as the plan keys it: the offered one its config names.
    live_set = (
        next(
            (s for s in offered.settings if runs_adaptive_config(s, control.live_adaptive_config)),
            None,
        )
        if control.live_adaptive
        else None
    )
    live_key = current if live_set is None else setting_key(live_set)
    full = pick.plan if pick is not None else None
    if live_set is not None and not _short_of_its_rows(full, live_set, config):
        live_key = None  # a set serving what its candidates' rows say: nothing to doubt
    static_plan = _static_plan(full, live_key)
    back = explore.settle(static_plan, current, control.explorations, config, now)
    if pick is not None and back is not None:
        pick = replace(pick, steps=back[0], why=f"{pick.why}; {back[1]}")
    if pick is not None and isinstance(observation, Observation):
        control = control.with_recommendation(now, pick.key, config.choose.stabilization_window_s)
    exploration = explore.ongoing(control.explorations, current, config, now)
    if exploration is None and static_plan is not None:
        known = static_plan.predictions
        allowed = range(config.choose.min_steps, config.choose.max_steps + 1)
        # The bands only matter where the model cannot predict (no calibration).
        band = None if all(k in known for k in allowed) else band_steps(ctx.history, config)
        exploration = explore.propose(
            static_plan, live_key, config, control.explorations, now, band
        )
        if exploration is not None and exploration.steps in {a.steps for a in control.avoided}:
            # It regressed when run (`specd.core.outcome`): measured already, and worse.
            exploration = None
    decide_with = functools.partial(
        decide,
        ctx.history,
        observation,
        config,
        ctx.override,
        now,
        control,
        pick,
        exploration=exploration,
        verdict=verdict,
        fleet_problem=ctx.fleet_problem,
        gateway_problem=ctx.gateway_problem,
        state_problem=ctx.state_problem,
        cannot_run=functools.partial(cannot_run, ctx.traits, ctx.static_only),
    )
    decision = decide_with(ctx.restart_needs_s)
    # An adaptive start captures a CUDA-graph set per candidate: the window must hold the
    # restart into the decision's own target, a pin's too (the policy's pick said nothing
    # of a pinned set, and held a static pin to its set's longer start).
    extra_s = restart_extra_s(decision.target_setting, config) if decision.target_setting else 0.0
    if extra_s > 0:
        decision = decide_with(ctx.restart_needs_s + extra_s)
    acts = decision.acts(
        current, live_adaptive=control.live_adaptive, live_config=control.live_adaptive_config
    )
    if decision.reason is Reason.EXPLORE and acts:
        assert decision.target_steps is not None
        control = control.with_exploration(now, decision.target_steps)
    if acts:
        live = current if not control.live_adaptive else None
        if live_set is not None:
            live = setting_key(live_set)
        control = _after_acting(control, decision, live, live_set, pick, ctx, now)
    predictions = pick.predictions if pick is not None else {}
    intervals = pick.intervals if pick is not None else {}
    return StepResult(
        decision,
        current,
        pick,
        control,
        predictions,
        intervals,
        verdict,
        _live_name(current, control.live_adaptive, live_set, control.live_adaptive_config),
    )


# The longest adaptive config file name `StepResult.live_name` shows (specd's own are 30
# characters, "adaptive-9dbb2fdde921af3e.json").
LIVE_FILE_NAME_MAX = 64


def _live_name(
    current: int | None, adaptive: bool, live_set: SpecSetting | None, config_path: str | None
) -> str | None:
    """``StepResult.live_name``: under SGLang's adaptive mode the steps gauge follows the
    tier of the moment, so the set is named by its config file."""
    if not adaptive:
        return None if current is None else outcome.label(current, None)
    if live_set is not None:
        return format_setting(live_set)
    name = (config_path or "").rstrip("/").rsplit("/", 1)[-1]
    if len(name) > LIVE_FILE_NAME_MAX:
        # What SGLang reports is not bounded; the name goes into state.json and a label.
        name = name[: LIVE_FILE_NAME_MAX - 1] + "…"
    return f"adaptive ({name})" if name else "adaptive"


def _after_acting(
    control: Control,
    decision: Decision,
    current: int | None,
    current_setting: SpecSetting | None,
    pick: Pick | None,
    ctx: StepContext,
    now: float,
) -> Control:
    """The control state once ``decision`` acts: a policy change is to be verified; any
    other change (going back from a regression, a pin, ...) is no change of specd's to
    verify. ``current``: the setting key live (``current_setting``: its adaptive set)."""
    chosen = decision.setting
    target = setting_key(chosen) if chosen is not None else decision.target_steps
    if decision.reason is Reason.CHANGE and current is not None and target is not None:
        gain = None
        if (
            pick is not None
            and pick.predictions.get(current, 0.0) > 0
            and target in pick.predictions
        ):
            gain = pick.predictions[target] / pick.predictions[current] - 1.0
        elif pick is not None and pick.plan is not None:
            # Adaptive sets are predicted in the plan only (keyed alike).
            held, new = pick.plan.predictions.get(current), pick.plan.predictions.get(target)
            if held is not None and new is not None and held.tok_s > 0:
                gain = new.tok_s / held.tok_s - 1.0
        until = outcome.verification_end(ctx.config, now)
        predicted: tuple[tuple[int, float, float], ...] = ()
        if pick is not None and pick.plan is not None and pick.plan.model is not None:
            predicted = outcome.predicted_bands(
                pick.plan.model, pick.mix, current, target, current_setting, chosen
            )
        snap = outcome.snapshot(
            ctx.history, current, target, gain, until, current_setting, chosen, predicted
        )
        return replace(control, verifying=snap)
    return replace(control, verifying=None)


def _short_of_its_rows(plan: Plan | None, live_set: SpecSetting, config: Settings) -> bool:
    """Whether the live adaptive set served less than its candidates' rows predict, by
    more than a day's prompts vary (`regression_min_ratio`), over at least
    `OBSERVED_PIVOT_S` busy seconds (where observation weighs as much as the rows): what
    SGLang's switching costs on this box, which the rows cannot show. Only then are the
    step counts it never runs worth an epoch of measuring from it."""
    if plan is None or plan.model is None:
        return False
    served = plan.model.set_served(live_set)
    if served is None:
        return False
    ratio, seconds = served
    return seconds >= OBSERVED_PIVOT_S and ratio < 1.0 - config.choose.regression_min_ratio


def _static_plan(plan: Plan | None, live: int | None) -> Plan | None:
    """The plan as safe exploration reads it: static step counts only, the live setting
    ``live`` held (a static K, or an offered adaptive set's key: a set that runs never
    learns what a step count it has not run serves here). Exploration measures a step
    count; a plan that moves to off or to an adaptive set explores nothing. One that keeps
    the live setting because the best (static, off or a set) is not sure to serve more
    reads its best static K (`Plan.static_only`)."""
    if plan is None or live is None or live == 0 or live not in plan.predictions:
        return None
    # From a static K the plan may move to another K; from a set it must keep the set.
    stays = plan.target >= 1 if live >= 1 else plan.target == live
    return plan.static_only(live) if stays else None
