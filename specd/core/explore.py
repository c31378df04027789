"""Safe exploration: run one epoch at a step count specd cannot judge, to measure it.

The model policy only observes the step count it runs, so a calibration point that is off
by a few percent would decide forever. When the policy holds the live step count because
the best candidate is within the prediction interval (`specd.core.model.plan`: its gain is
not beyond the margin), or when a candidate was never observed on this box, specd may run
one epoch at that candidate — from a window to the next window's opening — and let what it
observes there outweigh the calibration. Only where that is cheap and rare:

* its predicted tokens over the epoch, net of the restart, are at most
  ``explore_max_loss_ratio`` below the live step count's (without the discount the policy
  gives extrapolated candidates: that discount is about choosing, not measuring);
* at most ``explore_max_per_week`` explorations in a rolling week, and never the same step
  count twice in one;
* never under a pin or a freeze, never outside a window, nor when dwell or the restart
  budget say no: `specd.core.decide.decide` gates an exploration like a change.

While an exploration's epoch runs (the explored step count is live and the window after
the one it started in has not opened yet), the policy's own changes wait; after it, the
normal policy decides again (going back is a plain ``change``).

Pure: the exploration history is a value (``Control.explorations``), time is ``now``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING

from specd.core import windows

if TYPE_CHECKING:
    from specd.core.model import Plan
    from specd.core.settings import Settings

WEEK_S = 7 * 86400.0
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


def _stamp(t: float) -> str:
    return datetime.fromtimestamp(t, tz=timezone.utc).strftime("%Y-%m-%dT%H:%MZ")


def this_week(explorations: Sequence[tuple[float, int]], now: float) -> list[tuple[float, int]]:
    """The explorations of the rolling week up to ``now``, oldest first."""
    return sorted((t, k) for t, k in explorations if now - WEEK_S < t <= now)


def epoch_end(config: Settings, started: float) -> float | None:
    """When the epoch of an exploration started at ``started`` ends: the first window
    opening after the window it started in; None without one."""
    # One second on: `next_open` answers a window opening at exactly ``started`` itself.
    at = datetime.fromtimestamp(started + 1.0, tz=timezone.utc)
    try:
        return windows.next_open(config.windows, at).timestamp()
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
    return Exploration(
        steps,
        f"exploring {steps} since {_stamp(started)}: measuring it until the window of "
        f"{_stamp(end)}",
        ongoing=True,
    )


def loss_ratio(plan: Plan, steps: int, current: int, restart_cost_s: float) -> float | None:
    """Predicted share of the live step count's tokens over the epoch that running
    ``steps`` instead loses, restart included (negative: a predicted gain)."""
    held, other = plan.predictions.get(current), plan.predictions.get(steps)
    if held is None or other is None:
        return None
    horizon = max(plan.until - plan.now, 0.0)
    base = held.tok_s * horizon
    if base <= 0:
        return None
    return 1.0 - other.tok_s * max(horizon - restart_cost_s, 0.0) / base


def propose(
    plan: Plan | None,
    current: int | None,
    config: Settings,
    explorations: Sequence[tuple[float, int]],
    now: float,
) -> Exploration | None:
    """The step count to explore now, if any (see the module docstring).

    First the best candidate the evidence gate held back, then the never-observed
    candidates, most predicted tokens first; the first within the loss bound and not
    explored this week wins.
    """
    choose = config.choose
    if plan is None or current is None or current not in plan.predictions:
        return None
    week = this_week(explorations, now)
    if len(week) >= choose.explore_max_per_week:
        return None
    explored = {k for _, k in week}
    candidates: list[tuple[int, str]] = []
    if (
        plan.best != current
        and plan.target == current
        and 0 < plan.gain_tokens <= plan.margin_tokens
    ):
        candidates.append((plan.best, "within the prediction interval of the live one"))
    unobserved = sorted(
        (p for k, p in plan.predictions.items() if k != current),
        key=lambda p: (-p.tok_s, abs(p.steps - current)),
    )
    candidates += [
        (p.steps, "never observed on this box")
        for p in unobserved
        if p.evidence_s < UNOBSERVED_BELOW_S
    ]
    for steps, why in candidates:
        if steps in explored:
            continue
        loss = loss_ratio(plan, steps, current, choose.restart_cost_s)
        if loss is None or loss > choose.explore_max_loss_ratio:
            continue
        return Exploration(
            steps,
            f"{steps} is {why}; predicted loss {loss * 100:.2f}% ≤ "
            f"{choose.explore_max_loss_ratio * 100:g}% over the epoch, exploration "
            f"{len(week) + 1} of {choose.explore_max_per_week} this week",
        )
    return None
