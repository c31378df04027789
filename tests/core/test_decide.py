from __future__ import annotations

import functools
import typing
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from factories import make_observation, tables
from hypothesis import given, settings
from hypothesis import strategies as st

from specd.core import windows
from specd.core.choices import cannot_run
from specd.core.decide import (
    ACTING_REASONS,
    POLICIES,
    Control,
    Decision,
    Pick,
    Reason,
    choose,
    decide,
)
from specd.core.explore import Exploration
from specd.core.forecast import Forecast
from specd.core.history import History, HistorySettings
from specd.core.model import Plan
from specd.core.observation import Observation, ScrapeError
from specd.core.outcome import Verdict
from specd.core.override import Override
from specd.core.setting import (
    ServerTraits,
    SpecSetting,
    adaptive,
    adaptive_config_name,
    format_setting,
    off,
    traits_from_server_info,
)
from specd.core.settings import ChooseSettings, Settings

UTC = timezone.utc
# The default window opens daily at 03:00 UTC for an hour.
OPEN = datetime(2026, 1, 5, 3, 30, tzinfo=UTC).timestamp()
CLOSED = datetime(2026, 1, 5, 12, 0, tzinfo=UTC).timestamp()
HOUR = 3600.0
DAY = 86400.0


def config(**kwargs: Any) -> Settings:
    base: dict[str, Any] = {"min_history_s": 600, "stabilization_window_s": 600}
    return Settings.model_validate(tables(**{**base, **kwargs}))


def observation(t: float, running: int = 1, steps: int | None = 4) -> Observation:
    return make_observation(
        t, running=running, steps=steps, accept_length=2.5, max_running_requests=13
    )


