from __future__ import annotations

from pathlib import Path

import pytest
from factories import READING_RULES, TABLE_SWEEP

from specd.core.perftable import PerfTable, PerfTableError, reading_points
from specd.twin import preset

DATA = Path(__file__).resolve().parents[2] / "specd" / "data"
GOOD = (
    "steps,concurrency,output_tok_s,accept_length,max_running_requests\n"
    "1,1,100,1.9,4\n1,2,180,,\n1,4,300,,\n3,1,200,3.5,\n"
)


@pytest.mark.parametrize(
    ("steps", "concurrency", "expected"),
    [
        (1, 1, 100.0),
        (1, 1.5, 140.0),  # linear between measured points
        (1, 0.5, 50.0),  # from the origin below the first point
        (1, 3, 240.0),
        (1, 4, 300.0),
        (1, 16, 300.0),  # clamped to max_running_requests = 4: the rest queue
        (3, 10, 200.0),  # flat past the last point when capacity is unknown
    ],
)
def test_throughput_interpolates_and_saturates(
    steps: int, concurrency: float, expected: float
) -> None:
    table = PerfTable.from_csv_text(GOOD)
    assert table.throughput(steps, concurrency) == pytest.approx(expected)


@pytest.mark.parametrize(("rule", "steps", "concurrency", "expected"), READING_RULES)
def test_reading_rules(rule: str, steps: int, concurrency: float, expected: float) -> None:
    table = PerfTable.from_csv_text(TABLE_SWEEP)
    assert table.throughput(steps, concurrency) == pytest.approx(expected, rel=1e-12), rule


def test_measured_points_come_back_bit_for_bit() -> None:
    table = PerfTable.from_csv_text(TABLE_SWEEP)
    for row in table.rows:
        assert table.throughput(row.steps, row.concurrency) == row.output_tok_s


@pytest.mark.parametrize(
    ("xs", "ys", "capacity", "points"),
    [
        ((1.0, 2.0), (10.0, 20.0), None, ((1.0, 2.0), (10.0, 20.0))),
        # the plateau starts at capacity with the first point at or past it
        ((1.0, 8.0, 16.0), (10.0, 80.0, 90.0), 13, ((1.0, 8.0, 13.0, 16.0), (10, 80, 90, 90))),
        ((1.0, 13.0, 16.0), (10.0, 80.0, 90.0), 13, ((1.0, 13.0, 16.0), (10, 80, 90))),
        # measured short of capacity: read up to capacity, flat from there
        ((1.0, 2.0), (10.0, 20.0), 4, ((1.0, 2.0, 4.0), (10, 20, 20))),
        # capacity below every point: all of them are the plateau
        ((2.0, 4.0), (30.0, 31.0), 1, ((1.0, 2.0, 4.0), (30, 30, 31))),
    ],
)
def test_reading_points(
    xs: tuple[float, ...],
    ys: tuple[float, ...],
    capacity: int | None,
    points: tuple[tuple[float, ...], tuple[float, ...]],
) -> None:
    got = reading_points(xs, ys, capacity)
    assert got == (points[0], tuple(float(y) for y in points[1]))


