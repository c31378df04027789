from __future__ import annotations

import json
import math
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any

import pytest
from factories import make_observation, tables

from specd.core.acceptance import accept_length_from_alpha
from specd.core.history import (
    HOURS_PER_WEEK,
    MAX_ADAPTIVE_KEYS,
    History,
    HistorySettings,
    Recorded,
    concurrency_bin,
    hour_of_week,
    is_weekend_hour,
)
from specd.core.observation import Observation
from specd.core.setting import config_key
from specd.core.settings import Settings

T0 = 1_767_225_600.0  # 2026-01-01 00:00 UTC, a Thursday


def obs(
    t: float,
    running: int = 0,
    queued: int = 0,
    *,
    steps: int | None = 4,
    accept_length: float | None = None,
    spec_fresh: bool | None = None,
    max_running_requests: int | None = None,
    gen_throughput: float | None = None,
    decode_tokens_total: float | None = None,
    generation_tokens_total: float | None = None,
) -> Observation:
    return make_observation(
        t,
        running=running,
        queued=queued,
        accept_length=accept_length,
        spec_fresh=running > 0 if spec_fresh is None else spec_fresh,
        steps=steps,
        max_running_requests=max_running_requests,
        gen_throughput=gen_throughput,
        generation_tokens_total=generation_tokens_total,
        decode_tokens_total=decode_tokens_total,
    )


# Decay so slow that sums are plain sums within a test's time span.
NO_DECAY = HistorySettings(
    half_life_s=1e12, warmup_exclude_s=120, scrape_interval_s=5, hour_of_week_half_life_s=1e12
)


def feed(history: History, offered: list[int], *, start: float = T0, every: float = 5.0) -> float:
    t = start
    for value in offered:
        history.record(obs(t, running=value))
        t += every
    return t - every


@pytest.mark.parametrize(
    ("offered", "every", "observed", "busy"),
    [
        # The first observation stands for one nominal interval, later ones for the gap.
        ([3], 5.0, 5.0, 5.0),
        ([0, 0, 2], 5.0, 15.0, 5.0),
        ([1, 1, 1, 1], 3.0, 5.0 + 9.0, 14.0),
        # A gap longer than two scrape intervals is not traffic: capped at 10 s.
        ([4, 4], 3600.0, 15.0, 15.0),
    ],
    ids=["first", "idle-then-busy", "short-interval", "gap-capped"],
)
def test_time_weighting(offered: list[int], every: float, observed: float, busy: float) -> None:
    history = History(NO_DECAY)
    feed(history, offered, every=every)
    assert history.observed_seconds == pytest.approx(observed)
    assert history.busy_seconds == pytest.approx(busy)


@pytest.mark.parametrize(
    ("offered", "q", "busy_only", "expected"),
    [
        ([1, 1, 1, 10], 0.5, True, 1.0),
        ([1, 1, 1, 10], 0.74, True, 1.0),
        ([1, 1, 1, 10], 0.76, True, 10.0),
        ([1, 1, 1, 10], 1.0, True, 10.0),
        ([1, 1, 1, 10], 0.0, True, 1.0),
        ([0, 0, 0, 0, 0, 0, 7, 9], 0.5, True, 7.0),
        ([0, 0, 0, 0, 0, 0, 7, 9], 0.5, False, 0.0),
        ([0, 0, 0], 0.5, True, None),
        ([0, 0, 0], 0.5, False, 0.0),
        ([], 0.5, False, None),
        ([3, 20, 5, 4, 11], 0.5, True, 5.0),
    ],
)
def test_quantile(offered: list[int], q: float, busy_only: bool, expected: float | None) -> None:
    history = History(NO_DECAY)
    feed(history, offered)
    assert history.quantile(q, busy_only=busy_only) == expected


@pytest.mark.parametrize("q", [-0.1, 1.5, math.nan])
def test_quantile_rejects_impossible_ratios(q: float) -> None:
    history = History(NO_DECAY)
    feed(history, [1, 2])
    with pytest.raises(ValueError, match="outside"):
        history.quantile(q)


