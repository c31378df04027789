"""`step`: the one decision of a tick, as a pure function of values.

The daemon, `specd replay`, `specd recommend` and the demo call this and nothing else to
decide, so what replay proves is what the daemon does. Everything it needs comes in as a
value — the settings, the learned history (already holding this tick's observation), the
override in force, the control state carried from the previous tick, and the calibration
*table* (read by io, never here) — and everything it changes goes out in the result: no
clock, no file, no network, no cache outliving the call.

One tick: the live step count comes from this tick's observation only (a failed scrape
means "unknown", never the last value believed); the policy's pick is computed once and
both recorded for the stabilization window and handed to `decide`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from specd.core.choices import offer
from specd.core.decide import Control, Decision, Pick, choose, decide
from specd.core.model import Calibration, restart_cost_s
from specd.core.observation import Observation, ScrapeError

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
    # What the server can run (`specd.core.setting.traits_from_server_info`, with the
    # algorithm specd applies); None until /server_info was read: static K and off only.
    traits: ServerTraits | None = None


@dataclass(frozen=True)
class StepResult:
    """The decision, what it was based on, and the control state for the next tick."""

    decision: Decision
    current: int | None  # the step count live at SGLang per this tick's observation
    pick: Pick | None
    control: Control
    predictions: Mapping[int, float] = field(default_factory=dict)
    intervals: Mapping[int, tuple[float, float]] = field(default_factory=dict)

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
    )
    pick = choose(
        ctx.history,
        config,
        current,
        ctx.calibration,
        offer=offer(config.choose, ctx.traits),
        live_adaptive_config=control.live_adaptive_config,
    )
    if pick is not None and ctx.calibration_problem:
        pick = replace(pick, why=f"{pick.why} (calibration unusable: {ctx.calibration_problem})")
    if pick is not None and isinstance(observation, Observation):
        control = control.with_recommendation(now, pick.key, config.choose.stabilization_window_s)
    needs_s = ctx.restart_needs_s
    if pick is not None and pick.chosen is not None:
        # An adaptive start captures a CUDA-graph set per candidate: the window must hold it.
        needs_s += restart_cost_s(pick.chosen, config) - config.choose.restart_cost_s
    decision = decide(ctx.history, observation, config, ctx.override, now, control, pick, needs_s)
    predictions = pick.predictions if pick is not None else {}
    intervals = pick.intervals if pick is not None else {}
    return StepResult(decision, current, pick, control, predictions, intervals)
