"""The bench's truth tables: committed files equal the generator, and each has its shape."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.truth import generate  # noqa: E402
from specd.io.tables import read_table  # noqa: E402

TRUTH = REPO / "bench" / "truth"


def test_committed_tables_equal_the_generator(tmp_path: Path) -> None:
    written = generate.write_all(tmp_path)
    assert sorted(p.name for p in written) == sorted(p.name for p in TRUTH.glob("*.csv"))
    for path in written:
        assert path.read_text() == (TRUTH / path.name).read_text(), path.name


def _best(name: str, c: float, steps: range = range(1, 7)) -> int:
    table = read_table(TRUTH / f"{name}.csv")
    return max(steps, key=lambda k: table.throughput(k, c))


@pytest.mark.parametrize(("c", "best"), [(1, 6), (2, 6), (4, 6), (48, 1), (64, 1)])
def test_k6to1_runs_from_6_at_one_request_to_1_under_heavy_load(c: int, best: int) -> None:
    assert _best("k6to1", c) == best


@pytest.mark.parametrize("c", [1, 2, 4, 8, 16, 32, 64])
def test_near_best_static_is_only_a_little_better_than_the_start_value(c: int) -> None:
    table = read_table(TRUTH / "near.csv")
    assert _best("near", c) == 4
    assert table.throughput(4, c) / table.throughput(3, c) - 1 == pytest.approx(0.018, abs=1e-3)
    for k in (1, 2, 5, 6):
        assert table.throughput(k, c) <= table.throughput(3, c) * 0.97 + 0.1


def test_lowcap_capacities_lie_below_the_sweeps_larger_concurrencies() -> None:
    truth = read_table(TRUTH / "lowcap.csv")
    sweep = read_table(TRUTH / "lowcap-calibration.csv")
    swept = sorted({r.concurrency for r in sweep.rows})
    for k in sweep.steps():
        cap = truth.capacity(k)
        assert cap is not None
        assert cap < 32
        assert sum(1 for c in swept if c > cap) >= 2


def test_off3_calibration_is_three_percent_off_the_truth() -> None:
    truth = read_table(TRUTH / "k5to2.csv")
    cal = read_table(TRUTH / "k5to2-off3-calibration.csv")
    for row in cal.rows:
        ratio = row.output_tok_s / truth.throughput(row.steps, row.concurrency)
        assert ratio == pytest.approx(1.03 if row.steps % 2 else 0.97, abs=2e-3)
