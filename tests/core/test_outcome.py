"""specd.core.outcome: each change verified by what the new step count served since."""

from __future__ import annotations

import functools
import math
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any

import pytest
from factories import make_observation, seed_table, serve, tables
from hypothesis import given, settings
from hypothesis import strategies as st

from specd.core import choices, outcome, setting
from specd.core.adaptive import AdaptiveModel
from specd.core.decide import Control, Pick, Reason, choose, decide
from specd.core.history import History, HistorySettings
from specd.core.model import Calibration, PerformanceModel, adaptive_slots, plan
from specd.core.observation import Observation
from specd.core.outcome import Avoided, ChangeSnapshot, Verdict
from specd.core.override import Override
from specd.core.perftable import PerfRow, PerfTable
from specd.core.settings import Settings
from specd.core.step import StepContext, step

UTC = timezone.utc
MONDAY = datetime(2026, 1, 5, tzinfo=UTC).timestamp()
HOUR = 3600.0
DAY = 86400.0
# The default window opens daily at 03:00 UTC for an hour.
CHANGED = MONDAY + 3 * HOUR + 600  # Monday 03:10: specd changed 3 → 4
NEXT_WINDOW = MONDAY + DAY + 3 * HOUR + 1800  # Tuesday 03:30
SCRAPE_S = 60.0


def config(**kwargs: Any) -> Settings:
    base: dict[str, Any] = {"min_history_s": 600, "stabilization_window_s": 600}
    return Settings.model_validate(tables(**{**base, **kwargs}))


def fresh() -> History:
    return History(HistorySettings(half_life_s=DAY, warmup_exclude_s=0, scrape_interval_s=SCRAPE_S))


def observed(t: float, steps: int, offered: int) -> Observation:
    return make_observation(t, running=offered, steps=steps, max_running_requests=64)


def run(
    history: History, steps: int, start: float, until: float, offered: int, tok_s: float
) -> Observation:
    return serve(history, steps, start, until, offered, tok_s, SCRAPE_S)


def changed(
    new_tok_s: float,
    until: float = NEXT_WINDOW,
    *,
    offered: int = 2,
    old_tok_s: float = 1000.0,
    new_before_tok_s: float | None = None,
) -> tuple[History, ChangeSnapshot, Observation]:
    """3 steps serve ``old_tok_s`` from Monday 00:00; specd changes to 4 at 03:10 and 4
    serves ``new_tok_s`` until ``until``. With ``new_before_tok_s``, 4 also ran (at that
    rate) the Sunday before."""
    history = fresh()
    if new_before_tok_s is not None:
        run(history, 4, MONDAY - 6 * HOUR, MONDAY - 60, offered, new_before_tok_s)
    run(history, 3, MONDAY, CHANGED - 60, offered, old_tok_s)
    # Verified until the window after its epoch closes: Tuesday 04:00.
    snap = outcome.snapshot(history, 3, 4, 0.02, outcome.verification_end(config(), CHANGED))
    assert snap.until == MONDAY + DAY + 4 * HOUR
    # A change made as its window opens is verified until the next one closes, too.
    assert outcome.verification_end(config(), MONDAY + 3 * HOUR) == snap.until
    last = run(history, 4, CHANGED + 100, until, offered, new_tok_s)
    return history, snap, last


# -- the verdict --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("new_tok_s", "until", "regressed", "says"),
    [
        pytest.param(950.0, NEXT_WINDOW, True, "regression", id="5%-less-for-a-day"),
        pytest.param(950.0, CHANGED + 2 * HOUR, True, "regression", id="5%-less-for-2h"),
        pytest.param(997.0, NEXT_WINDOW, False, "no regression beyond noise", id="within-noise"),
        # Beyond the interval (±0.4 % after a day), not beyond regression_min_ratio (2 %).
        pytest.param(985.0, NEXT_WINDOW, False, "no regression beyond noise", id="below-floor"),
        pytest.param(1050.0, NEXT_WINDOW, False, "+5.0%", id="served-more"),
        # Before outcome_min_observed_s (half an hour) nothing counts, however bad it looks.
        pytest.param(900.0, CHANGED + 1800, False, "s needed", id="before-the-minimum-time"),
    ],
)
def test_a_regression_is_a_shortfall_beyond_noise_after_the_minimum_time(
    new_tok_s: float, until: float, regressed: bool, says: str
) -> None:
    history, snap, _ = changed(new_tok_s, until)
    found = outcome.verdict(snap, history, config(), 4)
    assert found is not None
    assert found.regressed is regressed
    assert found.beyond_noise is regressed
    assert says in found.why
    assert (found.from_steps, found.to_steps) == (3, 4)
    assert found.observed_tok_s == pytest.approx(new_tok_s, rel=1e-6)
    assert found.baseline_tok_s == pytest.approx(1000.0, rel=1e-6)
    assert found.margin_tok_s > 0
    assert "predicted +2.0%" in found.why


