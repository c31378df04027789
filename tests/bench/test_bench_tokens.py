"""`python -m bench tokens`: a base revision's tokens against this tree's, case by case."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import bench_tokens  # noqa: E402
from bench.child import export_revision  # noqa: E402
from bench.truth import generate  # noqa: E402
from specd.core.model import Calibration  # noqa: E402
from specd.core.setting import parse  # noqa: E402
from specd.io.tables import read_table  # noqa: E402


def _result(tokens: float, oracle: float, best: float, adaptive: float | None) -> dict[str, Any]:
    return {
        "specd_tokens": tokens,
        "ratio_to_oracle": oracle,
        "ratio_to_best_static": best,
        "ratio_to_adaptive": adaptive,
        "steps": "3→4",
    }


STILL = ("near", "steady_low", "model")
MOVED = ("lowcap", "steady_low", "model")


@pytest.mark.parametrize(
    ("base", "new", "expected"),
    [
        # Nothing moved: the counts only.
        (
            {STILL: _result(100.0, 0.999, 1.0, 1.01)},
            {STILL: _result(100.0, 0.999, 1.0, 1.01)},
            [
                "specd's tokens identical in 1 of 1 cases.",
                "| ×oracle ≥ 0.99 | 1 of 1 | 1 of 1 |",
                "| ×best static ≥ 0.995 | 1 of 1 | 1 of 1 |",
                "| ×adaptive ≥ 1 | 1 of 1 | 1 of 1 |",
            ],
        ),
        # One case lost tokens below two figures; a case without adaptive is not counted
        # for that figure.
        (
            {STILL: _result(100.0, 0.999, 1.0, None), MOVED: _result(200.0, 1.0, 1.0, 1.004)},
            {STILL: _result(100.0, 0.999, 1.0, None), MOVED: _result(198.0, 0.99, 0.99, 0.994)},
            [
                "specd's tokens identical in 1 of 2 cases.",
                "| ×oracle ≥ 0.99 | 2 of 2 | 2 of 2 |",
                "| ×best static ≥ 0.995 | 2 of 2 | 1 of 2 |",
                "| ×adaptive ≥ 1 | 1 of 1 | 0 of 1 |",
                "| lowcap | steady_low | model | ×0.9900 | 1.0000 → 0.9900 | 1.0000 → 0.9900 "
                "| 1.0040 → 0.9940 | 3→4 → 3→4 |",
            ],
        ),
    ],
)
def test_the_report_counts_each_figure_and_lists_what_moved(
    base: dict[bench_tokens.Case, dict[str, Any]],
    new: dict[bench_tokens.Case, dict[str, Any]],
    expected: list[str],
) -> None:
    lines = bench_tokens.report(base, new)
    for line in expected:
        assert line in lines
    moved = [line for line in lines if line.startswith("| lowcap")]
    assert len(moved) == sum(1 for c in base if base[c] != new[c])


def test_the_cases_are_the_replay_benchs_model_cases() -> None:
    every = bench_tokens.cases(None, None)
    # Each truth and trace, with the model policy by default and with static K only.
    assert len(every) == 9 * 5 * 2
    assert bench_tokens.cases("heavyoff", "weekly") == [
        ("heavyoff", "weekly", "model"),
        ("heavyoff", "weekly", "model static"),
    ]


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The committed tree, exported once for the module (each test only reads it, or a copy
    of its own)."""
    return export_revision("HEAD", tmp_path_factory.mktemp("export") / "head")


def test_one_tree_against_itself_moves_nothing(head: Path, tmp_path: Path) -> None:
    # The committed tree, exported, replayed as both sides: the whole pipeline (export,
    # workers in fresh processes, results by case), whatever the working tree holds. Two
    # copies of it, so that each side replays every case (compare runs a case once per
    # tree: the same tree twice would be one replay read twice).
    tree = head
    other = tmp_path / "head-again"
    shutil.copytree(tree, other)
    todo = bench_tokens.cases("near", "steady_low")
    base, new = bench_tokens.compare(other, tree, todo, 0.5, 2)
    assert base == new
    assert base[todo[0]]["specd_tokens"] > 0
    assert len(todo) == 2  # near's model and model static
    assert "specd's tokens identical in 2 of 2 cases." in bench_tokens.report(base, new)


def test_a_case_one_tree_does_not_run_is_named_and_left_out(head: Path, tmp_path: Path) -> None:
    # A base whose bench ran model static on heavyoff only.
    tree = head
    old = tmp_path / "old"
    shutil.copytree(tree, old)
    source = old / "bench" / "bench_replay.py"
    text = source.read_text(encoding="utf-8")
    line = "STATIC_TRUTHS = frozenset(t[0] for t in TRUTHS)"
    assert line in text
    source.write_text(text.replace(line, 'STATIC_TRUTHS = frozenset({"heavyoff"})'), "utf-8")
    todo = bench_tokens.cases("near", "steady_low")
    assert todo == [("near", "steady_low", "model"), ("near", "steady_low", "model static")]
    base, new = bench_tokens.compare(old, tree, todo, 0.25, 2)
    assert list(base) == todo[:1]
    assert list(new) == todo
    lines = bench_tokens.report(base, new)
    assert "specd's tokens identical in 1 of 1 cases." in lines
    assert "Only this tree runs: near/steady_low/model static." in lines
    assert not any(line.startswith("Only base") for line in lines)


def test_swept_calibrations_add_the_default_sets_to_each_truths_own(tmp_path: Path) -> None:
    names = {"heavyoff", "seed (twin)", "lowaccept"}
    found = bench_tokens.swept_calibrations(tmp_path, names, 0.03)
    assert set(found) == names
    truths = {name: calibration for name, _, calibration in bench_tokens.TRUTHS}
    for name, path in found.items():
        assert path.parent == tmp_path
        swept, own = read_table(path), read_table(truths[name])
        assert swept.rows == own.rows
        # heavyoff is swept at 0-7: SGLang's own set too; the seed at 1-5: not that one.
        assert len(swept.measured_settings()) == (5 if name == "heavyoff" else 4)
        # Swept with its static rows, on the machine they measured: a set's rows are its
        # candidates' less the loss, within the two rows' noise (lowaccept's calibration is
        # the seed's greedy sweep, whose sets serve as greedily).
        calibration = Calibration.of(swept)
        for text in swept.measured_settings():
            factor = calibration.set_factor(parse(text))
            assert factor is not None
            assert 0.97 * (1 - 4 * generate.NOISE_RATIO) <= factor <= 1.0, (name, text)


def test_swept_sets_reach_the_worker_in_place_of_the_truths_calibration(head: Path) -> None:
    # Every set swept at half of what it serves: told so, specd never runs one; told only
    # the static rows, it does (on heavyoff's mixed day, a set serves most by its rows).
    # The tree against itself: one replay a side, which is all this reads.
    tree = head
    todo = [("heavyoff", "day_night", "model")]
    _, rows = bench_tokens.compare(tree, tree, todo, 2.0, 2, 0.5)
    _, swept = bench_tokens.compare(tree, tree, todo, 2.0, 2, 0.5, swept_sets=True)
    assert "A" in rows[todo[0]]["steps"]
    assert "A" not in swept[todo[0]]["steps"]
