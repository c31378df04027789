"""The twin reads a table by the same rules as specd (tests/core/test_perftable.py), with its
own code: it stands in for the GPU server and shares nothing with the model it tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from factories import READING_RULES, TABLE_SWEEP

from specd.core import perftable
from specd.io import tables
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


def test_twin_and_specd_refuse_a_table_with_a_byte_order_mark_alike(tmp_path: Path) -> None:
    """Excel saves "CSV UTF-8" with a BOM: specd named it, the twin read it into the first
    header cell and said its header lacked "steps". One line, the same, from both."""
    path = tmp_path / "excel.csv"
    path.write_bytes(b"\xef\xbb\xbfsteps,concurrency,output_tok_s\n1,1,100\n")
    with pytest.raises(perftable.PerfTableError) as specd_says:
        tables.read_table(path)
    with pytest.raises(PerfTableError) as twin_says:
        PerfTable.from_csv(path)
    assert (
        str(twin_says.value)
        == str(specd_says.value)
        == (
            f"{path}: starts with a UTF-8 byte order mark (BOM); save the file as UTF-8 without BOM"
        )
    )