@pytest.mark.parametrize(
    ("half_lives_later", "expected_busy"),
    [(0.0, 100.0), (1.0, 50.0), (2.0, 25.0), (10.0, 100.0 / 1024)],
)
def test_decay_halves_old_traffic_per_half_life(
    half_lives_later: float, expected_busy: float
) -> None:
    settings = HistorySettings(half_life_s=100, warmup_exclude_s=0, scrape_interval_s=100)
    history = History(settings)
    history.record(obs(T0, running=5))  # 100 s busy at T0
    if half_lives_later:
        # An idle observation moves "now" forward without adding busy time.
        history.record(obs(T0 + 100 * half_lives_later, running=0))
    assert history.busy_seconds == pytest.approx(expected_busy)


def test_recent_traffic_outweighs_old_traffic() -> None:
    settings = HistorySettings(half_life_s=600, warmup_exclude_s=0, scrape_interval_s=5)
    history = History(settings)
    end = feed(history, [2] * 120)  # 10 min of light traffic
    feed(history, [30] * 84, start=end + 5)  # then 7 min heavy: shorter, but recent
    assert history.quantile(0.5) == 30.0


def test_rebasing_keeps_values_across_many_half_lives() -> None:
    settings = HistorySettings(half_life_s=10, warmup_exclude_s=0, scrape_interval_s=5)
    history = History(settings)
    t = T0
    for _ in range(2000):  # 10,000 s = 1,000 half-lives: would overflow without rebasing
        history.record(obs(t, running=3))
        t += 5
    # A steady state: 5 s per record, decaying; sum = 5 / (1 - 2^-0.5)
    assert history.busy_seconds == pytest.approx(5 / (1 - 2**-0.5), rel=1e-9)
    assert all(math.isfinite(v) for v in history.offered_weights().values())


@pytest.mark.parametrize(
    ("events", "results", "busy"),
    [
        # mark at T0: T0+60 is inside warm-up (120 s); T0+120 is the first counted one.
        (
            [("mark", T0), ("obs", T0 + 60), ("obs", T0 + 115), ("obs", T0 + 120)],
            [Recorded.WARMUP, Recorded.WARMUP, Recorded.COUNTED],
            5.0,
        ),
        # Counters going backwards reveal a restart specd did not make.
        (
            [("obs", T0, 1000.0), ("obs", T0 + 5, 50.0), ("obs", T0 + 10, 60.0)],
            [Recorded.COUNTED, Recorded.RESTART_DETECTED, Recorded.WARMUP],
            5.0,
        ),
        # A clock stepping back is skipped, and counting resumes after it.
        (
            [("obs", T0), ("obs", T0 - 30), ("obs", T0 - 25)],
            [Recorded.COUNTED, Recorded.OUT_OF_ORDER, Recorded.COUNTED],
            10.0,
        ),
        (
            [("obs", T0), ("obs", T0)],
            [Recorded.COUNTED, Recorded.OUT_OF_ORDER],
            5.0,
        ),
        # A start in the future (clock stepped back after it) does not exclude forever.
        (
            [("mark", T0 + 3600), ("obs", T0)],
            [Recorded.COUNTED],
            5.0,
        ),
    ],
    ids=["marked-start", "counters-back", "clock-back", "same-time", "start-in-future"],
)
def test_warmup_and_restarts(
    events: list[tuple[Any, ...]], results: list[Recorded], busy: float
) -> None:
    history = History(NO_DECAY)
    seen = []
    for kind, t, *counter in events:
        if kind == "mark":
            history.mark_sglang_start(t)
        else:
            total = counter[0] if counter else None
            seen.append(history.record(obs(t, running=2, generation_tokens_total=total)))
    assert seen == results
    assert history.busy_seconds == pytest.approx(busy)


def test_step_change_is_a_restart() -> None:
    history = History(NO_DECAY)
    assert history.record(obs(T0, running=1, steps=4)) is Recorded.COUNTED
    assert history.record(obs(T0 + 5, running=1, steps=3)) is Recorded.RESTART_DETECTED
    assert history.sglang_started_at == T0 + 5
    assert history.record(obs(T0 + 10, running=1, steps=3)) is Recorded.WARMUP