PREDICTED_THERE = [
    # (id, the prediction kept per load band: (band, ratio 4 / 3, share of the epoch),
    #  regressed, short of the prediction, message part). 4 served 950 tok/s at 2 requests
    # (load band 1) for a day, 3 serves 1000 there.
    ("not-predicted", (), True, None, "regression"),
    ("predicted-more-there", ((1, 1.02, 1.0),), True, True,
     "+2.0% at the traffic seen: -5.0% for its epoch with what it served there"),
    # Made for an epoch mostly of heavier traffic (band 4), where 4 was to serve 10% more:
    # serving 5% less at light traffic leaves it +4.0% for the epoch. No regression.
    ("made-for-heavier-traffic", ((1, 0.95, 0.4), (4, 1.10, 0.6)), False, False,
     "+4.0% for its epoch with what it served there"),
    ("a-small-loss-for-the-epoch", ((1, 1.02, 0.2), (4, 1.0, 0.8)), False, False,
     "as much as predicted for its epoch"),
    ("a-loss-for-the-epoch", ((1, 1.02, 0.5), (4, 1.0, 0.5)), True, True,
     "-2.5% for its epoch"),
    # A state file whose bands share nothing of the epoch (edited by hand) tells nothing.
    ("shares-of-nothing", ((1, 1.02, 0.0), (4, 1.0, 0.0)), True, None, "regression"),
    # No band seen was predicted: the shortfall against the old one decides, as before.
    ("predicted-for-other-bands-only", ((4, 1.02, 0.5), (5, 1.10, 0.5)), True, None,
     "regression"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("predicted", "regressed", "short", "says"),
    [pytest.param(*p[1:], id=p[0]) for p in PREDICTED_THERE],
)
def test_a_regression_is_a_loss_over_the_epoch_it_was_predicted_for(
    predicted: tuple[tuple[int, float, float], ...],
    regressed: bool,
    short: bool | None,
    says: str,
) -> None:
    history, snap, _ = changed(950.0)
    found = outcome.verdict(replace(snap, predicted=predicted), history, config(), 4)
    assert found is not None
    assert (found.regressed, found.beyond_noise) == (regressed, regressed)
    assert found.short_of_prediction is short
    assert says in found.why, found.why
    assert found.changed_at == snap.t
    ratios = {b: r for b, r, _ in predicted}
    if short is not None:
        assert found.predicted_tok_s == pytest.approx(1000.0 * ratios[1], rel=1e-6)
    else:
        assert found.epoch_ratio is None


@pytest.mark.parametrize(
    ("burst_s", "short"),
    [
        # Five seconds of a burst (band 5) are no measure of the busy hours it stands for.
        pytest.param(5.0 * SCRAPE_S, True, id="a-burst-stays-predicted"),
        pytest.param(20.0 * SCRAPE_S, False, id="a-band-seen-long-enough"),
    ],
)
def test_a_band_counts_as_seen_once_observation_outweighs_its_prediction(
    burst_s: float, short: bool
) -> None:
    # 4 served 5% less than 3 at 2 requests for an hour, then ``burst_s`` at 40 requests,
    # where it serves as much as 3 does (3 ran there too). The epoch was mostly bursts.
    history, snap, _ = changed(950.0, CHANGED + 100 + HOUR)
    run(history, 3, MONDAY - 3 * HOUR, MONDAY - 60, 40, 3000.0)
    last = run(history, 4, CHANGED + 200 + HOUR, CHANGED + 200 + HOUR + burst_s, 40, 3000.0)
    snap = replace(snap, predicted=((1, 1.02, 0.2), (5, 0.97, 0.8)))
    found = outcome.verdict(snap, history, config(), 4, None, {2: 0.2, 40: 0.8})
    assert found is not None
    assert last.t == history.last_t
    assert found.short_of_prediction is short, found.why
    # Seen long enough, band 5 counts as served (1.0 × 3's), not as predicted (0.97).
    expected = 0.2 * 0.95 + 0.8 * (0.97 if short else 1.0)
    assert found.epoch_ratio == pytest.approx(expected, abs=2e-3)


_BANDS = st.lists(
    st.tuples(
        st.integers(0, outcome.MAX_PREDICTED_BANDS - 1),
        st.floats(0.0, outcome.MAX_PREDICTED_RATIO),
        st.floats(0.0, 1.0),
    ),
    max_size=6,
    unique_by=lambda entry: entry[0],
)


@settings(max_examples=150, deadline=None)
@given(
    predicted=_BANDS,
    new_tok_s=st.floats(0.0, 1e5),
    gain=st.none() | st.floats(-1.0, 10.0),
)
def test_any_prediction_a_state_file_may_hold_gives_a_sound_verdict(
    predicted: list[tuple[int, float, float]], new_tok_s: float, gain: float | None
) -> None:
    """Whatever bands a state file holds (read back as validated: any band, a ratio up to
    1000, any share), the verdict is a value: the epoch's ratio finite where read, a
    regression only beyond noise, never one against a prediction it met."""
    history, snap, _ = changed(new_tok_s)
    data = outcome.snapshot_to_dict(
        replace(snap, predicted=tuple(sorted(predicted)), predicted_gain_ratio=gain), DAY
    )
    back = outcome.snapshot_from_dict(data, DAY)
    found = outcome.verdict(back, history, config(), 4)
    assert found is not None
    assert found.regressed <= found.beyond_noise
    if found.epoch_ratio is not None:
        assert math.isfinite(found.epoch_ratio)
        assert found.short_of_prediction is (
            1.0 - found.epoch_ratio
            > max(found.margin_tok_s / found.baseline_tok_s, config().choose.regression_min_ratio)
        )
    else:
        assert found.short_of_prediction is None
    if found.short_of_prediction is False:
        assert not found.beyond_noise
    assert "\n" not in found.why


def test_a_prediction_keeps_only_the_bands_its_state_file_holds() -> None:
    # specd accepts up to 100 million queued requests (far past any server); their load
    # bands (24 and up) are not kept, so the snapshot written is one it reads back.
    model = PerformanceModel(Calibration.of(seed_table()))
    bands = outcome.predicted_bands(model, {2: 1.0, 50_000_000: 1.0}, 3, 4)
    assert [b for b, _, _ in bands] == [1]
    _, snap, _ = changed(950.0, CHANGED + HOUR)
    data = outcome.snapshot_to_dict(replace(snap, predicted=bands), DAY)
    assert outcome.snapshot_from_dict(data, DAY).predicted == bands


def test_the_prediction_is_the_models_per_load_band_of_the_forecast() -> None:
    model = PerformanceModel(Calibration.of(seed_table()))
    mix = {1: 2.0, 2: 1.0, 3: 1.0, 5: 1.0, 40: 0.5, 0: 9.0, 7: 0.0}
    bands = {b: (r, share) for b, r, share in outcome.predicted_bands(model, mix, 3, 4)}
    # Bands: 1 → 0; 2 → 1; 3 and 5 → 2; 40 → 5 (idle and weightless entries left out).
    assert set(bands) == {0, 1, 2, 5}
    assert bands[0][0] == pytest.approx(model.throughput(4, 1.0) / model.throughput(3, 1.0))
    both = (model.throughput(4, 3.0) + model.throughput(4, 5.0)) / (
        model.throughput(3, 3.0) + model.throughput(3, 5.0)
    )
    assert bands[2][0] == pytest.approx(both)
    assert bands[0][0] > 1.0 > bands[5][0]  # deeper serves more alone, less under load
    # Each band's share of what 3 was predicted to serve over the epoch.
    old = {c: w * model.throughput(3, float(c)) for c, w in mix.items() if c > 0 and w > 0}
    assert bands[5][1] == pytest.approx(old[40] / sum(old.values()))
    assert sum(share for _, share in bands.values()) == pytest.approx(1.0)
    # A model that predicts neither (no calibration, nothing observed) keeps nothing: the
    # verdict then holds the shortfall against the old one alone.
    assert outcome.predicted_bands(PerformanceModel(None), mix, 3, 4) == ()


@pytest.mark.parametrize(
    ("coming", "regressed"),
    [
        pytest.param({2: 1.0}, True, id="the-same-traffic-comes"),
        pytest.param({0: 3.0, 2: 1.0}, True, id="idle-time-is-no-other-traffic"),
        pytest.param({2: 0.6, 30: 0.4}, True, id="traffic-a-little-heavier"),
        pytest.param({30: 1.0}, False, id="other-traffic-comes"),
    ],
)
def test_a_regression_goes_back_only_for_the_traffic_it_was_seen_under(
    coming: dict[int, float], regressed: bool
) -> None:
    # Light traffic since the change; the next epoch may be the night's batch jobs, for
    # which the policy, not this outcome, decides.
    history, snap, _ = changed(950.0)
    found = outcome.verdict(snap, history, config(), 4, None, coming)
    assert found is not None
    assert found.beyond_noise
    assert found.regressed is regressed
    assert ("other traffic" in found.why) is not regressed


def test_the_minimum_time_and_the_floor_are_config() -> None:
    history, snap, _ = changed(900.0, CHANGED + 1800)
    assert not outcome.verdict(snap, history, config(), 4).regressed  # type: ignore[union-attr]
    shorter = config(outcome_min_observed_s=600)
    assert outcome.verdict(snap, history, shorter, 4).regressed  # type: ignore[union-attr]
    history, snap, _ = changed(985.0)
    found = outcome.verdict(snap, history, config(regression_min_ratio=0.01), 4)
    assert found is not None
    assert found.regressed
    assert found.margin_tok_s < 15.0  # the interval alone would have called it already


def test_what_the_new_step_count_served_before_the_change_does_not_count() -> None:
    # 4 served 2000 tok/s the day before (other prompts): only what it served since counts.
    history, snap, _ = changed(950.0, new_before_tok_s=2000.0)
    seen = outcome.since_change(snap, history)
    assert set(seen) == {2}
    assert seen[2][1] == pytest.approx(950.0, rel=1e-6)
    assert history.throughput(4, 2) > 1000.0  # the history as a whole says 4 is better
    found = outcome.verdict(snap, history, config(), 4)
    assert found is not None
    assert found.regressed


def test_the_old_step_count_is_compared_at_the_concurrencies_seen_since() -> None:
    # 3 was observed at 2 requests; at 8 only the calibration says what it serves.
    history = fresh()
    seed = seed_table()
    run(history, 3, MONDAY, CHANGED - 60, 2, seed.throughput(3, 2))
    snap = outcome.snapshot(history, 3, 4)
    run(history, 4, CHANGED + 100, NEXT_WINDOW, 8, seed.throughput(4, 8) * 0.90)
    found = outcome.verdict(snap, history, config(), 4, Calibration.of(seed))
    assert found is not None
    assert found.mix == ((8, 1.0),)
    # The baseline is 3 at 8 requests (from the model), not what 3 served at 2.
    assert found.baseline_tok_s == pytest.approx(seed.throughput(3, 8), rel=0.02)
    assert found.regressed is (seed.throughput(4, 8) * 0.90 < seed.throughput(3, 8))


def test_the_verification_lapses_when_the_window_after_its_epoch_closes() -> None:
    # A later epoch's traffic is the policy's to judge, not this change's outcome.
    history, snap, last = changed(950.0, MONDAY + DAY + 4 * HOUR + 120)
    assert outcome.verdict(snap, history, config(), 4) is None
    control = Control(None, restart_times=(CHANGED + 100,), verifying=snap)
    result = step(context(history, control), last, last.t)
    assert result.verdict is None
    assert result.decision.reason is not Reason.REGRESSION
    assert result.control.verifying is None


@pytest.mark.parametrize(
    ("snap_of", "current"),
    [
        pytest.param(False, 4, id="no-change-to-verify"),
        pytest.param(True, 3, id="the-change-did-not-take"),  # rolled back: 3 is live
        pytest.param(True, None, id="live-step-count-unknown"),
    ],
)
def test_no_verdict_without_the_new_step_count_live(snap_of: bool, current: int | None) -> None:
    history, snap, _ = changed(900.0)
    assert outcome.verdict(snap if snap_of else None, history, config(), current) is None


# -- the avoid list -----------------------------------------------------------------------
REGRESSED = Avoided(4, NEXT_WINDOW, ((2, 1.0),), 0.05, 3)


@pytest.mark.parametrize(
    ("now", "mix", "avoided"),
    [
        pytest.param(NEXT_WINDOW + DAY, {2: 100.0}, {4}, id="same-traffic"),
        pytest.param(NEXT_WINDOW + DAY, {2: 60.0, 30: 40.0}, {4}, id="traffic-moved-a-little"),
        pytest.param(NEXT_WINDOW + DAY, {}, {4}, id="no-traffic-to-tell-by"),
        pytest.param(NEXT_WINDOW + DAY, {0: 50.0, 2: 50.0}, {4}, id="idle-time-is-no-change"),
        pytest.param(NEXT_WINDOW + DAY, {30: 100.0}, set(), id="traffic-moved-far"),
        pytest.param(NEXT_WINDOW + 7 * DAY - 1, {2: 1.0}, {4}, id="just-inside-the-ttl"),
        pytest.param(NEXT_WINDOW + 7 * DAY, {2: 1.0}, set(), id="ttl-over"),
    ],
)
def test_the_avoid_list_holds_until_its_ttl_or_a_change_of_traffic(
    now: float, mix: dict[int, float], avoided: set[int]
) -> None:
    blocked = outcome.avoided((REGRESSED,), now, config(), mix)
    assert set(blocked) == avoided
    for why in blocked.values():
        assert "served 5.0% less than 3" in why


def test_the_ttl_and_the_lift_are_config() -> None:
    short = config(regression_avoid_s=HOUR, regression_lift_mix_ratio=0.3)
    assert outcome.avoided((REGRESSED,), NEXT_WINDOW + 2 * HOUR, short, {2: 1.0}) == {}
    moved = {2: 60.0, 30: 40.0}  # 0.4 away: lifts at 0.3, not at the default 0.5
    assert outcome.avoided((REGRESSED,), NEXT_WINDOW + 60, short, moved) == {}
    assert set(outcome.avoided((REGRESSED,), NEXT_WINDOW + 60, config(), moved)) == {4}


def test_a_new_regression_of_the_same_step_count_replaces_the_old_and_expired_ones_go() -> None:
    old = Avoided(5, NEXT_WINDOW - 8 * DAY, ((2, 1.0),), 0.1, 3)
    again = replace(REGRESSED, t=NEXT_WINDOW + DAY, shortfall_ratio=0.07)
    kept = outcome.with_avoided((old, REGRESSED), again, NEXT_WINDOW + DAY, config())
    assert kept == (again,)


def test_the_model_policy_skips_an_avoided_step_count() -> None:
    seed = seed_table()
    history = fresh()
    run(history, 3, MONDAY, MONDAY + 3 * HOUR - 120, 2, seed.throughput(3, 2))
    cfg = config()
    free = plan(history, cfg, 3, Calibration.of(seed))
    assert free is not None
    assert free.target == 4  # at 2 requests, 4 beats 3 by ~20 %

    def avoid(mix: Any) -> dict[int, str]:
        assert mix  # the forecast's concurrency mix
        return {4: "4 served 5.0% less than 3", 3: "the live one is never skipped"}

    held = plan(history, cfg, 3, Calibration.of(seed), avoid)
    assert held is not None
    assert 4 not in held.predictions
    assert 3 in held.predictions
    assert held.target != 4
    assert "avoiding 4 served 5.0% less than 3" in held.why


def test_the_bands_policy_keeps_the_live_step_count_over_an_avoided_band() -> None:
    history = fresh()
    run(history, 3, MONDAY, MONDAY + HOUR, 2, 1000.0)
    cfg = config(policy="bands")
    assert choose(history, cfg, 3).steps == 4  # type: ignore[union-attr]
    pick = choose(history, cfg, 3, None, lambda mix: {4: "4 served 5.0% less than 3"})
    assert pick is not None
    assert pick.steps == 3
    assert "avoided: 4 served 5.0% less than 3" in pick.why


# -- deciding on a regression ---------------------------------------------------------------
def verdict_of(regressed: bool) -> Verdict:
    return Verdict(
        3, 4, 7200.0, 950.0, 1000.0, 10.0, True, regressed, "outcome of 3 → 4: ...", ((2, 1.0),)
    )


def pin(steps: int) -> Override:
    return Override(
        "pin", steps, datetime.fromtimestamp(NEXT_WINDOW + DAY, UTC), "eval", "next-window"
    )


FREEZE = Override(
    "freeze", None, datetime.fromtimestamp(NEXT_WINDOW + DAY, UTC), "incident", "next-window"
)


@pytest.mark.parametrize(
    ("now_offset", "regressed", "override", "control", "reason", "target", "pick"),
    [
        pytest.param(0.0, True, None, {}, Reason.REGRESSION, 5, 5, id="to-the-policys-other-pick"),
        pytest.param(0.0, True, None, {}, Reason.REGRESSION, 3, 4, id="goes-back-in-the-window"),
        pytest.param(6 * HOUR, True, None, {}, Reason.WINDOW_CLOSED, 3, 4, id="waits-for-a-window"),
        pytest.param(
            0.0,
            True,
            None,
            {"restart_times": (NEXT_WINDOW - 600,)},
            Reason.DWELL_TIME,
            3,
            4,
            id="dwell",
        ),
        pytest.param(
            0.0,
            True,
            None,
            {"restart_times": tuple(NEXT_WINDOW - 600 * i for i in range(7, 11))},
            Reason.RESTART_BUDGET,
            3,
            4,
            id="budget",
        ),
        pytest.param(0.0, True, pin(5), {}, Reason.OVERRIDE_PIN, 5, 4, id="a-pin-wins"),
        pytest.param(0.0, True, pin(4), {}, Reason.OVERRIDE_PIN, 4, 4, id="a-pin-on-it-wins"),
        pytest.param(0.0, True, FREEZE, {}, Reason.FROZEN, 4, 4, id="a-freeze-wins"),
        pytest.param(
            0.0,
            True,
            None,
            {"frozen": True, "frozen_reason": "restart failed"},
            Reason.FROZEN,
            4,
            4,
            id="frozen-after-a-failure",
        ),
        pytest.param(0.0, False, None, {}, Reason.WITHIN_TOLERANCE, 4, 4, id="no-regression"),
    ],
)
def test_a_regression_goes_back_under_the_usual_rules(
    now_offset: float,
    regressed: bool,
    override: Override | None,
    control: dict[str, Any],
    reason: Reason,
    target: int,
    pick: int,
) -> None:
    now = NEXT_WINDOW + now_offset
    history, _, _ = changed(950.0, now)
    obs = observed(now, 4, 2)
    decision = decide(
        history,
        obs,
        config(),
        override,
        now,
        Control(current_steps=4, **control),
        Pick(pick, f"the policy picks {pick}"),
        0.0,
        verdict=verdict_of(regressed),
    )
    assert decision.reason is reason, decision.message
    assert decision.target_steps == target
    if regressed and target == 3 and reason is not Reason.REGRESSION:
        # Waiting says what waits, and why it would go back.
        assert "outcome of 3 → 4" in decision.message
        assert "going back 4 → 3" in decision.message


# -- step: snapshot at a change, avoid after going back --------------------------------------
def context(history: History, control: Control, **cfg: Any) -> StepContext:
    return StepContext(config(**cfg), history, None, control)


def test_a_change_that_acts_is_snapshotted() -> None:
    history = fresh()
    # 4 ran once before; then 3 at 2 requests, where the bands want 4.
    run(history, 4, MONDAY - 6 * HOUR, MONDAY - 60, 2, 800.0)
    last = run(history, 3, MONDAY, MONDAY + 3 * HOUR + 600, 2, 1000.0)
    held = tuple((last.t - 900 + 5 * i, 4) for i in range(181))
    result = step(context(history, Control(None, recommendations=held)), last, last.t)
    assert result.decision.reason is Reason.CHANGE
    assert result.acts
    snap = result.control.verifying
    assert snap is not None
    assert (snap.from_steps, snap.to_steps, snap.t) == (3, 4, history.last_t)
    assert snap.until == MONDAY + DAY + 4 * HOUR  # the window after its epoch closes
    weight = history.throughput_table()[(4, 2)][1]
    assert snap.cells == ((2, pytest.approx(weight), pytest.approx(weight * 800.0)),)
    # What the new step count served before the change is all in the snapshot.
    assert outcome.since_change(snap, history) == {}


def test_step_goes_back_from_a_regression_and_does_not_repeat_it() -> None:
    history, snap, last = changed(950.0)
    control = Control(None, restart_times=(CHANGED + 100,), verifying=snap)
    result = step(context(history, control), last, last.t)
    assert result.verdict is not None
    assert result.verdict.regressed
    assert result.decision.reason is Reason.REGRESSION
    assert result.decision.target_steps == 3
    assert result.acts
    assert result.control.verifying is None
    (entry,) = result.control.avoided
    assert (entry.steps, entry.from_steps, entry.t) == (4, 3, last.t)
    assert entry.shortfall_ratio == pytest.approx(0.05, rel=1e-3)
    assert entry.mix == ((2, 1.0),)

    # Back at 3 the next day, the bands want 4 again at 2 requests: 4 is avoided.
    later = run(history, 3, last.t + 200, last.t + DAY, 2, 1000.0)
    after = replace(result.control, restart_times=(CHANGED + 100, last.t + 100))
    again = step(context(history, after), later, later.t)
    assert again.pick is not None
    assert again.pick.steps == 3
    assert again.decision.reason is Reason.WITHIN_TOLERANCE
    assert "avoided: 4 served 5.0% less than 3" in again.decision.message
    # Past the avoid list's TTL, 4 may be tried again.
    forgot = step(context(history, after, regression_avoid_s=HOUR), later, later.t)
    assert forgot.pick is not None
    assert forgot.pick.steps == 4
    assert forgot.control.avoided == ()


def test_a_regression_is_remembered_as_soon_as_it_is_found() -> None:
    # Monday 23:00: the window is closed, going back waits; 4 is on the avoid list already
    # (for the traffic it served less under: the policy skips it there, whatever comes).
    history, snap, last = changed(950.0, MONDAY + 23 * HOUR)
    control = Control(None, restart_times=(CHANGED + 100,), verifying=snap)
    result = step(context(history, control), last, last.t)
    assert result.verdict is not None
    assert result.verdict.regressed
    assert result.decision.reason is Reason.WINDOW_CLOSED
    assert result.decision.target_steps == 3
    assert result.control.verifying == snap  # still verified until it goes back
    assert [(e.steps, e.t) for e in result.control.avoided] == [(4, last.t)]


@pytest.mark.parametrize(
    ("predicted", "reason", "says"),
    [
        # The sweep had 4 above 3 at this traffic, all the epoch's; it served 5% less: back
        # in this window.
        pytest.param(((1, 1.02, 1.0),), Reason.REGRESSION, "going back 4 → 3 in the window "
                     "the change was made in", id="contradicts-its-prediction"),
        # Made for heavier traffic, where 4 is to serve 10% more: no regression.
        pytest.param(((1, 0.95, 0.3), (4, 1.10, 0.7)), None,
                     "as much as predicted for its epoch", id="made-for-other-traffic"),
    ],
)  # fmt: skip
def test_a_change_contradicting_its_prediction_goes_back_in_its_own_window(
    predicted: tuple[tuple[int, float, float], ...], reason: Reason | None, says: str
) -> None:
    # Changed 3 → 4 at 03:10; at 03:43 4 has served 5% less than 3 for 1900 s, and the
    # window is open until 04:00: the dwell (an hour) does not hold going back.
    history, snap, last = changed(950.0, CHANGED + 100 + 1900)
    snap = replace(snap, predicted=predicted)
    control = Control(None, restart_times=(CHANGED + 100,), verifying=snap)
    result = step(context(history, control), last, last.t)
    assert result.verdict is not None
    assert says in result.verdict.why + " :: " + result.decision.message
    if reason is None:
        assert not result.verdict.regressed
        assert result.decision.reason is not Reason.REGRESSION
        assert result.control.avoided == ()
        return
    assert result.decision.reason is reason, result.decision.message
    assert result.decision.target_steps == 3
    assert result.acts
    assert [e.steps for e in result.control.avoided] == [4]


def test_a_model_change_keeps_its_prediction_per_load_band() -> None:
    history = fresh()
    # 3 serves far less here than the calibration says 4 does: the model changes to 4.
    last = run(history, 3, MONDAY, MONDAY + 3 * HOUR + 600, 2, 100.0)
    held = tuple((last.t - 900 + 5 * i, 4) for i in range(181))
    cal = Calibration.of(seed_table())
    control = Control(None, recommendations=held)
    cfg = config(policy="model", kinds=["static"], stabilization_window_s=0)
    ctx = StepContext(cfg, history, None, control, cal)
    result = step(ctx, last, last.t)
    assert result.decision.reason is Reason.CHANGE, result.decision.message
    snap = result.control.verifying
    assert snap is not None
    assert result.pick is not None
    assert result.pick.plan is not None
    assert result.pick.plan.model is not None
    assert snap.predicted == outcome.predicted_bands(
        result.pick.plan.model, result.pick.mix, 3, snap.to_steps
    )
    assert 1 in {band for band, _, _ in snap.predicted}  # 2 requests: load band 1


def test_other_changes_are_not_verified() -> None:
    # A pin that acts is the on-call's change, not specd's: nothing to verify.
    history, snap, last = changed(1000.0)
    control = Control(None, restart_times=(CHANGED + 100,), verifying=snap)
    ctx = replace(context(history, control), override=pin(5))
    result = step(ctx, last, last.t)
    assert result.decision.reason is Reason.OVERRIDE_PIN
    assert result.acts
    assert result.control.verifying is None


# -- persistence ----------------------------------------------------------------------------
def test_the_snapshot_and_the_avoid_list_round_trip() -> None:
    _, snap, _ = changed(950.0, CHANGED + HOUR, new_before_tok_s=800.0)
    data = outcome.snapshot_to_dict(snap, DAY)
    back = outcome.snapshot_from_dict(data, DAY)
    assert back.t == snap.t
    assert (back.from_steps, back.to_steps, back.predicted_gain_ratio) == (3, 4, 0.02)
    assert back.until == snap.until
    assert back.cells == tuple((c, pytest.approx(w), pytest.approx(ws)) for c, w, ws in snap.cells)
    assert back.predicted == ()
    assert outcome.avoided_from_dict(0, outcome.avoided_to_dict(REGRESSED)) == REGRESSED
    predicted = ((0, 1.04, 0.25), (1, 1.0, 0.25), (5, 0.5, 0.5))
    data = outcome.snapshot_to_dict(replace(snap, predicted=predicted), DAY)
    assert data["predicted"] == [[0, 1.04, 0.25], [1, 1.0, 0.25], [5, 0.5, 0.5]]
    assert outcome.snapshot_from_dict(data, DAY).predicted == predicted
    del data["predicted"]  # a snapshot an older specd wrote
    assert outcome.snapshot_from_dict(data, DAY).predicted == ()


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (
            {"t": 1.0, "from_steps": 3, "to_steps": 3, "cells": {"ref_t": 1.0, "cells": []}},
            "both 3",
        ),
        (
            {"t": 1.0, "from_steps": 3, "to_steps": 99, "cells": {"ref_t": 1.0, "cells": []}},
            "to_steps",
        ),
        ({"t": "x", "from_steps": 3, "to_steps": 4, "cells": {"ref_t": 1.0, "cells": []}}, "t:"),
        (
            {
                "t": 1.0,
                "from_steps": 3,
                "to_steps": 4,
                "until": "then",
                "cells": {"ref_t": 1.0, "cells": []},
            },
            "until",
        ),
        ({"t": 1.0, "from_steps": 3, "to_steps": 4, "cells": []}, "expected an object"),
        (
            {
                "t": 1.0,
                "from_steps": 3,
                "to_steps": 4,
                "cells": {"ref_t": 1.0, "cells": [[0, 1, 1]]},
            },
            "concurrency",
        ),
        ("3→4", "verifying: expected an object"),
        *(
            (
                {
                    "t": 1.0,
                    "from_steps": 3,
                    "to_steps": 4,
                    "cells": {"ref_t": 1.0, "cells": []},
                    "predicted": predicted,
                },
                problem,
            )
            for predicted, problem in [
                ({"1": [1.0, 1.0]}, "predicted: expected a list"),
                ([[0, 1.0, 0.0]] * 25, "predicted: expected a list of at most 24"),
                ([[1, 1.0, 0.5], [1, 1.1, 0.5]], "predicted[1]: expected [band 0–23, once"),
                ([[-1, 1.0, 1.0]], "predicted[0]"),
                ([[24, 1.0, 1.0]], "predicted[0]"),
                ([[True, 1.0, 1.0]], "predicted[0]"),
                ([[1.0, 1.0, 1.0]], "predicted[0]"),
                ([[1, float("nan"), 1.0]], "predicted[0]"),
                ([[1, -0.5, 1.0]], "predicted[0]"),
                ([[1, 1e4, 1.0]], "predicted[0]"),
                ([[1, "1.0", 1.0]], "predicted[0]"),
                ([[1, 1.0, 1.5]], "predicted[0]"),
                ([[1, 1.0, float("inf")]], "predicted[0]"),
                ([[1, 1.0, False]], "predicted[0]"),
                ([[1, 1.0]], "predicted[0]"),
                ([1.0], "predicted[0]"),
            ]
        ),
    ],
)
def test_a_bad_snapshot_is_a_one_line_value_error(data: Any, problem: str) -> None:
    with pytest.raises(ValueError, match="verifying") as caught:
        outcome.snapshot_from_dict(data, DAY)
    assert problem in str(caught.value)
    assert "\n" not in str(caught.value)


