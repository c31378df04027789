"""systemd's time spans as `systemctl show` prints them ('5min', '1min 30s', '500ms',
'infinity', or plain microseconds)."""

from __future__ import annotations

import math

_UNITS_US = {
    "us": 1,
    "usec": 1,
    "ms": 1_000,
    "msec": 1_000,
    "s": 1_000_000,
    "sec": 1_000_000,
    "min": 60_000_000,
    "h": 3_600_000_000,
    "hr": 3_600_000_000,
    "d": 86_400_000_000,
    "w": 604_800_000_000,
}


def timespan_s(text: str) -> float | None:
    """Seconds in ``text``; ``math.inf`` for 'infinity'; None when it is not a time span."""
    text = text.strip()
    if text == "infinity":
        return math.inf
    if text.isdigit():
        return int(text) / 1e6
    total = 0.0
    parts = text.split()
    if not parts:
        return None
    for part in parts:
        number = part.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = part[len(number) :]
        if unit not in _UNITS_US:
            return None
        try:
            value = float(number)
        except ValueError:
            return None
        if not math.isfinite(value) or value < 0:
            return None
        total += value * _UNITS_US[unit]
    return total / 1e6
