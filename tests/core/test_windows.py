from __future__ import annotations

import random
from datetime import datetime, timedelta, timezone

import pytest

from specd.core import windows
from specd.core.windows import (
    WindowSpec,
    check_window,
    current_window,
    is_open,
    next_close,
    next_open,
    parse_cron,
)

UTC = timezone.utc


def at(
    year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0
) -> datetime:
    return datetime(year, month, day, hour, minute, second, tzinfo=UTC)


DAILY_UTC = [WindowSpec("0 3 * * mon-sun", 3600, "UTC")]
BERLIN = [WindowSpec("30 2 * * mon-sun", 3600, "Europe/Berlin")]
NEW_YORK_SPRING = [WindowSpec("0 2 * * sun", 1800, "America/New_York")]
NEW_YORK_FALL = [WindowSpec("30 1 * * sun", 1800, "America/New_York")]
LORD_HOWE_END = [WindowSpec("45 1 * * mon-sun", 600, "Australia/Lord_Howe")]
LORD_HOWE_START = [WindowSpec("15 2 * * mon-sun", 600, "Australia/Lord_Howe")]
KOLKATA = [WindowSpec("0 4 * * mon-fri", 3600, "Asia/Kolkata")]
OVERLAP = [
    WindowSpec("0 3 * * mon-sun", 3600, "UTC"),
    WindowSpec("30 3 * * mon-sun", 3600, "UTC"),
]
TOUCHING = [
    WindowSpec("0 3 * * mon-sun", 3600, "UTC"),
    WindowSpec("0 4 * * mon-sun", 3600, "UTC"),
]


@pytest.mark.parametrize(
    ("windows", "now", "expected"),
    [
        # UTC: [03:00, 04:00), end exclusive.
        (DAILY_UTC, at(2025, 7, 1, 2, 59, 59), None),
        (DAILY_UTC, at(2025, 7, 1, 3, 0), (at(2025, 7, 1, 3), at(2025, 7, 1, 4))),
        (DAILY_UTC, at(2025, 7, 1, 3, 59, 59), (at(2025, 7, 1, 3), at(2025, 7, 1, 4))),
        (DAILY_UTC, at(2025, 7, 1, 4, 0), None),
        # Berlin summer: 02:30 CEST = 00:30Z.
        (BERLIN, at(2025, 7, 1, 0, 30), (at(2025, 7, 1, 0, 30), at(2025, 7, 1, 1, 30))),
        # Berlin winter: 02:30 CET = 01:30Z.
        (BERLIN, at(2025, 1, 15, 1, 30), (at(2025, 1, 15, 1, 30), at(2025, 1, 15, 2, 30))),
        # Spring forward 2025-03-30: 02:30 does not exist; opens at the jump, 03:00 CEST = 01:00Z.
        (BERLIN, at(2025, 3, 30, 0, 59, 59), None),
        (BERLIN, at(2025, 3, 30, 1, 0), (at(2025, 3, 30, 1), at(2025, 3, 30, 2))),
        (BERLIN, at(2025, 3, 30, 1, 59), (at(2025, 3, 30, 1), at(2025, 3, 30, 2))),
        (BERLIN, at(2025, 3, 30, 2, 0), None),
        # Fall back 2025-10-26: 02:30 happens twice; only the first (CEST, 00:30Z) opens.
        (BERLIN, at(2025, 10, 26, 0, 30), (at(2025, 10, 26, 0, 30), at(2025, 10, 26, 1, 30))),
        (BERLIN, at(2025, 10, 26, 1, 30), None),
        (BERLIN, at(2025, 10, 26, 2, 0), None),
        # New York spring forward 2025-03-09: 02:00 EST→03:00 EDT at 07:00Z.
        (NEW_YORK_SPRING, at(2025, 3, 9, 6, 59), None),
        (
            NEW_YORK_SPRING,
            at(2025, 3, 9, 7, 10),
            (at(2025, 3, 9, 7), at(2025, 3, 9, 7, 30)),
        ),
        # New York fall back 2025-11-02: 01:30 EDT = 05:30Z opens, 01:30 EST = 06:30Z does not.
        (
            NEW_YORK_FALL,
            at(2025, 11, 2, 5, 45),
            (at(2025, 11, 2, 5, 30), at(2025, 11, 2, 6)),
        ),
        (NEW_YORK_FALL, at(2025, 11, 2, 6, 45), None),
        # Lord Howe (half-hour DST) ends 2025-04-06 02:00 (+11) → 01:30 (+10:30):
        # 01:45 first at 14:45Z (opens), again at 15:15Z (does not).
        (
            LORD_HOWE_END,
            at(2025, 4, 5, 14, 50),
            (at(2025, 4, 5, 14, 45), at(2025, 4, 5, 14, 55)),
        ),
        (LORD_HOWE_END, at(2025, 4, 5, 15, 20), None),
        # Lord Howe starts 2025-10-05 02:00 (+10:30) → 02:30 (+11) at 15:30Z: 02:15 is
        # skipped, the window opens at the jump.
        (LORD_HOWE_START, at(2025, 10, 4, 15, 29), None),
        (
            LORD_HOWE_START,
            at(2025, 10, 4, 15, 35),
            (at(2025, 10, 4, 15, 30), at(2025, 10, 4, 15, 40)),
        ),
        # A normal Lord Howe day in (southern) winter: 02:15 +10:30 = 15:45Z the day before.
        (
            LORD_HOWE_START,
            at(2025, 7, 1, 15, 50),
            (at(2025, 7, 1, 15, 45), at(2025, 7, 1, 15, 55)),
        ),
        # Kolkata (+05:30, no DST), weekdays: Monday 2025-07-07 04:00 IST = Sunday 22:30Z.
        (KOLKATA, at(2025, 7, 6, 22, 30), (at(2025, 7, 6, 22, 30), at(2025, 7, 6, 23, 30))),
        (KOLKATA, at(2025, 7, 4, 22, 45), None),  # Saturday 04:15 IST
        # Overlapping and touching windows count as one open period.
        (OVERLAP, at(2025, 7, 1, 3, 10), (at(2025, 7, 1, 3), at(2025, 7, 1, 4, 30))),
        (OVERLAP, at(2025, 7, 1, 4, 10), (at(2025, 7, 1, 3), at(2025, 7, 1, 4, 30))),
        (TOUCHING, at(2025, 7, 1, 4, 30), (at(2025, 7, 1, 3), at(2025, 7, 1, 5))),
        ([], at(2025, 7, 1, 3, 10), None),
    ],
)
def test_current_window(
    windows: list[WindowSpec],
    now: datetime,
    expected: tuple[datetime, datetime] | None,
) -> None:
    assert current_window(windows, now) == expected
    assert is_open(windows, now) is (expected is not None)


