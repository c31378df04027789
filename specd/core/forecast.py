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
   `Forecast.seen_spread` how far the hours of the day seen so far differ from recent
   traffic. Where they differ (a daily rhythm shows), recent traffic says little of the
   hours not seen: the model policy does not restart on a forecast that is mostly that
   (``[choose] min_forecast_seen_ratio``); where they agree (steady so far), it trusts it,
   but breaks a tie within the prediction interval toward the setting with most room for
   requests (`specd.core.model.plan`): unseen hours may be busier than those seen.

The result is the fraction of the epoch's time expected at each offered concurrency
(0 = idle included). `score` compares a forecast with what happened, so replays and the
daemon can record how good the forecasts were.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from specd.core.history import HOURS_PER_WEEK, hour_of_week
from specd.core.units import HOUR_S

if TYPE_CHECKING:
    from specd.core.history import History

# Decayed seconds an hour bucket needs before it stands on its own (a quarter hour).
MIN_HOUR_EVIDENCE_S = 900.0


# Hours of the day this far from recent traffic (total variation distance) show a daily
# rhythm: recent traffic then says little of the hours not seen yet. Steady traffic's hours
# differ from its whole by sampling noise only (well under this); day against night by ~1.
RHYTHM_SPREAD = 0.5


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
    # With recent_ratio > 0: the largest total variation distance between an hour of the
    # day seen so far and recent traffic (0 alike, 1 disjoint); 0 otherwise.
    seen_spread: float = 0.0
    # Where a daily rhythm shows (seen_spread >= RHYTHM_SPREAD) and hours were never seen:
    # the epoch again with those hours as the quietest, then as the busiest hour of the
    # day seen so far with any request (by mean offered), each (hour of the day, weights).
    # What the unseen hours may be like, as far as this box has shown; empty otherwise.
    scenarios: tuple[tuple[int, dict[int, float]], ...] = ()

    def mean(self) -> float:
        return sum([k * w for k, w in self.weights.items()])  # a list: read every tick

    def busy_ratio(self) -> float:
        return sum(w for k, w in self.weights.items() if k > 0)

    def quantile(self, q: float) -> float:
        running = 0.0
        for k in sorted(self.weights):
            running += self.weights[k]
            if running >= q * (1 - 1e-9):
                return float(k)
        return float(max(self.weights))


# `History.hour_shares`'s sources, in its order; the last: recent traffic.
_SOURCES = ("same hours", "same hours, other days", "same hours, any day", "recent")


class _HourSource:
    """Per-hour distributions; recent traffic read once per forecast."""

    def __init__(self, history: History) -> None:
        self.history = history
        # (recent traffic's shares, "recent") once read, None without any traffic. Every
        # hour that reads it gets this one object: `_merge` adds a run of them at once.
        self._recent: tuple[dict[int, float], str] | bool | None = False

    def _recent_part(self) -> tuple[dict[int, float], str] | None:
        if self._recent is False:
            shares = _normalized(self.history.offered_weights())
            self._recent = None if shares is None else (shares, _SOURCES[-1])
        assert self._recent is not True
        return self._recent

    def recent(self) -> dict[int, float] | None:
        part = self._recent_part()
        return None if part is None else part[0]

    def distribution(self, how: int) -> tuple[dict[int, float], str] | None:
        """Hour of the week ``how`` from its own hours, else its hours of the day on days
        of its kind, else on any day (each with `MIN_HOUR_EVIDENCE_S`), else recent."""
        shares, source = self.history.hour_shares(how, MIN_HOUR_EVIDENCE_S)
        if shares is not None:
            return shares, _SOURCES[source]
        return self._recent_part()


# `_merge`'s running sums: seconds per offered concurrency, per source, and covered.
_Sums = tuple[dict[int, float], dict[str, float], float]


@dataclass(frozen=True)
class _Made:
    """A forecast and the distributions it was made of, each hour's (in order)."""

    start: float
    end: float
    # Each hour slot's (seconds, hour of the week): a function of (start, end) alone.
    layout: tuple[tuple[float, int], ...]
    parts: tuple[tuple[dict[int, float], str] | None, ...]
    forecast: Forecast | None
    # `_merge`'s running sums before each slot (and after the last): a forecast whose first
    # hours read the same distributions goes on from the last of those.
    sums: tuple[_Sums, ...] = ()