# -- adaptive sets: one setting, however its steps gauge moves ---------------------------------
ADAPTIVE = setting.adaptive((3, 4))
ADAPTIVE_KEY = setting.setting_key(ADAPTIVE)
ADAPTIVE_PATH = "/var/lib/specd/" + setting.adaptive_config_name(ADAPTIVE)
OTHER_PATH = "/var/lib/specd/" + setting.adaptive_config_name(setting.adaptive((2, 5)))


def run_adaptive(
    history: History, start: float, until: float, tok_s: float, tier: int = 4
) -> Observation:
    return serve(history, tier, start, until, 2, tok_s, SCRAPE_S, adaptive_config=ADAPTIVE_PATH)


def changed_to_adaptive(
    new_tok_s: float, until: float = NEXT_WINDOW
) -> tuple[History, ChangeSnapshot, Observation]:
    """3 serves 1000 tok/s from Monday 00:00; specd changes to adaptive {3,4} at 03:10."""
    history = fresh()
    run(history, 3, MONDAY, CHANGED - 60, 2, 1000.0)
    until_t = outcome.verification_end(config(), CHANGED)
    snap = outcome.snapshot(history, 3, ADAPTIVE_KEY, 0.02, until_t, to_setting=ADAPTIVE)
    last = run_adaptive(history, CHANGED + 100, until, new_tok_s)
    return history, snap, last