@pytest.mark.parametrize(
    ("windows", "now", "opens", "closes"),
    [
        # Closed: the next window.
        (DAILY_UTC, at(2025, 7, 1, 1), at(2025, 7, 1, 3), at(2025, 7, 1, 4)),
        # Exactly at an opening: now, and the window it opens.
        (DAILY_UTC, at(2025, 7, 1, 3), at(2025, 7, 1, 3), at(2025, 7, 1, 4)),
        # Open: next_open is the next day's, next_close this one's.
        (DAILY_UTC, at(2025, 7, 1, 3, 30), at(2025, 7, 2, 3), at(2025, 7, 1, 4)),
        (DAILY_UTC, at(2025, 7, 1, 4), at(2025, 7, 2, 3), at(2025, 7, 2, 4)),
        # Berlin around both transitions.
        (BERLIN, at(2025, 3, 29, 12), at(2025, 3, 30, 1), at(2025, 3, 30, 2)),
        (BERLIN, at(2025, 3, 30, 2), at(2025, 3, 31, 0, 30), at(2025, 3, 31, 1, 30)),
        (BERLIN, at(2025, 10, 26, 0, 45), at(2025, 10, 27, 1, 30), at(2025, 10, 26, 1, 30)),
        (BERLIN, at(2025, 10, 26, 1, 30), at(2025, 10, 27, 1, 30), at(2025, 10, 27, 2, 30)),
        # Weekdays only: from Friday evening to Monday in Kolkata.
        (KOLKATA, at(2025, 7, 4, 12), at(2025, 7, 6, 22, 30), at(2025, 7, 6, 23, 30)),
        # Overlapping windows: the merged period closes at 04:30.
        (OVERLAP, at(2025, 7, 1, 3, 10), at(2025, 7, 2, 3), at(2025, 7, 1, 4, 30)),
    ],
)
def test_next_open_and_close(
    windows: list[WindowSpec], now: datetime, opens: datetime, closes: datetime
) -> None:
    assert next_open(windows, now) == opens
    assert next_close(windows, now) == closes


def test_fall_back_hour_opens_each_start_once() -> None:
    # APScheduler 3.11 alone repeats 02:x+01:00 forever here; we must terminate and never
    # open twice in the repeated hour.
    windows = [WindowSpec("*/20 2 * * mon-sun", 600, "Europe/Berlin")]
    now = at(2025, 10, 25, 23, 0)
    opens = []
    for _ in range(5):
        now = next_open(windows, now)
        opens.append(now)
        now = next_close(windows, now)
    assert opens == [
        at(2025, 10, 26, 0, 0),
        at(2025, 10, 26, 0, 20),
        at(2025, 10, 26, 0, 40),
        at(2025, 10, 27, 1, 0),  # 02:00 CET next day; nothing in the repeated hour
        at(2025, 10, 27, 1, 20),
    ]