def _layout(start: float, end: float) -> tuple[tuple[float, int], ...]:
    """The hours [start, end) covers: each one's (seconds in the epoch, hour of the week)."""
    slots: list[tuple[float, int]] = []
    t = start
    while t < end:
        slot_end = min((math.floor(t / HOUR_S) + 1) * HOUR_S, end)
        slots.append((slot_end - t, hour_of_week(t)))
        t = slot_end
        # Beyond a week the hours repeat: the first week's shape is the forecast.
        if t - start >= HOURS_PER_WEEK * HOUR_S:
            break
    return tuple(slots)


def forecast_epoch(history: History, start: float, end: float) -> Forecast | None:
    """Forecast for [start, end) (unix seconds); None when the history is empty.

    Each hour's distribution is a share of its (decaying) time, the same however long ago
    it was recorded; while the epoch and every distribution it reads are the same, so is
    the forecast: the history keeps the last one (`History.forecast_memo`) for the next
    tick, and it is made again only when one of them changed."""
    if not (math.isfinite(start) and math.isfinite(end)):
        return None
    if end <= start:
        end = start + HOUR_S  # a degenerate epoch: forecast the hour that follows
    memo = history.forecast_memo
    same_epoch = isinstance(memo, _Made) and memo.start == start and memo.end == end
    # The same epoch all day long (until a window opens): its hours are laid out once.
    layout = memo.layout if same_epoch else _layout(start, end)
    hours = _HourSource(history)
    parts = tuple([hours.distribution(how) for _, how in layout])
    kept: tuple[_Sums, ...] = ()
    if same_epoch:
        # The hours before the first that reads another distribution merge as before.
        same = 0
        for a, b in zip(memo.parts, parts, strict=True):
            if not _same(a, b):
                break
            same += 1
        if same == len(parts):
            return _copy(memo.forecast)
        kept = memo.sums[: same + 1]
    slots = [(span, got) for (span, _), got in zip(layout, parts, strict=True)]
    made, sums = _merge(start, end, slots, kept)
    if made is not None and made.recent_ratio > 0:
        recent = hours.recent()
        made = replace(made, seen_spread=_seen_spread(history, recent))
        if made.seen_spread >= RHYTHM_SPREAD and recent is not None:
            made = replace(made, scenarios=_scenarios(history, made, recent))
    history.forecast_memo = _Made(start, end, layout, parts, made, sums)
    return _copy(made)


def _scenarios(
    history: History, made: Forecast, recent: Mapping[int, float]
) -> tuple[tuple[int, dict[int, float]], ...]:
    """`Forecast.scenarios`: ``made``'s hours from recent traffic read instead as the
    quietest, then the busiest hour of the day seen with any request (each with
    `MIN_HOUR_EVIDENCE_S`; of hours alike, the latest)."""
    # An hour with no request at all says nothing of which setting serves more.
    seen = [
        (sum(c * w for c, w in shares.items()), hour, shares)
        for hour, (shares, seconds) in enumerate(history.hour_of_day_distributions())
        if shares is not None and seconds >= MIN_HOUR_EVIDENCE_S and any(c > 0 for c in shares)
    ]
    if not seen:
        return ()
    quietest = min(seen, key=lambda s: (s[0], -s[1]))
    busiest = max(seen, key=lambda s: s[:2])
    ratio = made.recent_ratio
    # The hours forecast from elsewhere, recent traffic's share taken out.
    rest = {c: w - ratio * recent.get(c, 0.0) for c, w in made.weights.items()}
    out = []
    for _, hour, shares in (quietest, busiest) if quietest is not busiest else (quietest,):
        weights = dict(rest)
        for c, w in shares.items():
            weights[c] = weights.get(c, 0.0) + ratio * w
        # Rounding can leave a share a hair below 0 where recent traffic was all of it.
        out.append((hour, {c: w for c, w in weights.items() if w > 1e-12}))
    return tuple(out)


def _same(a: tuple[dict[int, float], str] | None, b: tuple[dict[int, float], str] | None) -> bool:
    # The history hands out the same dict while its table is unchanged ("recent" is made
    # anew at every forecast, so a forecast reading it is never reused).
    if a is None or b is None:
        return a is b
    return a[0] is b[0] and a[1] == b[1]