@pytest.mark.parametrize("swept_ratio", [None, 0.9, 0.8])
def test_an_adaptive_set_is_measured_against_what_its_sweep_predicts(
    swept_ratio: float | None,
) -> None:
    # `specd recommend`'s rows: a set swept below its candidates' rows is predicted so.
    table = seed_table()
    composed = AdaptiveModel.of(adaptive_slots(ADAPTIVE), table)
    rows = [
        PerfRow(4, float(c), composed.throughput(c) * swept_ratio, None, None, "adaptive:3,4")
        for c in (1, 2, 4)
        if swept_ratio is not None
    ]
    history = fresh()
    run_adaptive(history, MONDAY, MONDAY + 2 * HOUR, 900.0)
    performance = PerformanceModel(
        Calibration.of(PerfTable([*table.rows, *rows], source="swept")), history
    )
    (found,) = outcome.measured(history, performance, [ADAPTIVE], 0.02)
    assert (found.setting, found.observed_tok_s) == ("adaptive:3,4", pytest.approx(900.0))
    assert found.predicted_tok_s == pytest.approx(composed.throughput(2) * (swept_ratio or 1.0))


def test_the_history_keys_an_adaptive_set_by_its_config_not_its_tier() -> None:
    history = fresh()
    run_adaptive(history, MONDAY, MONDAY + HOUR, 900.0, tier=3)
    run_adaptive(history, MONDAY + HOUR + 60, MONDAY + 2 * HOUR, 900.0, tier=4)
    cells = history.throughput_table()
    assert set(cells) == {(setting.config_key(ADAPTIVE_PATH), 2)}
    assert setting.config_key(ADAPTIVE_PATH) in setting.observed_keys(ADAPTIVE)
    assert cells[(setting.config_key(ADAPTIVE_PATH), 2)][0] == pytest.approx(900.0)
    # Neither tier is evidence of a static step count (whose capacity would differ).
    assert history.accept_length(3) is None
    assert history.accept_length(4) is None
    back = History.from_dict(history.to_dict())
    ((key, (tok_s, weight)),) = back.throughput_table().items()
    assert key == (setting.config_key(ADAPTIVE_PATH), 2)
    assert (tok_s, weight) == pytest.approx(cells[key])


