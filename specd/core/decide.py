"""The `decide` step of a tick: which step count specd wants live, and why (not) now.

Pure: no I/O and no clock of its own; ``now`` is a unix time passed in, turned into an
aware datetime only to ask whether a maintenance window is open. The same inputs always
give the same `Decision`, so every branch is testable with an injected clock.

Checks run in a fixed order, like Kubernetes' HPA: the first that holds gives the
reason. Safety first (freeze, then an operator's pin), then the quality of the data,
then whether the latest change regressed (go back: `specd.core.outcome`), then whether
the policy really wants a change, then when a change is allowed.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from types import MappingProxyType
from typing import TYPE_CHECKING

from specd.core import windows
from specd.core.model import Calibration, Plan, plan
from specd.core.observation import ScrapeError
from specd.core.text import duration_text as _duration

if TYPE_CHECKING:
    from specd.core.history import History
    from specd.core.observation import Observation
    from specd.core.outcome import Avoided, ChangeSnapshot, Verdict
    from specd.core.override import Override
    from specd.core.settings import Band, Settings

DAY_S = 86400.0


class Reason(str, enum.Enum):
    """Why a decision acts or holds. A fixed set: each is a metric label and a log field."""

    NO_DATA = "no_data"
    INSUFFICIENT_DATA = "insufficient_data"
    STALE_DATA = "stale_data"
    WITHIN_TOLERANCE = "within_tolerance"
    STABILIZING = "stabilizing"
    DWELL_TIME = "dwell_time"
    RESTART_BUDGET = "restart_budget"
    WINDOW_CLOSED = "window_closed"
    # Open, but closing before one restart of this unit could finish.
    WINDOW_ENDING = "window_ending"
    OVERRIDE_PIN = "override_pin"
    FROZEN = "frozen"
    CHANGE = "change"
    # Going back: the step count specd changed to served less than the one before it,
    # beyond noise (specd.core.outcome).
    REGRESSION = "regression"


# The only reasons under which the daemon applies a target.
ACTING_REASONS = frozenset({Reason.CHANGE, Reason.OVERRIDE_PIN, Reason.REGRESSION})


@dataclass(frozen=True)
class Decision:
    """``target_steps``: what specd wants live (None when it cannot know)."""

    target_steps: int | None
    reason: Reason
    message: str

    def acts(self, current: int | None) -> bool:
        """True iff the daemon should apply ``target_steps`` now."""
        return (
            self.reason in ACTING_REASONS
            and self.target_steps is not None
            and self.target_steps != current
        )


@dataclass(frozen=True)
class Control:
    """The part of specd's state that decide reads, carried from tick to tick by `step`."""

    current_steps: int | None
    restart_times: tuple[float, ...] = ()
    frozen: bool = False
    frozen_reason: str | None = None
    # (t, steps) the policy recommended at recent ticks, oldest first.
    recommendations: tuple[tuple[float, int], ...] = ()
    # The latest change specd made, whose outcome is being verified (specd.core.outcome).
    verifying: ChangeSnapshot | None = None
    # Step counts that regressed, which the policies skip for a while (specd.core.outcome).
    avoided: tuple[Avoided, ...] = ()

    def with_recommendation(self, t: float, steps: int, window_s: float) -> Control:
        """Append a recommendation and drop those the stabilization check no longer needs.

        The newest entry at or before ``t - window_s`` is kept: it shows whether the
        recommendation already held when the window began.
        """
        recs = [*self.recommendations, (t, steps)]
        horizon = t - window_s
        older = [i for i, (rt, _) in enumerate(recs) if rt <= horizon]
        if older:
            del recs[: older[-1]]
        return replace(self, recommendations=tuple(recs))

    def after_restart(self, t: float) -> Control:
        """SGLang came back from a restart at ``t``: it counts against dwell and budget, and
        a new setting must earn its stabilization window afresh."""
        return replace(self, restart_times=(*self.restart_times, t), recommendations=())


@dataclass(frozen=True)
class Pick:
    """The policy's step count for the coming epoch, why, and (model policy) the predicted
    mean tok/s of every candidate step count, with its prediction interval (low, high)."""

    steps: int
    why: str
    predictions: Mapping[int, float] = field(default_factory=dict)
    intervals: Mapping[int, tuple[float, float]] = field(default_factory=dict)
    # Share of time the policy expects at each offered concurrency (model: the epoch's
    # forecast; bands: the history), for judging whether an outcome applies to it.
    mix: Mapping[int, float] = field(default_factory=dict)
    # The model policy's whole prediction; None for bands.
    plan: Plan | None = None