@functools.cache
def history(offered: int = 20, busy_s: float = 1200.0, end: float = OPEN) -> History:
    """``busy_s`` seconds at ``offered`` concurrency, the last observation at ``end``."""
    h = History(HistorySettings(half_life_s=1e9, warmup_exclude_s=0, scrape_interval_s=5))
    n = int(busy_s // 5)
    for i in range(n):
        h.record(observation(end - 5 * (n - 1 - i), running=offered))
    return h


def pin(steps: int, apply: str = "next-window", expires: float = OPEN + DAY) -> Override:
    return Override(
        mode="pin",
        steps=steps,
        expires_at=datetime.fromtimestamp(expires, tz=UTC),
        reason="eval tonight",
        apply=apply,  # type: ignore[arg-type]
    )


def pin_now_decided(at: float) -> Override:
    """A pin applied now, written at ``at`` (as read from its file)."""
    return replace(pin(2, "now"), decided_at=at)


def pin_setting(
    setting: SpecSetting, apply: str = "next-window", expires: float = OPEN + DAY
) -> Override:
    return Override(
        mode="pin",
        steps=None,
        expires_at=datetime.fromtimestamp(expires, tz=UTC),
        reason="try it",
        apply=apply,  # type: ignore[arg-type]
        setting=setting,
    )


ADAPTIVE_34 = adaptive((3, 4))
ADAPTIVE_34_FILE = f"/var/lib/specd/{adaptive_config_name(ADAPTIVE_34)}"


def live_adaptive(config_file: str | None = ADAPTIVE_34_FILE, **kwargs: Any) -> Control:
    """SGLang runs its adaptive mode (the brain then sees no static step count)."""
    return control(current=None, live_adaptive=True, live_adaptive_config=config_file, **kwargs)


def freeze(expires: float = OPEN + DAY) -> Override:
    return Override(
        mode="freeze",
        steps=None,
        expires_at=datetime.fromtimestamp(expires, tz=UTC),
        reason="incident 42",
        apply="next-window",
    )


def held(steps: int, now: float, for_s: float = 600.0) -> tuple[tuple[float, int], ...]:
    """Recommendations of ``steps`` every 5 s over the last ``for_s`` seconds."""
    return tuple((now - for_s + 5 * i, steps) for i in range(int(for_s // 5) + 1))


def control(current: int | None = 4, now: float = OPEN, **kwargs: Any) -> Control:
    fields: dict[str, Any] = {"recommendations": held(3, now)}
    fields.update(kwargs)
    return Control(current_steps=current, **fields)


NO_OBS = object()  # "use a fresh observation at now"


def case(
    name: str,
    reason: Reason,
    target: int | None,
    acts: bool,
    says: str,
    *,
    now: float = OPEN,
    hist: History | None = None,
    obs: Any = NO_OBS,
    override: Override | None = None,
    ctl: Control | None = None,
    cfg: Settings | None = None,
) -> Any:
    return pytest.param(
        now,
        hist if hist is not None else history(),
        obs,
        override,
        ctl if ctl is not None else control(now=now),
        cfg if cfg is not None else config(),
        reason,
        target,
        acts,
        says,
        id=name,
    )


BUDGET_USED = (OPEN - 5 * HOUR, OPEN - 4 * HOUR, OPEN - 3 * HOUR, OPEN - 2 * HOUR)
CASES = [
    # Frozen beats everything, even a pin that says now.
    case("frozen", Reason.FROZEN, 4, False,
         "frozen (rb); holding 4 until an operator runs `specd unfreeze --reason ...`",
         override=pin(2, "now"), ctl=control(frozen=True, frozen_reason="rb")),
    case("freeze-override", Reason.FROZEN, 4, False,
         "override freeze until 2026-01-06T03:30:00+00:00 (incident 42); holding 4 "
         "(`specd override clear` ends it sooner)", override=freeze()),
    case("frozen-unknown-steps", Reason.FROZEN, None, False, "no change",
         obs=None, ctl=control(current=None, frozen=True)),
    # Off is step count 0: said as the operator writes it ("holding 0" read as a count).
    case("frozen-off", Reason.FROZEN, 1, False,
         "frozen (rb); holding off until an operator runs `specd unfreeze --reason ...`",
         ctl=control(current=0, frozen=True, frozen_reason="rb")),
    case("freeze-expired", Reason.CHANGE, 3, True, "4 → 3", override=freeze(expires=OPEN - 1)),
    case("frozen-clamped", Reason.FROZEN, 6, False, "holding 9",
         ctl=control(current=9, frozen=True)),
    # Pins.
    case("pin-now-window-closed", Reason.OVERRIDE_PIN, 2, True, "apply now: 4 → 2",
         now=CLOSED, override=pin(2, "now")),
    case("pin-in-window-ignores-dwell-and-data", Reason.OVERRIDE_PIN, 2, True,
         "pinned to 2 by override (eval tonight): 4 → 2",
         obs=None, override=pin(2), ctl=control(restart_times=(OPEN - 60,))),
    case("pin-waits-for-window", Reason.WINDOW_CLOSED, 2, False,
         "next opens 2026-01-06T03:00:00+00:00", now=CLOSED, override=pin(2)),
    case("pin-within-budget", Reason.RESTART_BUDGET, 2, False,
         "4 restarts in the last 24 h ≥ budget 4",
         override=pin(2), ctl=control(restart_times=BUDGET_USED)),
    case("pin-live", Reason.OVERRIDE_PIN, 4, False, "already live", override=pin(4)),
    case("pin-clamped", Reason.OVERRIDE_PIN, 6, True, "pinned to 6", override=pin(9, "now")),
    # A pin applied now bypasses the budget, but its own restarts since it was written have
    # one of their own (the daily budget, at least 2): a change that keeps ending aborted
    # (never ran: not frozen) restarted SGLang at every tick.
    case("pin-now-own-restarts-spent", Reason.RESTART_BUDGET, 2, False,
         "apply now: 4 → 2 waits: it has made 4 restarts since it was written, ≥ 4 (the daily "
         "budget, at least 2: a pin's own bound against restart loops); write the pin again",
         now=CLOSED, override=pin_now_decided(CLOSED - 3 * HOUR),
         ctl=control(now=CLOSED, restart_times=tuple(CLOSED - m * 600 for m in (15, 10, 5, 1)))),
    case("pin-now-restarts-before-it-count-not", Reason.OVERRIDE_PIN, 2, True,
         "apply now: 4 → 2", override=pin_now_decided(OPEN - HOUR),
         ctl=control(restart_times=BUDGET_USED)),
    case("pin-now-restarts-a-day-old-count-not", Reason.OVERRIDE_PIN, 2, True,
         "apply now: 4 → 2", override=pin_now_decided(OPEN - 3 * DAY),
         ctl=control(restart_times=tuple(t - DAY for t in BUDGET_USED))),
    case("pin-now-at-budget-0-may-try-again", Reason.OVERRIDE_PIN, 2, True,
         "apply now: 4 → 2", override=pin_now_decided(OPEN - 3 * HOUR),
         ctl=control(restart_times=(OPEN - HOUR,)), cfg=config(daily_restart_budget=0)),
    case("pin-now-at-budget-0-twice", Reason.RESTART_BUDGET, 2, False,
         "it has made 2 restarts since it was written, ≥ 2",
         override=pin_now_decided(OPEN - 3 * HOUR),
         ctl=control(restart_times=(OPEN - 2 * HOUR, OPEN - HOUR)),
         cfg=config(daily_restart_budget=0)),
    case("pin-expired", Reason.CHANGE, 3, True, "4 → 3", override=pin(2, expires=OPEN)),
    # Pins of settings that are not a static step count (off is target 0).
    case("pin-off", Reason.OVERRIDE_PIN, 0, True, "pinned to off by override (try it): 4 → off",
         override=pin_setting(off())),
    case("pin-off-live", Reason.OVERRIDE_PIN, 0, False, "pinned to off by override (try it); "
         "already live", override=pin_setting(off()), ctl=control(current=0)),
    case("pin-off-waits", Reason.WINDOW_CLOSED, 0, False, "4 → off waits",
         now=CLOSED, override=pin_setting(off())),
    case("pin-adaptive", Reason.OVERRIDE_PIN, None, True, "pinned to adaptive:3,4 by override "
         "(try it): 4 → adaptive:3,4", override=pin_setting(ADAPTIVE_34)),
    case("pin-adaptive-now", Reason.OVERRIDE_PIN, None, True, "apply now: 4 → adaptive:3,4",
         now=CLOSED, override=pin_setting(ADAPTIVE_34, "now")),
    case("pin-adaptive-budget", Reason.RESTART_BUDGET, None, False, "≥ budget 4",
         override=pin_setting(ADAPTIVE_34), ctl=control(restart_times=BUDGET_USED)),
    case("pin-adaptive-live", Reason.OVERRIDE_PIN, None, False, "already live",
         override=pin_setting(ADAPTIVE_34), ctl=live_adaptive()),
    # Adaptive, but with another candidate set (another content-addressed file) or none.
    case("pin-adaptive-other-set", Reason.OVERRIDE_PIN, None, True,
         "adaptive → adaptive:3,4", override=pin_setting(ADAPTIVE_34),
         ctl=live_adaptive(f"/var/lib/specd/{adaptive_config_name(adaptive((1, 3)))}")),
    case("pin-adaptive-no-config", Reason.OVERRIDE_PIN, None, True, "adaptive → adaptive:3,4",
         override=pin_setting(ADAPTIVE_34), ctl=live_adaptive(None)),
    case("pin-static-over-adaptive", Reason.OVERRIDE_PIN, 4, True, "adaptive → 4",
         override=pin(4), ctl=live_adaptive()),
    case("pin-off-over-adaptive", Reason.OVERRIDE_PIN, 0, True, "adaptive → off",
         override=pin_setting(off()), ctl=live_adaptive()),
    # Without a pin, specd's own choice replaces adaptive mode at a window: it is a change.
    case("auto-after-adaptive", Reason.CHANGE, 3, True, "adaptive → 3", ctl=live_adaptive()),
    case("auto-after-adaptive-waits", Reason.WINDOW_CLOSED, 3, False, "adaptive → 3 waits",
         now=CLOSED, hist=history(end=CLOSED), ctl=live_adaptive(now=CLOSED)),
    # Data.
    case("no-observation", Reason.NO_DATA, 4, False, "no observation of SGLang yet; holding 4",
         obs=None),
    case("scrape-error", Reason.NO_DATA, 4, False, "scrape failed (timeout: GET /metrics",
         obs=ScrapeError("timeout", "GET /metrics: timed out", OPEN)),
    case("unknown-steps", Reason.NO_DATA, None, False, "current step count is unknown",
         ctl=control(current=None)),
    case("stale", Reason.STALE_DATA, 4, False, "61 s old (> 60 s)", obs=observation(OPEN - 61)),
    case("from-the-future", Reason.STALE_DATA, 4, False, "in the future",
         obs=observation(OPEN + 61)),
    case("just-fresh", Reason.CHANGE, 3, True, "4 → 3", obs=observation(OPEN - 60)),
    case("short-history", Reason.INSUFFICIENT_DATA, 4, False,
         "9.9 min of busy history < 10.0 min needed", hist=history(busy_s=595)),
    case("just-enough-history", Reason.CHANGE, 3, True, "4 → 3", hist=history(busy_s=605)),
    case("never-busy", Reason.INSUFFICIENT_DATA, 4, False, "no busy traffic",
         hist=history(offered=0), cfg=config(min_history_s=0)),
    # The policy.
    case("same-band", Reason.WITHIN_TOLERANCE, 4, False,
         "p50 offered concurrency 2 ≤ 4 (band 1 → 4 steps)", hist=history(offered=2)),
    case("hysteresis", Reason.WITHIN_TOLERANCE, 3, False, "within 5% of the band boundary 4",
         hist=history(offered=4), ctl=control(current=3)),
    case("back-to-light", Reason.CHANGE, 4, True,
         "p50 offered concurrency 3 ≤ 4 (band 1 → 4 steps): 3 → 4",
         hist=history(offered=3), ctl=control(current=3, recommendations=held(4, OPEN))),
    case("stabilizing", Reason.STABILIZING, 3, False,
         "for 9.9 min of the 10.0 min stabilization window: 4 → 3 waits",
         ctl=control(recommendations=held(3, OPEN, 595))),
    case("stabilizing-from-nothing", Reason.STABILIZING, 3, False, "for 0 s",
         ctl=control(recommendations=())),
    case("stabilizing-interrupted", Reason.STABILIZING, 3, False, "for 3.3 min",
         ctl=control(recommendations=((OPEN - 900, 3), (OPEN - 300, 4), (OPEN - 200, 3)))),
    case("no-stabilization-window", Reason.CHANGE, 3, True, "4 → 3",
         ctl=control(recommendations=()), cfg=config(stabilization_window_s=0)),
    # When.
    case("window-closed", Reason.WINDOW_CLOSED, 3, False,
         "maintenance window closed (next opens 2026-01-06T03:00:00+00:00)",
         now=CLOSED, hist=history(end=CLOSED)),
    case("dwell", Reason.DWELL_TIME, 3, False, "last restart 60.0 min ago < 60.0 min dwell",
         ctl=control(restart_times=(OPEN - HOUR + 1,))),
    case("restart-in-the-future", Reason.DWELL_TIME, 3, False, "last restart 0 s ago",
         ctl=control(restart_times=(OPEN + 600,))),
    case("dwell-over", Reason.CHANGE, 3, True, "4 → 3", ctl=control(restart_times=(OPEN - HOUR,))),
    case("budget", Reason.RESTART_BUDGET, 3, False, "4 restarts in the last 24 h ≥ budget 4",
         ctl=control(restart_times=BUDGET_USED)),
    case("budget-rolls-over", Reason.CHANGE, 3, True,
         "p50 offered concurrency 20 > 4 (band 2 → 3 steps): 4 → 3",
         ctl=control(restart_times=(OPEN - DAY, *BUDGET_USED[1:]))),
    case("no-budget", Reason.RESTART_BUDGET, 3, False, "0 restarts in the last 24 h ≥ budget 0",
         cfg=config(daily_restart_budget=0)),
]  # fmt: skip


@pytest.mark.parametrize(
    ("now", "hist", "obs", "override", "ctl", "cfg", "reason", "target", "acts", "says"), CASES
)
def test_each_reason(
    now: float,
    hist: History,
    obs: Any,
    override: Override | None,
    ctl: Control,
    cfg: Settings,
    reason: Reason,
    target: int | None,
    acts: bool,
    says: str,
) -> None:
    if obs is NO_OBS:
        obs = observation(now, steps=ctl.current_steps)
    decision = decide(hist, obs, cfg, override, now, ctl, choose(hist, cfg, ctl.current_steps))
    assert decision.reason is reason, decision.message
    assert decision.target_steps == target
    pinned = override.setting if override is not None and override.active(now) else None
    assert decision.setting == (pinned if decision.reason is not Reason.CHANGE else None)
    acted = decision.acts(
        ctl.current_steps, live_adaptive=ctl.live_adaptive, live_config=ctl.live_adaptive_config
    )
    assert acted is acts
    assert says in decision.message
    assert "\n" not in decision.message


def _at(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


@pytest.mark.parametrize(
    ("needs_s", "says"),
    [
        (30.0, "next opens 2026-01-06T00:00:00+00:00): "),
        # A minute at midnight holds no restart: it goes out at 02:00 (it named midnight,
        # and the pin expired waiting there).
        (
            190.0,
            "next opens 2026-01-06T00:00:00+00:00, too short for one restart: it goes out "
            "from 2026-01-06T02:00:00+00:00): ",
        ),
        (7200.0, "next opens 2026-01-06T00:00:00+00:00, and none ahead holds one restart): "),
    ],
)
def test_a_closed_window_names_when_a_restart_can_go_out(needs_s: float, says: str) -> None:
    t = _at("2026-01-05T23:38:00+00:00")
    short_then_long = [
        {"cron": "0 0 * * *", "duration_s": 60, "timezone": "UTC"},
        {"cron": "0 2 * * *", "duration_s": 3600, "timezone": "UTC"},
    ]
    cfg = config(windows=short_then_long)
    hist = history(end=t)
    ctl = control(now=t)
    pinned = pin(2, expires=t + 30 * DAY)
    decision = decide(hist, observation(t), cfg, pinned, t, ctl, None, needs_s)
    assert decision.reason is Reason.WINDOW_CLOSED, decision.message
    assert says in decision.message, decision.message


@pytest.mark.parametrize(
    ("window", "now", "opens"),
    [
        # 03:00 in Berlin's winter is 02:00Z: the cron's 03:00 is what the operator reads.
        ("0 3 * * *;Europe/Berlin", "2026-12-06T12:00:00+00:00", "2026-12-07T03:00:00+01:00"),
        ("0 3 * * *;Europe/Berlin", "2026-07-01T12:00:00+00:00", "2026-07-02T03:00:00+02:00"),
        # Spring forward: 02:30 does not exist that night; it opens at the jump.
        ("30 2 * * *;Europe/Berlin", "2026-03-28T12:00:00+00:00", "2026-03-29T03:00:00+02:00"),
        # Fall back: the first 02:30, told from the second by its offset alone.
        ("30 2 * * *;Europe/Berlin", "2026-10-24T12:00:00+00:00", "2026-10-25T02:30:00+02:00"),
        ("0 22 * * fri;America/New_York", "2026-01-05T12:00:00+00:00", "2026-01-09T22:00:00-05:00"),
        ("0 3 * * *;UTC", "2026-01-05T12:00:00+00:00", "2026-01-06T03:00:00+00:00"),
    ],
)
@pytest.mark.parametrize("pinned", [False, True], ids=["auto", "pin"])
def test_a_closed_window_is_named_on_its_own_clock_as_status_names_it(
    window: str, now: str, opens: str, pinned: bool
) -> None:
    """The decision said `next opens 2026-12-07T02:00Z` for a 03:00 Berlin window, while
    `specd status` and `specd doctor` said 2026-12-07T03:00:00+01:00 on the line below."""
    cron, zone = window.split(";")
    t = _at(now)
    cfg = config(windows=[{"cron": cron, "duration_s": 3600, "timezone": zone}])
    hist = history(end=t)
    ctl = control(now=t)
    decision = decide(
        hist,
        observation(t),
        cfg,
        pin(2, expires=t + 30 * DAY) if pinned else None,
        t,
        ctl,
        choose(hist, cfg, ctl.current_steps),
    )
    assert decision.reason is Reason.WINDOW_CLOSED, decision.message
    assert f"maintenance window closed (next opens {opens}): " in decision.message
    # The text `specd status` prints for it (specd.commands.status: next_window_open_at).
    at = windows.next_open(cfg.windows, datetime.fromtimestamp(t, tz=UTC))
    assert windows.local_time(cfg.windows, at).isoformat(timespec="seconds") == opens


@pytest.mark.parametrize(
    ("expires", "says"),
    [
        ("2026-01-05T14:00:00+00:00", "override freeze until 2026-01-05T14:00:00+00:00 ("),
        # Given with another offset in the file: said in UTC, to the second, as status says it.
        ("2026-01-05T15:00:30+01:00", "override freeze until 2026-01-05T14:00:30+00:00 ("),
    ],
)
def test_a_freezes_expiry_is_said_as_status_and_override_show_say_it(
    expires: str, says: str
) -> None:
    freeze_ = Override("freeze", None, datetime.fromisoformat(expires), "incident 42", "now")
    ctl = control(now=CLOSED)
    decision = decide(history(), observation(CLOSED), config(), freeze_, CLOSED, ctl, None)
    assert decision.reason is Reason.FROZEN
    assert says in decision.message


@pytest.mark.parametrize(
    ("offered", "current", "bands", "tolerance", "expected", "why"),
    [
        (4, 4, None, 0.05, 4, "≤ 4 (band 1 → 4 steps)"),
        (5, 4, None, 0.05, 3, "> 4 (band 2 → 3 steps)"),
        (5, 4, None, 0.3, 4, "within 30% of the band boundary 4: keeping band 1 (4 steps)"),
        (6, 4, None, 0.3, 3, "> 4"),
        (4, 3, None, 0.05, 3, "within 5% of the band boundary 4: keeping band 2 (3 steps)"),
        (3, 3, None, 0.05, 4, "≤ 4"),
        (2, 5, None, 0.05, 4, "band 1"),  # a step count in no band: no hysteresis
        (5, None, None, 0.05, 3, "band 2"),
        # Three bands; the middle one is live.
        (2, 4, [(2.5, 5), (8, 4), (None, 3)], 0.25, 4, "boundary 2.5: keeping band 2"),
        (1, 4, [(2.5, 5), (8, 4), (None, 3)], 0.25, 5, "≤ 2.5 (band 1 → 5 steps)"),
        (9, 4, [(2.5, 5), (8, 4), (None, 3)], 0.25, 4, "boundary 8: keeping band 2"),
        (11, 4, [(2.5, 5), (8, 4), (None, 3)], 0.25, 3, "> 8 (band 3 → 3 steps)"),
        (5, 4, [(2.5, 5), (8, 4), (None, 3)], 0.25, 4, "in (2.5, 8] (band 2 → 4 steps)"),
    ],
)
def test_band_hysteresis(
    offered: int,
    current: int | None,
    bands: list[tuple[float | None, int]] | None,
    tolerance: float,
    expected: int,
    why: str,
) -> None:
    kwargs: dict[str, Any] = {"tolerance_ratio": tolerance}
    if bands is not None:
        kwargs["bands"] = tuple(
            {"steps": s} if m is None else {"max_concurrency": m, "steps": s} for m, s in bands
        )
    cfg = Settings.model_validate(tables(**kwargs))
    picked = choose(history(offered=offered), cfg, current)
    assert picked is not None
    assert picked.steps == expected
    assert why in picked.why


@pytest.mark.parametrize(
    ("ratio", "expected"),
    [(0.5, 4), (0.75, 4), (0.9, 3)],
)
def test_the_band_quantile_is_configurable(ratio: float, expected: int) -> None:
    h = History(HistorySettings(half_life_s=1e9, warmup_exclude_s=0, scrape_interval_s=5))
    for i, offered in enumerate([1] * 160 + [30] * 40):  # 80% light, 20% heavy
        h.record(observation(OPEN - 1000 + 5 * i, running=offered))
    picked = choose(h, Settings.model_validate(tables(band_quantile_ratio=ratio)))
    assert picked is not None
    assert picked.steps == expected
    assert f"p{ratio * 100:g} offered concurrency" in picked.why


def test_recommend_without_busy_history_is_none() -> None:
    assert choose(History(), Settings()) is None
    assert choose(history(offered=0), Settings()) is None


def test_every_configurable_policy_has_an_implementation() -> None:
    # The config's Literal is the set of policies: one without code cannot be configured.
    assert set(POLICIES) == set(typing.get_args(ChooseSettings.model_fields["policy"].annotation))


@pytest.mark.parametrize(
    ("decision", "current", "acts"),
    [
        (Decision(3, Reason.CHANGE, ""), 4, True),
        (Decision(3, Reason.CHANGE, ""), 3, False),
        (Decision(3, Reason.CHANGE, ""), None, True),
        (Decision(None, Reason.CHANGE, ""), 4, False),
        (Decision(2, Reason.OVERRIDE_PIN, ""), 4, True),
        *[(Decision(3, r, ""), 4, False) for r in Reason if r not in ACTING_REASONS],
    ],
)
def test_acts(decision: Decision, current: int | None, acts: bool) -> None:
    assert decision.acts(current) is acts


A34 = adaptive((3, 4))


@pytest.mark.parametrize(
    ("decision", "current", "live_adaptive", "live_config", "acts"),
    [
        # A static target replaces adaptive mode whatever tier it runs.
        (Decision(3, Reason.CHANGE, ""), None, True, None, True),
        (Decision(3, Reason.CHANGE, ""), 3, True, None, True),
        (Decision(0, Reason.OVERRIDE_PIN, "", off()), 0, False, None, False),
        (Decision(0, Reason.OVERRIDE_PIN, "", off()), 4, False, None, True),
        (Decision(0, Reason.OVERRIDE_PIN, "", off()), None, True, None, True),
        (Decision(None, Reason.OVERRIDE_PIN, "", A34), 4, False, None, True),
        (Decision(None, Reason.OVERRIDE_PIN, "", A34), None, True, None, True),
        (
            Decision(None, Reason.OVERRIDE_PIN, "", A34),
            None,
            True,
            f"/var/lib/specd/{adaptive_config_name(A34)}",
            False,
        ),
        (
            Decision(None, Reason.OVERRIDE_PIN, "", A34),
            None,
            True,
            f"/var/lib/specd/{adaptive_config_name(adaptive((3, 5)))}",
            True,
        ),
        (Decision(None, Reason.WINDOW_CLOSED, "", A34), 4, False, None, False),
    ],
)
def test_acts_with_settings(
    decision: Decision,
    current: int | None,
    live_adaptive: bool,
    live_config: str | None,
    acts: bool,
) -> None:
    assert decision.acts(current, live_adaptive=live_adaptive, live_config=live_config) is acts


@pytest.mark.parametrize(
    ("decision", "expected"),
    [
        (Decision(3, Reason.CHANGE, ""), "3"),
        (Decision(0, Reason.OVERRIDE_PIN, "", off()), "off"),
        (Decision(None, Reason.OVERRIDE_PIN, "", A34), "adaptive:3,4"),
        (Decision(None, Reason.NO_DATA, ""), None),
        (Decision(0, Reason.NO_DATA, ""), None),
    ],
)
def test_target_setting(decision: Decision, expected: str | None) -> None:
    got = decision.target_setting
    assert (None if got is None else format_setting(got)) == expected


def test_reasons_are_the_agreed_metric_labels() -> None:
    assert {r.value for r in Reason} == {
        "no_data",
        "insufficient_data",
        "stale_data",
        "within_tolerance",
        "stabilizing",
        "dwell_time",
        "restart_budget",
        "window_closed",
        "window_ending",
        "override_pin",
        "frozen",
        "fleet_unavailable",
        "change",
        "drain_unavailable",
        "state_unsaved",
        "explore",
        "regression",
        "unsupported",
    }


GATEWAY_DOWN = "gateway http://127.0.0.1:9: GET /workers: ConnectError"


@pytest.mark.parametrize(
    ("override", "ctl", "reason", "target"),
    [
        # The policy's change, a next-window pin and a pin applied now all wait for a drain.
        (None, control(), Reason.DRAIN_UNAVAILABLE, 3),
        (pin(2), control(), Reason.DRAIN_UNAVAILABLE, 2),
        (pin(2, apply="now"), control(), Reason.DRAIN_UNAVAILABLE, 2),
        # Nothing to restart for: the reason is what it would have been.
        (pin(4), control(), Reason.OVERRIDE_PIN, 4),
        (None, control(restart_times=(OPEN - 60,)), Reason.DWELL_TIME, 3),
        (freeze(), control(), Reason.FROZEN, 4),
    ],
)
def test_a_gateway_problem_holds_every_restart(
    override: Override | None, ctl: Control, reason: Reason, target: int
) -> None:
    hist, cfg = history(), config()
    pick = choose(hist, cfg, ctl.current_steps)
    args = (hist, observation(OPEN), cfg, override, OPEN, ctl, pick, 0.0)
    decision = decide(*args, gateway_problem=GATEWAY_DOWN)
    assert decision.reason is reason, decision.message
    assert decision.target_steps == target
    assert not decision.acts(ctl.current_steps)
    if reason is Reason.DRAIN_UNAVAILABLE:
        assert GATEWAY_DOWN in decision.message
        assert decide(*args).acts(ctl.current_steps)  # without the problem it would act
    assert "\n" not in decision.message


# -- properties (hypothesis) ------------------------------------------------------------
CONFIGS = [
    config(),
    config(min_steps=2, max_steps=4, daily_restart_budget=1, min_dwell_s=0),
    config(
        min_steps=3,
        max_steps=5,
        bands=(
            {"max_concurrency": 2, "steps": 5},
            {"max_concurrency": 8, "steps": 4},
            {"steps": 3},
        ),
        windows=({"cron": "30 2 * * mon-fri", "duration_s": 5400, "timezone": "Europe/Berlin"},),
        stabilization_window_s=0,
        min_history_s=0,
        min_dwell_s=0,
    ),
    config(daily_restart_budget=0, stabilization_window_s=0, min_dwell_s=0),
]
# Monday 2026-01-05 00:00 UTC plus up to a week: windows open and closed.
WEEK_START = datetime(2026, 1, 5, tzinfo=UTC).timestamp()
HISTORIES = [
    History(),
    history(busy_s=100),
    history(offered=1),
    history(offered=3),
    history(offered=6),
    history(),
    history(offered=40),
]


def mostly(
    usual: st.SearchStrategy[Any], unusual: st.SearchStrategy[Any]
) -> st.SearchStrategy[Any]:
    """``usual`` about seven times in eight, so that every branch of decide gets reached.

    (``one_of`` would not do: it folds identical branches into one.)
    """
    return st.sampled_from([False] * 7 + [True]).flatmap(lambda odd: unusual if odd else usual)


@st.composite
def situations(draw: st.DrawFn) -> dict[str, Any]:
    day = draw(st.integers(0, 6))
    # Mostly around the windows (01:30–04:00 UTC), sometimes anywhere in the day.
    hour = draw(mostly(st.floats(1.5, 4.0), st.floats(0.0, 24.0)))
    now = WEEK_START + day * DAY + hour * HOUR
    current = draw(mostly(st.integers(1, 6), st.one_of(st.none(), st.integers(0, 20))))
    obs = draw(
        mostly(
            st.builds(observation, t=st.just(now), steps=st.just(current)),
            st.one_of(
                st.none(),
                st.builds(
                    ScrapeError,
                    kind=st.sampled_from(["timeout", "refused", "malformed", "missing"]),
                    reason=st.text(max_size=30),
                    t=st.just(now),
                ),
                st.builds(observation, t=st.floats(now - 90, now + 90), steps=st.just(current)),
            ),
        )
    )
    override = draw(
        mostly(
            st.none(),
            st.builds(
                Override,
                mode=st.sampled_from(["auto", "pin", "freeze"]),
                steps=st.one_of(st.none(), st.integers(0, 20)),
                expires_at=st.one_of(
                    st.none(),
                    st.floats(-DAY, DAY).map(lambda d: datetime.fromtimestamp(now + d, tz=UTC)),
                ),
                reason=st.text(max_size=20),
                apply=st.sampled_from(["next-window", "now"]),
                setting=mostly(
                    st.none(), st.sampled_from([off(), adaptive((3, 4)), adaptive((1, 3, 5))])
                ),
            ),
        )
    )
    hist = draw(st.sampled_from(HISTORIES))
    cfg = draw(st.sampled_from(CONFIGS))
    # Mostly the policy's own pick held for a while, as the daemon would have noted it.
    pick = choose(hist, cfg)
    steps = draw(mostly(st.just(pick.steps if pick else 4), st.integers(1, 8)))
    since = draw(st.floats(0, 2000))
    recent = draw(st.lists(st.tuples(st.floats(now - 2000, now), st.integers(0, 20)), max_size=4))
    run = [(now - since + 5 * i, steps) for i in range(int(since // 5) + 1)]
    ctl = Control(
        current_steps=current,
        restart_times=tuple(
            draw(mostly(st.just([]), st.lists(st.floats(now - 3 * DAY, now + 600), max_size=6)))
        ),
        frozen=draw(mostly(st.just(False), st.just(True))),
        frozen_reason=draw(st.one_of(st.none(), st.text(max_size=20))),
        recommendations=tuple(sorted(draw(mostly(st.just(run), st.just(recent + run))))),
    )
    if current is None and draw(mostly(st.just(False), st.just(True))):
        ctl = replace(
            ctl,
            live_adaptive=True,
            live_adaptive_config=draw(st.sampled_from([None, ADAPTIVE_34_FILE, "/x/y.json"])),
        )
    return {
        "history": hist,
        "obs": obs,
        "config": cfg,
        "override": override,
        "now": now,
        "control": ctl,
    }


def _pin_now(s: dict[str, Any]) -> bool:
    o = s["override"]
    at = datetime.fromtimestamp(s["now"], tz=UTC)
    return o is not None and o.mode == "pin" and o.apply == "now" and o.active(at)


def _acts(decision: Decision, s: dict[str, Any]) -> bool:
    ctl = s["control"]
    return decision.acts(
        ctl.current_steps, live_adaptive=ctl.live_adaptive, live_config=ctl.live_adaptive_config
    )


def _decide(s: dict[str, Any], gateway_problem: str | None = None) -> Decision:
    pick = choose(s["history"], s["config"], s["control"].current_steps)
    return decide(
        s["history"],
        s["obs"],
        s["config"],
        s["override"],
        s["now"],
        s["control"],
        pick,
        0.0,
        gateway_problem=gateway_problem,
    )


PROPERTY = settings(max_examples=100, deadline=None)


@PROPERTY
@given(situations())
def test_target_is_always_in_the_allowed_range(s: dict[str, Any]) -> None:
    decision = _decide(s)
    cfg = s["config"]
    if decision.setting is not None:  # only an operator's pin names a setting
        assert decision.reason is not Reason.CHANGE
        assert decision.target_steps == (0 if decision.setting.kind == "off" else None)
    else:
        assert (
            decision.target_steps is None
            or cfg.choose.min_steps <= decision.target_steps <= cfg.choose.max_steps
        )
    assert decision.message
    assert "\n" not in decision.message


@PROPERTY
@given(situations())
def test_never_acts_outside_a_window_unless_a_pin_says_now(s: dict[str, Any]) -> None:
    decision = _decide(s)
    at = datetime.fromtimestamp(s["now"], tz=UTC)
    if _acts(decision, s) and not windows.is_open(s["config"].windows, at):
        assert _pin_now(s)
        assert decision.reason is Reason.OVERRIDE_PIN


@PROPERTY
@given(situations())
def test_never_acts_beyond_the_restart_budget_unless_a_pin_says_now(s: dict[str, Any]) -> None:
    decision = _decide(s)
    now = s["now"]
    used = sum(1 for t in s["control"].restart_times if t > now - DAY)
    if used >= s["config"].restart.daily_restart_budget:
        assert not _acts(decision, s) or _pin_now(s)


@PROPERTY
@given(situations())
def test_never_restarts_while_the_gateway_cannot_drain(s: dict[str, Any]) -> None:
    decision = _decide(s, "gateway http://10.0.0.2:30080: GET /workers: HTTP 503")
    assert not decision.acts(s["control"].current_steps)
    if _decide(s).acts(s["control"].current_steps):
        assert decision.reason is Reason.DRAIN_UNAVAILABLE


@PROPERTY
@given(situations())
def test_a_freeze_holds_whatever_the_input(s: dict[str, Any]) -> None:
    s["control"] = Control(
        current_steps=s["control"].current_steps,
        restart_times=s["control"].restart_times,
        frozen=True,
        frozen_reason="restart to 5 failed",
        recommendations=s["control"].recommendations,
    )
    decision = _decide(s)
    assert decision.reason is Reason.FROZEN
    assert not _acts(decision, s)
    current = s["control"].current_steps
    if (
        current is not None
        and s["config"].choose.min_steps <= current <= s["config"].choose.max_steps
    ):
        assert decision.target_steps == current


@PROPERTY
@given(situations(), st.sampled_from(["none", "error", "stale"]))
def test_missing_or_stale_data_never_acts_without_a_pin(s: dict[str, Any], kind: str) -> None:
    now = s["now"]
    s["obs"] = {
        "none": None,
        "error": ScrapeError("refused", "connection refused", now),
        "stale": observation(
            now - s["config"].observe.stale_after_s - 1, steps=s["control"].current_steps
        ),
    }[kind]
    o = s["override"]
    if o is not None and o.mode == "pin":
        s["override"] = None
    decision = _decide(s)
    assert not _acts(decision, s)
    assert decision.reason in (Reason.FROZEN, Reason.NO_DATA, Reason.STALE_DATA)


@PROPERTY
@given(situations())
def test_a_change_respects_dwell_stabilization_and_window(s: dict[str, Any]) -> None:
    decision = _decide(s)
    if decision.reason is not Reason.CHANGE:
        return
    cfg, now, ctl = s["config"], s["now"], s["control"]
    assert decision.acts(ctl.current_steps)
    assert windows.is_open(cfg.windows, datetime.fromtimestamp(now, tz=UTC))
    assert all(now - t >= cfg.restart.min_dwell_s for t in ctl.restart_times)
    assert s["history"].busy_seconds >= cfg.observe.min_history_s
    if cfg.choose.stabilization_window_s > 0:
        start = now - cfg.choose.stabilization_window_s
        assert any(t <= start for t, _ in ctl.recommendations)
        assert all(k == decision.target_steps for t, k in ctl.recommendations if t >= start)


def test_decide_is_pure() -> None:
    pick = choose(history(), config(), 4)
    args = (history(), observation(OPEN), config(), pin(2), OPEN, control(), pick)
    assert decide(*args) == decide(*args)
    assert decide(*args) == decide(*args[:4], OPEN, control(), pick)
    assert OPEN + timedelta(0).total_seconds() == OPEN


# -- a fleet without a free slot -----------------------------------------------------
FLEET_DOWN = "etcd http://127.0.0.1:9 POST /v3/kv/range: cannot connect: refused"
SLOTS_BUSY = "all 1 slot(s) of fleet group g busy: slot 0 held by box-b sglang.service"


@pytest.mark.parametrize("problem", [FLEET_DOWN, SLOTS_BUSY])
@pytest.mark.parametrize(
    ("override", "ctl", "reason", "target"),
    [
        # The policy's change, a next-window pin and a pin applied now all wait for a slot.
        (None, control(), Reason.FLEET_UNAVAILABLE, 3),
        (pin(2), control(), Reason.FLEET_UNAVAILABLE, 2),
        (pin(2, apply="now"), control(), Reason.FLEET_UNAVAILABLE, 2),
        # Nothing to restart for: the reason is what it would have been.
        (pin(4), control(), Reason.OVERRIDE_PIN, 4),
        (None, control(restart_times=(OPEN - 60,)), Reason.DWELL_TIME, 3),
        (freeze(), control(), Reason.FROZEN, 4),
    ],
)
def test_a_fleet_problem_holds_every_restart(
    problem: str, override: Override | None, ctl: Control, reason: Reason, target: int
) -> None:
    hist, cfg = history(), config()
    pick = choose(hist, cfg, ctl.current_steps)
    args = (hist, observation(OPEN), cfg, override, OPEN, ctl, pick, 0.0)
    decision = decide(*args, fleet_problem=problem + "\nsecond line")
    assert decision.reason is reason, decision.message
    assert decision.target_steps == target
    assert not decision.acts(ctl.current_steps)
    if reason is Reason.FLEET_UNAVAILABLE:
        assert f"no fleet slot can be taken ({problem} second line)" in decision.message
        assert decide(*args).acts(ctl.current_steps)  # without the problem it would act
    assert "\n" not in decision.message


DISK_FULL = "cannot write /var/lib/specd: [Errno 28] No space left on device"


@pytest.mark.parametrize(
    ("override", "ctl", "reason", "target"),
    [
        # The policy's change, a next-window pin and a pin applied now all wait for a save.
        (None, control(), Reason.STATE_UNSAVED, 3),
        (pin(2), control(), Reason.STATE_UNSAVED, 2),
        (pin(2, apply="now"), control(), Reason.STATE_UNSAVED, 2),
        # Nothing to restart for: the reason is what it would have been.
        (pin(4), control(), Reason.OVERRIDE_PIN, 4),
        (None, control(restart_times=(OPEN - 60,)), Reason.DWELL_TIME, 3),
        (freeze(), control(), Reason.FROZEN, 4),
    ],
)
def test_a_state_that_cannot_be_saved_holds_every_restart_first(
    override: Override | None, ctl: Control, reason: Reason, target: int
) -> None:
    hist, cfg = history(), config()
    pick = choose(hist, cfg, ctl.current_steps)
    args = (hist, observation(OPEN), cfg, override, OPEN, ctl, pick, 0.0)
    # Said before the fleet or the gateway: neither is asked for a restart that cannot go out.
    decision = decide(
        *args,
        state_problem=DISK_FULL + "\nsecond line",
        fleet_problem=SLOTS_BUSY,
        gateway_problem=GATEWAY_DOWN,
    )
    assert decision.reason is reason, decision.message
    assert decision.target_steps == target
    assert not decision.acts(ctl.current_steps)
    if reason is Reason.STATE_UNSAVED:
        assert f"specd cannot save its state ({DISK_FULL} second line)" in decision.message
        assert decision.message.endswith(" waits"), decision.message
        assert decide(*args).acts(ctl.current_steps)  # without the problem it would act
    assert "\n" not in decision.message


WIRED = "sglang.service's ExecStart= reads ${SPECULATIVE_NUM_STEPS}, not $SPECD_SPECULATIVE_ARGS"
SERVER = traits_from_server_info(
    {"speculative_algorithm": "NEXTN", "speculative_eagle_topk": 1, "version": "0.5.23"}
)


@pytest.mark.parametrize(
    ("override", "traits", "static_only", "reason", "why"),
    [
        # (the pin, the server's traits, the unit's wiring, the reason, what the message says)
        (pin_setting(off()), SERVER, WIRED, Reason.UNSUPPORTED, WIRED),
        (pin_setting(adaptive((1, 3)), apply="now"), SERVER, WIRED, Reason.UNSUPPORTED, WIRED),
        (pin_setting(adaptive((1, 3))), replace(SERVER, version=(0, 5, 11)), None,
         Reason.UNSUPPORTED, "needs SGLang >= 0.5.13"),
        (pin(2), replace(SERVER, algorithm=None), None, Reason.UNSUPPORTED,
         "no speculative algorithm"),
        # What can run is applied: a static K on a unit of the step variables, anything on a
        # server whose /server_info was not read yet (the applier's checks still stand).
        (pin(2), SERVER, WIRED, Reason.OVERRIDE_PIN, None),
        (pin_setting(off()), SERVER, None, Reason.OVERRIDE_PIN, None),
        (pin_setting(adaptive((1, 3))), None, None, Reason.OVERRIDE_PIN, None),
    ],
)  # fmt: skip
def test_a_pin_of_what_cannot_run_here_is_held_and_says_why(
    override: Override,
    traits: ServerTraits | None,
    static_only: str | None,
    reason: Reason,
    why: str | None,
) -> None:
    hist, cfg, ctl = history(), config(), control()
    pick = choose(hist, cfg, ctl.current_steps)
    args = (hist, observation(OPEN), cfg, override, OPEN, ctl, pick, 0.0)
    check = functools.partial(cannot_run, traits, static_only)
    decision = decide(*args, cannot_run=check)
    assert decision.reason is reason, decision.message
    assert decision.acts(ctl.current_steps) == (why is None)
    assert decide(*args).acts(ctl.current_steps)  # unchecked, it would restart
    if why is not None:
        assert "; not applied: " in decision.message
        assert why in decision.message.split("; not applied: ", 1)[1]
        assert decision.target_setting == decide(*args).target_setting  # what was asked
        # Held before the fleet or the gateway is even asked about.
        both = decide(*args, cannot_run=check, fleet_problem=SLOTS_BUSY)
        assert both.reason is Reason.UNSUPPORTED


@PROPERTY
@given(situations(), st.sampled_from(["fleet", "state"]))
def test_never_restarts_without_a_fleet_slot_or_its_state_saved(
    s: dict[str, Any], missing: str
) -> None:
    pick = choose(s["history"], s["config"], s["control"].current_steps)
    args = (s["history"], s["obs"], s["config"], s["override"], s["now"], s["control"], pick)
    if missing == "fleet":
        decision, reason = decide(*args, fleet_problem=SLOTS_BUSY), Reason.FLEET_UNAVAILABLE
    else:
        decision, reason = decide(*args, state_problem=DISK_FULL), Reason.STATE_UNSAVED
    assert not decision.acts(s["control"].current_steps)
    if decide(*args).acts(s["control"].current_steps):
        assert decision.reason is reason


def model_pick(
    steps: int, recent_ratio: float, spread: float = 0.9, robust: dict[int, float] | None = None
) -> Pick:
    """A model policy's pick of ``steps`` on a forecast ``recent_ratio`` of which comes from
    recent traffic alone (hours of the day never seen), while the hours seen are ``spread``
    (total variation) from recent traffic; with ``robust``, picked as the setting whose
    worst case across the hours seen loses least (`model._robust`)."""
    forecast = Forecast(OPEN, OPEN + DAY, {20: 1.0}, "recent", 0.0, recent_ratio, spread)
    plan = Plan(
        OPEN, OPEN + DAY, forecast, {}, steps, steps, 0.1, f"model: {steps} best",
        robust_regrets=robust,
    )  # fmt: skip
    return Pick(steps, f"model: {steps} best", plan=plan)


def regressed(from_steps: int, to_steps: int) -> Verdict:
    return Verdict(
        from_steps, to_steps, 7200.0, 900.0, 1000.0, 20.0, True, True,
        f"outcome of {from_steps} → {to_steps}: regression", ((20, 1.0),),
    )  # fmt: skip


UNSEEN = "87% of the epoch is forecast from recent traffic alone"
SEEN_GATE = [
    # (id, pick: (steps, recent ratio, spread of the hours seen), min_forecast_seen_ratio,
    #  exploration, verdict, reason, target, acts, message part)
    ("mostly-unseen-holds", (3, 0.87, 0.9), 0.5, None, None, Reason.INSUFFICIENT_DATA, 4,
     False, f"{UNSEEN} (hours of the day not seen yet), more than the 50% "
     "min_forecast_seen_ratio allows while the hours seen differ from it (total variation "
     "0.90 ≥ 0.5: a daily rhythm): 4 → 3 waits"),
    # Steady so far: recent traffic stands in for the hours not seen.
    ("mostly-unseen-but-steady", (3, 0.87, 0.2), 0.5, None, None, Reason.CHANGE, 3, True,
     "4 → 3"),
    ("just-a-rhythm", (3, 0.87, 0.5), 0.5, None, None, Reason.INSUFFICIENT_DATA, 4, False,
     "total variation 0.50"),
    ("half-seen-changes", (3, 0.5, 0.9), 0.5, None, None, Reason.CHANGE, 3, True, "4 → 3"),
    # Unless the model picked the setting that loses least whichever hour seen the unseen
    # ones are like: then the change goes on (exploring still waits, below).
    ("mostly-unseen-robust-changes", (3, 0.87, 0.9, {3: 0.01, 4: 0.16}), 0.5, None, None,
     Reason.CHANGE, 3, True, "4 → 3"),
    ("robust-exploration-waits", (4, 0.87, 0.9, {3: 0.1, 4: 0.0}), 0.5,
     Exploration(5, "5 is never observed"), None, Reason.WITHIN_TOLERANCE, 4, False,
     f"5 is never observed; but {UNSEEN}"),
    ("all-seen-changes", (3, 0.0, 0.0), 1.0, None, None, Reason.CHANGE, 3, True, "4 → 3"),
    ("one-hour-unseen-with-all-required", (3, 1 / 24, 0.9), 1.0, None, None,
     Reason.INSUFFICIENT_DATA, 4, False, "more than the 0% min_forecast_seen_ratio allows"),
    ("check-off", (3, 1.0, 1.0), 0.0, None, None, Reason.CHANGE, 3, True, "4 → 3"),
    # The live one is the pick: nothing to hold, the epoch unseen or not.
    ("live-within-tolerance", (4, 1.0, 0.9), 0.5, None, None, Reason.WITHIN_TOLERANCE, 4, False,
     "4 is live"),
    ("exploration-waits", (4, 0.87, 0.9), 0.5, Exploration(5, "5 is never observed"), None,
     Reason.WITHIN_TOLERANCE, 4, False, f"5 is never observed; but {UNSEEN}"),
    ("exploration-seen", (4, 0.2, 0.9), 0.5, Exploration(5, "5 is never observed"), None,
     Reason.EXPLORE, 5, True, "exploring 4 → 5 for one epoch"),
    # Going back from a change that served less is never held: the old one was measured.
    ("regression-goes-back", (4, 1.0, 0.9), 0.5, None, regressed(3, 4), Reason.REGRESSION, 3, True,
     "going back 4 → 3"),
]  # fmt: skip


@functools.cache
def after_a_day(tonight: int) -> History:
    """Sunday at 6 concurrent requests, then Monday until OPEN (03:30) at ``tonight``."""
    h = History(HistorySettings(half_life_s=1e9, warmup_exclude_s=0, scrape_interval_s=60))
    start = OPEN - 3.5 * HOUR - DAY
    for i in range(int((OPEN - start) // 60)):
        t = start + 60 * i
        h.record(observation(t, running=6 if t < OPEN - 3.5 * HOUR else tonight))
    return h


@pytest.mark.parametrize(
    ("tonight", "reason", "says"),
    [
        (6, Reason.EXPLORE, "exploring 4 → 5 for one epoch"),
        # A sixth of Sunday's load: the forecast, read from Sunday, may not hold today.
        (1, Reason.WITHIN_TOLERANCE, "5 is never observed; but the last 3 h carried 1.0 "
         "requests on average against 6.0 in the same hours on other days (×0.17): a day "
         "unlike those the forecast reads: exploring 4 → 5 waits"),
    ],
)  # fmt: skip
def test_no_exploration_on_a_day_unlike_the_days_the_forecast_reads(
    tonight: int, reason: Reason, says: str
) -> None:
    ctl = control(recommendations=held(4, OPEN))
    decision = decide(
        after_a_day(tonight), observation(OPEN), config(), None, OPEN, ctl,
        model_pick(4, 0.0, 0.0), 0.0, Exploration(5, "5 is never observed"), None,
    )  # fmt: skip
    assert decision.reason is reason, decision.message
    assert says in decision.message, decision.message
    assert decision.acts(4) is (reason is Reason.EXPLORE)


GOING_BACK = [
    # (id, the policy's pick after 3 → 4 regressed, target, setting, how the message ends)
    ("the-regressed-k-itself", Pick(4, "4"), 3, None, "going back 4 → 3"),
    ("the-old-k", Pick(3, "3"), 3, None, "going back 4 → 3"),
    ("another-k", Pick(2, "2"), 2, None, "going back 4 → 2 (the policy's pick)"),
    ("off", Pick(0, "off", setting=off()), 0, off(), "going back 4 → off (the policy's pick)"),
    ("an-adaptive-set", Pick(4, "the set", setting=adaptive((3, 4))), None, adaptive((3, 4)),
     "going back 4 → adaptive:3,4 (the policy's pick)"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("pick", "target", "setting", "says"), [pytest.param(*g[1:], id=g[0]) for g in GOING_BACK]
)
def test_going_back_from_a_regressed_k_goes_to_the_policys_pick_of_any_kind(
    pick: Pick, target: int | None, setting: SpecSetting | None, says: str
) -> None:
    """The policy has seen the outcome too: where it leaves the regressed K, its pick (a K,
    off or an adaptive set) serves the coming epoch best, not necessarily the old K."""
    ctl = control(recommendations=held(4, OPEN))
    decision = decide(
        history(), observation(OPEN), config(), None, OPEN, ctl, pick, 0.0, None, regressed(3, 4)
    )
    assert decision.reason is Reason.REGRESSION, decision.message
    assert (decision.target_steps, decision.setting) == (target, setting), decision.message
    assert decision.message.endswith(f"regression: {says}"), decision.message
    assert decision.acts(4)


OWN = " in the window the change was made in"
IN_ITS_WINDOW = [
    # (id, when 3 → 4 was made, restart times, settings, reason, message part). The window
    # opens daily at 03:00 for an hour; now is 03:30, the dwell an hour.
    ("its-window-dwell-does-not-hold", OPEN - 1200, (OPEN - 1200,), {}, Reason.REGRESSION,
     f"going back 4 → 3{OWN}"),
    ("made-at-the-opening", OPEN - 1800, (OPEN - 1800,), {}, Reason.REGRESSION, OWN),
    # A change of an earlier window: the dwell holds as for any change.
    ("yesterdays-window", OPEN - DAY, (OPEN - 1800,), {}, Reason.DWELL_TIME,
     "last restart 30.0 min ago < 60.0 min dwell: going back 4 → 3 waits"),
    ("made-before-this-window-opened", OPEN - 1801, (OPEN - 1801,), {}, Reason.DWELL_TIME,
     "< 60.0 min dwell"),
    # A verdict from a state file older than the change time: no exemption.
    ("change-time-unknown", None, (OPEN - 1800,), {}, Reason.DWELL_TIME, "< 60.0 min dwell"),
    # Not predicted at the traffic seen (the bands, or a snapshot an older specd wrote):
    # nothing says the window's traffic tells the epoch's; the next window decides.
    ("no-prediction-there", OPEN - 1200, (OPEN - 1200,), {"short_of_prediction": None},
     Reason.DWELL_TIME, "< 60.0 min dwell"),
    # The budget and the window still hold it.
    ("budget-spent", OPEN - 1800, (OPEN - 1800, OPEN - 7200), {"daily_restart_budget": 2},
     Reason.RESTART_BUDGET, f"2 restarts in the last 24 h ≥ budget 2: going back 4 → 3{OWN}"),
    ("window-ending", OPEN - 1800, (OPEN - 1800,), {"restart_needs_s": 1900},
     Reason.WINDOW_ENDING, "maintenance window closes in 30.0 min"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("changed_at", "restarts", "settings", "reason", "says"),
    [pytest.param(*g[1:], id=g[0]) for g in IN_ITS_WINDOW],
)
def test_a_regression_goes_back_in_its_own_window_despite_the_dwell(
    changed_at: float | None,
    restarts: tuple[float, ...],
    settings: dict[str, Any],
    reason: Reason,
    says: str,
) -> None:
    """A change found to serve less than the old setting and than its prediction at the
    traffic seen, while the window it was made in is open, goes back in that window rather
    than running the whole epoch: the dwell, there to stop flapping, does not hold the
    change's own outcome; the window and the daily budget do."""
    needs = settings.pop("restart_needs_s", 0.0)
    short = settings.pop("short_of_prediction", True)
    ctl = control(recommendations=held(4, OPEN), restart_times=restarts)
    verdict = replace(regressed(3, 4), changed_at=changed_at, short_of_prediction=short)
    decision = decide(
        history(), observation(OPEN), config(**settings), None, OPEN, ctl, Pick(3, "3"), needs,
        None, verdict,
    )  # fmt: skip
    assert decision.reason is reason, decision.message
    assert says in decision.message, decision.message
    assert decision.acts(4) is (reason is Reason.REGRESSION)
    if reason is Reason.REGRESSION:
        assert decision.target_steps == 3


@pytest.mark.parametrize(
    ("picked", "seen_ratio", "exploration", "verdict", "reason", "target", "acts", "says"),
    [pytest.param(*g[1:], id=g[0]) for g in SEEN_GATE],
)
def test_no_change_on_a_forecast_of_hours_never_seen(
    picked: tuple[int, float, float] | tuple[int, float, float, dict[int, float]],
    seen_ratio: float,
    exploration: Exploration | None,
    verdict: Verdict | None,
    reason: Reason,
    target: int,
    acts: bool,
    says: str,
) -> None:
    hist, cfg = history(), config(min_forecast_seen_ratio=seen_ratio)
    steps = picked[0]
    ctl = control(recommendations=held(steps, OPEN))
    decision = decide(
        hist, observation(OPEN), cfg, None, OPEN, ctl, model_pick(*picked), 0.0,
        exploration, verdict,
    )  # fmt: skip
    assert decision.reason is reason, decision.message
    assert decision.target_steps == target
    assert decision.acts(4) is acts
    assert says in decision.message, decision.message
