"""The twin reads a table by the same rules as specd (tests/core/test_perftable.py), with its
own code: it stands in for the GPU server and shares nothing with the model it tests."""

from __future__ import annotations

import pytest
from factories import READING_RULES, TABLE_SWEEP

from specd.twin.table import PerfTable, PerfTableError


@pytest.mark.parametrize(("rule", "steps", "concurrency", "expected"), READING_RULES)
def test_twin_reads_tables_as_specd_does(
    rule: str, steps: int, concurrency: float, expected: float
) -> None:
    table = PerfTable.from_csv_text(TABLE_SWEEP)
    assert table.throughput(steps, concurrency) == pytest.approx(expected, rel=1e-12), rule


def test_twin_skips_a_sweeps_adaptive_rows_and_refuses_a_setting_that_is_not_one() -> None:
    text = (
        "steps,concurrency,output_tok_s,setting\n0,1,100,off\n3,1,230,\n4,1,280,static:4\n"
        '4,1,999,"adaptive:3,4"\n'
    )
    table = PerfTable.from_csv_text(text)
    assert table.steps() == [0, 3, 4]
    assert table.throughput(4, 1) == 280
    for bad in ("5", "off", "fast\nlane"):
        csv_cell = f'"{bad}"' if "\n" in bad else bad
        with pytest.raises(PerfTableError, match="does not match steps 4") as info:
            PerfTable.from_csv_text(f"steps,concurrency,output_tok_s,setting\n4,1,2,{csv_cell}\n")
        assert "\n" not in str(info.value)
