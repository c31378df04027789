"""The memos the brain keeps across ticks (issue 12's decision cost) return what computing
afresh returns: the same numbers, bit for bit, and new ones as soon as an input changed.

Each test runs one history twice — one asked at every step (its memos filled and reused),
one asked only at the end (nothing memoized) — or compares with a value built anew.
"""

from __future__ import annotations

import dataclasses

import pytest
from factories import make_observation, seed_table

from specd.core.adaptive import DEFAULT_SLOTS, Slots
from specd.core.forecast import forecast_epoch
from specd.core.history import History, HistorySettings, hour_of_week
from specd.core.model import Calibration, PerformanceModel
from specd.core.observation import Observation
from specd.core.perftable import PerfRow, PerfTable

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


def test_a_kept_forecast_is_made_again_when_an_hour_of_the_epoch_changes() -> None:
    asked, cold = new_history(), new_history()
    record([asked, cold], MONDAY, MONDAY + 8 * DAY)
    # Next Wednesday 08:00–18:00: its own hours (last Wednesday) are known.
    start = MONDAY + (9 * 24 + 8) * HOUR
    before = forecast_epoch(asked, start, start + 10 * HOUR)
    assert before is not None
    assert before.source == "same hours"
    again = forecast_epoch(asked, start, start + 10 * HOUR)
    assert again == before
    # Wednesday's 10:00 hour again, a week later: 50 requests all hour. The hour's table
    # changed, so the forecast must too, exactly as a history never asked computes it.
    ten = MONDAY + (9 * 24 + 10) * HOUR
    assert hour_of_week(ten) == hour_of_week(MONDAY + (2 * 24 + 10) * HOUR)
    record([asked, cold], MONDAY + 8 * DAY, ten)  # the days between, as before
    forecast_epoch(asked, start, start + 10 * HOUR)  # kept again, then
    record([asked, cold], ten, ten + HOUR, level=50)
    after = forecast_epoch(asked, start, start + 10 * HOUR)
    assert after is not None
    assert after.weights != before.weights
    assert 50 in after.weights
    fresh = forecast_epoch(cold, start, start + 10 * HOUR)
    assert after == fresh


def test_a_kept_forecast_follows_the_other_days_of_its_kind() -> None:
    asked, cold = new_history(), new_history()
    record([asked, cold], MONDAY, MONDAY + 2 * DAY)
    # Wednesday 09:00–12:00 from Monday's and Tuesday's same hours.
    start = MONDAY + (2 * 24 + 9) * HOUR
    before = forecast_epoch(asked, start, start + 3 * HOUR)
    assert before is not None
    assert before.source == "same hours, other days"
    # Wednesday 00:00–09:00 observed: no hour of the epoch, nor of its day kind's hours
    # 09–12: the forecast is kept, and equal to a fresh one.
    record([asked, cold], MONDAY + 2 * DAY, start)
    kept = forecast_epoch(asked, start, start + 3 * HOUR)
    assert kept == before == forecast_epoch(cold, start, start + 3 * HOUR)
    # Tuesday's 10:00 hour of next week would be the same day kind: record a weekday 10:00
    # hour at 50 (Wednesday's own, the epoch's): the pooled hours change.
    record([asked, cold], start, start + 2 * HOUR, level=50)
    after = forecast_epoch(asked, start, start + 3 * HOUR)
    assert after is not None
    assert after != before
    assert after == forecast_epoch(cold, start, start + 3 * HOUR)


def test_a_kept_forecast_follows_the_same_hours_on_any_day() -> None:
    asked, cold = new_history(), new_history()
    record([asked, cold], MONDAY, MONDAY + 5 * DAY)
    # A first Saturday 09:00–12:00: no weekend seen, the weekdays' same hours stand in.
    start = MONDAY + (5 * 24 + 9) * HOUR
    before = forecast_epoch(asked, start, start + 3 * HOUR)
    assert before is not None
    assert before.source == "same hours, any day"
    assert before.mean() == pytest.approx(20.0)
    # Saturday 00:00–09:00: weekend hours, but none of the epoch's hours of the day.
    record([asked, cold], MONDAY + 5 * DAY, start)
    kept = forecast_epoch(asked, start, start + 3 * HOUR)
    assert kept == before == forecast_epoch(cold, start, start + 3 * HOUR)
    # Weekday 10:00 hours on another weekday (next week's Monday) at 50: the weekdays' same
    # hours change, and with them the forecast of a Saturday that has none of its own.
    monday_10 = MONDAY + (7 * 24 + 10) * HOUR
    record([asked, cold], monday_10, monday_10 + HOUR, level=50)
    after = forecast_epoch(asked, start, start + 3 * HOUR)
    assert after is not None
    assert after != before
    assert after == forecast_epoch(cold, start, start + 3 * HOUR)
    distribution, seconds = asked.hour_of_day_distribution(hour_of_week(monday_10))
    again, _ = asked.hour_of_day_distribution(hour_of_week(monday_10))
    assert again is distribution
    assert distribution is not None
    assert 50 in distribution
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
