from __future__ import annotations

import copy
import functools
import itertools
import json
import math
import os
import random
import re
import subprocess
import time
import tracemalloc
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from factories import run_specd
from in_process import specd_main as in_process

from specd.cli import main as specd_main
from specd.commands.replay import build_config, human_lines
from specd.core import windows
from specd.core.adaptive import DEFAULT_SLOTS, AdaptiveModel
from specd.core.model import adaptive_slots
from specd.core.perftable import PerfRow, PerfTable
from specd.core.setting import parse
from specd.core.settings import DEFAULT_ADAPTIVE_SETS
from specd.io.config import Config, Window
from specd.io.tables import read_table, write_table
from specd.tools import replay as replay_module
from specd.tools.replay import (
    ADAPTIVE,
    DEFAULT_START,
    MAX_TRACE_ROWS,
    TRACE_TOO_LONG,
    ReplayError,
    ReplayResult,
    Tokens,
    Trace,
    load_trace,
    replay,
    trace_from_rows,
)

REPO = Path(__file__).resolve().parents[2]
TRUTH = REPO / "bench" / "truth"
SEED = REPO / "specd" / "data" / "seed-qwen35-122b.csv"
# (truth the tokens come from, calibration a sweep measured)
TRUTHS = {
    "seed": (SEED, TRUTH / "seed-calibration.csv"),
    "k5to2": (TRUTH / "k5to2.csv", TRUTH / "k5to2-calibration.csv"),
    "lowaccept": (TRUTH / "lowaccept.csv", TRUTH / "seed-calibration.csv"),
}
DAY = 86400
TWICE_A_DAY = [
    Window(cron="0 7 * * mon-sun", duration_s=3600, timezone="UTC"),
    Window(cron="0 19 * * mon-sun", duration_s=3600, timezone="UTC"),
]
DAILY = [Window(cron="0 3 * * mon-sun", duration_s=3600, timezone="UTC")]
# A tick every 15 s (the daemon's default scrapes every 5 s): for the tests of what a replay
# counts and reports, which hold at any tick (tokens recount from the timeline the replay
# made, whatever it is); a third of the ticks. The bench (tests/bench) replays at 5 s.
QUICK = Config(observe={"scrape_interval_s": 15})


