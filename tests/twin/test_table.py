"""The twin reads a table by the same rules as specd (tests/core/test_perftable.py), with its
own code: it stands in for the GPU server and shares nothing with the model it tests."""

from __future__ import annotations

import pytest
from factories import READING_RULES, TABLE_SWEEP

from specd.twin.table import PerfTable


@pytest.mark.parametrize(("rule", "steps", "concurrency", "expected"), READING_RULES)
def test_twin_reads_tables_as_specd_does(
    rule: str, steps: int, concurrency: float, expected: float
) -> None:
    table = PerfTable.from_csv_text(TABLE_SWEEP)
    assert table.throughput(steps, concurrency) == pytest.approx(expected, rel=1e-12), rule
