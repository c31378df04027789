"""Hostile numbers on the command line: every numeric argument of every command.

Each value runs the real `specd` in a subprocess and must be refused by argparse: exit 2,
no traceback, one error line naming the argument, within seconds. The argument types
themselves are checked in-process with hypothesis, and every parser is walked so that a
new numeric argument without a bounded type fails here.
"""

from __future__ import annotations

import argparse
import importlib
import math
import subprocess
import sys
import time
from datetime import datetime, timedelta

import pytest
from factories import run_mains
from hypothesis import given, settings
from hypothesis import strategies as st

from specd.cli import COMMANDS
from specd.commands import args as cli_args

# "0.4s": a duration the override file (whole seconds) would hold expired.
HOSTILE = ["-1", "nan", "inf", "1e308", "99999999999999d", "", "0x10", "9" * 5000, "0.4s"]

# (command words, the argument as argparse names it, argv with {} for the value)
ARGUMENTS: list[tuple[str, str, list[str]]] = [
    ("override pin", "SETTING", ["override", "pin", "--", "{}"]),
    ("override pin", "--for", ["override", "pin", "3", "--for={}"]),
    ("override freeze", "--for", ["override", "freeze", "--for={}"]),
    ("replay", "--restart-s", ["replay", "--restart-s={}"]),
    ("replay", "--initial-steps", ["replay", "--initial-steps={}"]),
    ("replay", "--warmup-s", ["replay", "--warmup-s={}"]),
    ("replay", "--start", ["replay", "--start={}"]),
    ("replay", "--steps", ["replay", "--steps={}"]),
    ("replay", "--window", ["replay", "--window=0 7 * * mon;{};UTC"]),
    ("load", "--concurrency", ["load", "--concurrency={}"]),
    ("load", "--duration-s", ["load", "--duration-s={}"]),
    ("load", "--max-tokens", ["load", "--max-tokens={}"]),
    ("sweep", "--steps", ["sweep", "--steps={}"]),
    ("sweep", "--concurrency", ["sweep", "--concurrency={}"]),
    ("sweep", "--duration-s", ["sweep", "--duration-s={}"]),
    ("sweep", "--warmup-s", ["sweep", "--warmup-s={}"]),
    ("sweep", "--max-tokens", ["sweep", "--max-tokens={}"]),
    ("recommend", "--samples", ["recommend", "--samples={}"]),
    ("recommend", "--interval-s", ["recommend", "--interval-s={}"]),
    ("observe", "--timeout-s", ["observe", "--timeout-s={}"]),
    ("demo", "--duration-s", ["demo", "--duration-s={}"]),
    ("install", "--fleet-slots", ["install", "--unit=u.service", "--fleet-slots={}"]),
    ("install", "--fleet-lease-ttl-s", ["install", "--unit=u.service", "--fleet-lease-ttl-s={}"]),
    ("demo", "--metrics-port", ["demo", "--metrics-port={}"]),
    *(
        ("twin", flag, ["twin", f"{flag}={{}}"])
        for flag in (
            "--port",
            "--speculative-num-steps",
            "--speculative-eagle-topk",
            "--speculative-num-draft-tokens",
            "--max-running-requests",
            "--dp-size",
            "--tp-size",
            "--decode-log-interval",
            "--load-time-s",
            "--warmup-s",
            "--report-interval-s",
            "--seed",
            "--accept-noise",
            "--fail-start-at-steps",
            "--slow-s",
            "--metrics-pad-bytes",
        )
    ),
]


# One interpreter runs the real `specd` entry point (cli.main, as `python -m specd.cli`
# does) on every argv of this file's tables: 38 arguments × 8 values as separate processes
# took minutes of a 2-core CI machine, one interpreter per argument still ~45 s of CPU.
CLI_MAIN = "specd.cli:main"


