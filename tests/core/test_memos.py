"""The memos the brain keeps across ticks (issue 12's decision cost) return what computing
afresh returns: the same numbers, bit for bit, and new ones as soon as an input changed.

Each test runs one history twice — one asked at every step (its memos filled and reused),
one asked only at the end (nothing memoized) — or compares with a value built anew.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from datetime import datetime, timezone

import pytest
from factories import make_observation, seed_table, tables

from specd.core.adaptive import DEFAULT_SLOTS, Slots
from specd.core.explore import epoch_end
from specd.core.forecast import (
    MIN_HOUR_EVIDENCE_S,
    Forecast,
    _copy,
    _seen_spread,
    forecast_epoch,
)
from specd.core.history import History, HistorySettings, hour_of_week
from specd.core.model import Calibration, PerformanceModel, _next_epoch
from specd.core.observation import Observation
from specd.core.perftable import PerfRow, PerfTable
from specd.core.settings import Settings
from specd.core.windows import next_close, next_open

MONDAY = 1767571200.0  # 2026-01-05 00:00 UTC
HOUR = 3600.0
DAY = 86400.0
SEED = seed_table()


def observation(t: float, offered: int, steps: int = 3, capacity: int = 64) -> Observation:
    return make_observation(
        t,
        running=min(offered, capacity),
        queued=max(0, offered - capacity),
        spec_fresh=False,
        steps=steps,
        max_running_requests=capacity,
        version="test",
    )


def new_history() -> History:
    return History(HistorySettings(scrape_interval_s=60, warmup_exclude_s=0))


def office(t: float) -> int:
    hour = ((t - MONDAY) % DAY) / HOUR
    return 20 if 9 <= hour < 17 else 2


def record(histories: list[History], start: float, end: float, level: int | None = None) -> None:
    t = start
    while t < end:
        for history in histories:
            history.record(observation(t, office(t) if level is None else level))
        t += 60


@pytest.mark.parametrize(
    ("days", "epoch", "quiet_until", "change", "sources", "mean", "reader"),
    [
        # Next Wednesday 08:00–18:00: its own hours (last Wednesday) are known. The days
        # between observed as before (its 08 and 09 hours at last week's levels), then
        # Wednesday's 10:00 hour again, a week later, at 50: that hour's table changed.
        pytest.param(
            8,
            (9 * 24 + 8, 10),
            9 * 24 + 10,
            (9 * 24 + 10, 1),
            ("same hours", "same hours"),
            16.4,
            History.hour_of_week_distribution,
            id="own hours",
        ),
        # Wednesday 09:00–12:00 from Monday's and Tuesday's same hours. Wednesday 00:00–09:00
        # observed: no hour of the epoch, nor of its day kind's hours 09–12. Then Thursday's
        # 10:00 hour at 50: not an hour of the epoch, only of its day kind's pooled hours.
        pytest.param(
            2,
            (2 * 24 + 9, 3),
            2 * 24 + 9,
            (3 * 24 + 10, 1),
            ("same hours, other days", "same hours, other days"),
            20.0,
            History.day_kind_distribution,
            id="other days",
        ),
        # The same, but the weekday hours at 50 are Wednesday 09:00–11:00, the epoch's own:
        # they are pooled with its day kind's hours, and two of its hours now have their own.
        pytest.param(
            2,
            (2 * 24 + 9, 3),
            2 * 24 + 9,
            (2 * 24 + 9, 2),
            ("same hours, other days", "same hours+same hours, other days"),
            20.0,
            History.day_kind_distribution,
            id="other days, then its own",
        ),
        # A first Saturday 09:00–12:00: no weekend seen, the weekdays' same hours stand in.
        # Saturday 00:00–09:00 observed: weekend hours, but none of the epoch's hours of the
        # day. Then a weekday 10:00 hour on another weekday (next week's Monday) at 50: the
        # weekdays' same hours change, and with them the forecast of a Saturday that has
        # none of its own.
        pytest.param(
            5,
            (5 * 24 + 9, 3),
            5 * 24 + 9,
            (7 * 24 + 10, 1),
            ("same hours, any day", "same hours, any day"),
            20.0,
            History.hour_of_day_distribution,
            id="any day",
        ),
    ],
)
def test_a_kept_forecast_is_made_again_when_a_distribution_it_reads_changes(
    days: int,
    epoch: tuple[int, int],
    quiet_until: int,
    change: tuple[int, int],
    sources: tuple[str, str],
    mean: float,
    reader: Callable[[History, int], tuple[dict[int, float] | None, float]],
) -> None:
    """``epoch`` and ``change``: (first hour, hours), counted from MONDAY; ``quiet_until``:
    the office traffic goes on that far (hours from MONDAY) without changing the forecast;
    ``sources``: the forecast's before and after the change; ``reader``: the distribution
    the changed hour lands in, derived once per revision of its table."""
    asked, cold = new_history(), new_history()
    record([asked, cold], MONDAY, MONDAY + days * DAY)
    start = MONDAY + epoch[0] * HOUR
    end = start + epoch[1] * HOUR
    before = forecast_epoch(asked, start, end)
    assert before is not None
    assert before.source == sources[0]
    assert before.mean() == pytest.approx(mean)
    assert forecast_epoch(asked, start, end) == before
    record([asked, cold], MONDAY + days * DAY, MONDAY + quiet_until * HOUR)
    kept = forecast_epoch(asked, start, end)
    assert kept == before == forecast_epoch(cold, start, end)
    # 50 requests all along the changed hours: the forecast must change too, exactly as a
    # history never asked computes it.
    changed = MONDAY + change[0] * HOUR
    record([asked, cold], changed, changed + change[1] * HOUR, level=50)
    after = forecast_epoch(asked, start, end)
    assert after is not None
    assert after.source == sources[1]
    assert after.weights != before.weights
    assert 50 in after.weights
    assert after == forecast_epoch(cold, start, end)
    # The table read holds the 50s beside the 20s recorded before (the table an earlier
    # forecast read), one object until it changes again.
    distribution, seconds = reader(asked, hour_of_week(changed))
    again, _ = reader(asked, hour_of_week(changed))
    assert again is distribution
    assert distribution is not None
    assert set(distribution) == {20, 50}
    assert seconds > 0


def test_a_forecast_handed_out_is_the_callers_own() -> None:
    history = new_history()
    record([history], MONDAY, MONDAY + 8 * DAY)
    start = MONDAY + (9 * 24 + 8) * HOUR
    first = forecast_epoch(history, start, start + 10 * HOUR)
    assert first is not None
    expected = dict(first.weights)
    first.weights.clear()
    second = forecast_epoch(history, start, start + 10 * HOUR)
    assert second is not None
    assert second.weights == expected


@pytest.mark.parametrize("changed_hour", [9, 12, 14])
def test_a_forecast_made_again_from_its_first_changed_hour_sums_as_afresh(
    changed_hour: int,
) -> None:
    # Wednesday 09:00-15:00 from Monday's and Tuesday's same hours; then one of those hours
    # on Tuesday changes (its hour of the epoch first, middle, last but one): the hours
    # before it merge as kept, the rest again, to the same sums in the same order.
    asked, cold = new_history(), new_history()
    record([asked, cold], MONDAY, MONDAY + 2 * DAY)
    start = MONDAY + (2 * 24 + 9) * HOUR
    end = start + 6 * HOUR
    before = forecast_epoch(asked, start, end)
    assert before is not None
    assert before.source == "same hours, other days"
    changed = MONDAY + (24 + changed_hour) * HOUR + 600
    for level in (50, 7):
        for history in (asked, cold):
            history.record(observation(changed, level))
            history.record(observation(changed + 60, level))
        changed += 120
        after = forecast_epoch(asked, start, end)
        fresh = forecast_epoch(cold, start, end)
        cold.forecast_memo = None  # each of cold's from nothing kept
        assert after is not None
        assert fresh is not None
        assert list(after.weights.items()) == list(fresh.weights.items())
        assert after == fresh
        assert level in after.weights


def test_a_forecast_copy_has_every_field() -> None:
    # `_copy` lists the fields (faster than `replace`): none may be left at its default.
    made = Forecast(1.0, 2.0, {3: 1.0}, "recent", 0.25, 0.5, 0.75)
    copied = _copy(made)
    assert copied == made
    assert copied is not None
    assert copied.weights is not made.weights
    assert [getattr(copied, f.name) for f in dataclasses.fields(Forecast)] == [
        getattr(made, f.name) for f in dataclasses.fields(Forecast)
    ]


def test_an_hour_distribution_is_kept_per_revision_of_its_table() -> None:
    history = new_history()
    record([history], MONDAY, MONDAY + 2 * HOUR)
    shares, seconds = history.hour_of_week_distribution(hour_of_week(MONDAY))
    again, later = history.hour_of_week_distribution(hour_of_week(MONDAY))
    assert again is shares
    assert later == seconds
    history.record(observation(MONDAY + 7 * DAY, 9))  # the same hour of the week, a week on
    changed, _ = history.hour_of_week_distribution(hour_of_week(MONDAY))
    assert changed is not shares
    assert changed is not None
    assert 9 in changed
    # The decayed seconds follow the time read at, the shares not.
    assert sum(changed.values()) == pytest.approx(1.0)


def test_the_throughput_table_follows_every_observation() -> None:
    asked, cold = new_history(), new_history()
    t = MONDAY
    for served in range(0, 40_000, 1000):
        for history in (asked, cold):
            history.record(
                dataclasses.replace(
                    observation(t, 4), decode_tokens_total=float(served), gen_throughput=None
                )
            )
        table = asked.throughput_table()
        table.clear()  # a copy: the next reader is not affected
        assert asked.throughput_table() == cold.throughput_table()
        t += 60
    assert asked.throughput_table()


def test_a_calibration_reads_each_capacity_apart() -> None:
    # Measured at 1, 8 and 32 only: a capacity moves the plateau's first point.
    rows = [
        PerfRow(k, float(c), SEED.throughput(k, c), SEED.accept_length(k), SEED.capacity(k))
        for k in SEED.steps()
        for c in (1, 8, 32)
    ]
    table = PerfTable(rows, source="sparse")
    calibration = Calibration.of(table)
    fresh = Calibration.of(table)
    history = new_history()
    # Steps 3 observed with a capacity of 6: the curve plateaus there.
    history.record(observation(MONDAY, 4, steps=3, capacity=6))
    narrow = PerformanceModel(calibration, history)
    wide = PerformanceModel(calibration)  # the table's capacity, from the same memo
    for c in (1, 4, 6, 8, 12, 40):
        assert narrow.throughput(3, c) == PerformanceModel(fresh, history).throughput(3, c)
        assert wide.throughput(3, c) == PerformanceModel(Calibration.of(table)).throughput(3, c)
    # Read through other points: the memo of one capacity is not the other's.
    assert narrow.capacity(3) == 6 != wide.capacity(3)
    assert any(narrow.throughput(3, c) != wide.throughput(3, c) for c in (2, 4, 6, 8, 12))
    # A half concurrency is read through the points, never through the memo of whole ones.
    assert wide.throughput(3, 2.5) == PerformanceModel(fresh).throughput(3, 2.5)


@pytest.mark.parametrize("batch", [0, 1, 2, 7, 8, 9, 31, 32, 63, 64, 65, 500, 7.5])
def test_slot_routing_is_the_same_remembered(batch: float) -> None:
    slots = Slots.of({1: (1, 3, 5, 7), 8: (0, 1, 3), 32: (0, 1), 64: (0,)})
    assert slots == DEFAULT_SLOTS
    expected = [s for s in slots.slots if s.min_batch <= batch][-1:] or [slots.slots[0]]
    assert slots.slot_for(batch) == expected[0]
    assert slots.slot_for(batch) == expected[0]  # from the memo


def _spread_afresh(history: History, recent: dict[int, float]) -> float:
    # `_seen_spread` as it read before it kept anything: every hour compared.
    spread = 0.0
    for hour in range(24):
        shares, seconds = history.hour_of_day_distribution(hour)
        if shares is None or seconds < MIN_HOUR_EVIDENCE_S:
            continue
        keys = shares.keys() | recent.keys()
        spread = max(spread, 0.5 * sum(abs(shares.get(k, 0.0) - recent.get(k, 0.0)) for k in keys))
    return spread


def test_the_seen_spread_follows_recent_traffic_and_the_hours() -> None:
    asked, cold = new_history(), new_history()
    record([asked, cold], MONDAY, MONDAY + DAY)  # office hours at 20, the rest at 2
    # Mostly 2: the office hours are the farthest (0.9), the night hours near (0.1).
    night = {2: 0.9, 20: 0.1}
    assert _seen_spread(asked, night) == _spread_afresh(cold, night) == pytest.approx(0.9)
    # Recent traffic moved to mostly 20: now the night hours are the farthest. An hour kept
    # as near as it was would be skipped, and the spread read as the office hours' 0.4.
    day = {2: 0.4, 20: 0.6}
    assert _seen_spread(asked, day) == _spread_afresh(cold, day) == pytest.approx(0.6)
    # Back a little: the office hours the farthest (0.6), the 03:00 hour near (0.4).
    mixed = {2: 0.6, 20: 0.4}
    assert _seen_spread(asked, mixed) == _spread_afresh(cold, mixed) == pytest.approx(0.6)
    # The 03:00 hour changes (at 50 on the next three days): its shares are new, and it is
    # the farthest now (about 0.75, the latest days weigh more) while recent traffic stayed.
    for day_index in (1, 2, 3):
        three = MONDAY + day_index * DAY + 3 * HOUR
        record([asked, cold], three, three + HOUR, level=50)
    farthest = _spread_afresh(cold, mixed)
    assert _seen_spread(asked, mixed) == farthest == pytest.approx(0.75, abs=0.05)
    # A concurrency recent traffic never had: every hour's terms include it.
    burst = {2: 0.6, 20: 0.3, 50: 0.1}
    assert _seen_spread(asked, burst) == _spread_afresh(cold, burst)
    # Small moves, many times: the skipped hours' bounds keep up with each one.
    for step in range(1, 40):
        share = 0.6 - step * 0.002
        moved = {2: share, 20: 0.9 - share, 50: 0.1}
        assert _seen_spread(asked, moved) == _spread_afresh(cold, moved)


def test_an_hour_of_the_day_decays_as_read_afresh() -> None:
    # Its seconds are kept as of the time they were summed and rescaled when read: equal to
    # a fresh sum up to rounding, never a scale behind.
    asked, cold = new_history(), new_history()
    record([asked, cold], MONDAY, MONDAY + DAY)
    nine = hour_of_week(MONDAY + 9 * HOUR)
    shares, seconds = asked.hour_of_day_distribution(nine)
    # Later hours only: 09:00's shares are kept, its seconds decay with the time read.
    record([asked, cold], MONDAY + DAY, MONDAY + DAY + 5 * HOUR)
    again, later = asked.hour_of_day_distribution(nine)
    fresh, fresh_seconds = cold.hour_of_day_distribution(nine)
    assert again is shares
    assert again == fresh
    assert later == pytest.approx(fresh_seconds, rel=1e-12)
    assert later < seconds
    # A new half-life rebases the tables (the scale they are stored at changes).
    settings = dataclasses.replace(asked.settings, hour_of_week_half_life_s=DAY)
    for history in (asked, cold):
        history.reconfigure(settings)
    record([asked, cold], MONDAY + DAY + 5 * HOUR, MONDAY + DAY + 6 * HOUR)
    again, later = asked.hour_of_day_distribution(nine)
    rebuilt = new_history()
    record([rebuilt], MONDAY, MONDAY + DAY + 5 * HOUR)
    rebuilt.reconfigure(settings)
    record([rebuilt], MONDAY + DAY + 5 * HOUR, MONDAY + DAY + 6 * HOUR)
    expected, fresh_seconds = rebuilt.hour_of_day_distribution(nine)
    assert again == expected
    assert later == pytest.approx(fresh_seconds, rel=1e-12)


def _epoch_afresh(config: Settings, now: float) -> tuple[float, float]:
    # `_next_epoch` as it read before it kept anything.
    close = next_close(config.windows, datetime.fromtimestamp(now, timezone.utc))
    return close.timestamp(), next_open(config.windows, close).timestamp()


def test_a_kept_epoch_ends_when_a_window_opens() -> None:
    twice = Settings.model_validate(
        tables(
            windows=[
                {"cron": "0 7 * * *", "duration_s": 3600},
                {"cron": "0 19 * * *", "duration_s": 3600},
            ]
        )
    )
    nightly = Settings.model_validate(tables(windows=[{"cron": "30 2 * * *", "duration_s": 1800}]))
    # Chains: 07:00-08:30 (overlapping), 09:00-10:00 (touching), 22:00-23:00 inside 21-24.
    chained = Settings.model_validate(
        tables(
            windows=[
                {"cron": "0 7 * * *", "duration_s": 3600},
                {"cron": "30 7 * * *", "duration_s": 3600},
                {"cron": "0 9 * * *", "duration_s": 1800},
                {"cron": "30 9 * * *", "duration_s": 1800},
                {"cron": "0 21 * * *", "duration_s": 3 * 3600},
                {"cron": "0 22 * * *", "duration_s": 3600},
            ]
        )
    )
    seven = MONDAY + 7 * HOUR
    times = [MONDAY + minutes * 60.0 for minutes in range(0, 2 * 24 * 60, 7)]
    # Around an opening: just before it (to the microsecond and below), at it, inside.
    times += [seven - 1.0, seven - 1e-3, seven - 1e-6, seven - 1e-7, seven, seven + 1.0]
    times += [seven + HOUR - 1e-6, seven + HOUR, seven + HOUR + 1.0]
    # Inside the chains and at their joints and ends.
    for at_hour in (7.5, 8.0, 8.5, 9.0, 9.5, 10.0, 22.0, 23.0, 24.0):
        edge = MONDAY + at_hour * HOUR
        times += [edge - 1e-3, edge - 1e-6, edge, edge + 1e-6, edge + 1.0]
    times.sort()
    for now in times:
        # Configurations read in turn: each keeps its own epoch.
        for config in (twice, nightly, chained):
            assert _next_epoch(config, now) == _epoch_afresh(config, now), (config, now)
    # Back in time: the kept epoch does not hold before the time it was found at.
    for now in (seven + 2 * HOUR, MONDAY + HOUR, seven - 1.0):
        assert _next_epoch(twice, now) == _epoch_afresh(twice, now)


@pytest.mark.parametrize(
    "windows",
    [
        pytest.param([{"cron": "0 3 * * *", "duration_s": 3600}], id="daily"),
        pytest.param(
            [{"cron": "0 7 * * *", "duration_s": 3600}, {"cron": "0 19 * * *", "duration_s": 3600}],
            id="twice-a-day",
        ),
        pytest.param([{"cron": "0 3 * * sat", "duration_s": 7200}], id="weekly"),
    ],
)
def test_an_explorations_epoch_end_is_the_window_walk_afresh(windows: list[dict]) -> None:
    config = Settings.model_validate(tables(windows=windows))
    other = Settings.model_validate(tables(windows=[{"cron": "0 12 * * *", "duration_s": 600}]))
    starts = [MONDAY + minutes * 60.0 for minutes in range(0, 8 * 24 * 60, 53)]
    starts += [MONDAY + 3 * HOUR + d for d in (-1.0, -1e-6, 0.0, 1e-6, 1.0, HOUR, HOUR + 1.0)]
    for started in starts:
        # Twice each, another configuration read in between: each keeps its own.
        for _ in range(2):
            for settings in (config, other):
                at = datetime.fromtimestamp(started + 1.0, tz=timezone.utc)
                afresh = next_open(settings.windows, at).timestamp()
                assert epoch_end(settings, started) == afresh, (settings.windows, started)


def test_one_keys_throughput_cells_follow_every_observation() -> None:
    asked, cold = new_history(), new_history()
    t = MONDAY
    served = 0.0
    for i in range(60):
        steps, offered = (3, 1 + i % 5) if i < 30 else (4, 1 + i % 7)
        served += 1000.0 * offered
        for history in (asked, cold):
            history.record(
                dataclasses.replace(
                    observation(t, offered, steps=steps),
                    decode_tokens_total=served,
                    gen_throughput=None,
                )
            )
        for key in (3, 4, 5):
            table = cold.throughput_table().items()
            expected = [(c, v) for (k, c), v in table if k == key and c > 0]
            assert list(asked.throughput_cells(key).items()) == expected
        grouped: dict[int, list[tuple[int, tuple[float, float]]]] = {}
        for (k, c), v in cold.throughput_table().items():
            if c > 0:
                grouped.setdefault(k, []).append((c, v))
        every = asked.throughput_by_key()
        assert [(k, list(cells.items())) for k, cells in every.items()] == list(grouped.items())
        t += 60
    assert asked.throughput_cells(4)


def test_every_hour_of_the_day_at_once_reads_as_each_alone() -> None:
    asked, cold = new_history(), new_history()
    t = MONDAY
    while t < MONDAY + 2 * DAY:
        for history in (asked, cold):
            history.record(observation(t, office(t) + int(t // 600) % 3))
        every = asked.hour_of_day_distributions()  # first: a kept hour is read as kept
        alone = [asked.hour_of_day_distribution(hour) for hour in range(24)]
        assert every == alone
        fresh = [cold.hour_of_day_distribution(hour) for hour in range(24)]
        assert [shares for shares, _ in every] == [shares for shares, _ in fresh]
        t += 600


@pytest.mark.parametrize(
    "mapping", [{1: (1, 3, 5, 7), 8: (0, 1, 3), 32: (0, 1), 64: (0,)}, {1: (2,)}, {4: (6, 1)}]
)
def test_a_slots_candidates_are_the_same_kept(mapping: dict[int, tuple[int, ...]]) -> None:
    slots = Slots.of(mapping)
    expected = sorted({k for ks in mapping.values() for k in ks})
    assert list(slots.candidate_steps) == slots.candidates() == expected
    listed = slots.candidates()
    listed.append(99)  # a list of the caller's own: the kept tuple is not affected
    assert slots.candidates() == expected == list(Slots.of(mapping).candidate_steps)
