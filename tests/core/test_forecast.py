from __future__ import annotations

import math
from collections.abc import Callable
from datetime import datetime, timezone

import pytest
from factories import make_observation

from specd.core.forecast import Forecast, forecast_epoch, score, unlike_other_days
from specd.core.history import History, HistorySettings, is_weekend_hour
from specd.core.observation import Observation

UTC = timezone.utc
MONDAY = datetime(2026, 1, 5, tzinfo=UTC).timestamp()  # 00:00 UTC
HOUR = 3600.0
DAY = 86400.0


def observation(t: float, offered: int) -> Observation:
    return make_observation(
        t, running=offered, spec_fresh=False, steps=3, max_running_requests=64, version="test"
    )


def record(history: History, start: float, end: float, offered: Callable[[float], int]) -> None:
    """One observation a minute (scrape interval 60 s) from start to end."""
    t = start
    while t < end:
        history.record(observation(t, offered(t)))
        t += 60


def new_history() -> History:
    return History(HistorySettings(scrape_interval_s=60, warmup_exclude_s=0))


def office(t: float) -> int:
    """Weekdays 09–17 at 20 concurrent, 2 otherwise; weekends 1."""
    day, hour = int((t - MONDAY) // DAY) % 7, ((t - MONDAY) % DAY) / HOUR
    if day >= 5:
        return 1
    return 20 if 9 <= hour < 17 else 2


def forecast_after(days: float, start_hour: int, hours: int) -> Forecast:
    """The forecast of ``hours`` hours from ``start_hour`` (counted from MONDAY 00:00) after
    ``days`` days of office traffic from MONDAY."""
    history = new_history()
    record(history, MONDAY, MONDAY + days * DAY, office)
    start = MONDAY + start_hour * HOUR
    forecast = forecast_epoch(history, start, start + hours * HOUR)
    assert forecast is not None
    return forecast


@pytest.mark.parametrize(
    ("days_of_history", "start_hour", "hours", "source", "mean"),
    [
        # A week and a half: next Tuesday 09–17 has its own hours from last Tuesday.
        (8.5, 8 * 24 + 9, 8, "same hours", 20.0),
        # Two days: Wednesday 09–17 borrows the same hours of Monday and Tuesday.
        (2.0, 2 * 24 + 9, 8, "same hours, other days", 20.0),
        # Weekends apart, but a first Saturday after weekdays only has the same hours of
        # the day on any day: a daily rhythm seen beats none.
        (5.0, 5 * 24 + 9, 8, "same hours, any day", 20.0),
        # Half a day: the afternoon was never seen at any hour of the day, only recently.
        (0.5, 14, 8, "recent", None),
        # A week of history: Saturday's hours are known.
        (7.0, 12 * 24 + 9, 8, "same hours", 1.0),
    ],
)
def test_the_epoch_is_forecast_from_the_same_hours(
    days_of_history: float, start_hour: int, hours: int, source: str, mean: float | None
) -> None:
    forecast = forecast_after(days_of_history, start_hour, hours)
    assert forecast.source == source
    assert sum(forecast.weights.values()) == pytest.approx(1.0)
    if mean is not None:
        assert forecast.mean() == pytest.approx(mean, abs=0.01)
    else:
        # Recent history mixes office hours and evenings: neither 1 nor 20.
        assert 2.0 < forecast.mean() < 20.0


@pytest.mark.parametrize(
    ("hours_of_history", "start_hour", "hours", "recent_ratio", "spread"),
    [
        # A fresh start at midnight, three hours in: of the next 24 h only 00–03 of the
        # following day were seen (same hours, other days); the rest is recent traffic,
        # whose hours all looked alike so far.
        (3, 3, 24, 21 / 24, 0.0),
        # A whole day seen: every hour of the next day has its own hour of the day.
        (24, 24, 24, 0.0, 0.0),
        # Half of the coming 8 h seen (08–12 of the day before), half not (12–16); the
        # hours seen were 2 until 09:00 and 20 after, recent traffic 3/4 at 2: an hour at
        # 20 is 0.75 from it (a little less: recent traffic decays, its 20s weigh more).
        (12, 24 + 8, 8, 0.5, 0.75),
    ],
)
def test_recent_ratio_is_the_share_of_the_epoch_never_seen_at_its_hour_of_the_day(
    hours_of_history: int, start_hour: int, hours: int, recent_ratio: float, spread: float
) -> None:
    forecast = forecast_after(hours_of_history / 24, start_hour, hours)
    assert forecast.recent_ratio == pytest.approx(recent_ratio)
    assert forecast.seen_spread == pytest.approx(spread, abs=0.05)
    assert ("recent" in forecast.source) is (recent_ratio > 0)


def test_an_epoch_spanning_day_and_night_weighs_hours_by_their_share() -> None:
    # Next Tuesday 13:00 → 21:00: 4 office hours at 20, 4 evening hours at 2.
    forecast = forecast_after(8, 8 * 24 + 13, 8)
    assert forecast.weights == pytest.approx({20: 0.5, 2: 0.5})
    assert forecast.quantile(0.25) == 2.0
    assert forecast.quantile(0.75) == 20.0
    assert forecast.busy_ratio() == pytest.approx(1.0)
    assert forecast.same_hours_ratio == pytest.approx(1.0)


def test_a_long_epoch_forecasts_its_first_week() -> None:
    history = new_history()
    record(history, MONDAY, MONDAY + 7 * DAY, office)
    start = MONDAY + 7 * DAY
    two_weeks = forecast_epoch(history, start, start + 14 * DAY)
    one_week = forecast_epoch(history, start, start + 7 * DAY)
    assert two_weeks is not None
    assert one_week is not None
    assert two_weeks.weights == pytest.approx(one_week.weights)


@pytest.mark.parametrize(("start", "end"), [(math.nan, 0.0), (0.0, math.inf)])
def test_nonsense_epochs_give_no_forecast(start: float, end: float) -> None:
    history = new_history()
    record(history, MONDAY, MONDAY + DAY, office)
    assert forecast_epoch(history, start, end) is None


def test_an_empty_history_gives_no_forecast() -> None:
    assert forecast_epoch(new_history(), MONDAY, MONDAY + DAY) is None


@pytest.mark.parametrize(
    ("how", "weekend"), [(0, False), (5 * 24 - 1, False), (5 * 24, True), (167, True), (168, False)]
)
def test_weekend_hours(how: int, weekend: bool) -> None:
    assert is_weekend_hour(how) is weekend


@pytest.mark.parametrize(
    ("predicted", "actual", "error", "tv"),
    [
        ({2: 1.0}, {2: 3600.0}, 0.0, 0.0),
        ({2: 1.0}, {20: 60.0}, (2 - 20) / 20, 1.0),
        ({2: 0.5, 20: 0.5}, {2: 10.0, 20: 30.0}, (11 - 15.5) / 15.5, 0.25),
        ({0: 1.0}, {0: 5.0}, 0.0, 0.0),
    ],
)
def test_forecast_quality_is_recorded(
    predicted: dict[int, float], actual: dict[int, float], error: float, tv: float
) -> None:
    result = score(Forecast(0.0, 1.0, predicted, "same hours", 1.0), actual)
    assert result is not None
    assert result.mean_error_ratio == pytest.approx(error)
    assert result.total_variation == pytest.approx(tv)


def test_nothing_observed_scores_nothing() -> None:
    assert score(Forecast(0.0, 1.0, {1: 1.0}, "recent", 0.0), {}) is None


@pytest.mark.parametrize("hours", [1, 5, 21])
def test_hours_never_seen_forecast_recent_traffic_however_many(hours: int) -> None:
    # A fresh start three hours in: 2 requests for the first hour, 6 for the next two.
    history = new_history()
    record(history, MONDAY, MONDAY + 3 * HOUR, lambda t: 2 if t < MONDAY + HOUR else 6)
    recent = history.offered_weights()
    total = sum(recent.values())
    shares = {k: w / total for k, w in recent.items()}
    start = MONDAY + 3 * HOUR  # 03:00-24:00 were never seen at their hour of the day
    forecast = forecast_epoch(history, start, start + hours * HOUR)
    assert forecast is not None
    assert forecast.source == "recent"
    assert forecast.recent_ratio == pytest.approx(1.0)
    assert forecast.weights == pytest.approx(shares, rel=1e-12)
    # To the next day's 03:00: its 00-03 hours were seen, one at 2 and two at 6.
    day = forecast_epoch(history, start, start + 24 * HOUR)
    assert day is not None
    assert day.recent_ratio == pytest.approx(21 / 24)
    expected = {k: (21 * w + (1 if k == 2 else 2)) / 24 for k, w in shares.items()}
    assert day.weights == pytest.approx(expected, rel=1e-9)


def nights(weekday: int, weekend: int, **days: int) -> Callable[[float], int]:
    """``weekday`` concurrent requests on weekdays, ``weekend`` on weekends; a day named in
    ``days`` by its index from MONDAY (``d2=...``) carries its own."""

    def offered(t: float) -> int:
        day = int((t - MONDAY) // DAY)
        return days.get(f"d{day}", weekend if day % 7 >= 5 else weekday)

    return offered


def idle_wednesday(t: float) -> int:
    """Half idle, half one request, a minute each (a mean of 0.5); Wednesday idle."""
    return 0 if int((t - MONDAY) // DAY) == 2 else int((t - MONDAY) // 60) % 2


UNLIKE = [
    # (id, traffic, hours recorded, hour asked at (from MONDAY 00:00), message part or None)
    ("steady", nights(4, 4), 5 * 24 + 3, 5 * 24 + 3, None),
    # A first Saturday after weekdays: nothing of its kind yet, so the weekdays it is
    # unlike; the weekend's nights are a third of theirs.
    ("first-weekend", nights(6, 2), 5 * 24 + 3, 5 * 24 + 3,
     "the last 3 h carried 2.0 requests on average against 6.0 in the same hours on other "
     "days (×0.33): a day unlike those the forecast reads"),
    # Sunday has Saturday, of its kind: alike.
    ("second-weekend-day", nights(6, 2), 6 * 24 + 3, 6 * 24 + 3, None),
    # A busy Wednesday: five times its weekday nights.
    ("busy-day", nights(2, 2, d2=10), 2 * 24 + 3, 2 * 24 + 3, "10.0 requests on average "
     "against 2.0 in the same hours on other days (×5.00)"),
    # Busy after idle nights: no ratio to give.
    ("busy-after-idle", nights(0, 0, d2=3), 2 * 24 + 3, 2 * 24 + 3, "3.0 requests on "
     "average against 0.0 in the same hours on other days (idle there)"),
    # Far less than half the load, but by less than a request: near idle a ratio is noise.
    ("near-idle", idle_wednesday, 2 * 24 + 3, 2 * 24 + 3, None),
    # Less than a factor of two: a day's noise.
    ("within-a-factor-of-two", nights(6, 4), 5 * 24 + 3, 5 * 24 + 3, None),
    # A fresh start: no other day to compare with.
    ("no-other-day", nights(6, 2), 3, 3, None),
    # Nothing recorded in the last three hours (specd was down): nothing to tell.
    ("no-recent-hours", nights(6, 2), 5 * 24, 5 * 24 + 6, None),
]  # fmt: skip


@pytest.mark.parametrize(
    ("offered", "recorded_h", "asked_h", "says"), [pytest.param(*u[1:], id=u[0]) for u in UNLIKE]
)
def test_a_day_unlike_the_days_the_forecast_reads(
    offered: Callable[[float], int], recorded_h: int, asked_h: int, says: str | None
) -> None:
    history = new_history()
    record(history, MONDAY, MONDAY + recorded_h * HOUR, offered)
    got = unlike_other_days(history, MONDAY + asked_h * HOUR)
    if says is None:
        assert got is None
    else:
        assert got is not None
        assert says in got, got


def night_then_dawn(t: float) -> int:
    """Batch jobs at 36 until 06:00, then one early developer."""
    return 36 if ((t - MONDAY) % DAY) / HOUR < 6 else 1


@pytest.mark.parametrize(
    ("start_hour", "hours", "scenarios"),
    [
        # 07–19 never seen: the whole epoch is one hour seen or the other.
        # (Hours alike, 00–05 here, stand for each other: the latest.)
        (7, 12, [(6, {1: 1.0}), (5, {36: 1.0})]),
        # 04–10: 04–07 seen (two hours at 36, one at 1), 07–10 not, half the epoch.
        (4, 6, [(6, {36: 2 / 6, 1: 4 / 6}), (5, {36: 5 / 6, 1: 1 / 6})]),
    ],
)
def test_hours_never_seen_are_read_as_the_quietest_and_the_busiest_seen(
    start_hour: int, hours: int, scenarios: list[tuple[int, dict[int, float]]]
) -> None:
    """Seven hours into a day/night rhythm, the day's hours are unknown: recent traffic
    (mostly night) says nothing of them. `Forecast.scenarios` reads them as each extreme
    seen so far, the rest of the epoch as forecast."""
    history = new_history()
    record(history, MONDAY, MONDAY + 7 * HOUR, night_then_dawn)
    start = MONDAY + start_hour * HOUR
    forecast = forecast_epoch(history, start, start + hours * HOUR)
    assert forecast is not None
    assert forecast.seen_spread >= 0.5  # a daily rhythm
    assert [hour for hour, _ in forecast.scenarios] == [hour for hour, _ in scenarios]
    for (_, got), (_, want) in zip(forecast.scenarios, scenarios, strict=True):
        assert got == pytest.approx(want, abs=0.02)
        assert sum(got.values()) == pytest.approx(1.0)


def test_no_scenarios_where_the_hours_seen_look_alike_or_all_were_seen() -> None:
    steady = new_history()
    record(steady, MONDAY, MONDAY + 7 * HOUR, lambda t: 5)
    unseen = forecast_epoch(steady, MONDAY + 7 * HOUR, MONDAY + 19 * HOUR)
    assert unseen is not None
    assert unseen.recent_ratio == pytest.approx(1.0)
    assert unseen.scenarios == ()  # steady so far: recent traffic stands for the rest
    day = new_history()
    record(day, MONDAY, MONDAY + DAY, night_then_dawn)
    seen = forecast_epoch(day, MONDAY + DAY + 7 * HOUR, MONDAY + DAY + 19 * HOUR)
    assert seen is not None
    assert (seen.recent_ratio, seen.scenarios) == (0.0, ())
