"""The fleet bench: its report's arithmetic, and one real run at a tiny size (structure and
arithmetic of what it writes, not its timings)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.bench_fleet import Report, Span, run  # noqa: E402


def report(rolling: tuple[Span, ...]) -> Report:
    singles = (Span("a", 0, 10), Span("b", 20, 32), Span("c", 40, 48))
    return Report(4.0, 3, singles, rolling, served_rolling=90, served_quiet=120, errors=0,
                  most_out=1)  # fmt: skip


@pytest.mark.parametrize(
    ("rolling", "rolling_s", "overlap"),
    [
        ((Span("a", 100, 110), Span("b", 111, 121), Span("c", 122, 132)), 32.0, False),
        ((Span("c", 122, 132), Span("a", 100, 110), Span("b", 111, 121)), 32.0, False),
        ((Span("a", 100, 110), Span("b", 109, 121), Span("c", 122, 132)), 32.0, True),
        ((Span("a", 100, 110), Span("b", 110, 120), Span("c", 120, 130)), 30.0, False),
    ],
)
def test_report_arithmetic(rolling: tuple[Span, ...], rolling_s: float, overlap: bool) -> None:
    r = report(rolling)
    assert r.singles_sum_s == 30.0
    assert r.rolling_s == rolling_s
    assert r.time_ratio == pytest.approx(rolling_s / 30.0)
    assert r.served_ratio == pytest.approx(0.75)
    assert r.overlap is overlap


def cell(text: str, label: str) -> str:
    match = re.search(rf"^\| {re.escape(label)} \| ([^|]+) \|$", text, re.MULTILINE)
    assert match is not None, (label, text)
    return match.group(1).strip()


@pytest.mark.slow
@pytest.mark.timeout(900)  # ~3 min alone; far longer on a shared 2-core box
def test_a_tiny_run_writes_a_consistent_report(tmp_path: Path) -> None:
    out = tmp_path / "fleet.md"
    assert (
        run(["--load-time-s", "1", "--clients", "2", "--max-tokens", "20", "--out", str(out)]) == 0
    )
    text = out.read_text()
    assert text.startswith("# A rolling change across three servers behind one gateway\n")
    assert "Reproduce: `.venv/bin/python -m bench fleet --load-time-s 1 --clients 2" in text
    assert "--out" not in text
    assert cell(text, "failed requests (must be 0)") == "0"
    assert cell(text, "most servers out at once (must be 1)") == "1"
    singles = [float(cell(text, f"single {n}")) for n in "abc"]
    assert all(s > 0 for s in singles)
    total = float(cell(text, "sum of singles"))
    assert total == pytest.approx(sum(singles), abs=0.15)
    rolling = float(cell(text, "rolling change, all three"))
    # One at a time: at least the longest single restart's share, and the ratio is rolling/sum.
    assert rolling >= max(singles) - 0.1
    ratio = float(cell(text, "rolling change / sum of the 3 single restarts (wall time)")[1:])
    assert ratio == pytest.approx(rolling / total, abs=0.02)
    served = re.search(r"Requests: (\d+) complete during the rolling change, (\d+) in", text)
    assert served is not None
    during, quiet = int(served.group(1)), int(served.group(2))
    assert during > 0
    assert quiet > 0
    ratio = float(
        cell(text, "complete requests during the rolling change / same length with no change")[1:]
    )
    assert ratio == pytest.approx(during / quiet, abs=0.01)