def _copy(forecast: Forecast | None) -> Forecast | None:
    # Every caller gets weights of its own: the memo's are never handed out.
    if forecast is None:
        return None
    return replace(forecast, weights=dict(forecast.weights))


# `_seen_spread` skips an hour whose distance cannot reach the largest one found: far
# above the rounding of the sums its bound adds (relative errors of ~1e-14 on sums ≤ 2).
_SPREAD_SLACK = 1e-9
# The drift of recent traffic is summed from 0 again past this (an hour's bound is then at
# least 1, which no distance exceeds) or after this many reads (its rounding stays small).
_DRIFT_RESET = 1.0
_DRIFT_READS = 10_000


@dataclass
class _Spreads:
    """What `_seen_spread` keeps for the next tick (`History.spread_memo`): derived only.

    ``drift`` sums the distances between the recent traffic of consecutive reads: by the
    triangle inequality an hour of the day whose shares did not change is at most its
    distance then plus the drift since from recent traffic now, so only the hours that
    could be the farthest are compared again."""

    recent: Mapping[int, float] | None = None
    drift: float = 0.0
    reads: int = 0
    # hour of the day → (its shares, its distance from recent traffic then, drift then)
    known: dict[int, tuple[Mapping[int, float], float, float]] = field(default_factory=dict)
    # hour of the day → (its shares, recent's keys, the keys compared in the order of their
    # set, so a sum adds the same terms in the same order, and the hour's share of each)
    terms: dict[int, tuple[Mapping[int, float], tuple[int, ...], list[int], list[float]]] = field(
        default_factory=dict
    )


def _distance(a: Mapping[int, float], b: Mapping[int, float]) -> float:
    """Total variation distance of two distributions (only a bound is read of it)."""
    return 0.5 * sum([abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in a.keys() | b.keys()])


def _seen_spread(history: History, recent: Mapping[int, float] | None) -> float:
    """How far the hours of the day seen so far (each on any day) are from ``recent``: the
    largest total variation distance, 0 when nothing was seen."""
    if recent is None:
        return 0.0
    memo = history.spread_memo
    if not isinstance(memo, _Spreads) or memo.drift > _DRIFT_RESET or memo.reads >= _DRIFT_READS:
        memo = history.spread_memo = _Spreads()
    elif memo.recent is not None:
        memo.drift += _distance(memo.recent, recent)
    memo.recent, memo.reads = recent, memo.reads + 1
    drift = memo.drift
    bounded: list[tuple[float, int, Mapping[int, float]]] = []
    for hour, (shares, seconds) in enumerate(history.hour_of_day_distributions()):
        if shares is None or seconds < MIN_HOUR_EVIDENCE_S:
            continue
        known = memo.known.get(hour)
        bound = (
            known[1] + (drift - known[2]) + _SPREAD_SLACK
            if known is not None and known[0] is shares
            else math.inf
        )
        bounded.append((bound, hour, shares))
    bounded.sort(key=lambda item: item[0], reverse=True)
    recent_keys = tuple(recent)
    spread = 0.0
    for bound, hour, ours in bounded:
        if bound < spread:
            break  # this hour and every one after it are nearer than the farthest found
        kept = memo.terms.get(hour)
        if kept is None or kept[0] is not ours or kept[1] != recent_keys:
            keys = list(ours.keys() | recent.keys())
            kept = (ours, recent_keys, keys, [ours.get(k, 0.0) for k in keys])
            memo.terms[hour] = kept
        get = recent.get
        distance = 0.5 * sum([abs(s - get(k, 0.0)) for s, k in zip(kept[3], kept[2], strict=True)])
        memo.known[hour] = (ours, distance, drift)
        spread = max(spread, distance)
    return spread


