"""The cold-start bench: its bound counted by hand on a tiny case, its denominators equal to
the replay's, and specd's own tokens never above the bound of the setting it ran."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import bench_coldstart, bench_replay, firstepoch  # noqa: E402
from bench.traces import generate as traces  # noqa: E402
from specd.core.perftable import PerfTable  # noqa: E402
from specd.core.setting import format_setting, off, parse  # noqa: E402
from specd.core.settings import DEFAULT_ADAPTIVE_SETS  # noqa: E402
from specd.io.tables import read_table  # noqa: E402
from specd.tools.replay import Trace  # noqa: E402

# Two step counts and off, each measured at exactly the two levels the trace offers.
TINY = PerfTable.from_csv_text(
    "steps,concurrency,output_tok_s,accept_length,max_running_requests\n"
    "0,1,80,1.0,64\n0,10,450,1.0,64\n"
    "1,1,100,1.5,64\n1,10,500,1.5,64\n"
    "2,1,150,2.0,64\n2,10,400,2.0,64\n"
)
# 1 offered for 10 s, 10 for 20 s, 1 for 10 s; windows open at 5 s and 20 s for 2 s each.
TINY_TRACE = Trace([0.0, 10.0, 30.0, 40.0], [1, 10, 1])
TINY_OPENS = [(5.0, 7.0), (20.0, 22.0)]


def _tiny() -> firstepoch.Bounds:
    return firstepoch.upper_bound(
        TINY_TRACE, TINY, TINY_OPENS, [1, 2], start_steps=1, restart_s=2.0
    )


def test_the_denominators_are_counted_as_the_replay_counts_them() -> None:
    bounds = _tiny()
    # Before the first window everyone runs the start K 1: 5 s × 100 = 500.
    # Static 1 from there: 5 × 100 + 20 × 500 + 10 × 100 = 11500; static 2 restarts at 5 s
    # and serves from 7 s: 3 × 150 + 20 × 400 + 10 × 150 = 9950.
    assert bounds.static_tokens == pytest.approx({1: 500 + 11500, 2: 500 + 9950})
    assert bounds.best_static_tokens == pytest.approx(500 + 11500)
    # Epochs 5-20 and 20-40: the best fixed K of each (1: 5500 and 6000).
    assert bounds.oracle_tokens == pytest.approx(500 + 5500 + 6000)
    assert (bounds.seen_min, bounds.seen_max, bounds.seen_mean) == (1, 1, 1.0)


@pytest.mark.parametrize(
    ("s1", "tokens"),
    [
        # start 500; windows at the best K each second: 5-7 at 150 (2) = 300, 20-22 at 500
        # (1) = 1000; S1 from 7 to 20; the rest of epoch 2 (22-40) at its best fixed K, 1:
        # 8 × 500 + 10 × 100 = 5000.
        ("1", 500 + 300 + 1000 + (3 * 100 + 10 * 500) + 5000),
        ("2", 500 + 300 + 1000 + (3 * 150 + 10 * 400) + 5000),
    ],
)
def test_the_bound_of_each_first_epoch_step_count(s1: str, tokens: float) -> None:
    bounds = _tiny()
    assert list(bounds.upper) == ["1", "2"]  # a static-only policy: off is not offered
    assert bounds.upper[s1] == pytest.approx(tokens)
    assert bounds.to_best_static(s1) == pytest.approx(tokens / 12000)
    assert bounds.to_oracle(s1) == pytest.approx(tokens / 12000)


# adaptive:1,2 runs the better of 1 and 2 at each batch (150 at 1, 500 at 10), both sized
# for 64 requests; off serves 80 at 1 and 450 at 10.
BOTH = parse("adaptive:1,2")


@pytest.mark.parametrize(
    ("s1", "tokens"),
    [
        # start 500; windows 300 + 1000 as before (the set matches the best K there); S1
        # from 7 to 20 (3 s at 1, 10 s at 10); the rest of epoch 2 at its best fixed
        # setting, now the set: 8 × 500 + 10 × 150 = 5500.
        ("1", 500 + 300 + 1000 + (3 * 100 + 10 * 500) + 5500),
        ("2", 500 + 300 + 1000 + (3 * 150 + 10 * 400) + 5500),
        ("off", 500 + 300 + 1000 + (3 * 80 + 10 * 450) + 5500),
        ("adaptive:1,2", 500 + 300 + 1000 + (3 * 150 + 10 * 500) + 5500),
    ],
)
def test_a_policy_offered_off_and_a_set_is_bounded_over_them_too(s1: str, tokens: float) -> None:
    bounds = firstepoch.upper_bound(
        TINY_TRACE, TINY, TINY_OPENS, [1, 2], start_steps=1, restart_s=2.0, others=[off(), BOTH]
    )
    assert list(bounds.upper) == ["1", "2", "off", "adaptive:1,2"]
    assert bounds.upper[s1] == pytest.approx(tokens)
    # The denominators stay the replay's: static step counts and their oracle.
    assert bounds.best_static_tokens == pytest.approx(12000)
    assert bounds.oracle_tokens == pytest.approx(12000)
    # The set hedges the first epoch: it alone reaches 1.06 of both.
    assert bounds.reaching(1.06, 1.06) == ["adaptive:1,2"]


def test_a_step_count_reaches_the_figures_only_where_its_bound_does() -> None:
    # 1: 12100 / 12000 reaches both; 2: 11250 / 12000 = 0.9375 neither.
    assert _tiny().reaching(0.995, 0.99) == ["1"]
    assert _tiny().reaching(0.9, 0.9) == ["1", "2"]


def test_no_window_inside_the_trace_is_an_error() -> None:
    with pytest.raises(ValueError, match="no window opens"):
        firstepoch.upper_bound(TINY_TRACE, TINY, [(50.0, 52.0)], [1, 2], start_steps=1)


@pytest.fixture(scope="module")
def weekly(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A day and a half of the weekly trace: past the first epoch (Monday 04:00 to Tuesday
    03:00) and the next window. A replay is causal (what it decides by t reads the trace up
    to t), so the first epoch's bet is the one a longer trace gives."""
    return traces.write("weekly", tmp_path_factory.mktemp("traces") / "weekly.csv", 1.5)


