"""`python -m bench decision --instructions`: reading callgrind's count, per tick."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import bench_decision  # noqa: E402

# The head of a callgrind output file as valgrind 3.19 writes it, then a cost line.
CALLGRIND_HEAD = """# callgrind format
version: 1
creator: callgrind-3.19.0
pid: 12373
cmd:  python tg.py
part: 1

desc: I1 cache:
desc: Timerange: Basic block 0 - 27460851
desc: Trigger: Program termination

positions: line
events: Ir
summary: {summary}


totals: {summary}
fl=(1) ???
fn=(1) 0x0000000000001100
0 7
"""


@pytest.mark.parametrize("summary", [71128499, 1, 0])
def test_callgrind_total_is_the_summary_line(tmp_path: Path, summary: int) -> None:
    out = tmp_path / "run.cg"
    out.write_text(CALLGRIND_HEAD.format(summary=summary), encoding="utf-8")
    assert bench_decision.callgrind_total(out) == summary


@pytest.mark.parametrize(
    "text", ["", "events: Ir\ntotals: 5\n", "not callgrind at all\n", "\x00\xff garbage"]
)
def test_a_file_without_a_summary_is_an_error_naming_it(tmp_path: Path, text: str) -> None:
    out = tmp_path / "odd.cg"
    out.write_bytes(text.encode("latin-1"))
    with pytest.raises(RuntimeError, match=r"odd\.cg: no summary line"):
        bench_decision.callgrind_total(out)


@pytest.mark.parametrize(
    ("old", "new", "cell"),
    [
        # Per tick: the counts over each tree's own number of ticks.
        (
            {"instructions": 3_124_000_000, "cpu": [1.0] * 1000},
            {"instructions": 2_807_000_000, "cpu": [1.0] * 1000},
            "3124 k → 2807 k, ×0.899",
        ),
        (
            {"instructions": 1_000_000, "cpu": [1.0] * 4},
            {"instructions": 1_000_000, "cpu": [1.0] * 5},
            "250 k → 200 k, ×0.800",
        ),
        # Not counted (no --instructions), or no ticks to count over.
        ({"cpu": [1.0]}, {"cpu": [1.0]}, "–"),
        ({"instructions": 5, "cpu": []}, {"instructions": 5, "cpu": []}, "–"),
    ],
)
def test_instructions_cell(old: dict[str, Any], new: dict[str, Any], cell: str) -> None:
    assert bench_decision._instructions(old, new) == cell