@pytest.mark.parametrize(
    ("new_tok_s", "until", "regressed", "says"),
    [
        pytest.param(950.0, NEXT_WINDOW, True, "regression", id="5%-less-for-a-day"),
        pytest.param(997.0, NEXT_WINDOW, False, "no regression beyond noise", id="within-noise"),
        pytest.param(1050.0, NEXT_WINDOW, False, "+5.0%", id="served-more"),
        pytest.param(900.0, CHANGED + 1800, False, "s needed", id="before-the-minimum-time"),
    ],
)
def test_an_adaptive_set_is_verified_as_a_step_count_is(
    new_tok_s: float, until: float, regressed: bool, says: str
) -> None:
    history, snap, _ = changed_to_adaptive(new_tok_s, until)
    found = outcome.verdict(snap, history, config(), None, live_config=ADAPTIVE_PATH)
    assert found is not None
    assert found.regressed is regressed
    assert says in found.why
    assert "outcome of 3 → adaptive:3,4" in found.why
    assert (found.from_steps, found.to_steps, found.to_setting) == (3, ADAPTIVE_KEY, ADAPTIVE)
    assert found.observed_tok_s == pytest.approx(new_tok_s, rel=1e-6)
    assert found.baseline_tok_s == pytest.approx(1000.0, rel=1e-6)


