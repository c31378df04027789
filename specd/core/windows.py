"""Maintenance windows: when specd may restart SGLang. Pure; time is always passed in.

A window is a cron start (5 fields, weekday *names* only) plus a duration in seconds, in an
IANA timezone. An optional sixth, *leading* field gives the second ("SEC MIN HOUR DOM MON
DOW", e.g. ``"*/30 * * * * *"``: a window every 30 s, for tests and the demo); without it a
start is at second 0, so a 5-field cron means what it means in crontab. A window is open
at ``now`` when some start ``s`` satisfies ``s <= now < s + duration``.
Windows that overlap or touch (across all configured windows) count as one open period:
``current_window`` reports its first opening and its last closing, followed each way for
``LOOKBACK`` (8 days) or ``CHAIN_MAX`` openings, whichever ends first: back to back windows
of a minute (``* * * * *`` lasting 60 s, open all the time) are read as open for the next 34
hours, not walked opening by opening at every tick.

Fire times come from APScheduler 3.x ``CronTrigger`` evaluated on the *local wall clock*
(a trigger in UTC over naive local times), then mapped to real instants by these rules, which
follow ISC/Vixie cron:

* Spring forward — a start whose wall-clock time does not exist (02:30 in Europe/Berlin on
  the last Sunday of March) opens at the instant the clock jumps (03:00 CEST). Several
  starts inside the gap collapse into that one opening. The window lasts ``duration_s`` of
  real time from there.
* Fall back — a start whose wall-clock time happens twice opens only at its first
  occurrence; the repeat of that hour opens nothing. So the duplicated hour never yields a
  second window (and with it, a second restart).

These are cron's rules for a job at a fixed time. Cron runs a job with ``*`` in its minute
or hour field by the wall clock as it reads after the change (again in the repeated hour,
never at the jump); specd applies the fixed-time rules to every start, so back-to-back
windows (``*/5 1-4 * * *`` lasting 300 s, or ``* * * * *`` lasting 60 s) are closed for
the repeated hour, and an hourly ``30 * * * *`` also opens at the jump. Either moves, adds
or leaves out an opening on one night a year; dwell and the restart budget hold as ever.

We do not let APScheduler apply the zone itself: 3.11 returns non-monotonic fire times in a
fall-back hour (02:30+01:00 again and again, even for a ``now`` past it), which would loop.
"""

from __future__ import annotations

import bisect
import functools
import heapq
import itertools
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Protocol
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from apscheduler.triggers.cron import CronTrigger

WEEKDAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
FIELD_NAMES = ("second", "minute", "hour", "day", "month", "day_of_week")

# Every valid cron fires at least once in 4 years (29 feb); 5 years is a safe bound for
# "this cron never fires" and for how far ahead we ever look.
HORIZON = timedelta(days=5 * 366)
# How far a chain of overlapping windows is followed, back to its first opening and
# forward to its last closing; a window that never closes is reported as this long...
LOOKBACK = timedelta(days=8)
# ...or as this many openings, whichever is shorter: an always-open chain of per-minute
# windows holds 11,520 openings in LOOKBACK, of per-second ones 691,200, and every tick asks
# about the open window several times (each walk of a per-minute chain took a second, of a
# per-5-second one half a minute: past the watchdog).
CHAIN_MAX = 2048

_NUMERIC_ITEM = re.compile(r"^(\*|\d+(-\d+)?)(/\d+)?$")
_MONTH_ITEM = re.compile(r"^(\*|(\d+|[a-z]{3})(-(\d+|[a-z]{3}))?)(/\d+)?$")
_UTC = timezone.utc


class WindowLike(Protocol):
    """Anything with a window's three attributes (WindowSpec, config.Window)."""

    @property
    def cron(self) -> str: ...

    @property
    def duration_s(self) -> float: ...

    @property
    def timezone(self) -> str: ...


@dataclass(frozen=True)
class WindowSpec:
    cron: str
    duration_s: float
    timezone: str


@dataclass(frozen=True)
class CronFields:
    minute: str
    hour: str
    day: str
    month: str
    day_of_week: str
    # Last, with a default, so 5-field callers and positional construction keep working.
    second: str = "0"