@functools.cache
def minute_trace(days: float, level: Callable[[random.Random, int], tuple[int, int]]) -> Trace:
    """One row a minute; ``level(rng, hour)`` gives the range of offered concurrency (the
    same trace object for the same arguments: `kinds_result` knows it by identity)."""
    rng = random.Random(7)
    times, levels = [], []
    for m in range(int(days * 24 * 60)):
        lo, hi = level(rng, (m // 60) % 24)
        times.append(float(m * 60))
        levels.append(float(rng.randint(lo, hi)))
    return trace_from_rows(times, levels)


def day_night(rng: random.Random, hour: int) -> tuple[int, int]:
    if hour >= 20 or hour < 6:
        return 24, 48  # batch jobs
    if 8 <= hour < 18:
        return 1, 12  # an agentic-coding team
    return 0, 1


def bursty(rng: random.Random, hour: int) -> tuple[int, int]:
    return (24, 40) if rng.random() < 0.25 else (1, 2)


def check_acceptance(data: dict[str, Any]) -> None:
    assert data["restarts_outside_windows"] == 0
    assert data["ratio_to_oracle"] >= 0.97
    assert data["ratio_to_best_static"] >= 0.99
    if data["oracle_gap_ratio"] > 0.03:
        assert data["gap_captured_ratio"] >= 2 / 3
    assert data["restarts_per_day"] <= 2


def run_replay(
    truth: str, trace: Trace, window_list: list[Window], warmup_s: float = 0.0
) -> dict[str, Any]:
    table, calibration = TRUTHS[truth]
    # Ticks follow the config's scrape interval; 15 s keeps these tests quick.
    config = build_config(
        Config(observe={"scrape_interval_s": 15}),
        window_list=window_list,
        steps=(1, 6),
        calibration=calibration,
        restart_s=100,
    )
    return replay(trace, read_table(table), config, warmup_s=warmup_s).to_dict()


@pytest.mark.parametrize("truth", sorted(TRUTHS))
def test_day_and_night_against_the_oracle(truth: str) -> None:
    # The first day, which no forecast can know, is replayed but not scored here; the
    # bench scores whole weeks, cold start included.
    data = run_replay(truth, minute_trace(3, day_night), TWICE_A_DAY, warmup_s=DAY)
    check_acceptance(data)
    assert data["days"] == pytest.approx(2.0)
    # Every restart happened inside a window (by the windows code, not the replay's own).
    changes = data["steps_timeline"][1:]
    for t_s, _ in changes:
        assert windows.is_open(TWICE_A_DAY, DEFAULT_START + timedelta(seconds=t_s))
    scored = [t_s for t_s, _ in changes if t_s >= DAY]
    assert len(scored) == data["restarts"]
    # Forecasts made at each window opening, scored against the trace afterwards: after
    # the first day the same hours are known.
    assert 0 <= data["forecast_median_error_ratio"] < 0.2
    assert 0 <= data["forecast_total_variation"] <= 1


@pytest.mark.parametrize("truth", ["k5to2", "lowaccept"])
def test_bursty_traffic_against_the_oracle(truth: str) -> None:
    check_acceptance(run_replay(truth, minute_trace(2, bursty), DAILY))


def test_tokens_come_from_the_truth_and_restarts_serve_nothing() -> None:
    # Constant 2 concurrent for a day; the window at 03:00 switches 3 → 4 once.
    trace = trace_from_rows([h * 3600.0 for h in range(24)], [2.0] * 24)
    table = read_table(SEED)
    config = build_config(QUICK, window_list=DAILY, steps=(3, 4), calibration=SEED, restart_s=100)
    result = replay(trace, table, config, restart_s=100, initial_steps=3)
    rate3, rate4 = table.throughput(3, 2), table.throughput(4, 2)
    assert result.static_tokens[3] == pytest.approx(rate3 * DAY)
    # Before the first window (03:00) no one can choose: static 4 restarts into 4 then, and
    # serves nothing for the restart's 100 s, as specd.
    from_window = rate3 * 3 * 3600 + rate4 * (DAY - 3 * 3600 - 100)
    assert result.static_tokens[4] == pytest.approx(from_window)
    assert result.restarts == 1
    (switched_at, steps) = result.steps_timeline[1]
    assert steps == 4
    expected = rate3 * switched_at + rate4 * (DAY - switched_at - 100)
    assert result.specd_tokens == pytest.approx(expected)
    # Before the first window no one can choose, so the oracle runs 3 there too; it alone
    # restarts for free (the bound of choosing in hindsight).
    assert result.oracle_tokens == pytest.approx(rate3 * 3 * 3600 + rate4 * (DAY - 3 * 3600))


def test_the_margin_over_sglang_adaptive_is_split_where_its_capacity_binds() -> None:
    # Two requests, a batch job at 40 from 06:00 to 12:00, two again: adaptive's capacity
    # (its deepest candidate's) binds only in the batch job's six hours.
    levels = [40.0 if 6 <= h < 12 else 2.0 for h in range(24)]
    trace = trace_from_rows([h * 3600.0 for h in range(24)], levels)
    table = read_table(SEED)
    config = build_config(QUICK, window_list=DAILY, steps=(3, 4), calibration=SEED, restart_s=100)
    result = replay(trace, table, config, restart_s=100, initial_steps=3)
    data = result.to_dict()["adaptive"]
    adaptive = AdaptiveModel.of(DEFAULT_SLOTS, table)
    assert adaptive.capacity is not None
    assert 2 < adaptive.capacity < 40
    assert data["capacity"] == adaptive.capacity
    assert data["above_capacity_ratio"] == pytest.approx(0.25)
    # The batch job runs long after every restart (the window is 03:00-04:00): in those
    # hours adaptive serves its tier for 40 at its capacity, specd the K it changed to.
    live = [k for t_s, k in result.steps_timeline if t_s < 6 * 3600][-1]
    assert live is not None
    binds = data["where_capacity_binds"]
    assert binds["adaptive_tokens"] == round(adaptive.throughput(40.0) * 6 * 3600)
    assert binds["specd_tokens"] == round(table.throughput(live, 40.0) * 6 * 3600)
    assert binds["ratio_to_adaptive"] == pytest.approx(
        table.throughput(live, 40.0) / adaptive.throughput(40.0), abs=1e-4
    )
    # The two parts are the whole: each side's tokens, restarts included, add up.
    free = data["where_capacity_does_not_bind"]
    assert binds["specd_tokens"] + free["specd_tokens"] == pytest.approx(result.specd_tokens, abs=1)
    assert binds["adaptive_tokens"] + free["adaptive_tokens"] == pytest.approx(
        data["tokens"], abs=1
    )
    assert free["ratio_to_adaptive"] == pytest.approx(
        free["specd_tokens"] / free["adaptive_tokens"], abs=1e-4
    )


@pytest.mark.parametrize(
    ("a", "b", "ceiling"),
    [(0, 10_800, 11), (90, 7_170, 11), (61, 119, 0), (3_000, 3_001, 20), (500, 9_000, 29)],
)
def test_tokens_above_a_ceiling_count_only_the_seconds_above_it(
    a: int, b: int, ceiling: int
) -> None:
    # Runs of a minute at random levels; spans that start and end inside runs.
    rng = random.Random(3)
    levels = [float(rng.randint(0, 30)) for _ in range(180)]
    trace = trace_from_rows([m * 60.0 for m in range(180)], levels)
    table = read_table(SEED)
    tokens = Tokens(trace, table, [4])
    expected = sum(
        table.throughput(4, level)
        for s in range(a, b)
        if (level := levels[s // 60]) > ceiling and level > 0
    )
    assert tokens.between(4, a, b, above=ceiling) == pytest.approx(expected, rel=1e-9)
    everything = sum(table.throughput(4, levels[s // 60]) for s in range(a, b) if levels[s // 60])
    assert tokens.between(4, a, b) == pytest.approx(everything, rel=1e-9)


def test_where_adaptive_capacity_never_binds_that_part_is_empty() -> None:
    trace = trace_from_rows([h * 3600.0 for h in range(24)], [2.0] * 24)
    config = build_config(QUICK, window_list=DAILY, steps=(3, 4), calibration=SEED, restart_s=100)
    data = replay(trace, read_table(SEED), config, restart_s=100).to_dict()
    adaptive = data["adaptive"]
    assert adaptive["above_capacity_ratio"] == 0
    assert adaptive["where_capacity_binds"] == {
        "specd_tokens": 0,
        "adaptive_tokens": 0,
        "ratio_to_adaptive": None,
    }
    assert (
        adaptive["where_capacity_does_not_bind"]["ratio_to_adaptive"] == data["ratio_to_adaptive"]
    )


def test_the_bands_policy_replays_too() -> None:
    config = build_config(QUICK, window_list=DAILY, steps=(1, 6), policy="bands")
    assert config.choose.policy == "bands"
    result = replay(minute_trace(1, day_night), read_table(SEED), config)
    assert result.restarts_outside_windows == 0


def steady(lo: int, hi: int) -> Callable[[random.Random, int], tuple[int, int]]:
    return lambda rng, hour: (lo, hi)


@pytest.mark.parametrize(
    ("truth", "level", "visits", "explorations"),
    [
        # Light: the bands' 4, then up the rise to 5, the best; 6 lies past a rise that is
        # no longer beyond its interval once 4's day of evidence has decayed: the walk stops.
        (TRUTH / "k5to2.csv", steady(1, 3), [3, 4, 5], [4, 5]),
        # Heavy: the bands keep 3, so its neighbours: 4 (worse: back to 3 by a plain
        # change), 2 (better), a week on 1 (worse: back to 2, the best).
        (TRUTH / "k6to1.csv", steady(24, 48), [3, 4, 3, 2, 1, 2], [4, 2, 1]),
    ],
    ids=["light", "heavy"],
)
def test_without_calibration_specd_learns_the_box_by_exploring(
    truth: Path,
    level: Callable[[random.Random, int], tuple[int, int]],
    visits: list[int],
    explorations: list[int],
) -> None:
    # Ticks follow the config's scrape interval; 30 s keeps this test quick.
    config = build_config(
        Config(observe={"scrape_interval_s": 30}),
        window_list=DAILY,
        steps=(1, 6),
        policy="model",
        restart_s=100,
    )
    assert config.choose.calibration_file is None
    trace = minute_trace(10, level)
    data = replay(trace, read_table(truth), config, restart_s=100).to_dict()
    assert [k for _, k in data["steps_timeline"]] == visits
    assert visits[-1] == data["best_static_steps"]  # the truth's best, found
    explored = data["explorations"]
    assert [k for _, k in explored["timeline"]] == explorations
    assert explored["timeline"] == [
        [t, k]
        for (t, k), why in zip(data["steps_timeline"][1:], data["change_reasons"], strict=True)
        if why == "explore"
    ]
    assert explored["count"] == len(explorations)
    assert explored["per_steps"] == {str(k): 1 for k in sorted(explorations)}
    assert explored["max_per_steps_per_week"] == 1
    # Every other change went back from a worse one: a plain change.
    assert set(data["change_reasons"]) <= {"explore", "change"}
    assert data["restarts_outside_windows"] == 0
    # Found within nine days (two weeks of explorations), it stays there.
    assert all(t < 9 * DAY for t, _ in data["steps_timeline"][1:])


# -- input ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("time,c\n0,1\n", "header must be t_s,concurrency"),
        ("t_s,concurrency\n", "no rows"),
        ("t_s,concurrency\n0,1\n0,2\n", "t_s must increase"),
        ("t_s,concurrency\n0,-1\n", "concurrency >= 0"),
        ("t_s,concurrency\n0,abc\n", "not numbers"),
        ("t_s,concurrency\n0,1e300\n", "concurrency must be at most 2\\*\\*53, got 1e\\+300"),
        ("t_s,concurrency\n0\n", "expected t_s,concurrency"),
        ("t_s,concurrency\n0,1\n" + "1" * 200_000 + ",1\n", r":3: not a CSV row"),
        ("\ufefft_s,concurrency\n0,1\n", "starts with a UTF-8 byte order mark"),
        # An average over time: rounded, 0.45 was no request at all.
        ("t_s,concurrency\n0,2\n60,0.45\n", ":3: concurrency must be a whole number"),
        ("t_s,concurrency\n0,0\n60,0\n", "concurrency is 0 in every row"),
    ],
)
def test_bad_traces_are_one_line_errors(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "trace.csv"
    path.write_text(content)
    with pytest.raises(ReplayError, match=message) as info:
        load_trace(path)
    assert "\n" not in str(info.value)


def test_a_trace_is_runs_of_constant_concurrency(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    path.write_text("t_s,concurrency\n0,1\n10,1\n20,3\n30,3\n40,0\n")
    trace = load_trace(path)
    assert list(trace.level) == [1, 3, 0]
    assert list(trace.t) == [0.0, 20.0, 40.0, 50.0]  # the last row lasts the median row (10 s)
    assert [trace.at(s) for s in (0, 19.9, 20, 45)] == [1, 1, 3, 0]


# -- memory: a run costs bytes, not lists of Python floats ------------------------------
def _churn(path: Path, rows: int) -> Path:
    """1-second rows whose concurrency changes at every row: a run a row, replay's worst."""
    path.write_text("t_s,concurrency\n" + "".join(f"{t},{1 + t % 7}\n" for t in range(rows)))
    return path


def test_a_trace_and_its_tokens_take_tens_of_bytes_a_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Text, csv rows and lists of floats made a row of this trace cost ~700 bytes, 7 GB
    at the row cap: the trace, every step count's, set's and ceiling's tokens now ~40."""
    rows = 100_000
    # os.read asks for the whole cap at once: keep that allocation out of the peak.
    monkeypatch.setattr(replay_module, "MAX_TRACE_BYTES", 2 * 2**20)
    path = _churn(tmp_path / "trace.csv", rows)
    table = read_table(TRUTH / "k5to2.csv")
    sets = [parse(text) for text in DEFAULT_ADAPTIVE_SETS]
    tracemalloc.start()
    try:
        trace = load_trace(path)
        tokens = Tokens(trace, table, range(1, 7), AdaptiveModel.of(DEFAULT_SLOTS, table))
        keys = [tokens.ensure(s) for s in sets if s.table_steps <= set(table.steps())]
        for key in [*range(1, 7), ADAPTIVE, *keys]:
            assert tokens.between(key, 10.5, rows - 0.5, above=4) > 0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(trace.level) == rows
    assert len(keys) == 4
    assert peak < 48 * rows + 2**20, f"{peak / rows:.0f} bytes a row"


def test_the_row_cap_is_one_line_that_says_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(replay_module, "MAX_TRACE_ROWS", 100)
    path = _churn(tmp_path / "trace.csv", 100)
    assert len(load_trace(path).level) == 100
    _churn(path, 101)
    code = specd_main(["replay", "--trace", str(path), "--truth", str(SEED), "--steps", "1-5"])
    err = capsys.readouterr().err
    assert code == 2
    assert err == f"specd replay: {path}: more than 100 rows: {TRACE_TOO_LONG}\n"
    assert TRACE_TOO_LONG == (
        "resample it coarser, e.g. to 10-second rows (1-second rows fit up to 115 days)"
    )
    # The bench's longest traces (--days 28; bench_replay allows 100) fit the real cap.
    assert 100 * DAY <= MAX_TRACE_ROWS


def test_too_large_a_trace_file_says_what_to_do(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    _trace_huge(path)
    with pytest.raises(ReplayError) as info:
        load_trace(path)
    assert str(info.value) == (
        f"{path}: is 1.024e+04 MiB, larger than the 256 MiB allowed: {TRACE_TOO_LONG}"
    )


def test_sparse_prefix_sums_count_to_the_bit_of_a_running_sum() -> None:
    """`Tokens` keeps every 16th prefix sum and adds the runs since: every figure is the
    very float the running sum over all runs gave (the decisions and tokens must not move)."""
    rng = random.Random(5)
    times = [0.0]
    for _ in range(999):
        times.append(times[-1] + rng.choice([0.1, 0.7, 1.0, 3.3, 60.0]))
    trace = trace_from_rows(times, [float(rng.randint(0, 40)) for _ in times])
    table = read_table(SEED)
    tokens = Tokens(trace, table, [1, 4])
    t, levels = list(trace.t), list(trace.level)
    for k, above in itertools.product((1, 4), (None, 11)):
        rates = [
            table.throughput(k, float(c)) if c > 0 and (above is None or c > above) else 0.0
            for c in levels
        ]
        cum = [0.0]
        for i, r in enumerate(rates):
            cum.append(cum[-1] + r * (t[i + 1] - t[i]))
        for i, r in enumerate(rates):
            s = t[i] + (t[i + 1] - t[i]) * rng.random()
            assert tokens.upto(k, t[i], above) == cum[i]
            assert tokens.upto(k, s, above) == cum[i] + r * (s - t[i])
            assert tokens.run_rate(k, i, above) == r
        assert tokens.upto(k, t[-1], above) == cum[-2] + rates[-1] * (t[-1] - t[-2])


@pytest.mark.parametrize("max_values", [3, 65_536], ids=["sorted", "counted"])
def test_the_last_row_lasts_the_median_gap_a_sort_finds(
    monkeypatch: pytest.MonkeyPatch, max_values: int
) -> None:
    monkeypatch.setattr(replay_module, "_MAX_GAP_VALUES", max_values)
    rng = random.Random(9)
    for n in range(1, 80):
        times = sorted(x + rng.choice([0.0, 0.25, 0.1]) for x in rng.sample(range(200), n))
        gaps = sorted(b - a for a, b in itertools.pairwise(times))
        last = gaps[len(gaps) // 2] if gaps else 1.0
        assert trace_from_rows(times, [1.0] * n).t[-1] == times[-1] + last


@pytest.mark.parametrize("end", ["\n", "\r\n", "\r"], ids=["lf", "crlf", "cr"])
def test_every_line_ending_splits_rows(tmp_path: Path, end: str) -> None:
    """As io.StringIO(text, newline="") split them, also where the 8 KiB chunks the text is
    decoded in end between a \r and its \n (one of the header's paddings puts it there)."""
    rows = 3000
    path = tmp_path / "trace.csv"
    across = []
    for pad in range(8):
        lines = ["t_s,concurrency" + " " * pad, *(f"{t},{1 + t % 3}" for t in range(rows))]
        data = (end.join(lines) + end).encode()
        across.append(data[8191:8193] == b"\r\n")
        path.write_bytes(data)
        trace = load_trace(path)
        assert list(trace.level) == [1 + t % 3 for t in range(rows)]
        assert list(trace.t) == [float(t) for t in range(rows + 1)]
    assert any(across) == (end == "\r\n")


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 2**20])
@pytest.mark.parametrize(
    "tail",
    [b"\xff", b"\xc3", b"\xe2\x82", b"\xe2\x28\xa1", b"\xc0\xaf", b"\xed\xa0\x80", b"0,1\n\x80"],
)
def test_a_bad_byte_is_the_one_decoding_whole_finds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int, tail: bytes
) -> None:
    monkeypatch.setattr(replay_module, "_UTF8_CHUNK", chunk)
    data = "t_s,concurrency\n0,1\n1,é€😀\n".encode() + tail + b"\n"
    with pytest.raises(UnicodeDecodeError) as whole:
        data.decode("utf-8")
    path = tmp_path / "trace.csv"
    path.write_bytes(data)
    with pytest.raises(ReplayError, match=re.escape(f"(byte {whole.value.start})")):
        load_trace(path)
    # Characters across the chunks are no error: the row is.
    path.write_bytes(data[: -len(tail) - 1])
    with pytest.raises(ReplayError, match="not numbers: '1,é€😀'"):
        load_trace(path)


# -- the command ------------------------------------------------------------------------
def real_specd(*args: str) -> subprocess.CompletedProcess[str]:
    """`specd replay ARGS` as its own process, with no SPECD_* settings from here."""
    return run_specd("replay", *args, env={"PATH": "/usr/bin:/bin"})


def specd(*args: str) -> subprocess.CompletedProcess[str]:
    """`specd replay ARGS` in this process (tests/in_process.py). The tests that use it are
    about the command, not the process (a process costs ~0.5 s of CPU to import specd);
    test_the_command_prints_the_agreed_json and test_bad_arguments_exit_2_with_one_line
    keep real ones (`real_specd`)."""
    return in_process("replay", *args)


@pytest.fixture
def quick(tmp_path: Path) -> list[str]:
    """`--config` of a file setting `QUICK`'s tick, for the command's tests of what it
    counts and prints."""
    path = tmp_path / "quick.toml"
    path.write_text(f"[observe]\nscrape_interval_s = {QUICK.observe.scrape_interval_s:g}\n")
    return ["--config", str(path)]


@pytest.fixture(autouse=True)
def _no_specd_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """As the real processes run (`env={"PATH": ...}`): no SPECD_* setting reaches the
    config the command builds in process."""
    for name in list(os.environ):
        if name.upper().startswith("SPECD_"):
            monkeypatch.delenv(name)


def test_the_command_prints_the_agreed_json(tmp_path: Path, quick: list[str]) -> None:
    trace = tmp_path / "trace.csv"
    rows = [f"{m * 60},{2 if (m // 60) % 24 < 12 else 30}" for m in range(2 * 24 * 60)]
    trace.write_text("t_s,concurrency\n" + "\n".join(rows) + "\n")
    proc = real_specd(
        "--trace", str(trace), "--truth", str(SEED),
        "--calibration", str(TRUTH / "seed-calibration.csv"),
        "--window", "0 7 * * mon-sun;3600;UTC", "--steps", "1-5",
        "--restart-s", "100", "--start", "2026-01-05T00:00:00Z", "--json", *quick,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    for key in (
        "specd_tokens", "oracle_tokens", "ratio_to_oracle", "static_tokens",
        "best_static_steps", "ratio_to_best_static", "restarts",
        "restarts_outside_windows", "days", "decision_ms_p99", "decision_cpu_ms_p99",
        "decision_cpu_ms_mean", "decision_cpu_ms_max",
    ):  # fmt: skip
        assert key in data, key
    assert sorted(data["static_tokens"]) == ["1", "2", "3", "4", "5"]
    assert data["policy"] == "model"
    assert data["days"] == pytest.approx(2.0)
    assert data["decision_ms_p99"] < 50  # the ≤ 5 ms budget is measured in the bench


@pytest.mark.parametrize(
    ("config_cost_s", "flag", "replayed_s"),
    [
        pytest.param(None, None, 100.0, id="defaults"),
        # The config's restart cost is what its daemon decides with: replayed unless the
        # flag says otherwise (the flag's default of 100 s replaced it).
        pytest.param(3000, None, 3000.0, id="the-config-s"),
        pytest.param(3000, "300", 300.0, id="the-flag-wins"),
    ],
)
def test_the_restart_replayed_is_the_configs_unless_the_flag_says(
    tmp_path: Path, config_cost_s: int | None, flag: str | None, replayed_s: float
) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text("t_s,concurrency\n" + "".join(f"{m * 60},2\n" for m in range(24 * 60)))
    config = tmp_path / "specd.toml"
    text = f"[observe]\nscrape_interval_s = {QUICK.observe.scrape_interval_s:g}\n"
    if config_cost_s is not None:
        text += f"[choose]\nrestart_cost_s = {config_cost_s}\n"
    config.write_text(text)
    argv = ["--trace", str(trace), "--truth", str(SEED), "--config", str(config), "--json"]
    proc = specd(*argv, *(["--restart-s", flag] if flag is not None else []))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["restart_s"] == replayed_s
    assert set(data["static_restart_s"].values()) == {0, replayed_s}


BAD_ARGUMENTS = [
    (["--window", "0 7 * * 1;3600;UTC"], "--window"),
    (["--window", "0 7 * * mon"], "expected 'CRON;DURATION_S;TZ'"),
    (["--steps", "5-2"], "--steps"),
    (["--start", "yesterday"], "--start"),
    (["--truth", "/nonexistent.csv"], "cannot read"),
    (["--steps", "1-9"], "truth has no steps 7,8,9"),
    (["--start", "9999-12-31T00:00:00Z"], "--start: '9999-12-31T00:00:00Z': must be from 1970"),
    (["--start", "1969-12-31T23:00:00Z"], "must be from 1970 to 9000"),
    (["--calibration", "/nonexistent.csv"], "/nonexistent.csv: cannot read"),
    (["--restart-s", "inf"], "--restart-s"),
    (["--initial-steps", "99"], "--initial-steps"),
    (["--window", "0 7 * * mon;1e308;UTC"], "DURATION_S must be > 0"),
    (["--adaptive-loss", "0.6"], "--adaptive-loss: must be 0..0.5"),
    (["--adaptive-loss", "nan"], "--adaptive-loss"),
]


@pytest.mark.parametrize(("args", "message"), BAD_ARGUMENTS)
def test_bad_arguments_exit_2_with_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text("t_s,concurrency\n0,1\n60,2\n")
    base = {"--trace": str(trace), "--truth": str(SEED)}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        base[flag] = value
    argv = [item for pair in base.items() for item in pair]
    # A real process for the first row: the exit code and stderr through the boundary.
    proc = real_specd(*argv) if args == BAD_ARGUMENTS[0][0] else specd(*argv)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert message in lines[-1]
    assert "Traceback" not in proc.stderr


def test_a_garbage_calibration_names_the_file_in_one_line(tmp_path: Path) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text("t_s,concurrency\n0,1\n60,2\n")
    calibration = tmp_path / "cal.csv"
    calibration.write_text("garbage\n1,2,3\n")
    proc = specd("--trace", str(trace), "--truth", str(SEED), "--calibration", str(calibration))
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert f"{calibration}:1: header must be" in proc.stderr
    assert "pydantic" not in proc.stderr


@pytest.mark.parametrize(
    ("calibration", "kinds", "message"),
    [
        # Not a table: the flag that named it, not the config key it fills.
        (b"\x7fELF\x02\x01\x01\x00\xff\xfe", None, "--calibration: {cal}: is not UTF-8 text"),
        ((TRUTH / "k5to2-calibration.csv").read_bytes(), "off", "--kinds: {cal} can predict none"),
    ],
    ids=["binary", "kinds"],
)
def test_a_calibration_problem_names_the_flag_that_set_it(
    tmp_path: Path, calibration: bytes, kinds: str | None, message: str
) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text("t_s,concurrency\n0,1\n60,2\n")
    cal = tmp_path / "cal.csv"
    cal.write_bytes(calibration)
    more = [] if kinds is None else ["--kinds", kinds]
    proc = specd("--trace", str(trace), "--truth", str(SEED), "--calibration", str(cal), *more)
    assert proc.returncode == 2
    assert proc.stderr.startswith("specd replay: " + message.format(cal=cal)), proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert "choose." not in proc.stderr


@pytest.mark.parametrize("warmup", ["180", "181", "86400"])
def test_a_warmup_that_leaves_nothing_to_score_is_refused(tmp_path: Path, warmup: str) -> None:
    """It printed a TypeError (human lines) or, with --json, 0 tokens and every ratio 1.0."""
    trace = tmp_path / "trace.csv"
    trace.write_text("t_s,concurrency\n0,1\n60,2\n120,1\n")
    for extra in ([], ["--json"]):
        proc = specd("--trace", str(trace), "--truth", str(SEED), "--warmup-s", warmup, *extra)
        assert proc.returncode == 2, proc.stdout
        assert proc.stderr == (
            f"specd replay: warmup {float(warmup):g} s leaves nothing to score: the trace "
            "spans 180 s (its last row lasting as long as the median one)\n"
        )


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (["0,1", "1e308,2"], "the trace spans inf s; at most 3.16224e+07 s (366 days)"),
        (["0,1", "1e9,2"], "the trace spans 2e+09 s"),
        (["0,1", "1e7,2", "2e7,1"], "at most 6400000 ticks"),
    ],
)
def test_an_absurd_trace_span_is_refused_before_any_work(
    tmp_path: Path, rows: list[str], message: str
) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text("t_s,concurrency\n" + "\n".join(rows) + "\n")
    config = tmp_path / "specd.toml"
    config.write_text("[observe]\nscrape_interval_s = 1\n")  # 3e7 s: within a year, not in ticks
    started = time.monotonic()
    proc = specd("--trace", str(trace), "--truth", str(SEED), "--config", str(config))
    assert time.monotonic() - started < 20
    assert proc.returncode == 2
    assert message in proc.stderr.strip().splitlines()[-1], proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr


def test_start_defaults_to_a_monday() -> None:
    assert datetime(2026, 1, 5, tzinfo=timezone.utc) == DEFAULT_START
    assert DEFAULT_START.weekday() == 0


def _trace_fifo(path: Path) -> None:
    os.mkfifo(path)


def _trace_huge(path: Path) -> None:
    with path.open("wb") as handle:
        handle.truncate(10 * 1024**3)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (_trace_fifo, "is not a regular file (a FIFO)"),
        (_trace_huge, "larger than the 256 MiB allowed"),
        (lambda path: path.symlink_to("/dev/zero"), "(a character device)"),
        (lambda path: path.write_bytes(b"t_s,concurrency\n0,\xff\n"), "is not UTF-8 text"),
    ],
    ids=["fifo", "sparse-10g", "dev-zero", "latin1"],
)
def test_a_hostile_trace_file_is_one_line_within_a_second(
    tmp_path: Path, make: Callable[[Path], object], message: str
) -> None:
    path = tmp_path / "trace.csv"
    make(path)
    started = time.monotonic()
    with pytest.raises(ReplayError, match=re.escape(message)) as info:
        load_trace(path)
    assert time.monotonic() - started < 1.0
    assert str(info.value).startswith(f"{path}: ")
    assert "\n" not in str(info.value)


# -- side by side in one run, recountable -----------------------------------------------
SWEPT = TRUTH / "seed-calibration.csv"  # measured at 1..32: capacities 13..26 lie between
# Swept at 1, 2, 8, 16, 32, capacities 13..19 between: 4 serves most at 2 concurrent, 2 at 32.
PLATEAU_TRUTH = (
    "steps,concurrency,output_tok_s,accept_length,max_running_requests\n"
    "2,1,180,2.8,19\n2,2,350,2.8,19\n2,8,1300,2.8,19\n2,16,2000,2.8,19\n2,32,2300,2.8,19\n"
    "3,1,230,3.6,15\n3,2,450,3.6,15\n3,8,1600,3.6,15\n3,16,1900,3.6,15\n3,32,1950,3.6,15\n"
    "4,1,280,4.5,13\n4,2,540,4.5,13\n4,8,1900,4.5,13\n4,16,1800,4.5,13\n4,32,1750,4.5,13\n"
)


def _integrate(
    times: list[float], levels: list[int], rate: Callable[[int], float], a: float, b: float
) -> float:
    """Tokens at ``rate(level)`` over [a, b] of a trace of rows (each lasts to the next)."""
    total = 0.0
    for i, level in enumerate(levels):
        lo, hi = max(times[i], a), min(times[i + 1], b)
        if hi > lo and level > 0:
            total += rate(level) * (hi - lo)
    return total


def test_specd_tokens_recount_from_the_timeline_and_the_truth(
    tmp_path: Path, quick: list[str]
) -> None:
    # Two concurrent by day, 32 by night: specd changes at the windows, and the night is on
    # the swept table's plateau (every K's capacity is below 32).
    minutes = 3 * 24 * 60
    levels = [2 if 7 <= (m // 60) % 24 < 19 else 32 for m in range(minutes)]
    trace = tmp_path / "trace.csv"
    trace.write_text("t_s,concurrency\n" + "".join(f"{m * 60},{c}\n" for m, c in enumerate(levels)))
    swept = tmp_path / "swept.csv"
    swept.write_text(PLATEAU_TRUTH)
    proc = specd(
        "--trace", str(trace), "--truth", str(swept), "--calibration", str(swept),
        "--window", "0 7 * * mon-sun;3600;UTC", "--window", "0 19 * * mon-sun;3600;UTC",
        "--steps", "2-4", "--restart-s", "300", "--warmup-s", "3600", "--json", *quick,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    truth = read_table(swept)
    times = [m * 60.0 for m in range(minutes + 1)]
    end, scored_from, restart_s = times[-1], data["scored_from_s"], data["restart_s"]
    assert (scored_from, restart_s) == (3600, 300)
    timeline = data["steps_timeline"]
    assert len(timeline) >= 3, "the trace must make specd change for this test to mean much"
    specd_tokens = lost = 0.0
    for i, (at, k) in enumerate(timeline):
        serving_from = at + (restart_s if i else 0.0)
        until = timeline[i + 1][0] if i + 1 < len(timeline) else end
        rate = lambda c, k=k: truth.throughput(k, c)  # noqa: E731
        specd_tokens += _integrate(times, levels, rate, max(serving_from, scored_from), until)
        if i:
            old = timeline[i - 1][1]
            lost += _integrate(
                times, levels, lambda c, k=old: truth.throughput(k, c), max(at, scored_from),
                at + restart_s,
            )  # fmt: skip
    assert data["specd_tokens"] == pytest.approx(specd_tokens, abs=1)
    assert data["restart_lost_tokens"] == pytest.approx(lost, abs=1)
    assert lost > 0
    # Before the first window (07:00) no one can choose: every comparison runs what specd
    # ran (3, the start value), its own setting from the window's opening on; one that
    # differs restarts into it then and serves nothing for restart_s, as specd.
    first_open = 7 * 3600.0
    start_k = timeline[0][1]
    assert start_k == 3
    before = _integrate(
        times, levels, lambda c: truth.throughput(start_k, c), scored_from, first_open
    )
    for k, tokens in data["static_tokens"].items():
        serving_from = first_open + (0 if int(k) == start_k else restart_s)
        recount = before + _integrate(
            times, levels, lambda c, k=int(k): truth.throughput(k, c), serving_from, end
        )
        assert tokens == pytest.approx(recount, abs=1)
        assert data["ratio_to_static"][k] == pytest.approx(specd_tokens / recount, abs=1e-4)
    # The night's 32 concurrent is a measured point of the truth, on every K's plateau:
    # the tokens are what it says, not an interpolation below capacity (01:00–07:00 at 3,
    # on its plateau too).
    night_s = sum(1 for c in levels if c == 32) * 60 - first_open
    day_s = end - first_open - night_s
    assert data["static_tokens"]["4"] == pytest.approx(
        truth.throughput(3, 32) * (first_open - scored_from)
        + 540 * (day_s - restart_s)
        + 1750 * night_s,
        abs=1,
    )
    # SGLang's adaptive mode, default slots: of its candidates the truth has only 3, so the
    # slots ≥32 and ≥64 are left out, and capacity is 3's.
    adaptive = data["adaptive"]
    assert adaptive["slots"] == {"1": {"candidate_steps": [3]}, "8": {"candidate_steps": [3]}}
    assert adaptive["candidates_skipped"] == [0, 1, 5, 7]
    assert adaptive["capacity"] == 15

    def adaptive_rate(c: int) -> float:
        return truth.throughput(3, min(c, 15))

    # Its restart into the default slots captures one CUDA-graph set more per drafting
    # candidate beyond the first (1,3,5,7: 3 × 20 s), as specd counts an adaptive start.
    adaptive_from = first_open + restart_s + 3 * 20
    recount = before + _integrate(times, levels, adaptive_rate, adaptive_from, end)
    assert data["adaptive_tokens"] == pytest.approx(recount, abs=1)
    assert data["ratio_to_adaptive"] == pytest.approx(specd_tokens / recount, abs=1e-4)
    scored_night_s = sum(1 for c in levels if c == 32) * 60 - scored_from
    assert adaptive["above_capacity_ratio"] == pytest.approx(
        scored_night_s / (end - scored_from), abs=1e-4
    )

    # The same comparison from the first window opening a day into the scored span on (Tue
    # 07:00), when every comparison runs its own setting already: specd's tokens from then,
    # the oracle's epochs from then, each static K and SGLang adaptive from then.
    later = data["after_first_day"]
    settled = 31 * 3600.0
    assert later["from_s"] == settled

    def served(k: int, a: float, b: float) -> float:
        return _integrate(times, levels, lambda c: truth.throughput(k, c), a, b)

    specd_later = sum(
        served(k, max(at + (restart_s if i else 0.0), settled), until)
        for i, ((at, k), until) in enumerate(
            zip(timeline, [t for t, _ in timeline[1:]] + [end], strict=True)
        )
    )
    assert later["specd_tokens"] == pytest.approx(specd_later, abs=1)
    bounds = [settled + 12 * 3600.0 * i for i in range(4)] + [end]
    assert bounds[-2] < end
    oracle_later = sum(
        max(served(k, a, b) for k in (2, 3, 4)) for a, b in itertools.pairwise(bounds)
    )
    assert later["oracle_tokens"] == pytest.approx(oracle_later, abs=1)
    assert later["ratio_to_oracle"] == pytest.approx(specd_later / oracle_later, abs=1e-4)
    statics = {k: served(k, settled, end) for k in (2, 3, 4)}
    best = max(statics, key=lambda k: (statics[k], -k))
    assert later["best_static_steps"] == best
    assert later["ratio_to_best_static"] == pytest.approx(specd_later / statics[best], abs=1e-4)
    adaptive_later = _integrate(times, levels, adaptive_rate, settled, end)
    assert later["ratio_to_adaptive"] == pytest.approx(specd_later / adaptive_later, abs=1e-4)


def test_the_human_output_carries_the_same_figures(tmp_path: Path, quick: list[str]) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text(
        "t_s,concurrency\n" + "".join(f"{m * 60},{2 if m < 720 else 30}\n" for m in range(1440))
    )
    args = (
        "--trace", str(trace), "--truth", str(SEED), "--calibration", str(SWEPT),
        "--window", "0 7 * * mon-sun;3600;UTC", "--steps", "1-5", "--restart-s", "100",
        *quick,
    )  # fmt: skip
    data = json.loads(specd(*args, "--json").stdout)
    proc = specd(*args)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert f"specd {data['specd_tokens']:,} tokens" in text
    assert (
        f"oracle per epoch: {data['oracle_tokens']:,} tokens, specd ×{data['ratio_to_oracle']}"
        in text
    )
    for k, tokens in data["static_tokens"].items():
        assert f"  static {k}" in text
        assert f"{tokens:,} tokens, specd ×{data['ratio_to_static'][k]}" in text
    assert f"{data['adaptive_tokens']:,} tokens, specd ×{data['ratio_to_adaptive']}" in text
    assert "SGLang adaptive ≥1:[1,3,5] ≥8:[0,1,3] ≥32:[0,1] ≥64:[0] (not in the truth: 7)" in text
    assert f"{data['restart_lost_tokens']:,} tokens lost restarting" in text
    binds = data["adaptive"]["where_capacity_binds"]
    free = data["adaptive"]["where_capacity_does_not_bind"]
    assert (
        f"    where its capacity binds (offered above {data['adaptive']['capacity']}, 50% of "
        f"the time): specd ×{binds['ratio_to_adaptive']} ({binds['specd_tokens']:,} against "
        f"{binds['adaptive_tokens']:,} tokens); elsewhere: specd ×{free['ratio_to_adaptive']} "
        f"({free['specd_tokens']:,} against {free['adaptive_tokens']:,} tokens)"
    ) in text
    # The seed's table stops at 5 steps: SGLang's default set (to 7) is not offered.
    default_set = "adaptive:1,3,5,7/1=1,3,5,7;8=0,1,3;32=0,1;64=0"
    assert data["not_offered"] == {default_set: "the truth has no steps 7"}
    assert f"  not offered: {default_set} (the truth has no steps 7)\n" in text
    # A day's trace has no window opening a day in: no such comparison, no line.
    assert data["after_first_day"] is None
    assert len(text.strip().splitlines()) == 2 + len(data["static_tokens"]) + 4


def test_the_human_output_says_how_specd_fares_after_its_first_day(
    tmp_path: Path, quick: list[str]
) -> None:
    trace = tmp_path / "trace.csv"
    hours = 50
    trace.write_text(
        "t_s,concurrency\n"
        + "".join(f"{m * 60},{2 if (m // 60) % 24 < 12 else 30}\n" for m in range(hours * 60))
    )
    args = (
        "--trace", str(trace), "--truth", str(SEED), "--calibration", str(SWEPT),
        "--window", "0 7 * * mon-sun;3600;UTC", "--steps", "1-5", *quick,
    )  # fmt: skip
    data = json.loads(specd(*args, "--json").stdout)
    later = data["after_first_day"]
    # The trace starts Monday 00:00: the first opening a day in is Tuesday's 07:00.
    assert later["from_s"] == 31 * 3600
    assert later["specd_tokens"] < data["specd_tokens"]
    assert later["oracle_tokens"] < data["oracle_tokens"]
    text = specd(*args).stdout
    assert text.strip().splitlines()[-1] == (
        f"  after the first day (from Tue 2026-01-06 07:00 UTC): specd "
        f"×{later['ratio_to_oracle']} oracle, ×{later['ratio_to_best_static']} best static "
        f"({later['best_static_steps']}), ×{later['ratio_to_adaptive']} adaptive"
    )
    # Times are --start's, with its offset named: a bare 12:00 passed for the window's 07:00.
    shifted = specd(*args, "--start", "2026-01-05T00:00:00+05:00").stdout
    assert "(from Tue 2026-01-06 12:00 +05:00)" in shifted, shifted
    assert re.search(r"setting: 3 at the start, \d at \w{3} 2026-01-05 12:00:00 \+05:00", shifted)


def test_a_trace_of_unix_times_is_refused_not_replayed_decades_on(tmp_path: Path) -> None:
    trace = tmp_path / "trace.csv"
    start = 1_767_600_000  # 2026-01-05 08:00 UTC
    trace.write_text("t_s,concurrency\n" + "".join(f"{start + m * 60},2\n" for m in range(600)))
    proc = specd("--trace", str(trace), "--truth", str(SEED))
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "specd replay: the trace's first t_s is 1.7676e+09: t_s counts seconds from --start, "
        "not Unix time; subtract the first t_s from each and pass its time as --start"
    )


# -- choosing among kinds ---------------------------------------------------------------
HEAVYOFF = (TRUTH / "heavyoff.csv", TRUTH / "heavyoff-calibration.csv")


def heavy(rng: random.Random, hour: int) -> tuple[int, int]:
    return 24, 48


def mixed(rng: random.Random, hour: int) -> tuple[int, int]:
    if hour >= 20 or hour < 6:
        return 24, 48  # batch jobs: no speculation serves most
    if 8 <= hour < 18:
        return 1, 4  # a few agents: 2-3 steps
    return 0, 1


# (trace, kinds, calibration, options) → (the trace, its replay); the trace is kept so that
# its id is never another's.
_KINDS_REPLAYS: dict[tuple[Any, ...], tuple[Trace, ReplayResult]] = {}


def kinds_result(
    trace: Trace, kinds: tuple[str, ...], calibration: Path = HEAVYOFF[1], **options: Any
) -> ReplayResult:
    """heavyoff's truth replayed over ``trace`` with the first day a warm-up, offered
    ``kinds``. Several tests read the very same replay (two days of the mixed trace: four
    of them): it runs once, and each gets a copy of its own to read or change."""
    key = (id(trace), kinds, calibration, tuple(sorted(options.items())))
    known = _KINDS_REPLAYS.get(key)
    if known is None:
        config = build_config(
            Config(observe={"scrape_interval_s": 15}),
            window_list=TWICE_A_DAY,
            steps=(1, 6),
            calibration=calibration,
            restart_s=100,
            kinds=kinds,
        )
        result = replay(trace, read_table(HEAVYOFF[0]), config, warmup_s=DAY, **options)
        known = _KINDS_REPLAYS[key] = (trace, result)
    assert known[0] is trace
    return copy.deepcopy(known[1])


def kinds_replay(
    trace: Trace, kinds: tuple[str, ...], calibration: Path = HEAVYOFF[1], **options: Any
) -> dict[str, Any]:
    return kinds_result(trace, kinds, calibration, **options).to_dict()


def recount(data: dict[str, Any], trace: Trace, truth_path: Path) -> float:
    """specd's tokens from the setting timeline and the truth alone (an adaptive start takes
    20 s more per candidate beyond the first; an adaptive setting serves the JSON's
    ``adaptive_loss_ratio`` less than the best candidate of each batch's slot)."""
    kept = 1.0 - data["adaptive_loss_ratio"]
    truth = read_table(truth_path)
    times, levels = trace.t, trace.level
    timeline = data["setting_timeline"]
    total = 0.0
    for i, (at, text) in enumerate(timeline):
        setting = parse(text)
        took = data["restart_s"] + (20 * (len(setting.candidates) - 1) if setting.candidates else 0)
        if setting.kind == "adaptive":
            model = AdaptiveModel.of(adaptive_slots(setting), truth)
            rate: Callable[[int], float] = lambda c, m=model: m.throughput(float(c)) * kept  # noqa: E731
        else:
            rate = lambda c, k=setting.max_steps: truth.throughput(k, float(c))  # noqa: E731
        serving_from = at + (took if i else 0.0)
        until = timeline[i + 1][0] if i + 1 < len(timeline) else times[-1]
        total += _integrate(times, levels, rate, max(serving_from, data["scored_from_s"]), until)
    return total


def test_the_json_says_what_each_restart_took_and_rounds_the_gap_once() -> None:
    """Every restart's length is in the JSON, specd's and each comparison's (an adaptive
    start captures one CUDA-graph set more per candidate beyond the first, 20 s each), so
    anyone can recount the tokens; the oracle's gap over the best static is rounded once,
    from the tokens (a rounded ratio less 1 kept its rounding error)."""
    result = kinds_result(minute_trace(2, mixed), ("off", "static", "adaptive"))
    data = json.loads(json.dumps(result.to_dict()))
    best = result.static_tokens[result.best_static_steps]
    assert result.oracle_tokens > best  # a gap to round
    assert data["oracle_gap_ratio"] == round(result.oracle_tokens / best - 1.0, 4)
    # An oracle that picks the best static K in every epoch serves as much as it; summed
    # epoch by epoch, its total can land ulps under (bench near/day_night): no gap, not -0.0.
    result.oracle_tokens = best * (1 - 1e-15)
    assert math.copysign(1.0, result.to_dict()["oracle_gap_ratio"]) == 1.0
    assert f"{result.to_dict()['oracle_gap_ratio']:.1%}" == "0.0%"

    def took(text: str) -> float:
        setting = parse(text)
        return 100 + (20 * (len(setting.candidates) - 1) if setting.kind == "adaptive" else 0)

    # specd's own changes, one length each, an adaptive one among them.
    changes = [text for _, text in data["setting_timeline"][1:]]
    assert any(text.startswith("adaptive:") for text in changes)
    assert data["change_restart_s"] == [took(text) for text in changes]
    # Each comparison restarts at the first window into its setting unless it runs it then.
    at_scoring = [text for at, text in data["setting_timeline"] if at <= DAY][-1]
    assert data["static_restart_s"] == {
        k: 0 if k == at_scoring else 100 for k in data["static_tokens"]
    }
    assert set(data["adaptive_set_restart_s"]) == set(data["adaptive_set_tokens"])
    for text, seconds in data["adaptive_set_restart_s"].items():
        assert seconds == (0 if text == at_scoring else took(text)), text
    assert data["adaptive_set_restart_s"]["adaptive:1,3"] == 120
    # SGLang's default slots draft at 1, 3, 5 and 7: three sets more than a static start.
    assert data["adaptive"]["restart_s"] == 160


@pytest.mark.parametrize(
    ("kinds", "said"),
    [
        # Static restarts take --restart-s each.
        (("static",), "(100 s each)"),
        # An adaptive start takes 20 s more per drafting candidate beyond the first: the
        # human line said "(100 s each)" of them too.
        (("off", "static", "adaptive"), "(240 s in all, 100 to 140 s each)"),
    ],
)
def test_the_human_line_says_how_long_the_scored_restarts_took(
    kinds: tuple[str, ...], said: str
) -> None:
    data = kinds_replay(minute_trace(2, mixed), kinds)
    # The restarts scored (after the warm-up day), with what the JSON says each took.
    scored = [
        took
        for (at, _), took in zip(
            data["setting_timeline"][1:], data["change_restart_s"], strict=True
        )
        if at >= data["scored_from_s"]
    ]
    assert len(scored) == data["restarts"] == 2
    head = human_lines({"policy": "model", **data}, DEFAULT_START)[0]
    assert head.endswith(f"{data['restart_lost_tokens']:,} tokens lost restarting {said}"), head
    assert said == (
        f"({scored[0]:g} s each)"
        if len(set(scored)) == 1
        else f"({sum(scored):g} s in all, {min(scored):g} to {max(scored):g} s each)"
    )


def test_under_heavy_load_specd_turns_speculation_off_where_the_truth_says_it_pays() -> None:
    trace = minute_trace(3, heavy)
    data = kinds_replay(trace, ("off", "static", "adaptive"))
    assert data["kinds_chosen"]["off"] >= 1
    assert data["setting_timeline"][-1][1] == "off"
    assert [k for _, k in data["steps_timeline"]][-1] == 0
    # Off serves ~13 % more than the best static K on this machine at 24-48 concurrent.
    assert data["ratio_to_best_static"] > 1.08
    assert data["specd_tokens"] == pytest.approx(recount(data, trace, HEAVYOFF[0]), rel=1e-6)
    # The defaults choose static K only, as specd always has.
    static_only = kinds_replay(trace, ("static",))
    assert static_only["kinds_chosen"] == {"off": 0, "static": 1, "adaptive": 0}
    assert static_only["ratio_to_best_static"] == pytest.approx(1.0, abs=0.005)


def test_on_a_mixed_day_specd_beats_sglangs_adaptive_and_the_best_single_set() -> None:
    trace = minute_trace(3, mixed)
    data = kinds_replay(trace, ("off", "static", "adaptive"))
    assert data["kinds_chosen"]["adaptive"] >= 1
    assert data["kinds_chosen"]["off"] >= 1
    assert data["ratio_to_adaptive"] >= 1.0  # SGLang's adaptive mode, its default config
    assert data["best_adaptive_set"] in data["adaptive_set_tokens"]
    assert data["ratio_to_best_adaptive_set"] >= 0.99  # the best set in hindsight
    assert data["restarts_outside_windows"] == 0
    assert data["specd_tokens"] == pytest.approx(recount(data, trace, HEAVYOFF[0]), rel=1e-6)


@pytest.mark.parametrize("loss", [0.02, 0.1])
def test_an_adaptive_loss_costs_every_adaptive_setting_and_no_static_one(loss: float) -> None:
    trace = minute_trace(2, mixed)
    exact = kinds_replay(trace, ("off", "static", "adaptive"))
    lossy = kinds_replay(trace, ("off", "static", "adaptive"), adaptive_loss_ratio=loss)
    assert (exact["adaptive_loss_ratio"], lossy["adaptive_loss_ratio"]) == (0.0, loss)
    assert lossy["static_tokens"] == exact["static_tokens"]
    # SGLang's own adaptive mode and every set run from the first window serve less (before
    # it, they run specd's start K as everyone does)...
    assert lossy["adaptive_tokens"] < exact["adaptive_tokens"]
    assert set(lossy["adaptive_set_tokens"]) == set(exact["adaptive_set_tokens"])
    for text, tokens in exact["adaptive_set_tokens"].items():
        assert tokens * (1 - loss) < lossy["adaptive_set_tokens"][text] < tokens, text
    # ...and so does specd whenever it runs a set: its tokens recount with the loss.
    assert lossy["specd_tokens"] == pytest.approx(recount(lossy, trace, HEAVYOFF[0]), rel=1e-6)
    assert lossy["kinds_chosen"]["adaptive"] >= 1
    said = human_lines({"policy": "model", **lossy}, DEFAULT_START)
    assert f"every adaptive setting served {loss:.1%} less" in "\n".join(said)
    silent = human_lines({"policy": "model", **exact}, DEFAULT_START)
    assert not any("adaptive setting served" in line for line in silent)


def test_a_set_swept_short_of_its_rows_is_not_chosen_on_its_rows_word(tmp_path: Path) -> None:
    # Every adaptive setting serves 10 % less than its best candidate per batch. Told only
    # the static rows, specd runs a set and learns it by serving it; told what a sweep of
    # each set measured on this box (`specd sweep --adaptive`), it never runs one.
    trace = minute_trace(2, mixed)
    truth = read_table(HEAVYOFF[0])
    calibration = read_table(HEAVYOFF[1])
    swept = []
    for text in DEFAULT_ADAPTIVE_SETS:
        setting = parse(text)
        try:
            served = AdaptiveModel.of(adaptive_slots(setting), truth)
        except ValueError:
            continue
        swept += [
            PerfRow(setting.max_steps, float(c), served.throughput(c) * 0.9, None, None, text)
            for c in (1, 2, 4, 8, 16, 32, 64)
        ]
    assert swept
    path = tmp_path / "swept.csv"
    write_table(path, PerfTable([*calibration.rows, *swept], source="swept"))
    told_rows = kinds_replay(trace, ("off", "static", "adaptive"), adaptive_loss_ratio=0.1)
    told_sweep = kinds_replay(trace, ("off", "static", "adaptive"), path, adaptive_loss_ratio=0.1)
    assert told_rows["kinds_chosen"]["adaptive"] >= 1
    assert told_sweep["kinds_chosen"]["adaptive"] == 0
    assert told_sweep["specd_tokens"] > told_rows["specd_tokens"]
    assert told_sweep["specd_tokens"] == pytest.approx(
        recount(told_sweep, trace, HEAVYOFF[0]), rel=1e-6
    )


@pytest.mark.parametrize("loss", [0.0, 0.03, 0.5])
def test_an_adaptive_setting_serves_the_loss_less_second_by_second(loss: float) -> None:
    trace = minute_trace(1, mixed)
    truth = read_table(HEAVYOFF[0])
    exact = Tokens(trace, truth, [1, 3], AdaptiveModel.of(DEFAULT_SLOTS, truth))
    lossy = Tokens(trace, truth, [1, 3], AdaptiveModel.of(DEFAULT_SLOTS, truth), loss)
    sets = [exact.ensure(parse("adaptive:1,3")), lossy.ensure(parse("adaptive:1,3"))]
    assert sets[0] == sets[1]
    for a, b in ((0, 3600), (5 * 3600, 11 * 3600), (0, DAY)):
        for key in (ADAPTIVE, sets[0]):
            assert lossy.between(key, a, b) == pytest.approx(exact.between(key, a, b) * (1 - loss))
        for k in (1, 3):
            assert lossy.between(k, a, b) == exact.between(k, a, b)


@pytest.mark.parametrize("loss", [-0.01, 1.0, math.nan])
def test_an_impossible_adaptive_loss_is_refused(loss: float) -> None:
    trace = minute_trace(0.1, heavy)
    with pytest.raises(ReplayError, match=re.escape("adaptive loss must be 0..1")):
        kinds_replay(trace, ("static",), adaptive_loss_ratio=loss)


def test_a_kind_the_truth_cannot_serve_is_left_out_and_said_why() -> None:
    # k5to2 has steps 1-6: no off, nor SGLang's default set (0 and 7).
    truth = read_table(TRUTH / "k5to2.csv")
    trace = minute_trace(0.1, heavy)
    every = build_config(Config(), steps=(1, 6), kinds=("off", "static", "adaptive"))
    data = replay(trace, truth, every).to_dict()
    default_set = "adaptive:1,3,5,7/1=1,3,5,7;8=0,1,3;32=0,1;64=0"
    assert data["not_offered"] == {
        "off": "the truth has no steps-0 row",
        default_set: "the truth has no steps 0,7",
    }
    assert default_set not in data["adaptive_set_tokens"]  # nor scored beside
    assert "adaptive:1,3" in data["adaptive_set_tokens"]
    static = build_config(Config(), steps=(1, 6), kinds=("static",))
    assert replay(trace, truth, static).to_dict()["not_offered"] == {}
    # Nothing left to choose is an error, naming each reason.
    nothing = build_config(Config(), steps=(1, 6), kinds=("off", "adaptive"))
    only_default = nothing.choose.model_copy(update={"adaptive_candidate_sets": (default_set,)})
    with pytest.raises(ReplayError, match=r"can serve none of kinds \['off', 'adaptive'\]"):
        replay(trace, truth, nothing.model_copy(update={"choose": only_default}))


@pytest.mark.parametrize(
    ("kinds", "code", "output"),
    [
        ("off,static", 0, '"kinds_chosen": {"off": 1, "static": 0, "adaptive": 0}'),
        ("sometimes", 2, "expected kinds from off, static, adaptive"),
        ("off,,static", 2, "expected kinds from off, static, adaptive"),
    ],
)
def test_the_command_takes_the_kinds_specd_may_choose(
    tmp_path: Path, quick: list[str], kinds: str, code: int, output: str
) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text("t_s,concurrency\n" + "".join(f"{m * 60},40\n" for m in range(2 * 1440)))
    table, calibration = HEAVYOFF
    proc = specd(
        "--trace", str(trace), "--truth", str(table), "--calibration", str(calibration),
        "--window", "0 7 * * mon-sun;3600;UTC", "--steps", "1-6", f"--kinds={kinds}", "--json",
        *quick,
    )  # fmt: skip
    assert proc.returncode == code, proc.stderr
    assert output in (proc.stdout if code == 0 else proc.stderr)
    assert "Traceback" not in proc.stderr


def near_replay(calibration: str, levels: tuple[int, int], **choose: Any) -> ReplayResult:
    """Four days at ``levels`` offered, daily windows, on near's truth from 3 steps, the
    model policy reading ``calibration`` (a file in bench/truth); ``choose``: [choose]
    settings."""
    config = build_config(
        Config(observe={"scrape_interval_s": 15}, choose=choose),
        window_list=DAILY,
        steps=(1, 6),
        calibration=TRUTH / calibration,
        restart_s=100,
    )
    trace = minute_trace(4, lambda rng, hour: levels)
    return replay(trace, read_table(TRUTH / "near.csv"), config, initial_steps=3)


def test_a_sweep_that_stopped_short_of_the_load_does_not_hide_the_best_step_count() -> None:
    # near's truth: 4 serves 1.8 % more than the start value 3 at every load. Its sweep
    # stopped at 32 requests while the traffic runs 24–48: read flat past 32, every step
    # count looks ~4 % slower there than it is. Observing 3 shows that; lent to 4 (never
    # observed), 4 comes within the interval, is explored, measured better, and kept.
    result = near_replay("near-calibration.csv", (24, 48))
    assert [k for _, k in result.steps_timeline] == [3, 4], result.steps_timeline
    assert result.change_reasons == ["explore"]
    assert result.to_dict()["ratio_to_best_static"] >= 0.995
    assert result.restarts_outside_windows == 0


def test_a_change_the_calibration_oversold_is_taken_back_and_not_repeated() -> None:
    # near-k5up's sweep says 5 serves 8 % more than it does: at 2–4 requests it looks best,
    # yet serves 3 % less than the start value 3. Only the outcome of the change tells. The
    # forecast of the first epoch trusted (3 hours seen of it), as if those hours had been
    # seen: else its tie with 4 goes to 4 (the next test).
    result = near_replay("near-k5up-calibration.csv", (2, 4), min_forecast_seen_ratio=0)
    ks = [k for _, k in result.steps_timeline]
    assert ks[:2] == [3, 5], result.steps_timeline
    assert ks[2] != 5
    assert result.change_reasons[:2] == ["change", "regression"]
    # The traffic of the window is the epoch's, and 5 serves less there than it was
    # predicted to: it goes back in the window it was made in (an hour), not a day later.
    (changed, _), (back, _) = result.steps_timeline[1:3]
    assert back - changed < 3600, result.steps_timeline
    assert 5 not in ks[3:]  # avoided for a week: the same mistake is not made again
    assert result.restarts_outside_windows == 0


def test_a_blind_first_epoch_goes_to_the_roomier_of_a_tie_not_the_oversold_one() -> None:
    # The same sweep, the default: at the first window 21 of the epoch's 24 hours were never
    # seen, and 5 is not surely better than adaptive:3,4 (whose requests are sized for 4,
    # not 5): the set it is. Once the day was seen, 5 looks best beyond every interval; run,
    # it is taken back and not tried again.
    result = near_replay("near-k5up-calibration.csv", (2, 4))
    settings = [s for _, s in result.setting_timeline]
    assert settings[:3] == ["3", "adaptive:3,4", "5"], result.setting_timeline
    assert result.change_reasons[2] == "regression"
    assert "5" not in settings[3:]


def test_an_adaptive_set_the_calibration_oversold_is_taken_back_and_not_repeated() -> None:
    # As above, but the oversold step count is reachable only inside the adaptive set
    # {5,6}: its config is one setting, verified by what it served since the change.
    trace = minute_trace(4, lambda rng, hour: (2, 4))
    config = build_config(
        Config(
            observe={"scrape_interval_s": 15},
            choose={"adaptive_candidate_sets": ["adaptive:5,6"]},
        ),
        window_list=DAILY,
        steps=(3, 3),
        calibration=TRUTH / "near-k5up-calibration.csv",
        restart_s=100,
        kinds=("static", "adaptive"),
    )
    result = replay(trace, read_table(TRUTH / "near.csv"), config, initial_steps=3)
    # The timeline's steps: None while SGLang runs the adaptive set.
    settings = [s for _, s in result.steps_timeline]
    assert settings[:2] == [3, None], result.steps_timeline
    assert len(settings) >= 3, result.steps_timeline
    assert settings[2] is not None
    assert result.change_reasons[:2] == ["change", "regression"], result.steps_timeline
    assert None not in settings[2:]  # avoided: the same set is not chosen again
    assert result.restarts_outside_windows == 0


def night_then_team(rng: random.Random, hour: int) -> tuple[int, int]:
    if hour < 6:
        return 36, 36  # batch jobs
    if hour < 7:
        return 1, 1  # one early developer
    return (2, 6) if hour < 19 else (36, 36)


def test_the_first_day_after_a_night_runs_what_loses_least_on_hours_never_seen() -> None:
    """seed (twin)/day_night: at the first window (07:00) only the night and an early hour
    were seen; recent traffic (the night) said 3 and the rule for unseen hours held it for
    the whole day, where 4 served 12 % more. What loses least whichever hour seen the day
    is like (4) goes in at that window; the night's (3) at 19:00."""
    table, calibration = TRUTHS["seed"]
    config = build_config(
        QUICK, window_list=TWICE_A_DAY, steps=(1, 6), calibration=calibration, restart_s=100
    )
    result = replay(minute_trace(1, night_then_team), read_table(table), config)
    assert result.setting_timeline[:2] == [(0.0, "3"), (7 * 3600.0, "4")]
    assert result.change_reasons[0] == "change"
