"""Traffic traces that look like real use: offered concurrency, one row per second.

``python bench/traces/generate.py OUTDIR [--days N]`` (0 < N <= 100) writes ``NAME.csv``
(``t_s,concurrency``) for every trace below; `bench/bench_replay.py` generates them itself (a
week of 1-second rows is ~7 MB per trace, so the CSVs are not kept in the repository).
Seeded: the same command writes the same files.

Concurrency holds for a random spell (seconds to minutes, as requests come and go) at a
level drawn around the hour's pattern; t_s = 0 is Monday 00:00 UTC.

* ``day_night`` — an agentic-coding team by day (1–12 concurrent, with pauses; weekdays
  08–18) and batch jobs by night (24–48 concurrent, 20–06 every day).
* ``weekly`` — busy weekdays (8–24 concurrent 09–18, 1–4 otherwise), quiet weekends (0–2).
* ``steady_low`` — one or two developers all the time (1–3).
* ``steady_heavy`` — a saturated server (24–48).
* ``bursty`` — mostly 1–2, with bursts of 24–40 lasting 2–10 minutes, about a quarter of the time.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script: make `specd` importable
    sys.path.insert(0, str(REPO))

from specd.commands.args import Float  # noqa: E402

DAY_S = 86400
HOUR_S = 3600
# A row a second: 100 days are ~100 MB a trace, and what a replay reads (MAX_TRACE_ROWS).
MAX_DAYS = 100.0
DAYS = Float(0, MAX_DAYS, above_lo=True, unit="days")
Pattern = Callable[[random.Random, int, int], tuple[int, int]]  # (rng, hour, weekday) -> range


def _day_night(rng: random.Random, hour: int, weekday: int) -> tuple[int, int]:
    if hour >= 20 or hour < 6:
        return 24, 48
    if weekday < 5 and 8 <= hour < 18:
        return (1, 12) if rng.random() < 0.9 else (0, 0)
    return 0, 1


def _weekly(rng: random.Random, hour: int, weekday: int) -> tuple[int, int]:
    if weekday >= 5:
        return 0, 2
    if 9 <= hour < 18:
        return 8, 24
    return 1, 4


def _steady_low(rng: random.Random, hour: int, weekday: int) -> tuple[int, int]:
    return 1, 3


def _steady_heavy(rng: random.Random, hour: int, weekday: int) -> tuple[int, int]:
    return 24, 48


def _bursty(rng: random.Random, hour: int, weekday: int) -> tuple[int, int]:
    return (24, 40) if rng.random() < 0.05 else (1, 2)


PATTERNS: dict[str, Pattern] = {
    "day_night": _day_night,
    "weekly": _weekly,
    "steady_low": _steady_low,
    "steady_heavy": _steady_heavy,
    "bursty": _bursty,
}
SEEDS = {name: i + 11 for i, name in enumerate(PATTERNS)}


def rows(name: str, days: float = 7.0) -> Iterator[tuple[int, int]]:
    """(t_s, concurrency) for every second of ``days`` days of trace ``name``."""
    pattern = PATTERNS[name]
    rng = random.Random(SEEDS[name])
    end = int(days * DAY_S)
    t = 0
    while t < end:
        hour, weekday = (t // HOUR_S) % 24, (t // DAY_S) % 7
        lo, hi = pattern(rng, hour, weekday)
        # Bursts last minutes; ordinary spells seconds to a couple of minutes.
        spell = rng.randint(120, 600) if name == "bursty" and lo >= 24 else rng.randint(5, 120)
        level = rng.randint(lo, hi)
        stop = min(end, t + spell, (t // HOUR_S + 1) * HOUR_S)
        for s in range(t, stop):
            yield s, level
        t = stop


def write(name: str, path: Path, days: float = 7.0) -> Path:
    with path.open("w", encoding="utf-8") as handle:
        handle.write("t_s,concurrency\n")
        handle.writelines(f"{t},{c}\n" for t, c in rows(name, days))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python bench/traces/generate.py",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--days", type=DAYS, default=7.0, help=f"trace length ({DAYS.spec})")
    args = parser.parse_args(argv)
    if int(args.days * DAY_S) < 1:
        parser.error(f"argument --days: {args.days:g} days is less than one row (1 s) of trace")
    args.outdir.mkdir(parents=True, exist_ok=True)
    for name in PATTERNS:
        print(write(name, args.outdir / f"{name}.csv", args.days))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
