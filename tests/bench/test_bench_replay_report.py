"""The replay bench's report: the machine's speed (each row's decision p99 scaled to the
run's fastest probe, and the cases above the figure even then), and specd's margin over
SGLang adaptive where its capacity binds and where it does not."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import bench_replay  # noqa: E402
from specd.core.setting import format_setting  # noqa: E402
from specd.io.calibration import configured_offer  # noqa: E402
from specd.tools.replay import REPLAY_TRAITS  # noqa: E402


def _row(trace: str, p99_ms: float, probe_ms: float) -> bench_replay.Row:
    result = {"decision_cpu_ms_p99": p99_ms, "decision_ms_p99": p99_ms}
    return bench_replay.Row("seed (twin)", trace, "model", result, 1.0, probe_ms)


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        # The slow row's p99 is 1.5 ms at the fast row's speed: both within the figure.
        (
            [("a", 1.5, 5.0), ("b", 3.0, 10.0)],
            "5.000–10.000 ms, the slowest row ×2.00 the fastest. Decision p99 scaled to the "
            "run's fastest probe (p99 × fastest probe / the row's probe): ≤ 2 ms in 2 of 2 "
            "cases. The figure above is the unscaled one.",
        ),
        # Above the figure at any speed: named with its scaled p99.
        (
            [("a", 2.5, 5.0), ("b", 2.3, 6.0)],
            "5.000–6.000 ms, the slowest row ×1.20 the fastest. Decision p99 scaled to the "
            "run's fastest probe (p99 × fastest probe / the row's probe): ≤ 2 ms in 1 of 2 "
            "cases; above: seed (twin)/a 2.50. The figure above is the unscaled one.",
        ),
    ],
)
def test_each_p99_is_scaled_to_the_fastest_probe(
    rows: list[tuple[str, float, float]], expected: str
) -> None:
    made = [_row(trace, p99, probe) for trace, p99, probe in rows]
    lines = bench_replay._speed_lines(made, made)
    assert lines[0] == ""
    assert lines[1].endswith(expected)


def test_rows_without_a_probe_say_nothing_of_speed() -> None:
    made = [_row("a", 1.0, 0.0)]
    assert bench_replay._speed_lines(made, made) == []
    assert bench_replay._at_fastest(made[0], 5.0) == 1.0


def test_the_probe_is_a_decisions_cpu_time_in_milliseconds(tmp_path: Path) -> None:
    probe = bench_replay.speed_probe_ms(bench_replay.write_probe_trace(tmp_path))
    # A decision takes about a millisecond of CPU here (0.8 at the VM's fast moments);
    # 0, or a second, would mean the probe timed something else.
    assert 0.05 < probe < 50.0


def _versus(ratios: tuple[float | None, float | None] | None) -> dict[str, object]:
    """A row whose replay scored SGLang adaptive with these ×adaptive ratios where its
    capacity binds and where it does not (None: no such seconds; None for both: no
    capacity)."""
    parts: dict[str, object] = {"where_capacity_binds": None, "where_capacity_does_not_bind": None}
    if ratios is not None:
        for key, ratio in zip(parts, ratios, strict=True):
            parts[key] = {"specd_tokens": 1, "adaptive_tokens": 1, "ratio_to_adaptive": ratio}
    return {"adaptive": parts}


def test_the_margin_where_adaptive_capacity_binds_is_stated_over_the_cases_that_have_it() -> None:
    cases = {
        "a": (1.2, 1.01),
        "b": (0.97, 1.03),
        "c": (None, 1.05),  # never above the capacity: left out of that part
        "d": (1.1, 0.99),
        "e": None,  # no capacity at all: left out of both
    }
    made = [bench_replay.Row("k6to1", t, "model", _versus(v), 1.0) for t, v in cases.items()]
    lines = bench_replay._capacity_lines(made)
    assert lines[-2:] == [
        "| where its capacity binds | 3 | 1.1000 | 0.9700 (k6to1/b) | 1.2000 (k6to1/a) "
        "| k6to1/b 0.9700 |",
        "| where it does not | 4 | 1.0200 | 0.9900 (k6to1/d) | 1.0500 (k6to1/c) | k6to1/d 0.9900 |",
    ]
    # The same case under the static-only policy is told apart from the default's.
    static = bench_replay.Row("k6to1", "b", bench_replay.STATIC_POLICY, _versus((0.96, 1.0)), 1.0)
    both = bench_replay._capacity_lines([made[1], static])
    assert "| k6to1/b (model static) 0.9600; k6to1/b 0.9700 |" in both[-2]
    assert bench_replay._capacity_cell(made[2].result["adaptive"]) == "–/1.0500"
    assert bench_replay._capacity_cell(None) == "–/–"
    assert bench_replay._capacity_lines(made[4:]) == []


def _bet_row(
    trace: str, oracle: float, best: float, bet: dict[str, float] | None
) -> bench_replay.Row:
    result = {"ratio_to_oracle": oracle, "ratio_to_best_static": best}
    return bench_replay.Row("lowcap", trace, "model", result, 1.0, 0.0, bet)


@pytest.mark.parametrize(
    ("oracle", "best", "bound_oracle", "bound_best", "out_of_reach"),
    [
        # Both bounds below the figures: the first epoch decided both.
        (0.9574, 0.9632, 0.9674, 0.9733, "×oracle, ×best static"),
        # Only the oracle's bound below 0.99.
        (0.9793, 0.9899, 0.9876, 0.9983, "×oracle"),
        # Both within reach after the first epoch: the shortfall came later.
        (0.9909, 0.9938, 0.9942, 0.9971, "–"),
    ],
)
def test_each_shortfall_names_what_the_first_epoch_put_out_of_reach(
    oracle: float, best: float, bound_oracle: float, bound_best: float, out_of_reach: str
) -> None:
    bet = {"setting": "6", "to_oracle": bound_oracle, "to_best_static": bound_best}
    lines = bench_replay._first_epoch_lines([_bet_row("weekly", oracle, best, bet)])
    assert lines[-1] == (
        f"| lowcap/weekly | 6 | {oracle:.4f} / {best:.4f} | {bound_oracle:.4f} / "
        f"{bound_best:.4f} | {out_of_reach} |"
    )


def test_cases_meeting_the_figures_or_without_a_bound_are_left_out() -> None:
    bet = {"setting": "4", "to_oracle": 1.0, "to_best_static": 1.0}
    meets = _bet_row("steady_low", 0.9999, 1.0, bet)
    unbounded = _bet_row("weekly", 0.95, 0.95, None)  # an adaptive set or a change inside
    assert bench_replay._first_epoch_lines([meets, unbounded]) == []


@pytest.mark.parametrize(
    ("policy", "setting", "named"),
    [
        ("model", "adaptive:2,4", "lowcap/weekly"),
        (bench_replay.STATIC_POLICY, "4", "lowcap/weekly (model static)"),
    ],
)
def test_the_bet_setting_and_the_policy_are_named(policy: str, setting: str, named: str) -> None:
    bet = {"setting": setting, "to_oracle": 0.9874, "to_best_static": 1.0002}
    result = {"ratio_to_oracle": 0.98, "ratio_to_best_static": 0.99}
    row = bench_replay.Row("lowcap", "weekly", policy, result, 1.0, 0.0, bet)
    assert bench_replay._first_epoch_lines([row])[-1] == (
        f"| {named} | {setting} | 0.9800 / 0.9900 | 0.9874 / 1.0002 | ×oracle |"
    )


SGLANGS_OWN = "adaptive:1,3,5,7/1=1,3,5,7;8=0,1,3;32=0,1;64=0"
OTHER_SETS = ("adaptive:1,3", "adaptive:2,4", "adaptive:3,4", "adaptive:1,2,3")


@pytest.mark.parametrize(
    ("truth", "kinds", "sets"),
    [
        # Swept at steps 0-7: off and every default set.
        ("heavyoff", ("off", "static", "adaptive"), (SGLANGS_OWN, *OTHER_SETS)),
        # Swept at 1-6: no steps-0 row for off or for SGLang's own set's 0 tier, no 7.
        ("near", ("static", "adaptive"), OTHER_SETS),
        ("seed (twin)", ("static", "adaptive"), OTHER_SETS),
    ],
)
def test_the_model_chooses_among_what_the_calibration_can_predict(
    truth: str, kinds: tuple[str, ...], sets: tuple[str, ...]
) -> None:
    _, _, calibration = next(t for t in bench_replay.TRUTHS if t[0] == truth)
    config = bench_replay.case_config(calibration, "weekly", "model")
    assert (config.choose.policy, config.choose.kinds) == ("model", ("off", "static", "adaptive"))
    assert config.choose.calibration_file == calibration
    got, _ = configured_offer(config.choose, REPLAY_TRAITS, None)
    assert got is not None  # the bench's calibration reads
    assert tuple(k for k in ("off", "static", "adaptive") if got.allows(k)) == kinds
    assert tuple(format_setting(s) for s in got.settings if s.kind == "adaptive") == sets
    static = bench_replay.case_config(calibration, "weekly", bench_replay.STATIC_POLICY)
    assert (static.choose.policy, static.choose.kinds) == ("model", ("static",))


@pytest.mark.parametrize(
    ("out", "only", "truth", "days", "no_bands", "expected"),
    [
        (None, None, None, 7.0, False, bench_replay.RESULTS),  # the whole bench
        (None, None, "near", 7.0, False, None),
        (None, "weekly", None, 7.0, False, None),
        (None, None, None, 1.0, False, None),
        (None, None, None, 7.0, True, None),
        (Path("/tmp/kinds.md"), None, "heavyoff", 7.0, False, Path("/tmp/kinds.md")),
    ],
)
def test_only_a_whole_run_overwrites_the_committed_report(
    out: Path | None,
    only: str | None,
    truth: str | None,
    days: float,
    no_bands: bool,
    expected: Path | None,
) -> None:
    assert bench_replay.report_path(out, only, truth, days, no_bands) == expected


def test_a_partial_run_leaves_the_report_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A stand-in for the committed report: a failure here must not overwrite the real one.
    report = tmp_path / "replay.md"
    report.write_text("the committed report\n", encoding="utf-8")
    monkeypatch.setattr(bench_replay, "RESULTS", report)
    # Two rows (no bands): each row also times the decision on the probe's half day twice.
    argv = ["--days", "0.2", "--only", "steady_low", "--truth", "near", "--no-bands"]
    code = bench_replay.run(argv)
    assert code in (0, 1)
    assert report.read_text(encoding="utf-8") == "the committed report\n"
    assert "left as it is: a partial run writes its report only with --out" in (
        capsys.readouterr().out
    )