def _merge(
    start: float,
    end: float,
    slots: list[tuple[float, tuple[dict[int, float], str] | None]],
    kept: Sequence[_Sums] = (),
) -> tuple[Forecast | None, tuple[_Sums, ...]]:
    """The forecast of ``slots`` (each hour's seconds and distribution), and the running
    sums before each slot and after the last (up to the first hour of recent traffic).
    ``kept``: the running sums before the first ``len(kept)`` slots, of a merge whose slots
    before the last of them were these: the sums go on from there, adding the same terms
    in the same order as from the start."""
    sums: list[_Sums] = list(kept) or [({}, {}, 0.0)]
    merged, share, covered = dict(sums[-1][0]), dict(sums[-1][1]), sums[-1][2]
    resumable = True
    rest = slots[len(sums) - 1 :]
    i = 0
    while i < len(rest):
        span, got = rest[i]
        i += 1
        if got is not None:
            weights, source = got
            if source == _SOURCES[-1]:
                # Recent traffic is read anew at every forecast: no merge goes on past its
                # first hour, so the sums after it are not kept (copying them costs), and
                # the hours that read it in a row (a fresh start: all of them) add it once.
                resumable = False
                while i < len(rest) and rest[i][1] is got:
                    span += rest[i][0]
                    i += 1
            for k, w in weights.items():
                merged[k] = merged.get(k, 0.0) + w * span
            share[source] = share.get(source, 0.0) + span
            covered += span
        if resumable:
            sums.append((dict(merged), dict(share), covered))
    return _forecast(start, end, merged, share, covered), tuple(sums)


def _forecast(
    start: float, end: float, merged: dict[int, float], share: dict[str, float], covered: float
) -> Forecast | None:
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


# An exploration bets an epoch on the forecast, which reads the same hours on other days.
# Where the hours just past carried this many times more, or less, load than the same hours
# on those days (a first weekend after weekdays, a holiday), today is unlike them and the
# bet waits for a day that is like them. The bench's bursty trace varies within ×1.5 from
# day to day at its window's hours; its weekly one's first weekend night is ×0.4.
UNLIKE_DAYS_RATIO = 2.0
# ... and by this many concurrent requests on average: near idle, a ratio is noise.
UNLIKE_DAYS_MIN_REQUESTS = 1.0
# How many whole hours before now are compared.
UNLIKE_DAYS_HOURS = 3


def unlike_other_days(history: History, now: float) -> str | None:
    """Why the hours just past are unlike the same hours on other days, or None.

    The last `UNLIKE_DAYS_HOURS` whole hours of the week, each with `MIN_HOUR_EVIDENCE_S`
    of its own, against the same hours of the day on the other days of their kind
    (weekdays, or the weekend) or, where those have too little, on other days of either
    kind: their mean offered concurrency, averaged over the hours compared, differing by a
    factor of `UNLIKE_DAYS_RATIO` and by `UNLIKE_DAYS_MIN_REQUESTS`. An hour of the week
    holds that hour of earlier weeks too (a half-life of a week), so from the second week a
    day unlike its own weekday shows less; the forecast then reads that hour of the week
    first."""
    how = hour_of_week(now)
    own_means: list[float] = []
    other_means: list[float] = []
    for back in range(1, UNLIKE_DAYS_HOURS + 1):
        (own_s, own_c), kind, every = history.hour_moments((how - back) % HOURS_PER_WEEK)
        if own_s < MIN_HOUR_EVIDENCE_S:
            continue
        # The others' sums less this hour of the week's: the other days alone. Rounding
        # of tables decaying from different reference times may leave a hair, never 900 s.
        others = kind if kind[0] - own_s >= MIN_HOUR_EVIDENCE_S else every
        if others[0] - own_s < MIN_HOUR_EVIDENCE_S:
            continue
        own_means.append(own_c / own_s)
        other_means.append(max(others[1] - own_c, 0.0) / (others[0] - own_s))
    if not own_means:
        return None
    ours = sum(own_means) / len(own_means)
    theirs = sum(other_means) / len(other_means)
    if abs(ours - theirs) < UNLIKE_DAYS_MIN_REQUESTS or (
        max(ours, theirs) < UNLIKE_DAYS_RATIO * min(ours, theirs)
    ):
        return None
    times = f"×{ours / theirs:.2f}" if theirs > 0 else "idle there"
    return (
        f"the last {len(own_means)} h carried {ours:.1f} requests on average against "
        f"{theirs:.1f} in the same hours on other days ({times}): a day unlike those the "
        "forecast reads"
    )
