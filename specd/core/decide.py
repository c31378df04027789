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
from typing import TYPE_CHECKING, Any

from specd.core import windows
from specd.core.choices import CHOOSES_KINDS
from specd.core.forecast import RHYTHM_SPREAD, unlike_other_days
from specd.core.model import Calibration, Plan, plan
from specd.core.observation import ScrapeError
from specd.core.setting import (
    SpecSetting,
    format_setting,
    off,
    runs_adaptive_config,
    setting_key,
)
from specd.core.text import duration_text as _duration
from specd.core.text import iso_time
from specd.core.units import DAY_S, WEEK_S

if TYPE_CHECKING:
    from specd.core.choices import Offer
    from specd.core.explore import Exploration
    from specd.core.history import History
    from specd.core.observation import Observation
    from specd.core.outcome import Avoided, ChangeSnapshot, Verdict
    from specd.core.override import Override
    from specd.core.settings import Band, Settings


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
    # A [fleet] is configured but no slot can be taken (etcd unreachable or answering
    # nonsense, or every slot of the group held): no restart outside the fleet's turn.
    FLEET_UNAVAILABLE = "fleet_unavailable"
    # A gateway is configured but could not drain this server: no restart without a drain.
    DRAIN_UNAVAILABLE = "drain_unavailable"
    # specd cannot save its state (a full or read-only /var/lib/specd): a restart goes out
    # only with its journal on disk, so none starts, not even a pin applied now.
    STATE_UNSAVED = "state_unsaved"
    # The target is a setting this server cannot run (its /server_info) or its unit cannot
    # be given (a drop-in of the step-variable form): an on-call pin of one. No restart.
    UNSUPPORTED = "unsupported"
    CHANGE = "change"
    # One epoch at a step count the evidence cannot judge, to measure it (specd.core.explore).
    EXPLORE = "explore"
    # Going back: the step count specd changed to served less than the one before it,
    # beyond noise (specd.core.outcome).
    REGRESSION = "regression"


# The only reasons under which the daemon applies a target.
ACTING_REASONS = frozenset({Reason.CHANGE, Reason.OVERRIDE_PIN, Reason.EXPLORE, Reason.REGRESSION})


@dataclass(frozen=True)
class Decision:
    """``target_steps``: what specd wants live (None when it cannot know). ``setting``: a
    target that is not a static step count (an operator's pin of "off", target_steps 0, or
    of an adaptive set, target_steps None)."""

    target_steps: int | None
    reason: Reason
    message: str
    setting: SpecSetting | None = None

    def acts(
        self, current: int | None, *, live_adaptive: bool = False, live_config: str | None = None
    ) -> bool:
        """True iff the daemon should apply the target now. ``current`` is the static step
        count live (0: no speculation; None under SGLang's adaptive mode, ``live_adaptive``,
        whose config file is ``live_config``)."""
        if self.reason not in ACTING_REASONS:
            return False
        if self.setting is not None and self.setting.kind == "adaptive":
            return not (live_adaptive and runs_adaptive_config(self.setting, live_config))
        return self.target_steps is not None and (self.target_steps != current or live_adaptive)

    @property
    def target_setting(self) -> SpecSetting | None:
        """What applying this decision runs (None when nothing is known to apply)."""
        if self.setting is not None:
            return self.setting
        if self.target_steps is None or self.target_steps < 1:
            return None
        return SpecSetting("static", steps=self.target_steps)

    @property
    def target_name(self) -> str | None:
        """`target_setting` as the operator writes it ("4", "off", "adaptive:3,4")."""
        wanted = self.target_setting
        return None if wanted is None else format_setting(wanted)