def test_spring_forward_starts_in_the_gap_collapse_into_one() -> None:
    windows = [WindowSpec("*/20 2 * * mon-sun", 600, "Europe/Berlin")]
    assert next_open(windows, at(2025, 3, 30, 0, 0)) == at(2025, 3, 30, 1, 0)
    assert next_close(windows, at(2025, 3, 30, 1, 0)) == at(2025, 3, 30, 1, 10)
    assert next_open(windows, at(2025, 3, 30, 1, 0, 1)) == at(2025, 3, 31, 0, 0)


def test_windows_that_never_close_are_open() -> None:
    always = [WindowSpec("*/30 * * * *", 3600, "UTC")]
    now = at(2025, 7, 1, 12, 7)
    assert is_open(always, now)
    opened, closes = current_window(always, now) or (now, now)
    assert opened <= now - timedelta(days=7)
    assert closes >= now + timedelta(days=7)


def _chain_walked_opening_by_opening(
    configured: list[WindowSpec], now: datetime
) -> tuple[datetime, datetime] | None:
    """`current_window` as it was before CHAIN_MAX: every link of a chain, one at a time."""
    longest = timedelta(seconds=max(w.duration_s for w in configured))
    covering = [(s, e) for s, e in windows._intervals(configured, now - longest, now) if e > now]
    if not covering:
        return None
    opened = min(s for s, _ in covering)
    closes = max(e for _, e in covering)
    floor = now - windows.LOOKBACK
    while opened > floor:
        earlier = [
            s
            for s, e in windows._intervals(configured, opened - longest, opened)
            if s < opened <= e
        ]
        if not earlier:
            break
        opened = max(min(earlier), floor)
    for start, end in windows._intervals(configured, now, now + windows.LOOKBACK):
        if start > closes:
            break
        closes = max(closes, end)
    return opened, closes


@pytest.mark.parametrize(
    "configured",
    [
        # A day long each day: DST makes the Berlin ones overlap (23 h day) or leave a gap.
        [WindowSpec("0 3 * * *", 86400, "Europe/Berlin")],
        [WindowSpec("0 */6 * * *", 6 * 3600, "America/New_York")],
        [WindowSpec("*/20 1-3 * * *", 1200, "America/New_York")],
        [WindowSpec("0 1 * * mon-fri", 7200, "UTC"), WindowSpec("0 2 * * *", 7200, "UTC")],
        [WindowSpec("30 2 * * *", 3600, "Europe/Berlin"), WindowSpec("0 2 * * sun", 5400, "UTC")],
        TOUCHING,
        OVERLAP,
    ],
)
def test_a_chain_shorter_than_chain_max_reads_as_walked_link_by_link(
    configured: list[WindowSpec],
) -> None:
    rng = random.Random(repr(configured))
    # Around both of 2025's DST changes in Europe and North America.
    for start in (at(2025, 3, 7), at(2025, 10, 24)):
        for _ in range(40):
            now = start + timedelta(seconds=rng.randrange(10 * 86400))
            expected = _chain_walked_opening_by_opening(configured, now)
            assert current_window(configured, now) == expected, now


