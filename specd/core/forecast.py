"""Forecasting the offered concurrency of the coming epoch.

A setting chosen in a window stays live until the next window opens, so the model policy
needs the traffic of that epoch, not of the last minutes. The history keeps one decaying
distribution of offered concurrency per hour of the week (UTC). For each hour the epoch
covers, the forecast uses, in order:

1. that same hour of the week (the same hour on previous weeks);
2. the same hour of the day on other days of the same kind (weekdays and weekends apart),
   which is what exists after a day or two;
3. the same hour of the day on any day (a first weekend after weekdays, or the reverse):
   a daily rhythm seen beats no rhythm at all;
4. recent history (all hours), while that hour of the day was never seen. Such an hour's
   traffic is unknown: `Forecast.recent_ratio` says how much of the epoch that is, and
   the model policy does not restart on a forecast that is mostly that
   (``[choose] min_forecast_seen_ratio``).

The result is the fraction of the epoch's time expected at each offered concurrency
(0 = idle included). `score` compares a forecast with what happened, so replays and the
daemon can record how good the forecasts were.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specd.core.history import HOUR_S, HOURS_PER_WEEK, day_kind, hour_of_week

if TYPE_CHECKING:
    from specd.core.history import History

# Decayed seconds an hour bucket needs before it stands on its own (a quarter hour).
MIN_HOUR_EVIDENCE_S = 900.0


def _normalized(weights: Mapping[int, float]) -> dict[int, float] | None:
    total = sum(w for w in weights.values() if w > 0)
    if total <= 0:
        return None
    return {k: w / total for k, w in weights.items() if w > 0}


@dataclass(frozen=True)
class Forecast:
    """Expected share of the epoch's time at each offered concurrency (sums to 1)."""

    start: float
    end: float
    weights: dict[int, float]
    # "same hours", "same hours, other days", "same hours, any day", "recent", or a mix "a+b"
    source: str
    same_hours_ratio: float  # share of the epoch forecast from its own hours of the week
    # Share of the epoch forecast from recent traffic alone: hours of the day never seen,
    # whose traffic the forecast cannot know (a daily rhythm unseen).
    recent_ratio: float = 0.0

    def mean(self) -> float:
        return sum(k * w for k, w in self.weights.items())

    def busy_ratio(self) -> float:
        return sum(w for k, w in self.weights.items() if k > 0)

    def quantile(self, q: float) -> float:
        running = 0.0
        for k in sorted(self.weights):
            running += self.weights[k]
            if running >= q * (1 - 1e-9):
                return float(k)
        return float(max(self.weights))


class _HourSource:
    """Per-hour distributions, computed once per forecast."""

    def __init__(self, history: History) -> None:
        self.history = history
        self._own: dict[int, tuple[dict[int, float], float]] = {}
        self._kind: dict[int, dict[int, float] | None] = {}
        self._day: dict[int, dict[int, float] | None] = {}
        self._recent: dict[int, float] | bool | None = False

    def own(self, how: int) -> tuple[dict[int, float], float]:
        if how not in self._own:
            weights = self.history.hour_of_week_weights(how)
            self._own[how] = (weights, sum(weights.values()))
        return self._own[how]

    def same_kind(self, how: int) -> dict[int, float] | None:
        key = day_kind(how)
        if key not in self._kind:
            merged = self.history.day_kind_weights(how)
            total = sum(merged.values())
            self._kind[key] = _normalized(merged) if total >= MIN_HOUR_EVIDENCE_S else None
        return self._kind[key]

    def any_day(self, how: int) -> dict[int, float] | None:
        hour = how % 24
        if hour not in self._day:
            merged = self.history.hour_of_day_weights(how)
            total = sum(merged.values())
            self._day[hour] = _normalized(merged) if total >= MIN_HOUR_EVIDENCE_S else None
        return self._day[hour]

    def recent(self) -> dict[int, float] | None:
        if self._recent is False:
            self._recent = _normalized(self.history.offered_weights())
        assert self._recent is not True
        return self._recent

    def distribution(self, how: int) -> tuple[dict[int, float], str] | None:
        weights, total = self.own(how)
        if total >= MIN_HOUR_EVIDENCE_S:
            normalized = _normalized(weights)
            if normalized is not None:
                return normalized, "same hours"
        kind = self.same_kind(how)
        if kind is not None:
            return kind, "same hours, other days"
        day = self.any_day(how)
        if day is not None:
            return day, "same hours, any day"
        recent = self.recent()
        return None if recent is None else (recent, "recent")


def forecast_epoch(history: History, start: float, end: float) -> Forecast | None:
    """Forecast for [start, end) (unix seconds); None when the history is empty."""
    if not (math.isfinite(start) and math.isfinite(end)):
        return None
    if end <= start:
        end = start + HOUR_S  # a degenerate epoch: forecast the hour that follows
    hours = _HourSource(history)
    merged: dict[int, float] = {}
    share: dict[str, float] = {}
    covered = 0.0
    t = start
    while t < end:
        slot_end = min((math.floor(t / HOUR_S) + 1) * HOUR_S, end)
        span = slot_end - t
        how = hour_of_week(t)
        got = hours.distribution(how)
        if got is not None:
            weights, source = got
            for k, w in weights.items():
                merged[k] = merged.get(k, 0.0) + w * span
            share[source] = share.get(source, 0.0) + span
            covered += span
        t = slot_end
        # Beyond a week the hours repeat: the first week's shape is the forecast.
        if t - start >= HOURS_PER_WEEK * HOUR_S:
            break
    if covered <= 0:
        return None
    weights = {k: w / covered for k, w in merged.items()}
    source = "+".join(name for name, _ in sorted(share.items(), key=lambda kv: -kv[1]))
    return Forecast(
        start,
        end,
        weights,
        source,
        share.get("same hours", 0.0) / covered,
        share.get("recent", 0.0) / covered,
    )


@dataclass(frozen=True)
class ForecastScore:
    """How a forecast compared with what was then observed."""

    predicted_mean: float
    actual_mean: float
    mean_error_ratio: float  # (predicted − actual) / max(actual, 1)
    total_variation: float  # 0 = identical distributions, 1 = disjoint


def score(forecast: Forecast, actual: Mapping[int, float]) -> ForecastScore | None:
    """Compare with the actual time at each offered concurrency; None if nothing observed."""
    observed = _normalized(actual)
    if observed is None:
        return None
    predicted_mean = forecast.mean()
    actual_mean = sum(k * w for k, w in observed.items())
    keys = set(observed) | set(forecast.weights)
    tv = 0.5 * sum(abs(forecast.weights.get(k, 0.0) - observed.get(k, 0.0)) for k in keys)
    return ForecastScore(
        predicted_mean,
        actual_mean,
        (predicted_mean - actual_mean) / max(actual_mean, 1.0),
        tv,
    )