def check_refusal(
    command: str, name: str, value: str, code: object, stdout: str, stderr: str, took: float
) -> None:
    shown = value if len(value) < 20 else value[:20] + "…"
    assert code == 2, (shown, code, stderr[-500:])
    assert "Traceback" not in stderr, (shown, stderr[-2000:])
    assert stdout == "", (shown, stdout[:500])
    lines = stderr.rstrip("\n").splitlines()
    errors = [line for line in lines if f"specd {command}: error:" in line]
    assert len(errors) == 1, (shown, stderr[-1000:])
    assert errors[0] == lines[-1], (shown, stderr[-1000:])
    assert f"argument {name}" in errors[0] or f"/{name}:" in errors[0], (shown, errors[0])
    assert len(errors[0]) < 300, (shown, errors[0][:400])  # the input is quoted short
    # Everything before the error line is argparse's usage.
    assert lines[0].startswith("usage: "), (shown, lines[0])
    assert all(line.startswith(" ") for line in lines[1:-1]), (shown, stderr)
    assert took < 10, (shown, took)


def hostile_argvs(argv: list[str]) -> list[list[str]]:
    return [[part.replace("{}", value) for part in argv] for value in HOSTILE]


Result = tuple[object, str, str, float]


@pytest.fixture(scope="module")
def ran() -> dict[tuple[str, ...], Result]:
    """(exit code, stdout, stderr, seconds) of `specd ARGV` for every argv the tests below
    check, all run by one interpreter, in the tables' order."""
    argvs = [filled for _, _, argv in ARGUMENTS for filled in hostile_argvs(argv)]
    argvs += [url_argv(command, url) for command in URL_ARGVS for url in URLS]
    # In halves: the argvs travel as one command-line argument, at most 128 KiB on Linux.
    half = len(argvs) // 2
    results = run_mains(CLI_MAIN, argvs[:half]) + run_mains(CLI_MAIN, argvs[half:])
    return {tuple(argv): result for argv, result in zip(argvs, results, strict=True)}


@pytest.mark.parametrize(
    ("command", "name", "argv"), ARGUMENTS, ids=[f"{c}:{n}" for c, n, _ in ARGUMENTS]
)
def test_every_hostile_value_is_one_usage_error(
    ran: dict[tuple[str, ...], Result], command: str, name: str, argv: list[str]
) -> None:
    for value, filled in zip(HOSTILE, hostile_argvs(argv), strict=True):
        check_refusal(command, name, value, *ran[tuple(filled)])


@pytest.mark.parametrize(
    ("command", "name", "argv"), ARGUMENTS[:2], ids=[f"{c}:{n}" for c, n, _ in ARGUMENTS[:2]]
)
def test_hostile_values_through_a_process_of_their_own(
    command: str, name: str, argv: list[str]
) -> None:
    """The same refusals from `python -m specd.cli`, a process per value, as a shell runs it."""
    for value, filled in zip(HOSTILE, hostile_argvs(argv), strict=True):
        started = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "specd.cli", *filled],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
            stdin=subprocess.DEVNULL,
        )
        took = time.monotonic() - started
        check_refusal(command, name, value, proc.returncode, proc.stdout, proc.stderr, took)


# A URL under SGLang's root (as OpenAI clients are given it, http://HOST:PORT/v1) read
# /v1/metrics and was blamed on metrics being off: refused, naming the root URL to give.
URLS = [
    "http://127.0.0.1:30000/v1",
    "http://127.0.0.1:30000/v1/",
    "http://127.0.0.1:30000/v1/chat/completions",
    "http://127.0.0.1:30000/metrics",
    "http://127.0.0.1:30000/?x=1",
]


# `specd load` took /v1 silently (it dropped it) and answered a path it could not use with
# requests to HOST:PORT/PATH/v1/...: the same refusal as observe's.
URL_ARGVS = {
    "observe": [],
    "recommend": [],
    "load": ["--concurrency=1", "--duration-s=1"],
}


def url_argv(command: str, url: str) -> list[str]:
    return [command, f"--url={url}", *URL_ARGVS[command]]


@pytest.mark.parametrize("command", list(URL_ARGVS))
def test_a_url_under_the_servers_root_is_one_usage_error(
    ran: dict[tuple[str, ...], Result], command: str
) -> None:
    for url in URLS:
        code, stdout, stderr, took = ran[tuple(url_argv(command, url))]
        check_refusal(command, "--url", url, code, stdout, stderr, took)
        assert "is not the server's root URL: specd wants http://127.0.0.1:30000 " in stderr
        assert "--enable-metrics" not in stderr, stderr