@pytest.mark.parametrize(
    ("configured", "back"),
    [
        ([WindowSpec("*/20 * * * * *", 10, "UTC")], timedelta(days=365)),
        ([WindowSpec("* * * * *", 60, "Europe/Berlin")], timedelta(days=56 * 365)),
        ([WindowSpec("0 3 * * *", 3600, "UTC")], timedelta(minutes=1)),
    ],
)
def test_a_clock_stepped_far_back_computes_no_opening_in_between(
    configured: list[WindowSpec], back: timedelta, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A question far before the calendar kept (the wall clock stepped back a year, a
    wrong RTC corrected) filled the calendar with every opening in between: a year of a
    per-20-second window is 1.5 million, a tick of 40 s, past the watchdog. The answers
    stay the cron arithmetic's."""
    windows._holder.cache_clear()
    later = at(2026, 7, 1, 12, 0, 5)
    ahead = current_window(configured, later), next_open(configured, later)
    computed = [0]
    real = windows._cron_starts

    def counted(*args: object) -> object:
        for start in real(*args):  # type: ignore[arg-type]
            computed[0] += 1
            if computed[0] > 2 * windows._CALENDAR_MAX:
                raise AssertionError("computed the openings between the two times")
            yield start

    monkeypatch.setattr(windows, "_cron_starts", counted)
    earlier = later - back
    got = current_window(configured, earlier), next_open(configured, earlier)
    monkeypatch.setattr(windows, "_cron_starts", real)
    windows._holder.cache_clear()
    assert got == (current_window(configured, earlier), next_open(configured, earlier))
    # And forward again, as the clock runs on from there.
    assert (current_window(configured, later), next_open(configured, later)) == ahead
    windows._holder.cache_clear()


# Windows open all the time (back to back, or two that take turns), as an operator may write
# "restarts any time": every tick asks about the open window several times.
ALWAYS_OPEN = {
    "a minute long every minute": [WindowSpec("* * * * *", 60, "UTC")],
    "5 s long every 5 s": [WindowSpec("*/5 * * * * *", 5, "UTC")],
    "two taking turns": [
        WindowSpec("*/10 * * * *", 300, "Europe/Berlin"),
        WindowSpec("5-59/10 * * * *", 300, "Europe/Berlin"),
    ],
    "a day long every day": [WindowSpec("0 3 * * *", 86400, "UTC")],
}


@pytest.mark.parametrize("name", list(ALWAYS_OPEN))
def test_an_always_open_chain_costs_a_bounded_walk_per_tick(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each query used to walk the chain one opening at a time for 8 days each way (a
    second per query of per-minute windows, half a minute of per-5-second ones: ticks past
    the watchdog). Now a chain is followed for CHAIN_MAX openings at most."""
    configured = ALWAYS_OPEN[name]
    # Cron arithmetic done: each opening computed, and each search begun. Over the budget,
    # fail at once rather than after minutes.
    work = [0]
    budget = 12 * windows.CHAIN_MAX * len(configured)
    real = windows._cron_starts

    def counted(*args: object) -> object:
        work[0] += 1
        for start in real(*args):  # type: ignore[arg-type]
            work[0] += 1
            if work[0] > budget:
                raise AssertionError(f"more than {budget} openings computed")
            yield start

    monkeypatch.setattr(windows, "_cron_starts", counted)
    windows._holder.cache_clear()
    now = at(2025, 10, 26, 12)  # the day after Berlin fell back
    for tick in range(30):
        t = now + timedelta(seconds=10 * tick)
        opened, closes = current_window(configured, t) or (t, t)
        assert opened < t - timedelta(hours=2), opened
        assert closes > t + timedelta(hours=2), closes
        # As a tick asks: is one open, how long is left, when is the next, when does it close.
        assert next_open(configured, t) > t
        assert next_close(configured, t) == closes
    windows._holder.cache_clear()


@pytest.mark.parametrize(
    ("cron", "fields"),
    [
        ("0 3 * * mon-sun", ("0", "3", "*", "*", "mon-sun")),
        ("*/15 1-5 * * mon-fri", ("*/15", "1-5", "*", "*", "mon-fri")),
        ("30 2 * * sat,sun", ("30", "2", "*", "*", "sat,sun")),
        ("0 3 1 jan-mar *", ("0", "3", "1", "jan-mar", "*")),
        ("  0  3 * * MON  ", ("0", "3", "*", "*", "mon")),
        # A 5-field cron starts at second 0; a 6-field one leads with the second.
        ("0 3 * * mon-sun", ("0", "0", "3", "*", "*", "mon-sun")),
        ("*/20 * * * * *", ("*/20", "*", "*", "*", "*", "*")),
        ("15,45 */5 2 * * sat,sun", ("15,45", "*/5", "2", "*", "*", "sat,sun")),
        ("0-10 0 3 1 jan *", ("0-10", "0", "3", "1", "jan", "*")),
        # A day field starting with * makes cron AND the day fields too, as APScheduler does.
        ("0 3 */2 * mon", ("0", "3", "*/2", "*", "mon")),
    ],
)
def test_parse_cron_accepts(cron: str, fields: tuple[str, ...]) -> None:
    parsed = parse_cron(cron)
    got = (parsed.minute, parsed.hour, parsed.day, parsed.month, parsed.day_of_week)
    if len(fields) == 6:
        got = (parsed.second, *got)
    assert got == fields


@pytest.mark.parametrize(
    ("cron", "message"),
    [
        ("0 3 * * 1", "use names mon..sun, not numbers"),
        ("0 3 * * 0-6", "not numbers"),
        ("0 3 * * mon/2", "not numbers"),
        ("0 3 * * monday", "expected mon..sun"),
        ("0 3 * * fri-mon", "runs backwards"),
        ("0 3 * *", "has 4 fields; expected 5"),
        ("0 0 0 3 * * mon", "has 7 fields; expected 5"),
        ("60 0 3 * * *", "higher than the maximum"),
        ("*/0 * * * * *", "Increment must be higher than 0"),
        ("x 0 3 * * *", "second 'x'"),
        ("0 0 3 * * 1", "not numbers"),
        ("@daily", "macros are not supported"),
        ("60 3 * * *", "higher than the maximum"),
        ("0 24 * * *", "higher than the maximum"),
        ("0 3 0 * *", "lower than the minimum"),
        ("*/0 3 * * *", "Increment must be higher than 0"),
        ("0 3 last * *", "day 'last'"),
        ("0 3 * foo *", "month 'foo'"),
        ("0 3 1 * mon", r"restricts both day of month \(1\) and weekday \(mon\)"),
        # Every weekday named is still a restriction to cron, which then ORs: every day.
        ("0 3 1 * mon-sun", "restricts both day of month"),
        ("0 3 1-7 * sat,sun", "runs it on either"),
        ("", "has 0 fields"),
    ],
)
def test_parse_cron_rejects(cron: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        parse_cron(cron)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("cron", "zone", "message"),
    [
        ("0 0 31 feb *", "UTC", "never fires"),
        ("0 3 * * *", "Mars/Olympus", "unknown timezone"),
        ("0 3 * * *", "../../etc/passwd", "unknown timezone"),
        ("0 3 * * *", "", "IANA name"),
    ],
)
def test_check_window_rejects(cron: str, zone: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_window(cron, zone)


def test_odd_days_that_are_mondays_as_cron_reads_them() -> None:
    # cron ANDs `*/2` (it starts with *) with `mon`: odd days of the month that are Mondays.
    windows = [WindowSpec("0 3 */2 * mon", 3600, "UTC")]
    # 2025-12-01 is a Monday (odd day); Dec 8 (even) is skipped; Dec 15 is the next.
    assert next_open(windows, at(2025, 12, 1, 4)) == at(2025, 12, 15, 3)


def test_leap_day_window_fires_within_the_horizon() -> None:
    windows = [WindowSpec("0 3 29 feb *", 3600, "UTC")]
    check_window("0 3 29 feb *", "UTC")
    assert next_open(windows, at(2025, 3, 1)) == at(2028, 2, 29, 3)


NIGHT_HOUR = WindowSpec("0 3 * * *", 3600, "UTC")
NOON_MINUTE = WindowSpec("0 12 * * *", 60, "Europe/Berlin")  # 11:00Z in winter


@pytest.mark.parametrize(
    ("configured", "now", "current", "closes"),
    [
        # Each window lasts its own duration_s, whichever is configured last (each lasted
        # the last one's: the night's hour a minute, the noon minute an hour).
        ([NIGHT_HOUR, NOON_MINUTE], at(2026, 12, 2, 2), None, at(2026, 12, 2, 4)),
        (
            [NIGHT_HOUR, NOON_MINUTE],
            at(2026, 12, 2, 3, 30),
            (at(2026, 12, 2, 3), at(2026, 12, 2, 4)),
            at(2026, 12, 2, 4),
        ),
        ([NOON_MINUTE, NIGHT_HOUR], at(2026, 12, 2, 10), None, at(2026, 12, 2, 11, 1)),
        ([NOON_MINUTE, NIGHT_HOUR], at(2026, 12, 2, 11, 30), None, at(2026, 12, 3, 4)),
    ],
)
def test_each_window_lasts_its_own_duration(
    configured: list[WindowSpec],
    now: datetime,
    current: tuple[datetime, datetime] | None,
    closes: datetime,
) -> None:
    assert current_window(configured, now) == current
    assert next_close(configured, now) == closes


@pytest.mark.parametrize(
    ("configured", "short"),
    [
        ([WindowSpec("0 3 * * *", 60, "UTC")], [(0, 60.0)]),
        ([WindowSpec("0 3 * * *", 190, "UTC")], []),
        # Back to back: one open period, always open.
        ([WindowSpec("* * * * *", 60, "Europe/Berlin")], []),
        # Touching a long one (one period of 3660 s), or apart from it.
        ([WindowSpec("0 1 * * *", 60, "UTC"), WindowSpec("1 1 * * *", 3600, "UTC")], []),
        (
            [WindowSpec("0 1 * * *", 60, "UTC"), WindowSpec("2 1 * * *", 3600, "UTC")],
            [(0, 60.0)],
        ),
        # Overlapped by a long one on Sundays only: a restart fits then.
        ([WindowSpec("0 3 * * *", 60, "UTC"), WindowSpec("30 2 * * sun", 3600, "UTC")], []),
        # Two short ones overlapping: one period of 90 s, still short; each named.
        (
            [WindowSpec("0 3 * * *", 60, "UTC"), WindowSpec("30 0 3 * * *", 60, "UTC")],
            [(0, 90.0), (1, 90.0)],
        ),
        # The demo's: every 20 s for 15 s.
        ([WindowSpec("*/20 * * * * *", 15, "UTC")], [(0, 15.0)]),
    ],
)
def test_too_short_judges_the_open_period_not_the_window(
    configured: list[WindowSpec], short: list[tuple[int, float]]
) -> None:
    # A restart needing 190 s (systemd's default stop timeout + 100 s to start).
    assert windows.too_short(configured, 190.0, at(2026, 12, 2, 11)) == short


SHORT_THEN_LONG = [WindowSpec("0 0 * * *", 60, "UTC"), WindowSpec("0 2 * * *", 3600, "UTC")]
MINUTES = [WindowSpec("* * * * *", 60, "UTC")]
# An always-open chain, as current_window bounds it.
MINUTES_END = (current_window(MINUTES, at(2026, 12, 2, 23, 38, 30)) or (None, None))[1]


@pytest.mark.parametrize(
    ("configured", "now", "needs_s", "expected"),
    [
        # Open with time to spare: now, until it closes.
        (DAILY_UTC, at(2026, 12, 2, 3, 10), 190.0, (at(2026, 12, 2, 3, 10), at(2026, 12, 2, 4))),
        # Its last minutes hold no restart: tomorrow's opening.
        (DAILY_UTC, at(2026, 12, 2, 3, 58), 190.0, (at(2026, 12, 3, 3), at(2026, 12, 3, 4))),
        # Closed: the next opening.
        (DAILY_UTC, at(2026, 12, 2, 12), 190.0, (at(2026, 12, 3, 3), at(2026, 12, 3, 4))),
        # The next window lasts a minute: the one after it, past midnight.
        (SHORT_THEN_LONG, at(2026, 12, 2, 23, 38), 100.0, (at(2026, 12, 3, 2), at(2026, 12, 3, 3))),
        (SHORT_THEN_LONG, at(2026, 12, 2, 23, 38), 30.0, (at(2026, 12, 3), at(2026, 12, 3, 0, 1))),
        # Back to back minute windows make one period: a restart fits across them.
        (MINUTES, at(2026, 12, 2, 23, 38, 30), 190.0, (at(2026, 12, 2, 23, 38, 30), MINUTES_END)),
        # Never long enough: none.
        ([WindowSpec("0 0 * * *", 60, "UTC")], at(2026, 12, 2, 12), 190.0, None),
    ],
)
def test_holding_is_when_a_restart_can_start_inside_a_window(
    configured: list[WindowSpec],
    now: datetime,
    needs_s: float,
    expected: tuple[datetime, datetime] | None,
) -> None:
    assert windows.holding(configured, needs_s, now) == expected


@pytest.mark.parametrize(
    ("named", "numbered", "months"),
    [
        # A name means its number anywhere in the field, with a step or in a mixed range
        # (APScheduler read "jan-dec/2" as every month, "jan-12" as January only).
        ("jan-dec/2", "1-12/2", ["mar", "may", "jul", "sep", "nov", "jan"]),
        ("JAN-Mar/2", "1-3/2", ["mar", "jan", "mar", "jan", "mar", "jan"]),
        ("jan-12", "1-12", ["feb", "mar", "apr", "may", "jun", "jul"]),
        ("1-mar", "1-3", ["feb", "mar", "jan", "feb", "mar", "jan"]),
        ("jan/3", "1/3", ["apr", "jul", "oct", "jan", "apr", "jul"]),
    ],
)
def test_month_names_read_as_their_numbers(named: str, numbered: str, months: list[str]) -> None:
    def opening_months(month: str) -> list[str]:
        configured = [WindowSpec(f"0 3 1 {month} *", 3600, "Europe/Berlin")]
        check_window(configured[0].cron, "Europe/Berlin", 3600)
        now, seen = at(2026, 1, 5), []
        for _ in range(len(months)):
            now = next_open(configured, now)
            seen.append(windows.MONTHS[now.month - 1])
            now += timedelta(days=1)
        return seen

    assert opening_months(named) == opening_months(numbered) == months


NOON_UTC_AND_BERLIN_NIGHT = [
    WindowSpec("0 12 * * *", 1800, "UTC"),
    WindowSpec("0 3 * * *", 3600, "Europe/Berlin"),
]
NEW_YORK_THEN_BERLIN = [  # 20:00 EST is 01:00Z, one hour before 03:00 CET: one open period
    WindowSpec("0 20 * * *", 3600, "America/New_York"),
    WindowSpec("0 3 * * *", 3600, "Europe/Berlin"),
]


@pytest.mark.parametrize(
    ("configured", "instant", "shown"),
    [
        # The zone of the window opening or closing then, not the first one configured.
        (NOON_UTC_AND_BERLIN_NIGHT, at(2026, 12, 7, 2), "2026-12-07T03:00:00+01:00"),
        (NOON_UTC_AND_BERLIN_NIGHT, at(2026, 12, 7, 3), "2026-12-07T04:00:00+01:00"),
        (NOON_UTC_AND_BERLIN_NIGHT, at(2026, 12, 7, 12, 30), "2026-12-07T12:30:00+00:00"),
        (NOON_UTC_AND_BERLIN_NIGHT, at(2026, 7, 7, 1), "2026-07-07T03:00:00+02:00"),
        # A chain: opened by New York's window, closed by Berlin's.
        (NEW_YORK_THEN_BERLIN, at(2026, 12, 7, 1), "2026-12-06T20:00:00-05:00"),
        (NEW_YORK_THEN_BERLIN, at(2026, 12, 7, 3), "2026-12-07T04:00:00+01:00"),
        # Neither opens nor closes then: the first window's zone.
        (NEW_YORK_THEN_BERLIN, at(2026, 12, 7, 1, 30), "2026-12-06T20:30:00-05:00"),
        # Spring forward (02:30 opens at the jump) and fall back (closes at the second 02:30).
        (BERLIN, at(2026, 3, 29, 1), "2026-03-29T03:00:00+02:00"),
        (BERLIN, at(2026, 10, 25, 1, 30), "2026-10-25T02:30:00+01:00"),
    ],
)
def test_local_time_reads_an_instant_on_its_windows_clock(
    configured: list[WindowSpec], instant: datetime, shown: str
) -> None:
    local = windows.local_time(configured, instant)
    assert local.timestamp() == instant.timestamp()  # (== is False for a repeated hour)
    assert local.isoformat() == shown


@pytest.mark.parametrize("func", [is_open, current_window, next_open, next_close])
def test_naive_now_is_rejected(func: object) -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        func(DAILY_UTC, datetime(2025, 7, 1, 3))  # type: ignore[operator]


def test_no_windows_has_no_next_open() -> None:
    with pytest.raises(ValueError, match="no maintenance windows"):
        next_open([], at(2025, 7, 1))


def test_non_utc_now_is_accepted() -> None:
    berlin_summer = timezone(timedelta(hours=2))
    now = datetime(2025, 7, 1, 5, 30, tzinfo=berlin_summer)  # 03:30Z
    assert current_window(DAILY_UTC, now) == (at(2025, 7, 1, 3), at(2025, 7, 1, 4))


EVERY_20_S = [WindowSpec("*/20 * * * * *", 10, "UTC")]
AT_SECOND_30 = [WindowSpec("30 0 3 * * *", 60, "UTC")]
BERLIN_WITH_SECONDS = [WindowSpec("15 30 2 * * mon-sun", 3600, "Europe/Berlin")]


@pytest.mark.parametrize(
    ("windows", "now", "expected"),
    [
        # Every 20 s for 10 s: [00, 10), [20, 30), [40, 50) of each minute.
        (EVERY_20_S, at(2025, 7, 1, 12, 0, 0), (at(2025, 7, 1, 12), at(2025, 7, 1, 12, 0, 10))),
        (EVERY_20_S, at(2025, 7, 1, 12, 0, 9), (at(2025, 7, 1, 12), at(2025, 7, 1, 12, 0, 10))),
        (EVERY_20_S, at(2025, 7, 1, 12, 0, 10), None),
        (EVERY_20_S, at(2025, 7, 1, 12, 0, 19), None),
        (
            EVERY_20_S,
            at(2025, 7, 1, 12, 0, 45),
            (at(2025, 7, 1, 12, 0, 40), at(2025, 7, 1, 12, 0, 50)),
        ),
        # Second 30 of 03:00: closed at 03:00:00 (a 5-field cron would be open there).
        (AT_SECOND_30, at(2025, 7, 1, 3, 0, 0), None),
        (AT_SECOND_30, at(2025, 7, 1, 3, 0, 29), None),
        (
            AT_SECOND_30,
            at(2025, 7, 1, 3, 0, 30),
            (at(2025, 7, 1, 3, 0, 30), at(2025, 7, 1, 3, 1, 30)),
        ),
        (AT_SECOND_30, at(2025, 7, 1, 3, 1, 30), None),
        # DST rules hold with seconds: 02:30:15 CEST = 00:30:15Z in summer; in the spring
        # gap the window opens at the jump (01:00:00Z), in the repeated hour only once.
        (
            BERLIN_WITH_SECONDS,
            at(2025, 7, 1, 0, 30, 15),
            (at(2025, 7, 1, 0, 30, 15), at(2025, 7, 1, 1, 30, 15)),
        ),
        (BERLIN_WITH_SECONDS, at(2025, 7, 1, 0, 30, 14), None),
        (BERLIN_WITH_SECONDS, at(2025, 3, 30, 1, 0), (at(2025, 3, 30, 1), at(2025, 3, 30, 2))),
        (
            BERLIN_WITH_SECONDS,
            at(2025, 10, 26, 0, 30, 15),
            (at(2025, 10, 26, 0, 30, 15), at(2025, 10, 26, 1, 30, 15)),
        ),
        (BERLIN_WITH_SECONDS, at(2025, 10, 26, 1, 30, 15), None),
    ],
)
def test_current_window_with_seconds(
    windows: list[WindowSpec],
    now: datetime,
    expected: tuple[datetime, datetime] | None,
) -> None:
    assert current_window(windows, now) == expected


@pytest.mark.parametrize(
    ("windows", "now", "opens", "closes"),
    [
        (
            EVERY_20_S,
            at(2025, 7, 1, 12, 0, 11),
            at(2025, 7, 1, 12, 0, 20),
            at(2025, 7, 1, 12, 0, 30),
        ),
        (
            EVERY_20_S,
            at(2025, 7, 1, 12, 0, 20),
            at(2025, 7, 1, 12, 0, 20),
            at(2025, 7, 1, 12, 0, 30),
        ),
        # Open: the next opening after this one closes, across the minute.
        (
            EVERY_20_S,
            at(2025, 7, 1, 12, 0, 45),
            at(2025, 7, 1, 12, 1, 0),
            at(2025, 7, 1, 12, 0, 50),
        ),
        (AT_SECOND_30, at(2025, 7, 1, 3, 0, 0), at(2025, 7, 1, 3, 0, 30), at(2025, 7, 1, 3, 1, 30)),
        (
            AT_SECOND_30,
            at(2025, 7, 1, 3, 0, 31),
            at(2025, 7, 2, 3, 0, 30),
            at(2025, 7, 1, 3, 1, 30),
        ),
        # Fall back: the repeated 02:30:15 opens nothing; the next opening is the next day.
        (
            BERLIN_WITH_SECONDS,
            at(2025, 10, 26, 1, 31),
            at(2025, 10, 27, 1, 30, 15),
            at(2025, 10, 27, 2, 30, 15),
        ),
    ],
)
def test_next_open_and_close_with_seconds(
    windows: list[WindowSpec], now: datetime, opens: datetime, closes: datetime
) -> None:
    assert next_open(windows, now) == opens
    assert next_close(windows, now) == closes


@pytest.mark.parametrize(
    ("five", "six"),
    [
        ("0 3 * * mon-sun", "0 0 3 * * mon-sun"),
        ("30 2 * * mon-sun", "0 30 2 * * mon-sun"),
        ("*/20 2 * * mon-sun", "0 */20 2 * * mon-sun"),
    ],
)
@pytest.mark.parametrize("zone", ["UTC", "Europe/Berlin", "Australia/Lord_Howe"])
def test_five_field_cron_is_six_field_at_second_zero(five: str, six: str, zone: str) -> None:
    short, long = [WindowSpec(five, 900, zone)], [WindowSpec(six, 900, zone)]
    now = at(2025, 3, 29)  # walks across Berlin's spring-forward night
    for _ in range(6):
        opened = next_open(short, now)
        assert opened == next_open(long, now)
        assert next_close(short, opened) == next_close(long, opened)
        assert opened.second == 0
        now = opened + timedelta(seconds=1)


@pytest.mark.parametrize(
    ("cron", "duration_s", "overlaps"),
    [
        ("* * * * * *", 3600, True),  # every second, an hour long: always open
        ("* * * * mon-sun", 61, True),
        ("* * * * mon-sun", 60, False),  # back to back is allowed
        ("0 3 * * mon-fri", 4 * 86400, True),  # Monday's lasts into Tuesday's
        ("0 3 * * mon-fri", 3600, False),
        ("*/20 * * * * *", 15, False),  # the demo's
    ],
)
def test_a_window_may_not_overlap_itself(cron: str, duration_s: float, overlaps: bool) -> None:
    if overlaps:
        with pytest.raises(ValueError, match="overlap itself"):
            windows.check_window(cron, "UTC", duration_s)
    else:
        windows.check_window(cron, "UTC", duration_s)


# -- the calendar of openings: the same openings as the cron arithmetic, cheaper -------------
@pytest.mark.parametrize(
    ("cron", "zone", "longest_s"),
    [
        ("0 3 * * mon-sun", "UTC", 9 * 86400),
        ("30 2 * * sun", "Europe/Berlin", 40 * 86400),  # spring-forward gap, fall-back repeat
        ("*/20 1-3 * * *", "America/New_York", 2 * 86400),
        ("*/20 * * * * *", "UTC", 1800),  # the demo's: every 20 s
        ("0 0 29 feb *", "UTC", 3 * 366 * 86400),  # leap day: years apart
        ("15 1,2 * oct-nov sat,sun", "Australia/Sydney", 20 * 86400),
    ],
)
def test_the_calendar_answers_as_the_cron_arithmetic(
    cron: str, zone: str, longest_s: float
) -> None:
    rng = random.Random(cron)
    window = windows.WindowSpec(cron, 600, zone)
    windows._holder.cache_clear()
    t = datetime(2026, 3, 20, tzinfo=timezone.utc)
    for _ in range(150):
        # Mostly forward by a tick, sometimes back (chains, look-backs) or far ahead.
        move = rng.random()
        if move < 0.7:
            t += timedelta(seconds=rng.choice((5, 15, 60, 3600)))
        elif move < 0.85:
            t -= timedelta(hours=rng.choice((1, 6, 30)))
        else:
            t += timedelta(days=rng.choice((1, 40, 200, 800)))
        span = timedelta(seconds=longest_s * rng.random())
        after, until = t - span * rng.random(), t + span
        expected = list(windows._cron_starts(cron, zone, after, until))
        assert list(windows._starts(window, after, until)) == expected, (after, until)
    assert windows._holder.cache_info().currsize == 1, "the queries went through the calendar"