def load_zone(name: str) -> ZoneInfo:
    """The IANA zone called ``name``; ValueError with a clear message if there is none."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError("timezone must be an IANA name such as 'Europe/Berlin' or 'UTC'")
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise ValueError(
            f"unknown timezone {name!r} (use an IANA name such as 'Europe/Berlin' or 'UTC')"
        ) from None


def _check_weekdays(field: str) -> frozenset[str]:
    """Validate field 5 (names only) and return the set of weekdays it selects."""
    days: set[str] = set()
    for item in field.split(","):
        if item == "*":
            days.update(WEEKDAYS)
            continue
        if any(ch.isdigit() for ch in item):
            raise ValueError(
                f"weekday {item!r}: use names mon..sun, not numbers (cron counts 0=sun, "
                "APScheduler 0=mon, so numbers are ambiguous)"
            )
        lo, sep, hi = item.partition("-")
        if lo not in WEEKDAYS or (sep and hi not in WEEKDAYS):
            raise ValueError(
                f"weekday {item!r}: expected mon..sun, a range such as mon-fri, "
                "or a list such as mon,wed,fri"
            )
        first, last = WEEKDAYS.index(lo), WEEKDAYS.index(hi if sep else lo)
        if first > last:
            raise ValueError(
                f"weekday range {item!r} runs backwards; write it as a list, e.g. fri-sun,mon"
            )
        days.update(WEEKDAYS[first : last + 1])
    return frozenset(days)


def parse_cron(cron: str) -> CronFields:
    """Parse and validate a cron start of 5 fields, or 6 with a leading second field.

    Raises ValueError with a one-line reason.
    """
    if not isinstance(cron, str):
        raise ValueError("cron must be a string such as '0 3 * * mon-fri'")
    text = cron.strip().lower()
    if text.startswith("@"):
        raise ValueError(f"{cron!r}: macros are not supported; write 5 fields, e.g. '0 3 * * *'")
    parts = text.split()
    if len(parts) == 5:
        parts.insert(0, "0")
    elif len(parts) != 6:
        raise ValueError(
            f"{cron!r} has {len(parts)} fields; expected 5: minute hour day month weekday "
            "(e.g. '0 3 * * mon-fri'), or 6 with a leading second (e.g. '*/30 * * * * *')"
        )
    second, minute, hour, day, month, dow = parts
    for name, field in (("second", second), ("minute", minute), ("hour", hour), ("day", day)):
        for item in field.split(","):
            if not _NUMERIC_ITEM.match(item):
                raise ValueError(f"{name} {field!r}: expected *, N, N-M, */S or a list of them")
    for item in month.split(","):
        words = re.findall(r"[a-z]+", item)
        if not _MONTH_ITEM.match(item) or any(w not in MONTHS for w in words):
            raise ValueError(f"month {month!r}: expected 1-12 or jan..dec, ranges, lists")
    _check_weekdays(dow)
    # cron (Vixie, cronie) ORs the two day fields unless one of them starts with '*', and
    # APScheduler always ANDs them: `0 3 1 * mon-sun` is every day to cron and the 1st
    # only to APScheduler, `0 3 */2 * mon` the same to both.
    if not day.startswith("*") and not dow.startswith("*"):
        raise ValueError(
            f"{cron!r} restricts both day of month ({day}) and weekday ({dow}): cron runs it "
            "on either and APScheduler only on both, so restrict one and write * for the other"
        )
    fields = CronFields(minute, hour, day, month, dow, second)
    try:
        _trigger(fields)
    except ValueError as exc:
        raise ValueError(f"{cron!r}: {exc}") from None
    return fields


def _month_numbers(field: str) -> str:
    """The month field with each name as its number. APScheduler reads a name only as the
    start of an item: ``jan-dec/2`` as every month (the step dropped), ``jan-12`` as
    January, and ``1-mar`` not at all."""
    return re.sub(r"[a-z]{3}", lambda name: str(MONTHS.index(name.group()) + 1), field)


def _trigger(fields: CronFields) -> CronTrigger:
    # A UTC trigger over naive local times: the zone is applied by _to_instant.
    return CronTrigger(
        second=fields.second,
        minute=fields.minute,
        hour=fields.hour,
        day=fields.day,
        month=_month_numbers(fields.month),
        day_of_week=fields.day_of_week,
        timezone=_UTC,
    )


# Starts sampled to find how often a window opens (a week of daily starts, a few hours
# of per-minute ones): enough to see a window that overlaps itself.
_GAP_SAMPLES = 200


# A valid window is remembered: every config load validates its windows (~20 ms of cron
# arithmetic each), and the daemon, its reloads and every command load the same few. A
# refused one raises again each time (lru_cache keeps no exceptions).
@functools.lru_cache(maxsize=256)
def check_window(cron: str, tz_name: str, duration_s: float | None = None) -> None:
    """Validate a window's cron and zone, that it ever fires, and (given its duration) that
    it does not overlap itself. Raises ValueError.

    A window that opens again before it closes is open all the time, which is never what
    an operator means (a pin override with apply = "now" is the tool for "any time"), and
    it would make every "is a window open?" walk a chain of countless openings.
    """
    fields = parse_cron(cron)
    load_zone(tz_name)
    trigger = _trigger(fields)
    fire = trigger.get_next_fire_time(None, datetime(2000, 1, 1, tzinfo=_UTC))
    if fire is None:
        raise ValueError(f"{cron!r} never fires (no such date)")
    if duration_s is None:
        return
    shortest: float | None = None
    for _ in range(_GAP_SAMPLES):
        following = trigger.get_next_fire_time(fire, fire + timedelta(seconds=1))
        if following is None:
            break
        gap = (following - fire).total_seconds()
        shortest = gap if shortest is None else min(shortest, gap)
        fire = following
    # The gaps are read on the wall clock, as the cron is written, and a window's duration
    # is real time. On a spring-forward night the real gap is shorter by the shift (23 h
    # between two daily starts in Europe/Berlin), so a window longer than that (23.5 h)
    # overlaps that one next opening and the two are one open period, closing when the
    # second closes. Not refused: it is neither of the harms above (it closes, and the
    # chain is two openings, once a year), and it is only the far end of what every
    # window lasting across that night does: its real seconds end an hour later on the
    # wall clock, so its closed gap shrinks by the shift (a 22 h one's from 2 h to 1 h).
    # Refusing it would refuse in Berlin a window UTC takes, and stop a daemon at its
    # next start with a config it ran with.
    if shortest is not None and shortest < duration_s:
        raise ValueError(
            f"{cron!r} opens every {shortest:g} s but each window lasts {duration_s:g} s: "
            "it would overlap itself and never close; shorten duration_s"
        )


@functools.lru_cache(maxsize=64)
def _compiled(cron: str, tz_name: str) -> tuple[CronTrigger, ZoneInfo]:
    return _trigger(parse_cron(cron)), load_zone(tz_name)


def _to_instant(wall: datetime, tz: ZoneInfo) -> datetime:
    """The real instant (UTC) a local wall-clock start maps to (see module docstring)."""
    first = wall.replace(tzinfo=tz, fold=0).astimezone(_UTC)
    if first.astimezone(tz).replace(tzinfo=None) == wall:
        return first  # exists; fold=0 is the first occurrence when it is ambiguous
    # In a gap: fold=1 reads it with the offset after the jump (an earlier instant),
    # fold=0 with the one before. The jump lies between; find it to the second.
    lo = wall.replace(tzinfo=tz, fold=1).astimezone(_UTC)
    hi = first
    if lo > hi:
        lo, hi = hi, lo
    after_offset = hi.astimezone(tz).utcoffset()
    lo_s, hi_s = int(lo.timestamp()), int(hi.timestamp())
    while hi_s - lo_s > 1:
        mid = (lo_s + hi_s) // 2
        if datetime.fromtimestamp(mid, _UTC).astimezone(tz).utcoffset() == after_offset:
            hi_s = mid
        else:
            lo_s = mid
    return datetime.fromtimestamp(hi_s, _UTC)


def _cron_starts(cron: str, tz_name: str, after: datetime, until: datetime) -> Iterator[datetime]:
    """Window openings (UTC, increasing, no repeats) with after <= start <= until, from the
    cron arithmetic itself."""
    trigger, tz = _compiled(cron, tz_name)
    # One second back: a start in a DST gap maps to the jump instant, whose wall-clock
    # time is later than the start's own wall-clock time.
    wall = (after - timedelta(seconds=1)).astimezone(tz).replace(tzinfo=None, microsecond=0)
    fire = trigger.get_next_fire_time(None, wall.replace(tzinfo=_UTC))
    last: datetime | None = None
    while fire is not None:
        instant = _to_instant(fire.replace(tzinfo=None), tz)
        if instant > until:
            return
        if instant >= after and instant != last:
            last = instant
            yield instant
        fire = trigger.get_next_fire_time(fire, fire + timedelta(seconds=1))


# Openings are a pure function of (cron, timezone), yet every tick asks for the current and
# the next window: cron arithmetic was most of a decision's cost. Each (cron, timezone)
# keeps a calendar of the openings computed so far, extended as queries move on and read by
# bisection; it is rebuilt from the query when it would grow past _CALENDAR_MAX entries.
_CALENDAR_BATCH = 64
_CALENDAR_MAX = 8192
_TICK = timedelta(microseconds=1)


@dataclass
class _Calendar:
    """Every opening in [lo, hi) is in ``starts`` (sorted); only appended to in place."""

    lo: datetime
    hi: datetime
    starts: list[datetime]


@dataclass
class _Holder:
    calendar: _Calendar | None = None


@functools.lru_cache(maxsize=64)
def _holder(cron: str, tz_name: str) -> _Holder:
    # Memoized like _compiled: the calendar only ever answers what the cron arithmetic
    # answers (tests/core/test_windows.py), so no answer depends on earlier questions.
    return _Holder()


def _calendar(cron: str, tz_name: str, after: datetime) -> _Calendar:
    """The calendar of (cron, tz_name), covering ``after`` on."""
    holder = _holder(cron, tz_name)
    cal = holder.calendar
    if cal is None or after >= cal.hi or len(cal.starts) > _CALENDAR_MAX:
        cal = _Calendar(after, after, [])
    elif after < cal.lo:
        # Filled back to the old start only when that is near: a wall clock stepped back a
        # year (a wrong RTC corrected by NTP) would otherwise compute every opening of the
        # year between, 1.5 million of a per-20-second window (a tick of 40 s).
        earlier = list(
            itertools.islice(
                (s for s in _cron_starts(cron, tz_name, after, cal.lo) if s < cal.lo),
                _CALENDAR_MAX + 1,
            )
        )
        # A new object: an iteration over the old list (a suspended _starts) stays valid.
        if len(earlier) > _CALENDAR_MAX:
            cal = _Calendar(after, after, [])
        else:
            cal = _Calendar(after, cal.hi, earlier + cal.starts)
    holder.calendar = cal
    return cal


def _extend(cal: _Calendar, cron: str, tz_name: str, until: datetime) -> None:
    """Append the next openings after ``cal.hi`` (a batch, or all up to ``until``)."""
    batch = list(itertools.islice(_cron_starts(cron, tz_name, cal.hi, until), _CALENDAR_BATCH))
    cal.starts.extend(batch)
    cal.hi = batch[-1] + _TICK if len(batch) == _CALENDAR_BATCH else until + _TICK


def _starts(window: WindowLike, after: datetime, until: datetime) -> Iterator[datetime]:
    """Window openings (UTC, increasing, no repeats) with after <= start <= until."""
    cron, tz_name = window.cron, window.timezone
    cal = _calendar(cron, tz_name, after)
    i = bisect.bisect_left(cal.starts, after)
    while True:
        if i < len(cal.starts):
            start = cal.starts[i]
            if start > until:
                return
            yield start
            i += 1
        elif cal.hi > until:
            return
        else:
            _extend(cal, cron, tz_name, until)


def _spans(
    window: WindowLike, after: datetime, until: datetime
) -> Iterator[tuple[datetime, datetime]]:
    """(start, end) of each opening of ``window`` in [after, until], in start order."""
    length = timedelta(seconds=float(window.duration_s))
    for start in _starts(window, after, until):
        yield start, start + length


def _intervals(
    windows: Sequence[WindowLike], after: datetime, until: datetime
) -> Iterator[tuple[datetime, datetime]]:
    """(start, end) of every window opening in [after, until], in start order."""
    # One generator per window, each with its own length: a generator expression in the
    # loop read ``length`` when iterated, so every window lasted as long as the last one.
    return heapq.merge(*(_spans(window, after, until) for window in windows))


def _utc(now: datetime) -> datetime:
    if now.tzinfo is None or now.utcoffset() is None:
        raise ValueError("now must be timezone-aware")
    return now.astimezone(_UTC)


def _max_duration(windows: Sequence[WindowLike]) -> timedelta:
    return timedelta(seconds=max(float(w.duration_s) for w in windows))


def current_window(
    windows: Sequence[WindowLike], now: datetime
) -> tuple[datetime, datetime] | None:
    """(opened, closes) in UTC of the open period containing ``now``, or None if closed."""
    now = _utc(now)
    if not windows:
        return None
    longest = _max_duration(windows)
    covering = [(s, e) for s, e in _intervals(windows, now - longest, now) if e > now]
    if not covering:
        return None
    opened = min(s for s, _ in covering)
    closes = max(e for _, e in covering)
    # Follow overlapping or touching windows back to the first opening of the chain...
    opened = _chain_start(windows, opened, longest, now - LOOKBACK)
    # ...and forward to the last closing (for LOOKBACK or CHAIN_MAX openings at most).
    for count, (start, end) in enumerate(_intervals(windows, now, now + LOOKBACK), 1):
        if start > closes:
            break
        closes = max(closes, end)
        if count >= CHAIN_MAX:
            break
    return opened, closes


def _chain_start(
    windows: Sequence[WindowLike], opened: datetime, longest: timedelta, floor: datetime
) -> datetime:
    """The first opening of the chain of touching or overlapping windows that ``opened``
    belongs to: no earlier than ``floor``, nor more than CHAIN_MAX openings back.

    Read in blocks going back, each twice as long as the one after it, latest opening
    first: a window opening before ``opened`` extends the chain if it lasts until
    ``opened``; one opening more than the longest duration before it ends the chain.
    """
    span = longest
    hi = opened
    links = 0
    while opened > floor:
        lo = hi - span
        for start, end in reversed(list(_intervals(windows, lo, hi))):
            if start < opened - longest:
                return max(opened, floor)  # it closed before ``opened``, as all before it
            if start < opened <= end:
                opened = start
                links += 1
                if links >= CHAIN_MAX:
                    return max(opened, floor)
        if lo <= opened - longest:
            break  # every opening that could reach ``opened`` was read
        hi, span = lo, span * 2
    return max(opened, floor)


def is_open(windows: Sequence[WindowLike], now: datetime) -> bool:
    """True when a maintenance window is open at ``now``."""
    return current_window(windows, now) is not None


def next_open(windows: Sequence[WindowLike], now: datetime) -> datetime:
    """The next opening strictly after ``now``, or ``now`` itself if a window opens then.

    While a window is open, that is the first opening after it closes. Raises ValueError
    when there are no windows or none opens within the horizon (5 years).
    """
    now = _utc(now)
    if not windows:
        raise ValueError("no maintenance windows configured")
    current = current_window(windows, now)
    if current is not None and current[0] == now:
        return now
    after = now if current is None else current[1]
    for start, _ in _intervals(windows, after, after + HORIZON):
        if start > after:
            return start
    raise ValueError("no maintenance window opens within the next 5 years")


# Pure, of frozen values. For callers that ask every tick about the same fixed instant (an
# epoch's close, an exploration's start): a walk of the windows is ~90 µs, a hit ~2 µs.
@functools.lru_cache(maxsize=64)
def next_open_kept(configured: tuple[WindowLike, ...], now: datetime) -> datetime:
    """`next_open`, remembered per (windows, instant); ValueError each time, as it."""
    return next_open(configured, now)


# Openings `holding` follows before it gives up: a window that never holds a restart is
# refused by the config (`too_short`), so this bounds only chains of odd windows.
_HOLDING_TRIES = 64


def holding(
    windows: Sequence[WindowLike], needs_s: float, now: datetime
) -> tuple[datetime, datetime] | None:
    """When, from ``now`` on, a restart needing ``needs_s`` can start inside an open
    period, and when that period closes: ``now`` where the open period has that much left,
    else the first opening whose period does (an open window's last minutes, or a next
    window too short, hold none: the daemon waits past them, `window_ending`). None when
    none does within `_HOLDING_TRIES` openings."""
    at = _utc(now)
    for _ in range(_HOLDING_TRIES):
        period = current_window(windows, at)
        if period is not None and (period[1] - at).total_seconds() >= needs_s:
            return at, period[1]
        try:
            # From when this period closes: at an opening, next_open is that very instant.
            at = next_open(windows, at if period is None else period[1])
        except ValueError:
            return None
    return None


@functools.lru_cache(maxsize=64)
def holding_kept(
    configured: tuple[WindowLike, ...], needs_s: float, now: datetime
) -> tuple[datetime, datetime] | None:
    """`holding`, remembered per (windows, restart time, instant): a decision asks it at
    every tick of a closed window about the same next opening, and where no window holds
    the restart it walks `_HOLDING_TRIES` openings (1.5 ms)."""
    return holding(configured, needs_s, now)


# How far `too_short` looks ahead: a year, or as many openings as a chain is followed.
_HOLD_SPAN = timedelta(days=366)


def too_short(
    windows: Sequence[WindowLike], needs_s: float, now: datetime
) -> list[tuple[int, float]]:
    """The windows (by index) no restart needing ``needs_s`` fits in, each with the longest
    open period it opens into: shorter than that, and never (over the next year, or
    CHAIN_MAX openings of all windows) part of an open period of ``needs_s`` or more with
    the windows it touches or overlaps. A restart waits for an open period with that much
    left, not for a window: back to back windows of a minute (``* * * * *`` lasting 60 s)
    hold any restart."""
    now = _utc(now)
    longest = {i: float(w.duration_s) for i, w in enumerate(windows) if w.duration_s < needs_s}
    if not longest:
        return []

    def tagged(i: int, window: WindowLike) -> Iterator[tuple[datetime, datetime, int]]:
        for start, end in _spans(window, now, now + _HOLD_SPAN):
            yield start, end, i

    streams = [tagged(i, window) for i, window in enumerate(windows)]
    members: set[int] = set()
    opened = closes = now

    def close_period() -> None:
        period = (closes - opened).total_seconds()
        for i in members & longest.keys():
            longest[i] = max(longest[i], period)

    for start, end, i in itertools.islice(heapq.merge(*streams), CHAIN_MAX):
        if not members or start > closes:
            close_period()
            opened, closes, members = start, end, set()
        closes = max(closes, end)
        members.add(i)
    close_period()
    return [(i, period) for i, period in longest.items() if period < needs_s]


def local_time(windows: Sequence[WindowLike], at: datetime) -> datetime:
    """``at`` on the wall clock of the window that opens or closes then (the first such one
    configured), else of the first window: as its operator wrote the cron, with its offset."""
    at = _utc(at)
    for window in windows:
        length = timedelta(seconds=float(window.duration_s))
        for edge in (at, at - length):
            if next(_starts(window, edge, edge), None) is not None:
                return at.astimezone(load_zone(window.timezone))
    return at.astimezone(load_zone(windows[0].timezone)) if windows else at


def next_close(windows: Sequence[WindowLike], now: datetime) -> datetime:
    """When the open window closes; if none is open, when the next one will close."""
    now = _utc(now)
    current = current_window(windows, now)
    if current is None:
        current = current_window(windows, next_open(windows, now))
    assert current is not None  # next_open returns an opening, which is inside a window
    return current[1]