def test_adaptive_tiers_are_neither_restarts_nor_evidence_for_a_step_count() -> None:
    history = History(NO_DECAY)
    t = T0
    for i in range(40):  # SGLang's adaptive mode moves between its tiers every few seconds
        step = 3 if i % 3 else 4
        seen = make_observation(
            t,
            running=6,
            steps=step,
            adaptive=True,
            decode_tokens_total=1000.0 * i,
            accept_length=2.5,
            max_running_requests=13,
        )
        assert history.record(seen) is Recorded.COUNTED
        t += 5
    assert history.sglang_started_at is None
    assert history.busy_seconds == pytest.approx(40 * 5)
    assert history.throughput_table() == {}
    assert history.accept_seconds(3) == history.accept_seconds(4) == 0
    assert history.capacities == {}


def test_a_marked_start_is_not_detected_again_on_the_new_step_count() -> None:
    history = History(NO_DECAY)
    history.record(obs(T0, running=1, steps=4))
    history.mark_sglang_start(T0 + 100)
    history.record(obs(T0 + 300, running=1, steps=3))
    assert history.sglang_started_at == T0 + 100


@pytest.mark.parametrize(
    ("samples", "steps", "length"),
    [
        # Time-weighted: 3.0 held for 5 s, 2.0 for 15 s.
        ([(0, 3.0, True, 4), (15, 2.0, True, 4)], 4, (3.0 * 5 + 2.0 * 10) / 15),
        # Stale gauges (idle server) are ignored.
        ([(0, 3.0, True, 4), (5, 1.2, False, 4)], 4, 3.0),
        # Per step count; the change of steps is a restart, so its warm-up is skipped.
        ([(0, 3.0, True, 4), (5, 1.2, True, 1), (130, 1.8, True, 1)], 1, 1.8),
        # Unknown step count, impossible or missing lengths: nothing learned.
        ([(0, 3.0, True, None)], 4, None),
        ([(0, 0.0, True, 4), (5, math.nan, True, 4), (10, None, True, 4)], 4, None),
    ],
    ids=["time-weighted", "stale-ignored", "per-steps", "unknown-steps", "garbage"],
)
def test_accept_length_per_steps(
    samples: list[tuple[float, float | None, bool, int | None]],
    steps: int,
    length: float | None,
) -> None:
    history = History(NO_DECAY)
    for dt, value, fresh, k in samples:
        history.record(obs(T0 + dt, running=1, steps=k, accept_length=value, spec_fresh=fresh))
    if length is None:
        assert history.accept_length(steps) is None
        assert history.alpha(steps) is None
    else:
        assert history.accept_length(steps) == pytest.approx(length)


def test_acceptance_evidence_decays_but_how_much_was_measured_does_not() -> None:
    history = History(HistorySettings(half_life_s=3600, warmup_exclude_s=0, scrape_interval_s=5))
    t = T0
    for _ in range(720):  # an hour at 3 steps
        history.record(obs(t, running=2, steps=3, accept_length=2.1))
        t += 5
    measured, recent = history.accept_seen_s(3), history.accept_seconds(3)
    assert measured == pytest.approx(3600.0, rel=0.01)
    assert recent < measured  # the hour's first minutes have decayed already
    # Three hours under an adaptive set: no accept length of a step count is recorded.
    while t < T0 + 4 * 3600:
        history.record(
            make_observation(
                t, running=2, steps=3, accept_length=2.4, spec_fresh=True, adaptive=True
            )
        )
        t += 60
    assert history.accept_seconds(3) == pytest.approx(recent / 8, rel=0.02)
    assert history.accept_seen_s(3) == measured
    assert history.accept_length(3) == pytest.approx(2.1)
    assert history.accept_seen_s(4) == 0.0


@pytest.mark.parametrize(("alpha", "steps"), [(0.6, 1), (0.7, 3), (0.85, 4), (0.0, 2)])
def test_alpha_is_inverted_from_the_accept_length(alpha: float, steps: int) -> None:
    history = History(NO_DECAY)
    length = accept_length_from_alpha(alpha, steps)
    history.record(obs(T0, running=1, steps=steps, accept_length=length))
    assert history.alpha(steps) == pytest.approx(alpha, abs=1e-6)


