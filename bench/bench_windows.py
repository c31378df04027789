"""Window arithmetic per decision: the calendar of openings vs the cron arithmetic alone.

Every tick, a decision asks when the current window closes and when the next opens
(`specd.core.windows`). This walks a week of 5-second ticks through ``current_window``,
``next_open`` and ``next_close`` for each window configuration, twice interleaved per
round: once through the calendar (the code specd runs) and once with the calendar
bypassed (each query does the cron arithmetic, as before the calendar). It prints and
writes (bench/results/windows.md) CPU µs per tick for both and their ratio, measured side
by side in one run, and checks that both answer the same.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: make `bench` and `specd` importable
    sys.path.insert(0, str(REPO))

from specd.commands.args import Float, Int, Seconds  # noqa: E402
from specd.core import windows  # noqa: E402
from specd.core.windows import WindowLike, WindowSpec  # noqa: E402

RESULTS = REPO / "bench" / "results" / "windows.md"
START = datetime(2026, 1, 5, tzinfo=timezone.utc)  # a Monday
CASES: tuple[tuple[str, tuple[WindowSpec, ...]], ...] = (
    ("daily 03:00 UTC", (WindowSpec("0 3 * * mon-sun", 3600, "UTC"),)),
    (
        "07:00 and 19:00 Berlin",
        (
            WindowSpec("0 7 * * mon-sun", 3600, "Europe/Berlin"),
            WindowSpec("0 19 * * mon-sun", 3600, "Europe/Berlin"),
        ),
    ),
    ("weekends New York", (WindowSpec("0 2 * * sat,sun", 7200, "America/New_York"),)),
    ("every 20 s (demo)", (WindowSpec("*/20 * * * * *", 15, "UTC"),)),
)


@dataclass(frozen=True)
class Row:
    case: str
    ticks: int
    calendar_us: float
    cron_us: float

    @property
    def ratio(self) -> float:
        return self.cron_us / self.calendar_us


def _raw_starts(window: WindowLike, after: datetime, until: datetime) -> Iterator[datetime]:
    return windows._cron_starts(window.cron, window.timezone, after, until)


def _walk(ws: Sequence[WindowSpec], ticks: int, step_s: float) -> tuple[float, list[object]]:
    answers: list[object] = []
    began = time.process_time()
    for n in range(ticks):
        now = START + timedelta(seconds=n * step_s)
        answers.append(
            (
                windows.current_window(ws, now),
                windows.next_open(ws, now),
                windows.next_close(ws, now),
            )
        )
    return time.process_time() - began, answers


def measure(name: str, ws: Sequence[WindowSpec], ticks: int, step_s: float, rounds: int) -> Row:
    calendar = cron = 0.0
    calendar_starts = windows._starts
    for _ in range(rounds):
        windows._holder.cache_clear()
        seconds, with_calendar = _walk(ws, ticks, step_s)
        calendar += seconds
        windows._starts = _raw_starts
        try:
            seconds, without = _walk(ws, ticks, step_s)
        finally:
            windows._starts = calendar_starts
        cron += seconds
        if with_calendar != without:
            raise SystemExit(f"{name}: the calendar answers differently")
    per = 1e6 / (ticks * rounds)
    return Row(name, ticks, calendar * per, cron * per)


DAYS = Float(0, 366, above_lo=True, unit="days")
STEP_S = Seconds(0, 3600, above_lo=True)
ROUNDS = Int(1, 10)
# Some 10 µs a tick per round and case: past this a run takes hours.
MAX_TICKS = 10_000_000


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench windows", description=__doc__)
    parser.add_argument("--days", type=DAYS, default=1.0, help=f"ticked span ({DAYS.spec})")
    parser.add_argument("--step-s", type=STEP_S, default=5.0, help=f"tick ({STEP_S.spec})")
    parser.add_argument("--rounds", type=ROUNDS, default=2, help=f"rounds ({ROUNDS.spec})")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    ticks = int(args.days * 86400 / args.step_s)
    if not 1 <= ticks <= MAX_TICKS:
        parser.error(
            f"--days {args.days:g} at --step-s {args.step_s:g} is {ticks} ticks; "
            f"1..{MAX_TICKS} can be measured"
        )
    rows = []
    for name, ws in CASES:
        # The demo's window opens every 20 s: a day of ticks says as much as a week.
        n = min(ticks, int(86400 / args.step_s)) if "20 s" in name else ticks
        row = measure(name, ws, n, args.step_s, args.rounds)
        rows.append(row)
        print(
            f"{name:>24}: calendar {row.calendar_us:7.1f} µs/tick, cron arithmetic "
            f"{row.cron_us:7.1f} µs/tick, ×{row.ratio:.1f}",
            flush=True,
        )
    lines = [
        "# Window arithmetic per decision tick: calendar vs cron arithmetic",
        "",
        f"CPU µs per tick of `current_window` + `next_open` + `next_close`, {args.step_s:g} s "
        f"ticks over {args.days:g} days (the 20 s demo window: one day), {args.rounds} "
        "interleaved rounds each, same answers checked. Reproduce: `.venv/bin/python -m "
        "bench windows`.",
        "",
        "| windows | ticks | calendar µs | cron arithmetic µs | ratio |",
        "|---|--:|--:|--:|--:|",
    ]
    lines += [
        f"| {r.case} | {r.ticks} | {r.calendar_us:.1f} | {r.cron_us:.1f} | ×{r.ratio:.1f} |"
        for r in rows
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