@pytest.mark.parametrize(
    ("current", "live_config"),
    [
        pytest.param(3, None, id="static-3-is-live"),
        pytest.param(None, OTHER_PATH, id="another-adaptive-set-is-live"),
        pytest.param(None, None, id="adaptive-without-a-config"),
    ],
)
def test_an_adaptive_set_not_live_is_not_verified(
    current: int | None, live_config: str | None
) -> None:
    history, snap, _ = changed_to_adaptive(950.0)
    assert outcome.verdict(snap, history, config(), current, live_config=live_config) is None


def test_leaving_an_adaptive_set_compares_with_what_it_served() -> None:
    history = fresh()
    run_adaptive(history, MONDAY, CHANGED - 60, 1000.0)
    snap = outcome.snapshot(
        history, ADAPTIVE_KEY, 3, None, NEXT_WINDOW + HOUR, from_setting=ADAPTIVE
    )
    run(history, 3, CHANGED + 100, NEXT_WINDOW, 2, 950.0)
    found = outcome.verdict(snap, history, config(), 3)
    assert found is not None
    assert found.regressed
    assert found.baseline_tok_s == pytest.approx(1000.0, rel=1e-6)
    assert "outcome of adaptive:3,4 → 3" in found.why
    entry = outcome.avoid_entry(found, NEXT_WINDOW)
    assert (entry.steps, entry.from_steps, entry.from_setting) == (3, ADAPTIVE_KEY, ADAPTIVE)
    why = outcome.avoided([entry], NEXT_WINDOW, config(), {2: 1.0})
    assert why == {3: "3 served 5.0% less than adaptive:3,4 (went back 2026-01-06T03:30:00+00:00)"}