# -- policies -----------------------------------------------------------------------
# Given the concurrency mix the policy expects, the step counts it must skip, and why.
Avoid = Callable[[Mapping[int, float]], Mapping[int, str]]
Policy = Callable[
    ["History", "Settings", "int | None", "Calibration | None", "Avoid | None"], "Pick | None"
]


def clamp(steps: int, config: Settings) -> int:
    return max(config.choose.min_steps, min(config.choose.max_steps, steps))


def _num(x: float) -> str:
    return f"{x:.1f}" if x != int(x) else f"{int(x)}"


def _band_range(bands: Sequence[Band], i: int) -> str:
    upper = bands[i].max_concurrency
    lower = bands[i - 1].max_concurrency if i > 0 else None
    if upper is None:
        return f"> {_num(lower)}" if lower is not None else "any"
    if lower is None:
        return f"≤ {_num(upper)}"
    return f"in ({_num(lower)}, {_num(upper)}]"


def _pick_bands(
    history: History,
    config: Settings,
    current: int | None,
    _calibration: Calibration | None,
    avoid: Avoid | None = None,
) -> Pick | None:
    """Bands of offered concurrency; with ``current``, boundaries get hysteresis.

    The band is picked by a quantile of busy-time offered concurrency. To leave the
    band(s) of the live step count, that quantile must be beyond the boundary by
    ``tolerance_ratio`` (above b·(1+tol), or below b·(1−tol)), so traffic hovering at a
    boundary cannot make specd flap between two settings.
    """
    bands = config.bands
    ratio = config.choose.band_quantile_ratio
    q = history.quantile(ratio)
    if q is None or not bands:
        return None
    label = f"p{ratio * 100:g} offered concurrency {_num(q)}"
    picked = next(
        (i for i, b in enumerate(bands) if b.max_concurrency is None or q <= b.max_concurrency),
        len(bands) - 1,
    )
    steps = clamp(bands[picked].steps, config)
    why = f"{label} {_band_range(bands, picked)} (band {picked + 1} → {steps} steps)"
    if current is None or steps == current:
        return Pick(steps, why)
    skipped = avoid(history.offered_weights()) if avoid is not None else {}
    if steps in skipped:
        return Pick(current, f"{why}, avoided: {skipped[steps]}: keeping {current}")
    tol = config.choose.tolerance_ratio
    for j, band in enumerate(bands):
        if clamp(band.steps, config) != current:
            continue
        upper = band.max_concurrency
        lower = bands[j - 1].max_concurrency if j > 0 else None
        if upper is not None and q > upper * (1 + tol):
            continue
        if lower is not None and q < lower * (1 - tol):
            continue
        edge = upper if upper is not None and q > upper else lower
        return Pick(
            current,
            f"{label} is within {tol * 100:g}% of the band boundary {_num(edge or 0.0)}: "
            f"keeping band {j + 1} ({current} steps)",
        )
    return Pick(steps, why)


def _pick_model(
    history: History,
    config: Settings,
    current: int | None,
    calibration: Calibration | None,
    avoid: Avoid | None = None,
) -> Pick | None:
    """The throughput model (specd.core.model), forecast over the coming epoch."""
    result = plan(history, config, current, calibration, avoid)
    if result is None:
        return None
    return Pick(
        result.target,
        result.why,
        {k: p.tok_s for k, p in result.predictions.items()},
        {k: p.interval for k, p in result.predictions.items()},
        mix=result.forecast.weights,
        plan=result,
    )


# Read-only: the core keeps no mutable module state.
POLICIES: Mapping[str, Policy] = MappingProxyType({"bands": _pick_bands, "model": _pick_model})


def choose(
    history: History,
    config: Settings,
    current: int | None = None,
    calibration: Calibration | None = None,
    avoid: Avoid | None = None,
) -> Pick | None:
    """The configured policy's pick (clamped to the allowed range); None without busy history.

    Without ``current`` this is the raw pick; with it, the policy's tolerance applies
    and the pick is ``current`` while the evidence for a change is within tolerance.
    ``avoid`` names the step counts the pick must not change to (`specd.core.outcome`).
    """
    pick = POLICIES[config.choose.policy](history, config, current, calibration, avoid)
    if pick is not None and not pick.mix:
        pick = replace(pick, mix=history.offered_weights())
    return pick