@dataclass(frozen=True)
class Control:
    """The part of specd's state that decide reads, carried from tick to tick by `step`."""

    current_steps: int | None
    # One time per SGLang restart specd made (a rollback's two), for dwell and the budget.
    restart_times: tuple[float, ...] = ()
    frozen: bool = False
    frozen_reason: str | None = None
    # (t, steps) the policy recommended at recent ticks, oldest first.
    recommendations: tuple[tuple[float, int], ...] = ()
    # SGLang runs its own adaptive mode (current_steps is then None), reading this config.
    live_adaptive: bool = False
    live_adaptive_config: str | None = None
    # (t, steps) of the explorations of the last week, oldest first (specd.core.explore).
    explorations: tuple[tuple[float, int], ...] = ()
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

    def with_exploration(self, t: float, steps: int) -> Control:
        """Note an exploration begun at ``t``; those older than a week no longer count."""
        kept = [(et, k) for et, k in self.explorations if et > t - WEEK_S]
        return replace(self, explorations=tuple(sorted([*kept, (t, steps)])))

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
    # The model policy's whole prediction (safe exploration and the outcome check read it);
    # None for bands.
    plan: Plan | None = None
    # Share of time the policy expects at each offered concurrency (model: the epoch's
    # forecast; bands: the history), for judging whether an outcome applies to it.
    mix: Mapping[int, float] = field(default_factory=dict)
    # A pick that is not a static K: off (steps 0) or an adaptive set (steps is then its
    # deepest candidate). ``predictions`` key off as 0; adaptive sets are keyed by their
    # operator form in ``setting_predictions``.
    setting: SpecSetting | None = None
    setting_predictions: Mapping[str, float] = field(default_factory=dict)
    setting_intervals: Mapping[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def key(self) -> int:
        """The pick as one int, for the stabilization window (`setting_key`)."""
        return self.steps if self.setting is None else setting_key(self.setting)

    @property
    def chosen(self) -> SpecSetting | None:
        """The pick when it is not a static K (off or adaptive), else None."""
        return self.setting if self.setting is not None and self.setting.kind != "static" else None


# -- policies -----------------------------------------------------------------------
# Given the concurrency mix the policy expects, the step counts it must skip, and why.
Avoid = Callable[[Mapping[int, float]], Mapping[int, str]]
# (history, config, current K, calibration, avoid) -> pick; a policy in `CHOOSES_KINDS`
# also takes ``offer`` and ``live_adaptive_config`` (see `choose`).
Policy = Callable[..., "Pick | None"]


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


def band_steps(history: History, config: Settings) -> int | None:
    """The step count the bands give the traffic in ``history`` (no hysteresis): where
    safe exploration starts without a calibration (`specd.core.explore`)."""
    pick = _pick_bands(history, config, None, None)
    return None if pick is None else pick.steps


def _pick_model(
    history: History,
    config: Settings,
    current: int | None,
    calibration: Calibration | None,
    avoid: Avoid | None = None,
    *,
    offer: Offer | None = None,
    live_adaptive_config: str | None = None,
) -> Pick | None:
    """The throughput model (specd.core.model), forecast over the coming epoch."""
    result = plan(
        history,
        config,
        current,
        calibration,
        avoid,
        offer=offer,
        live_adaptive_config=live_adaptive_config,
    )
    if result is None:
        return None
    setting = result.target_setting
    steps = {k: p for k, p in result.predictions.items() if k >= 0}
    sets = {format_setting(result.setting_of(k)): p for k, p in result.predictions.items() if k < 0}
    return Pick(
        setting.max_steps,
        result.why,
        {k: p.tok_s for k, p in steps.items()},
        {k: p.interval for k, p in steps.items()},
        plan=result,
        mix=result.forecast.weights,
        setting=None if setting.kind == "static" else setting,
        setting_predictions={text: p.tok_s for text, p in sets.items()},
        setting_intervals={text: p.interval for text, p in sets.items()},
    )


# Read-only: the core keeps no mutable module state.
POLICIES: Mapping[str, Policy] = MappingProxyType({"bands": _pick_bands, "model": _pick_model})


def choose(
    history: History,
    config: Settings,
    current: int | None = None,
    calibration: Calibration | None = None,
    avoid: Avoid | None = None,
    *,
    offer: Offer | None = None,
    live_adaptive_config: str | None = None,
) -> Pick | None:
    """The configured policy's pick (clamped to the allowed range); None without busy history.

    Without ``current`` this is the raw pick; with it, the policy's tolerance applies
    and the pick is ``current`` while the evidence for a change is within tolerance.
    ``avoid`` names the step counts the pick must not change to (`specd.core.outcome`).
    ``offer`` (`specd.core.choices`; None: static K in the allowed range) is what may be
    chosen, and under SGLang's adaptive mode (``current`` None) ``live_adaptive_config``
    names the config file it runs; only a policy in `CHOOSES_KINDS` reads them.
    """
    kinds: dict[str, Any] = (
        {"offer": offer, "live_adaptive_config": live_adaptive_config}
        if config.choose.policy in CHOOSES_KINDS
        else {}
    )
    pick = POLICIES[config.choose.policy](history, config, current, calibration, avoid, **kinds)
    if pick is not None and not pick.mix:
        pick = replace(pick, mix=history.offered_weights())
    return pick


# -- decide -------------------------------------------------------------------------
def _utc(now: float) -> datetime:
    return datetime.fromtimestamp(now, tz=timezone.utc)


def _stamp(at: datetime) -> str:
    """An override's expiry as `specd status` and `specd override show` write it (UTC)."""
    return iso_time(at.astimezone(timezone.utc))


def _window_stamp(config: Settings, at: datetime) -> str:
    """A window's opening on its own clock, as `specd status` and `specd doctor` write it
    (``2026-12-07T03:00:00+01:00`` for 03:00 in Europe/Berlin)."""
    return iso_time(windows.local_time(config.windows, at))


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


def _live(current: int | None) -> str:
    """The live setting as the operator writes it: a step count, or off (step count 0;
    "holding 0" read as a step count no server runs)."""
    return "?" if current is None else "off" if current == 0 else str(current)


def _holding(current: int | None) -> str:
    return f"holding {_live(current)}" if current is not None else "no change"


def _arrow(current: int | None, target: int | str, *, live_adaptive: bool = False) -> str:
    live = "adaptive" if live_adaptive else _live(current)
    return f"{live} → {target}"


def _window_message(config: Settings, at: datetime, change: str, restart_needs_s: float) -> str:
    try:
        opens = windows.next_open(config.windows, at)
    except ValueError as exc:
        return f"maintenance window closed ({exc}): {change} waits"
    nxt = f"next opens {_window_stamp(config, opens)}"
    # A next window too short for the restart is not when it goes out.
    usable = windows.holding_kept(tuple(config.windows), restart_needs_s, opens)
    if usable is None:
        nxt += ", and none ahead holds one restart"
    elif usable[0] != opens:
        nxt += f", too short for one restart: it goes out from {_window_stamp(config, usable[0])}"
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
        return Reason.WINDOW_CLOSED, _window_message(config, at, change, restart_needs_s)
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
    exploration: Exploration | None = None,
    verdict: Verdict | None = None,
    *,
    fleet_problem: str | None = None,
    gateway_problem: str | None = None,
    state_problem: str | None = None,
    cannot_run: Callable[[SpecSetting], str | None] | None = None,
) -> Decision:
    """What specd wants live and whether to apply it now, given the policy's ``pick`` for
    ``control.current_steps`` (`choose`); a restart outside a forced pin must fit in the
    open window with ``restart_needs_s`` to spare. ``exploration`` (`specd.core.explore`)
    is one to start when the policy holds, or the one whose epoch runs, during which the
    policy's changes wait. A ``verdict`` of regression (`specd.core.outcome`) goes back to
    the step count before the change, gated like a change but without waiting for the
    stabilization window. ``fleet_problem``: why no slot of the
    configured fleet can be taken this tick (None: one can, or no fleet is configured);
    ``gateway_problem``: why the configured gateway cannot drain this server this tick
    (None: it can, or none is configured); ``state_problem``: why specd's state could not
    be saved (None: it was). Each holds every restart, a pin applied now included; the
    state first (no etcd or gateway is asked for a restart that cannot go out), then the
    fleet. ``cannot_run`` says why the server or its unit
    cannot run a setting (`specd.core.choices.cannot_run`): a target it names is held
    before either (the policy only picks what can run; an on-call pin may name anything).
    See the module docstring."""
    decision = _decide(
        history, obs, config, override, now, control, pick, restart_needs_s, exploration, verdict
    )
    acts = decision.acts(
        control.current_steps,
        live_adaptive=control.live_adaptive,
        live_config=control.live_adaptive_config,
    )
    if not acts:
        return decision
    wanted = decision.target_setting
    assert wanted is not None
    unsupported = cannot_run(wanted) if cannot_run is not None else None
    if unsupported:
        return Decision(
            decision.target_steps,
            Reason.UNSUPPORTED,
            f"{decision.message}; not applied: {_one_line(unsupported)}",
            decision.setting,
        )
    if not (state_problem or fleet_problem or gateway_problem):
        return decision
    target = decision.target_steps if wanted.kind == "static" else format_setting(wanted)
    assert target is not None
    arrow = _arrow(control.current_steps, target, live_adaptive=control.live_adaptive)
    if state_problem:
        reason = Reason.STATE_UNSAVED
        why = (
            f"specd cannot save its state ({_one_line(state_problem)}), and a restart goes "
            "out only with its journal on disk"
        )
    elif fleet_problem:
        reason = Reason.FLEET_UNAVAILABLE
        why = f"no fleet slot can be taken ({_one_line(fleet_problem)})"
    else:
        assert gateway_problem is not None
        reason = Reason.DRAIN_UNAVAILABLE
        why = f"the gateway cannot drain this server ({_one_line(gateway_problem)})"
    return Decision(
        decision.target_steps,
        reason,
        f"{decision.message}; but {why}: {arrow} waits",
        decision.setting,
    )