def test_queries_and_roundtrip() -> None:
    table = PerfTable.from_csv_text(GOOD)
    assert table.steps() == [1, 3]
    assert table.capacity(1) == 4
    assert table.capacity(3) is None
    assert table.accept_length(3) == 3.5
    assert PerfTable.from_csv_text(table.to_csv_text()) == table
    with pytest.raises(KeyError, match="no data for steps 2"):
        table.throughput(2, 1)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty file"),
        ("steps,conc,output_tok_s\n1,1,2\n", r":1: header must be"),
        ("steps,concurrency,output_tok_s\n1,1\n", r":2: expected 3 cells"),
        ("steps,concurrency,output_tok_s\n1,1,abc\n", r":2: output_tok_s is not a number"),
        ("steps,concurrency,output_tok_s\n1.5,1,2\n", r":2: steps must be a whole number"),
        ("steps,concurrency,output_tok_s\n1,0,2\n", r":2: concurrency must be > 0"),
        ("steps,concurrency,output_tok_s\n1,1,-2\n", r":2: output_tok_s must be a finite"),
        ("steps,concurrency,output_tok_s\n1,1,nan\n", r":2: output_tok_s must be a finite"),
        ("steps,concurrency,output_tok_s\n1,1,2\n1,1,3\n", "duplicate row"),
        ("steps,concurrency,output_tok_s,accept_length\n1,1,2,0.5\n", r":2: accept_length"),
        ("steps,concurrency,output_tok_s\n", "no data rows"),
        ("steps,concurrency,output_tok_s,setting\n4,1,2,adaptive:3,4\n", r":2: expected 4"),
        ("steps,concurrency,output_tok_s,setting\n4,1,2,fast\n", r":2: setting 'fast' is not"),
        ('steps,concurrency,output_tok_s,setting\n4,1,2,"a\nb"\n', r":2: setting 'a\\nb'"),
        ("steps,concurrency,output_tok_s,setting\n4,1,2,3\n", r"runs at most 3 steps, the row"),
        ("steps,concurrency,output_tok_s,setting\n4,1,2,off\n", r"runs at most 0 steps"),
        ('steps,concurrency,output_tok_s,setting\n5,1,2,"adaptive:3,4"\n', r"at most 4 steps"),
        ('steps,concurrency,output_tok_s,setting\n4,1,2,"adaptive:4,4"\n', r"repeat a step"),
        ('steps,concurrency,output_tok_s,setting\n4,1,2,"adaptive:0,4"\n', r"candidates must"),
        ("steps,concurrency,output_tok_s,setting\n4,1,2," + "9" * 600 + "\n", r"longer than"),
        ('steps,concurrency,output_tok_s,setting\n4,1,2,"adaptive:3,4"\n', "only adaptive"),
        # The csv module's own limits (a field over 128 KiB): the table's error, not csv's
        # traceback, which took a running daemon down when its calibration file held one.
        (
            "steps,concurrency,output_tok_s\n1,1,100\n" + "1" * 200_000 + ",1,100\n",
            r":3: not a CSV",
        ),
        # What no server measures: the table is refused, not read as a curve.
        (
            "steps,concurrency,output_tok_s,accept_length\n1,1,100,50\n",
            r"x.csv:2: accept_length 50 is more than steps \+ 1 = 2",
        ),
        (
            "steps,concurrency,output_tok_s,accept_length\n0,1,100,1.5\n",
            r"x.csv:2: accept_length 1.5 is more than steps \+ 1 = 1",
        ),
        (
            "steps,concurrency,output_tok_s,accept_length\n3,1,100,4.2\n",
            r"x.csv:2: accept_length 4.2 is more than steps \+ 1 = 4",
        ),
        ("steps,concurrency,output_tok_s\n1,1,1e308\n", r"x.csv:2: output_tok_s 1e308 is more"),
        ("steps,concurrency,output_tok_s\n1,1e300,100\n", r"x.csv:2: concurrency 1e300 is more"),
        (
            "steps,concurrency,output_tok_s,max_running_requests\n1,1,100,1e9\n",
            r"x.csv:2: max_running_requests 1e9 is more",
        ),
        ("steps,concurrency,output_tok_s\n1000,1,100\n", r"x.csv:2: steps 1000 is more than 64"),
        ("\ufeffsteps,concurrency,output_tok_s\n1,1,2\n", r"x.csv: starts with a UTF-8 byte order"),
        (
            "steps,concurrency,output_tok_s,setting\n3,1,2,\n"
            '4,1,2,"adaptive:3,4"\n4,1,3,"adaptive:4,3"\n',
            r"duplicate row for adaptive:3,4 at concurrency 1",
        ),
    ],
)
def test_bad_tables_give_one_line_errors(text: str, message: str) -> None:
    with pytest.raises(PerfTableError, match=message) as info:
        PerfTable.from_csv_text(text, source="x.csv")
    assert "\n" not in str(info.value)


