"""The bench's truth tables: committed files equal the generator, and each has its shape."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.truth import generate  # noqa: E402
from specd.core.adaptive import AdaptiveModel  # noqa: E402
from specd.core.model import adaptive_slots  # noqa: E402
from specd.core.setting import format_setting, parse  # noqa: E402
from specd.io.tables import read_table, write_table  # noqa: E402

TRUTH = REPO / "bench" / "truth"
DEFAULT_SGLANG = "adaptive:1,3,5,7/1=1,3,5,7;8=0,1,3;32=0,1;64=0"


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


@pytest.mark.parametrize(
    ("truth", "calibration", "sets"),
    [
        # Swept at steps 0-7: every default set, SGLang's own (0-7) too.
        ("heavyoff", "heavyoff-calibration", ("adaptive:1,3", "adaptive:2,4", DEFAULT_SGLANG)),
        # Swept at steps 1-5: SGLang's own set (0 and 7) cannot be swept or predicted.
        ("k5to2", "k5to2-calibration", ("adaptive:1,3", "adaptive:2,4")),
    ],
)
@pytest.mark.parametrize("loss", [0.0, 0.1])
def test_sets_are_swept_as_the_truth_serves_them_less_the_loss(
    tmp_path: Path, truth: str, calibration: str, sets: tuple[str, ...], loss: float
) -> None:
    served_by = read_table(TRUTH / f"{truth}.csv")
    static = read_table(TRUTH / f"{calibration}.csv")
    asked = (*sets, DEFAULT_SGLANG, sets[0])  # a set asked twice is swept once
    swept = generate.sweep_sets(served_by, static, asked, loss, seed=7)
    # Read back as specd reads a calibration: the static rows untouched, each set a row at
    # every swept concurrency, within a static row's noise of what it serves.
    path = tmp_path / "swept.csv"
    write_table(path, swept)
    back = read_table(path)
    assert back.rows == static.rows
    assert back.measured_settings() == sorted({format_setting(parse(t)) for t in sets})
    concurrency = sorted({r.concurrency for r in static.rows})
    for text in back.measured_settings():
        setting = parse(text)
        serves = AdaptiveModel.of(adaptive_slots(setting), served_by)
        rows = [r for r in back.setting_rows if r.setting == text]
        assert [r.concurrency for r in rows] == concurrency
        for r in rows:
            ratio = r.output_tok_s / (serves.throughput(r.concurrency) * (1 - loss))
            assert abs(ratio - 1) <= 2 * generate.NOISE_RATIO + 1e-3, (text, r)
            assert r.steps == setting.max_steps
    # Seeded: the same sweep twice is the same table.
    assert generate.sweep_sets(served_by, static, asked, loss, seed=7) == swept