@pytest.mark.parametrize(
    ("pick", "now_offset", "reason", "target", "chosen"),
    [
        pytest.param(Pick(3, "3"), 0.0, Reason.REGRESSION, 3, None, id="to-the-policy-pick"),
        pytest.param(Pick(2, "2"), 0.0, Reason.REGRESSION, 2, None, id="to-another-pick"),
        pytest.param(
            Pick(4, "the set", setting=ADAPTIVE),
            0.0,
            Reason.REGRESSION,
            3,
            None,
            id="the-pick-is-the-set-itself",
        ),
        pytest.param(Pick(3, "3"), -4.5 * HOUR, Reason.WINDOW_CLOSED, 3, None, id="window-closed"),
    ],
)
def test_a_regressed_adaptive_set_goes_back_at_the_next_window(
    pick: Pick, now_offset: float, reason: Reason, target: int, chosen: Any
) -> None:
    now = NEXT_WINDOW + now_offset
    history, snap, _ = changed_to_adaptive(950.0, now)
    found = outcome.verdict(snap, history, config(), None, live_config=ADAPTIVE_PATH)
    assert found is not None
    assert found.regressed
    obs = make_observation(now, running=2, steps=4, adaptive=True, adaptive_config=ADAPTIVE_PATH)
    control = Control(current_steps=None, live_adaptive=True, live_adaptive_config=ADAPTIVE_PATH)
    decision = decide(history, obs, config(), None, now, control, pick, 0.0, verdict=found)
    assert decision.reason is reason, decision.message
    assert (decision.target_steps, decision.setting) == (target, chosen)
    assert f"going back adaptive:3,4 → {target}" in decision.message
    assert decision.acts(None, live_adaptive=True, live_config=ADAPTIVE_PATH) is (
        reason is Reason.REGRESSION
    )


