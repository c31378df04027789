"""argparse types for every numeric command-line argument, with finite bounds.

Each type turns one argument string into a value inside ``lo..hi`` or raises
`argparse.ArgumentTypeError` with one line saying what was expected, so argparse prints
its usage error naming the argument and exits 2 — never an OverflowError, a NaN that
poisons arithmetic, or a value so large that a command runs for hours. The bounds are
generous for an operator; ``spec`` is the range as the ``--help`` text shows it.

Only the standard library: the twin (which imports nothing from specd.core) uses these.
"""

from __future__ import annotations

import argparse
import math
import re
from datetime import datetime, timedelta, timezone

_QUOTE_CHARS = 40  # error messages quote the input up to this many characters


def quoted(text: str) -> str:
    """``text`` in quotes, cut short: messages quote what was typed, never 5000 digits."""
    return repr(text if len(text) <= _QUOTE_CHARS else text[:_QUOTE_CHARS] + "…")


def _fmt(value: float) -> str:
    return f"{value:g}"


class Int:
    """A whole number in ``lo..hi`` (decimal digits only: no ``0x10``, ``1e3`` or ``5.0``)."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.spec = f"{lo}..{hi}"
        self.__name__ = "integer"  # what argparse calls the type in its messages

    def __call__(self, text: str) -> int:
        part = text.strip()
        if not re.fullmatch(r"[+-]?[0-9]{1,30}", part):
            raise argparse.ArgumentTypeError(
                f"expected a whole number in {self.spec}, got {quoted(text)}"
            )
        value = int(part)
        if not self.lo <= value <= self.hi:
            raise argparse.ArgumentTypeError(f"must be within {self.spec}, got {quoted(text)}")
        return value


class Float:
    """A finite number in ``lo..hi``; ``above_lo`` excludes ``lo`` itself (``> 0``)."""

    def __init__(self, lo: float, hi: float, *, above_lo: bool = False, unit: str = "") -> None:
        self.lo, self.hi, self.above_lo = lo, hi, above_lo
        suffix = f" {unit}" if unit else ""
        self.spec = (
            f"> {_fmt(lo)} and <= {_fmt(hi)}" if above_lo else f"{_fmt(lo)}..{_fmt(hi)}"
        ) + suffix
        self.__name__ = "number"

    def __call__(self, text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected a number {self.spec}, got {quoted(text)}")
        too_low = value <= self.lo if self.above_lo else value < self.lo
        if too_low or value > self.hi:
            raise argparse.ArgumentTypeError(f"must be {self.spec}, got {quoted(text)}")
        return value


class Seconds(Float):
    """A duration in seconds: a `Float` whose help says "s"."""

    def __init__(self, lo: float, hi: float, *, above_lo: bool = False) -> None:
        super().__init__(lo, hi, above_lo=above_lo, unit="s")


class IntList:
    """``1,2,4``: up to ``max_items`` distinct whole numbers, each in ``lo..hi``."""

    def __init__(self, lo: int, hi: int, max_items: int = 64) -> None:
        self.item = Int(lo, hi)
        self.max_items = max_items
        self.spec = f"comma-separated, each {self.item.spec}, at most {max_items}"
        self.__name__ = "list"

    def __call__(self, text: str) -> tuple[int, ...]:
        parts = [p for p in (raw.strip() for raw in text.split(",")) if p]
        if not parts:
            raise argparse.ArgumentTypeError(
                f"expected whole numbers like 1,2,4, got {quoted(text)}"
            )
        if len(parts) > self.max_items:
            raise argparse.ArgumentTypeError(f"at most {self.max_items} values, got {len(parts)}")
        values: list[int] = []
        for part in parts:
            try:
                values.append(self.item(part))
            except argparse.ArgumentTypeError as exc:
                # The item's message quotes the part already: the list is quoted once more
                # only when it holds more than that part (one line, never the text thrice).
                where = "" if len(parts) == 1 else f"in {quoted(text)}: "
                raise argparse.ArgumentTypeError(f"{where}{exc}") from None
        if len(set(values)) != len(values):
            raise argparse.ArgumentTypeError(f"a value is listed twice in {quoted(text)}")
        return tuple(values)


_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> timedelta:
    """'90s', '30m', '4h', '1d', '1h30m' → timedelta. ValueError if not one of those."""
    compact = text.strip().lower()
    parts = _DURATION_PART.findall(compact)
    if not compact or "".join(n + u for n, u in parts) != compact:
        raise ValueError(f"{text!r} is not a duration such as 90s, 30m, 4h, 1d or 1h30m")
    seconds = sum(float(n) * _UNIT_SECONDS[u] for n, u in parts)
    if seconds <= 0:
        raise ValueError(f"{text!r}: the duration must be positive")
    return timedelta(seconds=seconds)


class Duration:
    """``90s``, ``30m``, ``4h``, ``1d``, ``1h30m`` (the override file's), at most ``most``."""

    def __init__(self, most: timedelta, hint: str = "") -> None:
        self.most = most
        self.hint = f"; {hint}" if hint else ""
        self.spec = f"e.g. 30m, 4h, 1d; at most {_human(most)}"
        self.__name__ = "duration"

    def __call__(self, text: str) -> timedelta:
        try:
            value = parse_duration(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{quoted(text)} is not a positive duration such as 90s, 30m, 4h, 1d or 1h30m"
            ) from None
        except OverflowError:  # more days than timedelta holds
            value = timedelta.max
        if value > self.most:
            raise argparse.ArgumentTypeError(
                f"{quoted(text)} is longer than {_human(self.most)}{self.hint}"
            )
        if value < timedelta(seconds=1):
            # The override file holds whole seconds: it would be written expired.
            raise argparse.ArgumentTypeError(f"{quoted(text)} is shorter than a second")
        return value


def _human(delta: timedelta) -> str:
    seconds = int(delta.total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


class Timestamp:
    """An ISO 8601 time (``Z`` or an offset; UTC when none) in the years ``lo..hi``."""

    def __init__(self, lo_year: int = 1970, hi_year: int = 9000) -> None:
        self.lo = datetime(lo_year, 1, 1, tzinfo=timezone.utc)
        self.hi = datetime(hi_year, 1, 1, tzinfo=timezone.utc)
        self.spec = f"ISO 8601, from {lo_year} to {hi_year}"
        self.__name__ = "time"

    def __call__(self, text: str) -> datetime:
        try:
            at = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
            if at.tzinfo is None:
                at = at.replace(tzinfo=timezone.utc)
            inside = self.lo <= at <= self.hi
        except (ValueError, OverflowError):
            # OverflowError: an offset that pushes year 1 or 9999 out of datetime's range.
            raise argparse.ArgumentTypeError(f"{quoted(text)}: not an ISO 8601 time") from None
        if not inside:
            raise argparse.ArgumentTypeError(
                f"{quoted(text)}: must be from {self.lo.year} to {self.hi.year}"
            )
        return at


class IntRange:
    """``MIN-MAX`` (or one ``K``) with ``lo <= MIN <= MAX <= hi``."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.spec = f"MIN-MAX within {lo}..{hi}, e.g. 1-5"
        self.__name__ = "range"

    def __call__(self, text: str) -> tuple[int, int]:
        low, sep, high = text.strip().partition("-")
        bound = Int(self.lo, self.hi)
        try:
            a, b = bound(low), bound(high if sep else low)
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"expected {self.spec}, got {quoted(text)}") from None
        if a > b:
            raise argparse.ArgumentTypeError(f"MIN above MAX in {quoted(text)}")
        return a, b


# Bounds shared by several commands.
PORT = Int(1, 65535)
PORT_OR_FREE = Int(0, 65535)  # 0: the system picks a free port
STEPS = Int(1, 16)
STEPS_OR_NONE = Int(0, 16)  # 0: no speculative decoding
MAX_TOKENS = Int(1, 1_000_000)
MAX_CONCURRENCY = 4096
CONCURRENCY = Int(1, MAX_CONCURRENCY)
