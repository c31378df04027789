"""Hostile numbers on `python -m bench NAME`'s command lines: every numeric argument.

Each value must be refused by argparse before anything runs: exit 2, no traceback, one
error line naming the argument, within seconds (a bench case that gets ``--days 0`` or
``nan`` died a traceback deep in its run; one whose trace ends before its first
maintenance window opens died of "nothing to choose" in the middle of the run).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from factories import run_mains

REPO = Path(__file__).resolve().parents[2]
HOSTILE = ["0", "-1", "nan", "inf", "1e308", "", "0x10", "9" * 5000]

# (bench, the argument as argparse names it, argv with {} for the value)
ARGUMENTS: list[tuple[str, str, list[str]]] = [
    ("replay", "--days", ["--days={}"]),
    ("replay", "--jobs", ["--jobs={}"]),
    ("tokens", "--days", ["--days={}"]),
    ("tokens", "--jobs", ["--jobs={}"]),
    ("decision", "--days", ["--days={}"]),
    ("coldstart", "--days", ["--days={}"]),
    ("windows", "--days", ["--days={}"]),
    ("windows", "--step-s", ["--step-s={}"]),
    ("windows", "--rounds", ["--rounds={}"]),
    ("daemon", "--ticks", ["--ticks={}"]),
    ("daemon", "--rounds", ["--rounds={}"]),
    ("fleet", "--load-time-s", ["--load-time-s={}"]),
    ("fleet", "--clients", ["--clients={}"]),
    ("fleet", "--max-tokens", ["--max-tokens={}"]),
    ("replaymem", "--rows", ["--rows={}"]),
]
ZERO_ALLOWED = {("fleet", "--load-time-s")}  # the twin can load at once

# Values of the right type the bench still cannot run: (bench, argv, in the error line).
IMPOSSIBLE: list[tuple[str, list[str], str]] = [
    # day_night's first window opens at 07:00: a 0.2-day trace ends before it.
    (
        "replay",
        ["--days=0.2", "--only=day_night"],
        "argument --days: 0.2 days of trace day_night end before its first maintenance "
        "window opens (7 h in): at least 0.2917",
    ),
    ("replay", ["--days=0.1"], "argument --days: 0.1 days of trace day_night end"),
    ("tokens", ["--days=0.12", "--only=weekly"], "0.12 days of trace weekly end"),
    ("coldstart", ["--days=0.05"], "0.05 days of trace day_night end"),
    ("decision", ["--days=0.25"], "0.25 days of trace day_night end"),
    ("decision", ["--case=near/weekly"], "argument --case: expected TRUTH/TRACE/POLICY"),
    ("decision", ["--case=near/nope/model"], "argument --case: no trace 'nope'"),
    ("decision", ["--case=nope/weekly/model"], "argument --case: no truth 'nope'"),
    ("decision", ["--case=near/weekly/fast"], "argument --case: no policy 'fast'"),
    ("windows", ["--days=0.00001"], "--days 1e-05 at --step-s 5 is 0 ticks"),
    ("windows", ["--days=366", "--step-s=0.001"], "is 31622400000 ticks; 1..10000000"),
]


def _run(argvs: list[list[str]]) -> list[tuple[object, str, str, float]]:
    return run_mains("bench.__main__:main", argvs)


def _check(
    bench: str,
    shown: str,
    result: tuple[object, str, str, float],
    want: str,
    prog: str = "python -m bench {bench}",
) -> None:
    code, stdout, stderr, took = result
    assert code == 2, (shown, code, stderr[-1000:])
    assert "Traceback" not in stderr, (shown, stderr[-2000:])
    assert stdout == "", (shown, stdout[:500])
    lines = stderr.rstrip("\n").splitlines()
    errors = [line for line in lines if f"{prog.format(bench=bench)}: error:" in line]
    assert len(errors) == 1, (shown, stderr[-1000:])
    assert errors[0] == lines[-1], (shown, stderr[-1000:])
    assert want in errors[0], (shown, errors[0])
    assert len(errors[0]) < 300, (shown, errors[0][:400])
    assert took < 10, (shown, took)


@pytest.mark.parametrize(
    ("bench", "name", "argv"), ARGUMENTS, ids=[f"{b}:{n}" for b, n, _ in ARGUMENTS]
)
def test_every_hostile_value_is_one_usage_error(bench: str, name: str, argv: list[str]) -> None:
    values = [v for v in HOSTILE if not (v == "0" and (bench, name) in ZERO_ALLOWED)]
    argvs = [[bench, *(part.replace("{}", value) for part in argv)] for value in values]
    for value, result in zip(values, _run(argvs), strict=True):
        shown = value if len(value) < 20 else value[:20] + "…"
        _check(bench, shown, result, f"argument {name}:")


def test_a_run_that_cannot_be_done_is_one_usage_error() -> None:
    argvs = [[bench, *argv] for bench, argv, _ in IMPOSSIBLE]
    for (bench, argv, want), result in zip(IMPOSSIBLE, _run(argvs), strict=True):
        _check(bench, " ".join(argv), result, want)


# bench/traces/generate.py run on its own took --days as any float: 0 wrote empty traces,
# nan and 1e308 died a traceback deep in rows(), 1e6 would have filled the disk.
GENERATE = "python bench/traces/generate.py"
GENERATE_REFUSED = [(v, "argument --days:") for v in HOSTILE] + [
    ("101", "argument --days: must be > 0 and <= 100 days"),
    ("1e-9", "argument --days: 1e-09 days is less than one row (1 s) of trace"),
]


def test_the_trace_generator_on_its_own_bounds_its_days(tmp_path: Path) -> None:
    out = tmp_path / "traces"
    argvs = [[str(out), f"--days={value}"] for value, _ in GENERATE_REFUSED]
    results = run_mains("bench.traces.generate:main", argvs)
    for (value, want), result in zip(GENERATE_REFUSED, results, strict=True):
        shown = value if len(value) < 20 else value[:20] + "…"
        _check("traces", shown, result, want, prog=GENERATE)
    assert not out.exists()  # refused before anything is written
    # As a script, as its docstring says to run it: one refusal, then a short trace written.
    script = [sys.executable, str(REPO / "bench" / "traces" / "generate.py"), str(out)]
    started = time.monotonic()
    proc = subprocess.run(
        [*script, "--days=nan"], capture_output=True, text=True, timeout=60, check=False
    )
    _check("traces", "nan", (proc.returncode, proc.stdout, proc.stderr, 0.0), "--days", GENERATE)
    proc = subprocess.run(
        [*script, "--days=0.001"], capture_output=True, text=True, timeout=60, check=False
    )
    assert time.monotonic() - started < 30
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(proc.stdout.split()) == 5  # day_night, weekly, steady_low, steady_heavy, bursty
    for path in proc.stdout.split():
        assert Path(path).read_text().count("\n") == 1 + 86  # the header and 86 seconds