@pytest.mark.parametrize("policy", ["model", bench_replay.STATIC_POLICY])
def test_the_bound_holds_over_specds_own_replay(weekly: Path, policy: str) -> None:
    # The weekly trace on lowcap, whose first epoch specd bets on 6 (the quiet night says
    # light traffic; the weekday is not).
    path = weekly
    truth = next(t for t in bench_replay.TRUTHS if t[0] == "lowcap")
    row = bench_replay.run_one(truth, "weekly", path, policy)
    bounds = bench_coldstart.case(truth, "weekly", path, policy)
    result = row.result
    # The replay's own denominators, to the token.
    assert bounds.static_tokens == pytest.approx(
        {int(k): v for k, v in result["static_tokens"].items()}
    )
    assert bounds.oracle_tokens == pytest.approx(result["oracle_tokens"])
    # Offered what the policy is offered in the replay: lowcap's calibration has no steps-0
    # row (no off) nor rows for 0 and 7 (not SGLang's own set); the default takes the rest.
    sets = ["adaptive:1,3", "adaptive:2,4", "adaptive:3,4", "adaptive:1,2,3"]
    assert list(bounds.upper) == ["1", "2", "3", "4", "5", "6"] + (
        sets if policy == "model" else []
    )
    # What specd ran when the first window (Monday 03:00-04:00) closed, until Tuesday 03:00.
    first_close, next_open = 4 * 3600, 27 * 3600
    timeline = result["setting_timeline"]
    s1 = [name for at, name in timeline if at <= first_close][-1]
    assert all(not first_close < at < next_open for at, _ in timeline)
    assert result["specd_tokens"] <= bounds.upper[s1]
    # Not a bound so loose that it says nothing: specd is within a few percent of it.
    assert result["specd_tokens"] >= 0.95 * bounds.upper[s1]
    assert row.first_epoch == {
        "setting": s1,
        "to_best_static": round(bounds.to_best_static(s1), 4),
        "to_oracle": round(bounds.to_oracle(s1), 4),
    }


def test_the_bands_row_is_given_no_bound(weekly: Path) -> None:
    # The figures, and so the first epoch's bound, are the model policies'.
    path = weekly
    truth = next(t for t in bench_replay.TRUTHS if t[0] == "lowcap")
    assert bench_replay.run_one(truth, "weekly", path, "bands").first_epoch is None


@pytest.mark.parametrize(
    ("timeline", "s1"),
    [
        ([(0.0, "1")], "1"),  # the start K all along
        ([(0.0, "1"), (5.0, "2")], "2"),  # changed in the first window
        ([(0.0, "1"), (7.0, "2")], "2"),  # ...at its close
        ([(0.0, "1"), (5.0, "2"), (12.0, "1")], None),  # changed inside the epoch: no one S1
        ([(0.0, "1"), (5.0, "off")], None),  # off: not offered to this bound's policy
        ([(0.0, "1"), (5.0, "adaptive:1,2")], None),  # nor a set
        ([(0.0, "1"), (20.0, "2")], "1"),  # changed at the next opening: S1 was 1
    ],
)
def test_the_setting_a_replay_bet_the_first_epoch_on(
    timeline: list[tuple[float, str]], s1: str | None
) -> None:
    assert firstepoch.first_epoch_setting(timeline, _tiny()) == s1


def test_a_set_the_policy_was_offered_is_the_bet() -> None:
    bounds = firstepoch.upper_bound(
        TINY_TRACE, TINY, TINY_OPENS, [1, 2], start_steps=1, restart_s=2.0, others=[off(), BOTH]
    )
    # As the replay's JSON has it: [seconds, operator form].
    assert firstepoch.first_epoch_setting([[0.0, "1"], [5.0, "adaptive:1,2"]], bounds) == (
        "adaptive:1,2"
    )
    assert firstepoch.first_epoch_setting([[0.0, "1"], [6.0, "off"]], bounds) == "off"


@pytest.mark.parametrize(
    ("truth", "policy", "others"),
    [
        # heavyoff's calibration is swept at 0-7: off and every default set, SGLang's too.
        ("heavyoff", "model", ["off", *DEFAULT_ADAPTIVE_SETS]),
        ("heavyoff", bench_replay.STATIC_POLICY, []),
        # seed's at 1-6: no off, no SGLang's own (it needs 0 and 7).
        ("seed (twin)", "model", list(DEFAULT_ADAPTIVE_SETS[1:])),
    ],
)
def test_the_bound_offers_what_the_replay_offers(
    truth: str, policy: str, others: list[str]
) -> None:
    entry = next(t for t in bench_replay.TRUTHS if t[0] == truth)
    config = bench_replay.case_config(entry[2], "weekly", policy)
    got = firstepoch.offered_others(read_table(entry[1]), config)
    assert [format_setting(s) for s in got] == others