@pytest.mark.parametrize(
    ("samples", "expected"),
    [
        # The decode counter over the interval wins (500 tokens in 5 s = 100 tok/s) over
        # the gauge (90); the first sample has no previous counter, so its gauge (80) counts.
        ([(0, 2, 1000.0, 80.0), (5, 2, 1500.0, 90.0)], {(4, 2): 90.0}),
        # Without a previous counter value, the gauge is used.
        ([(0, 2, None, 80.0)], {(4, 2): 80.0}),
        # A counter that went back (restart) is not a rate; that sample is warm-up anyway.
        ([(0, 3, 5000.0, 80.0), (5, 3, 10.0, 90.0)], {(4, 3): 80.0}),
        # Idle time says nothing about throughput.
        ([(0, 0, None, 0.0)], {}),
    ],
    ids=["counter", "gauge", "counter-back", "idle"],
)
def test_throughput_per_steps_and_concurrency(
    samples: list[tuple[float, int, float | None, float]],
    expected: dict[tuple[int, int], float],
) -> None:
    history = History(NO_DECAY)
    for dt, running, counter, gauge in samples:
        history.record(
            obs(T0 + dt, running=running, decode_tokens_total=counter, gen_throughput=gauge)
        )
    table = {key: mean for key, (mean, _) in history.throughput_table().items()}
    assert table == pytest.approx(expected)
    for (steps, conc), value in expected.items():
        assert history.throughput(steps, conc) == pytest.approx(value)


def test_capacity_is_the_latest_per_steps_even_during_warmup() -> None:
    history = History(NO_DECAY)
    history.record(obs(T0, steps=4, max_running_requests=13))
    history.record(obs(T0 + 5, steps=4, max_running_requests=12))
    history.mark_sglang_start(T0 + 10)
    assert history.record(obs(T0 + 15, steps=3, max_running_requests=15)) is Recorded.WARMUP
    assert history.capacities == {4: 12, 3: 15}
    assert history.capacity(1) is None


@pytest.mark.parametrize(
    ("when", "expected"),
    [
        (datetime(2024, 1, 1, 0, 0, tzinfo=timezone.utc), 0),  # a Monday
        (datetime(2024, 1, 1, 0, 59, 59, tzinfo=timezone.utc), 0),
        (datetime(2024, 1, 3, 14, 30, tzinfo=timezone.utc), 2 * 24 + 14),
        (datetime(2024, 1, 7, 23, 59, tzinfo=timezone.utc), HOURS_PER_WEEK - 1),
        (datetime(1970, 1, 1, 0, 0, tzinfo=timezone.utc), 72),  # a Thursday
        (datetime(1969, 12, 29, 0, 0, tzinfo=timezone.utc), 0),  # negative unix time
    ],
)
def test_hour_of_week(when: datetime, expected: int) -> None:
    assert hour_of_week(when.timestamp()) == expected


def test_hour_of_week_buckets_forecast_the_same_hours() -> None:
    history = History(NO_DECAY)
    monday_9 = datetime(2026, 1, 5, 9, 0, tzinfo=timezone.utc).timestamp()
    for day in range(3):  # Monday to Wednesday, 09:00–09:10 busy at 20, 15:00 at 2
        feed(history, [20] * 120, start=monday_9 + day * 86400)
        feed(history, [2] * 120, start=monday_9 + day * 86400 + 6 * 3600)
    mornings = [hour_of_week(monday_9) + 24 * d for d in range(3)]
    afternoons = [h + 6 for h in mornings]
    assert history.hours_quantile(mornings, 0.5) == 20.0
    assert history.hours_quantile(afternoons, 0.5) == 2.0
    assert history.hours_quantile([h + 1 for h in mornings], 0.5) is None
    weights = history.hour_of_week_weights(mornings[0])
    assert weights == pytest.approx({20: 600.0})
    assert history.quantile(0.5) in (2.0, 20.0)


def _same_kind_sum(history: History, how: int) -> dict[int, float]:
    """The hourly tables of ``how``'s hour of the day on days of its kind, merged by hand."""
    merged: dict[int, float] = {}
    for day in range(7):
        other = day * 24 + how % 24
        if is_weekend_hour(other) == is_weekend_hour(how):
            for k, w in history.hour_of_week_weights(other).items():
                merged[k] = merged.get(k, 0.0) + w
    return merged