# -- decide -------------------------------------------------------------------------
def _utc(now: float) -> datetime:
    return datetime.fromtimestamp(now, tz=timezone.utc)


def _stamp(at: datetime) -> str:
    return at.strftime("%Y-%m-%dT%H:%MZ")


def _held_for(recommendations: Sequence[tuple[float, int]], target: int, now: float) -> float:
    """How long ``target`` has been recommended without interruption, up to ``now``."""
    since: float | None = None
    for t, steps in sorted(recommendations):
        if steps != target:
            since = None
        elif since is None:
            since = t
    return 0.0 if since is None else max(0.0, now - since)


def _one_line(text: str) -> str:
    """Messages are log fields and sd_notify STATUS= lines: one line, whatever came in."""
    return " ".join(text.split())


def _holding(current: int | None) -> str:
    return f"holding {current}" if current is not None else "no change"


def _arrow(current: int | None, target: int) -> str:
    return f"{current if current is not None else '?'} → {target}"


def _window_message(config: Settings, at: datetime, change: str) -> str:
    try:
        nxt = f"next opens {_stamp(windows.next_open(config.windows, at))}"
    except ValueError as exc:
        nxt = str(exc)
    return f"maintenance window closed ({nxt}): {change} waits"


def window_left_s(config: Settings, at: datetime) -> float | None:
    """Seconds until the open maintenance window closes; None when none is open."""
    current = windows.current_window(config.windows, at)
    return None if current is None else (current[1] - at).total_seconds()


def _window_blocks(
    config: Settings, at: datetime, restart_needs_s: float, change: str
) -> tuple[Reason, str] | None:
    """Why the window does not allow a restart now (closed, or closing before one restart
    of the unit could finish), or None."""
    left = window_left_s(config, at)
    if left is None:
        return Reason.WINDOW_CLOSED, _window_message(config, at, change)
    if left < restart_needs_s:
        return Reason.WINDOW_ENDING, (
            f"maintenance window closes in {_duration(left)}, one restart needs up to "
            f"{_duration(restart_needs_s)} (stop timeout + start): {change} waits"
        )
    return None


