"""The twin reads a table by the same rules as specd (tests/core/test_perftable.py), with its
own code: it stands in for the GPU server and shares nothing with the model it tests."""

from __future__ import annotations

import pytest

from specd.twin.table import PerfTable

SWEEP = (
    "steps,concurrency,output_tok_s,max_running_requests\n"
    "4,1,277,13\n4,2,520,\n4,4,900,\n4,8,1400,\n4,16,1610,\n4,32,1630,\n4,64,1620,\n"
    "2,1,186,\n2,2,350,\n2,4,640,\n"
    "3,1,234,40\n3,2,450,\n3,4,800,\n3,8,1200,\n"
)


@pytest.mark.parametrize(
    ("rule", "steps", "concurrency", "expected"),
    [
        ("measured point exact", 4, 8, 1400.0),
        ("measured point exact", 4, 32, 1630.0),
        ("measured point exact", 4, 64, 1620.0),
        ("plateau at capacity", 4, 13, 1610.0),
        ("plateau past capacity", 4, 24, 1620.0),
        ("plateau past capacity", 3, 100, 1200.0),
        ("linear between", 4, 10, 1484.0),
        ("from the origin", 4, 0.5, 138.5),
        ("flat past the last", 2, 9, 640.0),
    ],
)
def test_twin_reads_tables_as_specd_does(
    rule: str, steps: int, concurrency: float, expected: float
) -> None:
    table = PerfTable.from_csv_text(SWEEP)
    assert table.throughput(steps, concurrency) == pytest.approx(expected, rel=1e-12), rule