def test_shipped_preset_csv_equals_generator() -> None:
    shipped = (DATA / "seed-qwen35-122b.csv").read_text(encoding="utf-8")
    assert shipped == preset.preset_table().to_csv_text()


@pytest.mark.parametrize(("steps", "measured"), [(1, 123), (2, 186), (3, 234), (4, 277)])
def test_preset_matches_seed_single_request(steps: int, measured: float) -> None:
    assert preset.preset_table().throughput(steps, 1) == pytest.approx(measured, rel=0.03)


@pytest.mark.parametrize(
    ("concurrency", "best"),
    [(1, 4), (2, 4), (3, 4), (4, 4), (16, 3), (24, 3), (32, 3), (64, 3)],
)
def test_preset_best_steps_by_concurrency(concurrency: int, best: int) -> None:
    table = preset.preset_table()
    rates = {k: table.throughput(k, concurrency) for k in table.steps()}
    assert max(rates, key=rates.__getitem__) == best


@pytest.mark.parametrize(("steps", "cap"), [(0, 39), (1, 26), (2, 19), (3, 15), (4, 13), (6, 9)])
def test_preset_capacity(steps: int, cap: int) -> None:
    assert preset.preset_table().capacity(steps) == cap


@pytest.mark.parametrize(("steps", "length"), [(0, 1.0), (1, 1.954), (4, 4.5607)])
def test_preset_accept_length_follows_alpha(steps: int, length: float) -> None:
    assert preset.preset_table().accept_length(steps) == pytest.approx(length, abs=1e-3)


SETTINGS = (
    "steps,concurrency,output_tok_s,max_running_requests,setting\n"
    "0,1,100,39,off\n0,8,700,39,\n3,1,230,15,3\n3,8,1660,15,\n4,1,280,13,\n4,8,1900,13,\n"
    '4,1,270,13,"adaptive:3,4"\n4,16,2100,13," adaptive:4,3 "\n'
)


def test_setting_column_keeps_adaptive_rows_apart_from_the_curves() -> None:
    table = PerfTable.from_csv_text(SETTINGS)
    # Off (steps 0) and static rows are the curves; the adaptive rows are not a steps-4 curve.
    assert table.steps() == [0, 3, 4]
    assert table.throughput(4, 1) == 280
    assert table.throughput(0, 8) == 700
    assert all(r.setting is None for r in table.rows)
    assert table.measured_settings() == ["adaptive:3,4"]  # canonical text
    assert table.setting_throughput("adaptive:3,4", 1) == 270
    assert table.setting_throughput("adaptive:3,4", 16) == 2100
    # Past capacity the measured plateau, as a step count's curve reads.
    assert table.setting_throughput("adaptive:3,4", 13) == 2100
    assert table.setting_capacity("adaptive:3,4") == 13
    with pytest.raises(KeyError, match="no rows for setting adaptive:1,3"):
        table.setting_throughput("adaptive:1,3", 1)
    text = table.to_csv_text()
    assert text.splitlines()[0].endswith(",setting")
    assert '4,1,270,13,"adaptive:3,4"' in text
    assert PerfTable.from_csv_text(text) == table


def test_old_tables_without_the_setting_column_read_and_write_as_before() -> None:
    old = PerfTable.from_csv_text(GOOD)
    assert old.measured_settings() == []
    assert old.to_csv_text() == GOOD  # no setting column is added
    # Empty or agreeing setting cells are the same static rows as no column at all.
    with_column = (
        "steps,concurrency,output_tok_s,accept_length,max_running_requests,setting\n"
        "1,1,100,1.9,4,1\n1,2,180,,,static:1\n1,4,300,,,\n3,1,200,3.5,,3\n"
    )
    assert PerfTable.from_csv_text(with_column) == old