def _moments(tables: list[dict[int, float]]) -> tuple[float, float]:
    """(seconds, seconds × offered) of the tables together."""
    return (
        sum(w for table in tables for w in table.values()),
        sum(k * w for table in tables for k, w in table.items()),
    )


def test_day_kind_weights_and_moments_are_the_same_hours_of_days_summed() -> None:
    settings = HistorySettings(
        half_life_s=3600,
        hour_of_week_half_life_s=2 * 86400,
        warmup_exclude_s=0,
        scrape_interval_s=600,
    )
    history = History(settings)
    t = T0
    for i in range(10 * 144):  # ten days every 10 minutes, offered 0..9 by hour and day
        history.record(obs(t, running=(i // 6 + i // 144) % 10))
        t += 600
    checks = [history]
    checks.append(History.from_dict(json.loads(json.dumps(history.to_dict())), settings))
    history.reconfigure(
        HistorySettings(
            half_life_s=3600,
            hour_of_week_half_life_s=86400,
            warmup_exclude_s=0,
            scrape_interval_s=600,
        )
    )
    for k in (history, *checks[1:]):
        k.record(obs(t, running=3))
    for checked in (history, *checks[1:]):
        for how in range(HOURS_PER_WEEK):
            expected = _same_kind_sum(checked, how)
            assert checked.day_kind_weights(how) == pytest.approx(expected, rel=1e-9), how
            every = [checked.hour_of_week_weights(day * 24 + how % 24) for day in range(7)]
            moments = [
                _moments([checked.hour_of_week_weights(how)]),
                _moments([expected]),
                _moments(every),
            ]
            got = [x for pair in checked.hour_moments(how) for x in pair]
            assert got == pytest.approx([x for pair in moments for x in pair], rel=1e-9), how
    assert any(history.day_kind_weights(how) for how in range(HOURS_PER_WEEK))


def test_round_trip_through_json_keeps_every_query() -> None:
    settings = HistorySettings(half_life_s=3600, warmup_exclude_s=10, scrape_interval_s=5)
    history = History(settings)
    t = T0
    for i in range(400):
        history.record(
            obs(
                t,
                running=i % 7,
                queued=i % 3,
                steps=4 if i < 200 else 3,
                accept_length=2.5 if i < 200 else 2.1,
                max_running_requests=13 if i < 200 else 15,
                decode_tokens_total=100.0 * i,
                generation_tokens_total=90.0 * i,
            )
        )
        t += 5
    text = json.dumps(history.to_dict(), allow_nan=False)
    back = History.from_dict(json.loads(text))
    assert back.settings == settings
    for q in (0.1, 0.5, 0.9, 1.0):
        assert back.quantile(q) == history.quantile(q)
    assert back.busy_seconds == pytest.approx(history.busy_seconds)
    assert back.observed_seconds == pytest.approx(history.observed_seconds)
    for k in (3, 4):
        assert back.accept_length(k) == pytest.approx(history.accept_length(k))
        assert back.accept_seen_s(k) == pytest.approx(history.accept_seen_s(k))
    assert back.capacities == history.capacities
    assert back.throughput_table().keys() == history.throughput_table().keys()
    for key, (mean, weight) in history.throughput_table().items():
        assert back.throughput_table()[key] == pytest.approx((mean, weight))
    for how in range(HOURS_PER_WEEK):
        assert back.hour_of_week_weights(how) == pytest.approx(history.hour_of_week_weights(how))
    assert back.sglang_started_at == history.sglang_started_at
    # The restored history continues where the old one stopped.
    assert back.record(obs(t, running=2, steps=3, generation_tokens_total=90.0 * 400)) is (
        history.record(obs(t, running=2, steps=3, generation_tokens_total=90.0 * 400))
    )
    assert back.busy_seconds == pytest.approx(history.busy_seconds)


@pytest.mark.parametrize("step", [86400.0, -86400.0, -600.0])
def test_a_history_moved_with_a_stepped_clock_learns_on_as_one_on_a_steady_clock(
    step: float,
) -> None:
    """The daemon moves the history when the wall clock is stepped (`History.shift`). Left
    where it was, a day forward decayed everything learned by a day at once, and a day back
    refused every observation as out of order until the clock caught up."""
    settings = HistorySettings(half_life_s=3600, warmup_exclude_s=10, scrape_interval_s=5)
    steady, stepped = History(settings), History(settings)

    def seen(i: int, t: float) -> Observation:
        return obs(
            t,
            running=i % 7,
            steps=4 if i < 100 else 3,
            accept_length=2.5,
            decode_tokens_total=100.0 * i,
            generation_tokens_total=90.0 * i,
        )

    for i in range(200):
        assert stepped.record(seen(i, T0 + 5 * i)) is steady.record(seen(i, T0 + 5 * i))
    stepped.mark_sglang_start(T0 + 900)
    steady.mark_sglang_start(T0 + 900)
    stepped.shift(step)
    for i in range(200, 400):
        t = T0 + 5 * i
        assert stepped.record(seen(i, t + step)) is steady.record(seen(i, t))
    assert steady.last_t is not None
    assert stepped.last_t == steady.last_t + step
    assert stepped.sglang_started_at == T0 + 900 + step
    assert stepped.busy_seconds == pytest.approx(steady.busy_seconds)
    assert stepped.offered_weights() == pytest.approx(steady.offered_weights())
    for k in (3, 4):
        assert stepped.accept_length(k) == pytest.approx(steady.accept_length(k))
    table = stepped.throughput_table()
    assert table.keys() == steady.throughput_table().keys()
    for key, (mean, weight) in steady.throughput_table().items():
        assert table[key] == pytest.approx((mean, weight))


def test_settings_from_the_config_win_over_stored_ones() -> None:
    history = History(NO_DECAY)
    feed(history, [1, 2, 3])
    fresh = HistorySettings(half_life_s=60, warmup_exclude_s=0, scrape_interval_s=1)
    assert History.from_dict(history.to_dict(), fresh).settings == fresh


def test_reconfigure_keeps_what_was_learned() -> None:
    settings = HistorySettings(half_life_s=100, warmup_exclude_s=0, scrape_interval_s=100)
    history = History(settings)
    history.record(obs(T0, running=5))
    history.record(obs(T0 + 100, running=0))  # bin 5 has decayed to 50 s
    history.reconfigure(HistorySettings(half_life_s=50, warmup_exclude_s=0, scrape_interval_s=100))
    assert history.busy_seconds == pytest.approx(50.0)
    history.record(obs(T0 + 150, running=0))  # one new half-life: 25 s
    assert history.busy_seconds == pytest.approx(25.0)


def _valid() -> dict[str, Any]:
    history = History(NO_DECAY)
    feed(history, [1, 2])
    return history.to_dict()


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(format=99), "unknown format"),
        (lambda d: d.update(settings="x"), "settings"),
        (lambda d: d["settings"].update(half_life_s=-1), "half_life_s"),
        (lambda d: d["settings"].update(scrape_interval_s="5"), "scrape_interval_s"),
        (lambda d: d.update(last_t="yesterday"), "last_t"),
        (lambda d: d.update(offered=[]), "expected an object"),
        (lambda d: d["offered"].update(cells=[[1]]), "cells"),
        (lambda d: d["offered"].update(cells=[[-1, 5.0]]), "non-negative"),
        (lambda d: d["offered"].update(cells=[[1, -5.0]]), "negative weight"),
        (lambda d: d["offered"].update(ref_t=None), "ref_t"),
        (lambda d: d["throughput"].update(cells=[[4, 1.0, 1.0]]), "steps, concurrency"),
        (lambda d: d.update(capacity=[[4]]), "capacity"),
        (lambda d: d.update(hourly=[]), "hourly"),
        (lambda d: d.update(counters=[]), "counters"),
        (lambda d: d.update(last_steps=True), "non-negative integer"),
    ],
)
def test_malformed_history_is_a_one_line_value_error(mutate: Any, message: str) -> None:
    data = _valid()
    mutate(data)
    with pytest.raises(ValueError, match=message) as info:
        History.from_dict(data)
    assert str(info.value).startswith("history")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "kwargs",
    [{"half_life_s": 0}, {"scrape_interval_s": -5}, {"warmup_exclude_s": math.inf}],
)
def test_settings_validate(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        HistorySettings(**kwargs)


def test_settings_from_config() -> None:
    config = Settings.model_validate(
        tables(history_half_life_s=7200, warmup_exclude_s=30, scrape_interval_s=2)
    )
    assert HistorySettings.from_config(config) == HistorySettings(
        half_life_s=7200, warmup_exclude_s=30, scrape_interval_s=2
    )


@pytest.mark.parametrize(
    ("offered", "key"),
    [
        *((0, 0), (1, 1), (255, 255), (256, 256), (257, 256), (263, 256), (264, 264)),
        *((511, 504), (512, 512), (1000, 992), (1023, 1008), (100_000, 98_304)),
        (10**8, 98_566_144),
    ],
)
def test_a_concurrency_is_learned_exactly_to_256_then_in_bins_of_a_32nd_doubling(
    offered: int, key: int
) -> None:
    assert concurrency_bin(offered) == key
    assert offered - key <= offered / 32


def test_a_queue_of_a_new_length_every_second_adds_no_more_than_the_bins() -> None:
    # A batch queue whose length differs at every scrape: each length used to be a cell of
    # the offered, throughput and hour-of-week tables, kept for weeks as it decayed.
    history = History(replace(NO_DECAY, scrape_interval_s=1.0, warmup_exclude_s=0))
    for i in range(20_000):
        queued = (i * 7919) % 200_000  # every length once, all over the range
        history.record(
            obs(T0 + i, running=64, queued=queued, max_running_requests=64, gen_throughput=900.0)
        )
    data = history.to_dict()
    bins = 257 + 32 * math.ceil(math.log2(200_064 / 256))
    assert len(data["offered"]["cells"]) <= bins
    assert len(data["throughput"]["cells"]) <= bins
    assert sum(len(h["cells"]) for h in data["hourly"] if h is not None) <= 6 * bins
    # The time and the mean stay whole.
    assert history.busy_seconds == pytest.approx(20_000.0, rel=0.01)
    assert history.throughput(4, concurrency_bin(64 + 150_000)) == pytest.approx(900.0)


def test_a_history_from_before_the_bins_is_merged_into_them_as_it_loads() -> None:
    history = History(NO_DECAY)
    history.record(obs(T0, running=1, gen_throughput=100.0))
    data = history.to_dict()
    data["offered"]["cells"] += [[1000, 30.0], [1001, 10.0], [1023, 20.0]]
    data["throughput"]["cells"] += [[[4, 1000], 30.0, 30.0 * 200], [[4, 1001], 10.0, 10.0 * 600]]
    dropped: list[str] = []
    loaded = History.from_dict(data, NO_DECAY, dropped, now=T0)
    assert dropped == []
    weights = loaded.offered_weights()
    assert weights[992] == pytest.approx(30.0 + 10.0)
    assert weights[1008] == pytest.approx(20.0)
    assert loaded.throughput(4, 992) == pytest.approx(300.0)  # weighted: (30·200 + 10·600) / 40


def test_adaptive_sets_learned_at_once_are_bounded() -> None:
    """An SGLang naming another adaptive config file at every scrape made a throughput key
    per scrape: the history, the state file and each tick's cost grew without end (700
    cells an hour at 5 s scrapes). At most MAX_ADAPTIVE_KEYS sets are kept, the one
    observed least making room; the set that runs for real keeps what it learned."""
    history = History(NO_DECAY)
    served, t = 0.0, 1000.0
    main_set = "/var/lib/specd/adaptive-main.json"
    for i in range(400):
        # Every other scrape the real set; between them a name never seen before.
        name = main_set if i % 2 == 0 else f"/tmp/hostile-{i}.json"
        history.record(
            make_observation(
                t,
                running=4,
                spec_fresh=False,
                steps=None,
                adaptive=True,
                adaptive_config=name,
                decode_tokens_total=served,
                version="test",
            )
        )
        served += 500.0 * 5
        t += 5.0
    keys = {key for key in history.throughput_by_key() if key < 0}
    assert len(keys) <= MAX_ADAPTIVE_KEYS
    assert config_key(main_set) in keys
    assert history.throughput_cells(config_key(main_set))