# The restarts a pin applied now may make of its own in 24 h where the daily budget allows
# fewer (0 allows none automatic): its change, and one more try after a change that ended
# aborted (its start refused for the start limit, or not set up by systemd).
PIN_NOW_MIN_RESTARTS = 2


def pin_restarts_spent(pin: Override, control: Control, config: Settings, now: float) -> str | None:
    """Why a pin applied now makes no further restart, or None. It bypasses the window,
    dwell and daily budget, but a change that keeps ending aborted (not frozen: the target
    never ran) would otherwise restart SGLang at every tick: its own restarts since it was
    written count against a budget of their own, the daily one (at least
    ``PIN_NOW_MIN_RESTARTS``). Writing the pin again starts a new count."""
    if pin.decided_at is None:
        return None
    own = _restarts_in_day(control, now, since=pin.decided_at)
    allowed = max(config.restart.daily_restart_budget, PIN_NOW_MIN_RESTARTS)
    if own < allowed:
        return None
    return (
        f"it has made {own} restarts since it was written, ≥ {allowed} (the daily budget, at "
        f"least {PIN_NOW_MIN_RESTARTS}: a pin's own bound against restart loops); write the "
        "pin again (`specd override pin`) to try again"
    )


def _restarts_in_day(control: Control, now: float, since: float = -math.inf) -> int:
    """The SGLang restarts of the last 24 h (what the daily budget counts), those from
    ``since`` on only."""
    return sum(1 for t in control.restart_times if t > now - DAY_S and t >= since)