# -- the types, in-process ----------------------------------------------------------------
TYPES: list[object] = [
    cli_args.Int(1, 16),
    cli_args.Int(0, 65535),
    cli_args.Float(0, 1),
    cli_args.Seconds(0, 3600, above_lo=True),
    cli_args.IntList(1, 4096, max_items=64),
    cli_args.IntRange(1, 16),
    cli_args.Duration(timedelta(days=30)),
    cli_args.Timestamp(1970, 9000),
]


def _inside(kind: object, value: object) -> bool:
    if isinstance(kind, cli_args.Int):
        return isinstance(value, int) and kind.lo <= value <= kind.hi
    if isinstance(kind, cli_args.Float):
        assert isinstance(value, float)
        low_ok = value > kind.lo if kind.above_lo else value >= kind.lo
        return math.isfinite(value) and low_ok and value <= kind.hi
    if isinstance(kind, cli_args.IntList):
        assert isinstance(value, tuple)
        return 0 < len(value) <= kind.max_items and all(_inside(kind.item, v) for v in value)
    if isinstance(kind, cli_args.IntRange):
        assert isinstance(value, tuple)
        return kind.lo <= value[0] <= value[1] <= kind.hi
    if isinstance(kind, cli_args.Duration):
        return isinstance(value, timedelta) and timedelta(0) < value <= kind.most
    if isinstance(kind, cli_args.Timestamp):
        return isinstance(value, datetime) and kind.lo <= value <= kind.hi
    raise AssertionError(kind)


NUMBERISH = st.one_of(
    st.text(max_size=40),
    st.text(alphabet="0123456789.,-+eEinfatxdhms_ :TZ", max_size=40),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.integers(min_value=-(10**40), max_value=10**40).map(str),
    st.builds(lambda a, b: f"{a},{b}", st.integers(-5, 5000), st.integers(-5, 5000)),
    st.builds(lambda n, u: f"{n}{u}", st.integers(0, 10**20), st.sampled_from("smhd")),
    st.datetimes().map(lambda d: d.isoformat() + "Z"),
)


@settings(max_examples=300, deadline=None)
@given(kind=st.sampled_from(TYPES), text=NUMBERISH)
def test_a_type_returns_a_value_in_bounds_or_one_clear_refusal(kind: object, text: str) -> None:
    assert callable(kind)
    try:
        value = kind(text)
    except argparse.ArgumentTypeError as exc:
        message = str(exc)
        assert message
        assert "\n" not in message
        assert len(message) < 250, message
        return
    assert _inside(kind, value), (kind, text, value)


# -- every numeric argument uses a bounded type, and says its bounds in --help ------------
BOUNDED = (
    cli_args.Int,
    cli_args.Float,
    cli_args.IntList,
    cli_args.IntRange,
    cli_args.Duration,
    cli_args.Timestamp,
)


def _parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    found: list[tuple[str, argparse.ArgumentParser]] = []
    for name, (module_name, _) in COMMANDS.items():
        parser = argparse.ArgumentParser(prog=f"specd {name}")
        importlib.import_module(module_name).configure(parser)
        stack = [(name, parser)]
        while stack:
            label, current = stack.pop()
            found.append((label, current))
            for action in current._actions:
                if isinstance(action, argparse._SubParsersAction):
                    stack += [(f"{label} {n}", p) for n, p in action.choices.items()]
    return found


def test_no_argument_takes_a_bare_int_or_float_and_bounds_are_in_help() -> None:
    checked = 0
    for label, parser in _parsers():
        for action in parser._actions:
            where = f"specd {label} {'/'.join(action.option_strings) or action.dest}"
            assert action.type not in (int, float), f"{where}: unbounded {action.type}"
            if isinstance(action.type, BOUNDED):
                checked += 1
                spec = action.type.spec
                assert action.help, f"{where}: no help"
                assert spec in action.help, f"{where}: help lacks {spec!r}"
    # --window's DURATION_S is inside its own type; pin's SETTING is a setting, not a number.
    numeric = [arg for arg in ARGUMENTS if arg[1] != "SETTING"]
    assert checked >= len(numeric) - 1
