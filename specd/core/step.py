"""`step`: the one decision of a tick, as a pure function of values.

The daemon, `specd replay`, `specd recommend` and the demo call this and nothing else to
decide, so what replay proves is what the daemon does. Everything it needs comes in as a
value — the settings, the learned history (already holding this tick's observation), the
override in force, the control state carried from the previous tick, and the calibration
*table* (read by io, never here) — and everything it changes goes out in the result: no
clock, no file, no network, no cache outliving the call.

One tick: the live step count comes from this tick's observation only (a failed scrape
means "unknown", never the last value believed); the policy's pick is computed once and
both recorded for the stabilization window and handed to `decide`, with the outcome of the
latest change (`specd.core.outcome.verdict`, judged for the traffic the policy expects);
the policy skips the step counts on the avoid list. A regression found puts the regressed
step count on the avoid list; a change that acts is snapshotted for its verification.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from specd.core import outcome
from specd.core.decide import Control, Decision, Pick, Reason, choose, decide
from specd.core.model import Calibration
from specd.core.observation import Observation, ScrapeError

if TYPE_CHECKING:
    from specd.core.history import History
    from specd.core.override import Override
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

    @property
    def acts(self) -> bool:
        """True iff the caller should apply ``decision.target_steps`` now."""
        return self.decision.acts(self.current)


def step(ctx: StepContext, observation: Observation | ScrapeError | None, now: float) -> StepResult:
    """Decide for ``now``; see the module docstring."""
    config = ctx.config
    current = observation.steps if isinstance(observation, Observation) else None
    control = Control(
        current_steps=current,
        restart_times=ctx.control.restart_times,
        frozen=ctx.control.frozen,
        frozen_reason=ctx.control.frozen_reason,
        recommendations=ctx.control.recommendations,
        verifying=None
        if ctx.control.verifying is None or ctx.control.verifying.lapsed(now)
        else ctx.control.verifying,
        avoided=outcome.current_entries(ctx.control.avoided, now, config),
    )
    avoid = functools.partial(outcome.avoided, control.avoided, now, config)
    pick = choose(ctx.history, config, current, ctx.calibration, avoid)
    if pick is not None and ctx.calibration_problem:
        pick = replace(pick, why=f"{pick.why} (calibration unusable: {ctx.calibration_problem})")
    coming = pick.mix if pick is not None else ctx.history.offered_weights()
    model = pick.plan.model if pick is not None and pick.plan is not None else None
    verdict = outcome.verdict(
        control.verifying, ctx.history, config, current, ctx.calibration, coming, model
    )
    if verdict is not None and verdict.beyond_noise:
        # Remembered as soon as it is found, for whatever traffic it regressed under.
        entry = outcome.avoid_entry(verdict, now)
        control = replace(
            control, avoided=outcome.with_avoided(control.avoided, entry, now, config)
        )
    if pick is not None and isinstance(observation, Observation):
        control = control.with_recommendation(now, pick.steps, config.choose.stabilization_window_s)
    decision = decide(
        ctx.history,
        observation,
        config,
        ctx.override,
        now,
        control,
        pick,
        ctx.restart_needs_s,
        verdict,
    )
    if decision.acts(current):
        control = _after_acting(control, decision, current, pick, ctx, now)
    predictions = pick.predictions if pick is not None else {}
    intervals = pick.intervals if pick is not None else {}
    return StepResult(decision, current, pick, control, predictions, intervals, verdict)


def _after_acting(
    control: Control,
    decision: Decision,
    current: int | None,
    pick: Pick | None,
    ctx: StepContext,
    now: float,
) -> Control:
    """The control state once ``decision`` acts: a policy change is to be verified; any
    other change (going back from a regression, a pin, ...) is no change of specd's to
    verify."""
    target = decision.target_steps
    if decision.reason is Reason.CHANGE and current is not None and target is not None:
        gain = None
        if (
            pick is not None
            and pick.predictions.get(current, 0.0) > 0
            and target in pick.predictions
        ):
            gain = pick.predictions[target] / pick.predictions[current] - 1.0
        until = outcome.verification_end(ctx.config, now)
        snap = outcome.snapshot(ctx.history, current, target, gain, until)
        return replace(control, verifying=snap)
    return replace(control, verifying=None)