def _decide(
    history: History,
    obs: Observation | ScrapeError | None,
    config: Settings,
    override: Override | None,
    now: float,
    control: Control,
    pick: Pick | None,
    restart_needs_s: float,
    exploration: Exploration | None,
    verdict: Verdict | None,
) -> Decision:
    at = _utc(now)
    current = control.current_steps
    hold = None if current is None else clamp(current, config)
    active = override if override is not None and override.active(at) else None

    # 1. Frozen: after a failed restart (until an operator clears it) or by override.
    if control.frozen:
        # One line, whatever the state file holds: messages are log fields and STATUS=.
        why = _one_line(control.frozen_reason or "") or "a restart failed"
        return Decision(
            hold,
            Reason.FROZEN,
            f"frozen ({why}); {_holding(current)} until an operator runs "
            "`specd unfreeze --reason ...`",
        )
    if active is not None and active.mode == "freeze":
        until = f" until {_stamp(active.expires_at)}" if active.expires_at else ""
        return Decision(
            hold,
            Reason.FROZEN,
            f"override freeze{until} ({_one_line(active.reason)}); {_holding(current)} "
            "(`specd override clear` ends it sooner)",
        )

    # 2. An operator's pin. apply = "now" is the on-call's emergency lever, so it
    # bypasses the window, dwell and budget (but for its own restarts' bound,
    # `pin_restarts_spent`); a next-window pin waits for a window and
    # respects the daily budget (the guard against restart loops) but not the dwell,
    # which only exists to stop the automatic policy from flapping.
    if (
        active is not None
        and active.mode == "pin"
        and (active.steps is not None or active.setting is not None)
    ):
        adaptive_live = control.live_adaptive
        pinned = active.setting  # a pin that is not a static step count, or None
        pin: int | None
        label: int | str
        if pinned is None:
            assert active.steps is not None
            pin = clamp(active.steps, config)
            label = pin
            live = pin == current and not adaptive_live
        else:
            pin = 0 if pinned.kind == "off" else None
            label = format_setting(pinned)
            if pinned.kind == "adaptive":
                live = adaptive_live and runs_adaptive_config(pinned, control.live_adaptive_config)
            else:  # off: the reader reports 0 steps for a server without speculation
                live = current == 0 and not adaptive_live
        said = f"pinned to {label} by override ({_one_line(active.reason)})"
        arrow = _arrow(current, label, live_adaptive=adaptive_live)
        if live:
            return Decision(pin, Reason.OVERRIDE_PIN, f"{said}; already live", pinned)
        if active.apply == "now":
            looping = pin_restarts_spent(active, control, config, now)
            if looping is not None:
                waits = f"{said}, apply now: {arrow} waits: {looping}"
                return Decision(pin, Reason.RESTART_BUDGET, waits, pinned)
            return Decision(pin, Reason.OVERRIDE_PIN, f"{said}, apply now: {arrow}", pinned)
        blocked = _window_blocks(config, at, restart_needs_s, arrow)
        if blocked is not None:
            return Decision(pin, blocked[0], f"{said}; {blocked[1]}", pinned)
        used = _restarts_in_day(control, now)
        if used >= config.restart.daily_restart_budget:
            return Decision(
                pin,
                Reason.RESTART_BUDGET,
                f"{said}; {used} restarts in the last 24 h ≥ budget "
                f"{config.restart.daily_restart_budget}: {arrow} waits",
                pinned,
            )
        return Decision(pin, Reason.OVERRIDE_PIN, f"{said}: {arrow}", pinned)

    # 3. Data: an observation, fresh, and enough busy history behind it.
    if obs is None:
        return Decision(hold, Reason.NO_DATA, f"no observation of SGLang yet; {_holding(current)}")
    if isinstance(obs, ScrapeError):
        return Decision(
            hold,
            Reason.NO_DATA,
            f"scrape failed ({obs.kind}: {_one_line(obs.reason)}); {_holding(current)}",
        )
    if current is None and not control.live_adaptive:
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
    if verdict is not None and verdict.regressed and verdict.to_setting is not None:
        return _back_from_adaptive(config, at, now, control, restart_needs_s, pick, verdict)
    if verdict is not None and verdict.regressed and verdict.to_steps == current:
        before = clamp(verdict.from_steps, config)
        back: tuple[SpecSetting | None, int, str] = (None, before, "")
        if pick is not None and pick.key != current:
            # The policy, having seen the outcome too, leaves the regressed step count: its
            # pick (a K, off or an adaptive set), not necessarily the old K, serves the
            # coming epoch best.
            old_k = pick.chosen is None and pick.steps == before
            back = (pick.chosen, pick.steps, "" if old_k else " (the policy's pick)")
        if back[0] is not None or back[1] != current:
            return _going_back(
                config, at, now, control, restart_needs_s, verdict, back, str(current)
            )
    if pick is None:
        return Decision(
            hold, Reason.INSUFFICIENT_DATA, f"no busy traffic in the history; {_holding(current)}"
        )
    why = pick.why
    # A pick of off or of an adaptive set carries it as the decision's setting (adaptive:
    # no target step count); a static pick is its K, as it always was.
    chosen = pick.chosen
    target: int | None = None if chosen is not None and chosen.kind == "adaptive" else pick.steps
    shown: int | str = pick.steps if chosen is None else format_setting(chosen)

    # 4. Does the policy really want a change, and has it wanted it long enough?
    if chosen is not None and chosen.kind == "adaptive":
        live = control.live_adaptive and runs_adaptive_config(chosen, control.live_adaptive_config)
    else:
        live = target == current and not control.live_adaptive
    unseen = _unseen_epoch(pick, config)
    if live:
        if (
            exploration is not None
            and not exploration.ongoing
            and (current is not None or control.live_adaptive)
            and exploration.steps != current
        ):
            if unseen is not None:
                return Decision(
                    target,
                    Reason.WITHIN_TOLERANCE,
                    f"{why}; {shown} is live; {exploration.why}; but {unseen}: exploring waits",
                    chosen,
                )
            return _explore(
                history,
                config,
                at,
                now,
                control,
                restart_needs_s,
                why,
                exploration,
                (target, chosen),
            )
        return Decision(target, Reason.WITHIN_TOLERANCE, f"{why}; {shown} is live", chosen)
    change = _arrow(current, shown, live_adaptive=control.live_adaptive)
    if exploration is not None and exploration.ongoing:
        # One whole epoch at the explored step count: what it serves there is the point.
        return Decision(current, Reason.EXPLORE, f"{why}; {exploration.why}: {change} waits")
    if unseen is not None and (pick.plan is None or pick.plan.robust_regrets is None):
        # Missing data means no change: a restart bets the epoch on traffic never seen.
        # Unless the model chose the setting that loses least whichever of the hours seen
        # the unseen ones are like, and the live one is sure to lose more there.
        return Decision(hold, Reason.INSUFFICIENT_DATA, f"{why}; but {unseen}: {change} waits")
    window_s = config.choose.stabilization_window_s
    held = _held_for(control.recommendations, pick.key, now)
    if held < window_s:
        return Decision(
            target,
            Reason.STABILIZING,
            f"{why} for {_duration(held)} of the {_duration(window_s)} stabilization window: "
            f"{change} waits",
            chosen,
        )

    # 5. When a change may happen: window, dwell, budget.
    blocked = _change_blocks(config, at, now, control, restart_needs_s, change)
    if blocked is not None:
        return Decision(target, blocked[0], f"{why}; {blocked[1]}", chosen)
    return Decision(target, Reason.CHANGE, f"{why}: {change}", chosen)


