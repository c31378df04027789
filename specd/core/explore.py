"""Safe exploration: run one epoch at a step count specd cannot judge, to measure it.

The model policy only observes the step count it runs, so a calibration point that is off
by a few percent would decide forever. When the policy holds the live step count because
the best candidate is within the prediction interval (`specd.core.model.plan`: its gain is
not beyond the margin) and that candidate was observed too little for the interval to
shrink, or when a candidate was never observed on this box at the epoch's load (its
`StepPrediction.evidence_s`: what it did under other traffic leaves it as uncertain here),
specd may run one epoch at that candidate — from a window to the next window's opening — and
let what it observes there outweigh the calibration (an epoch is hours of observation, far
past `specd.core.model.OBSERVED_PIVOT_S`). Only where that is cheap and rare:

* its predicted tokens over the epoch, net of the restart and of the discount the policy
  gives an extrapolated candidate, are at most ``explore_max_loss_ratio`` below the live
  step count's (a bench truth whose deepest step count the calibration lacks showed an
  undiscounted extrapolation losing 13 % for a day);
* at most ``explore_max_per_week`` explorations in a rolling week, and never the same step
  count twice in one;
* never under a pin or a freeze, never outside a window, nor when dwell or the restart
  budget say no: `specd.core.decide.decide` gates an exploration like a change;
* never on a day unlike the days the forecast reads (`specd.core.forecast.unlike_other_days`:
  a first weekend after weekdays, a holiday): the loss above is predicted on that forecast
  (the bench's lowcap truth explored 2 on a first Saturday, predicted 0.8 % below the live 3
  on weekday traffic; at the eighth of that load the Saturday brought, it served 10 % less).

Exploration measures static step counts: it reads the plan's static K alone
(`specd.core.model.Plan.static_only`). Where off or an adaptive set is best but not sure to
serve more, the static ones stay open to it; a plan that moves to off or a set explores
nothing. While an adaptive set runs and the plan keeps it, and it served less than its
candidates' rows predict by more than `regression_min_ratio` (what SGLang's switching
costs on this box, which no row shows), the step counts are measured against it alike
(their loss counted against the set's tokens): a set only ever shows what its tiers serve,
so a step count it never runs would otherwise never be measured here once a set is live.
A set serving as its rows say leaves nothing to doubt (the bench lost tokens exploring
from such sets).

Without a calibration (none configured, or unusable) the model predicts only the step
counts observed on this box, so specd starts from the bands and walks one step at a time:

* while it has observed a single step count it explores the one the bands pick for the
  traffic (``band_steps``, the operator's prior), or, when the bands pick the live one,
  its neighbours; with no second step count there is no trend to judge a loss by, so the
  loss counted is the restart's;
* from two observed step counts on, it explores a never-observed step count next to an
  observed one (`trend`): between two observed ones it is predicted on the line through
  them, under the same loss bound; past the nearest two on one side only where they rise
  toward it beyond their prediction interval, predicted no better than the nearest (a
  curve in K flattens, then falls, at its top: a flat or falling trend says stop).

Each exploration measures its step count; the normal policy then compares the observed ones
with their evidence, so the walk climbs to the best and stops where its neighbours are
observed and worse, or the trend toward the next one flattens.

While an exploration's epoch runs (the explored step count is live and the window after
the one it started in has not opened yet), the policy's own changes wait; after it, the
normal policy decides again, and going back is a plain ``change``: in the epoch after,
an explored step count that is not the best measured one by the point prediction goes back
to it (`settle`), even inside the prediction interval — that interval protects a step
count chosen on evidence, and the explored one was not (otherwise the old step count's
evidence, decaying during the epoch, would widen the interval and keep a worse one live).
No exploration starts from an explored step count that has not settled so.

Pure: the exploration history is a value (``Control.explorations``), time is ``now``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING

from specd.core import windows
from specd.core.model import EVIDENCE_Z, OBSERVED_PIVOT_S
from specd.core.text import iso_time, utc_time
from specd.core.units import WEEK_S

if TYPE_CHECKING:
    from specd.core.model import Plan, StepPrediction
    from specd.core.settings import Settings

# A candidate with less (decayed) observation than this counts as never observed on this
# box: a tenth of what makes observation weigh as much as a calibration point
# (`specd.core.model.OBSERVED_PIVOT_S`).
UNOBSERVED_BELOW_S = 60.0


@dataclass(frozen=True)
class Exploration:
    """An exploration to start (``ongoing`` False) or the one whose epoch runs now."""

    steps: int
    why: str
    ongoing: bool = False


def this_week(explorations: Sequence[tuple[float, int]], now: float) -> list[tuple[float, int]]:
    """The explorations of the rolling week up to ``now``, oldest first."""
    return sorted((t, k) for t, k in explorations if now - WEEK_S < t <= now)


def epoch_end(config: Settings, started: float) -> float | None:
    """When the epoch of an exploration started at ``started`` ends: the first window
    opening after the window it started in; None without one."""
    # One second on: `next_open` answers a window opening at exactly ``started`` itself.
    at = datetime.fromtimestamp(started + 1.0, tz=timezone.utc)
    try:
        # Remembered: read three times a tick for the week an exploration is remembered.
        return windows.next_open_kept(tuple(config.windows), at).timestamp()
    except ValueError:
        return None


def ongoing(
    explorations: Sequence[tuple[float, int]], current: int | None, config: Settings, now: float
) -> Exploration | None:
    """The latest exploration while its step count is live and its epoch runs."""
    if current is None or not explorations:
        return None
    started, steps = max(explorations)
    if steps != current or started > now:
        return None
    end = epoch_end(config, started)
    if end is None or now >= end:
        return None
    # The window's opening on its own clock, as status and every decision name one.
    opening = windows.local_time(config.windows, datetime.fromtimestamp(end, timezone.utc))
    return Exploration(
        steps,
        f"exploring {steps} since {utc_time(started)}: measuring it until the window of "
        f"{iso_time(opening)}",
        ongoing=True,
    )


def _loss(held_tok_s: float, other_tok_s: float, horizon: float, restart_cost_s: float) -> float:
    """Share of ``held_tok_s``' tokens over ``horizon`` that ``other_tok_s`` loses after a
    restart (negative: a gain); 1 when nothing is held to lose against."""
    base = held_tok_s * horizon
    if base <= 0:
        return 1.0
    return 1.0 - other_tok_s * max(horizon - restart_cost_s, 0.0) / base


def loss_ratio(plan: Plan, steps: int, current: int) -> float | None:
    """Predicted share of the live step count's tokens over the epoch that running
    ``steps`` instead loses (negative: a predicted gain): the plan's own tokens, so net of
    the restart and of the discount of an extrapolated step count."""
    held, other = plan.predictions.get(current), plan.predictions.get(steps)
    if held is None or other is None or held.tokens <= 0:
        return None
    return 1.0 - other.tokens / held.tokens


def settle(
    plan: Plan | None,
    current: int | None,
    explorations: Sequence[tuple[float, int]],
    config: Settings,
    now: float,
) -> tuple[int, str] | None:
    """In the epoch after an exploration's: the measured step count to go back to when the
    explored one, still live, is not the best — by the point prediction, net of the
    restart, not only beyond the prediction interval (that interval protects a step count
    chosen on evidence; the explored one was chosen to be measured). None otherwise."""
    if plan is None or current is None or not explorations:
        return None
    started, steps = max(explorations)
    ended = epoch_end(config, started)
    if steps != current or ended is None or not ended <= now:
        return None
    following = epoch_end(config, ended)
    if following is None or now >= following:
        return None
    held = plan.predictions.get(current)
    measured = [
        p for k, p in plan.predictions.items() if k != current and p.evidence_s >= OBSERVED_PIVOT_S
    ]
    if held is None or plan.target != current or not measured:
        return None
    best = max(measured, key=lambda p: (p.tokens, -abs(p.steps - current)))
    if best.tokens <= held.tokens:
        return None
    return best.steps, (
        f"{current}, explored since {utc_time(started)}, measured below {best.steps} by "
        f"{best.tokens - held.tokens:.0f} tokens over the epoch, net of the restart: back to "
        f"{best.steps}"
    )


def trend(predictions: Mapping[int, StepPrediction], steps: int) -> float | None:
    """Predicted tok/s of ``steps`` from the model's ``predictions`` of other step counts,
    None unless one of them is next to it: on the line through the nearest on both sides;
    else, past the nearest two on one side, only up a rise beyond their prediction
    interval, and then no higher than the nearest (a curve in K flattens at its top)."""
    if steps in predictions or not ({steps - 1, steps + 1} & predictions.keys()):
        return None
    below = sorted(k for k in predictions if k < steps)
    above = sorted(k for k in predictions if k > steps)
    if below and above:
        a, b = predictions[below[-1]], predictions[above[0]]
        return a.tok_s + (b.tok_s - a.tok_s) * (steps - a.steps) / (b.steps - a.steps)
    side = below if len(below) >= 2 else above[1::-1] if len(above) >= 2 else None
    if side is None:
        return None
    far, near = predictions[side[-2]], predictions[side[-1]]
    margin = EVIDENCE_Z * math.hypot(far.error_ratio * far.tok_s, near.error_ratio * near.tok_s)
    return near.tok_s if near.tok_s - far.tok_s > margin else None


def _unpredicted(
    plan: Plan, current: int, config: Settings, band_steps: int | None
) -> list[tuple[int, float, str]]:
    """(steps, predicted tok/s, why) of the step counts the model cannot predict (never
    observed, no calibration to extrapolate from) that the walk may explore now."""
    choose = config.choose
    allowed = range(choose.min_steps, choose.max_steps + 1)
    unknown = [k for k in allowed if k not in plan.predictions]
    if not unknown:
        return []
    if len(plan.predictions) == 1:
        # No trend yet: the bands' step count, or its neighbours once it is the live one;
        # the loss counted is the restart's alone.
        held = plan.predictions[current].tok_s
        if band_steps in unknown:
            return [(band_steps, held, "the bands' step count, never observed")]
        if band_steps != current:
            return []
        return [
            (k, held, "next to the bands' step count, never observed")
            for k in (current + 1, current - 1)
            if k in unknown
        ]
    out = [
        (k, rate, "never observed, predicted from the trend of its observed neighbours")
        for k in unknown
        if (rate := trend(plan.predictions, k)) is not None
    ]
    return sorted(out, key=lambda c: (-c[1], abs(c[0] - current)))


def propose(
    plan: Plan | None,
    current: int | None,
    config: Settings,
    explorations: Sequence[tuple[float, int]],
    now: float,
    band_steps: int | None = None,
) -> Exploration | None:
    """The step count to explore now, if any (see the module docstring).

    First the best candidate the evidence gate held back while it is observed too little,
    then the never-observed candidates the model predicts, most predicted tokens first,
    then (without a calibration to predict them) the walk's never-observed step counts;
    the first within the loss bound and not explored this week wins. ``band_steps``: the
    bands' pick for the traffic, where a walk without calibration starts.
    """
    choose = config.choose
    if plan is None or current is None or current not in plan.predictions:
        return None
    week = this_week(explorations, now)
    if len(week) >= choose.explore_max_per_week:
        return None
    explored = {k for _, k in week}
    horizon = max(plan.until - plan.now, 0.0)
    held = plan.predictions[current].tok_s
    candidates: list[tuple[int, float, str]] = []
    best = plan.predictions[plan.best]
    if (
        plan.best != current
        and plan.target == current
        and 0 < plan.gain_tokens <= plan.margin_tokens
        # Observed this much, another epoch would hardly narrow its interval.
        and best.evidence_s < OBSERVED_PIVOT_S
    ):
        candidates.append((plan.best, best.tok_s, "within the prediction interval of the live one"))
    unobserved = sorted(
        (p for k, p in plan.predictions.items() if k != current),
        key=lambda p: (-p.tok_s, abs(p.steps - current)),
    )
    candidates += [
        (p.steps, p.tok_s, "never observed on this box")
        for p in unobserved
        if p.evidence_s < UNOBSERVED_BELOW_S
    ]
    if current >= 1:
        # The walk without a calibration starts from a step count (no set runs without one).
        candidates += _unpredicted(plan, current, config, band_steps)
    for steps, tok_s, why in candidates:
        if steps in explored or held * horizon <= 0:
            continue
        predicted = plan.predictions.get(steps)
        # The plan's tokens where it predicts (the extrapolation discount included: an
        # extrapolation off by more than the bound is what the bound is for), else the walk's.
        loss = (
            loss_ratio(plan, steps, current)
            if predicted is not None
            else _loss(held, tok_s, horizon, choose.restart_cost_s)
        )
        if loss is None or loss > choose.explore_max_loss_ratio:
            continue
        return Exploration(
            steps,
            f"{steps} is {why}; predicted loss {loss * 100:.2f}% ≤ "
            f"{choose.explore_max_loss_ratio * 100:g}% over the epoch, exploration "
            f"{len(week) + 1} of {choose.explore_max_per_week} this week",
        )
    return None