def test_an_avoided_adaptive_set_is_skipped_by_the_policy() -> None:
    history = fresh()
    run(history, 3, MONDAY, NEXT_WINDOW, 2, 1000.0)
    cal = Calibration.of(seed_table())
    cfg = config(kinds=["static", "adaptive"], adaptive_candidate_sets=["adaptive:3,4"])
    traits = setting.traits_from_server_info(
        {"speculative_algorithm": "EAGLE3", "speculative_eagle_topk": 1, "version": "0.5.14"}
    )
    offer = choices.offer(cfg.choose, traits)
    assert ADAPTIVE in offer.settings
    entry = Avoided(ADAPTIVE_KEY, NEXT_WINDOW, ((2, 1.0),), 0.05, 3, ADAPTIVE)
    avoid = functools.partial(outcome.avoided, [entry], NEXT_WINDOW, cfg)
    with_set = plan(history, cfg, 3, cal, offer=offer)
    without = plan(history, cfg, 3, cal, avoid, offer=offer)
    assert with_set is not None
    assert without is not None
    assert ADAPTIVE_KEY in with_set.predictions
    assert ADAPTIVE_KEY not in without.predictions
    assert "avoiding adaptive:3,4 served 5.0% less than 3" in without.why


def test_an_avoided_off_is_skipped_by_the_policy() -> None:
    """Off's key is 0, outside min_steps..max_steps: the avoid list dropped it as a step
    count out of range, so an off that had regressed was chosen again the next day (a
    replay with kinds off flapped 3, off, 3, off all week, each change taken back)."""
    history = fresh()
    # Heavy traffic: off serves more than every step count (the seed's capacity).
    run(history, 3, MONDAY, NEXT_WINDOW, 100, 1000.0)
    cal = Calibration.of(seed_table())
    cfg = config(kinds=["off", "static"])
    traits = setting.traits_from_server_info(
        {"speculative_algorithm": "EAGLE3", "speculative_eagle_topk": 1, "version": "0.5.14"}
    )
    offer = choices.offer(cfg.choose, traits, frozenset(cal.table.steps()))
    assert setting.off() in offer.settings
    entry = Avoided(0, NEXT_WINDOW, ((100, 1.0),), 0.05, 3, setting.off())
    avoid = functools.partial(outcome.avoided, [entry], NEXT_WINDOW, cfg)
    free = plan(history, cfg, 3, cal, offer=offer)
    held = plan(history, cfg, 3, cal, avoid, offer=offer)
    assert free is not None
    assert held is not None
    assert (free.best, 0 in free.predictions) == (0, True)
    assert 0 not in held.predictions
    assert held.best != 0
    assert "avoiding off served 5.0% less than 3" in held.why


def test_an_adaptive_snapshot_and_avoid_entry_round_trip() -> None:
    _, snap, _ = changed_to_adaptive(950.0, CHANGED + HOUR)
    data = outcome.snapshot_to_dict(snap, DAY)
    assert data["to_setting"] == "adaptive:3,4"
    back = outcome.snapshot_from_dict(data, DAY)
    assert (back.to_steps, back.to_setting, back.from_setting) == (ADAPTIVE_KEY, ADAPTIVE, None)
    entry = Avoided(ADAPTIVE_KEY, NEXT_WINDOW, ((2, 1.0),), 0.05, 3, ADAPTIVE)
    assert outcome.avoided_from_dict(0, outcome.avoided_to_dict(entry)) == entry


@pytest.mark.parametrize(
    ("to_setting", "problem"),
    [
        pytest.param(None, "missing", id="a-set-key-without-its-set"),
        pytest.param("adaptive:2,5", "is not the adaptive set of key", id="another-set"),
        pytest.param("4", "is not the adaptive set of key", id="a-step-count"),
        pytest.param(7, "expected an adaptive setting", id="not-text"),
    ],
)
def test_a_bad_adaptive_snapshot_is_a_one_line_value_error(to_setting: Any, problem: str) -> None:
    data = {
        "t": 1.0,
        "from_steps": 3,
        "to_steps": ADAPTIVE_KEY,
        "to_setting": to_setting,
        "cells": {"ref_t": 1.0, "cells": []},
    }
    with pytest.raises(ValueError, match="verifying") as caught:
        outcome.snapshot_from_dict(data, DAY)
    assert problem in str(caught.value)
    assert "\n" not in str(caught.value)