def _unseen_epoch(pick: Pick, config: Settings) -> str | None:
    """Why the model's forecast of the coming epoch is too blind to act on, or None: too
    much of it from recent traffic alone (hours of the day not seen yet) while the hours
    that were seen differ from recent traffic (a daily rhythm, whose unseen hours recent
    traffic cannot tell). The bands forecast nothing."""
    if pick.plan is None:
        return None
    forecast = pick.plan.forecast
    allowed = 1.0 - config.choose.min_forecast_seen_ratio
    if forecast.recent_ratio <= allowed + 1e-9 or forecast.seen_spread < RHYTHM_SPREAD:
        return None
    return (
        f"{forecast.recent_ratio * 100:.0f}% of the epoch is forecast from recent traffic "
        f"alone (hours of the day not seen yet), more than the {allowed * 100:g}% "
        f"min_forecast_seen_ratio allows while the hours seen differ from it (total "
        f"variation {forecast.seen_spread:.2f} ≥ {RHYTHM_SPREAD:g}: a daily rhythm)"
    )


def _back_from_adaptive(
    config: Settings,
    at: datetime,
    now: float,
    control: Control,
    restart_needs_s: float,
    pick: Pick | None,
    verdict: Verdict,
) -> Decision:
    """Going back from a live adaptive set that regressed: to the policy's pick when it
    leaves the set (it is on the avoid list by now), else to the setting before it."""
    assert verdict.to_setting is not None
    by = ""
    if pick is not None and pick.key != verdict.to_steps:
        chosen, steps, by = pick.chosen, pick.steps, " (the policy's pick)"
    elif verdict.from_setting is not None:
        chosen, steps = verdict.from_setting, verdict.from_steps
    elif verdict.from_steps == 0:
        chosen, steps = off(), 0
    else:
        chosen, steps = None, clamp(verdict.from_steps, config)
    return _going_back(
        config,
        at,
        now,
        control,
        restart_needs_s,
        verdict,
        (chosen, steps, by),
        format_setting(verdict.to_setting),
    )