def decide(
    history: History,
    obs: Observation | ScrapeError | None,
    config: Settings,
    override: Override | None,
    now: float,
    control: Control,
    pick: Pick | None,
    restart_needs_s: float = 0.0,
    verdict: Verdict | None = None,
) -> Decision:
    """What specd wants live and whether to apply it now, given the policy's ``pick`` for
    ``control.current_steps`` (`choose`); a restart outside a forced pin must fit in the
    open window with ``restart_needs_s`` to spare. A ``verdict`` of regression
    (`specd.core.outcome`) goes back to the step count before the change, gated like a
    change but without waiting for the stabilization window. See the module docstring."""
    at = _utc(now)
    current = control.current_steps
    hold = None if current is None else clamp(current, config)
    active = override if override is not None and override.active(at) else None

    # 1. Frozen: after a failed restart (until an operator clears it) or by override.
    if control.frozen:
        # One line, whatever the state file holds: messages are log fields and STATUS=.
        why = _one_line(control.frozen_reason or "") or "a restart failed"
        return Decision(hold, Reason.FROZEN, f"frozen ({why}); {_holding(current)}")
    if active is not None and active.mode == "freeze":
        until = f" until {_stamp(active.expires_at)}" if active.expires_at else ""
        return Decision(
            hold,
            Reason.FROZEN,
            f"override freeze{until} ({active.reason}); {_holding(current)}",
        )

    # 2. An operator's pin. apply = "now" is the on-call's emergency lever, so it
    # bypasses the window, dwell and budget; a next-window pin waits for a window and
    # respects the daily budget (the guard against restart loops) but not the dwell,
    # which only exists to stop the automatic policy from flapping.
    if active is not None and active.mode == "pin" and active.steps is not None:
        pin = clamp(active.steps, config)
        said = f"pinned to {pin} by override ({active.reason})"
        if pin == current:
            return Decision(pin, Reason.OVERRIDE_PIN, f"{said}; already live")
        if active.apply == "now":
            return Decision(pin, Reason.OVERRIDE_PIN, f"{said}, apply now: {_arrow(current, pin)}")
        blocked = _window_blocks(config, at, restart_needs_s, _arrow(current, pin))
        if blocked is not None:
            return Decision(pin, blocked[0], f"{said}; {blocked[1]}")
        used = sum(1 for t in control.restart_times if t > now - DAY_S)
        if used >= config.restart.daily_restart_budget:
            return Decision(
                pin,
                Reason.RESTART_BUDGET,
                f"{said}; {used} restarts in the last 24 h ≥ budget "
                f"{config.restart.daily_restart_budget}: {_arrow(current, pin)} waits",
            )
        return Decision(pin, Reason.OVERRIDE_PIN, f"{said}: {_arrow(current, pin)}")

    # 3. Data: an observation, fresh, and enough busy history behind it.
    if obs is None:
        return Decision(hold, Reason.NO_DATA, f"no observation of SGLang yet; {_holding(current)}")
    if isinstance(obs, ScrapeError):
        return Decision(
            hold,
            Reason.NO_DATA,
            f"scrape failed ({obs.kind}: {_one_line(obs.reason)}); {_holding(current)}",
        )
    if current is None:
        return Decision(None, Reason.NO_DATA, "SGLang's current step count is unknown; no change")
    age = now - obs.t
    if not math.isfinite(age) or abs(age) > config.observe.stale_after_s:
        return Decision(
            hold,
            Reason.STALE_DATA,
            f"latest observation is {_duration(abs(age)) if math.isfinite(age) else '?'} "
            f"{'old' if age >= 0 else 'in the future'} (> "
            f"{_duration(config.observe.stale_after_s)}); "
            f"{_holding(current)}",
        )
    busy = history.busy_seconds
    if busy < config.observe.min_history_s:
        return Decision(
            hold,
            Reason.INSUFFICIENT_DATA,
            f"{_duration(busy)} of busy history < {_duration(config.observe.min_history_s)} "
            "needed; "
            f"{_holding(current)}",
        )
    back = None if verdict is None else clamp(verdict.from_steps, config)
    if verdict is not None and verdict.regressed and pick is not None and pick.steps != current:
        # The policy, having seen the outcome too, leaves the regressed step count for
        # another: its pick, not necessarily the old one, serves the coming epoch best.
        back = pick.steps
    if verdict is not None and verdict.regressed and verdict.to_steps == current != back:
        assert back is not None
        by = "" if back == clamp(verdict.from_steps, config) else " (the policy's pick)"
        change = f"going back {_arrow(current, back)}{by}"
        blocked = _change_blocks(config, at, now, control, restart_needs_s, change)
        if blocked is not None:
            return Decision(back, blocked[0], f"{verdict.why}; {blocked[1]}")
        return Decision(back, Reason.REGRESSION, f"{verdict.why}: {change}")
    if pick is None:
        return Decision(
            hold, Reason.INSUFFICIENT_DATA, f"no busy traffic in the history; {_holding(current)}"
        )
    target, why = pick.steps, pick.why

    # 4. Does the policy really want a change, and has it wanted it long enough?
    if target == current:
        return Decision(target, Reason.WITHIN_TOLERANCE, f"{why}; {current} is live")
    change = _arrow(current, target)
    window_s = config.choose.stabilization_window_s
    held = _held_for(control.recommendations, target, now)
    if held < window_s:
        return Decision(
            target,
            Reason.STABILIZING,
            f"{why} for {_duration(held)} of the {_duration(window_s)} stabilization window: "
            f"{change} waits",
        )

    # 5. When a change may happen: window, dwell, budget.
    blocked = _change_blocks(config, at, now, control, restart_needs_s, change)
    if blocked is not None:
        return Decision(target, blocked[0], f"{why}; {blocked[1]}")
    return Decision(target, Reason.CHANGE, f"{why}: {change}")


def _change_blocks(
    config: Settings,
    at: datetime,
    now: float,
    control: Control,
    restart_needs_s: float,
    change: str,
) -> tuple[Reason, str] | None:
    """Why window, dwell or the restart budget forbid an automatic restart now, or None."""
    blocked = _window_blocks(config, at, restart_needs_s, change)
    if blocked is not None:
        return blocked
    if control.restart_times:
        since = now - max(control.restart_times)
        if since < config.restart.min_dwell_s:
            return Reason.DWELL_TIME, (
                f"last restart {_duration(max(since, 0.0))} ago < "
                f"{_duration(config.restart.min_dwell_s)} dwell: {change} waits"
            )
    used = sum(1 for t in control.restart_times if t > now - DAY_S)
    if used >= config.restart.daily_restart_budget:
        return Reason.RESTART_BUDGET, (
            f"{used} restarts in the last 24 h ≥ budget "
            f"{config.restart.daily_restart_budget}: "
            f"{change} waits"
        )
    return None