def _going_back(
    config: Settings,
    at: datetime,
    now: float,
    control: Control,
    restart_needs_s: float,
    verdict: Verdict,
    back: tuple[SpecSetting | None, int, str],
    regressed: str,
) -> Decision:
    """The decision going back from the ``regressed`` setting to ``back`` (its setting when
    not a static K, its step count, and " (the policy's pick)" or ""), unless a window,
    dwell or the restart budget hold it. In the window the change was made in the dwell
    does not hold it: the dwell stops the policy from flapping, and this is the change's
    own outcome, found while a restart may still undo it (else it runs a whole epoch);
    once per change, as the regressed setting is avoided from then on."""
    chosen, steps, by = back
    target = None if chosen is not None and chosen.kind == "adaptive" else steps
    shown = format_setting(chosen) if chosen is not None else str(steps)
    change = f"going back {regressed} → {shown}{by}"
    own = _in_own_window(config, at, verdict)
    if own:
        change += " in the window the change was made in"
    blocked = _change_blocks(config, at, now, control, restart_needs_s, change, dwell=not own)
    if blocked is not None:
        return Decision(target, blocked[0], f"{verdict.why}; {blocked[1]}", chosen)
    return Decision(target, Reason.REGRESSION, f"{verdict.why}: {change}", chosen)


def _in_own_window(config: Settings, at: datetime, verdict: Verdict) -> bool:
    """Whether the window open at ``at`` is the one the verified change was made in, and
    what it served there contradicts the prediction it was made on: the traffic of a
    window need not be its epoch's, which the prediction covers where it was kept."""
    if verdict.changed_at is None or not verdict.short_of_prediction:
        return False
    current = windows.current_window(config.windows, at)
    return current is not None and current[0].timestamp() <= verdict.changed_at


def _change_blocks(
    config: Settings,
    at: datetime,
    now: float,
    control: Control,
    restart_needs_s: float,
    change: str,
    *,
    dwell: bool = True,
) -> tuple[Reason, str] | None:
    """Why window, dwell (unless ``dwell`` is false) or the restart budget forbid an
    automatic restart now, or None."""
    blocked = _window_blocks(config, at, restart_needs_s, change)
    if blocked is not None:
        return blocked
    if dwell and control.restart_times:
        since = now - max(control.restart_times)
        if since < config.restart.min_dwell_s:
            return Reason.DWELL_TIME, (
                f"last restart {_duration(max(since, 0.0))} ago < "
                f"{_duration(config.restart.min_dwell_s)} dwell: {change} waits"
            )
    used = _restarts_in_day(control, now)
    if used >= config.restart.daily_restart_budget:
        return Reason.RESTART_BUDGET, (
            f"{used} restarts in the last 24 h ≥ budget "
            f"{config.restart.daily_restart_budget}: "
            f"{change} waits"
        )
    return None


def _explore(
    history: History,
    config: Settings,
    at: datetime,
    now: float,
    control: Control,
    restart_needs_s: float,
    why: str,
    exploration: Exploration,
    held: tuple[int | None, SpecSetting | None],
) -> Decision:
    """The policy holds the live setting (``held``: its target and setting, as a decision
    carries them) and `specd.core.explore` proposes one epoch at a step count: gated like
    a change, but a blocked exploration is no pending change — the policy is content, so
    the decision stays within tolerance and says what waits. An exploration bets its epoch
    on the forecast: it waits, too, on a day unlike the days the forecast reads (read only
    once nothing else holds it: a tick's cost)."""
    current = control.current_steps
    live: int | str = "?" if current is None else current
    if held[1] is not None and held[1].kind == "adaptive":
        live = format_setting(held[1])
    change = f"exploring {live} → {exploration.steps}"
    blocked = _change_blocks(config, at, now, control, restart_needs_s, change)
    waits = None if blocked is None else blocked[1]
    if waits is None:
        unlike = unlike_other_days(history, now)
        waits = None if unlike is None else f"but {unlike}: {change} waits"
    if waits is not None:
        return Decision(
            held[0],
            Reason.WITHIN_TOLERANCE,
            f"{why}; {live} is live; {exploration.why}; {waits}",
            held[1],
        )
    return Decision(
        exploration.steps,
        Reason.EXPLORE,
        f"{why}; {exploration.why}: {change} for one epoch",
    )
